"""Built-in pre-policy ``nsfw-screen``: every image and every video frame the engine gets, through Open-NSFW.

Runs after ``media-limits``, so it scores the files the engine is sent, decoded:
images as one frame of 8-bit RGB with nothing transparent (policies/media/image.py
normalises every image it forwards), videos frame by frame. A video of more than
``max_video_frames`` frames is cut to that many, spread evenly over it, and the
engine gets the cut video, whose frames are the ones scored: an engine samples
a video its own way, so a frame the screen skipped would otherwise reach it. The
highest score of a part decides; at or above ``threshold`` the request is
refused with a 400 ``content_policy_violation`` naming the part (``shadow: true``
only records, and forwards the video uncut). The model loads at start-up (about
half a second) and runs on its own thread; the frames it scores are decoded in
the media sandbox's worker processes. With ``served``, an engine serves the classifier instead
(policies/served/vision.py: KServe v2 or TorchServe), sent the same pixels; ``label`` names its output.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from PIL import Image
from pydantic import Field, model_validator

from core.context import MediaRecord, RequestContext, Scan, Screening
from core.errors import ContentPolicyViolation, GuardUnavailable
from core.schemas import ChatCompletionRequest
from policies.base import Deps, PolicyBase, PolicyConfig
from policies.media.config import VideoConfig
from policies.media.image import screen_view
from policies.media.models import NSFWModel, nsfw_input
from policies.media.parts import MediaRef, media_parts, output_part, payload_arg, replace_parts, spool_parts
from policies.media.sandbox import MediaRuntime, runtime_of
from policies.media.video import ScreenedVideo, screen_video
from policies.served.vision import ImageInput, ServedImageModel
from policies.settings import MediaSettings, ServedModelSettings

_SIZE = (256, 256)  # what the model's own preprocessing resizes to first (bilinear)


class NSFWConfig(PolicyConfig):
    """The Open-NSFW screen of images and video frames."""

    threshold: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.8, description="a part scoring at or above this is refused (content_policy_violation)"
    )
    max_video_frames: Annotated[int, Field(ge=1, le=240)] = Field(
        default=16,
        description="frames scored per video: every frame of a video that has at most this many; a longer "
        "one is cut to this many, evenly spaced, and the engine gets the cut video (media-limits sends "
        "up to video.max_frames, 240 by default: raise this to forward more, at the cost of screening time)",
    )
    crf: Annotated[int, Field(ge=0, le=51)] = Field(
        default=VideoConfig().crf, description="H.264 CRF of a video cut to the frames that were scored"
    )
    batch_size: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4, description="images scored per model call"
    )
    threads: Annotated[int, Field(ge=1, le=16)] = Field(default=1, description="onnxruntime CPU threads")
    served: ServedModelSettings | None = Field(
        default=None,
        description="an image classifier an engine serves (endpoint kserve-v2 or torchserve) instead of the "
        "in-process model; unset: Open-NSFW in the gateway",
    )
    label: str = Field(default="nsfw", description="served: the output label whose probability is the score")
    input_name: str = Field(default="input", description="kserve-v2: the name of the model's input tensor")
    layout: Literal["NHWC", "NCHW"] = Field(
        default="NHWC",
        description="kserve-v2: the input tensor's layout, FP32 [N, 224, 224, 3] or [N, 3, 224, 224], BGR, "
        "the channel means (104, 117, 123) subtracted, as Open-NSFW takes it",
    )

    @model_validator(mode="after")
    def _served_fields(self) -> NSFWConfig:
        if self.served is None:
            return self
        if self.served.endpoint not in ("kserve-v2", "torchserve"):
            raise ValueError("served.endpoint: the screen classifies images: kserve-v2 or torchserve")
        if self.served.endpoint == "kserve-v2" and self.label not in (self.served.labels or ()):
            raise ValueError(
                f"served.labels: name the model's outputs in index order, {self.label!r} among them"
            )
        return self


class NSFWScreen(PolicyBase):
    name: ClassVar[str] = "nsfw-screen"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = NSFWConfig
    runs_after: ClassVar[tuple[str, ...]] = ("media-fetch", "media-limits")

    def __init__(self, config: NSFWConfig) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="omnigate-nsfw")
        self._model: NSFWModel | None = None
        self._metrics: Any = None
        self._runtime: MediaRuntime | None = None
        self._served: ServedImageModel | None = None

    async def start(self, deps: Deps) -> None:
        self._metrics = deps.metrics
        self._runtime = runtime_of(deps)
        if self.config.served is not None:
            self._served = self._served_model(self.config.served)
            return
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(self._pool, NSFWModel, self.config.threads)

    async def aclose(self) -> None:
        # The model thread is this instance's: after a reload its requests have ended, so it ends too.
        self._pool.shutdown(wait=False, cancel_futures=True)  # the thread ends once idle
        if self._served is not None:
            await self._served.aclose()

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        scan = ctx.outputs.scan(self.name)  # the receipt: which model, at what threshold, saw what
        served = self.config.served
        scan.model, scan.threshold = ("open-nsfw" if served is None else served.model), self.config.threshold
        scan.model_digest = self._model.digest if self._model is not None else None
        visual = [r for r in media_parts(request) if r.kind in ("image", "video")]
        for ref in visual:
            if ref.is_remote:  # not fetched by media-fetch: the engine would see what this screen did not
                scan.missed.append({"part": ref.path, "why": "a remote URL the gateway did not fetch"})
        refs = [r for r in visual if not r.is_remote]
        if not refs:
            self._unscanned(scan)
            return request
        if self._runtime is None:
            self._runtime = MediaRuntime(MediaSettings())
        sandbox = self._runtime.sandbox
        seen: list[Any] = await asyncio.gather(
            *(sandbox.run(*self._task(ref), param=ref.param) for ref in refs)
        )
        frames = [s.views if isinstance(s, ScreenedVideo) else [s] for s in seen]
        loop = asyncio.get_running_loop()
        if served is None:
            scores = await loop.run_in_executor(self._pool, self._score_all, frames)
        else:
            scores = await self._score_served(frames)
        flagged: MediaRef | None = None
        sizes = {m.part: m for m in ctx.outputs.media}
        for ref, s, score in zip(refs, seen, scores, strict=True):
            scan.parts.append(_saw(ref, s, sizes.get(ref.path), round(score, 4)))
        for ref, score in zip(refs, scores, strict=True):
            hit = score >= self.config.threshold
            ctx.outputs.screenings.append(Screening(self.name, ref.path, round(score, 4), hit))
            if self._metrics is not None:
                self._metrics.screen_scores.labels(self.name, ref.kind).observe(score)
            if hit and flagged is None:
                flagged = ref
        if flagged is not None:
            raise ContentPolicyViolation(
                f"{flagged.path}: the {flagged.kind} was refused by the content screen", param=flagged.param
            )
        self._unscanned(scan)
        new: dict[tuple[int, int], list[Any]] = {}
        for ref, s in zip(refs, seen, strict=True):
            if isinstance(s, ScreenedVideo) and s.video is not None:
                # Its frames past max_video_frames were never scored: the engine gets the ones that were.
                if ctx.media_budget is not None:
                    await ctx.media_budget.take(len(s.video), ref.param)
                new[(ref.message, ref.index)] = spool_parts([output_part(ref.type, "video/mp4", s.video)])
                ctx.outputs.degrade("video-cut-to-screened-frames")
        return replace_parts(request, new)

    def _unscanned(self, scan: Scan) -> None:
        """A part this screen could not look at is not clean: the request is refused or served as the
        policy's ``on_error`` says (gateway/pipeline/unjudged.py), after every other part was screened."""
        if scan.missed:
            parts = ", ".join(m["part"] for m in scan.missed)
            raise GuardUnavailable(f"{parts}: not screened by {self.name}")

    def _task(self, ref: MediaRef) -> tuple[Any, tuple[Any, ...]]:
        """The decoding worker's task for one part: its screen's view of the pixels the engine gets."""
        if ref.kind == "image":
            return screen_view, (payload_arg(ref), _SIZE, ref.param)
        c = self.config
        return screen_video, (payload_arg(ref), c.max_video_frames, _SIZE, ref.param, c.crf)

    def _served_model(self, served: ServedModelSettings) -> ServedImageModel:
        c = self.config
        return ServedImageModel(served, name=self.name, input_name=c.input_name, layout=c.layout)

    def _score_all(self, per_part: list[list[np.ndarray]]) -> list[float]:
        """One part's frames are scored together; the images of a request share batches."""
        if self._model is None:
            self._model = NSFWModel(self.config.threads)
        images, owners = _images(per_part)
        return _best(len(per_part), owners, self._model.score(images, self.config.batch_size))

    async def _score_served(self, per_part: list[list[np.ndarray]]) -> list[float]:
        """The served model's score of each part: its frames' inputs (the tensor the in-process model
        takes, or PNG bytes) made on the model thread, judged in the served client's shared windows."""
        if self._served is None:  # not started (a policy driven without the gateway's lifespan)
            assert self.config.served is not None
            self._served = self._served_model(self.config.served)
        images, owners = _images(per_part)
        kserve = self._served.settings.endpoint == "kserve-v2"
        inputs = await asyncio.get_running_loop().run_in_executor(
            self._pool, _model_inputs if kserve else _png_inputs, images
        )
        answers = await self._served.classify_images(inputs)
        label = self.config.label
        if any(label not in a for a in answers):
            raise GuardUnavailable(
                f"the {self.name} model {self._served.settings.model!r} named no {label!r}"
            )
        return _best(len(per_part), owners, [a[label] for a in answers])


