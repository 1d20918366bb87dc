"""The engines behind each public model: a small facade over the pool's three jobs.

- :mod:`engines.selection.health`: probed health, model identity and each engine's circuit breaker;
- :mod:`engines.selection.slots`: per-engine concurrency, the bounded FIFO wait and the :class:`Lease` a request
  holds on its engine; with Redis, the caps are shared by every replica (:meth:`EnginePool.share_caps`);
- :mod:`engines.selection.choice`: the order to try a model's engines in, drawn from the routing table
  (:mod:`engines.rollout.routing`) that the rollback controller publishes; the request path only reads it.

Control hands the request path one immutable :class:`~engines.selection.view.View` (routing table, overload),
built from the current one and swapped in by :meth:`EnginePool.publish` (``set_table``, ``set_overloaded``:
shorthands); a request reads it once. The data plane reacts to a new view by itself, and its transitions go
out through :attr:`EnginePool.transitions`, which the controller subscribes to.

The pipeline asks :meth:`EnginePool.candidates` for the order, takes a :meth:`EnginePool.lease` on the
first engine with a free slot and reports outcomes back; the admin views and the controller read the
rest.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import structlog

from engines.adapters.base import Engine
from engines.rollout.routing import EngineInfo, RoutingTable, base_weights
from engines.rollout.settings import RoutingSettings
from engines.rollout.signals import EngineSummary
from engines.selection import choice
from engines.selection.build import build_engine
from engines.selection.health import Health
from engines.selection.shared_caps import SharedCaps
from engines.selection.slots import Lease, Slots
from engines.selection.transitions import Transitions
from engines.selection.view import View, Views
from observability.metrics import Metrics

__all__ = ["EnginePool", "Lease", "SharedCaps", "View", "build_engine"]

log = structlog.get_logger(__name__)


class EnginePool:
    def __init__(
        self,
        engines: Iterable[Engine],
        metrics: Metrics,
        probe_interval_s: float | None = None,
        routing: RoutingSettings | None = None,
    ) -> None:
        self.routing = routing or RoutingSettings()
        self.engines: dict[str, Engine] = {e.name: e for e in engines}
        self._metrics = metrics
        self._by_model = choice.by_model(self.engines.values())
        self.infos: dict[str, EngineInfo] = {
            name: EngineInfo(name, e.config.variant, e.config.role, tuple(e.config.serves), e.config.weight)
            for name, e in self.engines.items()
        }
        self._rng = random.Random(self.routing.seed)
        self.views = Views(View(RoutingTable(weights=base_weights(self.infos.values()))))
        #: every circuit and health transition, for whoever subscribes (the rollback controller)
        self.transitions = Transitions()
        interval = self.routing.probe_interval_s if probe_interval_s is None else probe_interval_s
        self.health = Health(
            self.engines,
            self.infos,
            metrics,
            self.routing,
            self.views,
            interval,
            self.transitions,
            self._availability,
        )
        self.slots = Slots(self.engines, self._by_model, self.health, metrics, self.views)
        for name in self.engines:
            self.health.refresh_state(name)
            self.slots.gauges(name)

    # the health's and slots' state under the names the pool's tests and admin views have always used
    @property
    def _healthy(self) -> dict[str, bool]:
        return self.health.healthy

    @property
    def _circuits(self) -> dict[str, object]:
        return self.health.circuits  # type: ignore[return-value]

    def _set_health(self, engine: Engine, healthy: bool) -> None:
        self.health.set_health(engine, healthy)

    def _availability(self, name: str, up: bool) -> None:
        """Health's news for the slots: ``name``'s circuit closed again (``up``) or it became unavailable."""
        if up:
            self.slots.grow(name)
        else:
            self.slots.strand_check(name)

    @property
    def view(self) -> View:
        """The view requests read now (routing table, overload, generation)."""
        return self.views.current

    @property
    def table(self) -> RoutingTable:
        return self.views.current.table

    @property
    def overloaded(self) -> bool:
        return self.views.current.overloaded

    def share_caps(self, shared: SharedCaps) -> None:
        """Hold each engine's cap across every replica through ``shared`` (started and closed with the pool)."""
        self.slots.shared = shared

    # -- read side (request path) ------------------------------------------
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def candidates(self, model: str, view: View | None = None) -> list[Engine]:
        """Engines for ``model`` in the order to try them (:func:`engines.selection.choice.order`), under
        ``view`` (None: the current one, read once). An engine the controller put to sleep (the table's
        ``asleep``) or serving other weights is not a candidate."""
        view = self.views.current if view is None else view
        table, health, slots = view.table, self.health, self.slots
        return choice.order(
            self._by_model.get(model, ()),
            table.weights.get(model, {}),
            self._rng,
            excluded=lambda name: name in table.asleep or name in health.mismatched,
            open_to_load=lambda name: health.up(name) and not slots.full(name, view),
        )

    def is_healthy(self, name: str) -> bool:
        return self.health.healthy.get(name, False)

    @property
    def ready(self) -> bool:
        return any(self.health.healthy.values())

    @property
    def started(self) -> bool:
        """Every engine has been started and probed once, whatever the verdict."""
        return self.health.all_probed

    def health_report(self) -> dict[str, bool]:
        return dict(self.health.healthy)

    def mismatches(self) -> dict[str, str]:
        """Engines that do not serve the model id or revision they were configured with, and why."""
        return dict(self.health.mismatched)

    def circuit_state(self, name: str) -> str:
        return self.health.circuits[name].current()

    def in_flight(self, name: str) -> int:
        return self.slots.in_flight.get(name, 0)

    def limit(self, name: str) -> int | None:
        """The engine's concurrency cap now (see :meth:`engines.selection.slots.Slots.limit`); None: no cap."""
        return self.slots.limit(name)

    def configured_cap(self, name: str) -> int | None:
        """The engine's own cap (``max_in_flight``), before overload, routing limits or raises."""
        return self.slots.configured_cap(name)

    def waiting(self, name: str) -> int:
        return self.slots.waiting(name)

    def concurrency(self) -> dict[str, dict[str, int | None]]:
        """Per engine: requests holding a slot, its cap and requests waiting (admin views, tests)."""
        return {
            name: {"in_flight": n, "limit": self.limit(name), "waiting": self.waiting(name)}
            for name, n in self.slots.in_flight.items()
        }

    def summaries(self, window_s: float | None = None) -> dict[str, EngineSummary]:
        """This replica's measurements per engine over the window (off the request path)."""
        return self.health.summaries(window_s if window_s is not None else self.routing.signals.window_s)

    def engine_state(self, name: str) -> str:
        """One word for the engine: serving, standby, ejected, half_open or down."""
        return self.health.state(name)

    # -- request path: claims and outcomes ---------------------------------
    def acquire(self, engine: Engine) -> bool:
        """Claim one request's slot on ``engine`` now; False when it is at its cap or ejected."""
        return self.slots.acquire(engine)

    async def claim(
        self, engines: list[Engine], model: str | None = None, view: View | None = None
    ) -> Engine | None:
        """A slot on the first of ``engines`` that has one (see :meth:`engines.selection.slots.Slots.claim`)."""
        return await self.slots.claim(engines, model, view)

    async def lease(
        self, engines: list[Engine], model: str | None = None, view: View | None = None
    ) -> Lease | None:
        """:meth:`claim`, held as a :class:`Lease` that settles the slot once; None: no engine could be
        claimed. ``view``: the one the request read (None: the current one)."""
        got = await self.slots.claim_slot(engines, model, view)
        if got is None:
            return None
        return Lease(got[0], self.slots.release, self.health.failure, shared=got[1])

    def release(self, engine: Engine | str, *, settled: bool = True) -> None:
        """End a claim. ``settled=False``: no outcome was reported (the half-open trial is given back)."""
        self.slots.release(engine, settled=settled)

    def report_success(self, engine: Engine | str, ttft_s: float | None, first_audio_s: float | None,
                       e2e_s: float, upstream_ttft_s: float | None = None,
                       upstream_e2e_s: float | None = None, tokens: int = 0,
                       audio_s: float = 0.0, *, prompt_tokens: int = 0,
                       tenant: str | None = None) -> None:  # fmt: skip
        """A served request's latencies for its engine's window; ``prompt_tokens`` (as the engine reported
        them) and ``tenant`` let the window judge the engine rather than one tenant's prompts."""
        name = engine if isinstance(engine, str) else engine.name
        self.health.success(
            name,
            ttft_s,
            first_audio_s,
            e2e_s,
            upstream_ttft_s,
            upstream_e2e_s,
            tokens,
            audio_s,
            prompt_tokens,
            tenant=tenant,
        )

    def report_failure(self, engine: Engine | str) -> None:
        """A request failed at the engine (refused, reset, timed out, 5xx, broken stream)."""
        self.health.failure(engine if isinstance(engine, str) else engine.name)

    # -- write side (control) -----------------------------------------------
    def publish(self, view: View) -> None:
        """Make ``view`` (built from the current one, :meth:`View.next`) the one requests read: one reference
        assignment, so a request sees the old or the new. The engines' gauges show it at once; requests
        waiting for a slot wake on it by themselves."""
        self.views.publish(view)
        for name in self.engines:
            self.health.refresh_state(name)
            self._metrics.engine_weight.labels(name).set(view.table.engine_weight(name))
            self.slots.gauges(name)

    def set_table(self, table: RoutingTable) -> None:
        """Publish the next view with a new routing table (the controller)."""
        self.publish(self.views.current.next(table=table))

    def set_overloaded(self, overloaded: bool) -> None:
        """Publish the next view with every engine at its overload cap, or back (the admission gate's loop)."""
        if overloaded == self.overloaded:
            return
        self.publish(self.views.current.next(overloaded=overloaded))
        for name in self.engines:
            log.info(
                "engine_limit_changed",
                engine=name,
                limit=self.limit(name),
                overloaded=overloaded,
                in_flight=self.in_flight(name),
            )

    def readmit(self, name: str) -> bool:
        """Close an engine's circuit by hand; True when it was open or half-open."""
        return self.health.readmit(name)

    async def start(self) -> None:
        if self.slots.shared is not None:
            await self.slots.shared.start()
        await self.health.start()

    async def probe_now(self) -> None:
        await self.health.probe_now()

    async def aclose(self) -> None:
        await self.health.stop()
        if self.slots.shared is not None:
            try:
                await self.slots.shared.aclose()
            except Exception as exc:  # Redis gone at shutdown: the leases expire by themselves
                log.warning("engine_caps_close_failed", error=repr(exc))
        for engine in self.engines.values():
            try:
                await engine.aclose()
            except Exception as exc:
                log.warning("engine_close_failed", engine=engine.name, error=str(exc))
