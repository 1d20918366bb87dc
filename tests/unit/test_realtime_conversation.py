"""A realtime session's conversation: what each turn sends the engine, what the session keeps of its audio,
and a played-so-far truncation."""

from __future__ import annotations

import base64
import struct

import pytest

from gateway.realtime.conversation import Conversation, Item, SessionConfig
from gateway.realtime.events import RealtimeError
from gateway.realtime.turn import chat_request


def _pcm(seconds: float, rate: int) -> bytes:
    return b"\x01\x00" * int(seconds * rate)


def _audio_parts(conv: Conversation, cfg: SessionConfig, budget: float) -> list[bytes]:
    req = chat_request(cfg, conv, ["audio"], None, None, budget)
    return [
        base64.b64decode(p.input_audio.data)
        for m in req.messages
        if isinstance(m.content, list)
        for p in m.content
        if p.type == "input_audio"
    ]


def test_each_turn_sends_the_newest_audio_within_the_budget_and_always_the_newest_turn():
    cfg = SessionConfig(model="m")
    conv = Conversation(limit=16)
    conv.add(Item("a", "user", audio=_pcm(1.0, 24000), rate=24000))
    conv.add(Item("b", "assistant", text="first answer", audio_ms=900))
    conv.add(Item("c", "user", audio=_pcm(0.5, 16000), rate=16000))
    wavs = _audio_parts(conv, cfg, 1.0)
    assert len(wavs) == 1 and struct.unpack_from("<I", wavs[0], 24)[0] == 16000  # its own rate in its header
    assert len(_audio_parts(conv, cfg, 2.0)) == 2
    assert len(_audio_parts(conv, cfg, 0.1)) == 1  # over the budget alone, the newest turn is still heard


def test_the_session_lets_go_of_audio_no_turn_will_send_again():
    conv = Conversation(limit=16)
    for name in "abc":
        conv.add(Item(name, "user", audio=_pcm(1.0, 24000), rate=24000))
    conv.forget_audio(2.0)
    assert [bool(i.audio) for i in conv.items] == [False, True, True]
    conv.forget_audio(0.5)
    assert [bool(i.audio) for i in conv.items] == [False, False, True]


def test_a_truncation_cuts_the_transcript_where_the_audio_stopped_at_a_word_end():
    conv = Conversation(limit=16)
    conv.add(Item("x", "assistant", text="one two three four", audio_ms=1000))
    item = conv.truncate("x", 500)
    assert item.text == "one two" and item.audio_ms == 500 and item.status == "incomplete"
    with pytest.raises(RealtimeError):
        conv.truncate("x", 900)  # past what is left
    with pytest.raises(RealtimeError):
        conv.truncate("nope", 1)


def test_the_oldest_items_leave_a_full_conversation():
    conv = Conversation(limit=2)
    for name in "abc":
        conv.add(Item(name, "user", text=name))
    assert [i.id for i in conv.items] == ["b", "c"]
