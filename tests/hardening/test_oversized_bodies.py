"""A 100 MB body is refused with 413 quickly and without buffering it; slow clients are cut off."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench.common import free_port

pytestmark = pytest.mark.timeout(120)

MB = 1024 * 1024


def _hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def gateway_proc(tmp_path_factory):
    port = free_port()
    cfg = tmp_path_factory.mktemp("gw") / "gw.yaml"
    # No engine needs to answer: these requests never get past the transport.
    cfg.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {
                        "name": "e",
                        "kind": "vllm",
                        "base_url": "http://127.0.0.1:9/v1",
                        "model": "m",
                        "serves": ["m"],
                    }
                ],
                "logging": {"level": "warning"},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield proc, port
    proc.terminate()
    proc.wait(15)


def _send(port: int, head: bytes, body_iter, read_timeout: float = 10) -> tuple[bytes, float]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head)
        try:
            for piece in body_iter:
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway refused and closed: expected once it has answered
        reply = b""
        try:
            while b"\r\n\r\n" not in reply or b'"code"' not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except (TimeoutError, ConnectionResetError):
            pass
    return reply, time.monotonic() - t0


def test_declared_100mb_body_is_refused_from_its_headers(gateway_proc, figures):
    proc, port = gateway_proc
    before = _hwm_kib(proc.pid)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (100 * MB)
    )
    reply, took = _send(port, head, iter([b"{" + b" " * MB]))
    figures(
        status=int(reply[9:12] or 0),
        refused_after_s=took,
        peak_rss_growth_mib=(_hwm_kib(proc.pid) - before) / 1024,
    )
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"payload_too_large"' in reply
    assert took < 5  # generous bound against a hang; the figure is in the suite's recorded figures
    assert _hwm_kib(proc.pid) - before < 20 * 1024


def test_chunked_100mb_body_is_cut_at_the_limit(gateway_proc, figures):
    proc, port = gateway_proc
    before = _hwm_kib(proc.pid)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"%x\r\n" % MB + b" " * MB + b"\r\n"
    reply, took = _send(port, head, (piece for _ in range(100)))
    figures(
        status=int(reply[9:12] or 0),
        refused_after_s=took,
        peak_rss_growth_mib=(_hwm_kib(proc.pid) - before) / 1024,
    )
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # Only up to the 16 MiB limit is ever held, once.
    assert _hwm_kib(proc.pid) - before < 20 * 1024


def test_a_trickled_body_times_out_with_408(tmp_path, figures):
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": {"body_timeout_s": 1.0},
                "engines": [
                    {
                        "name": "e",
                        "kind": "vllm",
                        "base_url": "http://127.0.0.1:9/v1",
                        "model": "m",
                        "serves": ["m"],
                    }
                ],
                "logging": {"level": "warning"},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )

        # One byte every 0.4 s, until the gateway answers (it must, after body_timeout_s).
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            answered = None
            for _ in range(10):
                readable, _, _ = select.select([sock], [], [], 0.4)
                if readable:
                    answered = time.monotonic() - t0
                    break
                sock.sendall(b" ")
            reply = b""
            while answered is not None and b'"code"' not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        figures(status=int(reply[9:12] or 0), body_timeout_s=1.0, answered_after_s=answered)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b'"request_timeout"' in reply
    finally:
        proc.terminate()
        proc.wait(15)
