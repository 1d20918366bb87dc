"""The gateway's own measurements per engine, over a sliding window, in a form replicas can merge.

The request path appends one tuple per finished request (:class:`OutcomeWindow`,
a bounded deque). Off the request path, each replica turns its window into an
:class:`EngineSummary`: counts plus latency histograms on fixed log-spaced buckets
(2 % wide), which add up across replicas, so the leader's percentiles are those of
all traffic rather than an average of per-replica percentiles.

The latencies judge the engine, not one tenant's prompts: besides the raw times there is the engine's
time to first token per 1,000 prompt tokens and its time per output token, and no tenant weighs more
than a capped share of a window's samples (:func:`tenant_weights`). Tenant names stay inside the
replica: the summary it publishes holds the weighted histograms only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from engines.rollout.summaries import LATENCIES as LATENCIES
from engines.rollout.summaries import WHOLE_ANSWER_MIN_TOKENS as WHOLE_ANSWER_MIN_TOKENS
from engines.rollout.summaries import EngineSummary as EngineSummary
from engines.rollout.summaries import WerWindow as WerWindow
from engines.rollout.summaries import bucket_counts as bucket_counts
from engines.rollout.summaries import bucket_index as bucket_index
from engines.rollout.summaries import merge_buckets as merge_buckets
from engines.rollout.summaries import quantile as quantile
from engines.rollout.summaries import tenant_weights as tenant_weights


def ttft_per_1k_prompt_tokens(upstream_ttft_s: float, prompt_tokens: int, floor: int) -> float | None:
    """The engine's time to first token per 1,000 prompt tokens (a prompt under ``floor`` counts as that
    long); None where the engine reported no prompt tokens."""
    if prompt_tokens <= 0:
        return None
    return upstream_ttft_s * 1000.0 / max(prompt_tokens, floor, 1)


class _Slot:
    """Aggregated outcomes of one slice of time; latencies per tenant ("" for none), weighed at summary time."""

    __slots__ = ("audio_s", "errors", "latency", "ok", "start", "tokens")

    def __init__(self, start: float) -> None:
        self.start = start
        self.ok = 0
        self.errors = 0
        self.tokens = 0
        self.audio_s = 0.0
        #: latency name -> tenant -> bucket -> samples
        self.latency: dict[str, dict[str, dict[int, int]]] = {name: {} for name in LATENCIES}


#: one finished request as the request path leaves it: when, ttft, first audio, e2e, upstream ttft,
#: upstream e2e (NaN: not measured; e2e -1: a failure), completion tokens, speech seconds, prompt tokens,
#: tenant ("" for none)
_Outcome = tuple[float, float, float, float, float, float, int, float, int, str]


class OutcomeWindow:
    """Per-engine outcomes of this replica's requests over a sliding window.

    The request path only appends a tuple to a bounded deque. Off the request path,
    :meth:`summary` folds what arrived since its last call into per-slot histograms
    (the window cut in ``slots`` slices) and sums the slots still in the window, so a
    tick costs in proportion to the new requests, not to the window's size. Each tenant's
    latencies are kept apart until then, and weighed so that none is more than
    ``tenant_share_cap`` of a latency's samples (:func:`tenant_weights`).
    """

    __slots__ = ("_cap", "_clock", "_finished", "_floor", "_q", "_slot_s", "_slots", "_window_s")

    def __init__(
        self,
        max_samples: int = 20_000,
        clock: Any = time.monotonic,
        window_s: float = 60.0,
        slots: int = 30,
        *,
        tenant_share_cap: float = 1.0,
        prompt_tokens_floor: int = 1000,
    ) -> None:
        self._q: deque[_Outcome] = deque(maxlen=max_samples)
        self._clock = clock
        self._window_s = window_s
        self._slot_s = window_s / slots
        self._slots: deque[_Slot] = deque()
        self._finished = 0
        self._cap = tenant_share_cap
        self._floor = max(1, prompt_tokens_floor)

    def success(
        self,
        ttft_s: float | None,
        first_audio_s: float | None,
        e2e_s: float,
        upstream_ttft_s: float | None = None,
        upstream_e2e_s: float | None = None,
        tokens: int = 0,
        audio_s: float = 0.0,
        prompt_tokens: int = 0,
        *,
        tenant: str | None = None,
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
                prompt_tokens,
                tenant or "",
            )
        )

    def failure(self) -> None:
        self._finished += 1
        self._q.append((self._clock(), math.nan, math.nan, -1.0, math.nan, math.nan, 0, 0.0, 0, ""))

    def __len__(self) -> int:
        return len(self._q) + sum(s.ok + s.errors for s in self._slots)

    def _engine_share(
        self, up_ttft: float, up_e2e: float, tokens: int, audio_s: float, prompt: int
    ) -> tuple[float, float, float]:
        """The engine's time to first token per 1,000 prompt tokens, its time per output token after the
        first (streamed) and a whole answer's time per output token (NaN: none)."""
        per_1k = ttft_per_1k_prompt_tokens(up_ttft, prompt, self._floor)  # NaN stays NaN
        streamed_text = tokens >= 2 and audio_s == 0.0 and up_e2e >= up_ttft
        tpot = (up_e2e - up_ttft) / (tokens - 1) if streamed_text else math.nan  # NaN compares false
        # A whole answer: the engine was timed to its end only (no first token on the wire).
        whole_text = up_ttft != up_ttft and tokens >= WHOLE_ANSWER_MIN_TOKENS and audio_s == 0.0
        whole = up_e2e / tokens if whole_text and up_e2e == up_e2e else math.nan
        return math.nan if per_1k is None else per_1k, tpot, whole

    def _fold(self) -> None:
        if not self._q:
            return
        batch = []
        while self._q:
            batch.append(self._q.popleft())
        for at, ttft, first_audio, e2e, up_ttft, up_e2e, tokens, audio_s, prompt, tenant in batch:
            start = math.floor(at / self._slot_s) * self._slot_s
            slot = self._slot_at(start)
            if e2e < 0:
                slot.errors += 1
                continue
            slot.ok += 1
            slot.tokens += tokens
            slot.audio_s += audio_s
            if up_ttft != up_ttft and up_e2e == up_e2e:
                # A whole answer: its client saw every token at once, at the end (that is e2e, not a TTFT).
                ttft = first_audio = math.nan
            per_1k, tpot, whole = self._engine_share(up_ttft, up_e2e, tokens, audio_s, prompt)
            values = (ttft, first_audio, e2e, up_ttft, up_e2e, per_1k, tpot, whole)
            for name, value in zip(LATENCIES, values, strict=True):
                if value == value:  # not NaN
                    buckets = slot.latency[name].setdefault(tenant, {})
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
        per_tenant: dict[str, dict[str, dict[int, int]]] = {name: {} for name in LATENCIES}
        for slot in self._slots:
            if slot.start + self._slot_s <= horizon:
                continue
            out.ok += slot.ok
            out.errors += slot.errors
            out.tokens += slot.tokens
            out.audio_s += slot.audio_s
            for name, tenants in slot.latency.items():
                for tenant, buckets in tenants.items():
                    target = per_tenant[name].setdefault(tenant, {})
                    for i, c in buckets.items():
                        target[i] = target.get(i, 0) + c
        for name, tenants in per_tenant.items():
            weights = tenant_weights({t: sum(b.values()) for t, b in tenants.items()}, self._cap)
            merged = out.latency[name]
            for tenant, buckets in tenants.items():
                w = weights.get(tenant, 0.0)
                for i, c in buckets.items():
                    merged[i] = merged.get(i, 0.0) + w * c
        return out
