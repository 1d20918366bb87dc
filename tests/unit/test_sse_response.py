"""SSEResponse is a Starlette ``Response`` to frameworks: its ``headers`` are the response's headers.

A framework or middleware that adds a header through ``response.headers`` must find a mutable
view of what goes on the wire, not the raw list the response was built with.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.sse import SSEResponse


async def _frames() -> AsyncIterator[bytes]:
    yield b"data: one\n\n"


async def _serve(response: SSEResponse, done: asyncio.Event) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
    return sent


def test_headers_are_a_view_of_the_wire_headers() -> None:
    done = asyncio.Event()  # the upstream's release ends the client's side too

    async def on_close() -> None:
        done.set()

    response = SSEResponse(_frames(), on_close=on_close, headers={"X-Request-Id": "r1"})
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["x-request-id"] == "r1"
    response.headers["x-added"] = "yes"  # what a middleware holding the response may do
    sent = asyncio.run(_serve(response, done))
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    wire = dict(start["headers"])
    assert wire[b"x-added"] == b"yes" and wire[b"cache-control"] == b"no-cache"
    assert [m["body"] for m in sent[1:]] == [b"data: one\n\n", b""]
