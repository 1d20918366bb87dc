"""Redaction cannot freeze the gateway: its time grows linearly with the text, however the text is built.

A backtracking engine holds the GIL for the whole match, so a prompt built to defeat
one pattern stalls every request of the process, health checks included. The attack
runs in a child process so that a stalled engine fails the test instead of hanging it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from observability.audit import redact as redaction
from observability.audit.redact import redact
from tests.redact_oracle import redact_with_backtracking

ROOT = Path(__file__).resolve().parents[2]

# 1 KB prompts against the rules that backtrack: ipv6 (runs of ':'), phone (digits and separators), email.
ATTACKS = [
    ":" * 1023 + "x",
    "1" * 1023 + "x",
    "1 " * 511 + "x",
    "1-" * 511 + "a",
    "a@" + "a." * 511,
    "a." * 511 + "@",
    "::" * 511 + "g",
]

_CHILD = """
import sys, time
from observability.audit.redact import redact
attacks = {attacks!r}
worst = 0.0
for text in attacks:
    t0 = time.perf_counter()
    redact(text)
    worst = max(worst, time.perf_counter() - t0)
print(worst)
"""


def test_a_one_kilobyte_adversarial_prompt_is_redacted_at_once():
    # Ceiling: 2 s for seven 1 KB texts is thousands of times what a linear engine needs; the
    # backtracking rule set spends tens of seconds on the first one alone.
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD.format(attacks=ATTACKS)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("redacting one 1 KB prompt took more than 30 s (catastrophic backtracking)")
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 2.0, f"the slowest 1 KB prompt took {float(done.stdout):.2f} s"


def _best_of(text: str, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        redact(text)
        best = min(best, time.perf_counter() - t0)
    return best


_ALPHABET = ":.@0123456789 -+()abfxAKI_é/"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    unit=st.text(alphabet=_ALPHABET, min_size=1, max_size=6),
    tail=st.sampled_from(["", "x", "g", "-", ":", "@", "1"]),
)
def test_redaction_time_is_linear_in_the_length_on_adversarial_runs(unit, tail):
    small_n, big_n = 8 * 1024, 64 * 1024
    small = unit * (small_n // len(unit)) + tail
    big = unit * (big_n // len(unit)) + tail
    t_small, t_big = _best_of(small), _best_of(big)
    # Eight times the text: a linear engine takes about eight times as long; quadratic would be 64x,
    # cubic 512x. The bound sits between linear and quadratic with room for a loaded machine (a
    # best-of-five reading of the small text can still land on a quiet moment), with a floor for timer
    # granularity.
    assert t_big <= 24 * max(t_small, 0.0005), (unit, tail, t_small, t_big)
    # Absolute ceiling: 50 ms per KB (a linear engine needs well under 1 ms).
    assert t_big <= 0.05 * big_n / 1024, (unit, tail, t_big)


def test_the_rules_still_find_what_they_found():
    text = (
        "mail jane.doe+x@example.co.uk, card 4111-1111-1111-1111, call +44 20 7946 0958 or "
        "(415) 555-0132 from 192.168.10.254 and 2001:db8::8a2e:370:7334; key sk-proj-abcdefghijklmnop1234"
    )
    assert redact(text) == (
        "mail [EMAIL], card [CARD], call [PHONE] or [PHONE] from [IP] and [IP]; key [SECRET]"
    )
    # neighbours shared by two matches (a look-around does not consume them)
    assert redact("555-0132, 555-0133") == "[PHONE], [PHONE]"
    assert redact("a 2001:db8::1 2001:db8::2 b") == "a [IP] [IP] b"
    # look-around edges: no phone inside a word or after '+'/'(' that is not its own
    assert redact("id x5550132999 and 555-0132-") == "id x5550132999 and 555-0132-"
    assert redact("über 555 0132 99 ünd") == "über [PHONE] ünd"


def test_one_record_spends_at_most_its_budget_and_never_keeps_the_rest():
    budget = redaction.Budget(100)
    first = budget.redact("mail bob@example.com " + "a" * 70)
    assert first.startswith("mail [EMAIL] ")
    second = budget.redact("secret 4111-1111-1111-1111 beyond the cap")
    assert "4111" not in second and second.endswith("more characters]")
    assert budget.redact("anything") == "[NOT KEPT: 8 more characters]"
    huge = "x" * (redaction.MAX_REDACTED_CHARS + 10)
    assert redact(huge).endswith("[NOT KEPT: 10 more characters]")


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet="0123456789 .-:+()@abcdefxyzAKIGBW_/", max_size=40))
def test_same_redactions_as_the_backtracking_rule_set_on_short_ascii_text(text):
    # The former rule set, on texts too short to make it backtrack for long, is the oracle: the
    # linear engine keeps every redaction it made. (They differ on non-ASCII neighbours: RE2's \b
    # and digits are ASCII.)
    assert redact(text) == redact_with_backtracking(text)
