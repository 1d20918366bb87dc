"""The engine adapter protocol: what an engine can do, what the pipeline calls, what leaves for it.

Adapters translate their upstream's wire shape into :class:`~core.events.Delta` events, so the
rest of the gateway never sees vLLM-Omni's base64-audio-in-``content`` quirk or
litellm's objects: text is text, audio is PCM16 bytes, and they cannot be
confused. Foreign exceptions are mapped to :mod:`core.errors` inside the
adapter that meets them.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import orjson

from core.capabilities import Capabilities
from core.errors import EngineProtocolError, MediaURLForbidden
from core.events import Completion, Delta
from core.spooled import SpooledMedia

if TYPE_CHECKING:
    from core.schemas import ChatCompletionRequest
    from engines.adapters.settings import EngineConfig


#: re-exported: adapters and callers import the capabilities from here, the kernel defines them
__all__ = ["Capabilities", "Completion", "Delta"]


def declared(config: EngineConfig, **more: Any) -> Capabilities:
    """The capabilities an adapter declares from its configuration: modalities, video form, audio rate
    and context (what an operator states of the engine), plus what the adapter itself adds (``more``)."""
    ins, outs = config.modalities()
    return Capabilities(
        input_modalities=ins,
        output_modalities=outs,
        video_form=config.video_form(),
        audio_rate=config.audio_rate(),
        context_tokens=config.max_context_tokens,
        **more,
    )


@runtime_checkable
class Engine(Protocol):
    """What the pipeline needs from an engine.

    ``stream`` returns an async generator; the caller always closes it
    (``aclose``), which must abort the upstream request.
    """

    name: str
    config: EngineConfig
    capabilities: Capabilities

    async def start(self) -> None: ...

    def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]: ...

    async def complete(self, request: ChatCompletionRequest) -> Completion: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...


def checked_index(value: object, bound: int, what: str, engine: str) -> int:
    """``value`` as an index below ``bound``, or an engine protocol error.

    An engine's index says where a piece of its answer goes (a choice among the request's ``n``, a
    tool call among the answer's), and the gateway sizes lists by it: it is checked where the engine's
    words are read, before anything is built from it. Only a JSON integer is an index (not a bool,
    a float or a string that looks like one).
    """
    if type(value) is not int or not 0 <= value < bound:
        raise EngineProtocolError(
            f"engine {engine} sent {what} index {value!r:.40}; expected an integer from 0 to {bound - 1}",
            engine=engine,
        )
    return value


# -- what leaves for an engine ----------------------------------------------------------------------------
_URL_FIELDS = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url"}
#: The only media an engine is sent: base64 data URIs, which the gateway's media steps produced.
_DATA_PREFIX = "data:"


def wire_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as every adapter sends them, refusing any media part that is not data.

    This is the last check before bytes leave for an engine and it cannot be configured away: an
    engine that fetches a URL itself bypasses the gateway's SSRF rules, so any part still carrying
    one (whatever the chain or tenant policy set did) is refused with a 400 naming the part.
    """
    for mi, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for pi, part in enumerate(message.content):
            field_name = _URL_FIELDS.get(part.type)
            if field_name is None:
                continue
            url = getattr(part, field_name).url
            head = url.header if isinstance(url, SpooledMedia) else url[:5]
            if head[:5].lower() != _DATA_PREFIX:
                param = f"messages.{mi}.content.{pi}.{field_name}.url"
                raise MediaURLForbidden(
                    f"{param}: media must be sent as data; this URL is not allowed", param=param
                )
    return [m.wire() for m in request.messages]


