"""A circuit breaker per engine: outlier ejection from passive outcomes, then a half-open retry.

Closed: every request may go. After ``consecutive_failures`` failures in a row, or a
failure rate of ``failure_rate`` over at least ``failure_rate_min_requests`` within the
window, the circuit opens: the engine is ejected for ``base_ejection_s`` times the
number of ejections so far (capped at ``max_ejection_s``), as Envoy's outlier detection
does. Then it is half-open: ``half_open_trials`` real requests may try it; a success
closes it, a failure opens it again for longer. Calls come from one event loop only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from engines.rollout.settings import CircuitSettings

State = Literal["closed", "open", "half_open"]


class Circuit:
    __slots__ = (
        "_clock",
        "_closed_at",
        "_failures",
        "_outcomes",
        "cfg",
        "consecutive",
        "ejections",
        "open_until",
        "state",
        "trials",
    )

    def __init__(self, cfg: CircuitSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.state: State = "closed"
        self.consecutive = 0
        self.ejections = 0
        self.open_until = 0.0
        self.trials = 0
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0
        self._closed_at = clock()

    # -- read side ------------------------------------------------------------------
    def current(self) -> State:
        """The state now; an open circuit whose ejection time has passed reads as half-open."""
        if self.state == "open" and self._clock() >= self.open_until:
            return "half_open"
        return self.state

    def available(self) -> bool:
        """Whether a request may be sent now (without claiming a half-open trial)."""
        s = self.current()
        return s == "closed" or (s == "half_open" and self.trials < self.cfg.half_open_trials)

    # -- request path -----------------------------------------------------------------
    def admit(self) -> tuple[bool, State | None]:
        """Claim the right to send one request; returns (admitted, new state if it changed)."""
        s = self.current()
        if s == "closed":
            return True, None
        if s == "open":
            return False, None
        changed: State | None = None
        if self.state == "open":
            self.state, changed = "half_open", "half_open"
            self.trials = 0
        if self.trials >= self.cfg.half_open_trials:
            return False, changed
        self.trials += 1
        return True, changed

    def release(self) -> None:
        """A claimed request ended without an outcome (cancelled, refused by a policy)."""
        if self.state == "half_open" and self.trials > 0:
            self.trials -= 1

    def success(self) -> State | None:
        self.consecutive = 0
        self._record(True)
        if self.state == "half_open":
            self.trials = max(0, self.trials - 1)
            self._close()
            return "closed"
        if (
            self.state == "closed"
            and self.ejections
            and self._clock() - self._closed_at > self.cfg.max_ejection_s
        ):
            self.ejections = 0  # long healthy again: the next ejection starts short
        return None

    def failure(self) -> State | None:
        self.consecutive += 1
        self._record(False)
        if self.state == "half_open":
            self.trials = max(0, self.trials - 1)
            self._open()
            return "open"
        if self.state != "closed":
            return None
        n = len(self._outcomes)
        tripped = self.consecutive >= self.cfg.consecutive_failures or (
            n >= self.cfg.failure_rate_min_requests and self._failures / n >= self.cfg.failure_rate
        )
        if tripped:
            self._open()
            return "open"
        return None

    def reset(self) -> State | None:
        """Close the circuit by hand (operator's readmit)."""
        before = self.state
        self._close()
        self.ejections = 0
        return "closed" if before != "closed" else None

    # -- internals ----------------------------------------------------------------------
    def _record(self, ok: bool) -> None:
        now = self._clock()
        q = self._outcomes
        q.append((now, ok))
        if not ok:
            self._failures += 1
        horizon = now - self.cfg.failure_rate_window_s
        while q and q[0][0] < horizon:
            _, was_ok = q.popleft()
            if not was_ok:
                self._failures -= 1

    def _open(self) -> None:
        self.ejections += 1
        self.state = "open"
        self.trials = 0
        self.open_until = self._clock() + min(
            self.cfg.max_ejection_s, self.cfg.base_ejection_s * self.ejections
        )
        self._outcomes.clear()
        self._failures = 0

    def _close(self) -> None:
        self.state = "closed"
        self.consecutive = 0
        self.trials = 0
        self._closed_at = self._clock()
        self._outcomes.clear()
        self._failures = 0
