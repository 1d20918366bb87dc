"""The audio screen's kept transcripts (policies/audio_screen.py ``Transcripts``): bounded in characters,
least recently used out, scoped by caller, and off at 0."""

from __future__ import annotations

from policies.audio_screen import Transcripts


def test_kept_within_the_bound_least_recently_used_out():
    kept = Transcripts(max_chars=3 * (Transcripts._ENTRY + 10))
    for name in "abc":
        kept.put(("t", name), name * 10)
    assert kept.get(("t", "a")) == "a" * 10  # used: now the newest
    kept.put(("t", "d"), "d" * 10)
    assert kept.get(("t", "b")) is None and len(kept) == 3
    assert [kept.get(("t", n)) for n in "acd"] == ["a" * 10, "c" * 10, "d" * 10]


def test_the_scope_is_part_of_the_key_and_silence_is_a_transcript_too():
    kept = Transcripts(max_chars=10_000)
    kept.put(("north", "x"), "")
    assert kept.get(("north", "x")) == ""  # heard, and nothing said: not heard again
    assert kept.get(("south", "x")) is None


def test_a_transcript_larger_than_the_bound_and_a_bound_of_zero_keep_nothing():
    kept = Transcripts(max_chars=200)
    kept.put(("t", "long"), "w" * 500)
    assert kept.get(("t", "long")) is None and len(kept) == 0
    off = Transcripts(max_chars=0)
    off.put(("t", "x"), "")
    assert off.get(("t", "x")) is None