def _images(per_part: list[list[np.ndarray]]) -> tuple[list[Image.Image], list[int]]:
    """Every part's frames as images, with the part each came from."""
    images: list[Image.Image] = []
    owners: list[int] = []
    for i, frames in enumerate(per_part):
        images.extend(Image.fromarray(a) for a in frames)
        owners.extend([i] * len(frames))
    return images, owners


def _best(parts: int, owners: list[int], scores: list[float]) -> list[float]:
    best = [0.0] * parts
    for owner, score in zip(owners, scores, strict=True):
        best[owner] = max(best[owner], score)
    return best


def _model_inputs(images: list[Image.Image]) -> list[ImageInput]:
    return list(nsfw_input(images))


def _png_inputs(images: list[Image.Image]) -> list[ImageInput]:
    out: list[ImageInput] = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _saw(ref: MediaRef, seen: Any, forwarded: MediaRecord | None, score: float) -> dict[str, Any]:
    """One part on the receipt: the image's size as the engine gets it, or the video's frames scored of
    those it has (media-limits' record of the forwarded part); the score the model gave it."""
    out: dict[str, Any] = {"part": ref.path, "kind": ref.kind, "score": score}
    if forwarded is not None and forwarded.width is not None:
        out["width"], out["height"] = forwarded.width, forwarded.height
    if isinstance(seen, ScreenedVideo):
        out["frames"] = len(seen.views)
        out["of"] = forwarded.frames if forwarded is not None and forwarded.frames else len(seen.views)
    return out


__all__ = ["NSFWScreen"]
