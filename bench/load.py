"""Run the Locust load test (bench/locustfile.py) against a gateway this script starts, headless.

    python -m bench.load --against scripted  [--users 8 --seconds 150 --out FILE]
    python -m bench.load --against real-vllm [--users 8 --seconds 150 --out FILE]
    python -m bench.load --smoke [--out FILE]      # scripted, 2 users for 4 s

``scripted``: the gateway in front of the scripted vLLM-Omni upstream (tests/upstream.py) serving
``qwen3-omni-flash``; the whole mix (text, image + text, audio + text, speech out) goes there.
``real-vllm``: the gateway in front of the real vLLM server of tests/realvllm (SmolLM2-135M on the CPU,
text only) serving ``smollm2-chat``, which takes the text requests; the media and speech requests go
to the scripted vLLM-Omni upstream behind the same gateway (``qwen3-omni-flash``), since the small
text model cannot take media. The summary says which model took which kind.

The gateway runs its default policy chain (the NSFW screen and media limits see the image and audio
parts), the routing controller off and admission limits lifted. The Locust process, the gateway and the
engines share the machine; the summary records its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.common import ROOT, add_smoke, emit, free_port, out_path, scripted_upstream, smoke_result, spawn

OMNI_MODEL = "qwen3-omni-flash"
TEXT_MODEL = "smollm2-chat"


def _wait(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never answered 200")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def gateway_config(engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "engines": engines,
        # The load test measures serving, not admission: 8 users never reach the default limits, but a
        # longer mix should not be shed by them either.
        "traffic": {"soft_limit": 1000, "hard_limit": 1000},
        "routing": {"controller": {"enabled": False}},
        "logging": {"level": "warning"},
    }


def omni_engine(port: int) -> dict[str, Any]:
    return {
        "name": "omni-scripted",
        "kind": "vllm-omni",
        "base_url": f"http://127.0.0.1:{port}/v1",
        "model": "scripted",
        "serves": [OMNI_MODEL],
        "variant": "bf16",
    }


@contextmanager
def started(against: str) -> Iterator[tuple[str, str, str]]:
    """A gateway (and its engines) for the run: yields its URL, the text model and the omni model."""
    procs: list[subprocess.Popen] = []
    vllm = None
    try:
        up_port, gw_port = free_port(), free_port()
        procs.append(scripted_upstream(up_port, "omni", None))
        _wait(f"http://127.0.0.1:{up_port}/health")
        engines = [omni_engine(up_port)]
        text_model = OMNI_MODEL
        if against == "real-vllm":
            from tests.realvllm.prepare import prepare
            from tests.realvllm.server import VllmServer

            vllm = VllmServer(prepare()).start()
            engines.append(
                {
                    "name": "real-vllm",
                    "kind": "vllm",
                    "base_url": vllm.base_url,
                    "model": "smollm2",
                    "serves": [TEXT_MODEL],
                    "variant": "bf16",
                    "first_byte_timeout_s": 120,
                    "read_timeout_s": 120,
                    "max_context_tokens": 2048,
                }
            )
            text_model = TEXT_MODEL
        cfg = Path(tempfile.mkdtemp(prefix="omnigate-load-")) / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(engines)))
        serve = ["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(gw_port)]
        procs.append(spawn(serve, cpu=None))
        _wait(f"http://127.0.0.1:{gw_port}/readyz", timeout=180)
        yield f"http://127.0.0.1:{gw_port}", text_model, OMNI_MODEL
    finally:
        for p in reversed(procs):
            _stop(p)
        if vllm is not None:
            vllm.stop()


def locust_command(
    host: str,
    text_model: str,
    omni_model: str,
    users: int,
    seconds: int,
    summary: Path,
    weights: str,
    max_tokens: int,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(ROOT / "bench" / "locustfile.py"),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{seconds}s",
        "--host",
        host,
        "--only-summary",
        "--stop-timeout",
        "30",
        "--text-model",
        text_model,
        "--omni-model",
        omni_model,
        "--weights",
        weights,
        "--max-tokens",
        str(max_tokens),
        "--summary-json",
        str(summary),
        "--loglevel",
        "WARNING",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", choices=("scripted", "real-vllm"), default="scripted")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--seconds", type=int, default=150)
    p.add_argument("--weights", default="text=4,image=2,audio=2,speech=2")
    p.add_argument("--max-tokens", type=int, default=64)
    add_smoke(p)
    args = p.parse_args()
    if args.smoke:
        args.against, args.users, args.seconds = "scripted", 2, 4
    summary = Path(tempfile.mkdtemp(prefix="omnigate-locust-")) / "summary.json"
    with started(args.against) as (host, text_model, omni_model):
        cmd = locust_command(
            host, text_model, omni_model, args.users, args.seconds, summary, args.weights, args.max_tokens
        )
        run = subprocess.run(cmd, cwd=ROOT, env={**os.environ}, timeout=args.seconds + 300)
    result = json.loads(summary.read_text())
    result["against"] = args.against
    result["cpu_cores"] = os.cpu_count()
    result["locust_exit_code"] = run.returncode
    emit(smoke_result(result, args), out_path(args, "load"))


if __name__ == "__main__":
    main()
