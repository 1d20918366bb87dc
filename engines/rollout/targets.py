"""Where a rule's shift may send traffic: the engines of its wanted variants that can take it.

Pure, like :func:`engines.rollout.rollback.decide`, which calls it when a shift is due. A destination is
up and awake, of the first of ``to_variants`` that has one for the model, not held by an ``exclude_target``
rule (the held-out accuracy under its floor), and not an engine whose own traffic a shift or
set_weight in force moved away, unless that incident is a later-listed rule's shift onto the
engine now firing: then the new shift ends it (the rule order is the priority).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from engines.rollout.rules import Rule
from engines.rollout.settings import ControllerSettings

if TYPE_CHECKING:
    from engines.rollout.snapshot import EngineSignals, Incident, Snapshot


def excluded_targets(snap: Snapshot, config: ControllerSettings) -> frozenset[str]:
    """Engines an ``exclude_target`` rule holds now (no for_s or way back: the latest reading decides)."""
    out: set[str] = set()
    for rule in config.rules:
        if rule.action.kind != "exclude_target":
            continue
        for name, sig in snap.engines.items():
            if not rule.select.matches(name, sig.info.variant, sig.info.role):
                continue
            value = sig.reading(rule.signal, rule.min_samples)
            if value is not None and rule.breached(value):
                out.add(name)
    return frozenset(out)


def shift_targets(
    rule: Rule,
    src: EngineSignals,
    snap: Snapshot,
    config: ControllerSettings,
    incidents: Mapping[str, Incident],
    sleeping: Collection[str] = (),
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Per model, the engines of the first wanted variant that serve it, are up (and awake: not in
    ``sleeping``) and may take traffic; with the incidents the shift ends (see the module docstring)."""
    order = {r.name: i for i, r in enumerate(config.rules)}
    mine = order.get(rule.name, len(order))
    excluded = excluded_targets(snap, config)
    moved_away: dict[str, list[str]] = {}  # engine -> keys of the incidents that moved its traffic away
    preemptable: set[str] = set()
    for key, inc in incidents.items():
        if inc.action not in ("shift", "set_weight"):
            continue
        moved_away.setdefault(inc.engine, []).append(key)
        onto_src = any(src.info.name in t for t in inc.targets.values())
        if inc.action == "shift" and onto_src and order.get(inc.rule, len(order)) > mine:
            preemptable.add(key)
    out: dict[str, tuple[str, ...]] = {}
    preempts: set[str] = set()
    for model in src.info.serves:
        for variant in rule.action.to_variants:
            found = []
            for n, e in snap.engines.items():
                if (
                    n == src.info.name
                    or model not in e.info.serves
                    or e.info.variant != variant
                    or not e.healthy
                    or e.circuit == "open"
                    or n in excluded
                    or n in sleeping
                ):
                    continue
                blocking = moved_away.get(n, [])
                if any(k not in preemptable for k in blocking):
                    continue
                preempts.update(blocking)
                found.append(n)
            if found:
                out[model] = tuple(sorted(found))
                break
    return out, tuple(sorted(preempts))
