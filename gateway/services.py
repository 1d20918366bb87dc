"""The resources one running gateway owns, created and closed by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from engines.pool import EnginePool, build_engine
from gateway.pipeline import Pipeline
from gateway.settings import Settings
from observability.metrics import Metrics
from policies.registry import PolicyChain, available_plugins, build_chain, resources_used

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Services:
    settings: Settings
    metrics: Metrics
    pool: EnginePool
    chain: PolicyChain
    pipeline: Pipeline
    #: the grounding scorer, built only when a configured policy ``uses`` it; loaded by :meth:`start`
    scorer: Any = None

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, plugins: dict[str, type] | None = None) -> "Services":
        plugins = available_plugins() if plugins is None else plugins
        chain = build_chain(settings.policies, plugins)
        pool = EnginePool([build_engine(cfg) for cfg in settings.engines], metrics)
        scorer = build_scorer_if_used(settings, metrics, resources_used(settings.policies, plugins))
        return cls(settings, metrics, pool, chain, Pipeline(pool, chain, metrics), scorer)

    def describe_scorer(self) -> dict[str, Any] | None:
        return self.scorer.describe() if self.scorer is not None else None

    async def start(self) -> None:
        if self.scorer is not None:
            # Loaded before the gateway serves: a configured model that cannot load fails the boot.
            await self.scorer.start()
        # Policies take their models and shared resources before traffic can arrive.
        for policy in self.chain.all():
            start = getattr(policy.impl, "start", None)
            if start is not None:
                await start(self)
        log.info(
            "gateway_starting",
            engines=[
                {"name": e.name, "kind": e.kind, "variant": e.variant, "serves": e.serves}
                for e in self.settings.engines
            ],
            policies=self.chain.describe(),
            grounding_scorer=self.describe_scorer(),
        )
        await self.pool.start()

    async def aclose(self) -> None:
        await self.pool.aclose()
        if self.scorer is not None:
            await self.scorer.aclose()


def build_scorer_if_used(settings: Settings, metrics: Metrics, used: set[str]) -> Any:
    """The grounding scorer when a configured policy uses it (not loaded yet), else None."""
    if "scorer" not in used:
        return None
    from policies.grounding.scorer import build_scorer

    return build_scorer(settings.grounding, metrics)
