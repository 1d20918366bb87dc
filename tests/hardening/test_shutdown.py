"""SIGTERM with open streams: readiness fails at once, streams end cleanly, the process exits in time."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
import yaml

from bench.common import free_port
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

STREAMS = 16


async def _open_stream(session: aiohttp.ClientSession, url: str, first: asyncio.Queue) -> list[bytes]:
    frames: list[bytes] = []
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                if not frames:
                    first.put_nowait(True)
                frames.append(line[6:].strip())
    return frames


async def _scenario(tmp_path, upstream_script: Script, drain_delay: float, grace: float) -> dict:
    async with ScriptedUpstream(upstream_script) as up:
        port = free_port()
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "server": {"drain_delay_s": drain_delay, "graceful_shutdown_s": grace},
                    # Every stream on the engine at once (its default cap, 8, would queue half of them).
                    "engines": [
                        {
                            "name": "e",
                            "kind": "vllm",
                            "base_url": up.base_url,
                            "model": "scripted",
                            "serves": ["m"],
                            "max_in_flight": STREAMS,
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
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                for _ in range(300):
                    try:
                        async with s.get(base + "/readyz") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)
                first: asyncio.Queue = asyncio.Queue()
                tasks = [
                    asyncio.create_task(_open_stream(s, base + "/v1/chat/completions", first))
                    for _ in range(STREAMS)
                ]
                for _ in range(STREAMS):
                    await asyncio.wait_for(first.get(), 20)
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                # Readiness must turn 503 at once: poll it until it does (at most 1 s).
                ready_status, ready_body, ready_after = 200, {}, None
                while time.monotonic() - t0 < 1.0:
                    async with s.get(base + "/readyz") as r:
                        ready_status, ready_body = r.status, await r.json()
                    if ready_status == 503:
                        ready_after = time.monotonic() - t0
                        break
                    await asyncio.sleep(0.005)
                results = await asyncio.gather(*tasks, return_exceptions=True)
                streams_done = time.monotonic() - t0
            rc = await asyncio.to_thread(proc.wait, 30)
            return {
                "ready_status": ready_status,
                "ready_body": ready_body,
                "ready_after_s": ready_after,
                "results": results,
                "rc": rc,
                "streams_done_after_s": streams_done,
                "exit_after_s": time.monotonic() - t0,
            }
        finally:
            if proc.poll() is None:
                proc.kill()


def _figures(out: dict) -> dict:
    frames = [f for f in out["results"] if not isinstance(f, BaseException)]
    return {
        "streams": STREAMS,
        "ended_with_done": sum(1 for f in frames if f and f[-1] == b"[DONE]"),
        "terminal_error_events": sum(1 for f in frames if len(f) > 1 and b'"error"' in f[-2]),
        "ready_503_after_s": out["ready_after_s"],
        "streams_done_after_s": out["streams_done_after_s"],
        "exit_after_s": out["exit_after_s"],
    }


def test_streams_that_finish_within_the_grace_period_complete(tmp_path, figures):
    # 20 chunks, 0.1 s apart: about 2 s, well inside drain (1 s) + grace (5 s).
    out = asyncio.run(_scenario(tmp_path, Script(text=" ".join(["w"] * 20), chunk_delay_s=0.1), 1.0, 5.0))
    figures(drain_delay_s=1.0, grace_s=5.0, **_figures(out))
    assert out["ready_status"] == 503 and out["ready_body"]["status"] == "draining"
    for frames in out["results"]:
        assert not isinstance(frames, BaseException), frames
        assert frames[-1] == b"[DONE]"
        assert not any(b'"error"' in f for f in frames)
    assert out["rc"] in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught once it has stopped


def test_streams_past_the_grace_period_get_a_terminal_event(tmp_path, figures):
    # 100 chunks, 0.2 s apart: 20 s, far past drain (0.5 s) + grace (2 s).
    out = asyncio.run(_scenario(tmp_path, Script(text=" ".join(["w"] * 100), chunk_delay_s=0.2), 0.5, 2.0))
    figures(drain_delay_s=0.5, grace_s=2.0, **_figures(out))
    assert out["ready_status"] == 503
    for frames in out["results"]:
        assert not isinstance(frames, BaseException), frames
        assert frames[-1] == b"[DONE]"
        assert b'"code":"shutting_down"' in frames[-2]
    assert out["rc"] in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught once it has stopped
    assert out["exit_after_s"] < 10
