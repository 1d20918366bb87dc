"""Shared pieces of the benchmarks: processes pinned to cores, a streaming load generator, percentiles."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    args: list[str], cpu: int | None, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """``python args`` on core ``cpu``, from the checkout (or ``cwd``: another checkout's code runs)."""
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []
    return subprocess.Popen(
        [*prefix, sys.executable, *args],
        cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def bench_engine(up_port: int, capped: bool = False) -> dict:
    """The one engine every gateway benchmark routes to: the scripted upstream as vLLM, model ``bench``.
    Uncapped unless ``capped``: a relay and LiteLLM's proxy have no per-engine caps to compare with."""
    engine: dict = {
        "name": "bench-vllm",
        "kind": "vllm",
        "base_url": f"http://127.0.0.1:{up_port}/v1",
        "model": "scripted",
        "variant": "fp16",
        "serves": ["bench"],
    }
    if not capped:
        engine.update(max_in_flight=10000, max_in_flight_overloaded=None)
    return engine


def scripted_upstream(port: int, flavour: str, cpu: int | None, *options: str) -> subprocess.Popen:
    """The scripted engine (``tests/upstream.py``) on ``port``, as the benches start it (``options``: its
    other flags, e.g. ``--chunks``)."""
    return spawn(["-m", "tests.upstream", "--port", str(port), "--flavour", flavour, *options], cpu=cpu)


def emit(result: dict, out: Path | None) -> None:
    """Print a benchmark's result as JSON and, with ``--out``, write it there too."""
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    print(text)
    if out:
        out.write_text(text + "\n")
        print(f"written to {out}", file=sys.stderr)


SMOKE_HELP = "tiny sizes, a few seconds: shows the benchmark still runs (its figures are not to be quoted)"


def add_smoke(ap: argparse.ArgumentParser, out: bool = True) -> None:
    """``--smoke`` (and, with ``out``, ``--out FILE``) on a benchmark's command line."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if out:
        ap.add_argument("--out", type=Path, default=None, help="write the JSON result here too")


def out_path(args: argparse.Namespace, name: str) -> Path | None:
    """Where a run writes its JSON: ``--out``; in smoke mode a temporary file when none is given.

    A smoke run never writes over the recorded results beside the benchmarks (``bench/*.json``).
    """
    out: Path | None = getattr(args, "out", None)
    if not getattr(args, "smoke", False):
        return out
    if out is None:
        return Path(tempfile.mkdtemp(prefix=f"omnigate-smoke-{name}-")) / f"{name}.json"
    if out.resolve().parent == (ROOT / "bench").resolve():
        raise SystemExit(f"a smoke run does not write into bench/ (the recorded results): {out}")
    return out


def smoke_result(result: dict, args: argparse.Namespace, not_measured: dict[str, str] | None = None) -> dict:
    """Mark a smoke run's result as such, with what it could not measure on this host and why."""
    if getattr(args, "smoke", False):
        result = {"smoke": True, **result, "not_measured": not_measured or {}}
        for what, why in (not_measured or {}).items():
            print(f"not measured: {what}: {why}", file=sys.stderr)
    return result


def pin_self(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and every live descendant (the gateway's media decoders, its forkserver),
    plus what its reaped children used, from /proc: a process that exits between two readings is lost."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for p in tree:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / ticks  # utime, stime, cutime, cstime
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} never answered 200")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class LoadResult:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    #: each served stream's end: from sending the request to the end of its body
    totals: list[float] = field(default_factory=list)
    chunks: int = 0
    errors: int = 0
    requests: int = 0
    wall: float = 0.0


async def stream_load(url: str, body: dict, concurrency: int, total: int) -> LoadResult:
    """``concurrency`` workers issue ``total`` streamed requests; TTFT is time to the first content chunk."""
    result = LoadResult()
    payload = orjson.dumps(body)
    remaining = total
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession) -> None:
        t0 = time.perf_counter()
        first = None
        last = None
        try:
            async with session.post(url, data=payload, headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    result.errors += 1
                    await resp.read()
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    doc = orjson.loads(line[6:])
                    if "error" in doc:
                        result.errors += 1
                        return
                    choices = doc.get("choices") or []
                    if not choices or not (choices[0].get("delta") or {}).get("content"):
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        result.ttft.append(now - t0)
                    else:
                        result.gaps.append(now - last)
                    last = now
                    result.chunks += 1
        except (TimeoutError, aiohttp.ClientError):
            result.errors += 1
            return
        result.totals.append(time.perf_counter() - t0)
        result.requests += 1

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one(session)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.wall = time.perf_counter() - t0
    return result
