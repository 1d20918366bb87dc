"""The rollback controller's loop: measure, decide, publish the routing table; off the request path.

Every replica runs one, each tick (``routing.controller.interval_s``):

1. it publishes a summary of its own measurements (latency histograms, outcomes, WER);
2. it tries to take or renew the leader lease (the leader also renews it on a beat of its own, a third
   of ``routing.state.lease_ttl_s``, so a lease no longer than the tick never lapses between two ticks
   and hands the lead to whichever replica ticks in the gap);
3. the leader merges every replica's summary with the scraped telemetry into a
   :class:`~engines.rollout.snapshot.Snapshot`, calls :func:`~engines.rollout.rollback.decide`, and
   writes the new state and routing table in one fenced update;
4. the others read the table when its version changes and apply it.

The leader also carries out the decision's sleep and wake intents through
:class:`~engines.rollout.offload.OffloadClient` (after the new table is written, so a sleeping
engine has no traffic before it is put to sleep), and reads back the sleep gauge of the
engines it put to sleep into the next snapshot (``sleep_state``).

Manual overrides (pin, unpin, freeze, resume, clear, readmit) go through the same
store from whichever replica the admin call reached. Every transition, automatic or
manual, is counted (``omnigate_routing_transitions_total``), logged as one
``routing_transition`` event, kept in :attr:`RolloutController.recent`, and passed to
each callback in :attr:`RolloutController.on_transition` (the audit trail hooks in
there: ``controller.on_transition.append(fn)``, ``fn(transition)`` sync or async).

The leader also integrates each engine's GPU power over its active time into
``tokens_per_joule`` (:mod:`engines.rollout.energy`) and publishes the engines' joules per token
beside its own summary; every replica copies them into its :class:`~engines.rollout.energy.EnergyBook`,
which the request path reads for ``usage.energy_joules``. The held-out accuracy sentinel
(:mod:`engines.rollout.accuracy`), when configured, runs on the leader and adds ``accuracy``.

Its length: the leader's tick gathers what the energy meter, the sentinels and the offload client
measured into one snapshot; the gathering is to move to the collectors themselves with the restructuring.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog

from engines.rollout.accuracy import HeldOutSentinel
from engines.rollout.energy import EnergyBook, EnergyMeter, token_equivalents
from engines.rollout.offload import OffloadClient
from engines.rollout.rollback import (
    ControllerState,
    Decision,
    Transition,
    clear_incident,
    decide,
    freeze,
    pin,
    resume,
    route,
    unpin,
)
from engines.rollout.routing import RoutingTable
from engines.rollout.sentinel import AccuracySentinel
from engines.rollout.settings import RoutingSettings
from engines.rollout.signals import EngineSummary
from engines.rollout.snapshot import EngineSignals, Snapshot
from engines.rollout.state_store import Doc, NotLeader, StateStore
from engines.rollout.telemetry import TelemetryCollector
from engines.selection.pool import EnginePool
from observability.metrics import Metrics

#: how long shutdown waits for transition hooks still running before it cancels them
_HOOKS_CLOSE_S = 5.0

log = structlog.get_logger("omnigate.routing")

TransitionHook = Callable[[Transition], "Awaitable[None] | None"]


class RolloutController:
    def __init__(
        self,
        pool: EnginePool,
        settings: RoutingSettings,
        metrics: Metrics,
        store: StateStore,
        telemetry: TelemetryCollector | None = None,
        sentinel: AccuracySentinel | None = None,
        clock: Callable[[], float] = time.time,
        *,
        energy: EnergyBook | None = None,
        accuracy: HeldOutSentinel | None = None,
        offload: OffloadClient | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.telemetry = telemetry
        self.sentinel = sentinel
        self.offload = offload
        self._clock = clock
        #: callbacks given every transition this replica makes (the audit trail registers here)
        self.on_transition: list[TransitionHook] = []
        self.recent: deque[Transition] = deque(maxlen=200)
        self.is_leader = False
        self.last_snapshot: Snapshot | None = None
        self.state = ControllerState()
        self._hook_tasks: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._tick_lock = asyncio.Lock()
        e = settings.energy
        self.energy = energy if energy is not None else EnergyBook(e.audio_tokens_per_s)
        self.energy_meter = EnergyMeter(
            window_s=settings.signals.window_s,
            min_joules=e.min_joules,
            # ticks further apart than this are a gap in the readings, not one long interval
            max_gap_s=max(30.0, 3 * settings.controller.interval_s),
        )
        self._energy_seen: dict[str, int] = {}
        self.accuracy = accuracy
        if accuracy is not None:
            self.on_transition.append(accuracy.on_transition)
        # The pool's circuit and health transitions come out through its feed; nothing is set on the pool.
        pool.transitions.subscribe(self.emit)

    @property
    def replica_id(self) -> str:
        return self.store.replica_id

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._load_or_seed()
        except Exception as exc:
            # Serving with the configured split beats not serving; the loop keeps trying the store.
            self.metrics.controller_errors.labels("store").inc()
            log.error("controller_store_unavailable", error=str(exc) or type(exc).__name__)
        try:
            if self.telemetry is not None:
                await self.telemetry.start()
            if self.sentinel is not None and self.settings.sentinel.enabled:
                await self.sentinel.start()
            if self.accuracy is not None:
                await self.accuracy.start()
        except BaseException:
            # A part that cannot start fails the boot; the parts started before it are closed first
            # (each part's aclose is safe on a part that never started).
            await self.aclose()
            raise
        self._task = asyncio.create_task(self._run(), name="rollout-controller")
        self._lease_task = asyncio.create_task(self._keep_lease(), name="rollout-controller-lease")

    async def _load_or_seed(self) -> None:
        await self.store.start()
        doc = await self.store.load()
        if not doc.table:
            # The first replica seeds the document with the configured split.
            seed = (ControllerState().to_dict(), self._table(ControllerState()).to_dict())
            await self.store.update(lambda d: None if d.table else seed)
            doc = await self.store.load()
        self._apply(doc)

    async def aclose(self) -> None:
        for task in (self._task, self._lease_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for closer in (self.telemetry, self.sentinel, self.accuracy, self.offload):
            if closer is not None:
                await closer.aclose()
        try:
            await self.store.withdraw()
            if self.is_leader:
                await self.store.release_lease()
        except Exception as exc:  # Redis gone at shutdown: the lease expires by itself
            log.warning("controller_release_failed", error=str(exc))
        self._set_leader(False)
        if self._hook_tasks:
            # Bounded: a transition hook stuck on a peer that no longer answers must not hold up shutdown.
            _, stuck = await asyncio.wait(set(self._hook_tasks), timeout=_HOOKS_CLOSE_S)
            for task in stuck:
                log.warning("transition_hook_abandoned", timeout_s=_HOOKS_CLOSE_S)
                task.cancel()
            if stuck:
                await asyncio.gather(*stuck, return_exceptions=True)
        await self.store.aclose()

    async def _run(self) -> None:
        interval = self.settings.controller.interval_s
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.controller_errors.labels("tick").inc()
                log.warning("controller_tick_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(interval)

    async def _keep_lease(self) -> None:
        """While this replica leads, renew its lease every third of the TTL, whatever the ticks take.

        Renewed only by the tick, a lease no longer than the tick's interval lapsed before every renewal,
        and the lead went to whichever replica ticked in the gap: two meters integrated the same engine's
        power in turn, and a leader taking the lead back joined an interval the other had counted."""
        ttl = self.settings.state.lease_ttl_s
        while True:
            await asyncio.sleep(ttl / 3)
            if not self.is_leader:
                continue
            try:
                held = await asyncio.wait_for(self.store.acquire_lease(ttl), timeout=ttl / 3)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.controller_errors.labels("store").inc()
                log.warning("controller_lease_renewal_failed", error=str(exc) or type(exc).__name__)
                continue  # the lease runs on until its TTL; the next beat or tick tries again
            if not held:
                self._set_leader(False)

    # -- one tick ---------------------------------------------------------------------------
    async def tick(self) -> Decision | None:
        async with self._tick_lock:
            await self.store.publish_summary(self._local_summary(), ttl_s=self._summary_ttl())
            leader = self.settings.controller.enabled and await self.store.acquire_lease(
                self.settings.state.lease_ttl_s
            )
            self._set_leader(leader)
            if not leader:
                await self._follow()
                return None
            try:
                return await self._lead()
            except NotLeader:
                self._set_leader(False)
                return None

    def _summary_ttl(self) -> float:
        return max(3 * self.settings.controller.interval_s, 1.0)

    def _local_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, summary in self.pool.summaries().items():
            if self.sentinel is not None:
                summary.wer_errors, summary.wer_words, summary.wer_samples = self.sentinel.totals(name)
            d = summary.to_dict()
            d["in_flight"] = self.pool.in_flight(name)
            jpt = self.energy.joules_per_token(name)
            if self.is_leader and jpt is not None:
                d["joules_per_token"] = jpt
            out[name] = d
        return out

    async def _lead(self) -> Decision:
        parts = await self.store.summaries(max_age_s=self._summary_ttl())
        if self.offload is not None and self.state.sleeping:
            await self.offload.refresh(sorted(self.state.sleeping))
        snapshot = self.snapshot(parts)
        self.last_snapshot = snapshot
        holder: dict[str, Decision] = {}

        def update(doc: Doc) -> tuple[dict[str, Any], dict[str, Any]] | None:
            state = ControllerState.from_dict(doc.state)
            decision = decide(snapshot, state, self.settings.controller)
            holder["d"] = decision
            new_state = decision.state.to_dict()
            table = self._table(decision.state)
            if new_state == doc.state and doc.table and table.same_routing(RoutingTable.from_dict(doc.table)):
                return None
            return new_state, table.to_dict()

        doc, _ = await self.store.update(update, fenced=True)
        decision = holder["d"]
        self._apply(doc)
        for hold in decision.holds:
            rule = hold.key.split("@", 1)[0]
            self.metrics.routing_holds.labels(rule, hold.reason).inc()
            log.info("routing_action_held", incident=hold.key, reason=hold.reason)
        for t in decision.transitions:
            self.emit(t)
        for intent in decision.intents:
            if self.offload is None:
                self.metrics.engine_sleep_requests.labels(intent.engine, intent.action, "unknown").inc()
                log.warning("engine_sleep_unconfigured", engine=intent.engine, action=intent.action)
                continue
            await self.offload.send(intent)
        return decision

    async def _follow(self) -> None:
        if await self.store.version() != self.pool.table.version:
            self._apply(await self.store.load())
        if self.settings.energy.usage_field and self.telemetry is not None and self.telemetry.measures_power:
            parts = await self.store.summaries(max_age_s=self._summary_ttl())
            self.energy.update(
                {
                    n: d["joules_per_token"]
                    for p in parts.values()
                    for n, d in p.items()
                    if "joules_per_token" in d
                }
            )

    def snapshot(self, parts: dict[str, dict[str, Any]]) -> Snapshot:
        """Every replica's measurements merged, plus telemetry, health and circuit state, at one instant."""
        merged: dict[str, EngineSummary] = {name: EngineSummary() for name in self.pool.infos}
        in_flight: dict[str, float] = {name: 0.0 for name in self.pool.infos}
        for part in parts.values():
            for name, d in part.items():
                if name in merged:
                    merged[name] = merged[name].merge(EngineSummary.from_dict(d))
                    in_flight[name] += float(d.get("in_flight", 0))
        engines: dict[str, EngineSignals] = {}
        now = self._clock()
        jpt: dict[str, float | None] = {}
        for name, info in self.pool.infos.items():
            values, samples = merged[name].values()
            values["in_flight"] = in_flight[name]
            cap = self.pool.configured_cap(name)
            if cap is not None:
                values["concurrency_cap"] = float(cap)
            seqs = self.pool.engines[name].config.max_num_seqs
            if seqs is not None:
                values["max_num_seqs"] = float(seqs)
            if self.telemetry is not None:
                values.update(self.telemetry.latest(name))
            tpj = self._energy(name, info.variant, now, values, merged[name], in_flight[name])
            if tpj is not None:
                values["tokens_per_joule"] = tpj
            jpt[name] = 1.0 / tpj if tpj else None
            if self.accuracy is not None:
                acc = self.accuracy.latest(name)
                if acc is not None:
                    values["accuracy"], samples["accuracy"] = acc[0], acc[1]
            gpus: tuple[str, ...] = ()
            if self.offload is not None:
                gpus = self.offload.gpus(name)
                if name in self.state.sleeping:
                    state = self.offload.latest(name)
                    if state is not None:
                        values["sleep_state"] = state
                        self.metrics.engine_sleep_state.labels(name).set(state)
            engines[name] = EngineSignals(
                info=info,
                healthy=self.pool.is_healthy(name),
                circuit=self.pool.circuit_state(name),
                values=values,
                samples=samples,
                gpus=gpus,
            )
        if self.settings.energy.usage_field:
            self.energy.update(jpt)
        return Snapshot(now=now, engines=engines, replicas=max(1, len(parts)))

    def _energy(
        self,
        name: str,
        variant: str,
        now: float,
        values: dict[str, Any],
        summary: EngineSummary,
        in_flight: float,
    ) -> float | None:
        """Integrate the engine's power since the last tick (busy: requests in flight or new ones counted)."""
        counted = summary.finished_total
        busy = in_flight > 0 or self._energy_seen.get(name, counted) != counted
        self._energy_seen[name] = counted
        watts = values.get("power_watts")
        added = self.energy_meter.observe(name, now, watts, busy)
        m = self.metrics
        if added:
            m.engine_energy.labels(name, variant).inc(added)
        tokens = token_equivalents(summary.tokens, summary.audio_s, self.settings.energy.audio_tokens_per_s)
        tpj = self.energy_meter.tokens_per_joule(name, tokens) if watts is not None else None
        if tpj is None:
            m.engine_tokens_per_joule.remove(name, variant)  # unknown now: no stale figure left behind
        else:
            m.engine_tokens_per_joule.labels(name, variant).set(tpj)
        return tpj

    # -- applying --------------------------------------------------------------------------------
    def _table(self, state: ControllerState) -> RoutingTable:
        return route(self.pool.infos, state)

    def _apply(self, doc: Doc) -> None:
        self.state = ControllerState.from_dict(doc.state)
        table = RoutingTable.from_dict(doc.table) if doc.table else self._table(self.state)
        table = replace(table, version=doc.version)  # every other field as stored or derived
        if table.version != self.pool.table.version:
            self.pool.publish(self.pool.view.next(table=table))  # the next view: one swap, read by requests
            self.metrics.routing_version.set(table.version)
            log.debug("routing_table_applied", version=table.version, leader=self.is_leader)
        self.metrics.controller_frozen.set(1 if self.state.frozen else 0)

    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            log.info("controller_leadership", replica=self.replica_id, leader=leader)
            if not leader:
                # Another replica integrates the power while this one follows: should the lead come back,
                # its meter starts a new series rather than join an interval the other has counted.
                self.energy_meter.restart()
        self.is_leader = leader
        self.metrics.controller_leader.set(1 if leader else 0)

    def emit(self, t: Transition) -> None:
        """Record one transition: metric, one log event, the recent list, and the hooks (audit)."""
        self.metrics.routing_transitions.labels(t.action, t.reason, t.source).inc()
        log.info("routing_transition", replica=self.replica_id, **t.to_dict())
        self.recent.append(t)
        for hook in list(self.on_transition):
            try:
                out = hook(t)
                if inspect.isawaitable(out):
                    task = asyncio.ensure_future(out)
                    self._hook_tasks.add(task)
                    task.add_done_callback(self._hook_done)
            except Exception as exc:
                self.metrics.controller_errors.labels("hook").inc()
                log.warning("transition_hook_failed", error=str(exc))

    def _hook_done(self, task: asyncio.Task[Any]) -> None:
        self._hook_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.metrics.controller_errors.labels("hook").inc()
            log.warning("transition_hook_failed", error=str(task.exception()))

    # -- manual overrides --------------------------------------------------------------------------
    async def _override(
        self,
        change: Callable[[ControllerState, float], ControllerState | None],
        action: str,
        reason: str,
        actor: str | None,
        note: str | None,
        engine: str | None = None,
        models: tuple[str, ...] = (),
        detail: dict[str, Any] | None = None,
    ) -> Transition | None:
        now = self._clock()
        before: dict[str, RoutingTable] = {}

        def update(doc: Doc) -> tuple[dict[str, Any], dict[str, Any]] | None:
            state = ControllerState.from_dict(doc.state)
            before["t"] = RoutingTable.from_dict(doc.table) if doc.table else self._table(state)
            new = change(state, now)
            if new is None or new == state:
                return None
            return new.to_dict(), self._table(new).to_dict()

        doc, changed = await self.store.update(update)
        self._apply(doc)
        if not changed:
            return None
        info = dict(detail or {})
        if actor:
            info["actor"] = actor
        if note:
            info["note"] = note
        if models:
            info["weights_before"] = {m: dict(before["t"].weights.get(m, {})) for m in models}
            info["weights"] = {m: dict(self.pool.table.weights.get(m, {})) for m in models}
        t = Transition(
            at=now, action=action, reason=reason, source="manual", engine=engine, models=models, detail=info
        )
        self.emit(t)
        return t

    async def pin(
        self, model: str, variant: str, actor: str | None = None, note: str | None = None
    ) -> Transition | None:
        def change(s: ControllerState, now: float) -> ControllerState | None:
            return None if s.pins.get(model) == variant else pin(s, model, variant, now)

        return await self._override(
            change, "pin", "manual", actor, note, models=(model,), detail={"variant": variant}
        )

    async def unpin(self, model: str, actor: str | None = None, note: str | None = None) -> Transition | None:
        def change(s: ControllerState, now: float) -> ControllerState | None:
            return unpin(s, model, now) if model in s.pins else None

        return await self._override(change, "unpin", "manual", actor, note, models=(model,))

    async def freeze(self, actor: str | None = None, note: str | None = None) -> Transition | None:
        return await self._override(lambda s, now: freeze(s), "freeze", "manual", actor, note)

    async def resume(
        self, actor: str | None = None, note: str | None = None, clear: bool = False
    ) -> Transition | None:
        models = tuple(self.pool.models())
        return await self._override(
            lambda s, now: resume(s, now, clear=clear),
            "resume",
            "manual",
            actor,
            note,
            models=models if clear else (),
            detail={"cleared_incidents": clear},
        )

    async def clear(self, key: str, actor: str | None = None, note: str | None = None) -> Transition | None:
        inc = self.state.incidents.get(key)
        engine = inc.engine if inc is not None else None
        models = self.pool.infos[engine].serves if engine in self.pool.infos else ()
        return await self._override(
            lambda s, now: clear_incident(s, key, now),
            "restore",
            "manual",
            actor,
            note,
            engine=engine,
            models=models,
            detail={"incident": key},
        )

    def readmit(self, engine: str) -> bool:
        """Close an engine's circuit on this replica (circuits are per replica)."""
        return self.pool.readmit(engine)

    # -- status ------------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        try:
            leader = await self.store.leader()
        except Exception as exc:
            leader = None
            log.warning("controller_store_unavailable", error=str(exc) or type(exc).__name__)
        table = self.pool.table
        snap = self.last_snapshot
        now = self._clock()
        engines = []
        local = self.pool.summaries()
        for name, info in self.pool.infos.items():
            if snap is not None and self.is_leader:
                sig = snap.engines[name]
                values, samples = dict(sig.values), dict(sig.samples)
            else:
                values, samples = local[name].values()
                if self.telemetry is not None:
                    values.update(self.telemetry.latest(name))
            engines.append(
                {
                    "name": name,
                    "variant": info.variant,
                    "role": info.role,
                    "serves": list(info.serves),
                    "state": self.pool.engine_state(name),
                    "healthy": self.pool.is_healthy(name),
                    "circuit": self.pool.circuit_state(name),
                    "weight": round(table.engine_weight(name), 4),
                    "limit": table.limits.get(name),
                    # the cap in force on this replica: the routing limit, the configured one, overload
                    "cap": self.pool.limit(name),
                    "in_flight": self.pool.in_flight(name),
                    "waiting": self.pool.waiting(name),
                    "signals": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in values.items()},
                    "samples": samples,
                }
            )
        st = self.state
        return {
            "replica": self.replica_id,
            "leader": leader,
            "is_leader": self.is_leader,
            "enabled": self.settings.controller.enabled,
            "frozen": st.frozen,
            "pins": dict(st.pins),
            "version": table.version,
            "weights": {m: {e: round(w, 4) for e, w in ws.items()} for m, ws in table.weights.items()},
            "limits": dict(table.limits),
            "raised": dict(table.raised),
            "sleeping": {k: z.to_dict() for k, z in st.sleeping.items()},
            "incidents": {k: i.to_dict() for k, i in st.incidents.items()},
            "breaches": {k: round(now - since, 3) for k, since in st.breaches.items()},
            "holds": dict(st.holds),
            "switches_last_hour": sum(1 for t in st.switches if now - t < 3600),
            "max_switches_per_hour": self.settings.controller.max_switches_per_hour,
            "engines": engines,
            "recent_transitions": [t.to_dict() for t in list(self.recent)[-20:]],
        }
