"""What the rollback controller reads and remembers: one tick's engine signals and an incident in force.

Kept apart from :mod:`engines.rollback` (the pure ``decide``) so that the shift-target rules
(:mod:`engines.targets`), which ``decide`` calls, read the same types without importing it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engines.rollout_rules import SAMPLED_SIGNALS
from engines.routing import EngineInfo


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One engine as the controller sees it at one tick."""

    info: EngineInfo
    healthy: bool = True
    circuit: str = "closed"
    #: signal name -> value (None: not measured); see ``engines.rollout_rules.Signal``
    values: Mapping[str, float | None] = field(default_factory=dict)
    #: signal name -> how many samples the value rests on (sampled signals only)
    samples: Mapping[str, int] = field(default_factory=dict)
    #: the GPUs the engine runs on (DCGM gpu labels or NVML indices); engines sharing one can trade memory
    gpus: tuple[str, ...] = ()

    def reading(self, signal: str, min_samples: int) -> float | None:
        value = self.values.get(signal)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None
        if signal in SAMPLED_SIGNALS and self.samples.get(signal, 0) < max(1, min_samples):
            return None
        return float(value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    engines: Mapping[str, EngineSignals]
    replicas: int = 1

    @property
    def infos(self) -> dict[str, EngineInfo]:
        return {n: e.info for n, e in self.engines.items()}


@dataclass(frozen=True, slots=True)
class Incident:
    """A rule's action in force on one engine."""

    rule: str
    engine: str
    action: str
    since: float
    detected_at: float
    value: float
    #: public model -> engines that took the traffic (shift)
    targets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    weight: float = 0.0
    keep: float = 0.0
    limit: int | None = None
    clear_since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "engine": self.engine,
            "action": self.action,
            "since": self.since,
            "detected_at": self.detected_at,
            "value": self.value,
            "targets": {m: list(t) for m, t in self.targets.items()},
            "weight": self.weight,
            "keep": self.keep,
            "limit": self.limit,
            "clear_since": self.clear_since,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Incident:
        return cls(
            rule=d["rule"],
            engine=d["engine"],
            action=d["action"],
            since=float(d["since"]),
            detected_at=float(d.get("detected_at", d["since"])),
            value=float(d.get("value", 0.0)),
            targets={m: tuple(t) for m, t in (d.get("targets") or {}).items()},
            weight=float(d.get("weight", 0.0)),
            keep=float(d.get("keep", 0.0)),
            limit=d.get("limit"),
            clear_since=d.get("clear_since"),
        )
