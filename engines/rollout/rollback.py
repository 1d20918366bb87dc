"""The rollback controller's pure core: ``decide(snapshot, state, config)`` and the routing it implies.

Nothing here does I/O or reads a clock: a :class:`Snapshot` carries the time and
the signals, :class:`ControllerState` carries everything remembered between ticks
(breach timers, active incidents, the switch history, freeze and pins), and
:func:`decide` returns the next state with the transitions it made. That is what
the unit tests drive with scripted signal series, and what the background loop in
:mod:`engines.controller` calls once per tick.

Anti-flapping, in the order it is applied:

* a condition must hold for the rule's ``for_s`` (an unknown signal resets the timer);
* the way back needs the signal below ``recover_below`` (a ``below`` rule: above ``recover_above``)
  for ``recover_for_s`` (hysteresis), and the incident at least ``min_dwell_s`` old;
* after any switch on a model, no automatic switch on it for ``cooldown_s``;
* at most ``max_switches_per_hour`` automatic switches in any hour;
* a frozen controller, or a model with a pinned variant, takes no automatic action.

Where a shift may send traffic (:func:`engines.rollout.targets.shift_targets`):

* never to an engine an ``exclude_target`` rule holds (the held-out accuracy under 90 %);
* never to an engine whose own traffic a shift or set_weight in force moved away, except that a
  rule listed earlier ends a later rule's shift onto the engine it fires on: INT4 rolled back for
  latency ends "prefer INT4 for energy" rather than wait behind it, never the other way round.

Sleeping engines (:mod:`engines.rollout.offload`): ``decide`` only says which engine should sleep or
wake (:attr:`Decision.intents`); the controller sends them. An engine that is asleep, or
waking and not yet confirmed awake by its ``sleep_state`` gauge, has no traffic share.

Its length: the incident lifecycle and the sleep lifecycle share the routing they both change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ConfigDict, TypeAdapter

from engines.rollout.routing import EngineInfo, RoutingTable, base_weights, move_share, normalise, set_share
from engines.rollout.rules import Rule
from engines.rollout.settings import ControllerSettings
from engines.rollout.snapshot import EngineSignals, Incident, Snapshot
from engines.rollout.targets import shift_targets

HOUR_S = 3600.0


# -- inputs ------------------------------------------------------------------------------------------------


# -- state ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sleep:
    """An engine put to sleep (``asleep``) or woken and not yet confirmed awake (``waking``)."""

    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    engine: str
    phase: str
    #: the incident that put it to sleep ("rule@engine"), or the one that woke it
    by: str
    level: int
    since: float
    #: when the last sleep or wake intent was issued (re-sent after ``offload.retry_s`` unconfirmed)
    sent_at: float

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _SLEEP.dump_python(self, mode="json")
        return d


@dataclass(frozen=True, slots=True)
class ControllerState:
    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    incidents: Mapping[str, Incident] = field(default_factory=dict)
    #: "rule@engine" -> since when its condition has held (not acted on yet)
    breaches: Mapping[str, float] = field(default_factory=dict)
    #: "rule@engine" -> why an action that is due is held back (logged once per change)
    holds: Mapping[str, str] = field(default_factory=dict)
    #: times of automatic switches within the last hour
    switches: tuple[float, ...] = ()
    #: public model -> time of its last switch (automatic or manual)
    last_switch: Mapping[str, float] = field(default_factory=dict)
    frozen: bool = False
    pins: Mapping[str, str] = field(default_factory=dict)
    #: engine -> its sleep, while it is asleep or waking
    sleeping: Mapping[str, Sleep] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _STATE.dump_python(self, mode="json")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ControllerState:
        """The state as the routing document stores it (None or empty: a fresh state)."""
        if not d:
            return cls()
        return _STATE.validate_python(d)


#: the stored shapes (the routing document in Redis, the admin API): JSON types, tuples as lists
_SLEEP = TypeAdapter(Sleep)
_STATE = TypeAdapter(ControllerState)


# -- outputs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of routing or engine state, automatic or manual: what goes to metrics, the log and audit.

    ``action`` is one of shift, set_weight, limit_concurrency, raise_concurrency, restore,
    sleep, wake, awake, pin, unpin, freeze, resume, eject, half_open, readmit, down, up
    (sleep and wake: the intent was issued; awake: the engine's gauge confirmed it and it
    may take traffic again); ``reason`` is a rule name or
    a fixed word (manual, outlier-ejection, health-probe, ...); ``source`` is auto or manual.
    """

    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    at: float
    action: str
    reason: str
    source: str
    engine: str | None = None
    models: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As the log, the audit trail and the admin API show it."""
        d: dict[str, Any] = _TRANSITION.dump_python(self, mode="json")
        return d


_TRANSITION = TypeAdapter(Transition)


@dataclass(frozen=True, slots=True)
class Hold:
    key: str
    reason: str


@dataclass(frozen=True, slots=True)
class Intent:
    """Something the controller must do to an engine: ``sleep`` (at ``level``) or ``wake``."""

    action: str
    engine: str
    level: int = 1
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    state: ControllerState
    transitions: tuple[Transition, ...] = ()
    #: newly held actions (a hold is reported once, when its reason first appears)
    holds: tuple[Hold, ...] = ()
    #: sleeps and wakes to send, in order
    intents: tuple[Intent, ...] = ()


# -- routing -------------------------------------------------------------------------------------------------


def route(infos: Mapping[str, EngineInfo], state: ControllerState, version: int = 0) -> RoutingTable:
    """The table implied by the configuration, the incidents in force (oldest first) and the pins."""
    weights = base_weights(infos.values())
    limits: dict[str, int] = {}
    raised: dict[str, int] = {}
    for inc in sorted(state.incidents.values(), key=lambda i: (i.since, i.rule, i.engine)):
        if inc.engine not in infos:
            continue
        if inc.action == "limit_concurrency" and inc.limit is not None:
            limits[inc.engine] = min(limits.get(inc.engine, inc.limit), inc.limit)
            continue
        if inc.action == "raise_concurrency" and inc.limit is not None:
            raised[inc.engine] = max(raised.get(inc.engine, inc.limit), inc.limit)
            continue
        for model in infos[inc.engine].serves:
            w = weights.get(model)
            if w is None:
                continue
            if inc.action == "shift":
                targets = [t for t in inc.targets.get(model, ()) if t in w]
                move_share(w, inc.engine, inc.keep, targets)
            elif inc.action == "set_weight":
                set_share(w, inc.engine, inc.weight, infos)
    for model, variant in state.pins.items():
        w = weights.get(model)
        if w is None:
            continue
        chosen = [n for n in w if infos[n].variant == variant]
        if chosen:
            weights[model] = {n: (1.0 / len(chosen) if n in chosen else 0.0) for n in w}
    # A sleeping engine (or one whose wake is not confirmed yet) takes no traffic, pinned or not.
    for name in sorted(state.sleeping):
        if name not in infos:
            continue
        for model in infos[name].serves:
            w = weights.get(model)
            if w is not None and w.get(name, 0.0) > 0.0:
                set_share(w, name, 0.0, infos)
    return RoutingTable(
        version=version,
        weights={m: normalise(w) for m, w in weights.items()},
        limits=limits,
        pins=dict(state.pins),
        raised=raised,
        asleep=tuple(sorted(n for n in state.sleeping if n in infos)),
    )


# -- decide --------------------------------------------------------------------------------------------------


def _key(rule: Rule, engine: str) -> str:
    return f"{rule.name}@{engine}"


def _new_incident(
    rule: Rule,
    sig: EngineSignals,
    value: float,
    since: float,
    snap: Snapshot,
    config: ControllerSettings,
    incidents: Mapping[str, Incident],
    sleeping: Mapping[str, Sleep] | None = None,
) -> tuple[Incident | None, tuple[str, ...]]:
    a = rule.action
    # What every new incident has; each action adds its own fields to it.
    base = Incident(
        rule=rule.name, engine=sig.info.name, action=a.kind, since=snap.now, detected_at=since, value=value
    )
    if a.kind == "shift":
        targets, preempts = shift_targets(rule, sig, snap, config, incidents, sleeping or {})
        if not targets:
            return None, ()
        return replace(base, targets=targets, keep=a.trickle_weight), preempts
    return _other_incident(rule, sig, base, snap), ()


def _other_incident(rule: Rule, sig: EngineSignals, base: Incident, snap: Snapshot) -> Incident | None:
    a = rule.action
    if a.kind == "set_weight":
        return replace(base, weight=a.weight)
    if a.kind == "raise_concurrency":
        cap = sig.values.get("concurrency_cap")
        seqs = sig.values.get("max_num_seqs")
        if cap is None or seqs is None or a.max_concurrency is None:
            return None  # no configured cap to raise, or no room the engine declared to raise it into
        # Past what the engine runs at once, requests queue inside it, where shedding cannot see them. The
        # cap is the engine's whole (shared by the replicas through Redis), as max_num_seqs is.
        raised = min(a.max_concurrency, math.ceil(a.raise_factor * float(cap)), math.floor(float(seqs)))
        return replace(base, limit=raised) if raised > cap else None  # at the ceiling already
    running = sig.values.get("requests_running") or sig.values.get("in_flight") or 0.0
    per_replica = a.concurrency_factor * float(running) / max(1, snap.replicas)
    return replace(base, limit=max(a.min_concurrency, math.floor(per_replica)))


def _gate(
    model_list: Iterable[str],
    state: ControllerState,
    cfg: ControllerSettings,
    now: float,
    switches: tuple[float, ...],
) -> str | None:
    if state.frozen:
        return "frozen"
    for m in model_list:
        if m in state.pins:
            return "pinned"
        last = state.last_switch.get(m)
        if last is not None and now - last < cfg.cooldown_s:
            return "cooldown"
    if len(switches) >= cfg.max_switches_per_hour:
        return "switch-limit"
    return None


def decide(snapshot: Snapshot, state: ControllerState, config: ControllerSettings) -> Decision:
    """One tick of the controller. Pure: the same inputs give the same output."""
    now = snapshot.now
    infos = snapshot.infos
    incidents = dict(state.incidents)
    breaches = dict(state.breaches)
    holds: dict[str, str] = {}
    switches = tuple(t for t in state.switches if now - t < HOUR_S)
    last_switch = dict(state.last_switch)
    transitions: list[Transition] = []
    new_holds: list[Hold] = []
    intents: list[Intent] = []
    sleeping = {n: z for n, z in state.sleeping.items() if n in infos}
    retry_s = config.offload.retry_s

    def held(key: str, reason: str) -> None:
        holds[key] = reason
        if state.holds.get(key) != reason:
            new_holds.append(Hold(key, reason))

    def now_state() -> ControllerState:
        return replace(state, incidents=incidents, sleeping=sleeping)

    def wake(z: Sleep, by: str, reason: str) -> None:
        sleeping[z.engine] = replace(z, phase="waking", by=by, sent_at=now)
        intents.append(Intent("wake", z.engine, reason=reason))
        transitions.append(_sleep_transition("wake", reason, now, infos[z.engine], {"by": by}))

    # Incidents whose engine left the configuration end quietly.
    for key in [k for k, i in incidents.items() if i.engine not in infos]:
        incidents.pop(key)

    # Sleeps and wakes the engines' gauges confirm (or that are sent again when they do not).
    for name, z in list(sleeping.items()):
        gauge = snapshot.engines[name].values.get("sleep_state")
        awake = gauge is not None and not math.isnan(float(gauge)) and float(gauge) == 0.0
        if z.phase == "waking" and awake:
            sleeping.pop(name)
            transitions.append(
                _sleep_transition("awake", z.by.split("@", 1)[0], now, infos[name], {"by": z.by})
            )
        elif now - z.sent_at >= retry_s and (z.phase == "waking" or awake):
            sleeping[name] = replace(z, sent_at=now)
            intents.append(Intent("wake" if z.phase == "waking" else "sleep", name, z.level, "retry"))
    current = route(infos, now_state())

    for rule in config.rules:
        if rule.action.kind == "exclude_target":
            continue  # read where shifts choose their targets
        for name, sig in snapshot.engines.items():
            if not rule.select.matches(name, sig.info.variant, sig.info.role):
                continue
            key = _key(rule, name)
            value = sig.reading(rule.signal, rule.min_samples)
            inc = incidents.get(key)
            models = sig.info.serves
            # A raise moves no traffic: it neither starts the model's cooldown nor spends the hourly switch
            # budget, so it can never hold back a rollback; its own for_s, hysteresis and dwell pace it.
            paced = rule.action.kind == "raise_concurrency"
            if inc is None:
                if value is None or not rule.breached(value):
                    breaches.pop(key, None)
                    continue
                since = breaches.setdefault(key, now)
                if now - since < rule.for_s:
                    continue
                reason = _gate(models, replace(state, last_switch=last_switch), config, now, switches)
                if reason in ("frozen", "pinned"):
                    held(key, reason)
                    continue
                probe, preempts = _new_incident(
                    rule, sig, value, since, snapshot, config, incidents, sleeping
                )
                if probe is None:
                    asleep = _sleeping_targets(rule, sig, snapshot, sleeping, config, incidents)
                    for z in asleep:
                        if z.phase == "asleep":
                            wake(z, key, rule.name)
                    held(key, "waking" if asleep else "no-target")
                    continue
                remaining = {k: i for k, i in incidents.items() if k not in preempts}
                trial = replace(now_state(), incidents={**remaining, key: probe})
                after = route(infos, trial)
                if after.same_routing(current):
                    continue  # the action would change nothing (e.g. the engine has no traffic left)
                if reason is not None and not (paced and reason in ("cooldown", "switch-limit")):
                    held(key, reason)
                    continue
                for k in preempts:
                    incidents.pop(k, None)
                incidents[key] = probe
                breaches.pop(key, None)
                if not paced:
                    switches = (*switches, now)
                    for m in models:
                        last_switch[m] = now
                transitions.append(_fired(rule, probe, value, current, after, preempts))
                current = after
                if rule.action.sleep_idle:
                    for idle in _idle_neighbours(rule, sig, snapshot, sleeping, current):
                        sleeping[idle] = Sleep(idle, "asleep", key, rule.action.sleep_level, now, now)
                        intents.append(Intent("sleep", idle, rule.action.sleep_level, rule.name))
                        transitions.append(
                            _sleep_transition(
                                "sleep",
                                rule.name,
                                now,
                                infos[idle],
                                {"by": key, "level": rule.action.sleep_level, "pressure_on": name},
                            )
                        )
                continue
            # An incident in force: watch for the way back.
            if value is not None:
                if rule.recovered(value):
                    if inc.clear_since is None:
                        inc = replace(inc, clear_since=now)
                elif inc.clear_since is not None:
                    inc = replace(inc, clear_since=None)
                incidents[key] = inc
            if not rule.auto_recover or inc.clear_since is None or now - inc.clear_since < rule.recover_for_s:
                continue
            if now - inc.since < config.min_dwell_s:
                held(key, "min-dwell")
                continue
            reason = _gate(models, replace(state, last_switch=last_switch), config, now, switches)
            if reason is not None and not (paced and reason in ("cooldown", "switch-limit")):
                held(key, reason)
                continue
            incidents.pop(key)
            after = route(infos, now_state())
            if not paced:
                switches = (*switches, now)
                for m in models:
                    last_switch[m] = now
            transitions.append(
                Transition(
                    at=now,
                    action="restore",
                    reason=rule.name,
                    source="auto",
                    engine=name,
                    models=tuple(models),
                    detail={
                        "signal": rule.signal,
                        "value": value,
                        **_recover_threshold(rule),
                        "incident_since": inc.since,
                        "undoes": inc.action,
                        "weights": _weights_of(after, models),
                    },
                )
            )
            current = after

    # The way back of an offload (its incident restored or cleared by hand): wake what it put to sleep.
    for z in sorted(sleeping.values(), key=lambda z: z.engine):
        if z.phase == "asleep" and z.by not in incidents:
            wake(z, z.by, z.by.split("@", 1)[0])

    new_state = replace(
        state,
        incidents=incidents,
        breaches=breaches,
        holds=holds,
        switches=switches,
        last_switch=last_switch,
        sleeping=sleeping,
    )
    return Decision(new_state, tuple(transitions), tuple(new_holds), tuple(intents))


def _sleeping_targets(
    rule: Rule,
    src: EngineSignals,
    snap: Snapshot,
    sleeping: Mapping[str, Sleep],
    config: ControllerSettings,
    incidents: Mapping[str, Incident],
) -> list[Sleep]:
    """The sleeping engines a shift would have taken, were they awake."""
    found, _ = shift_targets(rule, src, snap, config, incidents)
    names = sorted({n for group in found.values() for n in group if n in sleeping})
    return [sleeping[n] for n in names]


def _idle_neighbours(
    rule: Rule, src: EngineSignals, snap: Snapshot, sleeping: Mapping[str, Sleep], table: RoutingTable
) -> list[str]:
    """Engines on one of ``src``'s GPUs with no traffic share and nothing in flight, that may sleep."""
    gpus = set(src.gpus)
    if not gpus:
        return []
    wanted = rule.action.sleep_variants
    out = []
    for name, e in sorted(snap.engines.items()):
        if name == src.info.name or name in sleeping or not gpus & set(e.gpus):
            continue
        if wanted and e.info.variant not in wanted:
            continue
        busy = (e.values.get("in_flight") or 0.0) + (e.values.get("requests_running") or 0.0)
        if table.engine_weight(name) > 0.0 or busy > 0.0 or not e.healthy:
            continue
        if e.values.get("sleep_state") not in (None, 0.0):
            continue  # already asleep by someone else's hand
        out.append(name)
    return out


