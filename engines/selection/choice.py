"""Engine choice for one request, in one place: which of a model's engines can serve it (input
modalities, features, a thinking budget only an engine can keep), the order to try them in (a weighted
draw, then the rest) and the request as each one is sent it.

Pure functions of the request, the engines' capabilities, what the pool knows now (which engines are up
and under their cap) and the routing table's weights (:mod:`engines.rollout.routing`), so they are
tested without slots or probes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping

from core.errors import InvalidRequest
from core.schemas import ChatCompletionRequest
from engines.adapters.base import Engine
from engines.selection import thinking

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


def able(engines: list[Engine], request: ChatCompletionRequest) -> list[Engine]:
    """Those of ``engines`` (in order) that can serve ``request``; a request none can serve is refused
    (400) by the field it asked for, never served with the field dropped."""
    fitting = [e for e in engines if not (request.input_modalities() - e.capabilities.input_modalities)]
    if not fitting:
        kinds = ", ".join(sorted(request.input_modalities() - {"text"}))
        raise InvalidRequest(f"the model {request.model!r} does not accept {kinds} input", param="messages")
    features = request.features()
    if features:
        capable = [e for e in fitting if features <= e.capabilities.features]
        if not capable:
            field = min(features - set().union(*(e.capabilities.features for e in fitting)) or features)
            raise InvalidRequest(f"the model {request.model!r} does not support {field}", param=field)
        fitting = capable
    if thinking.needs_enforcement(request):
        fitting = [e for e in fitting if e.capabilities.thinking_budget]
        if not fitting:
            raise thinking.refuse(request)
    return fitting


def fit(engine: Engine, request: ChatCompletionRequest) -> tuple[ChatCompletionRequest | None, list[str]]:
    """The request as ``engine`` is sent it, and the degradations that carries; None: it cannot serve it."""
    if request.input_modalities() - engine.capabilities.input_modalities:
        return None, []
    request, held = thinking.fit(engine, request)
    degraded = [held] if held is not None else []
    if request.wants_audio and not engine.capabilities.speaks:
        degraded.append("engine-text-only")
        request = request.model_copy(update={"modalities": ["text"], "audio": None})
    return request, degraded
