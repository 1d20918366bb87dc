"""Check the NVML telemetry source on a GPU host: allocate GPU memory and watch ``vram_usage`` follow.

    python -m bench.nvml_check [--gib 40] [--gpu 0]

Prints the ratio the gateway's collector reads before, during and after the
allocation, next to what NVML's own used/total and torch report.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from prometheus_client import CollectorRegistry

from engines.control_settings import EngineTelemetry, SignalSettings
from engines.telemetry import TelemetryCollector
from observability.metrics import Metrics


async def main_async(gib: float, gpu: int) -> dict:
    import pynvml
    import torch

    collector = TelemetryCollector(
        [("gpu-engine", None, EngineTelemetry(scrape=False, nvml=True, gpus=[str(gpu)]))],
        SignalSettings(scrape_interval_s=1.0),
        Metrics(CollectorRegistry()),
    )
    await collector.start()
    try:

        async def read() -> float:
            await collector.collect_once()
            value = collector.latest("gpu-engine").get("vram_usage")
            if value is None:
                raise SystemExit("NVML could not be read: no NVIDIA driver on this host?")
            return value

        before = await read()
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
    return {
        "gpu": torch.cuda.get_device_name(gpu),
        "total_gib": round(info.total / 2**30, 2),
        "allocated_gib": gib,
        "vram_usage_before": round(before, 4),
        "vram_usage_during": round(during, 4),
        "vram_usage_after": round(after, 4),
        "expected_rise": round(gib * 2**30 / info.total, 4),
        "nvml_used_over_total_during": round(info.used / info.total, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.nvml_check", description=__doc__)
    p.add_argument("--gib", type=float, default=40.0)
    p.add_argument("--gpu", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args.gib, args.gpu)), indent=2))


if __name__ == "__main__":
    main()
