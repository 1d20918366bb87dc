"""Side by side: the scripted upstream directly, a minimal relay, omnigate, and LiteLLM's proxy.

    python -m bench.compare [--levels 1,16,64,256] [--chunks 64]
                            [--targets relay,omnigate-off,omnigate-noaudit,omnigate,omnigate-traced,litellm]
                            [--before DIR] [--out FILE] [--smoke]

The proxies run on core 0 (started together, idle but for their turn); the
upstream and this load generator share core 1. For each level, the targets take
turns in ``--rounds`` rounds, each turn a run straight at the upstream and one
through the target, and the figures are against the direct runs of the same turns: added TTFT p50/p99,
added inter-chunk gap, requests/s, the proxy's CPU seconds per 1,000 requests
and per streamed 64-chunk request; then RSS per open stream with 256 streams
held open, and idle RSS. ``omnigate-off`` has an empty policy chain, ``omnigate`` the
default one, ``omnigate-noaudit`` an empty chain and no audit trail (what the durable
audit costs), ``omnigate-traced`` the default chain with every request traced (what tracing costs): it
exports OTLP/HTTP to a receiver in this process, which counts the spans, and each of its turns ends when
the spans of its requests are in, less the process's idle CPU over that wait. Its batch processor exports
at least once a second instead of every 5 s, so the wait is short; under load a batch of 512 spans fills
sooner than that, so the exports are the default's. LiteLLM's proxy is installed on first use into
``.bench/litellm-venv`` (``litellm[proxy]==1.100.0``, the newest release whose proxy extra installs).
``--smoke`` runs the targets at two small levels; LiteLLM's proxy only where it is installed already.
``omnigate-before`` with ``--before DIR`` runs the default chain from another checkout (e.g. a
``git worktree`` of an older commit), so before and after take turns in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from bench.common import (
    ROOT,
    LoadResult,
    add_smoke,
    bench_engine,
    cpu_seconds,
    emit,
    free_port,
    out_path,
    pct,
    pin_self,
    rss_kib,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)

LITELLM_VENV = ROOT / ".bench" / "litellm-venv"
# litellm 1.101 and later move the proxy into a package `litellm-proxy` that PyPI does not serve;
# 1.100.0 is the newest release whose `[proxy]` extra installs.
LITELLM_VERSION = "1.100.0"
#: the target whose traces are exported, all of them, to :class:`TraceSink`
TRACED = "omnigate-traced"
#: omnigate-traced's batch span processor exports at least this often (the default is 5 s): the longest a
#: turn waits for its last spans. Under load a batch (512 spans) fills sooner, so its exports are the default's.
BSP_DELAY_S = 1.0


def _merge(into: LoadResult, part: LoadResult) -> None:
    into.ttft += part.ttft
    into.gaps += part.gaps
    into.totals += part.totals
    into.chunks += part.chunks
    into.errors += part.errors
    into.requests += part.requests
    into.wall += part.wall


def _litellm_bin() -> Path:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
            check=True,
        )
    return exe


class TraceSink:
    """An OTLP/HTTP trace receiver that counts spans: ``POST /v1/traces`` answered as a collector answers
    (200, an empty ``ExportTraceServiceResponse``). It runs in the load generator, on core 1."""

    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        self.spans += sum(len(ss.spans) for rs in export.resource_spans for ss in rs.scope_spans)
        self.exports += 1
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def start(self) -> TraceSink:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def settle(self, expected: float = math.inf) -> float:
        """Wait until ``expected`` spans have come, or none for longer than the batch processor holds them;
        return the seconds waited."""
        t0 = since = time.monotonic()
        seen = self.spans
        while self.spans < expected:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            if self.spans != seen:
                seen, since = self.spans, now
            elif now - since > BSP_DELAY_S + 0.5:
                break
        return time.monotonic() - t0


def _omnigate(
    up_port: int, port: int, chain: str, audit: bool = True, traces_to: str | None = None
) -> list[str]:
    # The relay and LiteLLM's proxy have no admission limits or per-engine caps; lift omnigate's so the
    # comparison measures relaying (with its defaults it sheds above 16 and refuses above 64 streams).
    cfg = {
        "engines": [bench_engine(up_port)],
        # "default": the chain a config without a ``policies`` key gets (load shedding, request limits and
        # the media policies: fetch, limits, the NSFW screen), as a user gets it.
        **({"policies": {"pre": []}} if chain == "off" else {}),
        "traffic": {"soft_limit": 10000, "hard_limit": 10000},
        "logging": {"level": "warning"},
        "audit": {"enabled": audit},
        # every request traced, exported as a deployment exports them (OTLP/HTTP, the batch processor)
        **({"tracing": {"enabled": "on", "endpoint": traces_to, "sample_ratio": 1.0}} if traces_to else {}),
    }
    path = Path(tempfile.mkdtemp()) / "omnigate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)]


#: the checkout ``omnigate-before`` runs (``--before``)
_BEFORE: list[str] = []


def _start(
    target: str, up_port: int, port: int, traces_to: str | None = None
) -> tuple[subprocess.Popen, str]:
    """Start a proxy on core 0; return it and its readiness URL (``traces_to``: omnigate-traced's receiver)."""
    if target == "relay":
        args = ["-m", "bench.relay", "--port", str(port), "--upstream", f"http://127.0.0.1:{up_port}/v1"]
        return spawn(args, cpu=0), f"http://127.0.0.1:{port}/health"
    if target in ("omnigate", "omnigate-off", "omnigate-noaudit", "omnigate-before", TRACED):
        # omnigate-noaudit: policies off and no audit trail, to see what the durable audit costs.
        # omnigate-before: the default chain served by another checkout's code (--before DIR), for
        # before-and-after figures taken in turns within one run.
        # omnigate-traced: the default chain, every request traced: what tracing on costs.
        chain = "default" if target in ("omnigate", "omnigate-before", TRACED) else "off"
        tree = Path(_BEFORE[0]) if target == "omnigate-before" and _BEFORE else None
        if target == "omnigate-before" and tree is None:
            raise SystemExit("omnigate-before needs --before DIR (a checkout of the code to compare with)")
        traces = traces_to if target == TRACED else None
        return spawn(
            _omnigate(up_port, port, chain, audit=target != "omnigate-noaudit", traces_to=traces),
            cpu=0,
            env={"OTEL_BSP_SCHEDULE_DELAY": str(int(BSP_DELAY_S * 1000))} if traces else None,
            cwd=tree,
        ), f"http://127.0.0.1:{port}/readyz"
    if target == "litellm":
        exe = _litellm_bin()
        cfg = {
            "model_list": [
                {
                    "model_name": "bench",
                    "litellm_params": {
                        "model": "hosted_vllm/scripted",
                        "api_base": f"http://127.0.0.1:{up_port}/v1",
                        "api_key": "x",
                    },
                }
            ],
            "litellm_settings": {"drop_params": True, "telemetry": False},
        }
        path = Path(tempfile.mkdtemp()) / "litellm.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        proc = subprocess.Popen(
            [
                "taskset",
                "-c",
                "0",
                str(exe),
                "--config",
                str(path),
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return proc, f"http://127.0.0.1:{port}/health/liveliness"
    raise ValueError(target)


async def _set_script(up_port: int, **script) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{up_port}/_script", json=script) as r:
        r.raise_for_status()


async def _hold_open(url: str, body: dict, n: int, seconds: float) -> int:
    """Open ``n`` streams, read their first chunk, hold them ``seconds``; return how many were open."""
    opened = 0
    release, all_open = asyncio.Event(), asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal opened
        async with session.post(url, json=body) as resp:
            await resp.content.readline()
            opened += 1
            if opened == n:
                all_open.set()
            await release.wait()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(n)]
        with contextlib.suppress(TimeoutError):  # the ones that opened are held and counted all the same
            await asyncio.wait_for(all_open.wait(), timeout=60)
        await asyncio.sleep(seconds)
        count = opened
        release.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return count


async def _held_rss(
    proc: subprocess.Popen, url: str, body: dict, up_port: int, args: argparse.Namespace
) -> dict:
    """RSS per open stream: ``args.hold`` streams held open on a slow upstream."""
    await _set_script(up_port, flavour="vllm", chunk_delay_s=0.5, text=" ".join(["w"] * 40))
    try:
        before = rss_kib(proc.pid)
        held = asyncio.create_task(_hold_open(url, body, args.hold, args.hold_s))
        peak = before
        while not held.done():
            peak = max(peak, rss_kib(proc.pid))
            await asyncio.sleep(0.2)
        opened = held.result()
    finally:
        await _set_script(
            up_port,
            flavour="vllm",
            chunk_delay_s=args.chunk_delay_ms / 1000,
            text=" ".join(["w"] * args.chunks),
        )
    return {"held_streams": opened, "rss_kib_per_open_stream": (peak - before) / max(1, opened)}


class _TracedTurns:
    """omnigate-traced's turns. Each ends when the spans of its requests are in, so their export is charged
    to it and not to the next target's turn; the process's idle CPU over that wait, measured between its
    turns, is taken off again."""

    def __init__(self, sink: TraceSink, pid: int, spans_per_request: float) -> None:
        self.sink, self.pid, self.spans_per_request = sink, pid, spans_per_request
        self.idle_s = self.idle_cpu = 0.0
        self._mark = (time.monotonic(), cpu_seconds(pid))

    def begin(self) -> int:
        now, cpu = time.monotonic(), cpu_seconds(self.pid)
        self.idle_s += now - self._mark[0]
        self.idle_cpu += cpu - self._mark[1]
        return self.sink.spans

    async def end(self, spans0: int, requests: int) -> tuple[int, float]:
        """Wait for the turn's spans; return how many came and the seconds waited."""
        waited = await self.sink.settle(spans0 + self.spans_per_request * requests)
        self._mark = (time.monotonic(), cpu_seconds(self.pid))
        return self.sink.spans - spans0, waited

    @property
    def idle_cpu_per_s(self) -> float:
        return self.idle_cpu / self.idle_s if self.idle_s else 0.0


async def run(args: argparse.Namespace) -> dict:
    pin_self(1)
    up_port = free_port()
    upstream = scripted_upstream(
        up_port, "vllm", 1, "--chunks", str(args.chunks), "--chunk-delay-ms", str(args.chunk_delay_ms)
    )
    body = {
        "model": "bench",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4096,
    }
    out: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "chunks_per_request": args.chunks,
        "chunk_delay_ms": args.chunk_delay_ms,
        "targets": {},
        "direct": {},
    }
    procs: dict[str, subprocess.Popen] = {}
    sink = await TraceSink().start() if TRACED in args.targets else None
    traced: _TracedTurns | None = None
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        direct_url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        direct_body = {**body, "model": "scripted"}
        # Every proxy is started up front (idle ones cost nothing), so the targets can take turns within
        # each round: this VM's speed drifts by tens of percent over minutes, and measuring one target
        # after another would charge that drift to whichever ran in a slow spell.
        urls: dict[str, str] = {}
        for target in args.targets:
            port = free_port()
            procs[target], ready = _start(target, up_port, port, sink.url if sink else None)
            await wait_http(ready, timeout=180)
            urls[target] = f"http://127.0.0.1:{port}/v1/chat/completions"
            warm = await stream_load(urls[target], body, 4, 20)  # warm-up
            if target == TRACED and sink is not None:
                # Every span of the warm-up in: how many a request makes, what each turn then waits for.
                await sink.settle()
                if not sink.spans:
                    raise SystemExit(f"{TRACED} exported no spans to {sink.url}")
                traced = _TracedTurns(
                    sink, procs[target].pid, sink.spans / max(1, warm.requests + warm.errors)
                )
        await asyncio.sleep(1)
        for target, proc in procs.items():
            out["targets"][target] = {"idle_rss_mib": rss_kib(proc.pid) / 1024, "levels": {}}
        for c in args.levels:
            # A p99 over a few hundred samples is one of the largest handful; the TTFT target is at one
            # stream, so that level gets enough requests for its p99 to mean something.
            n = max(args.min_requests, c * 2, args.one_stream_requests if c == 1 else 0)
            per_round = max(c, n // args.rounds)
            direct = {t: LoadResult() for t in args.targets}
            proxied = {t: LoadResult() for t in args.targets}
            cpu = dict.fromkeys(args.targets, 0.0)
            spans, flush_wait = 0, 0.0
            for i in range(args.rounds):
                # Direct and proxied runs alternate, and the targets take turns in a rotating order.
                for target in args.targets[i % len(args.targets) :] + args.targets[: i % len(args.targets)]:
                    _merge(direct[target], await stream_load(direct_url, direct_body, c, per_round))
                    turn = traced if target == TRACED else None
                    spans0 = turn.begin() if turn else 0
                    cpu0 = cpu_seconds(procs[target].pid)
                    part = await stream_load(urls[target], body, c, per_round)
                    _merge(proxied[target], part)
                    if turn:
                        got, waited = await turn.end(spans0, part.requests + part.errors)
                        spans, flush_wait = spans + got, flush_wait + waited
                    cpu[target] += cpu_seconds(procs[target].pid) - cpu0
            if traced:
                idle = traced.idle_cpu_per_s * flush_wait
                cpu[TRACED] -= idle
            for target in args.targets:
                d, r = direct[target], proxied[target]
                out["direct"].setdefault(target, {})[c] = {
                    "ttft_p50_ms": pct(d.ttft, 50) * 1e3,
                    "ttft_p99_ms": pct(d.ttft, 99) * 1e3,
                    "total_p50_ms": pct(d.totals, 50) * 1e3,
                    "requests_per_s": d.requests / d.wall,
                }
                out["targets"][target]["levels"][c] = {
                    "requests": r.requests,
                    "errors": r.errors,
                    "ttft_p50_ms": pct(r.ttft, 50) * 1e3,
                    "ttft_p99_ms": pct(r.ttft, 99) * 1e3,
                    "added_ttft_p50_ms": (pct(r.ttft, 50) - pct(d.ttft, 50)) * 1e3,
                    "added_ttft_p99_ms": (pct(r.ttft, 99) - pct(d.ttft, 99)) * 1e3,
                    "added_gap_p50_ms": (pct(r.gaps, 50) - pct(d.gaps, 50)) * 1e3,
                    # the end of the stream, as the client sees it (what batching the writes shortens)
                    "total_p50_ms": pct(r.totals, 50) * 1e3,
                    "requests_per_s": r.requests / r.wall,
                    "cpu_s_per_1000_requests": cpu[target] / max(1, r.requests) * 1000,
                    "cpu_ms_per_request": cpu[target] / max(1, r.requests) * 1e3,
                }
            if traced:
                served = proxied[TRACED].requests + proxied[TRACED].errors
                out["targets"][TRACED]["levels"][c].update(
                    {
                        # what the receiver got: the run shows the traces were exported, all of them
                        "spans_received": spans,
                        "spans_per_request": spans / max(1, served),
                        "flush_wait_s": flush_wait,
                        "idle_cpu_ms_taken_off": idle * 1e3,
                    }
                )
        if traced and sink:
            out["traces"] = {
                "receiver": "OTLP/HTTP /v1/traces in the load generator (core 1), answering 200",
                "spans_per_request_warm_up": traced.spans_per_request,
                "idle_cpu_ms_per_s": traced.idle_cpu_per_s * 1e3,
                "spans": sink.spans,
                "exports": sink.exports,
            }
            print(
                f"{TRACED}: {sink.spans} spans in {sink.exports} exports, "
                f"{traced.spans_per_request:g} per request",
                file=sys.stderr,
            )
        for target in args.targets:
            out["targets"][target].update(await _held_rss(procs[target], urls[target], body, up_port, args))
        return out
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                # waited for off the loop: the traced gateway's shutdown flushes its last spans to the sink
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if sink:
            await sink.stop()
        upstream.terminate()
        upstream.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,16,64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument(
        "--targets",
        default=f"relay,omnigate-off,omnigate-noaudit,omnigate,{TRACED},litellm",
        type=lambda s: s.split(","),
    )
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0)
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument(
        "--one-stream-requests",
        type=int,
        default=1200,
        help="requests at one stream (where the TTFT target is), per target and side",
    )
    ap.add_argument("--rounds", type=int, default=4, help="direct and proxied runs alternate this many times")
    ap.add_argument("--hold", type=int, default=256)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="whole runs, each with fresh processes; the summary gives each figure's median and range",
    )
    ap.add_argument("--hold-s", type=float, default=3.0, help="seconds the held streams stay open")
    ap.add_argument(
        "--before", help="a checkout of older code: the target omnigate-before runs it (before and after)"
    )
    add_smoke(ap)
    args = ap.parse_args()
    if args.before:
        _BEFORE.append(args.before)
    if args.smoke:
        args.levels, args.chunks, args.min_requests, args.one_stream_requests = [1, 4], 8, 8, 8
        args.rounds, args.hold, args.hold_s, args.repeats = 2, 8, 0.5, 1
        missing = {}
        if "litellm" in args.targets and not (LITELLM_VENV / "bin" / "litellm").exists():
            args.targets = [t for t in args.targets if t != "litellm"]
            missing["litellm"] = (
                f"LiteLLM's proxy is not installed in {LITELLM_VENV.relative_to(ROOT)} "
                "(a full run installs it)"
            )
        emit(smoke_result(asyncio.run(run(args)), args, missing), out_path(args, "compare"))
        return
    if args.repeats == 1:
        emit(asyncio.run(run(args)), args.out)
        return
    runs = [asyncio.run(run(args)) for _ in range(args.repeats)]
    emit(
        {"machine": runs[0]["machine"], "repeats": args.repeats, "summary": summarize(runs), "runs": runs},
        args.out,
    )


