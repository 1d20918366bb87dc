"""The resources one running gateway owns, created and closed by the app's lifespan.

Over 400 lines on purpose: the wiring (:meth:`Services.build`), the start order and the teardown stack
that reverses it are one sequence a reader must see whole to check that every resource is closed once,
after everything that uses it. What is not that sequence lives elsewhere (chain generations in
gateway/chains.py, the directory in gateway/directory/, reloads in gateway/reload.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from core.capabilities import EngineFacts
from core.settings import TenantConfig
from engines.controller import RolloutController
from engines.rollout.accuracy import HeldOutSentinel
from engines.rollout.energy import EnergyBook
from engines.rollout.offload import OffloadClient
from engines.rollout.offload import targets_from as offload_targets
from engines.rollout.rollback import Transition
from engines.rollout.sentinel import AccuracySentinel
from engines.rollout.state_store import build_store as build_state_store
from engines.rollout.telemetry import TelemetryCollector
from engines.selection.pool import EnginePool, SharedCaps, build_engine
from gateway.admission import AdmissionGate
from gateway.answer_audio import AnswerAudio
from gateway.auth_failures import AuthFailures
from gateway.chains import Chains, ChainSet
from gateway.directory.live import LiveDirectory
from gateway.engine_chat import PoolChat
from gateway.metrics_server import MetricsServer
from gateway.pipeline import Pipeline
from gateway.ratelimit import RateLimiter
from gateway.realtime.places import LocalPlaces, Places, SharedPlaces
from gateway.redis_client import SharedRedis
from gateway.settings import Settings
from gateway.sse import OpenStreams
from gateway.tenants import Directory
from observability.audit import AuditLog
from observability.audit import build_store as build_audit_store
from observability.metrics import Metrics
from observability.tracing import Tracing
from observability.tracing import build as build_tracing
from policies.base import Deps, LoadShedder
from policies.media.sandbox import MediaRuntime
from policies.registry import PolicyChain, available_plugins

if TYPE_CHECKING:
    from policies.grounding.scorer import Scorer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Services:
    settings: Settings
    metrics: Metrics
    pool: EnginePool
    #: the policy chain generations: the current one and those a reload retired (gateway/chains.py)
    chains: Chains
    pipeline: Pipeline
    controller: RolloutController
    #: failed authentications: the per-address limit and the interval's counts (every replica has one)
    auth_failures: AuthFailures
    #: set once shutdown begins: readiness fails, open streams get a deadline
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    drain_deadline: float | None = None
    #: the open SSE responses, ended at the drain deadline
    streams: OpenStreams = field(default_factory=OpenStreams)
    audit: AuditLog | None = None
    limiter: RateLimiter | None = None
    directory: Directory = field(default_factory=Directory)
    #: the tenant directory's store and this process's last read of it
    live: LiveDirectory | None = None
    #: decided once, from the config the process booted with; a reload never changes it
    auth_required: bool = True
    #: the listener of ``metrics.port`` when one is set
    metrics_server: MetricsServer | None = None
    plugins: Mapping[str, type] | None = None
    admission: AdmissionGate | None = None
    #: one reload at a time (gateway/reload.py)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: the closes of what build and start opened, in the order they opened (aclose unwinds it)
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    #: the grounding scorer, built only when a configured policy ``uses`` it; loaded by :meth:`start`.
    #: The gateway's, not a chain's: kept across reloads (its ``grounding`` settings need a restart)
    scorer: Scorer | None = None
    #: the replica's one Redis connection pool (``redis``), closed once, after everything that uses it
    redis: SharedRedis | None = None
    #: the media sandbox and byte budgets every chain's media steps share (policies/media/sandbox.py);
    #: the gateway's, kept across reloads (``media`` needs a restart)
    media: MediaRuntime | None = None
    #: OpenTelemetry traces (observability/tracing.py); None when tracing is off: requests carry no trace
    tracing: Tracing | None = None
    #: the places of each key's realtime sessions: in this process, or in Redis for every replica
    realtime_places: Places = field(default_factory=LocalPlaces)

    @classmethod
    def build(
        cls, settings: Settings, metrics: Metrics, plugins: Mapping[str, type] | None = None
    ) -> Services:
        from gateway import secret_check

        secret_check.check(settings)  # a placeholder or typed key never boots
        plugins = available_plugins() if plugins is None else plugins
        policies = ChainSet.build(settings, plugins)  # checked now; started by the lifespan
        routing = settings.routing
        pool = EnginePool([build_engine(cfg) for cfg in settings.engines], metrics, routing=routing)
        sentinel = (
            AccuracySentinel(routing.sentinel, metrics, seed=routing.seed)
            if routing.sentinel.enabled
            else None
        )
        state = routing.state
        redis = SharedRedis(settings.redis)  # the one pool every shared feature draws from
        state_store = build_state_store(state.backend, state.key_prefix, state.replica_id, redis.client)
        controller: RolloutController
        url_for = TelemetryCollector.metrics_url_for
        targets = [
            (e.name, url_for(str(e.base_url) if e.base_url else None, e.telemetry), e.telemetry)
            for e in settings.engines
        ]
        telemetry = TelemetryCollector(
            targets,
            routing.signals,
            metrics,
            active=lambda: controller.is_leader,
            variants={e.name: e.variant for e in settings.engines},
        )
        energy = EnergyBook(routing.energy.audio_tokens_per_s)
        accuracy = (
            HeldOutSentinel(
                routing.accuracy, lambda: pool.engines, metrics, active=lambda: controller.is_leader
            )
            if routing.accuracy.enabled
            else None
        )
        offload = OffloadClient(
            offload_targets(settings.engines, {n: url for n, url, _ in targets}),
            routing.controller.offload,
            metrics,
        )
        controller = RolloutController(
            pool,
            routing,
            metrics,
            state_store,
            telemetry,
            sentinel,
            energy=energy,
            accuracy=accuracy,
            offload=offload,
        )
        audit = (
            AuditLog(settings.audit, build_audit_store(settings.audit), metrics)
            if settings.audit.enabled
            else None
        )
        limiter = RateLimiter(settings.rate_limits, metrics, redis)
        admission = (
            AdmissionGate(settings.traffic, metrics, on_overload=pool.set_overloaded, redis=redis)
            if settings.traffic.enabled
            else None
        )
        if redis.configured:
            # Every replica counts each engine's requests in one place: its cap holds whatever the pod count.
            traffic = settings.traffic
            pool.share_caps(
                SharedCaps(
                    redis.client(),
                    metrics,
                    key_prefix=traffic.key_prefix,
                    lease_ttl_s=traffic.lease_ttl_s,
                    heartbeat_s=traffic.heartbeat_interval_s,
                    timeout_s=settings.redis.timeout_s,
                    probe_s=settings.redis.probe_s,
                    fail_open_share=traffic.fail_open_share,
                    replica_id=admission.replica_id if admission is not None else None,
                )
            )
        chains = Chains(policies)
        pipeline = Pipeline(
            pool,
            chains,
            metrics,
            audit=audit,
            limiter=limiter,
            sentinel=sentinel,
            admission=admission,
            energy=energy if routing.energy.usage_field else None,
            sampling_defaults={m: c.sampling_defaults.values() for m, c in settings.models.items()},
            answers=AnswerAudio.build(redis, settings.rate_limits.key_prefix),
            tracing=build_tracing(settings.tracing),
        )
        services = cls(
            settings,
            metrics,
            pool,
            chains,
            pipeline,
            controller,
            audit=audit,
            limiter=limiter,
            directory=Directory.build(settings),
            plugins=plugins,
            admission=admission,
            scorer=build_scorer_if_used(settings, metrics, policies.uses()),
            media=MediaRuntime(settings.media, eager=_names_media_limits(settings)),
            live=LiveDirectory(settings.auth.directory, metrics),
            auth_failures=build_auth_failures(settings, metrics, redis),
            redis=redis,
            auth_required=settings.auth_required,
            metrics_server=MetricsServer(settings, metrics) if settings.metrics.port is not None else None,
            tracing=pipeline.tracing,
        )
        if redis.configured:
            services.realtime_places = SharedPlaces(
                settings.traffic, redis, metrics, admission.replica_id if admission is not None else None
            )
        # Built here, used by what start starts: closed after all of it, the Redis pool last.
        services._on_close("redis", redis.aclose)
        tracing = services.tracing
        if tracing is not None:
            # Closed last: the spans of the requests that ended during the drain are flushed to the
            # collector (on a thread: the export may wait for its timeout).
            services._on_close("tracing", lambda: asyncio.to_thread(tracing.shutdown))
        services._on_close("limiter", limiter.aclose)
        services._on_close("auth_failures", services.auth_failures.aclose)
        if audit is not None:
            # Every routing transition, automatic or manual, goes into the same tamper-evident chain.
            controller.on_transition.append(services._audit_transition)
        return services

    @property
    def chain(self) -> PolicyChain:
        """The current default chain."""
        return self.chains.current.chain

    def deps(self, settings: Settings | None = None) -> Deps:
        """What the policies of a chain opened under ``settings`` (default: the running ones) may use."""
        return Deps(
            settings=settings or self.settings,
            metrics=self.metrics,
            resources={
                name: r for name, r in (("media", self.media), ("scorer", self.scorer)) if r is not None
            },
            engines=tuple(
                EngineFacts(e.name, tuple(e.config.serves), e.config.role, e.capabilities)
                for e in self.pool.engines.values()
            ),
            engine_chat=PoolChat(self.pool),
        )

    def describe_scorer(self) -> dict[str, Any] | None:
        return self.scorer.describe() if self.scorer is not None else None

    async def _audit_transition(self, transition: Transition) -> None:
        if self.audit is not None:
            await self.audit.append_event("routing_transition", transition.to_dict())

    async def start(self) -> None:
        """Start the resources and put each one's close on the stack; one that fails closes the rest and raises."""
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise

    async def _start(self) -> None:
        # Each resource starts after what it uses, and its close goes on the stack as soon as it has
        # started, so the unwinding closes it before them: the background tasks (the last failure
        # summary goes into the audit trail) before the audit writer and the directory; the chain
        # generations before the scorer and the media runtime they share; the controller and the
        # admission gate (both switch the engines) before the engine pool; and everything before the
        # limiter, the failure window and the Redis pool, which build put on the stack first.
        # The scorer's slot is taken before it loads: a reload may build one later, closed here too.
        self._on_close("scorer", self._close_scorer)
        if self.scorer is not None:
            # Loaded before the gateway serves: a configured model that cannot load fails the boot.
            await self.scorer.start()
        log.info(
            "gateway_starting",
            engines=[
                {"name": e.name, "kind": e.kind, "variant": e.variant, "serves": e.serves}
                for e in self.settings.engines
            ],
            policies=self.chain.describe(),
            grounding_scorer=self.describe_scorer(),
            policy_sets={name: c.describe() for name, c in self.pipeline.chains.items()},
        )
        if self.audit is not None:
            await self.audit.start()
            self._on_close("audit", self.audit.aclose)
        else:
            log.warning("audit_disabled")
        if self.live is not None:
            self._on_close("live", self.live.aclose)  # closes its store only once a read opened it
        await self.refresh_directory()
        auth = self.describe_auth()
        if not self.auth_required:
            log.warning("auth_disabled", reason=auth["reason"])
        elif not self.directory.tenants:
            log.warning("auth_required_no_tenants", reason=auth["reason"], directory=auth["directory"])
        else:
            log.info(
                "auth_required",
                tenants=len(self.directory.tenants),
                keys=len(self.directory.keys),
                directory=auth["directory"],
            )
        for name, loop in (
            ("directory-refresh", self._refresh_forever),
            ("auth-failure-summary", self._summarise_failures_forever),
        ):
            task = asyncio.create_task(loop(), name=name)
            self._tasks.append(task)
            self._on_close(name, functools.partial(_cancel, task))
        if self.media is not None:
            # On the stack before it starts: workers started by a start that then fails are killed too.
            self._on_close("media", self.media.aclose)
            await self.media.start()
        # Policies load their models before traffic can arrive (the lifespan has not yielded yet).
        await self.chains.current.open(self.deps())
        # Every generation (each policy's aclose in reverse start order), the retired ones included.
        self._on_close("chains", self.chains.aclose)
        await self.pool.start()
        self._on_close("pool", self.pool.aclose)
        await self.controller.start()
        self._on_close("controller", self.controller.aclose)
        if self.admission is not None:
            chains = {"policies": self.chain}
            chains.update({f"policy_sets.{n}": c for n, c in self.pipeline.chains.items()})
            unshed = unshed_chains(chains)
            if unshed:
                log.warning(
                    "load_shedding_not_in_chain",
                    chains=unshed,
                    detail="admission limits apply, but speech is not shed there above the soft limit",
                )
            await self.admission.start()
            # A close that fails (Redis gone at shutdown) is logged: the leases expire by themselves.
            self._on_close("admission", self.admission.aclose)
        await self.realtime_places.start()
        self._on_close("realtime_places", self.realtime_places.aclose)
        if self.metrics_server is not None:
            self.metrics_server.start()
            self._on_close("metrics_server", _as_async(self.metrics_server.stop))

    def _on_close(self, name: str, close: Callable[[], Awaitable[object]]) -> None:
        """Put ``close`` on the stack: run by :meth:`aclose` in the reverse order of registration."""
        self._stack.push_async_callback(_close_logged, name, close)

    async def _close_scorer(self) -> None:
        if self.scorer is not None:
            await self.scorer.aclose()

    def begin_drain(self) -> None:
        """Shutdown has begun: fail readiness now, and give open streams until the deadline."""
        if self.draining.is_set():
            return
        server = self.settings.server
        self.drain_deadline = (
            time.monotonic() + server.drain_delay_s + max(0.0, server.graceful_shutdown_s - 1.0)
        )
        self.draining.set()
        self.streams.cut_at(self.drain_deadline)
        log.warning(
            "gateway_draining", drain_delay_s=server.drain_delay_s, grace_s=server.graceful_shutdown_s
        )

    def describe_auth(self) -> dict[str, Any]:
        """Whether keys are required and why; what ``/readyz`` (to the admin), the banner and the log say."""
        from gateway.directory.live import write_refusal

        s = self.settings
        d = s.auth.directory
        shared = self.live.store.shared if self.live is not None else d.shared
        if s.auth.required is not None:
            origin = "auth.required"
        elif self.auth_required:
            origin = "the config names tenants, API keys, an admin key or a shared directory"
        else:
            origin = "no config names tenants, API keys, an admin key or a shared directory"
        tenants = len(self.directory.tenants)
        if not self.auth_required:
            reason = f"authentication is off ({origin}): every request is served, unauthenticated"
        elif tenants == 0:
            reason = f"authentication is required ({origin}) and no tenant exists: every request gets 401"
        else:
            reason = f"authentication is required ({origin})"
        return {
            "required": self.auth_required,
            "reason": reason,
            "tenants": tenants,
            "keys": len(self.directory.keys),
            "directory": {
                "backend": d.backend,
                "shared": shared,
                "replicas": s.auth.replicas,
                "fresh": not self.directory.stale(),
                "refresh_s": d.refresh_s,
                "fail_closed_after_s": d.fail_closed_after_s,
                "admin_writes": write_refusal(s, self.auth_required, shared) or "allowed",
            },
        }

    async def refresh_directory(self, *, rebuild: bool = True) -> None:
        """Rebuild the tenant and key directory from the config and the directory store.

        ``rebuild=False`` (the periodic refresh): when the store's revision did not move, only
        the snapshot's read time is renewed; the config cannot have changed without a reload,
        and a reload rebuilds.
        """
        tenants: list[TenantConfig] = []
        keys = []
        read_at = None
        if self.live is not None:
            before = self.live.revision
            await self.live.read()
            if not rebuild and self.live.revision == before and before is not None:
                self.directory = dataclasses.replace(self.directory, read_at=self.live.read_at)
                return
            tenants, keys, read_at = self.live.tenants, self.live.keys, self.live.read_at
        self.directory = Directory.build(self.settings, tenants, keys, read_at)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.auth.directory.refresh_s)
            try:
                await self.refresh_directory(rebuild=False)
            except (
                Exception
            ) as exc:  # a bug must not end the loop: the snapshot would freeze, then fail closed
                log.warning("directory_refresh_failed", error=f"{type(exc).__name__}: {exc}")

    async def summarise_failures(self) -> dict[str, Any] | None:
        """One aggregated record and log line for the interval's refused requests (none when there were none)."""
        summary = self.auth_failures.take_summary()
        if summary is None:
            return None
        log.warning("auth_failures_summary", **summary)
        if self.audit is not None:
            await self.audit.append_event("auth_failures", summary)
        return summary

    async def _summarise_failures_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.settings.auth.failures.summary_interval_s)
                try:
                    await self.summarise_failures()
                except Exception as exc:
                    log.warning("auth_failure_summary_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            # The last interval's counts are not lost at shutdown.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.summarise_failures())

    async def aclose(self) -> None:
        """Close what was started (and what build opened), in the reverse order; later calls close nothing."""
        await self._stack.aclose()


#: how long one resource's close may take at shutdown before it is abandoned (logged by name), so that a
#: store that stops answering cannot hold the process past its stop for good
_CLOSE_S = 15.0


async def _close_logged(name: str, close: Callable[[], Awaitable[object]]) -> None:
    # One resource's failing or hanging close must not keep the others open; it is logged, by name.
    try:
        async with asyncio.timeout(_CLOSE_S):
            await close()
    except TimeoutError:
        log.error("service_close_timed_out", resource=name, after_s=_CLOSE_S)
    except Exception as exc:
        log.warning("service_close_failed", resource=name, error=f"{type(exc).__name__}: {exc}")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _as_async(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        fn()

    return call


def unshed_chains(chains: dict[str, PolicyChain]) -> list[str]:
    """The chains (by where they are configured) without a :class:`~policies.base.LoadShedder` pre-policy."""
    return [
        where for where, c in chains.items() if not any(p.stage == "pre" for p in c.implementing(LoadShedder))
    ]


def build_auth_failures(
    settings: Settings, metrics: Metrics, redis: SharedRedis | None = None
) -> AuthFailures:
    """The failure limit, shared through Redis where one is configured (``store: auto``)."""
    f = settings.auth.failures
    shared = redis is not None and redis.configured and f.store != "memory"
    return AuthFailures(
        f, metrics, redis=redis if shared else None, key_prefix=f"{settings.rate_limits.key_prefix}:auth"
    )


def _names_media_limits(settings: Settings) -> bool:
    """Whether the operator put media-limits in a chain (then its workers start with the gateway)."""
    chains = [settings.policies, *settings.policy_sets.values()]
    return any(spec.name == "media-limits" for chain in chains for spec in chain.pre)


def build_scorer_if_used(settings: Settings, metrics: Metrics, used: set[str]) -> Scorer | None:
    """The grounding scorer when a configured policy uses it (not loaded yet), else None."""
    if "scorer" not in used:
        return None
    if settings.grounding.scorer == "served":  # the NLI model an engine serves (grounding.served)
        from policies.grounding.served import ServedScorer

        return ServedScorer(settings.grounding, metrics)
    from policies.grounding.scorer import build_scorer

    return build_scorer(settings.grounding, metrics)
