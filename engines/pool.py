"""The engines behind each public model, their health, and the order to try them in.

Health comes from a background probe loop (a watchdog off the request path), and
from passive outcomes reported by the pipeline, which feed each engine's circuit
breaker (:mod:`engines.circuit`) and its outcome window (:mod:`engines.signals`).
The order for one request is drawn from the routing table (:mod:`engines.routing`)
that the rollback controller publishes; the request path only reads it.

Per-engine concurrency has one mechanism, here: a request claims a slot on an engine
(:meth:`EnginePool.acquire`, :meth:`EnginePool.claim`) and gives it back
(:meth:`EnginePool.release`). An engine's cap is the lowest of its configured
``max_in_flight`` (the seeds' ``max_num_seqs``, 8), its ``max_in_flight_overloaded`` (4)
while the gateway is overloaded (see :mod:`gateway.admission`), and the routing table's
``limits`` entry that the rollback controller's ``limit_concurrency`` action sets (its
``raise_concurrency`` replaces the configured cap by a higher one, ``raised``). When
every available engine for a request is at its cap, the request waits in a bounded FIFO
queue per engine (``max_waiting``, at most ``max_wait_s``) and a freed slot is handed
straight to the oldest waiter, so newcomers cannot overtake; a full queue or a wait that
runs out is :class:`core.errors.EngineBusy` (503 with ``Retry-After``). All of it runs
on the event loop thread and needs no locks.

Its length: weighted choice, slots, circuits, health probing and metrics are still one class; splitting it
by job is part of the planned restructuring (issue: one kernel, one request loop).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import structlog

from engines.base import Engine
from engines.circuit import Circuit
from core.control_settings import RoutingSettings
from engines.identity import identity_problem
from engines.rollback import Transition
from engines.routing import EngineInfo, RoutingTable, base_weights
from engines.signals import EngineSummary, OutcomeWindow
from core.errors import EngineBusy
from core.settings import EngineConfig
from observability.metrics import ENGINE_STATES, Metrics

log = structlog.get_logger(__name__)

_ROLE_ORDER = {"primary": 0, "canary": 1, "fallback": 2}
_CIRCUIT_ACTIONS = {"open": "eject", "half_open": "half_open", "closed": "readmit"}
_CIRCUIT_REASONS = {"eject": "outlier-ejection", "half_open": "ejection-elapsed", "readmit": "half-open-success"}
_BUSY_RETRY_AFTER_S = 1.0


class _Requeue(Exception):
    """A waiter woken without a slot: every engine it waited for became unavailable; look again."""


@dataclass(eq=False, slots=True)
class _Waiter:
    """One request waiting for a slot on any of ``engines``; the future resolves to the engine granted."""

    engines: tuple[str, ...]
    future: "asyncio.Future[Engine]"


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
        self._probe_interval_s = self.routing.probe_interval_s if probe_interval_s is None else probe_interval_s
        self._healthy: dict[str, bool] = {name: False for name in self.engines}
        #: engines serving another model id or revision than configured: never routed to, with the reason
        self._mismatched: dict[str, str] = {
            e.name: "its model has not been verified yet" for e in self.engines.values()
            if e.config.expected_model is not None or e.config.expected_revision is not None
        }
        for name in self._mismatched:
            metrics.engine_model_verified.labels(name, self.engines[name].config.variant).set(0)
        self._by_model: dict[str, list[Engine]] = {}
        for engine in sorted(self.engines.values(), key=lambda e: _ROLE_ORDER[e.config.role]):
            for public in engine.config.serves:
                self._by_model.setdefault(public, []).append(engine)
        self.infos: dict[str, EngineInfo] = {
            e.name: EngineInfo(e.name, e.config.variant, e.config.role, tuple(e.config.serves), e.config.weight)
            for e in self.engines.values()
        }
        self._circuits = {name: Circuit(self.routing.circuit) for name in self.engines}
        signals = self.routing.signals
        self._windows = {
            name: OutcomeWindow(signals.max_samples, window_s=signals.window_s) for name in self.engines
        }
        self._in_flight: dict[str, int] = {name: 0 for name in self.engines}
        self._waiters: dict[str, deque[_Waiter]] = {name: deque() for name in self.engines}
        #: configured caps per engine: (normal, while overloaded); None: no cap
        self._caps: dict[str, tuple[int | None, int | None]] = {
            e.name: (e.config.max_in_flight, e.config.overload_limit()) for e in self.engines.values()
        }
        #: set by the admission gate's overload loop: engines run at their max_in_flight_overloaded
        self.overloaded = False
        self._rng = random.Random(self.routing.seed)
        self.table = RoutingTable(weights=base_weights(self.infos.values()))
        #: called with every circuit transition (eject, half_open, readmit); set by the controller
        self.transition_sink: Callable[[Transition], None] | None = None
        self._probed: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        for name in self.engines:
            self._refresh_state(name)
            self._publish(name)

    # -- read side (request path) ------------------------------------------
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def candidates(self, model: str) -> list[Engine]:
        """Engines for ``model`` in the order to try them.

        First, one engine drawn by the routing table's weights among those that are
        healthy, not ejected and under their concurrency limit; then the rest of those
        by weight; then the available engines without traffic share (fallbacks, engines
        rolled back from); last, as a last resort, engines that are down or ejected. An engine
        the controller put to sleep (the table's ``asleep``) is not a candidate at all.
        """
        engines = self._by_model.get(model, ())
        weights = self.table.weights.get(model, {})
        weighted: list[tuple[float, Engine]] = []
        standby: list[Engine] = []
        down: list[Engine] = []
        asleep = self.table.asleep
        for e in engines:
            if e.name in asleep or e.name in self._mismatched:
                continue  # asleep (weights off the GPU) or serving other weights: not even a last resort
            up = self._healthy.get(e.name, False) and self._circuits[e.name].available()
            if not up or self._full(e.name):
                down.append(e)
                continue
            w = weights.get(e.name, 0.0)
            if w > 0.0:
                weighted.append((w, e))
            else:
                standby.append(e)
        out: list[Engine] = []
        if weighted:
            if len(weighted) > 1:
                x = self._rng.random() * sum(w for w, _ in weighted)
                for i, (w, e) in enumerate(weighted):
                    x -= w
                    if x < 0 or i == len(weighted) - 1:
                        out.append(e)
                        del weighted[i]
                        break
                weighted.sort(key=lambda we: -we[0])
            out.extend(e for _, e in weighted)
        out.extend(standby)
        out.extend(down)
        return out

    def is_healthy(self, name: str) -> bool:
        return self._healthy.get(name, False)

    @property
    def ready(self) -> bool:
        return any(self._healthy.values())

    def health_report(self) -> dict[str, bool]:
        return dict(self._healthy)

    def mismatches(self) -> dict[str, str]:
        """Engines that do not serve the model id or revision they were configured with, and why."""
        return dict(self._mismatched)

    def circuit_state(self, name: str) -> str:
        return self._circuits[name].current()

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def limit(self, name: str) -> int | None:
        """The engine's concurrency cap now: the lowest of its configured cap (normal or overloaded) and the
        routing table's; None: no cap."""
        normal, overloaded = self._caps[name]
        raised = self.table.raised.get(name)
        if raised is not None and normal is not None:
            normal = max(normal, raised)  # the controller's raise_concurrency; overload still wins
        own = overloaded if self.overloaded else normal
        routed = self.table.limits.get(name)
        if own is None or routed is None:
            return routed if own is None else own
        return min(own, routed)

    def configured_cap(self, name: str) -> int | None:
        """The engine's own cap (``max_in_flight``), before overload, routing limits or raises."""
        return self._caps[name][0]

    def waiting(self, name: str) -> int:
        return sum(1 for w in self._waiters[name] if not w.future.done())

    def concurrency(self) -> dict[str, dict[str, int | None]]:
        """Per engine: requests holding a slot, its cap and requests waiting (admin views, tests)."""
        return {
            name: {"in_flight": n, "limit": self.limit(name), "waiting": self.waiting(name)}
            for name, n in self._in_flight.items()
        }

    def summaries(self, window_s: float | None = None) -> dict[str, EngineSummary]:
        """This replica's measurements per engine over the window (off the request path)."""
        w = window_s if window_s is not None else self.routing.signals.window_s
        return {name: win.summary(w) for name, win in self._windows.items()}

    def engine_state(self, name: str) -> str:
        """One word for the engine: serving, standby, ejected, half_open or down."""
        if not self._healthy.get(name, False):
            return "down"
        c = self._circuits[name].current()
        if c == "open":
            return "ejected"
        if c == "half_open":
            return "half_open"
        return "serving" if self.table.engine_weight(name) > 0 else "standby"

    # -- request path: claims and outcomes ---------------------------------
    def _full(self, name: str) -> bool:
        """At its cap, or others are already queued for it (a newcomer never overtakes the queue)."""
        limit = self.limit(name)
        return (limit is not None and self._in_flight[name] >= limit) or self._queued(name)

    def _queued(self, name: str) -> bool:
        q = self._waiters[name]
        while q and q[0].future.done():
            q.popleft()
        return bool(q)

    def _up(self, name: str) -> bool:
        return self._healthy.get(name, False) and self._circuits[name].available()

    def acquire(self, engine: Engine) -> bool:
        """Claim one request's slot on ``engine`` now; False when it is at its cap or ejected."""
        name = engine.name
        if self._full(name) or not self._admit_circuit(engine):
            return False
        self._in_flight[name] += 1
        self._publish(name)
        self._metrics.engine_queue_wait.labels(name).observe(0.0)
        return True

    def _admit_circuit(self, engine: Engine) -> bool:
        name = engine.name
        admitted, changed = self._circuits[name].admit()
        if changed is not None:
            self._circuit_changed(name, changed)
        return admitted or self._panic(engine)

    async def claim(self, engines: list[Engine], model: str | None = None) -> Engine | None:
        """A slot on the first of ``engines`` (in order) that has one; the engine, already claimed.

        Only available engines (healthy, circuit not open) take load that spills over from a full
        one. When every available engine is at its cap, wait boundedly for the first slot any of
        them frees. With no available engine at all, the others are tried as a last resort; None
        when none of them can be claimed either.
        """
        deadline: float | None = None
        while True:
            up = [e for e in engines if self._up(e.name)]
            for e in up:
                if self.acquire(e):
                    return e
            full = [e for e in up if self._full(e.name)]
            if not full:
                for e in engines:
                    if e not in up and self.acquire(e):
                        return e
                return None
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + max(e.config.max_wait_s for e in full)
            try:
                return await self._wait(full, model, deadline)
            except _Requeue:
                continue

    async def _wait(self, full: list[Engine], model: str | None, deadline: float) -> Engine:
        queues = [e for e in full if e.config.max_wait_s > 0 and self.waiting(e.name) < e.config.max_waiting]
        if not queues:
            self._metrics.admission_shed.labels("engine_busy").inc()
            raise EngineBusy(
                f"every engine for {model!r} is at its concurrency limit", retry_after=_BUSY_RETRY_AFTER_S
            )
        waiter = _Waiter(tuple(e.name for e in queues), asyncio.get_running_loop().create_future())
        for e in queues:
            self._waiters[e.name].append(waiter)
            self._publish(e.name)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                granted = await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # A slot was handed over just as the wait ended: pass it on.
                self.release(waiter.future.result(), settled=False)
            else:
                waiter.future.cancel()
            if isinstance(exc, TimeoutError):
                self._metrics.admission_shed.labels("engine_busy").inc()
                raise EngineBusy(
                    f"no engine for {model!r} had a free slot within the wait limit",
                    retry_after=_BUSY_RETRY_AFTER_S,
                ) from None
            raise
        finally:
            for e in queues:
                try:
                    self._waiters[e.name].remove(waiter)
                except ValueError:
                    pass
                self._publish(e.name)
        self._metrics.engine_queue_wait.labels(granted.name).observe(time.perf_counter() - t0)
        return granted

    def _panic(self, engine: Engine) -> bool:
        """Every engine of the model is ejected or down: trying an ejected one beats refusing outright."""
        for model in engine.config.serves:
            for other in self._by_model.get(model, ()):
                if self._healthy.get(other.name, False) and self._circuits[other.name].available():
                    return False
        return True

    def release(self, engine: Engine | str, *, settled: bool = True) -> None:
        """End a claim. ``settled=False``: no outcome was reported (the half-open trial is given back).

        While the engine is within its cap, the slot goes straight to the oldest request waiting for it.
        """
        name = engine if isinstance(engine, str) else engine.name
        if name not in self._in_flight:
            return
        if not settled:
            self._circuits[name].release()
        limit = self.limit(name)
        if not (limit is not None and self._in_flight[name] > limit) and self._hand_over(name):
            self._publish(name)
            return
        self._in_flight[name] = max(0, self._in_flight[name] - 1)
        self._publish(name)

    def _hand_over(self, name: str) -> bool:
        """Give one held slot of ``name`` to its oldest live waiter; False when nobody can take it."""
        q = self._waiters[name]
        engine = self.engines[name]
        while q:
            w = q[0]
            if w.future.done():
                q.popleft()
                continue
            if not self._admit_circuit(engine):
                return False
            q.popleft()
            w.future.set_result(engine)
            return True
        return False

    def _grow(self, name: str) -> None:
        """The cap went up: let waiters in while there is room."""
        limit = self.limit(name)
        while self._queued(name) and (limit is None or self._in_flight[name] < limit):
            self._in_flight[name] += 1
            if not self._hand_over(name):
                self._in_flight[name] -= 1
                break
        self._publish(name)

    def _strand_check(self, name: str) -> None:
        """``name`` became unavailable: waiters with no available engine left look again (last resort)."""
        for w in list(self._waiters[name]):
            if not w.future.done() and not any(self._up(n) for n in w.engines):
                w.future.set_exception(_Requeue())

    def set_overloaded(self, overloaded: bool) -> None:
        """Switch every engine to its overload cap, or back (called by the admission gate's loop)."""
        if overloaded == self.overloaded:
            return
        self.overloaded = overloaded
        for name in self.engines:
            log.info("engine_limit_changed", engine=name, limit=self.limit(name), overloaded=overloaded,
                     in_flight=self._in_flight[name])
            self._grow(name)

    def _publish(self, name: str) -> None:
        m = self._metrics
        limit = self.limit(name)
        m.engine_in_flight.labels(name).set(self._in_flight[name])
        m.engine_waiting.labels(name).set(self.waiting(name))
        m.engine_limit.labels(name).set(-1 if limit is None else limit)

    def report_success(self, engine: Engine | str, ttft_s: float | None, first_audio_s: float | None,
                       e2e_s: float, upstream_ttft_s: float | None = None,
                       upstream_e2e_s: float | None = None, tokens: int = 0,
                       audio_s: float = 0.0) -> None:  # fmt: skip
        name = engine if isinstance(engine, str) else engine.name
        if name not in self._windows:
            return
        self._windows[name].success(ttft_s, first_audio_s, e2e_s, upstream_ttft_s, upstream_e2e_s, tokens, audio_s)
        changed = self._circuits[name].success()
        if changed is not None:
            self._circuit_changed(name, changed)

    def report_failure(self, engine: Engine | str) -> None:
        """A request failed at the engine (refused, reset, timed out, 5xx, broken stream)."""
        name = engine if isinstance(engine, str) else engine.name
        if name not in self._windows:
            return
        self._windows[name].failure()
        changed = self._circuits[name].failure()
        if changed is not None:
            self._circuit_changed(name, changed)

    # -- write side ---------------------------------------------------------
    def set_table(self, table: RoutingTable) -> None:
        """Swap in a new routing table (one reference assignment: requests see the old or the new)."""
        self.table = table
        for name in self.engines:
            self._refresh_state(name)
            self._metrics.engine_weight.labels(name).set(table.engine_weight(name))
            self._grow(name)

    def readmit(self, name: str) -> bool:
        """Close an engine's circuit by hand; True when it was open or half-open."""
        changed = self._circuits[name].reset()
        if changed is not None:
            self._circuit_changed(name, changed, source="manual")
            return True
        return False

    def _circuit_changed(self, name: str, state: str, source: str = "auto") -> None:
        circuit = self._circuits[name]
        action = _CIRCUIT_ACTIONS[state]
        reason = "manual" if source == "manual" else _CIRCUIT_REASONS[action]
        detail = {"ejections": circuit.ejections, "consecutive_failures": circuit.consecutive}
        if state == "open":
            detail["ejected_for_s"] = round(circuit.open_until - time.monotonic(), 3)
        self._refresh_state(name)
        if state == "open":
            self._strand_check(name)
        elif state == "closed":
            self._grow(name)
        t = Transition(at=time.time(), action=action, reason=reason, source=source, engine=name,
                       models=self.infos[name].serves, detail=detail)  # fmt: skip
        if self.transition_sink is not None:
            self.transition_sink(t)
        else:
            log.warning("engine_transition", **t.to_dict())

    def _refresh_state(self, name: str) -> None:
        now_state = self.engine_state(name)
        gauge = self._metrics.engine_state
        for s in ENGINE_STATES:
            gauge.labels(name, s).set(1 if s == now_state else 0)

    def _set_health(self, engine: Engine, healthy: bool) -> None:
        name = engine.name
        changed = self._healthy.get(name) != healthy
        first = name not in self._probed
        self._probed.add(name)
        self._healthy[name] = healthy
        self._metrics.engine_healthy.labels(name, engine.config.variant).set(1 if healthy else 0)
        self._refresh_state(name)
        if not changed:
            return
        log.info("engine_health_changed", engine=name, healthy=healthy)
        if not healthy:
            self._strand_check(name)
        if not first and self.transition_sink is not None:
            # The first probe result is where an engine starts, not a change of state.
            self.transition_sink(
                Transition(at=time.time(), action="up" if healthy else "down", reason="health-probe", source="auto",
                           engine=name, models=self.infos[name].serves)
            )

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
            self._set_health(engine, await self._probe(engine))
        await self._probe_forever(engine)

    async def _probe_forever(self, engine: Engine) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                healthy = await self._probe(engine)
            except Exception as exc:
                log.warning("engine_probe_failed", engine=engine.name, error=str(exc))
                healthy = False
            self._set_health(engine, healthy)

    async def probe_now(self) -> None:
        for engine in self.engines.values():
            self._set_health(engine, await self._probe(engine))

    async def _probe(self, engine: Engine) -> bool:
        """The engine's health, and (where configured) that it serves the expected model id and revision."""
        healthy = await engine.health()
        cfg = engine.config
        if cfg.expected_model is None and cfg.expected_revision is None:
            return healthy
        problem: str | None = None
        if healthy:
            try:
                problem = identity_problem(cfg.expected_model, cfg.expected_revision,
                                           await engine.served_models())  # type: ignore[attr-defined]
            except Exception as exc:
                problem = f"its model list could not be read ({type(exc).__name__})"
        elif engine.name in self._mismatched:
            return False  # down as well: the mismatch stands until a probe shows the right model
        if problem != self._mismatched.get(engine.name):
            if problem is None:
                del self._mismatched[engine.name]
                log.info("engine_model_verified", engine=engine.name, model=cfg.expected_model,
                         revision=cfg.expected_revision)
            else:
                self._mismatched[engine.name] = problem
                log.error("engine_model_mismatch", engine=engine.name, reason=problem,
                          expected_model=cfg.expected_model, expected_revision=cfg.expected_revision)
        if healthy:  # a probe that did not reach the engine leaves the last verdict standing
            self._metrics.engine_model_verified.labels(engine.name, cfg.variant).set(0 if problem else 1)
        return healthy and problem is None

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for engine in self.engines.values():
            try:
                await engine.aclose()
            except Exception as exc:
                log.warning("engine_close_failed", engine=engine.name, error=str(exc))
