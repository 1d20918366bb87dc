"""The Locust load test (bench/locustfile.py), briefly and headless, through a gateway before the real vLLM.

What this run exercises: the text requests of the mix go to the real vLLM server (SmolLM2-135M on the CPU,
public model ``smollm2-chat``); the image + text, audio + text and speech-out requests go to the scripted
vLLM-Omni upstream behind the same gateway (``qwen3-omni-flash``), since the small text model cannot take
media. It asserts the run completed without a failure and wrote its summary; the figures belong in
bench/RESULTS.md and are never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer
from tests.realvllm.conftest import ENGINE, MODEL
from tests.upstream import Script, ScriptedUpstream

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
OMNI_MODEL = "qwen3-omni-flash"
OMNI_ENGINE = "omni-scripted"


@pytest.fixture(scope="module")
def omni(bg) -> ScriptedUpstream:
    up = ScriptedUpstream(Script(flavour="omni"))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture(scope="module")
def mixed_gateway(bg, vllm, omni) -> GatewayServer:
    settings = Settings(
        engines=[
            EngineConfig(name=ENGINE, kind="vllm", base_url=vllm.base_url, model="smollm2", variant="bf16",
                         serves=[MODEL], first_byte_timeout_s=120, read_timeout_s=120,
                         max_context_tokens=2048),
            EngineConfig(name=OMNI_ENGINE, kind="vllm-omni", base_url=omni.base_url, model="scripted",
                         variant="bf16", serves=[OMNI_MODEL]),
        ],
        policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
    )  # fmt: skip
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()


def test_a_short_headless_locust_run_completes_without_failures(mixed_gateway, tmp_path):
    summary_path = tmp_path / "summary.json"
    run = subprocess.run(
        [
            sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"), "--headless",
            "-u", "2", "-r", "2", "-t", "20s", "--stop-timeout", "60", "--host", mixed_gateway.url,
            "--only-summary", "--loglevel", "WARNING",
            "--text-model", MODEL, "--omni-model", OMNI_MODEL, "--weights", "text=2,image=1,audio=1,speech=1",
            "--max-tokens", "16", "--summary-json", str(summary_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # Locust exits 1 when any request failed.
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["failures"] == 0 and summary["failures_total"] == 0, summary
    assert summary["requests"] > 0
    kinds = summary["by_kind"]
    for kind in ("text", "image", "audio", "speech"):
        assert kinds[kind]["requests"] > 0, (kind, summary)
        # Every successful request recorded its time to first token, and only those.
        assert kinds[kind]["ttft_ms"]["n"] == kinds[kind]["requests"], (kind, summary)
    assert summary["first_audio_ms"]["n"] == kinds["speech"]["requests"]
    assert summary["models"] == {"text": MODEL, "omni": OMNI_MODEL}
    assert set(summary["against_targets"]) == {"req_per_s", "ttft_p99_ms", "engine_ttft_p99_ms",
                                               "first_audio_p99_ms"}  # fmt: skip
    assert summary["engine_ttft_p99_ms"] is not None  # read off the gateway's own /metrics
    # The custom entries are in Locust's own report too.
    assert "TTFT" in run.stdout + run.stderr and "first-audio" in run.stdout + run.stderr

    # The text part really went to the real vLLM, the media and speech parts to the scripted vLLM-Omni.
    registry = mixed_gateway.registry
    served = {
        engine: registry.get_sample_value(
            "omnigate_engine_time_to_first_token_seconds_count", {"engine": engine, "variant": "bf16"}
        )
        for engine in (ENGINE, OMNI_ENGINE)
    }
    assert served[ENGINE] == kinds["text"]["requests"], served
    assert served[OMNI_ENGINE] == sum(kinds[k]["requests"] for k in ("image", "audio", "speech")), served
