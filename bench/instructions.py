"""Instructions per streamed request under Valgrind's callgrind: a count that the machine's load does not move.

    python -m bench.instructions --tree NAME=DIR [--tree NAME=DIR ...] [--requests 200] [--streams 1,16]
                                 [--chunks 64] [--out FILE] [--smoke]

CPU seconds per request on this shared 2-core machine move by more between runs than a few per cent of a
change (bench/RESULTS.md, "Tracing off, again"). Callgrind counts the instructions the gateway's process
executes (every thread of it: the event loop, the audit writer), which do not depend on what else the
machine runs. Each ``--tree`` (``.`` for this checkout, or another checkout's directory, e.g. a ``git
worktree`` of an older commit) serves the default chain with the SQLite audit trail on, as
``bench.compare``'s ``omnigate`` does, in front of the scripted vLLM engine (``--chunks`` content chunks per
answer, no delays). The process starts with instrumentation off (Valgrind still translates its code, so
start-up takes a minute or two); after a warm-up, instrumentation is switched on (``callgrind_control -i
on``) for ``--requests`` streamed requests at each level of ``--streams``, and the count is read from the
profile dumped at the end of each level. Instructions are not time (a cache miss costs more than an add),
but a code change that adds work adds instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import (
    ROOT,
    add_smoke,
    bench_engine,
    emit,
    free_port,
    out_path,
    scripted_upstream,
    smoke_result,
    stream_load,
    wait_http,
)

BODY = {
    "model": "bench",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4096,
}


def _config(up_port: int, folder: Path) -> Path:
    cfg = {
        "engines": [bench_engine(up_port)],
        "traffic": {"soft_limit": 10000, "hard_limit": 10000},
        "logging": {"level": "warning"},
        "audit": {"enabled": True, "sqlite_path": str(folder / "audit.db")},
    }
    path = folder / "omnigate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def _total(profile: Path) -> int:
    """The instructions (``Ir``) a callgrind profile counted: its ``totals:`` (or ``summary:``) line."""
    text = profile.read_text(errors="replace")
    found = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.MULTILINE)
    if found is None:
        raise ValueError(f"{profile}: no totals line")
    return int(found.group(1))


def _read_dump(folder: Path) -> int | None:
    for dump in folder.glob("callgrind.out.*.*"):
        try:
            return _total(dump)
        except ValueError:
            pass  # still being written
    return None


def _clear(folder: Path) -> None:
    for old in folder.glob("callgrind.out.*"):
        old.unlink()


async def _dumped(folder: Path, timeout: float = 120.0) -> int:
    """The instructions of the dump callgrind writes for the level (its file complete: a totals line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        total = _read_dump(folder)
        if total is not None:
            return total
        await asyncio.sleep(0.5)
    raise SystemExit(f"{folder}: no callgrind dump in {timeout:.0f} s")


async def _tree(name: str, tree: Path, up_port: int, args: argparse.Namespace) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"instructions-{name}-"))
    port = free_port()
    out = folder / "callgrind.out"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}.%p",
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(_config(up_port, folder)),
        "--port",
        str(port),
    ]
    log = (folder / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    figures: dict[str, float] = {}
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", timeout=900)
        await stream_load(url, BODY, 4, args.warmup)
        for streams in args.streams:
            _clear(folder)
            _control("-z", str(proc.pid))  # zero the counters
            _control("-i", "on", str(proc.pid))
            t0 = time.monotonic()
            result = await stream_load(url, BODY, streams, args.requests)
            # The dump is written when the process next runs instrumented code: asked for while it still is
            # on, and waited for (the dump of part N is callgrind.out.PID.N).
            _control("-d", str(proc.pid))
            total = await _dumped(folder)
            _control("-i", "off", str(proc.pid))
            if result.errors or result.requests != args.requests:
                raise SystemExit(
                    f"{name}: {result.errors} errors, {result.requests} of {args.requests} served"
                )
            figures[f"instructions_per_request_{streams}"] = total / args.requests
            figures[f"wall_s_{streams}"] = round(time.monotonic() - t0, 1)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    return figures


async def _run(args: argparse.Namespace) -> dict:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not installed")
    up_port = free_port()
    upstream = scripted_upstream(up_port, "vllm", None, "--chunks", str(args.chunks), "--chunk-delay-ms", "0")
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        trees = {}
        for name, folder in args.tree:
            trees[name] = await _tree(name, folder, up_port, args)
    finally:
        upstream.terminate()
        upstream.wait(30)
    out: dict = {"chunks_per_request": args.chunks, "requests_per_level": args.requests, "trees": trees}
    names = list(trees)
    if len(names) > 1:
        base = trees[names[0]]
        out["against_" + names[0]] = {
            name: {
                key: round(100 * (value / base[key] - 1), 2)
                for key, value in figures.items()
                if key.startswith("instructions")
            }
            for name, figures in trees.items()
            if name != names[0]
        }
    return out


def _tree_arg(text: str) -> tuple[str, Path]:
    name, _, folder = text.partition("=")
    if not name or not folder:
        raise argparse.ArgumentTypeError("a tree is NAME=DIR")
    path = Path(folder).resolve() if folder != "." else ROOT
    return name, path


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=_tree_arg, action="append", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--streams", default=[1, 16], type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--chunks", type=int, default=64)
    add_smoke(ap)
    args = ap.parse_args()
    args.tree = args.tree or [("this", ROOT)]
    if args.smoke:
        args.requests, args.warmup, args.streams, args.chunks = 8, 4, [2], 8
    result = asyncio.run(_run(args))
    emit(smoke_result(result, args) if args.smoke else result, out_path(args, "instructions"))


if __name__ == "__main__":
    main()
