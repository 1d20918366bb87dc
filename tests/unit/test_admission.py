"""Admission decisions, priority classes, the overload hysteresis, load shedding and the traffic settings."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from core.context import LoadSnapshot, RequestContext
from core.errors import InvalidRequest, Overloaded, PermissionDenied, RateLimited
from core.schemas import ChatCompletionRequest
from engines.adapters.settings import EngineConfig
from gateway.admission import AdmissionGate, decide_overload
from gateway.admission_slots import Limits, decide
from gateway.settings import Settings
from gateway.traffic_settings import TrafficSettings
from observability.metrics import Metrics
from policies.shedding import LoadShedding, LoadSheddingConfig
from policies.shedding import decide as shed

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("n", "tn", "limits", "expected"),
    [
        (0, 0, Limits(16, 64), "admit"),
        (63, 0, Limits(16, 64), "admit"),
        (64, 0, Limits(16, 64), "refuse_overload"),
        (3, 2, Limits(16, 64, tenant_quota=2), "refuse_quota"),
        (64, 2, Limits(16, 64, tenant_quota=2), "refuse_quota"),  # the tenant's own limit speaks first
        (10, 1, Limits(16, 64, tenant_quota=2), "admit"),
    ],
)
def test_decide(n, tn, limits, expected):
    assert decide(n, tn, limits) == expected


def test_overload_state_has_hysteresis():
    series = [10, 16, 17, 15, 13, 12, 11, 17, 20, 12]
    state, seen = False, []
    for n in series:
        state = decide_overload(state, n, enter_above=16, exit_at_or_below=12)
        seen.append(state)
    assert seen == [False, False, True, True, True, False, False, True, True, False]


def test_fail_open_share_scales_every_limit():
    assert Limits(16, 64, 10).scaled(0.5) == Limits(8, 32, 5)
    assert Limits(1, 1, 1).scaled(0.1) == Limits(0, 1, 1)
    assert Limits(16, 64).scaled(1.0) == Limits(16, 64)


def test_shedding_decision():
    above = LoadSnapshot("standard", in_flight=16, soft_limit=16, hard_limit=64, store="local")
    below = LoadSnapshot("standard", in_flight=15, soft_limit=16, hard_limit=64, store="local")
    assert shed(above, wants_speech=True) == "text-only"
    assert shed(above, wants_speech=False) == "as-asked"
    assert shed(below, wants_speech=True) == "as-asked"
    assert shed(None, wants_speech=True) == "as-asked"  # admission off


async def test_shedding_policy_rewrites_speech_to_text_and_announces_it():
    policy = LoadShedding(LoadSheddingConfig())
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "wav"},
        }
    )
    ctx = RequestContext.new("r")
    ctx.load = LoadSnapshot("standard", 20, 16, 64, "local")
    out = await policy.pre(req, ctx)
    assert out.modalities == ["text"] and out.audio is None and not out.wants_audio
    assert ctx.outputs.degraded == ["load-text-only"]
    ctx2 = RequestContext.new("r2")
    ctx2.load = LoadSnapshot("standard", 3, 16, 64, "local")
    assert await policy.pre(req, ctx2) is req and ctx2.outputs.degraded == []


def _gate(**traffic) -> AdmissionGate:
    return AdmissionGate(TrafficSettings(**traffic), Metrics(CollectorRegistry()))


def _ctx(**kw) -> RequestContext:
    return RequestContext.new("r", **kw)


async def test_local_gate_counts_sheds_and_refuses_by_class():
    gate = _gate(soft_limit=2, hard_limit=4)
    tickets = []
    for expected_above in (False, False, True, True):
        ctx = _ctx()
        tickets.append(await gate.admit(ctx))
        assert ctx.load.above_soft_limit is expected_above
    with pytest.raises(Overloaded) as info:
        await gate.admit(_ctx())
    assert info.value.status == 503 and info.value.headers() == {"Retry-After": "1"}
    assert gate.store.count == 4
    for t in tickets:
        t.release()
        t.release()  # once only
    assert gate.store.count == 0
    m = gate.metrics.registry.get_sample_value
    assert m("omnigate_admission_total", {"priority": "standard", "result": "admitted"}) == 2
    assert m("omnigate_admission_total", {"priority": "standard", "result": "above_soft_limit"}) == 2
    assert m("omnigate_admission_total", {"priority": "standard", "result": "refused_overload"}) == 1


async def test_lower_classes_are_shed_and_refused_first():
    gate = _gate(
        soft_limit=4,
        hard_limit=8,
        priorities=[
            {"name": "interactive", "soft_share": 1.5},
            {"name": "standard"},
            {"name": "batch", "soft_share": 0.5, "hard_share": 0.5},
        ],
    )
    assert gate._limits == {"interactive": (6, 8), "standard": (4, 8), "batch": (2, 4)}
    held = [await gate.admit(_ctx()) for _ in range(4)]
    batch = _ctx(requested_priority="batch")
    with pytest.raises(Overloaded):
        await gate.admit(batch)  # batch stops at 4
    std = _ctx()
    held.append(await gate.admit(std))
    assert std.load.above_soft_limit  # standard sheds from 4
    top = _ctx(priority="interactive")
    held.append(await gate.admit(top))
    assert not top.load.above_soft_limit  # interactive keeps speech up to 6
    for t in held:
        t.release()


async def test_tenant_quota_is_a_429():
    gate = _gate()
    a1 = await gate.admit(_ctx(tenant="acme", tenant_max_concurrency=1))
    with pytest.raises(RateLimited) as info:
        await gate.admit(_ctx(tenant="acme", tenant_max_concurrency=1))
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.headers()["Retry-After"] == "1"
    assert (
        gate.metrics.registry.get_sample_value("omnigate_admission_shed_total", {"reason": "tenant_quota"})
        == 1
    )
    other = await gate.admit(_ctx(tenant="globex", tenant_max_concurrency=1))  # other tenants unaffected
    a1.release()
    again = await gate.admit(_ctx(tenant="acme", tenant_max_concurrency=1))
    for t in (other, again):
        t.release()
    assert gate.store.count == 0 and gate.store.tenants == {}


def test_priority_header_may_only_lower_the_class():
    gate = _gate()
    assert gate.priority_of(_ctx()) == "standard"
    assert gate.priority_of(_ctx(requested_priority="batch")) == "batch"
    assert gate.priority_of(_ctx(requested_priority=" Batch ")) == "batch"
    assert gate.priority_of(_ctx(priority="interactive", requested_priority="standard")) == "standard"
    assert gate.priority_of(_ctx(priority="interactive", requested_priority="interactive")) == "interactive"
    assert gate.priority_of(_ctx(priority="interactive")) == "interactive"
    with pytest.raises(PermissionDenied):
        gate.priority_of(_ctx(requested_priority="interactive"))  # not a header class
    with pytest.raises(PermissionDenied):
        gate.priority_of(_ctx(priority="batch", requested_priority="standard"))  # above its own
    with pytest.raises(InvalidRequest) as info:
        gate.priority_of(_ctx(requested_priority="vip"))
    assert info.value.status == 400 and info.value.code == "invalid_priority"
    assert "x-omnigate-priority" in info.value.message


async def test_observe_drives_the_overload_switch():
    switched: list[bool] = []
    gate = AdmissionGate(
        TrafficSettings(soft_limit=2, hard_limit=8, overload_exit_below=1),
        Metrics(CollectorRegistry()),
        on_overload=switched.append,
    )
    held = [await gate.admit(_ctx()) for _ in range(3)]
    assert await gate.observe() is True
    held.pop().release()
    assert await gate.observe() is True  # 2 in flight: still above the exit level
    held.pop().release()
    assert await gate.observe() is False
    assert switched == [True, False]
    assert gate.metrics.registry.get_sample_value("omnigate_overloaded") == 0
    held.pop().release()


@pytest.mark.parametrize(
    ("traffic", "message"),
    [
        ({"soft_limit": 65}, r"soft_limit \(65\) exceeds hard_limit"),
        ({"default_priority": "gold"}, "default_priority"),
        ({"header_priorities": ["gold"]}, "header_priorities"),
        ({"priorities": [{"name": "standard", "hard_share": 1.5}]}, "hard_share"),
        (
            {"priorities": [{"name": "standard"}, {"name": "b", "soft_share": 2}]},
            "higher limits than the class above",
        ),
        ({"priorities": [{"name": "standard"}, {"name": "standard"}]}, "used twice"),
        ({"lease_ttl_s": 2, "heartbeat_s": 2}, "heartbeat_s"),
        ({"key_prefix": "bad prefix"}, "key_prefix"),
        ({"overload_exit_below": 20}, "overload_exit_below"),
    ],
)
def test_bad_traffic_settings_name_the_problem(traffic, message):
    with pytest.raises(ValidationError, match=message):
        Settings(traffic=traffic)


def test_class_limits_follow_the_gateway_limits():
    t = TrafficSettings()
    assert [t.class_limits(n) for n in ("interactive", "standard", "batch")] == [(32, 64), (16, 64), (8, 48)]
    t = TrafficSettings(soft_limit=2, hard_limit=4)
    assert [t.class_limits(n) for n in ("interactive", "standard", "batch")] == [(4, 4), (2, 4), (1, 3)]
    assert t.header_classes() == ["standard", "batch"]
    assert TrafficSettings(priorities=[{"name": "standard"}]).header_classes() == ["standard"]


def test_engine_overload_limit_defaults():
    def cfg(**kw):
        return EngineConfig(name="e", kind="vllm", base_url="http://h/v1", model="m", serves=["x"], **kw)

    assert (cfg().max_in_flight, cfg().overload_limit()) == (8, 4)
    assert cfg(max_in_flight=2).overload_limit() == 2
    assert cfg(max_in_flight=None).overload_limit() is None
    assert cfg(max_in_flight=None, max_in_flight_overloaded=3).overload_limit() == 3
    assert cfg(max_in_flight_overloaded=None).overload_limit() == 8
