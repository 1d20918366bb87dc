"""Energy per token: GPU power integrated over an engine's active time, over the tokens the gateway counted.

Method (the figure is an estimate, and this is what it estimates):

* power is the sum over the engine's GPUs of DCGM's ``DCGM_FI_DEV_POWER_USAGE`` (W) or NVML's
  ``nvmlDeviceGetPowerUsage`` (mW, read as W), as :mod:`engines.rollout.telemetry` scrapes it;
* the controller observes it once a tick, with whether the engine was busy (requests in flight on
  any replica, or requests finished since the last tick); the energy of the interval between two
  observations is the trapezoid ``(w0 + w1) / 2 * (t1 - t0)``, counted when the engine was busy at
  either end, so idle power between bursts is not charged to anyone;
* the tokens are those the gateway itself counted for the engine over the same window: the
  completion tokens of its answers plus, for speech, ``audio_tokens_per_s`` token-equivalents per
  second of audio served (speech adds no completion tokens);
* ``tokens_per_joule`` is window tokens over window joules, once the window holds ``min_joules``;
* a request's estimate (``usage.energy_joules``) is its own tokens times the engine's current
  joules per token, so requests are charged in proportion to what they produced.

A GPU shared by two engines is charged in full to each: configure each GPU under one engine.
Nothing here does I/O; :class:`EnergyMeter` is fed by the controller and by ``bench/energy_gpu.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def trapezoid_joules(samples: Iterable[tuple[float, float, bool]]) -> float:
    """Joules of ``(time_s, watts, busy)`` samples in time order, counting intervals busy at either end."""
    total = 0.0
    prev: tuple[float, float, bool] | None = None
    for t, w, busy in samples:
        if prev is not None and t > prev[0] and (busy or prev[2]):
            total += (prev[1] + w) / 2.0 * (t - prev[0])
        prev = (t, w, busy)
    return total


def token_equivalents(completion_tokens: float, audio_seconds: float, audio_tokens_per_s: float) -> float:
    """What energy is divided by: completion tokens plus speech converted at ``audio_tokens_per_s``."""
    return float(completion_tokens) + float(audio_seconds) * audio_tokens_per_s


@dataclass(slots=True)
class _Track:
    last: tuple[float, float, bool] | None = None
    #: (end time of the interval, joules charged in it)
    segments: deque[tuple[float, float]] = field(default_factory=deque)
    total_joules: float = 0.0


class EnergyMeter:
    """Per engine, active joules over a sliding window, integrated from power observations."""

    def __init__(self, window_s: float = 60.0, min_joules: float = 1.0, max_gap_s: float = 30.0) -> None:
        self.window_s = window_s
        self.min_joules = min_joules
        #: two observations further apart than this are not joined (a scrape outage is no measurement)
        self.max_gap_s = max_gap_s
        self._tracks: dict[str, _Track] = {}

    def observe(self, engine: str, now: float, watts: float | None, busy: bool) -> float:
        """One power observation; returns the joules it added to the engine's active energy."""
        track = self._tracks.setdefault(engine, _Track())
        if watts is None or watts != watts or watts < 0:
            track.last = None  # no reading: the next one starts a new series
            return 0.0
        added = 0.0
        last = track.last
        if last is not None and now > last[0] and now - last[0] <= self.max_gap_s:
            added = trapezoid_joules((last, (now, watts, busy)))
        if last is None or now > last[0]:
            track.last = (now, watts, busy)
        if added:
            track.segments.append((now, added))
            track.total_joules += added
        while track.segments and track.segments[0][0] <= now - self.window_s:
            track.segments.popleft()
        return added

    def restart(self) -> None:
        """Start every engine's series anew: the next observation adds nothing (this meter stopped
        observing, and what happened meanwhile is not its to count)."""
        for track in self._tracks.values():
            track.last = None

    def window_joules(self, engine: str) -> float:
        track = self._tracks.get(engine)
        return sum(j for _, j in track.segments) if track else 0.0

    def total_joules(self, engine: str) -> float:
        track = self._tracks.get(engine)
        return track.total_joules if track else 0.0

    def has_power(self, engine: str) -> bool:
        track = self._tracks.get(engine)
        return track is not None and track.last is not None

    def tokens_per_joule(self, engine: str, tokens: float) -> float | None:
        """``tokens`` (counted over the same window) per active joule; None below ``min_joules``."""
        joules = self.window_joules(engine)
        if joules < self.min_joules:
            return None
        return tokens / joules


class EnergyBook:
    """The engines' current joules per token, as every replica's request path reads it.

    The controller's leader computes the figures and publishes them beside its measurements;
    every replica's controller copies them here. The request path only reads a float.
    """

    __slots__ = ("_jpt", "audio_tokens_per_s")

    def __init__(self, audio_tokens_per_s: float = 12.5) -> None:
        self._jpt: dict[str, float] = {}
        self.audio_tokens_per_s = audio_tokens_per_s

    def update(self, figures: Mapping[str, float | None]) -> None:
        self._jpt = {e: float(v) for e, v in figures.items() if v is not None and v > 0}

    def joules_per_token(self, engine: str) -> float | None:
        return self._jpt.get(engine)

    def figures(self) -> dict[str, float]:
        return dict(self._jpt)

    def estimate(self, engine: str | None, completion_tokens: int, audio_seconds: float) -> float | None:
        """A request's energy estimate in joules, or None without power telemetry for its engine."""
        if engine is None:
            return None
        jpt = self._jpt.get(engine)
        if jpt is None:
            return None
        tokens = token_equivalents(completion_tokens, audio_seconds, self.audio_tokens_per_s)
        return tokens * jpt if tokens > 0 else None
