"""Built-in pre-policy ``media-limits``: probe, limit and normalise every media part.

Runs after ``media-fetch`` (every part is data by then). Images are capped in
pixels, downsampled above 2 MP and forwarded as one frame of 8-bit RGB (transparency
composited onto white), the pixels the content screens then score; audio is probed from its header, resampled
to the engine's rate and cut into 2,400 s segments above 40 minutes; video is
probed, trimmed or refused beyond 120 s, sampled at 2 fps (at most 240 frames)
and handed over as a short MP4 or as frames, as the engines serving the model
take it. Then the one-modality-per-message rule and the modal-token budget.
Every probe and decode runs in a confined worker process (policies/media/sandbox.py), headers
of every part first, so budgets and context are checked before anything is decoded; decoded output
counts against the request's media budget. Every rewrite is a
degradation reason (``x-omnigate-degraded``) and is listed on the part's
:class:`core.context.MediaRecord`.

Its length: the pre-hook runs the probes, the budgets and the rewrites as one sequence over a request's
parts (headers first, then decodes); the decoding itself is in policies/media/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from core.context import MediaRecord, RequestContext, SegmentPlan
from core.errors import (
    ContextLengthExceeded,
    InvalidMedia,
    InvalidRequest,
    MediaURLForbidden,
    ModalBudgetExceeded,
)
from core.schemas import PART_MODALITY, ChatCompletionRequest, Message
from core.spooled import SpooledMedia, SpoolFull, SpoolWriter
from policies.base import Deps, PolicyBase, PolicyConfig, Segmented
from policies.media import budget as tokens
from policies.media.budget import BudgetConfig
from policies.media.config import AudioConfig, ImageConfig, VideoConfig
from policies.media.parts import (
    SPOOL_OUTPUT,
    MediaRef,
    data_uri,
    declared_type,
    decode_payload,
    make_part,
    media_parts,
    payload_arg,
    payload_size,
    replace_parts,
    spool_parts,
)
from policies.media.sandbox import SHARE_MIN, MediaRuntime, SharedPart, runtime_of, shared_part
from policies.media.shared import SharedOut
from policies.media.targets import MediaTarget, check_modalities, targets_from
from policies.settings import MediaSettings

if TYPE_CHECKING:
    from policies.media.audio import AudioResult  # the decoders load only where media is served
    from policies.media.process import Done as _Done
    from policies.media.process import Probed

__all__ = ["MediaLimits", "MediaLimitsConfig", "MediaTarget", "check_modalities", "targets_from"]


class MediaLimitsConfig(PolicyConfig):
    image: ImageConfig = ImageConfig()
    audio: AudioConfig = AudioConfig()
    video: VideoConfig = VideoConfig()
    budget: BudgetConfig = BudgetConfig()
    one_modality_per_message: Literal["split", "refuse", "off"] = Field(
        default="split", description="Qwen-Omni takes one non-text modality per message: split it or refuse"
    )


class MediaLimits(PolicyBase):
    name: ClassVar[str] = "media-limits"
    stage: ClassVar[str] = "pre"
    #: skipped (not run, not recorded) for requests without media parts
    media_only: ClassVar[bool] = True
    Config: ClassVar[type[PolicyConfig]] = MediaLimitsConfig
    runs_after: ClassVar[tuple[str, ...]] = ("media-fetch",)

    def __init__(self, config: MediaLimitsConfig) -> None:
        self.config = config
        self._part_settings: Any = None  # policies.media.process.Settings, built with the decoders
        self._targets: dict[str, MediaTarget] = {}
        self._metrics: Any = None
        self._runtime: MediaRuntime | None = None
        self._own_runtime = False

    async def start(self, deps: Deps) -> None:
        self._targets = targets_from(deps.engines)
        self._metrics = deps.metrics
        # The gateway's runtime is the gateway's: a reload's aclose must not stop its workers.
        self._runtime = runtime_of(deps)
        if self._runtime is None:  # a chain started outside a gateway (tests): its own, closed with it
            self._runtime = MediaRuntime(deps.settings.media)
            self._own_runtime = True
        if self._runtime.eager:
            self._process()  # the operator configured media-limits: load the decoders before traffic

    async def aclose(self) -> None:
        if self._own_runtime and self._runtime is not None:
            await self._runtime.aclose()

    def _process(self) -> Any:
        from policies.media import process

        if self._part_settings is None:
            c = self.config
            self._part_settings = process.Settings(c.image, c.audio, c.video, c.budget)
        return process

    def target(self, model: str) -> MediaTarget:
        return self._targets.get(model, MediaTarget())

    @property
    def runtime(self) -> MediaRuntime:
        if self._runtime is None:
            self._runtime = MediaRuntime(MediaSettings())
            self._own_runtime = True
        return self._runtime

    # -- the hook -------------------------------------------------------------------------------------------
    async def pre(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> ChatCompletionRequest | Segmented:
        refs = list(media_parts(request))
        if not refs:
            return request
        target = self.target(request.model)
        check_modalities(request, self._targets.get(request.model))
        if self.config.one_modality_per_message == "refuse":
            self._one_modality(request, ctx)  # a refusal from the parts' types alone costs no decode
        for ref in refs:
            if ref.is_remote:
                raise MediaURLForbidden(
                    f"{ref.param}: remote media must be fetched by media-fetch first", param=ref.param
                )
        # The decoders load with the first media part (or at start-up, see start): a text-only gateway
        # never imports them.
        process = self._process()
        probe_part, process_part = process.probe_part, process.process_part
        runtime = self.runtime
        if ctx.media_budget is None:
            ctx.media_budget = runtime.request_budget()
        budget = ctx.media_budget
        sandbox = runtime.sandbox
        # Base64 is undone here, once (a strict alphabet check, no decoder): workers get raw bytes. A
        # large part is decoded straight into a shared segment the workers read, so the gateway holds
        # it once for both tasks (probe, decode), beside the client's string, and only until then.
        segments: dict[str, SharedPart] = {}
        try:
            payloads: dict[str, Any] = {}
            for ref in refs:
                size = payload_size(ref)
                if isinstance(ref.value, SpooledMedia):  # already in a file the workers map: none made here
                    payloads[ref.path] = payload_arg(ref)
                    continue
                seg = shared_part(ref, size) if size >= SHARE_MIN else None
                if seg is None:
                    payloads[ref.path] = decode_payload(ref)
                else:
                    segments[ref.path] = seg
                    payloads[ref.path] = seg.handle
            # Headers first, for every part: a request the budgets refuse costs no decode.
            # Workers get the part's place and kind, not its string: the bytes travel once, as bytes.
            light = {ref.path: dataclasses.replace(ref, value="") for ref in refs}
            probes = await self._each(
                refs,
                lambda ref: sandbox.run(
                    probe_part,
                    (light[ref.path], payloads[ref.path], self._part_settings, target),
                    param=ref.param,
                ),
            )
            for ref, probed in zip(refs, probes, strict=True):
                probed.ref = ref
            self._check_probes(request, probes, target)
            # A client's own data URI declares a type the bytes must match; a fetched part's type is a
            # server's label, which media-fetch passed on and which is not held against the client.
            from_client = {r.part for r in ctx.outputs.media if r.source == "data"}
            room = budget.room

            seconds = {p.ref.path: p.seconds for p in probes}

            async def one(ref: MediaRef) -> _Done:
                declared = declared_type(ref) if ref.path in from_client else None
                t0 = time.perf_counter()
                out = _output_file(ref, seconds.get(ref.path, 0.0), target, self.config)
                try:
                    done: _Done = await sandbox.run(
                        process_part,
                        (
                            light[ref.path],
                            payloads[ref.path],
                            self._part_settings,
                            target,
                            declared,
                            room,
                            None if out is None else SharedOut(out.name, out.reserved),
                        ),
                        param=ref.param,
                    )
                except BaseException:
                    if out is not None:
                        out.discard()
                    raise
                done.ref = ref
                # A large output: written by the worker into the file reserved for it, or to the spool
                # here; never a base64 string of it in the gateway.
                done.parts = spool_parts(done.parts, out)
                done.restore(lambda: _payload_bytes(ref, payloads[ref.path], segments.get(ref.path)))
                if self._metrics is not None:
                    self._metrics.media_seconds.labels(ref.kind).observe(time.perf_counter() - t0)
                await budget.take(done.out_bytes, ref.param)
                return done

            done = await self._each(refs, one)
            self._check_budget(request, done, target)
            new = {(d.ref.message, d.ref.index): d.parts for d in done}
            out = replace_parts(request, new)
            self._record(done, ctx)
            plan = self._segment(done)
            out = self._one_modality(out, ctx)
            return out if plan is None else Segmented(out, plan)
        finally:
            for seg in segments.values():
                seg.release()

    async def _each(self, refs: list[MediaRef], fn: Any) -> list[Any]:
        """``fn`` for every part concurrently; the first part's error (in part order) is the answer."""
        results = await asyncio.gather(*(fn(ref) for ref in refs), return_exceptions=True)
        for ref, res in zip(refs, results, strict=True):
            if isinstance(res, BaseException):
                self._count(ref.kind, "refused")
                if isinstance(res, InvalidMedia) and res.param is None:
                    res.param = ref.param
                    res.message = f"{ref.param}: {res.message}"
                raise res
        return list(results)

    def _check_probes(
        self, request: ChatCompletionRequest, probes: list[Probed], target: MediaTarget
    ) -> None:
        """The modal-token and context budgets from header facts alone (the estimate after decoding rules)."""
        cfg = self.config.budget
        counted = [p for p in probes if p.ref.kind in cfg.counted]
        modal = sum(p.tokens for p in counted)
        if modal > cfg.max_modal_tokens:
            worst = max(counted, key=lambda p: p.tokens)
            raise ModalBudgetExceeded(
                f"{worst.ref.path} ({worst.ref.kind}) is estimated at {worst.tokens:,} modal tokens; the request's "
                f"{modal:,} modal tokens are {modal - cfg.max_modal_tokens:,} over the limit of "
                f"{cfg.max_modal_tokens:,}",
                param=worst.ref.path,
            )
        text = tokens.text_tokens(sum(len(m.text()) for m in request.messages), cfg)
        media = sum(p.tokens for p in probes)
        output = request.output_token_limit or 0
        total = text + media + output
        if total > target.context_tokens:
            worst = max(probes, key=lambda p: p.tokens)
            raise ContextLengthExceeded(
                f"the request needs about {total:,} tokens (text {text:,}, media {media:,}, output {output:,}), "
                f"{total - target.context_tokens:,} more than the engine's context of {target.context_tokens:,}; "
                f"the largest part is {worst.ref.path} ({worst.ref.kind}, about {worst.tokens:,} tokens)",
                param=worst.ref.path,
            )

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
        by_part = {r.part: r for r in ctx.outputs.media}
        for d in done:
            rec = by_part.get(d.ref.path)
            if rec is None:
                rec = MediaRecord(part=d.ref.path, kind=d.ref.kind, source="data")
                ctx.outputs.media.append(rec)
            for key, value in d.facts.items():
                setattr(rec, key, value)
            rec.modal_tokens = d.tokens
            rec.actions.extend(d.actions)
            for reason in d.actions:
                ctx.outputs.degrade(reason)
            self._count(d.ref.kind, "rewritten" if d.actions else "passed")

    def _segment(self, done: list[_Done]) -> SegmentPlan | None:
        """The plan of the one part too long for one engine call, if any (more than one is refused)."""
        split = [d for d in done if d.audio is not None]
        if not split:
            return None
        if len(split) > 1:
            raise InvalidMedia(
                f"{split[1].ref.param}: only one audio part per request may be longer than "
                f"{self.config.audio.segment_s:.0f} s",
                param=split[1].ref.param,
            )
        d = split[0]
        audio, encoding, kind = d.audio, self.config.audio.encoding, d.ref.type
        assert audio is not None
        first = d.parts[0]

        # The plan lives as long as the request: it keeps the decoded audio, never the part's
        # reference (whose value is the client's string).
        return SegmentPlan(
            d.ref.path,
            audio.boundaries,
            first,
            _AudioSegments(audio, encoding, kind),
            self.config.audio.segment_separator,
        )

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
        ctx.outputs.degrade("message-split")
        return request.model_copy(update={"messages": messages})

    def _count(self, kind: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.media_parts.labels(kind, outcome).inc()


#: what a reserved audio output may hold beyond its PCM bound (container headers, metadata)
_OUT_SLACK = 1 << 16


def _output_file(
    ref: MediaRef, seconds: float, target: MediaTarget, cfg: MediaLimitsConfig
) -> SpoolWriter | None:
    """A file reserved for an audio part's output, sized from its probed duration (16-bit mono PCM at the
    rate it is sent at: a FLAC is smaller; an output that does not fit comes back through the pipe)."""
    if ref.kind != "audio" or seconds <= 0:
        return None
    rate = min(target.audio_rate or cfg.audio.max_output_rate, cfg.audio.max_output_rate)
    size = _OUT_SLACK + int(min(seconds, cfg.audio.segment_s) * rate * 2)
    if size < SPOOL_OUTPUT:
        return None
    try:
        out = SpoolWriter()
        out.reserve(size)
    except SpoolFull:
        return None
    return out


def _payload_bytes(ref: MediaRef, payload: Any, seg: SharedPart | None) -> bytes:
    if isinstance(ref.value, SpooledMedia):
        return ref.value.read()
    if seg is None:
        return bytes(payload)
    with seg.view() as view:
        return bytes(view)


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


@dataclass(frozen=True, slots=True)
class _AudioSegments(Sequence[Any]):
    """The content part of each segment of one decoded audio part, encoded when the pipeline asks for it."""

    audio: AudioResult
    encoding: str
    kind: str

    def __len__(self) -> int:
        return len(self.audio.boundaries)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        audio = self.audio
        return make_part(self.kind, data_uri(audio.mediatype, audio.segment(i, self.encoding)), audio.fmt)
