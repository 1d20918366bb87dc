"""A client of one guard model served by an engine: vLLM's pooling endpoints, TEI's, micro-batched.

    ServedModel
    ├── score(pairs)      -> one number per (text_1, text_2) pair
    │     endpoint score        vLLM  POST /score  {"model", "text_1": [...], "text_2": [...]}
    │     endpoint rerank       vLLM  POST /rerank {"model", "query", "documents"} (one call per query)
    │     endpoint tei-rerank   TEI   POST /rerank {"query", "texts"}              (one call per query)
    ├── classify(texts)   -> the class probabilities of each text (or pair, as token ids)
    │     endpoint classify     vLLM  POST /classify {"model", "input": [...]}
    │     endpoint tei-predict  TEI   POST /predict  {"inputs": [...]} (labels named by the answer)
    │     endpoint chat-guard   any   POST /v1/chat/completions, one call per text (Llama Guard style:
    │                                 "safe", or "unsafe" and a line of category codes)
    ├── transcribe(audio) -> the words of one audio file (not batched: one call per file)
    │     endpoint transcriptions  vLLM (or any OpenAI-compatible server) POST /v1/audio/transcriptions,
    │                              multipart: file, model, response_format json
    └── ServedImageModel (policies/served/vision.py): classify_images(images) -> per image, by label
          endpoint kserve-v2    KServe / Triton  POST /v2/models/{model}/infer, one FP32 tensor per batch
          endpoint torchserve   TorchServe       POST /predictions/{model}, the image's bytes, one per call

Concurrent callers share calls (:class:`policies.served.batcher.MicroBatcher`): one engine call per batch
window. The base URL, the model and the key come from the config, never from a request; the pool of
connections is bounded. Whatever goes wrong (refused, reset, a timeout, an HTTP error, an answer of the
wrong shape) is :class:`core.errors.GuardUnavailable`, whose message names the model but not its address
(the address is in the log): the policy's ``on_error`` decides what the request gets.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import httpx
import structlog

from core.errors import GuardUnavailable
from policies.served.batcher import MicroBatcher
from policies.settings import ServedModelSettings

log = structlog.get_logger(__name__)

#: one input of ``classify``: a text, or a pair already tokenised by the model's tokenizer (vLLM 0.32
#: classifies text pairs only as token ids)
ClassifyInput = str | list[int]


class ServedModel:
    """One served guard model: its connection pool and its two batchers (pairs to score, inputs to classify)."""

    def __init__(self, settings: ServedModelSettings, *, name: str = "served-guard") -> None:
        self.settings = settings
        self.name = name
        headers = (
            {"authorization": f"Bearer {settings.api_key.get_secret_value()}"} if settings.api_key else {}
        )
        self._http = httpx.AsyncClient(
            base_url=settings.url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(settings.timeout_s),
            limits=httpx.Limits(
                max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
            ),
            follow_redirects=False,  # a guard model that redirects is misconfigured, not followed
        )
        common: dict[str, Any] = {
            "max_batch": settings.max_batch,
            "max_wait_s": settings.max_wait_ms / 1000.0,
            "deadline_s": settings.timeout_s,
            "max_inflight": settings.max_inflight,
            "name": name,
        }
        self.pairs: MicroBatcher[tuple[str, str], float] = MicroBatcher(self._score_batch, **common)
        self.inputs: MicroBatcher[ClassifyInput, dict[str, float]] = MicroBatcher(
            self._classify_batch, **common
        )

    def describe(self) -> dict[str, Any]:
        return self.describe_settings(self.settings)

    @staticmethod
    def describe_settings(s: ServedModelSettings) -> dict[str, Any]:
        """What a receipt and the start-up log say of the model (never its address or key)."""
        return {
            "model": s.model,
            "endpoint": s.endpoint,
            "max_batch": s.max_batch,
            "max_wait_ms": s.max_wait_ms,
            "timeout_s": s.timeout_s,
        }

    async def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One score per pair (vLLM's ``/score``: the model's activated output, 0..1 for a cross-encoder)."""
        return await self.pairs.submit(list(pairs))

    async def classify(self, inputs: Sequence[ClassifyInput]) -> list[dict[str, float]]:
        """The probability of each label, by label name, for each input."""
        return await self.inputs.submit(list(inputs))

    async def transcribe(
        self, audio: bytes, *, filename: str = "audio.wav", language: str | None = None
    ) -> str:
        """The transcript of one audio file, within ``timeout_s`` (a speech-to-text model the engine serves)."""
        data = {"model": self.settings.model, "response_format": "json"}
        if language is not None:
            data["language"] = language
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                r = await self._http.post(
                    "/v1/audio/transcriptions",
                    data=data,
                    files={"file": (filename, audio, "application/octet-stream")},
                )
        except TimeoutError as exc:
            raise GuardUnavailable(
                f"the {self.name} model {self.settings.model!r} did not answer within {self.settings.timeout_s:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            log.warning("served_guard_unreachable", guard=self.name, url=self.settings.url, error=repr(exc))
            raise GuardUnavailable(f"the {self.name} model {self.settings.model!r} is unreachable") from exc
        if r.status_code != 200:
            raise self._malformed(f"HTTP {r.status_code}")
        try:
            return str(r.json()["text"])
        except (ValueError, KeyError, TypeError) as exc:
            raise self._malformed("a transcription of the wrong shape", exc) from exc

    async def aclose(self) -> None:
        await self.pairs.aclose()
        await self.inputs.aclose()
        await self._http.aclose()

    # -- one engine call -------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any] | None = None, *, content: bytes = b"") -> Any:
        try:
            r = await (
                self._http.post(path, json=body)
                if body is not None
                else self._http.post(path, content=content)
            )
        except httpx.HTTPError as exc:
            log.warning("served_guard_unreachable", guard=self.name, url=self.settings.url, error=repr(exc))
            raise GuardUnavailable(f"the {self.name} model {self.settings.model!r} is unreachable") from exc
        if r.status_code != 200:
            log.warning(
                "served_guard_error",
                guard=self.name,
                url=self.settings.url,
                status=r.status_code,
                body=r.text[:500],
            )
            raise GuardUnavailable(
                f"the {self.name} model {self.settings.model!r} answered HTTP {r.status_code}"
            )
        try:
            return r.json()
        except ValueError as exc:
            raise GuardUnavailable(f"the {self.name} model {self.settings.model!r} answered no JSON") from exc

    def _malformed(self, what: str, exc: Exception | None = None) -> GuardUnavailable:
        log.warning(
            "served_guard_malformed", guard=self.name, url=self.settings.url, what=what, error=repr(exc)
        )
        return GuardUnavailable(f"the {self.name} model {self.settings.model!r} answered {what}")

    def _truncation(self) -> dict[str, Any]:
        t = self.settings.truncate_prompt_tokens
        return {} if t is None else {"truncate_prompt_tokens": t}

    async def _score_batch(self, pairs: list[tuple[str, str]]) -> list[float]:
        endpoint = self.settings.endpoint
        if endpoint == "score":
            body = {
                "model": self.settings.model,
                "text_1": [a for a, _ in pairs],
                "text_2": [b for _, b in pairs],
                **self._truncation(),
            }
            return self._by_index(await self._post("/score", body), "data", "score", len(pairs))
        if endpoint in ("rerank", "tei-rerank"):
            # One query per call: the window's pairs grouped by their first text, the calls made together.
            groups: dict[str, list[int]] = {}
            for i, (query, _) in enumerate(pairs):
                groups.setdefault(query, []).append(i)
            answers = await asyncio.gather(
                *(self._rerank(q, [pairs[i][1] for i in idx]) for q, idx in groups.items())
            )
            out = [0.0] * len(pairs)
            for idx, scores in zip(groups.values(), answers, strict=True):
                for i, s in zip(idx, scores, strict=True):
                    out[i] = s
            return out
        raise self._malformed(f"nothing for pairs to score: its endpoint is {endpoint!r}")

    async def _rerank(self, query: str, documents: list[str]) -> list[float]:
        if self.settings.endpoint == "rerank":
            body = {
                "model": self.settings.model,
                "query": query,
                "documents": documents,
                **self._truncation(),
            }
            return self._by_index(
                await self._post("/rerank", body), "results", "relevance_score", len(documents)
            )
        tei = await self._post("/rerank", {"query": query, "texts": documents, "truncate": True})
        return self._by_index({"results": tei}, "results", "score", len(documents))

    def _by_index(self, answer: Any, key: str, field: str, n: int) -> list[float]:
        try:
            rows = answer[key]
            out: list[float | None] = [None] * n
            for row in rows:
                out[int(row["index"])] = float(row[field])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._malformed(f"a {key} list of the wrong shape", exc) from exc
        if any(x is None for x in out):
            raise self._malformed(f"{len(rows)} results for {n} inputs")
        return [x for x in out if x is not None]

    async def _classify_batch(self, inputs: list[ClassifyInput]) -> list[dict[str, float]]:
        endpoint = self.settings.endpoint
        if endpoint == "classify":
            body = {"model": self.settings.model, "input": inputs, **self._truncation()}
            answer = await self._post("/classify", body)
            labels = self.settings.labels
            try:
                rows = sorted(answer["data"], key=lambda r: int(r["index"]))
                probs = [[float(p) for p in r["probs"]] for r in rows]
            except (KeyError, TypeError, ValueError) as exc:
                raise self._malformed("a data list of the wrong shape", exc) from exc
            if len(probs) != len(inputs):
                raise self._malformed(f"{len(probs)} results for {len(inputs)} inputs")
            if labels is None:
                # Unnamed labels: by index ("0", "1", ...), with the top one's name where the engine gives it.
                return [{str(i): p for i, p in enumerate(ps)} for ps in probs]
            if any(len(ps) != len(labels) for ps in probs):
                raise self._malformed(f"{len(probs[0])} classes where the config names {len(labels)} labels")
            return [dict(zip(labels, ps, strict=True)) for ps in probs]
        if endpoint == "tei-predict":
            if any(not isinstance(x, str) for x in inputs):
                raise self._malformed("nothing for token ids: TEI's /predict takes texts")
            answer = await self._post("/predict", {"inputs": [[x] for x in inputs], "truncate": True})
            try:
                return [{str(c["label"]): float(c["score"]) for c in row} for row in answer]
            except (KeyError, TypeError, ValueError) as exc:
                raise self._malformed("a prediction list of the wrong shape", exc) from exc
        if endpoint == "chat-guard":
            if any(not isinstance(x, str) for x in inputs):
                raise self._malformed("nothing for token ids: a chat guard reads texts")
            return list(await asyncio.gather(*(self._chat_guard(str(x)) for x in inputs)))
        raise self._malformed(f"nothing for inputs to classify: its endpoint is {endpoint!r}")

    async def _chat_guard(self, text: str) -> dict[str, float]:
        """One text judged by a generative safety model: its answer read as label probabilities.

        The answer's first word is the verdict (``safe`` / ``unsafe``); a second line names the categories
        (Llama Guard's ``S1,S10``). The verdict's probability is its first token's (the engine's logprobs;
        1.0 where it gives none): ``unsafe`` and each named category score it, ``safe`` the rest.
        """
        s = self.settings
        body: dict[str, Any] = {
            "model": s.model,
            "messages": [{"role": "user", "content": s.prompt.replace("{text}", text) if s.prompt else text}],
            "max_tokens": 32,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 1,
        }
        if s.choices is not None:
            body["structured_outputs"] = {"choice": s.choices}
        answer = await self._post("/v1/chat/completions", body)
        try:
            choice = answer["choices"][0]
            words = str(choice["message"]["content"] or "").strip()
            first = (choice.get("logprobs") or {}).get("content") or []
            p = math.exp(float(first[0]["logprob"])) if first else 1.0
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._malformed("a chat completion of the wrong shape", exc) from exc
        lines = words.splitlines() or [""]
        verdict = lines[0].strip().lower()
        if verdict.startswith("unsafe"):
            unsafe = p
        elif verdict.startswith("safe"):
            unsafe = 1.0 - p
        else:
            raise self._malformed(f"neither safe nor unsafe ({words[:40]!r})")
        out = {"safe": 1.0 - unsafe, "unsafe": unsafe}
        if verdict.startswith("unsafe") and len(lines) > 1:
            for code in lines[1].split(","):
                if code.strip():
                    out[code.strip().upper()] = unsafe
        return out
