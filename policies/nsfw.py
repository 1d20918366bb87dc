"""Built-in pre-policy ``nsfw-screen``: images and sampled video frames through Open-NSFW.

Runs after ``media-limits``, so it sees what the engine will see (images of at
most 2 MP, videos already sampled). A video is screened on ``max_video_frames``
frames spread evenly over it, scored as one batch. The highest score of a part
decides; at or above ``threshold`` the request is refused with a 400
``content_policy_violation`` naming the part (``shadow: true`` only records).
The model loads at start-up (about half a second) and runs on its own thread;
the frames it scores are decoded in the media sandbox's worker processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar

from PIL import Image
from pydantic import Field

from core.context import RequestContext, Screening
from core.errors import ContentPolicyViolation
from core.schemas import ChatCompletionRequest
from core.settings import MediaSettings
from policies.base import Deps, PolicyBase, PolicyConfig
from policies.media.config import ImageConfig
from policies.media.models import NSFWModel
from policies.media.parts import MediaRef, media_parts, payload_arg
from policies.media.process import screen_frames
from policies.media.sandbox import MediaRuntime, runtime_of

_SIZE = (256, 256)  # what the model's own preprocessing resizes to first


class NSFWConfig(PolicyConfig):
    """The Open-NSFW screen of images and video frames."""

    threshold: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.8, description="a part scoring at or above this is refused (content_policy_violation)"
    )
    max_video_frames: Annotated[int, Field(ge=1, le=240)] = Field(
        default=16, description="evenly spaced frames scored per video"
    )
    batch_size: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4, description="images scored per model call"
    )
    threads: Annotated[int, Field(ge=1, le=16)] = Field(default=1, description="onnxruntime CPU threads")


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
        self._decode = ImageConfig()
        self._runtime: MediaRuntime | None = None

    async def start(self, deps: Deps) -> None:
        self._metrics = deps.metrics
        self._runtime = runtime_of(deps)
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(self._pool, NSFWModel, self.config.threads)

    async def aclose(self) -> None:
        # The model thread is this instance's: after a reload its requests have ended, so it ends too.
        self._pool.shutdown(wait=False, cancel_futures=True)  # the thread ends once idle

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        refs = [r for r in media_parts(request) if r.kind in ("image", "video") and not r.is_remote]
        if not refs:
            return request
        if self._runtime is None:
            self._runtime = MediaRuntime(MediaSettings())
        sandbox = self._runtime.sandbox
        frames = await asyncio.gather(
            *(
                sandbox.run(
                    screen_frames,
                    (
                        dataclasses.replace(ref, value=""),
                        payload_arg(ref),
                        self.config.max_video_frames,
                        _SIZE,
                    ),
                    param=ref.param,
                )
                for ref in refs
            )
        )
        loop = asyncio.get_running_loop()
        scores = await loop.run_in_executor(self._pool, self._score_all, frames)
        flagged: MediaRef | None = None
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
        return request

    def _score_all(self, per_part: list[list[Any]]) -> list[float]:
        """One part's frames are scored together; the images of a request share batches."""
        if self._model is None:
            self._model = NSFWModel(self.config.threads)
        images: list[Image.Image] = []
        owners: list[int] = []
        for i, frames in enumerate(per_part):
            images.extend(Image.fromarray(a) for a in frames)
            owners.extend([i] * len(frames))
        scores = self._model.score(images, self.config.batch_size)
        best = [0.0] * len(per_part)
        for owner, score in zip(owners, scores, strict=True):
            best[owner] = max(best[owner], score)
        return best


__all__ = ["NSFWScreen"]
