"""Energy per token measured on a GPU: NVML power sampled during token generation, integrated as the gateway does.

    python -m bench.energy_gpu measure --out RAW.json     # on the GPU host (torch, transformers, nvidia-ml-py)
    python -m bench.energy_gpu integrate RAW.json          # anywhere: the gateway's EnergyMeter over the samples

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

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)  # fmt: skip


def measure(batches: list[int], new_tokens: int, prompt_len: int, idle_s: float) -> dict:
    import pynvml
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples: list[list] = []
    state = {"busy": False, "run": True}

    def sampler() -> None:
        while state["run"]:
            samples.append([time.monotonic(), pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, state["busy"]])
            time.sleep(0.05)

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):  # initialised on the GPU: a CPU init of 1.1 B random weights takes long
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    runs = []
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    time.sleep(idle_s)
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(100, 30000, (b, prompt_len), device="cuda")
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
            torch.cuda.synchronize()
            state["busy"] = True
            t0 = time.monotonic()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            torch.cuda.synchronize()
            t1 = time.monotonic()
            state["busy"] = False
            runs.append({"batch": b, "start": t0, "end": t1, "tokens": int((out.shape[1] - prompt_len) * b)})
            time.sleep(idle_s)
    state["run"] = False
    thread.join()
    return {
        "device": torch.cuda.get_device_name(0),
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0,
        "torch": torch.__version__,
        "model": {"shape": SHAPE, "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
                  "weights": "random"},
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "sample_period_s": 0.05,
        "runs": runs,
        "samples": samples,
    }


def integrate(raw: dict) -> dict:
    """Each run's samples through the gateway's EnergyMeter (busy flags as the controller sets them)."""
    from engines.energy import EnergyMeter, trapezoid_joules

    samples = [(float(t), float(w), bool(b)) for t, w, b in raw["samples"]]
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
        out.append({
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
        })
    return {"device": raw["device"], "driver": raw["driver"], "runs": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.energy_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--batches", default="8,64,256")
    m.add_argument("--new-tokens", type=int, default=256)
    m.add_argument("--prompt-len", type=int, default=128)
    m.add_argument("--idle-s", type=float, default=3.0)
    i = sub.add_parser("integrate")
    i.add_argument("raw")
    args = p.parse_args(argv)
    if args.cmd == "measure":
        raw = measure([int(b) for b in args.batches.split(",")], args.new_tokens, args.prompt_len, args.idle_s)
        with open(args.out, "w") as f:
            json.dump(raw, f)
        print(json.dumps({k: v for k, v in raw.items() if k != "samples"}, indent=1))
    else:
        with open(args.raw) as f:
            json.dump(integrate(json.load(f)), sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
