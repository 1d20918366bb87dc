"""What the rollback controller reads and remembers: one tick's engine signals and an incident in force.

Kept apart from :mod:`engines.rollout.rollback` (the pure ``decide``) so that the shift-target rules
(:mod:`engines.rollout.targets`), which ``decide`` calls, read the same types without importing it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, GetCoreSchemaHandler, TypeAdapter
from pydantic_core import CoreSchema, core_schema

from engines.rollout.routing import EngineInfo
from engines.rollout.rules import SAMPLED_SIGNALS


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One engine as the controller sees it at one tick."""

    info: EngineInfo
    healthy: bool = True
    circuit: str = "closed"
    #: signal name -> value (None: not measured); see ``engines.rollout.rules.Signal``
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

    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

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
        d: dict[str, Any] = _INCIDENT.dump_python(self, mode="json")
        return d

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        # An incident stored before detection time was recorded has none: it was detected when it began.
        return core_schema.no_info_before_validator_function(_detected_when_begun, handler(source))


def _detected_when_begun(d: Any) -> Any:
    if isinstance(d, Mapping) and "detected_at" not in d and "since" in d:
        return {**d, "detected_at": d["since"]}
    return d


#: the stored shape (Redis, audit, the admin API): JSON types, targets as lists
_INCIDENT = TypeAdapter(Incident)
