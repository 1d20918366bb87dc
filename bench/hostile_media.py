"""The hostile media corpus against a real ``omnigate serve``: status, error, time to refusal, peak RSS.

    python -m bench.hostile_media [--out FILE] [--keep DIR] [--index-cost] [--smoke]

The corpus (``bench.hostile_corpus``: pixel bombs, lying headers, truncated
files, polyglots, lying audio and video headers) is written to a temporary
directory and each file sent, one at a time, as a data URI in the content part
of its kind to a gateway process with the default pre chain (``request-limits
→ media-fetch → media-limits → nsfw-screen``) in front of a scripted vLLM-Omni
engine. Per file: the HTTP status, the error's code and param, the wall time
from sending to the answer, and how much the gateway's peak RSS (VmHWM) grew.
For comparison, clean 2, 4 and 8 s clips follow the corpus. ``--index-cost``
also opens MP4s declaring 10^6 to 8x10^7 samples in FFmpeg without the gateway's
check, each in a fresh process. The gateway runs on core 0, the engine and this
client on core 1. ``--smoke`` sends the first file of each category and one clean 2 s clip
(with ``--index-cost``, one MP4 of 10^5 samples).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import hostile_corpus
from bench.common import ROOT, add_smoke, emit, free_port, out_path, pin_self, smoke_result
from bench.hostile_corpus import Sample

MODEL = "omni"


def hwm_kib(pid: int) -> int:
    """Peak resident set size of a process so far (VmHWM), KiB."""
    return _status_kib("VmHWM", pid)


def rss_kib(pid: int) -> int:
    """Resident set size of a process now (VmRSS), KiB."""
    return _status_kib("VmRSS", pid)


def gateway_config(upstream_port: int) -> dict[str, Any]:
    """One vLLM-Omni engine (image, audio and video in); no ``policies`` key: the default pre chain."""
    return {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                "model": "scripted",
                "serves": [MODEL],
                "input_modalities": ["text", "image", "audio", "video"],
            }
        ],
        "logging": {"level": "warning"},
        "routing": {"controller": {"enabled": False}},
    }


@dataclass
class Rig:
    """The scripted engine and the gateway, each its own process."""

    gateway: subprocess.Popen
    upstream: subprocess.Popen
    url: str
    workdir: Path

    @classmethod
    def start(cls, pin: bool = False, ready_timeout: float = 120.0) -> Rig:
        workdir = Path(tempfile.mkdtemp(prefix="omnigate-hostile-"))
        up_port, gw_port = free_port(), free_port()
        cfg = workdir / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(up_port)))
        upstream = _spawn(
            ["-m", "tests.upstream", "--port", str(up_port), "--flavour", "omni"],
            workdir / "upstream.log",
            cpu=1 if pin else None,
        )
        gateway = _spawn(
            ["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(gw_port)],
            workdir / "gateway.log",
            cpu=0 if pin else None,
        )
        rig = cls(gateway, upstream, f"http://127.0.0.1:{gw_port}", workdir)
        try:
            rig._wait(f"http://127.0.0.1:{up_port}/health", ready_timeout)
            rig._wait(rig.url + "/readyz", ready_timeout)
        except BaseException:
            rig.stop()
            raise
        return rig

    def _wait(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in (self.gateway, self.upstream):
                if proc.poll() is not None:
                    raise RuntimeError(f"a process exited with {proc.returncode}: see {self.workdir}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{url} never answered 200")

    def log(self) -> str:
        path = self.workdir / "gateway.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in (self.gateway, self.upstream):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _spawn(args: list[str], log: Path, cpu: int | None) -> subprocess.Popen:
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []
    with log.open("wb") as out:  # a file, not a pipe: a full pipe would stall the process
        return subprocess.Popen(
            [*prefix, sys.executable, *args],
            cwd=ROOT,
            env=os.environ.copy(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def request_body(sample: Sample) -> dict[str, Any]:
    part = sample.content_part(base64.b64encode(sample.data).decode("ascii"))
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}],
    }


def send(client: httpx.Client, rig: Rig, sample: Sample, timeout: float = 60.0) -> dict[str, Any]:
    """One sample through the gateway: what came back, how long it took, how much the peak RSS grew."""
    before = hwm_kib(rig.gateway.pid)
    t0 = time.perf_counter()
    resp = client.post(rig.url + "/v1/chat/completions", json=request_body(sample), timeout=timeout)
    took = time.perf_counter() - t0
    after = hwm_kib(rig.gateway.pid)
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    return {
        "name": sample.name,
        "category": sample.category,
        "part": sample.part,
        "bytes": len(sample.data),
        "expect": sample.expect,
        "status": resp.status_code,
        "code": error.get("code") if isinstance(error, dict) else None,
        "param": error.get("param") if isinstance(error, dict) else None,
        "message": (error.get("message") or "")[:200] if isinstance(error, dict) else None,
        "error_shape_ok": isinstance(error, dict) and set(error) == {"message", "type", "param", "code"},
        "degraded": resp.headers.get("x-omnigate-degraded"),
        "ms": round(took * 1000, 2),
        "hwm_growth_kib": after - before,
        "hwm_kib": after,
    }


def warm_up(client: httpx.Client, rig: Rig, parts: tuple[str, ...] | None = None) -> None:
    """Clean images, audio and video first, so lazily built decoders and models are in the baseline."""
    for sample in hostile_corpus.benign():
        if parts is not None and sample.part not in parts:
            continue
        resp = client.post(rig.url + "/v1/chat/completions", json=request_body(sample), timeout=120)
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up {sample.name}: {resp.status_code} {resp.text[:300]}")


def ordinary_video(
    client: httpx.Client, rig: Rig, lengths: tuple[float, ...] = (2.0, 4.0, 8.0)
) -> list[dict[str, Any]]:
    """For comparison, clean 320x240 clips of 2, 4 and 8 s after the corpus: the peak RSS each leaves."""
    out = []
    for seconds in lengths:
        sample = hostile_corpus.clean_video(seconds)
        row = send(client, rig, sample, timeout=120)
        out.append(
            {
                "seconds": seconds,
                "status": row["status"],
                "ms": row["ms"],
                "hwm_mib": round(row["hwm_kib"] / 1024, 1),
            }
        )
    return out


def summarise(rows: list[dict[str, Any]], baseline_kib: int, idle_kib: int) -> dict[str, Any]:
    refused = [r for r in rows if 400 <= r["status"] < 500]
    times = [r["ms"] for r in refused]
    by_category: dict[str, dict[str, Any]] = {}
    for r in rows:
        c = by_category.setdefault(
            r["category"], {"files": 0, "refused": 0, "served": 0, "other": 0, "max_refusal_ms": None}
        )
        c["files"] += 1
        c[_outcome(r["status"])] += 1
        if _outcome(r["status"]) == "refused":
            c["max_refusal_ms"] = max(c["max_refusal_ms"] or 0.0, r["ms"])
    slowest = max(refused, key=lambda r: r["ms"]) if refused else None
    peak = max([baseline_kib, *(r["hwm_kib"] for r in rows)])
    return {
        "files": len(rows),
        "refused_4xx": len(refused),
        "served_200": sum(r["status"] == 200 for r in rows),
        "5xx": sum(r["status"] >= 500 for r in rows),
        "not_as_expected": [
            {k: r[k] for k in ("name", "status", "code", "message")}
            for r in rows
            if _outcome(r["status"]) != {"refuse": "refused", "serve": "served"}[r["expect"]]
        ],
        "bad_error_shape": [r["name"] for r in refused if not r["error_shape_ok"]],
        "codes": {
            code: sum(r["code"] == code for r in refused) for code in sorted({r["code"] for r in refused})
        },
        "refusal_ms": {
            "p50": round(statistics.median(times), 1) if times else None,
            "p90": round(statistics.quantiles(times, n=10)[-1], 1) if len(times) > 1 else None,
            "max": round(max(times), 1) if times else None,
            "slowest": slowest["name"] if slowest else None,
        },
        "rss": {
            "idle_hwm_mib": round(idle_kib / 1024, 1),
            "after_warm_up_hwm_mib": round(baseline_kib / 1024, 1),
            "peak_hwm_mib": round(peak / 1024, 1),
            "peak_growth_over_corpus_mib": round((peak - baseline_kib) / 1024, 1),
            "largest_single_file_growth_kib": max((r["hwm_growth_kib"] for r in rows), default=0),
            "largest_growth_file": max(rows, key=lambda r: r["hwm_growth_kib"])["name"] if rows else None,
        },
        "by_category": by_category,
    }


def _outcome(status: int) -> str:
    return "refused" if 400 <= status < 500 else "served" if status == 200 else "other"


def run(keep: Path | None = None, pin: bool = True, smoke: bool = False) -> dict[str, Any]:
    if pin:
        pin_self(1)
    corpus_dir = keep or Path(tempfile.mkdtemp(prefix="omnigate-corpus-"))
    written = hostile_corpus.write(corpus_dir)
    if smoke:  # the first file of each category
        firsts: dict[str, tuple[Sample, Path]] = {}
        for sample, path in written:
            firsts.setdefault(sample.category, (sample, path))
        written = list(firsts.values())
    rig = Rig.start(pin=pin)
    try:
        idle = hwm_kib(rig.gateway.pid)
        with httpx.Client() as client:
            warm_up(client, rig)
            baseline = hwm_kib(rig.gateway.pid)
            rows = [send(client, rig, replace(sample, data=path.read_bytes())) for sample, path in written]
            ordinary = ordinary_video(client, rig, (2.0,) if smoke else (2.0, 4.0, 8.0))
        alive = rig.gateway.poll() is None
    finally:
        rig.stop()
        if keep is None:
            shutil.rmtree(corpus_dir, ignore_errors=True)
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "command": "python -m bench.hostile_media",
        "gateway_alive_after": alive,
        "summary": summarise(rows, baseline, idle),
        "ordinary_video_after": ordinary,
        "files": rows,
    }


def index_cost(samples: int) -> dict[str, Any]:
    """What FFmpeg's MP4 demuxer spends opening a 1 s clip whose tables declare ``samples`` samples.

    Runs without the gateway's check, in a fresh child process (its peak RSS is its own), to
    show what the sample-table check in ``policies.media.container`` prevents.
    """
    out = subprocess.run(
        [sys.executable, "-m", "bench.hostile_media", "--open-unchecked", str(samples)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _open_unchecked(samples: int) -> None:
    import io

    import av

    data = hostile_corpus.declared_frames_mp4(samples)
    # Reset this process's VmHWM (Linux >= 4.0), so the peak read after the open is the open's own.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    try:
        with av.open(io.BytesIO(data)):
            outcome = "opened"
    except av.FFmpegError as exc:
        outcome = type(exc).__name__
    took = time.perf_counter() - t0
    growth = _status_kib("VmHWM") - before
    print(
        json.dumps(
            {
                "samples": samples,
                "file_bytes": len(data),
                "outcome": outcome,
                "open_ms": round(took * 1000, 1),
                "peak_rss_growth_mib": round(growth / 1024, 1),
            }
        )
    )


def _status_kib(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the full JSON (every file) here")
    ap.add_argument("--keep", type=Path, default=None, help="write the corpus here and keep it")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the gateway and the client to cores")
    ap.add_argument(
        "--index-cost",
        action="store_true",
        help="also measure FFmpeg opening MP4s that declare 1e6..8e7 samples, unchecked",
    )
    ap.add_argument("--open-unchecked", type=int, default=None, help=argparse.SUPPRESS)
    add_smoke(ap, out=False)
    args = ap.parse_args()
    if args.open_unchecked is not None:
        _open_unchecked(args.open_unchecked)
        return
    result = run(args.keep, pin=not args.no_pin, smoke=args.smoke)
    if args.index_cost:
        sizes = (10**5,) if args.smoke else (10**6, 10**7, 4 * 10**7, 8 * 10**7)
        result["ffmpeg_index_cost_unchecked"] = [index_cost(n) for n in sizes]
    if args.smoke:
        emit(smoke_result(result, args), out_path(args, "hostile_media"))
        return
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2))


if __name__ == "__main__":
    main()
