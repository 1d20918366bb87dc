"""A served image classifier: KServe's Open Inference Protocol v2 or TorchServe's predictions API.

    ServedImageModel(ServedModel)
    └── classify_images(images) -> the class probabilities of each image, by label
          endpoint kserve-v2   POST /v2/models/{model}/infer: the window's images as one FP32 tensor
                               {"inputs": [{"name", "shape": [N, 224, 224, 3] (or NCHW), "datatype":
                               "FP32", "data": [...]}]}; the answer's outputs[0], shape [N, classes],
                               named by ``labels``
          endpoint torchserve  POST /predictions/{model}: one image's bytes (PNG) as the body, one call per
                               image; the answer {label: probability}

Batched, time-limited and failing as :class:`policies.served.client.ServedModel` is: concurrent requests
share a window (one tensor per kserve-v2 call), a judgement past ``timeout_s`` or an answer of the wrong
shape is :class:`core.errors.GuardUnavailable`. Only pixels are sent, never a request's URL or headers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from policies.served.batcher import MicroBatcher
from policies.served.client import ServedModel
from policies.settings import ServedModelSettings

#: what one image is sent as: its model input (224, 224, 3) for kserve-v2, its encoded bytes for torchserve
ImageInput = np.ndarray | bytes


class ServedImageModel(ServedModel):
    """One served image classifier; ``input_name`` and ``layout`` describe kserve-v2's input tensor."""

    def __init__(
        self,
        settings: ServedModelSettings,
        *,
        name: str = "served-guard",
        input_name: str = "input",
        layout: Literal["NHWC", "NCHW"] = "NHWC",
    ) -> None:
        super().__init__(settings, name=name)
        self.input_name = input_name
        self.layout = layout
        self.images: MicroBatcher[ImageInput, dict[str, float]] = MicroBatcher(
            self._images_batch,
            max_batch=settings.max_batch,
            max_wait_s=settings.max_wait_ms / 1000.0,
            deadline_s=settings.timeout_s,
            max_inflight=settings.max_inflight,
            name=name,
        )

    async def classify_images(self, images: Sequence[ImageInput]) -> list[dict[str, float]]:
        """The probability of each label, by label name, for each image."""
        return await self.images.submit(list(images))

    async def aclose(self) -> None:
        await self.images.aclose()
        await super().aclose()

    async def _images_batch(self, images: list[ImageInput]) -> list[dict[str, float]]:
        endpoint = self.settings.endpoint
        if endpoint == "kserve-v2":
            arrays = [x for x in images if isinstance(x, np.ndarray)]
            if len(arrays) != len(images):
                raise self._malformed("nothing for image bytes: kserve-v2 takes the model's input tensor")
            return self._kserve_answer(
                await self._post(self._path("v2/models", "/infer"), self._tensor(arrays)), len(arrays)
            )
        if endpoint == "torchserve":
            if any(not isinstance(x, bytes) for x in images):
                raise self._malformed("nothing for a tensor: torchserve takes the image's bytes")
            return list(await asyncio.gather(*(self._torchserve(bytes(x)) for x in images)))
        raise self._malformed(f"nothing for images to classify: its endpoint is {endpoint!r}")

    def _path(self, prefix: str, suffix: str = "") -> str:
        return f"/{prefix}/{self.settings.model}{suffix}"

    def _tensor(self, arrays: list[np.ndarray]) -> dict[str, Any]:
        batch = np.stack(arrays).astype(np.float32, copy=False)
        if self.layout == "NCHW":
            batch = batch.transpose(0, 3, 1, 2)
        tensor = {"name": self.input_name, "shape": list(batch.shape), "datatype": "FP32"}
        return {"inputs": [{**tensor, "data": batch.ravel().tolist()}]}

    def _kserve_answer(self, answer: Any, n: int) -> list[dict[str, float]]:
        try:
            out = answer["outputs"][0]
            probs = np.asarray(out["data"], dtype=np.float64).reshape(n, -1)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._malformed("an outputs list of the wrong shape", exc) from exc
        labels = self.settings.labels or [str(i) for i in range(probs.shape[1])]
        if probs.shape[1] != len(labels):
            raise self._malformed(f"{probs.shape[1]} classes where the config names {len(labels)} labels")
        return [dict(zip(labels, (float(p) for p in row), strict=True)) for row in probs]

    async def _torchserve(self, image: bytes) -> dict[str, float]:
        answer = await self._post(self._path("predictions"), content=image)
        try:
            return {str(k): float(v) for k, v in dict(answer).items()}
        except (TypeError, ValueError) as exc:
            raise self._malformed("a prediction of the wrong shape", exc) from exc
