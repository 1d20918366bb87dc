"""Built-in pre-policy ``nsfw-screen``: images and sampled video frames through Open-NSFW.

Runs after ``media-limits``, so it sees what the engine will see (images of at
most 2 MP, videos already sampled). A video is screened on ``max_video_frames``
frames spread evenly over it, scored as one batch. The highest score of a part
decides; at or above ``threshold`` the request is refused with a 400
``content_policy_violation`` naming the part (``shadow: true`` only records).
The model loads at start-up (about half a second) and runs on its own thread.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar

from PIL import Image
from pydantic import Field

from gateway.context import RequestContext, Screening
from gateway.errors import ContentPolicyViolation
from gateway.schemas import ChatCompletionRequest
from policies.base import PolicyConfig
from policies.media.image import ImageConfig, open_image
from policies.media.models import NSFWModel
from policies.media.parts import MediaRef, decode_payload, media_parts
from policies.media.video import probe_video, sample_frames

_SIZE = (256, 256)  # what the model's own preprocessing resizes to first


class NSFWConfig(PolicyConfig):
    threshold: Annotated[float, Field(gt=0, le=1)] = 0.8
    max_video_frames: Annotated[int, Field(ge=1, le=240)] = 16
    batch_size: Annotated[int, Field(ge=1, le=64)] = 4
    threads: Annotated[int, Field(ge=1, le=16)] = 1


class NSFWScreen:
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

    async def start(self, services: Any) -> None:
        self._metrics = services.metrics
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(self._pool, NSFWModel, self.config.threads)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        refs = [r for r in media_parts(request) if r.kind in ("image", "video") and not r.is_remote]
        if not refs:
            return request
        loop = asyncio.get_running_loop()
        scores = await loop.run_in_executor(self._pool, self._score_all, refs)
        flagged: MediaRef | None = None
        for ref, score in zip(refs, scores):
            hit = score >= self.config.threshold
            ctx.screenings.append(Screening(self.name, ref.path, round(score, 4), hit))
            if self._metrics is not None:
                self._metrics.screen_scores.labels(self.name, ref.kind).observe(score)
            if hit and flagged is None:
                flagged = ref
        if flagged is not None:
            raise ContentPolicyViolation(
                f"{flagged.path}: the {flagged.kind} was refused by the content screen", param=flagged.param
            )
        return request

    def _score_all(self, refs: list[MediaRef]) -> list[float]:
        """One part's frames are scored together; the images of a request share batches."""
        if self._model is None:
            self._model = NSFWModel(self.config.threads)
        images: list[Image.Image] = []
        owners: list[int] = []
        for i, ref in enumerate(refs):
            frames = self._frames(ref)
            images.extend(frames)
            owners.extend([i] * len(frames))
        scores = self._model.score(images, self.config.batch_size)
        best = [0.0] * len(refs)
        for owner, score in zip(owners, scores):
            best[owner] = max(best[owner], score)
        return best

    def _frames(self, ref: MediaRef) -> list[Image.Image]:
        data = decode_payload(ref)
        if ref.kind == "image":
            im = open_image(data, self._decode, ref.param)
            im.draft("RGB", _SIZE)
            return [im.convert("RGB")]
        info = probe_video(data, ref.param)
        n = min(self.config.max_video_frames, max(1, info.frames or self.config.max_video_frames))
        fps = n / info.duration_s if info.duration_s > 0 else 1.0
        return [Image.fromarray(a) for a in sample_frames(data, info.duration_s, n, fps, _SIZE, ref.param)]


__all__ = ["NSFWScreen"]