def whole_strings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each spooled payload as the one string a library that takes messages needs.

    Only for adapters that hand messages to a library (litellm): the bodies this module writes take a
    spooled payload a piece at a time instead.
    """

    return [_whole(m) for m in messages]


def _whole(value: Any) -> Any:
    if isinstance(value, SpooledMedia):
        return value.text()
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


# -- the request body, in pieces --------------------------------------------------------------------------
#: strings at least this long (media: data URIs, base64) are written into the body a slice at a time
LARGE_STRING = 1 << 16
#: characters of a large string encoded per piece of the body
BODY_PIECE = 1 << 18


@dataclass(slots=True)
class Body:
    """An engine request's JSON body as pieces: the document's small JSON, cut where its large strings go.

    A body carrying media is never serialised whole: each media string is the part's own ``str`` (held
    once, by the request), JSON-encoded ``BODY_PIECE`` characters at a time as the connection takes them
    (escaping is per character, so slices encode on their own). Sending it costs a piece beside the
    request instead of a second copy of all its media, and a third where the socket's send buffer would
    keep what it could not send at once. Its length is not known before it is sent: HTTP/1.1 chunked.
    """

    #: JSON bytes and large strings, alternating (a large string stands for its JSON string)
    pieces: list[bytes | str | SpooledMedia]

    def chunks(self) -> Iterator[bytes]:
        for piece in self.pieces:
            if isinstance(piece, bytes):
                yield piece
                continue
            yield b'"'
            if isinstance(piece, SpooledMedia):
                # A header and base64: nothing JSON escapes. Re-encoded from the spool as the socket drains.
                for text in piece.pieces():
                    yield text.encode("ascii")
                yield b'"'
                continue
            for i in range(0, len(piece), BODY_PIECE):
                yield orjson.dumps(piece[i : i + BODY_PIECE])[1:-1]
            yield b'"'

    async def stream(self) -> AsyncIterator[bytes]:
        """The pieces for an HTTP client that writes an async iterable with backpressure (aiohttp)."""
        for chunk in self.chunks():
            yield chunk

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks())


def request_body(doc: dict[str, Any]) -> bytes | Body:
    """``doc`` as a JSON body: plain bytes, or a :class:`Body` of pieces when it carries large strings.

    Large strings are looked for in ``doc["messages"]`` only (media parts); each is replaced, in a
    copy of the structure, by a marker no client can know, and the small rest serialised once. A
    request without one (every text request) costs one look at its messages and orjson, as before.
    """
    messages = doc.get("messages")
    if not _has_large(messages):
        return orjson.dumps(doc)
    marker = secrets.token_hex(16)
    large: list[str | SpooledMedia] = []
    skeleton = orjson.dumps({**doc, "messages": _lift(messages, marker, large)})
    cut = re.split(b'"' + marker.encode() + rb'(\d+)"', skeleton)
    return Body([large[int(piece)] if i % 2 else piece for i, piece in enumerate(cut)])


def _lift(value: Any, marker: str, large: list[str | SpooledMedia]) -> Any:
    """``value`` with each large string (and spooled payload) appended to ``large`` and a marker in its place.

    A module function, not a closure: a recursive closure is a reference cycle (the function and its
    own cell), which would keep ``large`` (the request's media) alive until the next collection.
    """
    if isinstance(value, SpooledMedia) or (isinstance(value, str) and len(value) >= LARGE_STRING):
        large.append(value)
        return f"{marker}{len(large) - 1}"
    if isinstance(value, dict):
        return {k: _lift(v, marker, large) for k, v in value.items()}
    if isinstance(value, list):
        return [_lift(v, marker, large) for v in value]
    return value


def _has_large(messages: Any) -> bool:
    """Whether a message carries a string of ``LARGE_STRING`` characters or more (text messages are
    looked at field by field: this runs for every request)."""
    for message in messages if isinstance(messages, list) else ():
        for v in message.values() if isinstance(message, dict) else ():
            if isinstance(v, SpooledMedia) or (isinstance(v, str) and len(v) >= LARGE_STRING):
                return True
            if isinstance(v, (list, dict)) and _nested_large(v):
                return True
    return False


def _nested_large(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, SpooledMedia):
            return True
        if isinstance(v, str):
            if len(v) >= LARGE_STRING:
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False
