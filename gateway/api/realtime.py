"""``WS /v1/realtime``: OpenAI's Realtime protocol, served over the omni chat engine.

The route authenticates (the ``Authorization`` header, or OpenAI's browser form: the key in the
``openai-insecure-api-key.<key>`` subprotocol, answered with ``realtime``), checks the model, caps the
sessions of one key, takes ONE admission slot for the session's life, then feeds client frames to the
session (gateway/realtime/session.py) and writes its events, each within the write deadline. What the
session holds (its slot, a response in progress and so its engine request) is given back however the
socket ends: the client gone, a limit, a stalled reader, a server shutdown. A refusal before the upgrade
is an HTTP answer with the OpenAI error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import orjson
import structlog
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from core.context import RequestContext
from core.errors import InvalidRequest, ModelNotFound, OmnigateError, Overloaded, RateLimited
from gateway.auth_failures import TooManyAuthFailures
from gateway.realtime import passthrough
from gateway.realtime.events import ClientGone, RealtimeError
from gateway.realtime.places import Place
from gateway.realtime.session import Close, RealtimeSession
from gateway.services import Services
from gateway.tenants import KeyRefused

log = structlog.get_logger("omnigate.realtime")

PATH = "/v1/realtime"
#: OpenAI's browser form of the key: a subprotocol, since browsers cannot set headers on a WebSocket
KEY_PROTOCOL = "openai-insecure-api-key."


class Outbox:
    """The session's writes, one at a time, each within the deadline. A write that fails ends the session:
    the reader (blocked on the next frame) is cancelled so that the session's teardown runs at once."""

    def __init__(self, websocket: WebSocket, timeout_s: float, reader: asyncio.Task[Any]) -> None:
        self.websocket, self.timeout_s, self.reader = websocket, timeout_s, reader
        self._lock = asyncio.Lock()
        self.gone = False

    async def send(self, event: dict[str, Any]) -> None:
        if self.gone:
            raise ClientGone
        data = orjson.dumps(event).decode()
        try:
            async with self._lock, asyncio.timeout(self.timeout_s):
                await self.websocket.send_text(data)
        except (TimeoutError, OSError, RuntimeError, WebSocketDisconnect) as exc:
            # WebSocketDisconnect and RuntimeError: Starlette's words for a send after the client left or
            # after the close; OSError: the transport's.
            self.gone = True
            if asyncio.current_task() is not self.reader:
                self.reader.cancel()
            raise ClientGone from exc


