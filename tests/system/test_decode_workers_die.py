"""A gateway killed with SIGKILL takes its media decoding workers with it.

The workers are forked by a forkserver, not by the gateway, so no parent-death signal reaches them,
and their pool's queues never see end-of-file (a worker holds both ends); they also hold the
forkserver's "alive" pipe open. Without a watch of their own, a gateway the OOM killer or an operator
SIGKILLs leaves its workers and its forkserver running on the host.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_sigkilled_gateway_leaves_no_decode_worker_or_forkserver(tmp_path):
    port = _port()
    config = {
        "engines": [
            {
                "name": "text-vllm",
                "kind": "vllm",
                "base_url": f"http://127.0.0.1:{_port()}/v1",
                "model": "scripted",
                "serves": ["text-model"],
            }
        ],
        "admin": {"api_key": secrets.token_hex(32)},
        "auth": {"required": False},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        workers: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                live = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                live = False
            # The chain's media steps start the sandbox at boot: a forkserver and its workers.
            workers = {p for p in _descendants(proc.pid) if "policies.media.worker" in _cmdline(p)}
            if live and len(workers) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the gateway did not start"
        assert len(workers) >= 2, "no decoding workers started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        left = sorted(p for p in workers if _alive(p))
        assert not left, (
            f"still running after the gateway was killed: {[(p, _cmdline(p)[:80]) for p in left]}"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _descendants(proc.pid) if proc.poll() is None else ():
            os.kill(p, signal.SIGKILL)
