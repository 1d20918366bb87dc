"""A realtime turn runs the tenant's policy chain as a chat request does: a stream filter shapes the spoken
answer's transcript, a pre-policy's refusal fails that response (``response.done`` ``failed``, with the
policy's error) and the session goes on, and each turn's audit record names the policies that ran."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import Client, answer, audit_rows, tone
from tests.plugins import PLUGINS
from tests.upstream import Script

pytestmark = pytest.mark.timeout(90)

SAID = "Words the filter will shout."


@pytest.fixture(scope="module")
def keys():
    return {"loud": mint_key(), "strict": mint_key()}


@pytest.fixture(scope="module")
def server(bg, upstreams, keys, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams,
        policies=PolicyChainConfig(
            pre=[PolicySpec(name="request-limits")], stream=[PolicySpec(name="uppercase")]
        ),
        policy_sets={"strict": PolicyChainConfig(pre=[PolicySpec(name="always-reject")])},
        tenants=[{"name": "loud", "models": [OMNI_MODEL]}, {"name": "strict", "policy_set": "strict"}],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
        audit={"sqlite_path": str(db)},
    )
    s = GatewayServer(bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}).start()
    s.db = db
    yield s
    s.stop()


@pytest.fixture
def ups(server, upstreams):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    assert wait_until(lambda: server.services.metrics.realtime_sessions._value.get() == 0, timeout=10)
    return upstreams


def _turn(c: Client) -> list[dict]:
    c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    c.until("session.updated")
    c.append(tone(0.4))
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    return c.until("response.done")


def test_the_stream_filter_shapes_the_spoken_transcript(server, ups, keys):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    with Client(server.url, keys["loud"].key) as c:
        session_id = c.until("session.created")[-1]["session"]["id"]
        audio, words, done = answer(_turn(c))
    assert words == SAID.upper() and audio and done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == SAID.upper()

    def turn_record() -> list[dict]:
        return [
            r["payload"]
            for r in audit_rows(server.db, "request")
            if (r["payload"].get("realtime") or {}).get("session_id") == session_id
        ]

    assert wait_until(lambda: bool(turn_record()), timeout=10)
    ran = [(p["name"], p["stage"]) for p in turn_record()[0]["policies"]]
    assert ("request-limits", "pre") in ran and (
        "media-limits",
        "pre",
    ) in ran  # the committed audio was checked


def test_a_refused_turn_fails_its_response_and_the_session_goes_on(server, ups, keys):
    with Client(server.url, keys["strict"].key) as c:
        c.until("session.created")
        done = _turn(c)[-1]
        assert done["response"]["status"] == "failed"
        error = done["response"]["status_details"]["error"]
        assert error["message"] == "refused by always-reject"
        c.send({"type": "session.update", "session": {"instructions": "still here"}})
        assert c.until("session.updated")[-1]["session"]["instructions"] == "still here"
    assert ups.omni_a.request_count == 0  # refused before any engine call
