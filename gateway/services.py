"""The resources one running gateway owns, created and closed by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

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
        # Policies load their models before traffic can arrive (the lifespan has not yielded yet).
        for policy in self.chain.all():
            start = getattr(policy.impl, "start", None)
            if start is not None:
                await start(self)
        await self.pool.start()

    async def aclose(self) -> None:
        await self.pool.aclose()
        for policy in self.chain.all():
            close = getattr(policy.impl, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception as exc:
                    log.warning("policy_close_failed", policy=policy.name, error=str(exc))
