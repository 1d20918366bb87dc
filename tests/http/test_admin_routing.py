"""Manual overrides under /admin/routing: pin, unpin, freeze, resume; each one a recorded transition."""

from __future__ import annotations

import pytest
import structlog
from prometheus_client import CollectorRegistry

from engines.rollout.rules import Rule, RuleAction, RuleSelector
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import ADMIN_KEY, MODEL, admin, chat, engines, settings
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

RULE = Rule(
    name="int4-latency",
    select=RuleSelector(variants=["int4"]),
    signal="ttft_p99",
    above=0.15,
    for_s=0.2,
    min_samples=3,
    recover_below=0.05,
    recover_for_s=600,
    action=RuleAction(kind="shift", to_variants=["bf16"], trickle_weight=0.0),
)


@pytest.fixture
def server(bg, trio):
    trio.reset()
    registry = CollectorRegistry()
    s = GatewayServer(bg, settings(engines(trio), [RULE]), registry).start()
    s.audit = []
    bg.call(lambda: s.services.controller.on_transition.append(s.audit.append))
    yield s
    s.stop()


def test_the_routing_admin_needs_the_key(server):
    assert admin(server.url, "", key=None).status_code == 401
    r = admin(server.url, "/pin", {"model": MODEL, "variant": "bf16"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_status_shows_the_table_the_controller_and_every_engine(server):
    assert chat(server.url).ok

    def int4_samples() -> int:
        st = admin(server.url, "").json()
        return next(e for e in st["engines"] if e["name"] == "omni-int4")["samples"]["ttft_p99"]

    assert wait_until(lambda: int4_samples() == 1, timeout=10)  # on the controller's next tick
    st = admin(server.url, "").json()
    assert st["is_leader"] and st["leader"] == st["replica"] and not st["frozen"]
    assert st["weights"] == {MODEL: {"omni-int4": 1.0, "omni-int8": 0.0, "omni-bf16": 0.0}}
    by_name = {e["name"]: e for e in st["engines"]}
    assert by_name["omni-int4"]["state"] == "serving" and by_name["omni-bf16"]["state"] == "standby"
    assert by_name["omni-int4"]["circuit"] == "closed"
    assert st["max_switches_per_hour"] == 100 and st["switches_last_hour"] == 0


def test_pin_moves_all_traffic_to_the_variant_until_unpinned(server, trio):
    registry = server.registry
    with structlog.testing.capture_logs() as logs:
        r = admin(
            server.url,
            "/pin",
            {"model": MODEL, "variant": "bf16", "note": "INT4 build under review", "actor": "oncall-ana"},
        )
    assert r.status_code == 200 and r.json()["changed"] is True
    assert r.json()["weights"][MODEL] == {"omni-int4": 0.0, "omni-int8": 0.0, "omni-bf16": 1.0}
    [t] = server.audit
    assert (t.action, t.reason, t.source, t.models) == ("pin", "manual", "manual", (MODEL,))
    # Who did it is the credential that made the call; the body's name is only recorded as a claim.
    assert t.detail["variant"] == "bf16" and t.detail["actor"] == "admin:api_key (claimed: oncall-ana)"
    assert t.detail["note"] == "INT4 build under review"
    assert t.detail["weights_before"][MODEL]["omni-int4"] == 1.0
    assert [e["action"] for e in logs if e["event"] == "routing_transition"] == ["pin"]
    assert (
        registry.get_sample_value(
            "omnigate_routing_transitions_total", {"action": "pin", "reason": "manual", "source": "manual"}
        )
        == 1
    )

    trio.reset()
    assert all(chat(server.url).ok for _ in range(5))
    assert trio.counts() == {"int4": 0, "int8": 0, "bf16": 5}
    again = admin(server.url, "/pin", {"model": MODEL, "variant": "bf16"})
    assert again.json()["changed"] is False and len(server.audit) == 1  # nothing changed, nothing recorded

    r = admin(server.url, "/unpin", {"model": MODEL})
    assert r.json()["changed"] and r.json()["pins"] == {} and r.json()["weights"][MODEL]["omni-int4"] == 1.0
    assert server.audit[-1].action == "unpin"


def test_a_pinned_model_is_left_alone_by_the_rules(server, trio):
    assert admin(server.url, "/pin", {"model": MODEL, "variant": "int4"}).json()["changed"]
    trio.set(trio.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
    assert wait_until(
        lambda: (
            chat(server.url).ok
            and admin(server.url, "").json()["holds"] == {"int4-latency@omni-int4": "pinned"}
        ),
        timeout=30,
        interval=0,
    )
    assert [t.action for t in server.audit] == ["pin"]


def test_freeze_holds_automatic_switches_and_resume_lets_them_happen(server, trio):
    r = admin(server.url, "/freeze", {"note": "game day"})
    assert r.status_code == 200 and r.json()["frozen"] is True
    assert server.registry.get_sample_value("omnigate_controller_frozen") == 1
    trio.set(trio.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
    assert wait_until(
        lambda: (
            chat(server.url).ok
            and admin(server.url, "").json()["holds"] == {"int4-latency@omni-int4": "frozen"}
        ),
        timeout=30,
        interval=0,
    )
    assert admin(server.url, "").json()["weights"][MODEL]["omni-int4"] == 1.0

    assert admin(server.url, "/resume", {}).json()["frozen"] is False
    assert wait_until(
        lambda: chat(server.url).ok and admin(server.url, "").json()["weights"][MODEL]["omni-bf16"] == 1.0,
        timeout=30,
        interval=0,
    )
    assert [(t.action, t.source) for t in server.audit] == [
        ("freeze", "manual"),
        ("resume", "manual"),
        ("shift", "auto"),
    ]

    # resume with clear_incidents ends the rollback by hand: traffic goes back to the configured split.
    r = admin(server.url, "/resume", {"clear_incidents": True, "note": "INT4 fixed"})
    assert r.json()["weights"][MODEL]["omni-int4"] == 1.0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/pin", {"model": MODEL, "variant": "fp8"}, 400, "variant"),
        ("/pin", {"model": MODEL, "variant": "int3"}, 400, "variant"),
        ("/pin", {"model": "nope", "variant": "bf16"}, 404, "model"),
        ("/pin", {"model": MODEL}, 400, "variant"),
        ("/pin", {"model": MODEL, "variant": "bf16", "colour": "red"}, 400, "colour"),
        ("/unpin", {"model": "nope"}, 404, "model"),
        ("/clear", {"incident": "no-such@rule"}, 400, "incident"),
        ("/readmit", {"engine": "nope"}, 400, "engine"),
    ],
)
def test_bad_override_requests_are_openai_shaped_errors(server, path, body, status, param):
    r = admin(server.url, path, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    assert server.audit == []


def test_a_body_that_is_not_json_is_a_400(server):
    import httpx

    r = httpx.post(
        server.url + "/admin/routing/freeze",
        content=b"{not json",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
