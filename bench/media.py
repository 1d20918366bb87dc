"""Media pre-filter figures: NSFW latency, downsampling, probes, 2 fps sampling, pixel-bomb refusal memory.

    python -m bench.media [--repeat N] [--out FILE] [--smoke]

Each figure is the median of N runs (wall and CPU time of this process, which
is pinned to one core). The pixel-bomb figure runs in a fresh child process so
its peak RSS is not hidden by what the other figures allocated. ``--smoke`` takes a 2 s clip
and a 1 min recording instead of 120 s and 45 min, one run each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np
import soundfile as sf

from bench.common import add_smoke, emit, out_path, pin_self, smoke_result
from policies.media.audio import probe_audio
from policies.media.budget import BudgetConfig, frame_size_for
from policies.media.image import ImageConfig, normalise_image
from policies.media.models import NSFWModel
from policies.media.video import VideoConfig, plan_frames, probe_video, sample_frames
from tests.media import jpeg, photo, png_bomb


def measure(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of ``fn``."""
    walls, cpus = [], []
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        walls.append((time.perf_counter() - w0) * 1000)
        cpus.append((time.process_time() - c0) * 1000)
    return statistics.median(walls), statistics.median(cpus)


def clip_720p(seconds: int = 120, fps: int = 30) -> bytes:
    buf = io.BytesIO()
    w, h = 1280, 720
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.zeros((h, w, 3), np.uint8)
    base[..., 0] = (xx * 255 // w).astype(np.uint8)
    base[..., 1] = (yy * 255 // h).astype(np.uint8)
    with av.open(buf, mode="w", format="mp4") as out:
        s = out.add_stream("libx264", rate=Fraction(fps))
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": "ultrafast", "g": "60"}
        for i in range(seconds * fps):
            arr = base.copy()
            cx = (i * 9) % w
            arr[300:420, max(0, cx - 60) : cx + 60] = (250, 220, 40)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(p)
        for p in s.encode(None):
            out.mux(p)
    return buf.getvalue()


def bomb_child() -> None:
    """Runs in a child: RSS before and after refusing the 50k x 50k PNG header."""
    from core.errors import InvalidMedia

    cfg = ImageConfig()
    data = png_bomb(50_000, 50_000)
    with contextlib.suppress(
        InvalidMedia
    ):  # warm the code path once with a small file so imports are not counted
        normalise_image(png_bomb(9000, 9000), cfg, "p")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        normalise_image(data, cfg, "p")
        refused = False
    except InvalidMedia:
        refused = True
    ms = (time.perf_counter() - t0) * 1000
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "refused": refused,
                "ms": ms,
                "peak_before_kib": before,
                "peak_after_kib": after,
                "bytes": len(data),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bomb-child", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    clip_s, minutes = 120, 45
    if args.smoke:
        args.repeat, clip_s, minutes = 1, 2, 1
    if args.bomb_child:
        bomb_child()
        return
    pin_self(0)
    rows: list[tuple[str, str, str, str]] = []

    model = NSFWModel(threads=1)
    from PIL import Image

    img = Image.open(io.BytesIO(jpeg(photo(1600, 1200))))
    img.load()
    frames = [img.resize((640, 360))] * 8
    wall, cpu = measure(lambda: model.score([img]), args.repeat * 4)
    rows.append(
        (
            "NSFW, one 1600x1200 image (preprocess + inference, 1 thread)",
            f"{wall:.1f} ms",
            f"{cpu:.1f} ms",
            "<= 50 ms",
        )
    )
    wall, cpu = measure(lambda: model.score(frames, batch=8), args.repeat * 2)
    rows.append(("NSFW, one batch of 8 video frames", f"{wall:.1f} ms", f"{cpu:.1f} ms", ""))

    shot = jpeg(photo(4000, 3000), orientation=6, exif_text="camera")
    cfg = ImageConfig(vision_max_res=None)  # the area cap alone: the figure is 12 MP -> 2 MP
    wall, cpu = measure(lambda: normalise_image(shot, cfg, "p"), args.repeat * 2)
    rows.append(
        (
            "12 MP JPEG -> 2 MP (decode, orient, strip, resize, encode)",
            f"{wall:.1f} ms",
            f"{cpu:.1f} ms",
            "<= 150 ms",
        )
    )

    print(f"encoding the {clip_s} s 720p clip (once) ...", file=sys.stderr)
    clip = clip_720p(clip_s)
    info = probe_video(clip, "p")
    wall, cpu = measure(lambda: probe_video(clip, "p"), args.repeat * 4)
    rows.append(
        (
            f"video probe, {clip_s} s 720p30 H.264 ({len(clip) / 1e6:.1f} MB, {info.frames} frames)",
            f"{wall:.2f} ms",
            f"{cpu:.2f} ms",
            "<= 10 ms",
        )
    )
    vcfg = VideoConfig()
    used, count = plan_frames(info, vcfg)
    size = frame_size_for(
        count,
        info.width,
        info.height,
        BudgetConfig().max_modal_tokens,
        vcfg.min_frame_pixels,
        vcfg.max_frame_pixels,
        BudgetConfig(),
    )
    wall, cpu = measure(
        lambda: sample_frames(clip, used, count, vcfg.fps, size, "p"), max(1, args.repeat // 2)
    )
    rows.append(
        (
            f"2 fps sampling of it ({count} frames at {size[0]}x{size[1]})",
            f"{wall:.0f} ms",
            f"{cpu:.0f} ms",
            "<= 4 s CPU",
        )
    )

    pcm = (np.sin(np.arange(16000 * 60 * minutes) * 0.05) * 3000).astype(np.int16)
    for fmt, sub in (("WAV", "PCM_16"), ("FLAC", "PCM_16")):
        buf = io.BytesIO()
        sf.write(buf, pcm, 16000, format=fmt, subtype=sub)
        data = buf.getvalue()
        wall, cpu = measure(lambda data=data: probe_audio(data, "p"), args.repeat * 4)
        rows.append(
            (
                f"audio duration probe, {minutes} min {fmt} ({len(data) / 1e6:.0f} MB)",
                f"{wall:.2f} ms",
                f"{cpu:.2f} ms",
                "<= 10 ms",
            )
        )

    child = subprocess.run(
        [sys.executable, "-m", "bench.media", "--bomb-child"],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    bomb = json.loads(child.stdout.strip().splitlines()[-1])
    growth = (bomb["peak_after_kib"] - bomb["peak_before_kib"]) / 1024
    rows.append(
        (
            f"50k x 50k PNG header refused ({bomb['bytes']} bytes; refused={bomb['refused']})",
            f"{bomb['ms']:.2f} ms",
            f"peak RSS growth {growth:.1f} MiB",
            "<= 200 ms, < 50 MB",
        )
    )

    print("| figure | wall (median) | CPU (median) | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.out or args.smoke:
        result = {
            "rows": [dict(zip(("figure", "wall", "cpu", "target"), row, strict=True)) for row in rows],
            "bomb": bomb,
        }
        emit(smoke_result(result, args), out_path(args, "media"))


if __name__ == "__main__":
    main()
