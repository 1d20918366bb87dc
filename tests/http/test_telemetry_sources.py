"""GPU memory from a real Prometheus server (PromQL over DCGM gauges), and NVML where there is none."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import Trio, admin, engines, settings

pytestmark = pytest.mark.timeout(120)

VRAM_QUERY = "DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)"


@pytest.fixture(scope="module")
def trio(bg):
    t = Trio(bg)
    t.reset()
    yield t
    t.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(trio, tmp_path_factory):
    """A Prometheus server scraping the INT4 engine's /metrics every second (Debian's prometheus package)."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError("these tests need Prometheus: apt-get install -y prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    target = trio.int4.base_url.removeprefix("http://").removesuffix("/v1")
    (folder / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "engines", "static_configs": [{"targets": [target]}]}],
            }
        )
    )
    port = _free_port()
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("Prometheus did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def _int4_signals(server: GatewayServer) -> dict:
    status = admin(server.url, "").json()
    return next(e for e in status["engines"] if e["name"] == "omni-int4")["signals"]


def test_vram_from_a_promql_query_against_prometheus(bg, trio, prometheus):
    trio.set(trio.int4, kv_cache_usage_perc=0.2, gpu_fb_used_mib=60000.0, gpu_fb_free_mib=20000.0)
    engine_list = engines(trio)
    tel = engine_list[0].telemetry.model_copy(update={"vram_query": VRAM_QUERY})
    engine_list[0] = engine_list[0].model_copy(update={"telemetry": tel})
    s = settings(engine_list, [])
    s.routing.signals.prometheus_url = prometheus
    server = GatewayServer(bg, s, CollectorRegistry()).start()
    try:
        assert wait_until(lambda: _int4_signals(server).get("vram_usage") == 0.75, timeout=60, interval=0.2)
        assert _int4_signals(server)["kv_cache_usage"] == 0.2
        # A query that Prometheus rejects is a counted read error, not a crash, and the scrape goes on.
        bad = engine_list[0].telemetry.model_copy(update={"vram_query": "sum(("})
        engine_list[0] = engine_list[0].model_copy(update={"telemetry": bad})
    finally:
        server.stop()

    s = settings(engine_list, [])
    s.routing.signals.prometheus_url = prometheus
    registry = CollectorRegistry()
    server = GatewayServer(bg, s, registry).start()
    try:
        assert wait_until(
            lambda: (
                (
                    registry.get_sample_value(
                        "omnigate_telemetry_scrape_errors_total",
                        {"engine": "omni-int4", "source": "prometheus"},
                    )
                    or 0
                )
                >= 2
            ),
            timeout=30,
        )
        assert wait_until(
            lambda: _int4_signals(server).get("vram_usage") == 0.2, timeout=30
        )  # KV-cache fallback
    finally:
        server.stop()


def test_nvml_without_a_gpu_driver_is_a_counted_read_error(bg, trio):
    trio.set(trio.int4, kv_cache_usage_perc=0.3, gpu_fb_used_mib=None, gpu_fb_free_mib=None)
    engine_list = engines(trio)
    tel = engine_list[0].telemetry.model_copy(update={"nvml": True, "gpus": ["0"]})
    engine_list[0] = engine_list[0].model_copy(update={"telemetry": tel})
    registry = CollectorRegistry()
    server = GatewayServer(bg, settings(engine_list, []), registry).start()
    try:
        assert wait_until(
            lambda: (
                (
                    registry.get_sample_value(
                        "omnigate_telemetry_scrape_errors_total", {"engine": "omni-int4", "source": "nvml"}
                    )
                    or 0
                )
                >= 1
            ),
            timeout=30,
        )
        assert wait_until(lambda: _int4_signals(server).get("kv_cache_usage") == 0.3, timeout=30)
    finally:
        server.stop()
