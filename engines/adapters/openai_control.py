"""An OpenAI-compatible engine's construction, lifecycle and probes: what runs at start, at close and
for the health checks, never for a request (:class:`engines.adapters.openai_compat.OpenAICompatEngine`
adds the calls)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from core.errors import EngineUnavailable
from core.schemas import FEATURE_FIELDS, VLLM_EXTRA_FIELDS
from engines.adapters.base import declared
from engines.adapters.settings import EngineConfig


class OpenAICompatBase:
    """An engine that speaks plain OpenAI chat completions: its session, its start and close, its probes."""

    #: vLLM's sampling and decoding extras this kind of engine honours (core.schemas.VLLM_EXTRA_FIELDS)
    extras: tuple[str, ...] = VLLM_EXTRA_FIELDS

    def __init__(self, config: EngineConfig) -> None:
        self.name = config.name
        self.config = config
        self._base = str(config.base_url).rstrip("/")
        self._url = self._base + "/chat/completions"
        # n > 1 only where every choice is read back (plain vLLM); vLLM-Omni's answers fold choices into one.
        features = frozenset((*FEATURE_FIELDS, *self.extras)) | ({"n"} if config.kind == "vllm" else set())
        self.capabilities = declared(config, features=features, thinking_budget=config.thinking_budget)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key is not None:
            self._headers["Authorization"] = f"Bearer {config.api_key.get_secret_value()}"
        self._session: aiohttp.ClientSession | None = None
        self._draining: set[asyncio.Task[None]] = set()

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        # Idle pooled connections are dropped before the engine's own keep-alive timeout
        # (uvicorn, under vLLM, closes after 5 s): reusing one it just closed would fail a request.
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections,
            ttl_dns_cache=300,
            keepalive_timeout=self.config.keepalive_timeout_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
            ),
            json_serialize=lambda o: orjson.dumps(o).decode(),
            auto_decompress=False,
        )

    async def aclose(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self) -> bool:
        session = self._require_session()
        root = self._base[: -len("/v1")] if self._base.endswith("/v1") else self._base
        try:
            async with asyncio.timeout(self.config.connect_timeout_s + 2):
                async with session.get(root + "/health", headers=self._headers) as resp:
                    # 503 is a dead engine even while /v1/models still answers; only a server without the
                    # route (404) is judged by /v1/models.
                    if resp.status != 404:
                        return resp.status == 200
                async with session.get(self._base + "/models", headers=self._headers) as resp:
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def served_models(self) -> list[dict[str, Any]]:
        """The engine's ``/v1/models`` cards (``id``, ``root``): what engines/selection/identity.py checks."""
        session = self._require_session()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s + 2):
                async with session.get(self._base + "/models", headers=self._headers) as resp:
                    if resp.status != 200:
                        raise EngineUnavailable(
                            f"engine {self.name} answered {resp.status} to /v1/models", engine=self.name
                        )
                    doc = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            raise EngineUnavailable(f"engine {self.name} did not list its models", engine=self.name) from exc
        data = doc.get("data") if isinstance(doc, dict) else None
        return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []

    def _require_session(self) -> aiohttp.ClientSession:
        # OpenAICompatEngine's, beside the stream that calls it for every request.
        raise NotImplementedError
