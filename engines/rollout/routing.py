"""The routing table: per public model, the share of new requests each engine takes first.

The table is plain data, versioned and serialisable, so the controller can compute it
off the request path and share it across replicas; the request path only reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, TypeAdapter

_EPS = 1e-9
_ROLE_ORDER = {"primary": 0, "canary": 1, "fallback": 2}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What routing needs to know about an engine: static, from its configuration."""

    name: str
    variant: str
    role: str
    serves: tuple[str, ...]
    weight: float | None = None

    @property
    def order(self) -> int:
        return _ROLE_ORDER.get(self.role, 3)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    version: int = 0
    #: public model -> engine -> share of new requests (each model's shares add up to 1)
    weights: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: engine -> most requests in flight this replica sends it
    limits: Mapping[str, int] = field(default_factory=dict)
    #: public model -> pinned variant (manual override)
    pins: Mapping[str, str] = field(default_factory=dict)
    #: engine -> a raised cap that replaces its configured one on this replica (``limits`` and overload still win)
    raised: Mapping[str, int] = field(default_factory=dict)
    #: engines asleep or not yet confirmed awake: no request goes to them, not even as a failover candidate
    asleep: tuple[str, ...] = ()

    def weight(self, model: str, engine: str) -> float:
        return self.weights.get(model, {}).get(engine, 0.0)

    def engine_weight(self, engine: str) -> float:
        """The largest share the engine has for any model it serves."""
        return max((w.get(engine, 0.0) for w in self.weights.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _TABLE.dump_python(self, mode="json")
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoutingTable:
        return _TABLE.validate_python(data)

    def same_routing(self, other: RoutingTable) -> bool:
        """Equal apart from the version number (weights compared to 1e-6)."""
        if (
            self.limits != other.limits
            or self.raised != other.raised
            or tuple(self.asleep) != tuple(other.asleep)
            or self.pins != other.pins
            or set(self.weights) != set(other.weights)
        ):
            return False
        for model, w in self.weights.items():
            o = other.weights[model]
            for name in set(w) | set(o):
                if abs(w.get(name, 0.0) - o.get(name, 0.0)) > 1e-6:
                    return False
        return True


#: the shared shape (the routing document in Redis, the admin API): JSON types, ``asleep`` as a list
_TABLE = TypeAdapter(RoutingTable)


def base_weights(engines: Iterable[EngineInfo]) -> dict[str, dict[str, float]]:
    """The configured split: canaries (and weighted fallbacks) take their weight, primaries share the rest.

    A canary without a weight takes 10 %. When a model has no primary, its
    unweighted fallbacks share what is left, so every model's shares add up to 1.
    """
    by_model: dict[str, list[EngineInfo]] = {}
    for e in engines:
        for m in e.serves:
            by_model.setdefault(m, []).append(e)
    out: dict[str, dict[str, float]] = {}
    for model, group in by_model.items():
        w: dict[str, float] = {e.name: 0.0 for e in group}
        fixed = 0.0
        for e in group:
            if e.role == "canary" or (e.role == "fallback" and e.weight):
                share = e.weight if e.weight is not None else 0.1
                w[e.name] = share
                fixed += share
        rest = max(0.0, 1.0 - fixed)
        primaries = [e for e in group if e.role == "primary"]
        takers = primaries or [e for e in group if e.role == "fallback" and not e.weight] or group
        explicit = [e for e in takers if e.weight is not None and e.role == "primary"]
        if explicit and len(explicit) == len(takers):
            total = sum(e.weight or 0.0 for e in takers) or 1.0
            for e in takers:
                w[e.name] += rest * (e.weight or 0.0) / total
        else:
            for e in takers:
                w[e.name] += rest / len(takers)
        out[model] = normalise(w)
    return out


def normalise(w: Mapping[str, float]) -> dict[str, float]:
    total = sum(max(0.0, x) for x in w.values())
    if total <= _EPS:
        return {k: 0.0 for k in w}
    return {k: max(0.0, x) / total for k, x in w.items()}


def move_share(w: dict[str, float], source: str, keep: float, targets: list[str]) -> None:
    """Move ``source``'s share, less ``keep``, to ``targets`` in equal parts."""
    have = w.get(source, 0.0)
    moved = max(0.0, have - keep)
    if moved <= _EPS or not targets:
        return
    w[source] = have - moved
    for t in targets:
        w[t] = w.get(t, 0.0) + moved / len(targets)


def set_share(w: dict[str, float], engine: str, share: float, infos: Mapping[str, EngineInfo]) -> None:
    """Give ``engine`` exactly ``share``; the others grow or shrink in proportion to their shares."""
    share = min(1.0, max(0.0, share))
    others = {k: x for k, x in w.items() if k != engine}
    total = sum(others.values())
    w[engine] = share
    rest = 1.0 - share
    if total > _EPS:
        for k, x in others.items():
            w[k] = rest * x / total
        return
    # Nobody else had traffic: the primaries (else the fallbacks) take the rest.
    takers = [k for k in others if infos[k].role == "primary"] or [
        k for k in others if infos[k].role == "fallback"
    ]
    takers = takers or list(others)
    for k in others:
        w[k] = rest / len(takers) if k in takers else 0.0
    if not takers:
        w[engine] = 1.0
