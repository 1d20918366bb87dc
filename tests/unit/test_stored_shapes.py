"""What replicas share through Redis: the routing document, the replica summaries and the transitions.

The documents below are written in the shape replicas of this release store today. A replica
of a later release must still load them (during a rolling upgrade the old replicas keep writing
them), and must write back the same shape, so an old replica can read what a new one wrote.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from engines.rollout.rollback import ControllerState, Sleep, Transition
from engines.rollout.routing import RoutingTable
from engines.rollout.signals import EngineSummary
from engines.rollout.snapshot import Incident
from engines.rollout.state_store import Doc, RedisStore

REDIS_URL = "redis://127.0.0.1:6379/0"

DOC = (
    b'{"version":7,"state":{"incidents":{"int4-latency@omni-int4":{"rule":"int4-latency","engine":"omni-int4",'
    b'"action":"shift","since":100.0,"detected_at":95.5,"value":1.2,"targets":{"omni":["omni-bf16"]},'
    b'"weight":0.0,"keep":0.0,"limit":null,"clear_since":null},"latency-batch@omni-bf16":{"rule":'
    b'"latency-batch","engine":"omni-bf16","action":"limit_concurrency","since":120.0,"detected_at":120.0,'
    b'"value":0.9,"targets":{},"weight":0.0,"keep":0.0,"limit":4,"clear_since":130.5}},"breaches":'
    b'{"vram-pressure@omni-bf16":140.0},"holds":{"accuracy-floor@omni-int4":"cooldown"},"switches":[100.0],'
    b'"last_switch":{"omni":100.0},"frozen":false,"pins":{"voice":"bf16"},"sleeping":{"omni-spare":'
    b'{"engine":"omni-spare","phase":"asleep","by":"vram-pressure@omni-bf16","level":1,"since":150.0,'
    b'"sent_at":150.0}}},"table":{"version":7,"weights":{"omni":{"omni-int4":0.0,"omni-bf16":1.0},"voice":'
    b'{"omni-bf16":1.0,"omni-spare":0.0}},"limits":{"omni-bf16":4},"pins":{"voice":"bf16"},"raised":{},'
    b'"asleep":["omni-spare"]}}'
)

#: one engine's entry in a replica's published summary, with the two keys the controller adds beside it
SUMMARY = (
    b'{"ok":40,"errors":2,"latency":{"ttft":{"120":30.0,"150":10.0},"e2e":{"200":40.0}},"wer_errors":3.0,'
    b'"wer_words":100,"wer_samples":5,"tokens":4000,"audio_s":12.5,"finished_total":900,"in_flight":3,'
    b'"joules_per_token":0.25}'
)


def test_a_stored_routing_document_loads_into_typed_state():
    doc = Doc.loads(DOC)
    assert doc.version == 7
    state = ControllerState.from_dict(doc.state)
    shift = state.incidents["int4-latency@omni-int4"]
    assert shift == Incident(
        rule="int4-latency",
        engine="omni-int4",
        action="shift",
        since=100.0,
        detected_at=95.5,
        value=1.2,
        targets={"omni": ("omni-bf16",)},
    )
    limit = state.incidents["latency-batch@omni-bf16"]
    assert limit.limit == 4 and isinstance(limit.limit, int) and limit.clear_since == 130.5
    assert state.breaches == {"vram-pressure@omni-bf16": 140.0}
    assert state.holds == {"accuracy-floor@omni-int4": "cooldown"}
    assert state.switches == (100.0,) and state.last_switch == {"omni": 100.0}
    assert state.frozen is False and state.pins == {"voice": "bf16"}
    assert state.sleeping == {
        "omni-spare": Sleep("omni-spare", "asleep", "vram-pressure@omni-bf16", 1, 150.0, 150.0)
    }
    table = RoutingTable.from_dict(doc.table)
    assert table.version == 7
    assert table.weight("omni", "omni-bf16") == 1.0 and table.weight("voice", "omni-spare") == 0.0
    assert table.limits == {"omni-bf16": 4} and table.raised == {}
    assert table.pins == {"voice": "bf16"} and table.asleep == ("omni-spare",)


def test_the_document_is_written_back_in_the_shape_it_was_read():
    doc = Doc.loads(DOC)
    state = ControllerState.from_dict(doc.state)
    table = RoutingTable.from_dict(doc.table)
    # The controller compares what it would write with what it read (JSON types: lists, not tuples).
    assert state.to_dict() == doc.state
    assert table.to_dict() == doc.table
    assert Doc(doc.version, state.to_dict(), table.to_dict()).dumps() == DOC


async def test_a_document_an_older_replica_left_in_redis_loads_and_is_written_back_in_its_shape():
    client = aioredis.from_url(REDIS_URL)
    prefix = f"test-stored-shapes-{uuid.uuid4().hex[:8]}"
    store = RedisStore(client, prefix, "new")
    try:
        await client.set(f"{prefix}:doc", DOC)
        loaded = await store.load()
        assert ControllerState.from_dict(loaded.state).sleeping["omni-spare"].phase == "asleep"

        def rewrite(doc: Doc) -> tuple[dict[str, Any], dict[str, Any]]:
            return ControllerState.from_dict(doc.state).to_dict(), RoutingTable.from_dict(doc.table).to_dict()

        new, changed = await store.update(rewrite)
        assert changed and new.version == 8
        stored = orjson.loads(await client.get(f"{prefix}:doc"))
        before = orjson.loads(DOC)
        assert stored == {"version": 8, "state": before["state"], "table": {**before["table"], "version": 8}}
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await store.aclose()


def test_an_incident_stored_without_its_detection_time_was_detected_when_it_began():
    state = orjson.loads(DOC)["state"]
    del state["incidents"]["int4-latency@omni-int4"]["detected_at"]
    inc = ControllerState.from_dict(state).incidents["int4-latency@omni-int4"]
    assert inc.detected_at == inc.since == 100.0


def test_an_empty_or_missing_state_is_a_fresh_one():
    assert ControllerState.from_dict(None) == ControllerState()
    assert ControllerState.from_dict({}) == ControllerState()
    assert Doc.loads(None) == Doc() and Doc.loads(b"") == Doc()
    assert RoutingTable.from_dict({}) == RoutingTable()


def test_a_document_that_is_not_the_shape_is_refused_naming_the_field():
    state = orjson.loads(DOC)["state"]
    state["sleeping"]["omni-spare"]["level"] = "deep"
    with pytest.raises(ValidationError, match="level"):
        ControllerState.from_dict(state)
    with pytest.raises(ValidationError, match="version"):
        Doc.loads(b'{"version":"seven","state":{},"table":{}}')


def test_a_replica_summary_loads_with_the_controllers_extra_keys_ignored():
    summary = EngineSummary.from_dict(orjson.loads(SUMMARY))
    assert summary.ok == 40 and summary.errors == 2
    assert summary.latency == {"ttft": {120: 30.0, 150: 10.0}, "e2e": {200: 40.0}}
    assert summary.wer == 0.03 and summary.tokens == 4000 and summary.audio_s == 12.5
    assert summary.finished_total == 900
    published = orjson.loads(SUMMARY)
    del published["in_flight"], published["joules_per_token"]
    assert summary.to_dict() == published


def test_a_summary_from_a_replica_without_the_newer_counts_merges_as_zero():
    older = EngineSummary.from_dict({"ok": 3, "errors": 1, "latency": {"ttft": {"10": 4}}})
    assert older.tokens == 0 and older.audio_s == 0.0 and older.finished_total == 0
    merged = older.merge(EngineSummary.from_dict(orjson.loads(SUMMARY)))
    assert merged.ok == 43 and merged.latency["ttft"] == {10: 4.0, 120: 30.0, 150: 10.0}
    assert merged.count("ttft") == 44.0


def test_a_transition_is_shown_with_json_types():
    t = Transition(
        at=1.0,
        action="shift",
        reason="int4-latency",
        source="auto",
        engine="omni-int4",
        models=("omni",),
        detail={"weights": {"omni": {"omni-int4": 0.0}}, "ends": ("accuracy-floor@omni-int4",)},
    )
    assert t.to_dict() == {
        "at": 1.0,
        "action": "shift",
        "reason": "int4-latency",
        "source": "auto",
        "engine": "omni-int4",
        "models": ["omni"],
        "detail": {"weights": {"omni": {"omni-int4": 0.0}}, "ends": ["accuracy-floor@omni-int4"]},
    }