def _sleep_transition(
    action: str, reason: str, now: float, info: EngineInfo, detail: Mapping[str, Any]
) -> Transition:
    return Transition(
        at=now,
        action=action,
        reason=reason,
        source="auto",
        engine=info.name,
        models=info.serves,
        detail=dict(detail),
    )


def _weights_of(table: RoutingTable, models: Iterable[str]) -> dict[str, dict[str, float]]:
    return {m: {e: round(w, 4) for e, w in table.weights.get(m, {}).items()} for m in models}


def _recover_threshold(rule: Rule) -> dict[str, float | None]:
    if rule.below is not None:
        return {"recover_above": rule.recover_above}
    return {"recover_below": rule.recover_below}


def _fired(
    rule: Rule,
    inc: Incident,
    value: float,
    before: RoutingTable,
    after: RoutingTable,
    preempts: tuple[str, ...] = (),
) -> Transition:
    models = tuple(m for m in after.weights if inc.engine in after.weights[m])
    detail: dict[str, Any] = {
        "signal": rule.signal,
        "value": value,
        **({"below": rule.below} if rule.below is not None else {"above": rule.above}),
        "for_s": rule.for_s,
        "detected_at": inc.detected_at,
        "weights_before": _weights_of(before, models),
        "weights": _weights_of(after, models),
    }
    if inc.targets:
        detail["targets"] = {m: list(t) for m, t in inc.targets.items()}
    if inc.limit is not None:
        detail["limit"] = inc.limit
    if preempts:
        detail["ends"] = list(preempts)
    return Transition(
        at=inc.since,
        action=inc.action,
        reason=rule.name,
        source="auto",
        engine=inc.engine,
        models=models,
        detail=detail,
    )


# -- manual overrides ----------------------------------------------------------------------------------------


def pin(state: ControllerState, model: str, variant: str, now: float) -> ControllerState:
    return replace(state, pins={**state.pins, model: variant}, last_switch={**state.last_switch, model: now})


def unpin(state: ControllerState, model: str, now: float) -> ControllerState:
    pins = {m: v for m, v in state.pins.items() if m != model}
    return replace(state, pins=pins, last_switch={**state.last_switch, model: now})


def freeze(state: ControllerState) -> ControllerState:
    return replace(state, frozen=True)


def resume(state: ControllerState, now: float, *, clear: bool = False) -> ControllerState:
    """Unfreeze; with ``clear``, also end every incident (traffic goes back to the configured split)."""
    if clear:
        return replace(state, frozen=False, incidents={}, breaches={}, holds={})
    return replace(state, frozen=False)


def clear_incident(state: ControllerState, key: str, now: float) -> ControllerState:
    """End one incident by hand (a canary set to 0 % stays there until someone does this)."""
    inc = state.incidents.get(key)
    if inc is None:
        return state
    incidents = {k: i for k, i in state.incidents.items() if k != key}
    return replace(state, incidents=incidents)
