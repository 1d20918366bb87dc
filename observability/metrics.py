"""Every Prometheus metric omnigate exports, and the request path's handle on their children.

The metrics themselves (names, labels, buckets, one declaration each) are defined once in
:mod:`observability.metric_catalog` and made at start-up; they are re-exported here, where the rest of
the project imports them from. What stays here is what a request calls: :class:`Children`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

from observability.metric_catalog import ENGINE_STATES as ENGINE_STATES
from observability.metric_catalog import SHED_REASONS as SHED_REASONS
from observability.metric_catalog import Metrics as Metrics

M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """``metric.labels(*values)`` with each child made once: a dict lookup per call on the request path
    (prometheus_client's ``labels`` checks and converts every value and takes a lock each time). Only
    for metrics whose children are never removed."""

    __slots__ = ("_made", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._made: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._made.get(values)
        if child is None:
            child = self._made[values] = self._metric.labels(*values)
        return child
