"""The contributors' pre-commit configuration is valid and runs only local tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".pre-commit-config.yaml"


def _pre_commit() -> list[str]:
    exe = Path(sys.executable).with_name("pre-commit")
    return [str(exe)] if exe.exists() else [shutil.which("pre-commit") or "pre-commit"]


def test_pre_commit_validates_the_config():
    out = subprocess.run(
        [*_pre_commit(), "validate-config", str(CONFIG)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_hooks_are_local_and_the_unit_tests_run_on_push_only():
    doc = yaml.safe_load(CONFIG.read_text())
    hooks = {h["id"]: h for repo in doc["repos"] for h in repo["hooks"]}
    assert {repo["repo"] for repo in doc["repos"]} == {"local"}
    assert all(h["language"] == "system" for h in hooks.values())
    assert hooks["mypy"]["entry"] == "mypy" and hooks["mypy"]["pass_filenames"] is False
    assert {"ruff-check", "ruff-format"} <= set(hooks)
    assert hooks["unit-tests"]["stages"] == ["pre-push"]
    assert "tests/unit" in hooks["unit-tests"]["entry"]
