"""A minimal streaming relay, the yardstick for the gateway's CPU cost.

One aiohttp process with one pooled upstream session: it forwards the request
body, parses each upstream SSE chunk and re-serialises it to the client. No
validation, no policies, no metrics: the least a relay that looks at every
chunk can do.

    python -m bench.relay --port 9100 --upstream http://127.0.0.1:9001/v1
    python -m bench.relay --smoke [--out FILE]

``--smoke`` starts the scripted upstream and the relay (each its own process, as
``bench.compare`` runs them), streams a few requests through it and reports the chunks.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import orjson
from aiohttp import web

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    url = upstream.rstrip("/") + "/chat/completions"

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with app["session"].post(url, data=body, headers={"content-type": "application/json"}) as up:
            resp = web.StreamResponse(
                headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
            )
            await resp.prepare(request)
            async for line in up.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    await resp.write(b"data: [DONE]\n\n")
                    break
                await resp.write(b"data: " + orjson.dumps(orjson.loads(data)) + b"\n\n")
            await resp.write_eof()
            return resp

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def smoke() -> dict:
    up_port, port = free_port(), free_port()
    upstream = scripted_upstream(up_port, "vllm", None, "--chunks", "8")
    relay = spawn(
        ["-m", "bench.relay", "--port", str(port), "--upstream", f"http://127.0.0.1:{up_port}/v1"], cpu=None
    )
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        await wait_http(f"http://127.0.0.1:{port}/health")
        body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        res = await stream_load(f"http://127.0.0.1:{port}/v1/chat/completions", body, 2, 4)
        return {
            "requests": res.requests,
            "errors": res.errors,
            "chunks": res.chunks,
            "done": res.requests == 4 and res.errors == 0,
        }
    finally:
        for proc in (relay, upstream):
            proc.terminate()
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--upstream")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        emit(smoke_result(asyncio.run(smoke()), args), out_path(args, "relay"))
        return
    if not args.upstream:
        ap.error("--upstream is required")
    web.run_app(make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
