"""Two replicas through Redis: the leader integrates the power, the follower's answers carry the estimate."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from core.control_settings import EnergySettings, EngineTelemetry, SharedStateSettings
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import MODEL, admin, engines, settings
from tests.http.test_energy_usage import Dcgm

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dcgm(bg):
    d = Dcgm()
    bg.run(d.start())
    yield d
    bg.run(d.stop())


def _replica(bg, trio, dcgm, prefix: str, name: str) -> GatewayServer:
    state = SharedStateSettings(backend="redis", key_prefix=prefix, lease_ttl_s=1.0,
                                replica_id=name)  # fmt: skip
    engine_list = engines(trio)
    engine_list[0] = engine_list[0].model_copy(
        update={"telemetry": EngineTelemetry(dcgm_url=f"http://127.0.0.1:{dcgm.port}/metrics", gpus=["0"])}
    )
    cfg = settings(engine_list, [], state=state, window_s=10.0, interval_s=1.0)
    cfg.routing.energy = EnergySettings(min_joules=1.0)
    return GatewayServer(bg, cfg, CollectorRegistry()).start()


def _usage(url: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_the_followers_answers_carry_the_energy_the_leader_measured(bg, fresh, dcgm, prefix):
    a = _replica(bg, fresh, dcgm, prefix, "replica-a")
    b = _replica(bg, fresh, dcgm, prefix, "replica-b")
    try:
        assert wait_until(lambda: admin(a.url, "").json()["leader"] in ("replica-a", "replica-b"), timeout=10)
        leader, follower = (a, b) if admin(a.url, "").json()["is_leader"] else (b, a)
        # Only the follower serves: the leader sees the traffic through the follower's published counts.
        deadline = time.monotonic() + 30
        usage = _usage(follower.url)
        while "energy_joules" not in usage and time.monotonic() < deadline:
            usage = _usage(follower.url)
        assert "energy_joules" in usage, usage
        book = follower.services.pipeline.energy
        before = follower.bg.call(lambda: book.joules_per_token("omni-int4"))
        usage = _usage(follower.url)
        after = follower.bg.call(lambda: book.joules_per_token("omni-int4"))
        tokens = usage["completion_tokens"]
        assert any(usage["energy_joules"] == pytest.approx(tokens * f, abs=1e-3) for f in (before, after)), (
            usage
        )
        # The figure the follower charges is the one the leader computed and exports.
        tpj = leader.registry.get_sample_value(
            "omnigate_engine_tokens_per_joule", {"engine": "omni-int4", "variant": "int4"}
        )
        assert tpj is not None and tpj > 0
        # The energy is integrated once, by the leader.
        assert (
            follower.registry.get_sample_value(
                "omnigate_engine_energy_joules_total", {"engine": "omni-int4", "variant": "int4"}
            )
            is None
        )
    finally:
        b.stop()
        a.stop()
