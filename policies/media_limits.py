"""Built-in pre-policy ``media-limits``: probe, limit and normalise every media part.

Runs after ``media-fetch`` (every part is data by then). Images are capped in
pixels and downsampled above 2 MP; audio is probed from its header, resampled
to the engine's rate and cut into 2,400 s segments above 40 minutes; video is
probed, trimmed or refused beyond 120 s, sampled at 2 fps (at most 240 frames)
and handed over as a short MP4 or as frames, as the engines serving the model
take it. Then the one-modality-per-message rule and the modal-token budget.
Decoding runs on a small thread pool, off the event loop. Every rewrite is a
degradation reason (``x-omnigate-degraded``) and is listed on the part's
:class:`gateway.context.MediaRecord`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from gateway.context import MediaRecord, RequestContext, Segmentation
from gateway.errors import (
    ContextLengthExceeded,
    InvalidMedia,
    InvalidRequest,
    MediaURLForbidden,
    ModalBudgetExceeded,
)
from gateway.schemas import PART_MODALITY, ChatCompletionRequest, Message
from policies.base import PolicyConfig
from policies.media import budget as tokens
from policies.media.audio import AudioConfig, AudioResult, normalise_audio
from policies.media.budget import BudgetConfig
from policies.media.container import check_declared, check_one_file
from policies.media.image import ImageConfig, normalise_image
from policies.media.parts import (
    MediaRef,
    data_uri,
    declared_type,
    decode_payload,
    make_part,
    media_parts,
    replace_parts,
)
from policies.media.video import VideoConfig, encode_jpeg, encode_mp4, plan_frames, probe_video, sample_frames


class MediaLimitsConfig(PolicyConfig):
    image: ImageConfig = ImageConfig()
    audio: AudioConfig = AudioConfig()
    video: VideoConfig = VideoConfig()
    budget: BudgetConfig = BudgetConfig()
    one_modality_per_message: Literal["split", "refuse", "off"] = Field(
        default="split", description="Qwen-Omni takes one non-text modality per message: split it or refuse"
    )
    workers: Annotated[int, Field(ge=1, le=32)] = 2


@dataclass(frozen=True, slots=True)
class MediaTarget:
    """What the engines behind one public model take."""

    video_form: str = "video"  # video | frames
    audio_rate: int | None = 16000
    context_tokens: int = 65536


@dataclass(slots=True)
class _Done:
    ref: MediaRef
    parts: list[Any]
    tokens: int  # per engine call (the longest segment for a segmented part)
    actions: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    audio: AudioResult | None = None


def targets_from(engines: list[Any]) -> dict[str, MediaTarget]:
    """One target per public model: the most conservative of the engines serving it."""
    by_model: dict[str, list[Any]] = {}
    for e in engines:
        for public in e.serves:
            by_model.setdefault(public, []).append(e)
    out: dict[str, MediaTarget] = {}
    order = {"primary": 0, "canary": 1, "fallback": 2}
    for model, cfgs in by_model.items():
        cfgs = sorted(cfgs, key=lambda c: order[c.role])
        video = "video" if all(c.video_form() == "video" for c in cfgs) else "frames"
        rates = [c.audio_rate() for c in cfgs if c.audio_rate() is not None]
        out[model] = MediaTarget(video, rates[0] if rates else None, min(c.max_context_tokens for c in cfgs))
    return out


class MediaLimits:
    name: ClassVar[str] = "media-limits"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = MediaLimitsConfig
    runs_after: ClassVar[tuple[str, ...]] = ("media-fetch",)

    def __init__(self, config: MediaLimitsConfig) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="omnigate-media")
        self._targets: dict[str, MediaTarget] = {}
        self._metrics: Any = None

    async def start(self, services: Any) -> None:
        self._targets = targets_from(services.settings.engines)
        self._metrics = services.metrics

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def target(self, model: str) -> MediaTarget:
        return self._targets.get(model, MediaTarget())

    # -- the hook -------------------------------------------------------------------------------------------
    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        refs = list(media_parts(request))
        if not refs:
            return request
        target = self.target(request.model)
        loop = asyncio.get_running_loop()
        # A client's own data URI declares a type the bytes must match; a fetched part's type is a
        # server's label, which media-fetch passed on and which is not held against the client.
        from_client = {r.part for r in ctx.media if r.source == "data"}
        jobs = []
        for ref in refs:
            if ref.is_remote:
                raise MediaURLForbidden(
                    f"{ref.param}: remote media must be fetched by media-fetch first", param=ref.param
                )
            declared = declared_type(ref) if ref.path in from_client else None
            jobs.append(loop.run_in_executor(self._pool, self._process, ref, target, declared))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for ref, res in zip(refs, results):
            if isinstance(res, BaseException):
                self._count(ref.kind, "refused")
                if isinstance(res, InvalidMedia) and res.param is None:
                    res.param = ref.param
                    res.message = f"{ref.param}: {res.message}"
                raise res
        done: list[_Done] = results  # type: ignore[assignment]

        self._check_budget(request, done, target)
        new = {(d.ref.message, d.ref.index): d.parts for d in done}
        out = replace_parts(request, new)
        self._record(done, ctx)
        out = self._segment(out, done, ctx)
        return self._one_modality(out, ctx)

    # -- per part, on the pool ------------------------------------------------------------------------------
    def _process(self, ref: MediaRef, target: MediaTarget, declared: str | None) -> _Done:
        t0 = time.perf_counter()
        data = decode_payload(ref)
        check_one_file(data, ref.kind, ref.param)
        if ref.kind == "image":
            done = self._image(ref, data, declared)
        elif ref.kind == "audio":
            done = self._audio(ref, data, target, declared)
        else:
            done = self._video(ref, data, target, declared)
        if self._metrics is not None:
            self._metrics.media_seconds.labels(ref.kind).observe(time.perf_counter() - t0)
        return done

    def _image(self, ref: MediaRef, data: bytes, declared: str | None) -> _Done:
        r = normalise_image(data, self.config.image, ref.param, declared)
        # Unchanged bytes still get the media type they really have, whatever the client or server claimed.
        part = make_part(ref.type, data_uri(r.mediatype, r.data))
        return _Done(
            ref,
            [part],
            tokens.image_tokens(r.width, r.height, self.config.budget),
            r.actions,
            {"format": r.source_format.lower(), "width": r.source_width, "height": r.source_height},
        )

    def _audio(self, ref: MediaRef, data: bytes, target: MediaTarget, declared: str | None) -> _Done:
        r = normalise_audio(data, self.config.audio, target.audio_rate, ref.param, declared)
        longest = max(end - start for start, end in r.boundaries)
        part = make_part(ref.type, data_uri(r.mediatype, r.data), r.fmt)
        return _Done(
            ref,
            [part],
            tokens.audio_tokens(longest, self.config.budget),
            r.actions,
            {"format": r.info.container, "duration_s": round(r.info.duration_s, 3)},
            r if r.pcm is not None else None,
        )

    def _video(self, ref: MediaRef, data: bytes, target: MediaTarget, declared: str | None) -> _Done:
        cfg, budget = self.config.video, self.config.budget
        info = probe_video(data, ref.param)
        check_declared("video", declared, info.container, ref.param)
        if info.width * info.height > cfg.max_input_pixels:
            raise InvalidMedia(
                f"{ref.param}: the video is {info.width}x{info.height}; the limit is {cfg.max_input_pixels:,} pixels",
                param=ref.param,
            )
        try:
            used, count = plan_frames(info, cfg)
        except InvalidMedia as exc:
            raise InvalidMedia(f"{ref.param}: {exc.message}", param=ref.param) from None
        video_budget = budget.max_modal_tokens if "video" in budget.counted else target.context_tokens // 2
        size = tokens.frame_size_for(
            count, info.width, info.height, video_budget, cfg.min_frame_pixels, cfg.max_frame_pixels, budget
        )
        frames = sample_frames(data, used, count, cfg.fps, size, ref.param)
        actions: list[str] = []
        if used < info.duration_s - 1e-3:
            actions.append("video-trimmed")
        if info.fps > cfg.fps + 0.01 or size != (info.width, info.height):
            actions.append("video-resampled")
        if info.has_audio:
            actions.append("video-audio-dropped")
        if target.video_form == "frames":
            actions.append("video-as-frames")
            parts = [
                make_part("image_url", data_uri("image/jpeg", encode_jpeg(f, cfg.frame_quality)))
                for f in frames
            ]
        else:
            parts = [make_part(ref.type, data_uri("video/mp4", encode_mp4(frames, cfg.fps, cfg.crf)))]
        facts = {
            "format": info.container,
            "width": info.width,
            "height": info.height,
            "duration_s": round(info.duration_s, 3),
            "frames": len(frames),
        }
        return _Done(ref, parts, tokens.video_tokens(len(frames), size[0], size[1], budget), actions, facts)

    # -- request-level rules --------------------------------------------------------------------------------
    def _check_budget(self, request: ChatCompletionRequest, done: list[_Done], target: MediaTarget) -> None:
        cfg = self.config.budget
        counted = [d for d in done if d.ref.kind in cfg.counted]
        modal = sum(d.tokens for d in counted)
        if self._metrics is not None:
            self._metrics.modal_tokens.observe(sum(d.tokens for d in done))
        if modal > cfg.max_modal_tokens:
            worst = max(counted, key=lambda d: d.tokens)
            raise ModalBudgetExceeded(
                f"{worst.ref.path} ({worst.ref.kind}) is estimated at {worst.tokens:,} modal tokens; the request's "
                f"{modal:,} modal tokens are {modal - cfg.max_modal_tokens:,} over the limit of "
                f"{cfg.max_modal_tokens:,}",
                param=worst.ref.path,
            )
        chars = sum(len(m.text()) for m in request.messages)
        text = tokens.text_tokens(chars, cfg)
        media = sum(d.tokens for d in done)
        output = request.output_token_limit or 0
        total = text + media + output
        if total > target.context_tokens:
            worst = max(done, key=lambda d: d.tokens)
            raise ContextLengthExceeded(
                f"the request needs about {total:,} tokens (text {text:,}, media {media:,}, output {output:,}), "
                f"{total - target.context_tokens:,} more than the engine's context of {target.context_tokens:,}; "
                f"the largest part is {worst.ref.path} ({worst.ref.kind}, about {worst.tokens:,} tokens)",
                param=worst.ref.path,
            )

    def _record(self, done: list[_Done], ctx: RequestContext) -> None:
        by_part = {r.part: r for r in ctx.media}
        for d in done:
            rec = by_part.get(d.ref.path)
            if rec is None:
                rec = MediaRecord(part=d.ref.path, kind=d.ref.kind, source="data")
                ctx.media.append(rec)
            for key, value in d.facts.items():
                setattr(rec, key, value)
            rec.modal_tokens = d.tokens
            rec.actions.extend(d.actions)
            for reason in d.actions:
                ctx.degrade(reason)
            self._count(d.ref.kind, "rewritten" if d.actions else "passed")

    def _segment(
        self, request: ChatCompletionRequest, done: list[_Done], ctx: RequestContext
    ) -> ChatCompletionRequest:
        split = [d for d in done if d.audio is not None]
        if not split:
            return request
        if len(split) > 1:
            raise InvalidMedia(
                f"{split[1].ref.param}: only one audio part per request may be longer than "
                f"{self.config.audio.segment_s:.0f} s",
                param=split[1].ref.param,
            )
        d = split[0]
        audio, encoding = d.audio, self.config.audio.encoding
        assert audio is not None
        first = d.parts[0]

        def build(req: ChatCompletionRequest, i: int) -> ChatCompletionRequest:
            part = make_part(d.ref.type, data_uri(audio.mediatype, audio.segment(i, encoding)), audio.fmt)
            return _swap_part(req, first, part)

        ctx.segmentation = Segmentation(
            d.ref.path, audio.boundaries, build, self.config.audio.segment_separator
        )
        return request

    def _one_modality(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        mode = self.config.one_modality_per_message
        if mode == "off":
            return request
        messages: list[Message] = []
        changed = False
        for mi, message in enumerate(request.messages):
            kinds = _modalities(message)
            if len(kinds) <= 1:
                messages.append(message)
                continue
            if mode == "refuse":
                raise InvalidRequest(
                    f"messages.{mi}.content carries {' and '.join(sorted(kinds))}; a message may carry one non-text "
                    f"modality: send each in its own message",
                    param=f"messages.{mi}.content",
                    code="one_modality_per_message",
                )
            messages.extend(_split(message))
            changed = True
        if not changed:
            return request
        ctx.degrade("message-split")
        return request.model_copy(update={"messages": messages})

    def _count(self, kind: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.media_parts.labels(kind, outcome).inc()


def _modalities(message: Message) -> set[str]:
    if not isinstance(message.content, list):
        return set()
    return {PART_MODALITY[p.type] for p in message.content} - {"text"}


def _split(message: Message) -> list[Message]:
    """Cut before each part whose modality differs from the one the current message already carries."""
    groups: list[list[Any]] = [[]]
    current: str | None = None
    assert isinstance(message.content, list)
    for part in message.content:
        kind = PART_MODALITY[part.type]
        if kind != "text" and current is not None and kind != current:
            groups.append([])
            current = None
        if kind != "text":
            current = kind
        groups[-1].append(part)
    return [message.model_copy(update={"content": g}) for g in groups if g]


def _swap_part(request: ChatCompletionRequest, old: Any, new: Any) -> ChatCompletionRequest:
    messages = []
    for message in request.messages:
        if isinstance(message.content, list) and any(p == old for p in message.content):
            message = message.model_copy(
                update={"content": [new if p == old else p for p in message.content]}
            )
        messages.append(message)
    return request.model_copy(update={"messages": messages})
