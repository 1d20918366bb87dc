"""Runs the openai-node contract script (tests/node/contract.mjs) from pytest.

The SDK is installed with ``npm ci`` from the committed lock into the suites' cache outside the clone
(tests/cachedir.py; redone when the lock changes), so the suite needs node and npm's registry, nothing global.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests import cachedir

HERE = Path(__file__).resolve().parent
CACHE = cachedir.entry("openai-node", "OMNIGATE_NODE_CACHE")
_FILES = ("package.json", "package-lock.json", "contract.mjs")


def install(cache: Path = CACHE) -> Path:
    lock = (HERE / "package-lock.json").read_bytes()
    stamp = cache / f".installed-{hashlib.sha256(lock).hexdigest()[:16]}"
    if not stamp.exists():
        if cache.exists():
            shutil.rmtree(cache)
        cache.mkdir(parents=True)
        for name in _FILES[:2]:
            shutil.copy2(HERE / name, cache / name)
        subprocess.run(
            ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=cache,
            check=True,
            timeout=600,
        )
        stamp.touch()
    # The script is copied on every run (cheap) so an edit needs no reinstall.
    shutil.copy2(HERE / "contract.mjs", cache / "contract.mjs")
    return cache


def call(
    base_url: str,
    mode: str,
    request: dict[str, Any],
    api_key: str | None = None,
    timeout: float = 240,
    **more: Any,
) -> dict[str, Any]:
    cache = install()
    job: dict[str, Any] = {"base_url": base_url, "mode": mode, **more}
    if api_key is not None:
        job["api_key"] = api_key
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        # In a file, not an argument: one argument is at most 128 KiB on Linux, a request with media more.
        json.dump(request, f)
        f.flush()
        job["request_file"] = f.name
        out = subprocess.run(
            ["node", str(cache / "contract.mjs"), json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"node exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def stream_text(chunks: list[dict[str, Any]]) -> tuple[str, str | None, dict | None]:
    text, finish, usage = [], None, None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            text.append((c.get("delta") or {}).get("content") or "")
            finish = c.get("finish_reason") or finish
    return "".join(text), finish, usage
