"""What the control side decides and the request path reads: one immutable :class:`View`, swapped whole.

A view holds the routing table (weights, routing limits, raised caps, engines asleep; see
:mod:`engines.rollout.routing`), whether the gateway is overloaded (the admission gate's loop decides it,
:mod:`gateway.admission`) and a ``generation`` that grows by one with each view. Control builds the next
view from the current one (:meth:`View.next`) and publishes it (:meth:`Views.publish`): one reference
assignment, so a request sees the old view or the new one, never half of each. A request reads the view
once and passes it along (engine order, claim, caps).

The data plane reacts to a new view by itself: a request waiting for a slot also waits for the next view
(:meth:`Views.published`) and, when one comes, lets waiters in where the cap rose. Nothing of the control
side calls into the slots or sets anything on them.

An engine's cap is computed here (:meth:`View.limit`) from the view and the engine's configured caps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from engines.rollout.routing import RoutingTable

__all__ = ["View", "Views"]


@dataclass(frozen=True, slots=True)
class View:
    table: RoutingTable
    #: engines run at their ``max_in_flight_overloaded`` (the admission gate's overload state)
    overloaded: bool = False
    #: one more than the view it was built from
    generation: int = 0

    def next(self, *, table: RoutingTable | None = None, overloaded: bool | None = None) -> View:
        """The view after this one, with what changed."""
        return replace(
            self,
            table=self.table if table is None else table,
            overloaded=self.overloaded if overloaded is None else overloaded,
            generation=self.generation + 1,
        )

    def limit(
        self,
        name: str,
        normal: int | None,
        overloaded: int | None,
        fail_open: Callable[[int], int] | None = None,
    ) -> int | None:
        """Engine ``name``'s concurrency cap under this view: the lowest of its configured cap (``normal``, or
        ``overloaded`` while the gateway is) and the routing table's limit; None: no cap.

        The table's ``raised`` entry replaces the normal cap by a higher one (overload still wins).
        ``fail_open``: the share of a cap this replica applies alone while the shared caps' store is
        unreachable (:meth:`engines.selection.shared_caps.SharedCaps.fail_open_cap`); None when it answers.
        """
        raised = self.table.raised.get(name)
        if raised is not None and normal is not None:
            normal = max(normal, raised)
        own = overloaded if self.overloaded else normal
        if own is not None and fail_open is not None:
            own = fail_open(own)
        routed = self.table.limits.get(name)
        if own is None or routed is None:
            return routed if own is None else own
        return min(own, routed)


class Views:
    """The current view and its publication: the one place control hands the data plane anything."""

    def __init__(self, first: View) -> None:
        self.current = first
        self._next: asyncio.Future[View] | None = None

    def publish(self, view: View) -> None:
        """Make ``view`` the current one. It must be built from the current one (its generation one more):
        a view built from an older one would undo what was published since."""
        if view.generation != self.current.generation + 1:
            raise ValueError(
                f"view generation {view.generation} does not follow the current one ({self.current.generation})"
            )
        self.current = view
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(view)

    def published(self) -> asyncio.Future[View]:
        """A future that resolves to the next view published (for requests waiting on the event loop)."""
        loop = asyncio.get_running_loop()
        if self._next is None or self._next.done() or self._next.get_loop() is not loop:
            self._next = loop.create_future()
        return self._next
