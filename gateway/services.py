"""The resources one running gateway owns, created and closed by the app's lifespan."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from engines.pool import EnginePool, build_engine
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
    #: set once shutdown begins: readiness fails, open streams get a deadline
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    drain_deadline: float | None = None

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, plugins: dict[str, type] | None = None) -> "Services":
        chain = build_chain(settings.policies, plugins)
        pool = EnginePool([build_engine(cfg) for cfg in settings.engines], metrics)
        return cls(settings, metrics, pool, chain, Pipeline(pool, chain, metrics))

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

    def begin_drain(self) -> None:
        """Shutdown has begun: fail readiness now, and give open streams until the deadline."""
        if self.draining.is_set():
            return
        server = self.settings.server
        self.drain_deadline = time.monotonic() + server.drain_delay_s + max(0.0, server.graceful_shutdown_s - 1.0)
        self.draining.set()
        log.warning("gateway_draining", drain_delay_s=server.drain_delay_s, grace_s=server.graceful_shutdown_s)

    async def aclose(self) -> None:
        await self.pool.aclose()
