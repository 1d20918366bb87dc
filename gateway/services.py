"""The resources one running gateway owns, created and closed by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from engines.pool import EnginePool, build_engine
from gateway.admission import AdmissionGate
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
    admission: AdmissionGate | None = None

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, plugins: dict[str, type] | None = None) -> "Services":
        chain = build_chain(settings.policies, plugins)
        pool = EnginePool([build_engine(cfg) for cfg in settings.engines], metrics)
        admission = (
            AdmissionGate(settings.traffic, metrics, on_overload=pool.limits.set_overloaded)
            if settings.traffic.enabled
            else None
        )
        return cls(settings, metrics, pool, chain, Pipeline(pool, chain, metrics, admission), admission)

    async def start(self) -> None:
        log.info(
            "gateway_starting",
            engines=[
                {"name": e.name, "kind": e.kind, "variant": e.variant, "serves": e.serves}
                for e in self.settings.engines
            ],
            policies=self.chain.describe(),
        )
        if self.admission is not None:
            if not any(p.name == "load-shedding" for p in self.chain.pre):
                log.warning("load_shedding_not_in_chain",
                            detail="admission limits apply, but speech is never shed above the soft limit")
            await self.admission.start()
        await self.pool.start()

    async def aclose(self) -> None:
        if self.admission is not None:
            await self.admission.aclose()
        await self.pool.aclose()
