"""The engines behind each public model, their health, and the order to try them in.

Health comes from a background probe loop (a watchdog off the request path) and
from passive outcomes reported by the pipeline. The request path only reads.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

import structlog

from engines.base import Engine
from engines.limits import EngineSlot, EngineSlots
from gateway.settings import EngineConfig
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

_ROLE_ORDER = {"primary": 0, "canary": 1, "fallback": 2}


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "vllm":
        from engines.openai_compat import OpenAICompatEngine

        return OpenAICompatEngine(config)
    if config.kind == "vllm-omni":
        from engines.vllm_omni import VLLMOmniEngine

        return VLLMOmniEngine(config)
    if config.kind == "litellm":
        from engines.litellm_engine import LiteLLMEngine

        return LiteLLMEngine(config)
    if config.kind == "local":
        from engines.local import LocalEngine

        return LocalEngine(config)
    raise ValueError(f"unknown engine kind {config.kind!r}")


class EnginePool:
    def __init__(self, engines: Iterable[Engine], metrics: Metrics, probe_interval_s: float = 5.0) -> None:
        self.engines: dict[str, Engine] = {e.name: e for e in engines}
        self._metrics = metrics
        self._probe_interval_s = probe_interval_s
        self._healthy: dict[str, bool] = {name: False for name in self.engines}
        self._by_model: dict[str, list[Engine]] = {}
        for engine in sorted(self.engines.values(), key=lambda e: _ROLE_ORDER[e.config.role]):
            for public in engine.config.serves:
                self._by_model.setdefault(public, []).append(engine)
        self._tasks: list[asyncio.Task[None]] = []
        self.limits = EngineSlots(self.engines.values(), metrics)

    # -- read side (request path) ------------------------------------------
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def candidates(self, model: str) -> list[Engine]:
        """Engines for ``model``: healthy ones first, in configured order."""
        engines = self._by_model.get(model, [])
        return sorted(engines, key=lambda e: not self._healthy.get(e.name, False))

    async def acquire(self, engines: list[Engine], model: str | None = None) -> EngineSlot:
        """A concurrency slot on the first of ``engines`` with room (see :mod:`engines.limits`).

        Only healthy engines take load that spills over from a full one; an unhealthy engine is tried
        only when none of ``engines`` is healthy (the last resort, as before limits existed).
        """
        healthy = [e for e in engines if self._healthy.get(e.name, False)]
        return await self.limits.acquire(healthy or engines, model)

    def is_healthy(self, name: str) -> bool:
        return self._healthy.get(name, False)

    @property
    def ready(self) -> bool:
        return any(self._healthy.values())

    def health_report(self) -> dict[str, bool]:
        return dict(self._healthy)

    # -- write side ---------------------------------------------------------
    def _set_health(self, engine: Engine, healthy: bool) -> None:
        if self._healthy.get(engine.name) != healthy:
            log.info("engine_health_changed", engine=engine.name, healthy=healthy)
        self._healthy[engine.name] = healthy
        self._metrics.engine_healthy.labels(engine.name, engine.config.variant).set(1 if healthy else 0)

    def report_failure(self, engine: Engine) -> None:
        """A request could not reach the engine: stop preferring it until a probe says otherwise."""
        self._set_health(engine, False)

    async def start(self) -> None:
        for engine in self.engines.values():
            self._tasks.append(asyncio.create_task(self._start_one(engine), name=f"engine-start-{engine.name}"))

    async def _start_one(self, engine: Engine) -> None:
        try:
            await engine.start()
        except Exception as exc:  # an engine that cannot start must not take the others down
            log.error("engine_start_failed", engine=engine.name, error=str(exc))
            self._set_health(engine, False)
        else:
            self._set_health(engine, await engine.health())
        await self._probe_forever(engine)

    async def _probe_forever(self, engine: Engine) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                healthy = await engine.health()
            except Exception as exc:
                log.warning("engine_probe_failed", engine=engine.name, error=str(exc))
                healthy = False
            self._set_health(engine, healthy)

    async def probe_now(self) -> None:
        for engine in self.engines.values():
            self._set_health(engine, await engine.health())

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in self.engines.values():
            try:
                await engine.aclose()
            except Exception as exc:
                log.warning("engine_close_failed", engine=engine.name, error=str(exc))