_SUMMARIZED = (
    "added_ttft_p50_ms",
    "added_ttft_p99_ms",
    "cpu_ms_per_request",
    "requests_per_s",
    "total_p50_ms",
)
#: the figures the lean-request-line issue holds omnigate to, as ratios to the relay of the same run
_TO_RELAY = ("cpu_ms_per_request", "requests_per_s", "total_p50_ms")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    """Per target and level, each figure's median over the runs and its range (this VM drifts between runs)."""
    out: dict = {}
    for target, first in runs[0]["targets"].items():
        for level in first["levels"]:
            row = out.setdefault(target, {}).setdefault(level, {})
            for key in _SUMMARIZED:
                row[key] = _spread([r["targets"][target]["levels"][level][key] for r in runs])
            # Against the relay of the same run: what the ratios compare.
            if target != "relay" and "relay" in runs[0]["targets"]:
                for key in _TO_RELAY:
                    row[f"{key}_to_relay"] = _spread(
                        [
                            r["targets"][target]["levels"][level][key]
                            / r["targets"]["relay"]["levels"][level][key]
                            for r in runs
                        ]
                    )
                row["added_ttft_p50_to_relay"] = _spread(
                    [
                        r["targets"][target]["levels"][level]["added_ttft_p50_ms"]
                        / r["targets"]["relay"]["levels"][level]["added_ttft_p50_ms"]
                        for r in runs
                    ]
                )
            # Against omnigate of the same run: what tracing on (or the older code) adds to a request.
            if target in (TRACED, "omnigate-before") and "omnigate" in runs[0]["targets"]:
                mine = [r["targets"][target]["levels"][level]["cpu_ms_per_request"] for r in runs]
                base = [r["targets"]["omnigate"]["levels"][level]["cpu_ms_per_request"] for r in runs]
                row["added_cpu_ms_per_request_to_omnigate"] = _spread(
                    [m - b for m, b in zip(mine, base, strict=True)]
                )
                row["cpu_ms_per_request_to_omnigate"] = _spread(
                    [m / b for m, b in zip(mine, base, strict=True)]
                )
            if "spans_per_request" in first["levels"][level]:
                row["spans_per_request"] = _spread(
                    [r["targets"][target]["levels"][level]["spans_per_request"] for r in runs]
                )
    return out


if __name__ == "__main__":
    main()
