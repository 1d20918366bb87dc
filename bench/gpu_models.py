"""The policy models on a GPU against the CPU, batched, to size deployments.

    python bench/gpu_models.py --assets DIR [--out FILE] [--quick]

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
real models'. ``DIR`` holds ``open_nsfw.onnx`` and a BERT WordPiece ``vocab.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch


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


def bench_nsfw(assets: Path, batches: list[int], repeat: int) -> dict:
    import onnx
    import onnxruntime as ort
    from onnx2torch import convert

    path = assets / "open_nsfw.onnx"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in inp.shape]
    out: dict = {"input": inp.name, "input_shape": inp.shape, "cpu_onnxruntime": {}, "cuda_fp32": {}, "cuda_fp16": {}}
    model = convert(onnx.load(str(path))).eval().cuda()
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.uniform(0, 255, size=[b, *shape[1:]]).astype("float32")
        ref = sess.run(None, {inp.name: x})[0]
        out["cpu_onnxruntime"][b] = _time(lambda: sess.run(None, {inp.name: x}), _nothing, repeat)
        xt = torch.from_numpy(x).cuda()
        with torch.inference_mode():
            got = model(xt).float().cpu().numpy()
            out["cuda_fp32"][b] = _time(lambda: model(xt), _cuda_sync, repeat)
            # The converted graph casts internally, so fp16 runs under autocast rather than .half().
            with torch.autocast("cuda", dtype=torch.float16):
                got16 = model(xt).float().cpu().numpy()
                out["cuda_fp16"][b] = _time(lambda: model(xt), _cuda_sync, repeat)
        out.setdefault("max_abs_diff_vs_onnxruntime", {})[b] = {
            "fp32": float(np.abs(got - ref).max()), "fp16": float(np.abs(got16 - ref).max())}
    return out


def _cross_encoder(vocab: Path, hidden: int, layers: int, heads: int, inter: int, where: Path):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=inter, num_labels=3,
                     id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                     label2id={"contradiction": 0, "entailment": 1, "neutral": 2})
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(where)
    tok.save_pretrained(where)
    return where


def bench_nli(assets: Path, batches: list[int], repeat: int, cpu_threads: int) -> dict:
    from sentence_transformers import CrossEncoder

    premise = " ".join(["The quarterly report states that revenue grew by 12 percent in Europe"] * 16)
    hypothesis = "Revenue in Europe grew by twelve percent according to the quarterly report."
    out: dict = {}
    sizes = {"minilm_l12_h384": (384, 12, 12, 1536), "bert_base": (768, 12, 12, 3072)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (h, l, a, i) in sizes.items():
            where = _cross_encoder(assets / "vocab.txt", h, l, a, i, Path(tmp) / name)
            res: dict = {"cpu": {}, "cuda_fp32": {}, "cuda_fp16": {}}
            cpu = CrossEncoder(str(where), device="cpu", max_length=512)
            gpu = CrossEncoder(str(where), device="cuda", max_length=512)
            gpu16 = CrossEncoder(str(where), device="cuda", max_length=512)
            gpu16.model.half()
            torch.set_num_threads(cpu_threads)
            for b in batches:
                pairs = [(premise, hypothesis)] * b
                res["cpu"][b] = _time(lambda: cpu.predict(pairs, batch_size=b), _nothing, max(3, repeat // 4))
                res["cuda_fp32"][b] = _time(lambda: gpu.predict(pairs, batch_size=b), _cuda_sync, repeat)
                res["cuda_fp16"][b] = _time(lambda: gpu16.predict(pairs, batch_size=b), _cuda_sync, repeat)
            res["tokens_per_pair"] = len(cpu.tokenizer(premise, hypothesis, truncation=True, max_length=512)["input_ids"])
            out[name] = res
    return out


def bench_whisper(batches: list[int], repeat: int, steps: int = 48) -> dict:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    # whisper tiny.en's published shape
    cfg = WhisperConfig(vocab_size=51864, num_mel_bins=80, encoder_layers=4, decoder_layers=4,
                        encoder_attention_heads=6, decoder_attention_heads=6, d_model=384,
                        encoder_ffn_dim=1536, decoder_ffn_dim=1536, max_source_positions=1500,
                        max_target_positions=448, decoder_start_token_id=50257)
    torch.manual_seed(0)
    base = WhisperForConditionalGeneration(cfg).eval()

    def decode(model, feats):
        enc = model.model.encoder(input_features=feats).last_hidden_state
        ids = torch.full((feats.shape[0], 1), cfg.decoder_start_token_id, device=feats.device)
        past = None
        for _ in range(steps):
            dec = model.model.decoder(input_ids=ids[:, -1:], encoder_hidden_states=enc, past_key_values=past,
                                      use_cache=True)
            past = dec.past_key_values
            nxt = model.proj_out(dec.last_hidden_state[:, -1]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids

    out: dict = {"decoder_steps": steps, "cpu": {}, "cuda_fp32": {}, "cuda_fp16": {}}
    gpu = WhisperForConditionalGeneration(cfg).eval().cuda()
    gpu.load_state_dict(base.state_dict())
    gpu16 = WhisperForConditionalGeneration(cfg).eval().cuda().half()
    gpu16.load_state_dict({k: v.half() for k, v in base.state_dict().items()})
    for b in batches:
        feats = torch.randn(b, 80, 3000)
        with torch.inference_mode():
            if b <= 8:
                out["cpu"][b] = _time(lambda: decode(base, feats), _nothing, max(2, repeat // 5))
            f = feats.cuda()
            out["cuda_fp32"][b] = _time(lambda: decode(gpu, f), _cuda_sync, repeat)
            f16 = f.half()
            out["cuda_fp16"][b] = _time(lambda: decode(gpu16, f16), _cuda_sync, repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="small batches and few repeats (a smoke run)")
    ap.add_argument("--only", default="nsfw,nli,whisper", help="comma-separated sections to run")
    args = ap.parse_args()
    repeat = 3 if args.quick else 20
    cpu_threads = os.cpu_count() or 1
    torch.set_num_threads(cpu_threads)
    result: dict = {
        "host": f"{platform.machine()}, {cpu_threads} CPU threads, python {platform.python_version()}",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    sections = {
        "nsfw": lambda: bench_nsfw(args.assets, [1, 8] if args.quick else [1, 8, 32, 128], repeat),
        "nli": lambda: bench_nli(args.assets, [1, 8] if args.quick else [1, 8, 32, 128], repeat, cpu_threads),
        "whisper": lambda: bench_whisper([1, 4] if args.quick else [1, 8, 32], repeat),
    }
    for name, fn in sections.items():
        if name not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # one model failing must not lose the others' figures
            result[name] = {"error": traceback.format_exc(limit=5)}
        result[name + "_wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, "done", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
