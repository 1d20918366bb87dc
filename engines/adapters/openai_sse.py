"""An OpenAI-compatible engine's SSE body: its ``data:`` payloads, read a batch per socket read, and what
is left of it after ``[DONE]``.

A stream that ended with ``[DONE]`` keeps its connection: the chunked body's
terminator often arrives in a segment of its own just after ``[DONE]`` (uvicorn,
under vLLM, writes it separately), and aiohttp closes a connection released
before its body ended. So the rest of the body is read in the background (at most
``_DRAIN_BYTES`` within ``_DRAIN_S``) and the connection goes back to the pool;
the client's stream does not wait for it. Without this, a share of requests paid
a new TCP connection to the engine on their way to the first token.

The stream that reads it is :meth:`engines.adapters.openai_compat.OpenAICompatEngine.stream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from core.errors import EngineProtocolError

_DATA = b"data:"
#: the payload that ends a stream
DONE = b"[DONE]"
# One SSE line may carry a large audio chunk (base64), never megabytes of it.
MAX_LINE_BYTES = 16 * 1024 * 1024
# What may follow [DONE] before the body's end (its terminator; a server's trailing bytes), and how long.
_DRAIN_BYTES = 64 * 1024
_DRAIN_S = 2.0


async def sse_data(content: aiohttp.StreamReader, engine: str) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of an SSE body, a batch per read: every complete line that read brought.

    One read of the socket usually holds several events (an engine streaming faster
    than the gateway reads); splitting them here costs one ``bytes.split`` instead of
    two ``readline`` calls per event. Lines end with ``\n`` (a ``\r`` before it is
    stripped); an unterminated line longer than ``MAX_LINE_BYTES`` is a protocol error.
    """
    tail = b""
    async for chunk in content.iter_any():
        if tail:
            chunk = tail + chunk
        if b"\n" not in chunk:
            tail = chunk
        else:
            *lines, tail = chunk.split(b"\n")
            batch = [line[5:].strip() for line in lines if line.startswith(_DATA)]
            if batch:
                yield batch
        if len(tail) > MAX_LINE_BYTES:
            raise EngineProtocolError(
                f"engine {engine} sent an SSE line over {MAX_LINE_BYTES} bytes", engine=engine
            )
    if tail.startswith(_DATA):
        yield [tail[5:].strip()]


async def finish_body(resp: aiohttp.ClientResponse) -> None:
    """Read what is left of a body after ``[DONE]`` so its connection can be reused; close it otherwise."""
    reusable = False
    try:
        left = _DRAIN_BYTES
        async with asyncio.timeout(_DRAIN_S):
            while left > 0 and (chunk := await resp.content.readany()):
                left -= len(chunk)
        reusable = resp.content.is_eof()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        if reusable:
            resp.release()
        else:
            resp.close()
