"""A realtime session relayed to the engine's own ``WS /v1/realtime`` (an engine configured
``realtime: passthrough``): each turn's committed audio goes to the engine in vLLM-Omni's dialect, and its
answer comes back as the Realtime protocol's response events (rendered by the same :class:`Turn` a
chat-backed turn uses).

The session's own handling stays the gateway's (its input limits, VAD, budgets, cancellation); only the
per-turn pipeline (policies, speech gate, failover) is skipped: the engine answers directly.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from core.context import RequestContext
from core.errors import GuardUnavailable
from engines.adapters.settings import EngineConfig
from gateway.realtime import events as ev
from gateway.realtime.audio import Resampler, digest, seconds
from gateway.realtime.turn import Emit, Status, Turn

log = structlog.get_logger("omnigate.realtime")

ENGINE_RATE = 16000  # vLLM-Omni's realtime input: 16 kHz PCM16
_PIECE = ENGINE_RATE // 10 * 2  # 100 ms of it per append
_AUDIO_DELTA = frozenset({"response.audio.delta", "response.output_audio.delta"})
_AUDIO_DONE = frozenset({"response.audio.done", "response.output_audio.done"})

Audit = Callable[[str, dict[str, Any]], Awaitable[None]]
Gone = Callable[[], Awaitable[None]]


class EngineGone(Exception):
    """The engine's socket closed or failed mid-session."""

    code, message = "engine_gone", "the engine went away"


class EngineSilent(EngineGone):
    """The engine sent nothing for its read timeout while a turn was open."""

    code, message = "engine_timeout", "the engine stopped answering"


@contextlib.asynccontextmanager
async def engine_socket(url: str, api_key: str | None, model: str) -> AsyncIterator[ClientConnection]:
    """The engine's realtime socket for one session, told its model; closed whatever ends the session."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    connecting = connect(url, additional_headers=headers, max_size=None, open_timeout=10, close_timeout=2)
    async with connecting as ws:
        await ws.send(orjson.dumps({"type": "session.update", "model": model}).decode())
        yield ws


def realtime_url(base_url: str) -> str:
    """The engine's ``/v1`` URL as its realtime socket's."""
    url = base_url.rstrip("/")
    url = "ws" + url[4:] if url.startswith("http") else url
    return url + "/realtime"


def engine_for(engines: Sequence[EngineConfig], model: str) -> EngineConfig | None:
    """The passthrough engine of a session's model (its first such engine), or None."""
    for e in engines:
        if model in e.serves and e.kind == "vllm-omni" and e.realtime == "passthrough" and e.base_url:
            return e
    return None


def check_guards(engine: EngineConfig | None, chain: Mapping[str, Sequence[str]]) -> None:
    """Refuse a passthrough session under a chain with output guards (stream or post policies): the engine's
    answer never passes through them, so serving it would break the promise the chain makes."""
    guards = [*chain.get("stream", ()), *chain.get("post", ())]
    if engine is not None and guards:
        raise GuardUnavailable(
            f"engine {engine.name!r} serves realtime sessions by passthrough (realtime: passthrough), which "
            f"cannot apply the output guards of this key's policy chain ({', '.join(guards)}); configure the "
            "engine realtime: chat, or give the key a policy set without stream or post policies",
            code="passthrough_unguarded",
        )


def relay_for(
    engines: Sequence[EngineConfig], model: str, stack: contextlib.AsyncExitStack, audit: Audit, gone: Gone
) -> Relay | None:
    """The relay of a session whose model is on a passthrough engine, or None."""
    e = engine_for(engines, model)
    if e is None or e.base_url is None:
        return None
    key = e.api_key.get_secret_value() if e.api_key else None
    url = realtime_url(str(e.base_url))
    return Relay(url, key, e.model, e.realtime_read_timeout_s, stack, audit, gone)


