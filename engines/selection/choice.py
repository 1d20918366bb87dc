"""The order to try a model's engines in, for one request: a weighted draw, then the rest.

A pure function of what the pool knows now (which engines are up and under their cap) and
the routing table's weights (:mod:`engines.rollout.routing`), so it is tested without slots or probes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping

from engines.adapters.base import Engine

#: the order engines of one model are listed in before any weight is applied
ROLE_ORDER = {"primary": 0, "canary": 1, "fallback": 2}


def by_model(engines: Iterable[Engine]) -> dict[str, list[Engine]]:
    """Each public model's engines, primaries first, then canaries, then fallbacks."""
    out: dict[str, list[Engine]] = {}
    for engine in sorted(engines, key=lambda e: ROLE_ORDER[e.config.role]):
        for public in engine.config.serves:
            out.setdefault(public, []).append(engine)
    return out


def order(
    engines: Iterable[Engine],
    weights: Mapping[str, float],
    rng: random.Random,
    *,
    excluded: Callable[[str], bool],
    open_to_load: Callable[[str], bool],
) -> list[Engine]:
    """Engines in the order to try them.

    First, one engine drawn by ``weights`` among those open to load (healthy, not ejected, under
    their concurrency limit); then the rest of those by weight; then those open to load without
    traffic share (fallbacks, engines rolled back from); last, as a last resort, the engines that
    are not open to load. ``excluded`` engines (asleep, serving other weights) are not listed at all.
    """
    weighted: list[tuple[float, Engine]] = []
    standby: list[Engine] = []
    down: list[Engine] = []
    for e in engines:
        if excluded(e.name):
            continue
        if not open_to_load(e.name):
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
            x = rng.random() * sum(w for w, _ in weighted)
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
