"""Issue 25: spool files count against the media budget as they are written, and a start sweeps the
files a killed gateway left.

The attack: bodies whose base64 payloads arrive slowly (or never finish) were decoded into
``/dev/shm`` with nothing counted until the body was complete: 330 MiB held under a 64 MiB budget.
And a kill that takes out every process of a gateway (its resource tracker too) left its files in
``/dev/shm`` for good.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import yaml

from bench.common import free_port
from core import spooled
from core.errors import Overloaded
from gateway.api import body as json_body
from policies.media.sandbox import ByteBudget, MediaRuntime, RequestBudget
from policies.settings import MediaSettings

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024


def _body(payload_bytes: int) -> bytes:
    payload = base64.b64encode(os.urandom(payload_bytes)).decode()
    return orjson.dumps(
        {
            "model": "omni",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": payload, "format": "wav"}}],
                }
            ],
        }
    )


def _own_files() -> set[str]:
    prefix = f"{spooled.PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(spooled.SHM_DIR) if n.startswith(prefix)}


def _request(process: ByteBudget) -> RequestBudget:
    return RequestBudget(process, 64 * MIB, 0.0)


def _feed(reader: json_body.Reader, body: bytes, chunk: int = 64 * 1024) -> int:
    """Feed ``body`` a chunk at a time; how many bytes were fed when the reader refused it."""
    for at in range(0, len(body), chunk):
        reader.feed(body[at : at + chunk])
    return len(body)


def test_a_body_over_the_process_budget_is_refused_while_it_arrives():
    process = ByteBudget(2 * MIB)
    before = _own_files()
    body = _body(6 * MIB)
    reader = json_body.Reader(budget=_request(process))
    fed = 0
    with pytest.raises(Overloaded):
        for at in range(0, len(body), 64 * 1024):
            reader.feed(body[at : at + 64 * 1024])
            fed = at
            assert process.used <= process.limit
    assert fed < len(body) // 2  # refused while arriving, not once complete
    assert process.used == 0  # the refused file gave its bytes back
    assert _own_files() == before  # and is gone


def test_two_bodies_share_the_process_budget_and_a_finished_payload_keeps_its_count_until_released():
    process = ByteBudget(5 * MIB)
    first = json_body.Reader(budget=_request(process))
    _feed(first, _body(3 * MIB))
    doc = first.result()
    media = doc["messages"][0]["content"][0]["input_audio"]["data"]
    assert isinstance(media, spooled.SpooledMedia)
    assert process.used == media.size  # the payload, exactly: reservations beyond it were given back
    second = json_body.Reader(budget=_request(process))
    with pytest.raises(Overloaded):
        _feed(second, _body(3 * MIB))
    media.release()
    assert process.used == 0
    third = json_body.Reader(budget=_request(process))
    _feed(third, _body(3 * MIB))  # room again once the first request's file went
    third.result()["messages"][0]["content"][0]["input_audio"]["data"].release()
    assert process.used == 0


def test_the_request_gives_its_spool_back_when_it_ends_even_while_a_file_lingers():
    """A file may outlive its request for a moment (its audit record reads it); the budget does not wait."""
    process = ByteBudget(8 * MIB)
    budget = _request(process)
    reader = json_body.Reader(budget=budget)
    _feed(reader, _body(3 * MIB))
    media = reader.result()["messages"][0]["content"][0]["input_audio"]["data"]
    assert process.used == media.size
    budget.release()  # the request ended (its holdings closed)
    assert process.used == 0
    media.release()  # the file goes later: nothing given back twice
    assert process.used == 0


def test_a_spooled_part_counted_again_by_a_media_step_is_not_counted_twice():
    process = ByteBudget(5 * MIB)
    budget = _request(process)
    reader = json_body.Reader(budget=budget)
    _feed(reader, _body(3 * MIB))
    media = reader.result()["messages"][0]["content"][0]["input_audio"]["data"]
    asyncio.run(budget.take(media.size, "messages.0.content.0.input_audio.data"))  # as media-fetch counts it
    assert process.used == media.size  # the spool's count covered it
    asyncio.run(budget.take(1 * MIB, "messages.0.content.0.input_audio.data"))  # an output: counted anew
    assert process.used == media.size + MIB
    media.release()  # claimed bytes stay the request's until it ends
    assert process.used == media.size + MIB
    budget.release()
    assert process.used == 0


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """A served gateway whose process may hold 4 MiB of media."""
    up_port, port = free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream", "--port", str(up_port), "--flavour", "omni"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cfg = tmp_path_factory.mktemp("gw") / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {
                        "name": "omni",
                        "kind": "vllm-omni",
                        "base_url": f"http://127.0.0.1:{up_port}/v1",
                        "model": "scripted",
                        "serves": ["omni"],
                        "input_modalities": ["text", "image", "audio", "video"],
                    }
                ],
                "server": {"body_timeout_s": 20.0, "max_body_bytes": 64 * MIB},
                "media": {"max_request_bytes": 4 * MIB, "max_inflight_bytes": 4 * MIB},
                "logging": {"level": "warning"},
                "routing": {"controller": {"enabled": False}},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.2)
    yield {"url": url, "port": port, "pid": proc.pid}
    proc.terminate()
    engine.terminate()
    proc.wait(30)
    engine.wait(10)


def _spool_bytes(pid: int) -> int:
    prefix = f"{spooled.PREFIX}{pid}-"
    total = 0
    for entry in os.scandir(spooled.SHM_DIR):
        if entry.name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):  # released meanwhile
                total += entry.stat().st_blocks * 512
    return total


def test_unfinished_uploads_hold_no_more_spool_than_the_budget_on_a_served_gateway(gw):
    """The attack as the issue ran it: uploads that send most of a large payload and stop."""
    body = _body(3 * MIB)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks: list[socket.socket] = []
    answers: list[bytes] = []
    try:
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", gw["port"]), timeout=10)
            socks.append(s)
            s.sendall(head + body[: len(body) - 100])  # all but the end of its payload
        time.sleep(1.0)
        held = _spool_bytes(gw["pid"])
        assert held <= 4 * MIB + 1 * MIB, f"{held:,} bytes of spool held under a 4 MiB budget"
        for s in socks:
            s.settimeout(0.5)
            try:
                answers.append(s.recv(200))
            except TimeoutError:
                answers.append(b"")
    finally:
        for s in socks:
            s.close()
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503") or a.startswith(b"HTTP/1.1 413")]
    assert refused, answers  # the bodies past the budget were answered while they arrived
    deadline = time.monotonic() + 20
    while _spool_bytes(gw["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _spool_bytes(gw["pid"]) == 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


def test_a_start_sweeps_what_a_killed_gateway_left_and_nothing_a_live_one_holds():
    dead = _dead_pid()
    stale = os.path.join(spooled.SHM_DIR, f"{spooled.PREFIX}{dead}-{os.urandom(12).hex()}")
    held_elsewhere = os.path.join(spooled.SHM_DIR, f"{spooled.PREFIX}{dead}-{os.urandom(12).hex()}")
    not_ours = os.path.join(spooled.SHM_DIR, f"other-{dead}-{os.urandom(4).hex()}")
    for path in (stale, held_elsewhere, not_ours):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    # a gateway in another pid namespace (its pid means nothing here) holds this one open
    holder = os.open(held_elsewhere, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    # a live gateway's own file
    live = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from core import spooled; w = spooled.SpoolWriter(); w.write(b'x' * 10);"
            " print(w.name, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        live_name = live.stdout.readline().strip()
        assert live_name
        asyncio.run(MediaRuntime(MediaSettings()).start())  # the next start sweeps
        assert not os.path.exists(stale)
        assert os.path.exists(held_elsewhere)
        assert os.path.exists(not_ours)
        assert os.path.exists(os.path.join(spooled.SHM_DIR, live_name))
    finally:
        live.kill()
        live.wait(10)
        os.close(holder)
        for path in (stale, held_elsewhere, not_ours):
            if os.path.exists(path):
                os.unlink(path)
