"""The engines' transitions as the data plane hands them on: the one way out of health to the control side.

Health (:mod:`engines.selection.health`) publishes every change of an engine's circuit or probed health
as a :class:`~engines.rollout.rollback.Transition`; whoever wants them (the rollback controller) subscribes
once when it is wired. Each subscriber gets every transition once, in order, as it happens; with nobody
subscribed, a transition is logged instead.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from engines.rollout.rollback import Transition

__all__ = ["Transitions"]

log = structlog.get_logger("engines.pool")


class Transitions:
    def __init__(self) -> None:
        self._subscribers: list[Callable[[Transition], None]] = []

    def subscribe(self, fn: Callable[[Transition], None]) -> Callable[[], None]:
        """Hand every transition from now on to ``fn``; returns the call that stops it."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    @property
    def subscribed(self) -> bool:
        return bool(self._subscribers)

    def publish(self, t: Transition) -> None:
        if not self._subscribers:
            log.warning("engine_transition", **t.to_dict())
            return
        for fn in list(self._subscribers):
            fn(t)
