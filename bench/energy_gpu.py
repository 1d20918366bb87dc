"""Energy per token measured on a GPU: NVML power sampled during token generation, integrated as the gateway does.

    python -m bench.energy_gpu measure --out RAW.json     # on the GPU host (torch, transformers, nvidia-ml-py)
    python -m bench.energy_gpu integrate RAW.json          # anywhere: the gateway's EnergyMeter over the samples
    python -m bench.energy_gpu --smoke [--out FILE]        # anywhere: both, tiny; says what it could not read

``--smoke`` generates with a model of the same architecture but tiny, on the GPU where torch sees
one and on the CPU otherwise, samples NVML where it can be read, then integrates its own samples
(where there are any) and the recorded H200 samples (``bench/energy-gpu-h200-raw.json``, only read).

The load is greedy decoding with a TinyLlama-shaped model (1.1 B parameters, bf16, random
weights: no weights can be fetched on the GPU host; the arithmetic per token is the real shape's),
at a few batch sizes, every answer forced to its full length. A thread reads
``nvmlDeviceGetPowerUsage`` every 50 ms, marking each sample busy while a batch is generating;
idle stretches before, between and after the batches are recorded too, so the integration has
to leave them out as it does for an idle engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from bench.common import ROOT, SMOKE_HELP, emit, out_path, smoke_result

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)  # fmt: skip


#: a smoke run's model: the same architecture, small enough for a CPU
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000)  # fmt: skip


def _nvml():
    """NVML's module and the first GPU's handle, or (None, why) where NVML cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as exc:  # the library or the driver missing: pynvml raises its own errors
        return None, f"NVML could not be read ({exc})"


def measure(
    batches: list[int],
    new_tokens: int,
    prompt_len: int,
    idle_s: float,
    device: str = "cuda",
    shape: dict | None = None,
    require_power: bool = True,
) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pynvml, h = _nvml()
    if pynvml is None and require_power:
        raise SystemExit(h)
    shape = shape or SHAPE
    samples: list[list] = []
    state = {"busy": False, "run": True}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def sampler() -> None:
        while state["run"]:
            samples.append([time.monotonic(), pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, state["busy"]])
            time.sleep(0.05)

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # initialised on the GPU: a CPU init of 1.1 B random weights takes long
        model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    runs = []
    thread = threading.Thread(target=sampler, daemon=True)
    if pynvml is not None:
        thread.start()
    time.sleep(idle_s)
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(100, 30000, (b, prompt_len), device=device)
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
            sync()
            state["busy"] = True
            t0 = time.monotonic()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            sync()
            t1 = time.monotonic()
            state["busy"] = False
            runs.append({"batch": b, "start": t0, "end": t1, "tokens": int((out.shape[1] - prompt_len) * b)})
            time.sleep(idle_s)
    state["run"] = False
    if pynvml is not None:
        thread.join()
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "driver": pynvml.nvmlSystemGetDriverVersion() if pynvml else None,
        "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0 if pynvml else None,
        "torch": torch.__version__,
        "model": {
            "shape": shape,
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": "bfloat16",
            "weights": "random",
        },
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "sample_period_s": 0.05,
        "runs": runs,
        "samples": samples,
    }


def integrate(raw: dict) -> dict:
    """Each run's samples through the gateway's EnergyMeter (busy flags as the controller sets them)."""
    from engines.rollout.energy import EnergyMeter, trapezoid_joules

    samples = [(float(t), float(w), bool(b)) for t, w, b in raw["samples"]]
    if not samples:
        raise SystemExit("no power samples to integrate")
    out = []
    for run in raw["runs"]:
        # The samples of this run with the idle ones around it, as a controller would see them.
        lo, hi = run["start"] - 1.0, run["end"] + 1.0
        meter = EnergyMeter(window_s=1e9, min_joules=0.0)
        part = [s for s in samples if lo <= s[0] <= hi]
        for t, w, busy in part:
            meter.observe("gpu", t, w, busy)
        joules = meter.window_joules("gpu")
        busy_w = [w for _, w, b in part if b]
        idle_w = [w for _, w, b in part if not b]
        secs = run["end"] - run["start"]
        out.append(
            {
                "batch": run["batch"],
                "tokens": run["tokens"],
                "seconds": round(secs, 3),
                "tokens_per_s": round(run["tokens"] / secs, 1),
                "joules": round(joules, 1),
                "tokens_per_joule": round(meter.tokens_per_joule("gpu", run["tokens"]) or 0.0, 3),
                "mean_busy_w": round(sum(busy_w) / len(busy_w), 1) if busy_w else None,
                "mean_idle_w": round(sum(idle_w) / len(idle_w), 1) if idle_w else None,
                "joules_if_idle_counted": round(trapezoid_joules((t, w, True) for t, w, _ in part), 1),
                "samples": len(part),
            }
        )
    return {"device": raw["device"], "driver": raw["driver"], "runs": out}


def smoke(args: argparse.Namespace) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = measure([1, 2], 8, 16, 0.2, device=device, shape=TINY_SHAPE, require_power=False)
    missing = {}
    if device == "cpu":
        missing["generation on the GPU"] = "torch sees no CUDA device: the tiny model ran on the CPU"
    if not raw["samples"]:
        missing["gpu power (NVML)"] = _nvml()[1] or "no samples"
    recorded = json.loads((ROOT / "bench" / "energy-gpu-h200-raw.json").read_text())
    result = {
        "measure": raw,
        "integrate": integrate(recorded),
        "integrate_measured": integrate(raw) if raw["samples"] else None,
    }
    emit(smoke_result(result, args, missing), out_path(args, "energy_gpu"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.energy_gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--out", type=Path, default=None, help="with --smoke: write the JSON result here")
    sub = p.add_subparsers(dest="cmd")
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True, dest="raw_out")
    m.add_argument("--batches", default="8,64,256")
    m.add_argument("--new-tokens", type=int, default=256)
    m.add_argument("--prompt-len", type=int, default=128)
    m.add_argument("--idle-s", type=float, default=3.0)
    i = sub.add_parser("integrate")
    i.add_argument("raw")
    args = p.parse_args(argv)
    if args.smoke:
        smoke(args)
        return
    if args.cmd is None:
        p.error("a command is required: measure or integrate")
    if args.cmd == "measure":
        raw = measure(
            [int(b) for b in args.batches.split(",")], args.new_tokens, args.prompt_len, args.idle_s
        )
        with open(args.raw_out, "w") as f:
            json.dump(raw, f)
        print(json.dumps({k: v for k, v in raw.items() if k != "samples"}, indent=1))
    else:
        with open(args.raw) as f:
            json.dump(integrate(json.load(f)), sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
