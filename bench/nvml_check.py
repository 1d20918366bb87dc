"""Check the NVML telemetry source on a GPU host: allocate GPU memory and watch ``vram_usage`` follow.

    python -m bench.nvml_check [--gib 40] [--gpu 0] [--out FILE]
    python -m bench.nvml_check --smoke [--out FILE]    # 0.25 GiB; on a host without NVML, says so

Prints the ratio the gateway's collector reads before, during and after the
allocation, next to what NVML's own used/total and torch report.
"""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import CollectorRegistry

from bench.common import add_smoke, emit, out_path, smoke_result
from engines.rollout.settings import EngineTelemetry, SignalSettings
from engines.rollout.telemetry import TelemetryCollector
from observability.metrics import Metrics


async def main_async(gib: float, gpu: int, smoke: bool = False) -> tuple[dict, dict[str, str]]:
    """The readings, and what could not be measured (a smoke run on a host without NVML or CUDA)."""
    collector = TelemetryCollector(
        [("gpu-engine", None, EngineTelemetry(scrape=False, nvml=True, gpus=[str(gpu)]))],
        SignalSettings(scrape_interval_s=1.0),
        Metrics(CollectorRegistry()),
    )
    await collector.start()
    try:

        async def read() -> float | None:
            await collector.collect_once()
            return collector.latest("gpu-engine").get("vram_usage")

        before = await read()
        if before is None:
            if not smoke:
                raise SystemExit("NVML could not be read: no NVIDIA driver on this host?")
            return (
                {"gpu": None, "allocated_gib": 0.0, "vram_usage_before": None},
                {"vram_usage (NVML)": "NVML could not be read: no NVIDIA driver on this host"},
            )
        import pynvml
        import torch

        if not torch.cuda.is_available():
            if not smoke:
                raise SystemExit("torch sees no CUDA device to allocate on")
            return (
                {"gpu": None, "allocated_gib": 0.0, "vram_usage_before": round(before, 4)},
                {"vram_usage_during (allocation)": "torch sees no CUDA device to allocate on"},
            )
        block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=f"cuda:{gpu}")
        block.fill_(1)
        torch.cuda.synchronize()
        during = await read()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(gpu))
        del block
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        after = await read()
    finally:
        await collector.aclose()
    assert during is not None and after is not None
    return {
        "gpu": torch.cuda.get_device_name(gpu),
        "total_gib": round(info.total / 2**30, 2),
        "allocated_gib": gib,
        "vram_usage_before": round(before, 4),
        "vram_usage_during": round(during, 4),
        "vram_usage_after": round(after, 4),
        "expected_rise": round(gib * 2**30 / info.total, 4),
        "nvml_used_over_total_during": round(info.used / info.total, 4),
    }, {}


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.nvml_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gib", type=float, default=40.0)
    p.add_argument("--gpu", type=int, default=0)
    add_smoke(p)
    args = p.parse_args()
    if args.smoke:
        args.gib = 0.25
    result, missing = asyncio.run(main_async(args.gib, args.gpu, args.smoke))
    emit(smoke_result(result, args, missing), out_path(args, "nvml_check"))


if __name__ == "__main__":
    main()
