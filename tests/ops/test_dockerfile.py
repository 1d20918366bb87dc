"""ops/Dockerfile: hadolint's lint, and what it copies and runs checked against the repository."""

from __future__ import annotations

import fnmatch
import re
import shlex

from tests.ops.catalogue import OPS, ROOT
from tests.ops.tools import run, venv_tool

DOCKERFILE = OPS / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_is_clean():
    result = run([venv_tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_copied_sources_exist_and_are_not_ignored():
    ignored = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    sources = []
    for word, rest in _instructions():
        if word == "COPY" and "--from=" not in rest:
            sources.extend(shlex.split(rest)[:-1])
    assert {
        "requirements/lock.txt",
        "pyproject.toml",
        "gateway",
        "engines",
        "policies",
        "observability",
    } <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        for pattern in ignored:
            assert not fnmatch.fnmatch(src, pattern) and not src.startswith(pattern.rstrip("/") + "/"), (
                src,
                pattern,
            )
    # Every top-level package the project installs is copied into the image.
    packages = re.search(r"include = \[(.*?)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    for pkg in re.findall(r'"(\w+)\*"', packages):
        assert pkg in sources, pkg


def test_runs_unprivileged_on_the_port_compose_uses():
    instr = _instructions()
    user = [rest for word, rest in instr if word == "USER"][-1]
    assert not user.startswith(("0", "root"))
    assert [rest for word, rest in instr if word == "EXPOSE"] == ["8080"]
    health = next(rest for word, rest in instr if word == "HEALTHCHECK")
    assert "/healthz" in health
    assert ("ENTRYPOINT", '["omnigate"]') in instr
    # Base image pinned to a patch release.
    assert re.search(r"PYTHON_IMAGE=python:3\.11\.\d+-slim", DOCKERFILE.read_text())
    # The lock file is installed by hash.
    assert "--require-hashes" in DOCKERFILE.read_text()
