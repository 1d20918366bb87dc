"""Whether each engine may take load: probed health, model identity, and its circuit breaker.

Health comes from a background probe loop (a watchdog off the request path); passive outcomes
the pipeline reports feed each engine's circuit breaker (:mod:`engines.selection.circuit`) and its outcome
window (:mod:`engines.rollout.signals`). Every change of state is published as a metric and as a
:class:`engines.rollout.rollback.Transition` on the pool's :class:`~engines.selection.transitions.Transitions`
(the rollback controller subscribes there). An engine going away or coming back is told to the pool's
``availability`` callback, given at construction, which passes it on to the slots
(:mod:`engines.selection.slots`); nothing is set on health from outside.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from engines.adapters.base import Engine
from engines.rollout.rollback import Transition
from engines.rollout.routing import EngineInfo
from engines.rollout.settings import RoutingSettings
from engines.rollout.signals import EngineSummary, OutcomeWindow
from engines.selection.circuit import Circuit
from engines.selection.identity import ListsModels, identity_problem
from engines.selection.transitions import Transitions
from engines.selection.view import Views
from observability.metrics import ENGINE_STATES, Metrics

log = structlog.get_logger("engines.pool")

_CIRCUIT_ACTIONS = {"open": "eject", "half_open": "half_open", "closed": "readmit"}
_CIRCUIT_REASONS = {
    "eject": "outlier-ejection",
    "half_open": "ejection-elapsed",
    "readmit": "half-open-success",
}


class Health:
    def __init__(
        self,
        engines: dict[str, Engine],
        infos: dict[str, EngineInfo],
        metrics: Metrics,
        routing: RoutingSettings,
        views: Views,
        probe_interval_s: float,
        transitions: Transitions,
        availability: Callable[[str, bool], None],
    ) -> None:
        """``availability(name, up)``: engine ``name`` became unavailable (False) or its circuit closed again
        (True)."""
        self.engines = engines
        self.infos = infos
        self._metrics = metrics
        self._views = views
        self._probe_interval_s = probe_interval_s
        self.healthy: dict[str, bool] = {name: False for name in engines}
        #: engines serving another model id or revision than configured: never routed to, with the reason
        self.mismatched: dict[str, str] = {
            e.name: "its model has not been verified yet"
            for e in engines.values()
            if e.config.expected_model is not None or e.config.expected_revision is not None
        }
        for name in self.mismatched:
            metrics.engine_model_verified.labels(name, engines[name].config.variant).set(0)
        self.circuits = {name: Circuit(routing.circuit) for name in engines}
        signals = routing.signals
        self.windows = {
            name: OutcomeWindow(
                signals.max_samples,
                window_s=signals.window_s,
                tenant_share_cap=signals.tenant_share_cap,
                prompt_tokens_floor=signals.prompt_tokens_floor,
            )
            for name in engines
        }
        #: where every transition (eject, half_open, readmit, up, down) is published
        self._transitions = transitions
        self._availability = availability
        self._probed: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    # -- read side ------------------------------------------------------------
    @property
    def all_probed(self) -> bool:
        """Every engine has had its first probe (or failed to start): where a start ends."""
        return len(self._probed) >= len(self.engines)

    def up(self, name: str) -> bool:
        """Healthy and its circuit lets requests through."""
        return self.healthy.get(name, False) and self.circuits[name].available()

    def state(self, name: str) -> str:
        """One word for the engine: serving, standby, ejected, half_open or down."""
        if not self.healthy.get(name, False):
            return "down"
        c = self.circuits[name].current()
        if c == "open":
            return "ejected"
        if c == "half_open":
            return "half_open"
        return "serving" if self._views.current.table.engine_weight(name) > 0 else "standby"

    def summaries(self, window_s: float) -> dict[str, EngineSummary]:
        return {name: win.summary(window_s) for name, win in self.windows.items()}

    # -- circuits -------------------------------------------------------------
    def admit(self, engine: Engine, by_model: dict[str, list[Engine]]) -> bool:
        """May one more request go to ``engine`` now (its circuit, or every engine of its models is out)?"""
        name = engine.name
        admitted, changed = self.circuits[name].admit()
        if changed is not None:
            self.circuit_changed(name, changed)
        return admitted or self._panic(engine, by_model)

    def _panic(self, engine: Engine, by_model: dict[str, list[Engine]]) -> bool:
        """Every engine of the model is ejected or down: trying an ejected one beats refusing outright."""
        for model in engine.config.serves:
            for other in by_model.get(model, ()):
                if self.up(other.name):
                    return False
        return True

    def give_back_trial(self, name: str) -> None:
        """A claim ended without an outcome: a half-open trial it took is free again."""
        self.circuits[name].release()

    def success(self, name: str, *signals: float | int | None, tenant: str | None = None) -> None:
        if name not in self.windows:
            return
        self.windows[name].success(*signals, tenant=tenant)  # type: ignore[arg-type]
        changed = self.circuits[name].success()
        if changed is not None:
            self.circuit_changed(name, changed)

    def failure(self, name: str) -> None:
        if name not in self.windows:
            return
        self.windows[name].failure()
        changed = self.circuits[name].failure()
        if changed is not None:
            self.circuit_changed(name, changed)

    def readmit(self, name: str) -> bool:
        changed = self.circuits[name].reset()
        if changed is not None:
            self.circuit_changed(name, changed, source="manual")
            return True
        return False

    def circuit_changed(self, name: str, state: str, source: str = "auto") -> None:
        circuit = self.circuits[name]
        action = _CIRCUIT_ACTIONS[state]
        reason = "manual" if source == "manual" else _CIRCUIT_REASONS[action]
        detail: dict[str, float] = {
            "ejections": circuit.ejections,
            "consecutive_failures": circuit.consecutive,
        }
        if state == "open":
            detail["ejected_for_s"] = round(circuit.open_until - time.monotonic(), 3)
        self.refresh_state(name)
        if state == "open":
            self._availability(name, False)
        elif state == "closed":
            self._availability(name, True)
        t = Transition(at=time.time(), action=action, reason=reason, source=source, engine=name,
                       models=self.infos[name].serves, detail=detail)  # fmt: skip
        self._transitions.publish(t)

    def refresh_state(self, name: str) -> None:
        now_state = self.state(name)
        gauge = self._metrics.engine_state
        for s in ENGINE_STATES:
            gauge.labels(name, s).set(1 if s == now_state else 0)

    # -- probing --------------------------------------------------------------
    def set_health(self, engine: Engine, healthy: bool) -> None:
        name = engine.name
        changed = self.healthy.get(name) != healthy
        first = name not in self._probed
        self._probed.add(name)
        self.healthy[name] = healthy
        self._metrics.engine_healthy.labels(name, engine.config.variant).set(1 if healthy else 0)
        self.refresh_state(name)
        if not changed:
            return
        log.info("engine_health_changed", engine=name, healthy=healthy)
        if not healthy:
            self._availability(name, False)
        if not first and self._transitions.subscribed:
            # The first probe result is where an engine starts, not a change of state.
            self._transitions.publish(
                Transition(
                    at=time.time(),
                    action="up" if healthy else "down",
                    reason="health-probe",
                    source="auto",
                    engine=name,
                    models=self.infos[name].serves,
                )
            )

    async def start(self) -> None:
        for engine in self.engines.values():
            task = asyncio.create_task(self._start_one(engine), name=f"engine-start-{engine.name}")
            self._tasks.append(task)

    async def _start_one(self, engine: Engine) -> None:
        try:
            await engine.start()
        except Exception as exc:  # an engine that cannot start must not take the others down
            log.error("engine_start_failed", engine=engine.name, error=str(exc))
            self.set_health(engine, False)
        else:
            self.set_health(engine, await self.probe(engine))
        await self._probe_forever(engine)

    async def _probe_forever(self, engine: Engine) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                healthy = await self.probe(engine)
            except Exception as exc:
                log.warning("engine_probe_failed", engine=engine.name, error=str(exc))
                healthy = False
            self.set_health(engine, healthy)

    async def probe_now(self) -> None:
        for engine in self.engines.values():
            self.set_health(engine, await self.probe(engine))

    async def probe(self, engine: Engine) -> bool:
        """The engine's health, and (where configured) that it serves the expected model id and revision."""
        healthy = await engine.health()
        cfg = engine.config
        if cfg.expected_model is None and cfg.expected_revision is None:
            return healthy
        problem: str | None = None
        if healthy:
            if not isinstance(engine, ListsModels):
                problem = "it cannot list its models"
            else:
                try:
                    served = await engine.served_models()
                    problem = identity_problem(cfg.expected_model, cfg.expected_revision, served)
                except Exception as exc:
                    problem = f"its model list could not be read ({type(exc).__name__})"
        elif engine.name in self.mismatched:
            return False  # down as well: the mismatch stands until a probe shows the right model
        if problem != self.mismatched.get(engine.name):
            if problem is None:
                del self.mismatched[engine.name]
                log.info(
                    "engine_model_verified",
                    engine=engine.name,
                    model=cfg.expected_model,
                    revision=cfg.expected_revision,
                )
            else:
                self.mismatched[engine.name] = problem
                log.error(
                    "engine_model_mismatch",
                    engine=engine.name,
                    reason=problem,
                    expected_model=cfg.expected_model,
                    expected_revision=cfg.expected_revision,
                )
        if healthy:  # a probe that did not reach the engine leaves the last verdict standing
            self._metrics.engine_model_verified.labels(engine.name, cfg.variant).set(0 if problem else 1)
        return healthy and problem is None

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
