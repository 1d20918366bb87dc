"""Manual control of routing under ``/admin/routing``: status, pin, unpin, freeze, resume, clear, readmit.

Behind the same admin key as the rest of ``/admin``. Each call that changes
something is a transition like the controller's own: counted, logged and handed to
the audit hooks, with the caller's ``note``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from core.errors import InvalidRequest, ModelNotFound
from engines.rollout.rollback import Transition
from engines.rollout.rules import Variant
from gateway.api.admin import credential_of, require_admin, services_of
from gateway.api.chat import validation_to_error
from gateway.services import Services

router = APIRouter(prefix="/admin/routing", include_in_schema=False, dependencies=[Depends(require_admin)])

Note = Annotated[str, Field(max_length=500)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    note: Note | None = None
    #: what the caller says it is; recorded as a claim beside the credential that made the call
    actor: Annotated[str, Field(max_length=100)] | None = None


class PinBody(_Body):
    model: str
    variant: Variant


class UnpinBody(_Body):
    model: str


class ResumeBody(_Body):
    clear_incidents: bool = False


class ClearBody(_Body):
    incident: Annotated[str, Field(min_length=3, max_length=300)]


class ReadmitBody(_Body):
    engine: str


async def _body(request: Request, model: type[_Body]) -> _Body:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise validation_to_error(exc.errors()) from None


def _actor(request: Request, body: _Body) -> str:
    """Who made the call: the admin credential; a body's ``actor`` is kept only as what the caller claimed."""
    actor = credential_of(request).label
    return f"{actor} (claimed: {body.actor})" if body.actor else actor


def _result(services: Services, transition: Transition | None) -> JSONResponse:
    return JSONResponse(
        {
            "changed": transition is not None,
            "transition": transition.to_dict() if transition is not None else None,
            "version": services.pool.table.version,
            "frozen": services.controller.state.frozen,
            "pins": dict(services.controller.state.pins),
            "weights": {m: dict(w) for m, w in services.pool.table.weights.items()},
        }
    )


@router.get("")
async def status(request: Request) -> JSONResponse:
    """Routing table, controller state (leader, frozen, pins, incidents, holds) and each engine's signals."""
    return JSONResponse(await services_of(request).controller.status())


@router.post("/pin")
async def pin(request: Request) -> JSONResponse:
    services = services_of(request)
    body = await _body(request, PinBody)
    assert isinstance(body, PinBody)
    if not services.pool.serves(body.model):
        raise ModelNotFound(f"the model {body.model!r} does not exist", param="model")
    variants = {i.variant for i in services.pool.infos.values() if body.model in i.serves}
    if body.variant not in variants:
        raise InvalidRequest(
            f"no engine serves {body.model!r} as {body.variant}; variants: {sorted(variants)}",
            param="variant",
        )
    t = await services.controller.pin(body.model, body.variant, actor=_actor(request, body), note=body.note)
    return _result(services, t)


@router.post("/unpin")
async def unpin(request: Request) -> JSONResponse:
    services = services_of(request)
    body = await _body(request, UnpinBody)
    assert isinstance(body, UnpinBody)
    if not services.pool.serves(body.model):
        raise ModelNotFound(f"the model {body.model!r} does not exist", param="model")
    return _result(
        services, await services.controller.unpin(body.model, actor=_actor(request, body), note=body.note)
    )


@router.post("/freeze")
async def freeze(request: Request) -> JSONResponse:
    services = services_of(request)
    body = await _body(request, _Body)
    return _result(services, await services.controller.freeze(actor=_actor(request, body), note=body.note))


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    services = services_of(request)
    body = await _body(request, ResumeBody)
    assert isinstance(body, ResumeBody)
    t = await services.controller.resume(
        actor=_actor(request, body), note=body.note, clear=body.clear_incidents
    )
    return _result(services, t)


@router.post("/clear")
async def clear(request: Request) -> JSONResponse:
    """End one incident by hand (``rule@engine``, as listed by the status)."""
    services = services_of(request)
    body = await _body(request, ClearBody)
    assert isinstance(body, ClearBody)
    if body.incident not in services.controller.state.incidents:
        raise InvalidRequest(f"no incident {body.incident!r} is in force", param="incident")
    return _result(
        services, await services.controller.clear(body.incident, actor=_actor(request, body), note=body.note)
    )


@router.post("/readmit")
async def readmit(request: Request) -> JSONResponse:
    """Close an engine's circuit on the replica that takes this call."""
    services = services_of(request)
    body = await _body(request, ReadmitBody)
    assert isinstance(body, ReadmitBody)
    if body.engine not in services.pool.engines:
        raise InvalidRequest(f"no engine is named {body.engine!r}", param="engine")
    return JSONResponse(
        {
            "changed": services.controller.readmit(body.engine),
            "circuit": services.pool.circuit_state(body.engine),
        }
    )
