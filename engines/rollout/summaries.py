"""The measurements' mergeable form: fixed log-spaced latency buckets, the tenant weights and
:class:`EngineSummary`, what one replica publishes and the leader merges; and the sentinel's
:class:`WerWindow`. Re-exported by engines/rollout/signals.py, whose :class:`OutcomeWindow` folds the
request path's outcomes into these off the request path.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ConfigDict, TypeAdapter

__all__ = [
    "LATENCIES",
    "WHOLE_ANSWER_MIN_TOKENS",
    "EngineSummary",
    "WerWindow",
    "bucket_counts",
    "bucket_index",
    "merge_buckets",
    "quantile",
    "tenant_weights",
]

# Buckets: 1 ms to ~2 min, each 2 % wider than the last; values outside are clamped.
_GROWTH = 1.02
_MIN_S = 0.001
_N_BUCKETS = math.ceil(math.log(120.0 / _MIN_S) / math.log(_GROWTH)) + 1
_UPPER = [_MIN_S * _GROWTH**k for k in range(1, _N_BUCKETS + 1)]

#: client-visible (from the request's arrival: body read, pre-policies and hold-back included) and, as
#: ``upstream_*``, the engine's own share: from sending the engine request to its first token (streamed
#: requests only) and to the end of its answer (streamed or not); then two that do not grow with what a
#: tenant sends: the engine's time to first token per 1,000 prompt tokens (a prompt shorter than the
#: window's ``prompt_tokens_floor`` counts as that long, where a first token's fixed cost outweighs its
#: prefill; no sample where the engine reported no prompt tokens) and its time per output token after the
#: first (streamed text answers of two tokens or more; speech adds no tokens to divide by); last, for a
#: whole (non-streamed) answer, which has no first token to time, the engine's duration over the output
#: tokens it reported (text answers of ``WHOLE_ANSWER_MIN_TOKENS`` tokens or more). ``ttft`` and
#: ``first_audio`` are streamed answers only: a whole answer's client-visible time is ``e2e``.
LATENCIES = (
    "ttft",
    "first_audio",
    "e2e",
    "upstream_ttft",
    "upstream_e2e",
    "upstream_ttft_per_1k_prompt_tokens",
    "upstream_tpot",
    "upstream_whole_tpot",
)
#: A whole answer's duration holds its prefill once; over this many output tokens or more the prefill is
#: a small share of the time per token, so a tenant's long prompt with a one-word answer is no sample.
WHOLE_ANSWER_MIN_TOKENS = 16


def bucket_index(value: float) -> int:
    """The bucket of one latency in seconds: the first whose upper edge is at or above it (clamped)."""
    return bisect_left(_UPPER, min(max(value, 0.0), _UPPER[-1]))


def bucket_counts(values: Iterable[float]) -> dict[int, float]:
    """Sparse bucket counts of latency values in seconds (NaNs are skipped)."""
    return dict(Counter(bucket_index(v) for v in values if v == v))


def quantile(buckets: Mapping[int, float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a bucketed distribution (counts may be weights): the upper edge of its
    bucket."""
    total = sum(buckets.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0.0
    for i in sorted(buckets):
        seen += buckets[i]
        if seen >= rank - 1e-9:
            return _UPPER[min(i, _N_BUCKETS - 1)]
    return _UPPER[min(max(buckets), _N_BUCKETS - 1)]


def merge_buckets(parts: Iterable[Mapping[int, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for p in parts:
        for i, c in p.items():
            out[int(i)] = out.get(int(i), 0) + float(c)
    return out


def tenant_weights(counts: Mapping[str, float], cap: float) -> dict[str, float]:
    """The weight (0..1) of each tenant's samples so that no tenant is more than ``cap`` of the weighted total.

    A tenant within the cap keeps every sample (weight 1). The tenants over it are scaled down to one
    common count, the largest at which each is exactly ``cap`` of the total. With fewer tenants than
    ``1 / cap`` the cap cannot hold; each tenant then weighs at most an equal share (one tenant alone
    keeps all its samples: its requests are all the engine served).
    """
    present = sorted(((float(n), t) for t, n in counts.items() if n > 0), reverse=True)
    if not present:
        return {}
    share = max(cap, 1.0 / len(present))
    sizes = [n for n, _ in present]
    level = sizes[0]
    if level > share * sum(sizes):
        # Cap the k largest at one level L, the rest as they are: L = share * (rest + k * L).
        rest = sum(sizes)
        level = sizes[-1]  # all tenants at the smallest one's count: an equal share each
        for k in range(1, len(sizes)):
            rest -= sizes[k - 1]
            if share * k >= 1.0:
                break
            candidate = share * rest / (1.0 - share * k)
            if candidate >= sizes[k]:
                level = candidate
                break
    return {t: min(1.0, level / n) for n, t in present}


@dataclass(slots=True)
class EngineSummary:
    """One replica's (or, merged, every replica's) measurements of one engine over the window."""

    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    ok: int = 0
    errors: int = 0
    #: latency name -> bucket -> weight of its samples (a tenant over its share weighs less than 1 each)
    latency: dict[str, dict[int, float]] = field(default_factory=dict)
    wer_errors: float = 0.0
    wer_words: int = 0
    wer_samples: int = 0
    #: what energy per token divides by: completion tokens and seconds of speech served (engines/rollout/energy.py)
    tokens: int = 0
    audio_s: float = 0.0
    #: requests finished since the replica started (not windowed: tells a busy engine from a sliding window)
    finished_total: int = 0

    def count(self, name: str) -> float:
        """The weighted number of samples of one latency."""
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
        d: dict[str, Any] = _SUMMARY.dump_python(self, mode="json")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineSummary:
        """A replica's published summary; keys it does not have (an older replica) take their defaults."""
        return _SUMMARY.validate_python(d)

    def values(self) -> tuple[dict[str, float | None], dict[str, int]]:
        """The summary as controller signals (``ttft_p99``, ``error_rate``, ``wer``, ...), with counts."""
        values: dict[str, float | None] = {}
        samples: dict[str, int] = {}
        for name in LATENCIES:
            n = math.floor(self.count(name) + 1e-9)
            for tag, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
                values[f"{name}_{tag}"] = self.percentile(name, q)
                samples[f"{name}_{tag}"] = n
        values["error_rate"] = self.error_rate
        samples["error_rate"] = self.ok + self.errors
        values["wer"] = self.wer
        samples["wer"] = self.wer_samples
        return values, samples


#: what a replica publishes for the leader to merge: JSON types, the latency buckets keyed by their index as text
_SUMMARY = TypeAdapter(EngineSummary)


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
