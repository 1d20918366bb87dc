"""The engines' SSE reader against a real socket: ``data:`` payloads batched per read, whatever the boundaries."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from core.errors import EngineProtocolError
from engines.adapters.openai_sse import MAX_LINE_BYTES, sse_data


async def _read(pieces: list[bytes]) -> list[list[bytes]]:
    """Serve ``pieces`` as separate writes (a pause after each) and read them back through ``sse_data``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.002)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as resp,
        ):
            return [batch async for batch in sse_data(resp.content, "e")]
    finally:
        await runner.cleanup()


async def test_events_split_anywhere_come_out_whole_and_in_order() -> None:
    body = b"".join(b'data: {"i": %d}\n\n' % i for i in range(30)) + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(body)):
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        flat = [d for batch in await _read(pieces) for d in batch]
        assert flat == [b'{"i": %d}' % i for i in range(30)] + [b"[DONE]"]


async def test_events_that_arrive_together_come_out_as_one_batch() -> None:
    body = b"".join(b"data: %d\n\n" % i for i in range(10))
    assert await _read([body]) == [[b"%d" % i for i in range(10)]]


async def test_comments_other_fields_and_crlf_endings() -> None:
    body = b': keep-alive\r\n\r\nevent: x\r\nid: 3\r\ndata: {"a": 1}\r\n\r\ndata:[DONE]\r\n\r\n'
    assert [d for b in await _read([body]) for d in b] == [b'{"a": 1}', b"[DONE]"]


async def test_a_last_line_without_newline_is_kept() -> None:
    assert [d for b in await _read([b"data: 1\n\n", b"data: [DONE]"]) for d in b] == [b"1", b"[DONE]"]


async def test_an_endless_line_is_a_protocol_error_not_unbounded_memory() -> None:
    chunk = b"data: " + b"x" * (1024 * 1024)
    with pytest.raises(EngineProtocolError):
        await _read([chunk] * (MAX_LINE_BYTES // len(chunk) + 2))
