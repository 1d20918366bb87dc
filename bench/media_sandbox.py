"""What the decoding sandbox costs, and what a hostile part costs others (issue 15).

    python -m bench.media_sandbox [--repeat N] [--rss] [--out FILE]
    python -m bench.media_sandbox --smoke [--out FILE]

Per figure, the median of N runs of ``media-limits``' per-part work (probe, then decode and
re-encode): in this process, and through the sandbox's worker processes (pickling the part
there and the result back included). Then the peak RSS of the worker against the media bytes
it was handed, and the latency of a small task submitted while another worker is stuck in a
decoder made to hang. ``--smoke`` runs both parts once, on small media, with a 2 s decode deadline
for the hanging decoder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import time

from bench.common import add_smoke, emit, out_path, smoke_result
from policies.media.audio import AudioConfig
from policies.media.budget import BudgetConfig
from policies.media.image import ImageConfig
from policies.media.parts import decode_payload, media_parts
from policies.media.process import MediaTarget, Settings, probe_part, process_part
from policies.media.sandbox import DecoderFailed, Sandbox
from policies.media.video import VideoConfig
from policies.settings import MediaSettings
from tests import hostile_decoders
from tests.media import data_uri, photo, tone, video, wav


def _ref(kind: str, uri: str):
    from core.schemas import ChatCompletionRequest

    part = {
        "image": {"type": "image_url", "image_url": {"url": uri}},
        "video": {"type": "video_url", "video_url": {"url": uri}},
        "audio": {"type": "audio_url", "audio_url": {"url": uri}},
    }[kind]
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    )
    return next(media_parts(req))


def _worker_peak_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def main(repeat: int, smoke: bool = False) -> dict:
    cfg = Settings(ImageConfig(vision_max_res=None), AudioConfig(), VideoConfig(), BudgetConfig())
    target = MediaTarget()
    buf = io.BytesIO()
    width, height = (1600, 1200) if smoke else (4000, 3000)
    photo(width, height).save(buf, "JPEG", quality=90)
    seconds, minutes = (4.0, 0.5) if smoke else (120.0, 10)
    image = f"{width * height / 1e6:.0f} MP JPEG -> 2 MP"
    cases = {
        image: _ref("image", data_uri("image/jpeg", buf.getvalue())),
        f"{seconds:.0f} s 320x240 4 fps H.264 -> 2 fps MP4": _ref(
            "video", data_uri("video/mp4", video(seconds, fps=4))
        ),
        f"{minutes} min 16 kHz WAV (passed through)": _ref(
            "audio", data_uri("audio/wav", wav(tone(minutes * 60), 16000))
        ),
    }
    box = Sandbox(MediaSettings(decode_workers=2, decode_deadline_s=2.0 if smoke else 30.0))
    await box.start()
    out: dict = {"repeat": repeat, "figures": []}
    try:
        for name, ref in cases.items():
            inproc, sandboxed = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                data = decode_payload(ref)
                probe_part(ref, data, cfg, target)
                process_part(ref, data, cfg, target, None, 1 << 30).restore(data)
                inproc.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                data = decode_payload(ref)
                await box.run(probe_part, (ref, data, cfg, target), param="p")
                done = await box.run(process_part, (ref, data, cfg, target, None, 1 << 30), param="p")
                done.restore(data)
                sandboxed.append(time.perf_counter() - t0)
            peak = await box.run(_worker_peak_kib, (), param="p")
            a, b = statistics.median(inproc), statistics.median(sandboxed)
            out["figures"].append(
                {
                    "case": name,
                    "media_bytes": len(ref.value),
                    "in_process_ms": a * 1000,
                    "sandboxed_ms": b * 1000,
                    "overhead_ms": (b - a) * 1000,
                    "worker_peak_rss_mib": peak / 1024,
                }
            )
        # A hostile part stuck in C in one worker; a clean part on the other worker meanwhile.
        small = cases[image]
        hostile = asyncio.create_task(box.run(hostile_decoders.hangs_in_c, (), param="h"))
        await asyncio.sleep(0.2)
        waits = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await box.run(probe_part, (small, decode_payload(small), cfg, target), param="p")
            waits.append(time.perf_counter() - t0)
        try:
            await hostile
        except DecoderFailed as exc:
            out["hostile"] = type(exc).__name__
        out["clean_probe_during_hang_ms"] = statistics.median(waits) * 1000
    finally:
        await box.aclose()
    return out


def _body(part: dict) -> dict:
    return {
        "model": "omni",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}],
    }


def gateway_rss(repeat: int, smoke: bool = False) -> dict:
    """A real ``omnigate serve`` per case: its peak RSS growth for one request against the media bytes.

    The gateway's peak is reset (``/proc/PID/clear_refs``) after a warm-up request, so the growth is
    this request's alone; what the engine was sent is read back from the scripted engine.
    """
    import httpx
    import orjson

    from bench.hostile_media import Rig, hwm_kib

    buf = io.BytesIO()
    photo(4000, 3000).save(buf, "JPEG", quality=90)
    cases = (
        {
            "12 MP JPEG (downsampled to 1024x768, vision_max_res)": (
                "image_url",
                data_uri("image/jpeg", buf.getvalue()),
            ),
            "5 min 16 kHz WAV (passed through)": (
                "audio_url",
                data_uri("audio/wav", wav(tone(300.0), 16000)),
            ),
            "2 min 44.1 kHz WAV (resampled to 16 kHz FLAC)": (
                "audio_url",
                data_uri("audio/wav", wav(tone(120.0, rate=44100), 44100)),
            ),
            # the same path with a part too small to matter: what a request costs whatever its media
            "2 s 44.1 kHz WAV (the path's fixed cost)": (
                "audio_url",
                data_uri("audio/wav", wav(tone(2.0, rate=44100), 44100)),
            ),
            "120 s 640x360 30 fps H.264 (2 fps MP4)": (
                "video_url",
                data_uri("video/mp4", video(120.0, 30, (640, 360))),
            ),
        }
        if not smoke
        else {
            "4 s 320x240 4 fps H.264 (2 fps MP4)": ("video_url", data_uri("video/mp4", video(4.0, 4))),
        }
    )
    rows = []
    for name, (kind, uri) in cases.items():
        rig = Rig.start()
        try:
            engine = "http://127.0.0.1:" + _engine_port(rig)
            with httpx.Client() as client:
                small = _body({"type": "image_url", "image_url": {"url": data_uri("image/png", _png64())}})
                client.post(rig.url + "/v1/chat/completions", json=small, timeout=60)  # warm the code path
                body = orjson.dumps(_body({"type": kind, kind: {"url": uri}}))
                # and the same request once: what is measured is a request's own, not a first use's
                # (a module's first import, an allocator's first arena for that size)
                client.post(
                    rig.url + "/v1/chat/completions",
                    content=body,
                    timeout=120,
                    headers={"content-type": "application/json"},
                )
                before = _reset_peak_kib(rig.gateway.pid)
                with _SpoolWatch(rig.gateway.pid) as spool:
                    resp = client.post(
                        rig.url + "/v1/chat/completions",
                        content=body,
                        timeout=120,
                        headers={"content-type": "application/json"},
                    )
                after = hwm_kib(rig.gateway.pid)
                forwarded = client.get(engine + "/_stats").json().get("last_body_bytes", 0)
                growth = (after - before) * 1024
                rows.append(
                    {
                        "case": name,
                        "status": resp.status_code,
                        "media_bytes": len(uri),
                        "body_bytes": len(body),
                        "forwarded_bytes": forwarded,
                        "peak_rss_growth_mib": growth / 2**20,
                        "peak_rss_mib": after / 1024,
                        "peak_over_forwarded": growth / forwarded if forwarded else None,
                        "peak_over_body": growth / len(body),
                        # the spooled payloads (shared-memory files, outside the RSS): their peak
                        "spool_peak_mib": spool.peak / 2**20,
                    }
                )
                if kind == "video_url":
                    rows[-1]["clean_latency"] = _clean_latency(
                        client, rig, _body({kind: {"url": uri}, "type": kind}), repeat
                    )
        finally:
            rig.stop()
    return {"rows": rows}


class _SpoolWatch:
    """The peak total size of the gateway's spool files (core/spooled.py) while a request runs.

    Sampled every millisecond from another thread; the files are the payloads the body reader wrote,
    which count in the shared-memory file system's use and not in the gateway's RSS.
    """

    def __init__(self, pid: int) -> None:
        import threading

        self.prefix = f"omnigate-{pid}-"
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from core import spooled

        while not self._stop.is_set():
            total = 0
            for entry in os.scandir(spooled.SHM_DIR):
                if entry.name.startswith(self.prefix):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
            self.peak = max(self.peak, total)
            time.sleep(0.001)

    def __enter__(self) -> _SpoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _engine_port(rig) -> str:
    return rig.upstream.args[rig.upstream.args.index("--port") + 1]


def _reset_peak_kib(pid: int) -> int:
    """Make the process's current RSS its peak (VmHWM); that RSS in KiB (the peak so far where not allowed)."""
    from bench.hostile_media import hwm_kib, rss_kib

    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return hwm_kib(pid)
    return rss_kib(pid)


