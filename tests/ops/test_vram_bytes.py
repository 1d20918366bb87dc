"""The absolute GPU memory gauge the peak-VRAM alert reads: bytes from a DCGM exporter, beside the ratio."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.settings import EngineTelemetry, SignalSettings
from engines.rollout.telemetry import TelemetryCollector, parse_dcgm_used_bytes
from observability.metrics import Metrics
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20

DCGM_TWO_GPUS = """\
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a"} 70000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b"} 68000
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a"} 65000
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b"} 67000
"""


def test_dcgm_framebuffer_mib_become_bytes_summed_over_the_engines_gpus():
    assert parse_dcgm_used_bytes(DCGM_TWO_GPUS) == (70000 + 68000) * MIB
    assert parse_dcgm_used_bytes(DCGM_TWO_GPUS, ["1"]) == 68000 * MIB
    assert parse_dcgm_used_bytes(DCGM_TWO_GPUS, ["GPU-a"]) == 70000 * MIB
    # No framebuffer series for the selected GPUs: no reading, not zero.
    assert parse_dcgm_used_bytes(DCGM_TWO_GPUS, ["7"]) is None
    vllm_only = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    assert parse_dcgm_used_bytes(vllm_only) is None


async def _until(probe, want, timeout: float = 10.0):
    """Poll ``probe()`` until it returns ``want`` (the collector scrapes every 50 ms); its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    got = probe()
    while got != want and loop.time() < deadline:
        await asyncio.sleep(0.02)
        got = probe()
    return got


async def test_the_collector_exports_used_bytes_per_engine_and_variant_and_removes_a_stale_reading():
    async with ScriptedUpstream(Script(flavour="omni")) as up:
        up.gpu_fb_used_mib, up.gpu_fb_free_mib = 120_000.0, 16_000.0
        dcgm = up.base_url.removesuffix("/v1") + "/metrics"
        metrics = Metrics(CollectorRegistry())
        leading = {"now": True}
        collector = TelemetryCollector(
            [("omni-bf16", None, EngineTelemetry(dcgm_url=dcgm))],
            SignalSettings(scrape_interval_s=0.05, scrape_timeout_s=2),
            metrics,
            active=lambda: leading["now"],
            variants={"omni-bf16": "bf16"},
        )
        labels = {"engine": "omni-bf16", "variant": "bf16"}

        def used() -> float | None:
            return metrics.registry.get_sample_value("omnigate_engine_vram_used_bytes", labels)

        await collector.start()
        try:
            assert await _until(used, 120_000 * MIB) == 120_000 * MIB
            assert collector.latest("omni-bf16")["vram_used_bytes"] == 120_000 * MIB
            # The ratio is still there beside it.
            ratio = metrics.registry.get_sample_value(
                "omnigate_engine_vram_usage_ratio", {"engine": "omni-bf16"}
            )
            assert ratio == pytest.approx(120_000 / 136_000)

            # The exporter stops sending the framebuffer gauges: the byte reading goes, not stays put.
            up.gpu_fb_used_mib = up.gpu_fb_free_mib = None
            assert await _until(used, None) is None

            # It comes back; then this replica stops leading and exports nothing.
            up.gpu_fb_used_mib, up.gpu_fb_free_mib = 100_000.0, 36_000.0
            assert await _until(used, 100_000 * MIB) == 100_000 * MIB
            leading["now"] = False
            assert await _until(used, None) is None
        finally:
            await collector.aclose()
