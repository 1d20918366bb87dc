"""One media part's probe and normalisation, as plain functions a decoding worker process runs.

Everything here takes and returns picklable values (the part, its settings, what the engines take),
so ``media-limits`` can run it in a worker (policies/media/sandbox.py). :func:`probe_part` reads
headers only, so request-level checks run before anything is decoded; :func:`process_part` decodes,
bounded by the bytes the request may still hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidMedia, MediaTooLarge
from core.spooled import SpooledMedia
from policies.media import budget as tokens
from policies.media.audio import AudioResult, decode_pcm, normalise_audio, probe_audio
from policies.media.budget import BudgetConfig
from policies.media.config import AudioConfig, ImageConfig, VideoConfig
from policies.media.container import check_declared, check_one_file
from policies.media.image import normalise_image, open_image
from policies.media.parts import MediaRef, Output, data_uri, make_part, output_part
from policies.media.shared import SharedOut
from policies.media.targets import MediaTarget
from policies.media.video import encode_jpeg, encode_mp4, plan_frames, probe_video, sample_frames


@dataclass(frozen=True, slots=True)
class Settings:
    image: ImageConfig
    audio: AudioConfig
    video: VideoConfig
    budget: BudgetConfig


@dataclass(slots=True)
class Probed:
    """Header facts of one part and the modal tokens it will cost at most."""

    ref: MediaRef
    tokens: int
    seconds: float = 0.0


@dataclass(slots=True)
class Done:
    ref: MediaRef
    parts: list[Any]
    tokens: int  # per engine call (the longest segment for a segmented part)
    actions: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    audio: AudioResult | None = None
    out_bytes: int = 0
    #: (media type, input_audio format) when the part is served as the client's own bytes
    same: tuple[str, str | None] | None = None

    def restore(self, data: bytes | Callable[[], bytes]) -> None:
        """Rebuild a marker's part from the bytes the parent kept.

        The client's own string is reused when it already says what the bytes are (``input_audio``
        base64 always does, with the format set here): a second base64 copy of a large part is
        what a request's peak memory would otherwise be made of.
        """
        if self.same is None:
            return
        mediatype, fmt = self.same
        value = self.ref.value
        head = self.ref.head
        plain_base64 = self.ref.type == "input_audio" and not head.startswith("data:")
        # (input_audio carries plain base64: a spooled data URI's payload cannot be cut out of its file)
        keeps = not (self.ref.type == "input_audio" and isinstance(value, SpooledMedia))
        if plain_base64 or (keeps and head.startswith(f"data:{mediatype};base64,")):
            uri: str | SpooledMedia = value
        else:  # the bytes are asked for only here: a shared part is copied out only when re-encoded
            uri = data_uri(mediatype, data() if callable(data) else data)
        self.parts = [make_part(self.ref.type, uri, fmt)]
        self.same = None


def _video_budget(cfg: Settings, target: MediaTarget) -> int:
    b = cfg.budget
    return b.max_modal_tokens if "video" in b.counted else target.context_tokens // 2


def probe_part(ref: MediaRef, data: bytes, cfg: Settings, target: MediaTarget) -> Probed:
    """Headers only: what the part will cost, so a request that will be refused costs no decode."""
    check_one_file(data, ref.kind, ref.param)
    if ref.kind == "image":
        im = open_image(data, cfg.image, ref.param)
        try:
            w, h = im.size
        finally:
            im.close()
        from policies.media.image import target_size

        tw, th = target_size(w, h, cfg.image.max_pixels, cfg.image.vision_max_res)
        return Probed(ref, tokens.image_tokens(tw, th, cfg.budget))
    if ref.kind == "audio":
        info = probe_audio(data, ref.param)
        seconds = min(info.duration_s, cfg.audio.segment_s)
        return Probed(ref, tokens.audio_tokens(seconds, cfg.budget), info.duration_s)
    video = probe_video(data, ref.param)
    try:
        used, count = plan_frames(video, cfg.video)
    except InvalidMedia as exc:
        raise InvalidMedia(f"{ref.param}: {exc.message}", param=ref.param) from None
    size = tokens.frame_size_for(
        count,
        video.width,
        video.height,
        _video_budget(cfg, target),
        cfg.video.min_frame_pixels,
        cfg.video.max_frame_pixels,
        cfg.budget,
    )
    return Probed(ref, tokens.video_tokens(count, size[0], size[1], cfg.budget), used)


def process_part(
    ref: MediaRef,
    data: bytes,
    cfg: Settings,
    target: MediaTarget,
    declared: str | None,
    room: int,
    out: SharedOut | None = None,
) -> Done:
    """Decode and normalise one part; ``room`` is the bytes of output the request may still hold.

    A part served as the client's own bytes comes back as a marker (:attr:`Done.same`), not as a
    copy: the parent holds those bytes already, and sending them back would double the cost of
    the process boundary for the commonest case.
    """
    check_one_file(data, ref.kind, ref.param)
    if ref.kind == "image":
        done = _image(ref, data, cfg, declared)
    elif ref.kind == "audio":
        done = _audio(ref, data, cfg, target, declared, room, out)
    else:
        done = _video(ref, data, cfg, target, declared)
    done.out_bytes = sum(_size(p) for p in done.parts) + (
        done.audio.held_bytes if done.audio is not None else 0
    )
    if done.same is not None:
        done.out_bytes = 0  # the input's bytes, already counted
        done.parts = []
    if done.out_bytes > room:
        raise MediaTooLarge(
            f"{ref.param}: decoding the part produces {done.out_bytes:,} bytes, more than the "
            f"{room:,} the request may still hold",
            param=ref.param,
        )
    return done


def _size(part: Any) -> int:
    if isinstance(part, Output):
        return part.chars
    url = getattr(getattr(part, part.type, None), "url", None)
    if url is None and part.type == "input_audio":
        url = part.input_audio.data
    return len(url or "")


def _image(ref: MediaRef, data: bytes, cfg: Settings, declared: str | None) -> Done:
    r = normalise_image(data, cfg.image, ref.param, declared)
    # Unchanged bytes still get the media type they really have, whatever the client or server claimed.
    same = r.data is data or r.data == data
    part = None if same else output_part(ref.type, r.mediatype, r.data)
    return Done(
        ref,
        [part] if part is not None else [],
        tokens.image_tokens(r.width, r.height, cfg.budget),
        r.actions,
        {"format": r.source_format.lower(), "width": r.source_width, "height": r.source_height},
        same=(r.mediatype, None) if same else None,
    )


def _audio(
    ref: MediaRef,
    data: bytes,
    cfg: Settings,
    target: MediaTarget,
    declared: str | None,
    room: int,
    out: SharedOut | None = None,
) -> Done:
    r = normalise_audio(data, cfg.audio, target.audio_rate, ref.param, declared, max_bytes=room)
    longest = max(end - start for start, end in r.boundaries)
    same = r.data is data
    part = None if same else output_part(ref.type, r.mediatype, r.data, r.fmt, out)
    return Done(
        ref,
        [part] if part is not None else [],
        tokens.audio_tokens(longest, cfg.budget),
        r.actions,
        {"format": r.info.container, "duration_s": round(r.info.duration_s, 3)},
        r if r.segments is not None else None,
        same=(r.mediatype, r.fmt) if same else None,
    )


def _video(ref: MediaRef, data: bytes, cfg: Settings, target: MediaTarget, declared: str | None) -> Done:
    vcfg, budget = cfg.video, cfg.budget
    info = probe_video(data, ref.param)
    check_declared("video", declared, info.container, ref.param)
    if info.width * info.height > vcfg.max_input_pixels:
        raise InvalidMedia(
            f"{ref.param}: the video is {info.width}x{info.height}; the limit is {vcfg.max_input_pixels:,} pixels",
            param=ref.param,
        )
    try:
        used, count = plan_frames(info, vcfg)
    except InvalidMedia as exc:
        raise InvalidMedia(f"{ref.param}: {exc.message}", param=ref.param) from None
    size = tokens.frame_size_for(
        count,
        info.width,
        info.height,
        _video_budget(cfg, target),
        vcfg.min_frame_pixels,
        vcfg.max_frame_pixels,
        budget,
    )
    frames = sample_frames(data, used, count, vcfg.fps, size, ref.param, max_decoded=vcfg.max_decoded_frames)
    actions: list[str] = []
    if used < info.duration_s - 1e-3:
        actions.append("video-trimmed")
    if info.fps > vcfg.fps + 0.01 or size != (info.width, info.height):
        actions.append("video-resampled")
    if info.has_audio:
        actions.append("video-audio-dropped")
    if target.video_form == "frames":
        actions.append("video-as-frames")
        parts = [
            make_part("image_url", data_uri("image/jpeg", encode_jpeg(f, vcfg.frame_quality))) for f in frames
        ]
    else:
        parts = [output_part(ref.type, "video/mp4", encode_mp4(frames, vcfg.fps, vcfg.crf))]
    facts = {
        "format": info.container,
        "width": info.width,
        "height": info.height,
        "duration_s": round(info.duration_s, 3),
        "frames": len(frames),
    }
    return Done(ref, parts, tokens.video_tokens(len(frames), size[0], size[1], budget), actions, facts)


def screen_pcm(data: bytes, param: str, max_s: float, max_bytes: int | None = None) -> Any:
    """A speech screen's input: the audio as 16 kHz mono PCM (probed first, so non-audio costs no decode)."""
    probe_audio(data, param)
    pcm, _ = decode_pcm(data, 16000, param, max_s, max_bytes)
    return pcm
