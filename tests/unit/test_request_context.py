"""The request context's three owners: an identity nothing after the front door can change, a record,
typed policy outputs; no field can be added on the fly (the shared blackboard it replaced)."""

from __future__ import annotations

import dataclasses

import pytest

from core.context import Identity, PolicyOutputs, RequestContext
from core.settings import TenantConfig


def test_the_identity_is_frozen_and_completed_whole_by_authentication():
    ctx = RequestContext.new("r1", client_request_id="c1", requested_priority="batch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.identity.tenant = "someone-else"  # type: ignore[misc]  # what a policy must not be able to do
    tenant = TenantConfig(
        name="acme", priority="interactive", max_concurrency=3, policy_set="strict", audit_content="raw"
    )
    before = ctx.identity
    ctx.identity = ctx.identity.authenticated(tenant, "abcdefgh1234")
    assert before.tenant is None  # the old identity is not changed: a new one replaces it
    assert dataclasses.asdict(ctx.identity) | {"tenant_config": None} == {
        "request_id": "r1",
        "client_request_id": "c1",
        "requested_priority": "batch",
        "tenant": "acme",
        "tenant_config": None,
        "key_id": "abcdefgh1234",
        "priority": "interactive",
        "tenant_max_concurrency": 3,
        "policy_set": "strict",
        "audit_content": "raw",
    }
    assert ctx.identity.tenant_config is tenant
    assert ctx.identity.refused("k").key_id == "k"


def test_no_field_can_be_added_to_any_part():
    ctx = RequestContext.new("r")
    for part in (ctx, ctx.record, ctx.outputs):
        with pytest.raises(AttributeError):
            part.segmentation = object()  # type: ignore[attr-defined, union-attr]
    with pytest.raises((AttributeError, TypeError)):
        Identity("r").extra = 1  # type: ignore[attr-defined]


def test_undo_takes_back_degradations_and_control_decisions_made_since_the_mark():
    out = PolicyOutputs()
    out.degrade("max-tokens-capped")
    out.control["earlier"] = {"action": "x"}
    mark = out.mark()
    out.degrade("load-text-only")
    out.degrade("max-tokens-capped")  # already there: once
    out.control["shedding"] = {"action": "text-only"}
    out.undo(mark)
    assert out.degraded == ["max-tokens-capped"] and out.control == {"earlier": {"action": "x"}}
