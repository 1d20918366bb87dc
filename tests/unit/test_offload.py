"""Sleep and wake through vLLM-Omni's control routes, against the scripted upstream that serves them as vLLM-Omni does."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.offload import OffloadClient, OffloadTarget, parse_sleep_state
from engines.rollout.rollback import Intent
from engines.rollout.settings import OffloadSettings
from observability.metrics import Metrics
from tests.upstream import ScriptedUpstream

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def up():
    async with ScriptedUpstream(models=["qwen3-omni-bf16"]) as server:
        yield server


def _client(up: ScriptedUpstream, metrics: Metrics, **kw) -> OffloadClient:
    root = up.base_url[: -len("/v1")]
    target = OffloadTarget("omni-bf16", root, root + "/metrics", api_key="k" * 32, gpus=("0",))
    return OffloadClient([target], OffloadSettings(**kw), metrics)


def _sent(metrics: Metrics, action: str, outcome: str) -> float:
    labels = {"engine": "omni-bf16", "action": action, "outcome": outcome}
    return metrics.registry.get_sample_value("omnigate_engine_sleep_requests_total", labels) or 0.0


async def test_sleep_then_wake_every_stage_and_the_gauge_says_when_it_is_awake(up):
    metrics = Metrics(CollectorRegistry())
    up.wake_delay_s = 0.4  # the gauge lags the wakeup's answer
    client = _client(up, metrics)
    try:
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") == 0.0 and client.gpus("omni-bf16") == ("0",)
        assert await client.send(Intent("sleep", "omni-bf16", level=1))
        assert up.sleep_calls == [("sleep", {"stage_ids": [0, 1, 2], "level": 1})]
        assert up.sleeping_stages == {0: 1, 1: 1, 2: 1}
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") == 1.0
        assert await client.send(Intent("wake", "omni-bf16"))
        assert up.sleep_calls[-1] == ("wakeup", {"stage_ids": [0, 1, 2]})
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") == 1.0  # not confirmed yet: routing keeps it out
        await asyncio.sleep(0.5)
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") == 0.0
        assert _sent(metrics, "sleep", "ok") == 1 and _sent(metrics, "wake", "ok") == 1
        # Level 2 discards the weights; the gauge says so.
        assert await client.send(Intent("sleep", "omni-bf16", level=2))
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") == 2.0
    finally:
        await client.aclose()


async def test_the_scripted_routes_answer_as_vllm_omni_does(up):
    root = up.base_url[: -len("/v1")]
    async with httpx.AsyncClient(base_url=root) as http:
        r = await http.post("/v1/omni/wakeup", json={"stage_ids": [0]})
        assert r.status_code == 200 and r.json() == {"status": "SKIPPED"}  # nothing sleeps
        r = await http.post("/v1/omni/sleep", json={"stage_ids": [0, 1]})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "SUCCESS" and len(body["acks"]) == 2
        assert up.sleeping_stages == {0: 2, 1: 2}  # level 2 by default
        r = await http.post("/v1/omni/wakeup", json={"stage_ids": [1, 99]})
        assert r.status_code == 200 and [a["stage_id"] for a in r.json()["acks"]] == [1]
        for bad in ({"stage_ids": []}, {"stage_ids": [0], "level": -1}, {"level": 1}, {"stage_ids": ["x"]}):
            r = await http.post("/v1/omni/sleep", json=bad)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "body", bad
        assert (await http.post("/v1/omni/wakeup", json={"stage_ids": []})).status_code == 422


async def test_an_engine_without_sleep_mode_refuses_and_the_client_says_so(up):
    metrics = Metrics(CollectorRegistry())
    up.sleep_mode = False
    client = _client(up, metrics)
    try:
        assert not await client.send(Intent("sleep", "omni-bf16", level=1))
        assert _sent(metrics, "sleep", "refused") == 1 and up.sleeping_stages == {}
    finally:
        await client.aclose()
    await up.stop()
    client = _client(up, metrics, timeout_s=1)
    try:
        assert not await client.send(Intent("wake", "omni-bf16"))
        assert _sent(metrics, "wake", "unreachable") == 1
        await client.refresh(["omni-bf16"])
        assert client.latest("omni-bf16") is None
    finally:
        await client.aclose()


def test_the_gauge_is_read_per_stage_and_replica_and_in_vllms_own_labels():
    omni = "\n".join(
        [
            "# TYPE vllm:engine_sleep_state gauge",
            'vllm:engine_sleep_state{model_name="m",stage="0",replica="0",sleep_state="awake"} 0.0',
            'vllm:engine_sleep_state{model_name="m",stage="0",replica="0",sleep_state="weights_offloaded"} 1.0',
            'vllm:engine_sleep_state{model_name="m",stage="0",replica="0",sleep_state="discard_all"} 0.0',
            'vllm:engine_sleep_state{model_name="m",stage="3",replica="0",sleep_state="awake"} 1.0',
            "",
        ]
    )
    assert parse_sleep_state(omni, [0]) == 1.0
    assert parse_sleep_state(omni, [3]) == 0.0
    assert parse_sleep_state(omni, [7]) is None
    plain = "\n".join(
        [
            "# TYPE vllm:engine_sleep_state gauge",
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0',
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
            "",
        ]
    )
    assert parse_sleep_state(plain, [0, 1, 2]) == 0.0
    assert parse_sleep_state("# nothing here\n") is None
