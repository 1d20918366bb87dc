"""The gateway's own measurements per engine, over a sliding window, in a form replicas can merge.

The request path appends one tuple per finished request (:class:`OutcomeWindow`,
a bounded deque). Off the request path, each replica turns its window into an
:class:`EngineSummary`: counts plus latency histograms on fixed log-spaced buckets
(2 % wide), which add up across replicas, so the leader's percentiles are those of
all traffic rather than an average of per-replica percentiles.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Buckets: 1 ms to ~2 min, each 2 % wider than the last; values outside are clamped.
_GROWTH = 1.02
_MIN_S = 0.001
_N_BUCKETS = math.ceil(math.log(120.0 / _MIN_S) / math.log(_GROWTH)) + 1
_UPPER = [_MIN_S * _GROWTH**k for k in range(1, _N_BUCKETS + 1)]

#: client-visible (from the request's arrival: body read, pre-policies and hold-back included) and, as
#: ``upstream_*``, the engine's own share: from sending the engine request to its first token (streamed
#: requests only) and to the end of its answer (streamed or not)
LATENCIES = ("ttft", "first_audio", "e2e", "upstream_ttft", "upstream_e2e")


def bucket_index(value: float) -> int:
    """The bucket of one latency in seconds: the first whose upper edge is at or above it (clamped)."""
    return bisect_left(_UPPER, min(max(value, 0.0), _UPPER[-1]))


def bucket_counts(values: Iterable[float]) -> dict[int, int]:
    """Sparse bucket counts of latency values in seconds (NaNs are skipped)."""
    return dict(Counter(bucket_index(v) for v in values if v == v))


def quantile(buckets: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a bucketed distribution: the upper edge of its bucket."""
    total = sum(buckets.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i in sorted(buckets):
        seen += buckets[i]
        if seen >= rank - 1e-9:
            return _UPPER[min(i, _N_BUCKETS - 1)]
    return _UPPER[min(max(buckets), _N_BUCKETS - 1)]


def merge_buckets(parts: Iterable[Mapping[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in parts:
        for i, c in p.items():
            out[int(i)] = out.get(int(i), 0) + int(c)
    return out


@dataclass(slots=True)
class EngineSummary:
    """One replica's (or, merged, every replica's) measurements of one engine over the window."""

    ok: int = 0
    errors: int = 0
    latency: dict[str, dict[int, int]] = field(default_factory=dict)
    wer_errors: float = 0.0
    wer_words: int = 0
    wer_samples: int = 0
    #: what energy per token divides by: completion tokens and seconds of speech served (engines/energy.py)
    tokens: int = 0
    audio_s: float = 0.0
    #: requests finished since the replica started (not windowed: tells a busy engine from a sliding window)
    finished_total: int = 0

    def count(self, name: str) -> int:
        return sum(self.latency.get(name, {}).values())

    def percentile(self, name: str, q: float) -> float | None:
        return quantile(self.latency.get(name, {}), q)

    @property
    def error_rate(self) -> float | None:
        n = self.ok + self.errors
        return self.errors / n if n else None

    @property
    def wer(self) -> float | None:
        return self.wer_errors / self.wer_words if self.wer_words else None

    def merge(self, other: EngineSummary) -> EngineSummary:
        return EngineSummary(
            ok=self.ok + other.ok,
            errors=self.errors + other.errors,
            latency={
                n: merge_buckets([self.latency.get(n, {}), other.latency.get(n, {})]) for n in LATENCIES
            },
            wer_errors=self.wer_errors + other.wer_errors,
            wer_words=self.wer_words + other.wer_words,
            wer_samples=self.wer_samples + other.wer_samples,
            tokens=self.tokens + other.tokens,
            audio_s=self.audio_s + other.audio_s,
            finished_total=self.finished_total + other.finished_total,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "errors": self.errors,
            "latency": {n: {str(i): c for i, c in b.items()} for n, b in self.latency.items()},
            "wer_errors": self.wer_errors,
            "wer_words": self.wer_words,
            "wer_samples": self.wer_samples,
            "tokens": self.tokens,
            "audio_s": self.audio_s,
            "finished_total": self.finished_total,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSummary:
        return cls(
            ok=int(d.get("ok", 0)),
            errors=int(d.get("errors", 0)),
            latency={n: {int(i): int(c) for i, c in b.items()} for n, b in (d.get("latency") or {}).items()},
            wer_errors=float(d.get("wer_errors", 0.0)),
            wer_words=int(d.get("wer_words", 0)),
            wer_samples=int(d.get("wer_samples", 0)),
            tokens=int(d.get("tokens", 0)),
            audio_s=float(d.get("audio_s", 0.0)),
            finished_total=int(d.get("finished_total", 0)),
        )

    def values(self) -> tuple[dict[str, float | None], dict[str, int]]:
        """The summary as controller signals (``ttft_p99``, ``error_rate``, ``wer``, ...), with counts."""
        values: dict[str, float | None] = {}
        samples: dict[str, int] = {}
        for name in LATENCIES:
            n = self.count(name)
            for tag, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
                values[f"{name}_{tag}"] = self.percentile(name, q)
                samples[f"{name}_{tag}"] = n
        values["error_rate"] = self.error_rate
        samples["error_rate"] = self.ok + self.errors
        values["wer"] = self.wer
        samples["wer"] = self.wer_samples
        return values, samples


class _Slot:
    """Aggregated outcomes of one slice of time."""

    __slots__ = ("audio_s", "errors", "latency", "ok", "start", "tokens")

    def __init__(self, start: float) -> None:
        self.start = start
        self.ok = 0
        self.errors = 0
        self.tokens = 0
        self.audio_s = 0.0
        self.latency: dict[str, dict[int, int]] = {name: {} for name in LATENCIES}


class OutcomeWindow:
    """Per-engine outcomes of this replica's requests over a sliding window.

    The request path only appends a tuple to a bounded deque. Off the request path,
    :meth:`summary` folds what arrived since its last call into per-slot histograms
    (the window cut in ``slots`` slices) and sums the slots still in the window, so a
    tick costs in proportion to the new requests, not to the window's size.
    """

    __slots__ = ("_clock", "_finished", "_q", "_slot_s", "_slots", "_window_s")

    def __init__(
        self, max_samples: int = 20_000, clock: Any = time.monotonic, window_s: float = 60.0, slots: int = 30
    ) -> None:
        self._q: deque[tuple[float, float, float, float, float, float, int, float]] = deque(
            maxlen=max_samples
        )
        self._clock = clock
        self._window_s = window_s
        self._slot_s = window_s / slots
        self._slots: deque[_Slot] = deque()
        self._finished = 0

    def success(
        self,
        ttft_s: float | None,
        first_audio_s: float | None,
        e2e_s: float,
        upstream_ttft_s: float | None = None,
        upstream_e2e_s: float | None = None,
        tokens: int = 0,
        audio_s: float = 0.0,
    ) -> None:
        nan = math.nan
        self._finished += 1
        self._q.append(
            (
                self._clock(),
                nan if ttft_s is None else ttft_s,
                nan if first_audio_s is None else first_audio_s,
                e2e_s,
                nan if upstream_ttft_s is None else upstream_ttft_s,
                nan if upstream_e2e_s is None else upstream_e2e_s,
                tokens,
                audio_s,
            )
        )

    def failure(self) -> None:
        self._finished += 1
        self._q.append((self._clock(), math.nan, math.nan, -1.0, math.nan, math.nan, 0, 0.0))

    def __len__(self) -> int:
        return len(self._q) + sum(s.ok + s.errors for s in self._slots)

    def _fold(self) -> None:
        if not self._q:
            return
        batch = []
        while self._q:
            batch.append(self._q.popleft())
        for at, ttft, first_audio, e2e, up_ttft, up_e2e, tokens, audio_s in batch:
            start = math.floor(at / self._slot_s) * self._slot_s
            slot = self._slot_at(start)
            if e2e < 0:
                slot.errors += 1
                continue
            slot.ok += 1
            slot.tokens += tokens
            slot.audio_s += audio_s
            for name, value in zip(LATENCIES, (ttft, first_audio, e2e, up_ttft, up_e2e), strict=True):
                if value == value:  # not NaN
                    buckets = slot.latency[name]
                    i = bucket_index(value)
                    buckets[i] = buckets.get(i, 0) + 1

    def _slot_at(self, start: float) -> _Slot:
        """The slot that starts at ``start``; outcomes arrive in time order, so only the newest can match."""
        if self._slots and self._slots[-1].start == start:
            return self._slots[-1]
        slot = _Slot(start)
        self._slots.append(slot)
        return slot

    def summary(self, window_s: float | None = None) -> EngineSummary:
        """The outcomes of the last ``window_s`` (at most the window this was built with), to a slot's precision."""
        self._fold()
        now = self._clock()
        keep_from = now - self._window_s - self._slot_s
        while self._slots and self._slots[0].start < keep_from:
            self._slots.popleft()
        horizon = now - min(window_s or self._window_s, self._window_s)
        out = EngineSummary(latency={name: {} for name in LATENCIES}, finished_total=self._finished)
        for slot in self._slots:
            if slot.start + self._slot_s <= horizon:
                continue
            out.ok += slot.ok
            out.errors += slot.errors
            out.tokens += slot.tokens
            out.audio_s += slot.audio_s
            for name, buckets in slot.latency.items():
                target = out.latency[name]
                for i, c in buckets.items():
                    target[i] = target.get(i, 0) + c
        return out


@dataclass(slots=True)
class WerWindow:
    """The sentinel's results for one engine: word errors and reference words of its recent samples."""

    max_samples: int = 50
    window_s: float = 900.0
    _q: deque[tuple[float, float, int]] = field(default_factory=deque)

    def add(self, at: float, errors: float, words: int) -> None:
        self._q.append((at, errors, words))
        while len(self._q) > self.max_samples:
            self._q.popleft()

    def totals(self, now: float) -> tuple[float, int, int]:
        while self._q and self._q[0][0] < now - self.window_s:
            self._q.popleft()
        return sum(e for _, e, _ in self._q), sum(w for _, _, w in self._q), len(self._q)