def _png64() -> bytes:
    from tests.media import plain_image, png

    return png(plain_image(64))


def _clean_latency(client, rig, hostile_body: dict, repeat: int) -> dict:
    """A small text request's latency alone, and while the video above is being decoded."""
    import concurrent.futures

    clean = {"model": "omni", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    def one() -> float:
        t0 = time.perf_counter()
        client.post(rig.url + "/v1/chat/completions", json=clean, timeout=60)
        return time.perf_counter() - t0

    alone = statistics.median(one() for _ in range(repeat)) * 1000
    during = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(repeat):
            heavy = pool.submit(client.post, rig.url + "/v1/chat/completions", json=hostile_body, timeout=120)
            time.sleep(0.3)
            during.append(one())
            heavy.result()
    return {"alone_ms": alone, "during_video_decode_ms": statistics.median(during) * 1000}


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rss", action="store_true", help="the per-request RSS figures (real gateways)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        result = {"sandbox": asyncio.run(main(1, smoke=True)), "gateway_rss": gateway_rss(1, smoke=True)}
        emit(smoke_result(result, args), out_path(args, "media_sandbox"))
        return
    result = gateway_rss(args.repeat) if args.rss else asyncio.run(main(args.repeat))
    if args.out:
        emit(result, args.out)
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