class RealtimeEndpoint:
    """The route's ASGI app. The places of each key's sessions (the per-key cap) are the services'
    (gateway/realtime/places.py): in this process, or in Redis for every replica."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        websocket = WebSocket(scope, receive, send)
        services: Services = websocket.app.state.services
        settings = services.settings.realtime
        session_id = "sess_" + uuid.uuid4().hex[:24]
        ctx = RequestContext.new(
            session_id, requested_priority=websocket.headers.get(services.settings.traffic.priority_header)
        )
        offered = [
            p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()
        ]
        subprotocol = "realtime" if "realtime" in offered else None
        place: Place | None = None
        admitted = False
        try:
            if not settings.enabled:
                raise OmnigateError("not found", status=404, code="not_found")
            if not websocket.app.state.readiness.open:  # as the readiness gate answers /v1/* over HTTP
                raise Overloaded(
                    "the gateway is starting: no engine has answered its health probe yet; retry shortly",
                    code="gateway_starting",
                    retry_after=1.0,
                )
            await _authenticate(websocket, services, offered, ctx)
            model = _model(websocket, services, ctx)
            chain = services.pipeline.chain_for(ctx).describe()
            passthrough.check_guards(passthrough.engine_for(services.settings.engines, model), chain)
            who = ctx.identity.key_id or (websocket.client.host if websocket.client else "unknown")
            # Taken before the admission, atomically (in Redis when shared): two handshakes at once, on
            # one replica or on two, cannot both take the last place.
            place = await services.realtime_places.take(who, settings.max_sessions_per_key)
            if place is None:
                raise RateLimited(
                    f"too many realtime sessions open for this key (at most {settings.max_sessions_per_key})",
                    retry_after=services.settings.traffic.retry_after_s,
                )
            await services.pipeline.admit(ctx)  # the session's one slot, on ctx.holds until it ends
            admitted = True
        except OmnigateError as exc:
            with ctx.holds:
                if not isinstance(exc, (KeyRefused, TooManyAuthFailures)):
                    await services.pipeline.refused(ctx, exc)
                await _deny(websocket, exc)
            return
        finally:
            if not admitted:  # refused, or cancelled in the admission's await: the place and the slot go back
                if place is not None:
                    place.release()
                ctx.holds.close()
        services.metrics.realtime_sessions.inc()
        try:
            with ctx.holds:
                await self._serve(websocket, services, ctx, session_id, model, subprotocol)
        finally:
            # Last, after the slot went back and the close was audited: a session counted open holds nothing.
            if place is not None:
                place.release()
            services.metrics.realtime_sessions.dec()

    async def _serve(
        self,
        websocket: WebSocket,
        services: Services,
        ctx: RequestContext,
        session_id: str,
        model: str,
        subprotocol: str | None,
    ) -> None:
        settings = services.settings.realtime
        metrics = services.metrics
        reader = asyncio.current_task()
        assert reader is not None
        try:
            await websocket.accept(subprotocol=subprotocol)
        except (OSError, RuntimeError, WebSocketDisconnect):
            return  # gone during the handshake: nothing was opened
        outbox = Outbox(websocket, services.settings.server.stream_write_timeout_s, reader)
        engine = contextlib.AsyncExitStack()  # a passthrough engine's own realtime socket, closed in finally
        relay = passthrough.relay_for(
            services.settings.engines,
            model,
            engine,
            lambda rid, payload: _audit(services, ctx, rid, payload),
            lambda: websocket.close(1011),
        )
        session = RealtimeSession(
            pipeline=services.pipeline,
            metrics=metrics,
            settings=settings,
            ctx=ctx,
            session_id=session_id,
            model=model,
            send=outbox.send,
            relay=relay,
        )
        started = time.monotonic()
        await _audit(services, ctx, session_id, {"event": "open", "model": model})
        code, reason = 1000, "client"
        try:
            async with asyncio.timeout(settings.max_session_s):
                await session.open()
                while True:
                    try:
                        async with asyncio.timeout(settings.idle_s):
                            message = await websocket.receive()
                    except TimeoutError:
                        if session.responses.active is not None:
                            continue  # listening to an answer is not idling
                        idle = RealtimeError(
                            f"nothing was sent for {settings.idle_s:g} s", code="session_idle", fatal=True
                        )
                        await session.refuse(idle, None)  # raises Close
                        continue
                    if message["type"] == "websocket.disconnect":
                        break
                    await session.frame(message.get("text"), message.get("bytes"))
        except Close as c:
            code, reason = c.code, "abuse" if c.reason == "too many invalid events" else "limit"
        except TimeoutError:
            code, reason = 1008, "limit"
            expired = RealtimeError(
                f"the session reached its limit of {settings.max_session_s:g} s", code="session_expired"
            )
            with contextlib.suppress(ClientGone):
                await session.emit(expired.event(None))
        except ClientGone:
            reason = "client"
        except asyncio.CancelledError:
            if not outbox.gone:
                reason = "shutdown"
                raise
            reader.uncancel()  # cancelled by the outbox: the client stopped reading
            reason = "stalled"
        finally:
            # A response in progress is cancelled, and its engine request closed, before the slot goes back.
            await session.aclose()
            await engine.aclose()
            metrics.realtime_closed.labels(reason).inc()
            if websocket.application_state == WebSocketState.CONNECTED and not outbox.gone:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1):
                        await websocket.close(code)
            await _audit(
                services,
                ctx,
                session_id,
                {
                    "event": "close",
                    "model": session.cfg.model,
                    "reason": reason,
                    "close_code": code,
                    "duration_s": round(time.monotonic() - started, 3),
                    "turns": session.turns,
                    "usage": {
                        "audio_in_seconds": round(session.audio_in_s, 3),
                        "audio_out_seconds": round(session.audio_out_s, 3),
                    },
                },
            )


async def _authenticate(
    websocket: WebSocket, services: Services, offered: list[str], ctx: RequestContext
) -> None:
    """As gateway/api/auth.py for chat, with the key taken from the header or OpenAI's subprotocol form."""
    if not services.auth_required:
        return
    address = websocket.client.host if websocket.client is not None else "unknown"
    services.auth_failures.check(address)
    header = websocket.headers.get("authorization")
    if header is None:
        key = next((p[len(KEY_PROTOCOL) :] for p in offered if p.startswith(KEY_PROTOCOL)), None)
        header = f"Bearer {key}" if key else None
    try:
        principal = services.directory.authenticate(header)
    except KeyRefused as exc:
        services.metrics.auth_failures.labels(exc.reason).inc()
        ctx.identity = ctx.identity.refused(exc.key_id)
        await services.auth_failures.failed(address, exc.reason)
        raise
    ctx.identity = ctx.identity.authenticated(principal.tenant, principal.key_id)
    structlog.contextvars.bind_contextvars(tenant=principal.tenant.name)


def _model(websocket: WebSocket, services: Services, ctx: RequestContext) -> str:
    model = websocket.query_params.get("model")
    if not model:
        raise InvalidRequest("the model is required: /v1/realtime?model=...", param="model")
    tenant = ctx.identity.tenant_config
    if not services.pipeline.pool.serves(model) or (
        tenant is not None and tenant.models is not None and model not in tenant.models
    ):
        raise ModelNotFound(
            f"the model {model!r} does not exist or you do not have access to it", param="model"
        )
    return model


async def _deny(websocket: WebSocket, exc: OmnigateError) -> None:
    """Refuse the upgrade with an HTTP answer carrying the OpenAI error body (a close, where the server
    cannot answer a WebSocket request with HTTP)."""
    headers = exc.headers()
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    with contextlib.suppress(OSError, RuntimeError, WebSocketDisconnect):  # the client may be gone already
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(
                JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)
            )
        else:
            await websocket.close(1008, exc.message[:120])


async def _audit(services: Services, ctx: RequestContext, session_id: str, payload: dict[str, Any]) -> None:
    """The session's open and close records, in the chain beside its turns' (each turn has its own)."""
    audit = services.pipeline.audit
    if audit is None:
        return
    payload = {**payload, "key_id": ctx.identity.key_id, "admission": ctx.record.admission}
    fut = audit.submit("realtime_session", request_id=session_id, tenant=ctx.identity.tenant, payload=payload)
    with contextlib.suppress(Exception):  # the session's record must not end it; a lost one is a gap record
        await audit.wait(fut)


routes = [WebSocketRoute(PATH, RealtimeEndpoint(), name="realtime")]
