"""vLLM-Omni's health and metrics as the gateway reads them, against the scripted upstream over real sockets."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from engines.adapters.vllm_omni import VLLMOmniEngine
from engines.rollout.settings import EngineTelemetry, SignalSettings
from engines.rollout.telemetry import TelemetryCollector, parse_vllm
from observability.metrics import Metrics
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def up():
    async with ScriptedUpstream(Script(flavour="omni")) as server:
        yield server


@pytest.fixture
async def engine(up):
    e = VLLMOmniEngine(EngineConfig(name="omni", kind="vllm-omni", base_url=up.base_url, model="q",
                                    serves=["omni"], connect_timeout_s=1))  # fmt: skip
    await e.start()
    yield e
    await e.aclose()


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False), (500, False), (404, True)])
async def test_health_is_health_and_models_only_stands_in_for_a_missing_route(up, engine, status, healthy):
    # A dead vLLM-Omni answers /health with 503 while /v1/models still says 200.
    up.health_status = status
    assert await engine.health() is healthy


async def test_per_stage_series_are_never_summed_across_stages(up):
    up.num_requests_running = 3.0
    up.stage_metrics = {  # stage ids as vLLM-Omni labels them: thinker, talker, code2wav
        "0": {"running": 3, "waiting": 1, "kv": 0.4, "ttft": [0.07] * 99 + [0.3]},
        "1": {"running": 3, "waiting": 5, "kv": 0.7, "ttft": [4.0] * 100},
        "2": {"running": 3, "waiting": 0, "kv": 0.1},
    }
    collector = TelemetryCollector(
        [("omni", up.base_url.removesuffix("/v1") + "/metrics", EngineTelemetry())],
        SignalSettings(scrape_interval_s=60), Metrics(CollectorRegistry()),
    )  # fmt: skip
    await collector.start()  # its loop reads once now (a second read would see no new observations)
    try:
        for _ in range(500):
            if got := collector.latest("omni"):
                break
            await asyncio.sleep(0.01)
    finally:
        await collector.aclose()
    assert got["requests_running"] == 3.0  # vllm_omni:num_requests_running, not 3 stages x 3
    assert got["kv_cache_usage"] == 0.7  # the fullest stage
    assert got["engine_ttft_p99"] <= 0.5  # the thinker's first token; the talker's 4 s are not mixed in


def test_stage_selection_without_vllm_omni_series():
    text = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{stage="0",replica="0"} 2.0
vllm:num_requests_waiting{stage="0",replica="1"} 1.0
vllm:num_requests_waiting{stage="1",replica="0"} 9.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{stage="1",replica="0"} 4.0
"""
    r = parse_vllm(text)
    assert r.requests_waiting == 3.0  # the thinker's replicas add up; other stages do not
    assert r.requests_running is None  # no thinker series: unknown, not another stage's count
    assert parse_vllm(text, stage="1").requests_running == 4.0


# A real vLLM-Omni 0.30.0 server labels the per-stage series with stage ids; a build or relabelling that names
# the stages says "thinker". Either way the default (and "thinker" configured) reads the thinker only.
_BY_ID = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{stage="0",replica="0"} 2.0
vllm:num_requests_running{stage="1",replica="0"} 5.0
vllm:num_requests_running{stage="2",replica="0"} 7.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{stage="0",replica="0",le="0.5"} 3.0
vllm:time_to_first_token_seconds_bucket{stage="0",replica="0",le="+Inf"} 3.0
vllm:time_to_first_token_seconds_bucket{stage="1",replica="0",le="0.5"} 0.0
vllm:time_to_first_token_seconds_bucket{stage="1",replica="0",le="+Inf"} 3.0
"""
_BY_NAME = (
    _BY_ID.replace('stage="0"', 'stage="thinker"')
    .replace('stage="1"', 'stage="talker"')
    .replace('stage="2"', 'stage="code2wav"')
)


@pytest.mark.parametrize("text", [_BY_ID, _BY_NAME], ids=["stage-ids", "stage-names"])
@pytest.mark.parametrize("configured", ["0", "thinker", "Thinker"])
def test_thinker_stage_selected_whether_labelled_by_id_or_name(text, configured):
    r = parse_vllm(text, stage=configured)
    assert r.requests_running == 2.0  # the thinker's count, not 2 + 5 + 7
    assert r.ttft_buckets == {0.5: 3.0, float("inf"): 3.0}  # the talker's slow first tokens are not mixed in


def test_other_stages_by_id_or_name():
    assert parse_vllm(_BY_NAME, stage="1").requests_running == 5.0
    assert parse_vllm(_BY_ID, stage="code2wav").requests_running == 7.0
    assert parse_vllm(_BY_ID, stage="9").requests_running is None  # a stage the engine does not have