class Relay:
    """Runs each turn of a session over the engine's socket (one turn at a time, as the session runs them).

    The socket opens with the first turn and is closed on the session's exit stack, so whatever ends the
    session closes it. The engine answers every committed turn to its end: a turn cancelled after its commit
    leaves the rest of its answer owed, read and dropped before the next turn's; one cancelled before its
    commit went out leaves half its audio in the engine's buffer, so its socket is replaced instead."""

    def __init__(
        self,
        url: str,
        key: str | None,
        model: str,
        read_timeout_s: float,
        stack: contextlib.AsyncExitStack,
        audit: Audit,
        gone: Gone,
    ) -> None:
        self._url, self._key, self._model, self._read_timeout_s = url, key, model, read_timeout_s
        self._ws: ClientConnection | None = None
        self._socket = contextlib.AsyncExitStack()  # the socket of the moment
        stack.push_async_callback(self._close)
        self._owed = 0  # cancelled turns whose answer the engine is still sending
        self._stale = False  # cancelled mid-send: the socket is replaced before the next turn
        self.broken = False  # the engine went away or silent: the session ends after this turn
        self._audit, self._gone = audit, gone

    @property
    def ws(self) -> ClientConnection:
        assert self._ws is not None
        return self._ws

    async def run(self, ctx: RequestContext, turn: Turn, audio_in: bytes, in_rate: int, emit: Emit) -> Status:
        """Send the turn's audio, relay the answer as events; returns how it ended."""
        resample = Resampler(turn.out_rate)
        audio_out = bytearray()
        started = committed = False
        try:
            await self._ready()
            await self._send_audio(audio_in, in_rate)
            committed = True
            async for event in self._events():
                kind = event.get("type")
                if not started and kind in _AUDIO_DELTA | {"transcription.delta"}:
                    started = True
                    await emit(turn.part_added(False))
                if kind in _AUDIO_DELTA and turn.audio:
                    pcm = _pcm(event.get("delta"))
                    out = resample(pcm, int(event.get("sample_rate_hz") or ENGINE_RATE))
                    if out:
                        audio_out += out
                        await emit(turn.audio_delta(out))
                elif kind == "transcription.delta" and isinstance(event.get("delta"), str):
                    await emit(turn.text_delta(event["delta"]))
                elif kind == "error":
                    error: dict[str, Any] = event["error"] if isinstance(event.get("error"), dict) else event
                    turn.error = {
                        "type": "server_error",
                        "code": "engine_error",
                        "message": str(error.get("message") or "the engine refused the turn"),
                    }
                    return await self._end(ctx, turn, audio_out, "failed")
                elif _ends(kind):
                    break
            tail = resample.flush()
            if tail:
                audio_out += tail
                await emit(turn.audio_delta(tail))
        except asyncio.CancelledError:
            if committed:
                self._owed += 1
            else:
                self._stale = self._ws is not None
            raise
        except EngineGone as exc:
            turn.error = {"type": "server_error", "code": exc.code, "message": exc.message}
            self.broken = True
            await self._close()  # before anything is said: the engine may not keep the socket from here
            await self._end(ctx, turn, audio_out, "failed")
            await emit(
                ev.RealtimeError(exc.message, code=exc.code, type_="server_error", fatal=True).event(None)
            )
            return "failed"  # its response.done follows; then end_session()
        return await self._end(ctx, turn, audio_out, "completed")

    async def end_session(self) -> None:
        """After a broken engine's turn is told: the session closes (1011)."""
        await self._gone()

    async def _ready(self) -> None:
        """The socket, opened or replaced as needed, with the answers of cancelled turns drained."""
        if self._stale:
            await self._close()
        if self._ws is None:
            try:
                self._ws = await self._socket.enter_async_context(
                    engine_socket(self._url, self._key, self._model)
                )
            except (OSError, TimeoutError, WebSocketException) as exc:
                raise EngineGone from exc
        while self._owed:
            async for event in self._events():
                if event.get("type") == "error" or _ends(event.get("type")):
                    break
            self._owed -= 1

    async def _close(self) -> None:
        self._ws, self._owed, self._stale = None, 0, False
        socket, self._socket = self._socket, contextlib.AsyncExitStack()
        with contextlib.suppress(OSError, WebSocketException):
            await socket.aclose()

    async def _send_audio(self, pcm: bytes, rate: int) -> None:
        to_engine = Resampler(ENGINE_RATE)
        audio = to_engine(pcm, rate) + to_engine.flush()
        try:
            for at in range(0, len(audio), _PIECE):
                piece = base64.b64encode(audio[at : at + _PIECE]).decode("ascii")
                await self.ws.send(
                    orjson.dumps({"type": "input_audio_buffer.append", "audio": piece}).decode()
                )
            await self.ws.send(orjson.dumps({"type": "input_audio_buffer.commit", "final": True}).decode())
        except WebSocketException as exc:
            raise EngineGone from exc

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        """The engine's events while a turn is open; a silence past the read timeout is EngineSilent."""
        while True:
            try:
                async with asyncio.timeout(self._read_timeout_s):
                    raw = await self.ws.recv()
            except TimeoutError as exc:
                raise EngineSilent from exc
            except WebSocketException as exc:
                raise EngineGone from exc
            try:
                event = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # not an event: skipped, as the engine's own clients would
            if isinstance(event, dict):
                yield event

    async def _end(
        self, ctx: RequestContext, turn: Turn, audio_out: bytes | bytearray, status: Status
    ) -> Status:
        """The turn's audit record: the session's marks on it (as a chat-backed turn's), the answer's audio."""
        payload: dict[str, Any] = {
            **(ctx.record.realtime or {}),
            "status": status,
            "audio_out": {
                "sha256": digest(bytes(audio_out)),
                "seconds": round(seconds(len(audio_out), turn.out_rate), 3),
            }
            if audio_out
            else None,
            "transcript_sha256": digest(turn.text.encode()) if turn.text else None,
            "error": turn.error,
        }
        payload = {"event": "turn", **payload}
        await self._audit(turn.request_id, payload)
        return status


def _ends(kind: object) -> bool:
    """The engine's last event of an answer."""
    return isinstance(kind, str) and (kind in _AUDIO_DONE or kind == "response.done")


def _pcm(delta: object) -> bytes:
    if not isinstance(delta, str):
        return b""
    try:
        return base64.b64decode(delta, validate=True)
    except (binascii.Error, ValueError):
        return b""
