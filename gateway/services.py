"""The resources one running gateway owns, created and closed by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from engines.controller import RolloutController
from engines.pool import EnginePool, build_engine
from engines.sentinel import AccuracySentinel
from engines.state_store import build_store
from engines.telemetry import TelemetryCollector
from gateway.pipeline import Pipeline
from gateway.settings import Settings
from observability.metrics import Metrics
from policies.registry import PolicyChain, build_chain

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Services:
    settings: Settings
    metrics: Metrics
    pool: EnginePool
    chain: PolicyChain
    pipeline: Pipeline
    controller: RolloutController

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, plugins: dict[str, type] | None = None) -> "Services":
        chain = build_chain(settings.policies, plugins)
        routing = settings.routing
        pool = EnginePool([build_engine(cfg) for cfg in settings.engines], metrics, routing=routing)
        sentinel = None
        if routing.sentinel.enabled:
            sentinel = AccuracySentinel(routing.sentinel, metrics, seed=routing.seed)
        state = routing.state
        store = build_store(state.backend, state.redis_url, state.key_prefix, state.replica_id)
        controller: RolloutController
        url_for = TelemetryCollector.metrics_url_for
        targets = [
            (e.name, url_for(str(e.base_url) if e.base_url else None, e.telemetry), e.telemetry)
            for e in settings.engines
        ]
        telemetry = TelemetryCollector(targets, routing.signals, metrics, active=lambda: controller.is_leader)
        controller = RolloutController(pool, routing, metrics, store, telemetry, sentinel)
        pipeline = Pipeline(pool, chain, metrics, sentinel=sentinel)
        return cls(settings, metrics, pool, chain, pipeline, controller)

    async def start(self) -> None:
        log.info(
            "gateway_starting",
            engines=[
                {"name": e.name, "kind": e.kind, "variant": e.variant, "serves": e.serves}
                for e in self.settings.engines
            ],
            policies=self.chain.describe(),
        )
        await self.pool.start()
        await self.controller.start()

    async def aclose(self) -> None:
        try:
            await self.controller.aclose()
        finally:
            await self.pool.aclose()
