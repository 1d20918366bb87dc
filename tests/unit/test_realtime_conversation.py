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


def test_each_turn_s_audio_is_resampled_to_the_engine_s_rate_once_and_sent_at_it(monkeypatch):
    """A 24 kHz session before a 16 kHz engine: a turn's audio is resampled when the first response after it
    starts and kept, so later turns send the same WAV at 16 kHz (the media steps pass it with a header's
    probe) instead of resampling the whole conversation's audio again at every turn."""
    import asyncio

    from gateway.realtime import conversation

    calls: list[int] = []
    real = conversation.resampled

    def counted(pcm: bytes, rate: int, out_rate: int) -> bytes:
        calls.append(len(pcm))
        return real(pcm, rate, out_rate)

    monkeypatch.setattr(conversation, "resampled", counted)
    cfg = SessionConfig(model="m")
    conv = Conversation(limit=16)
    tone = b"".join(struct.pack("<h", (i * 97) % 20000 - 10000) for i in range(24000))
    conv.add(Item("a", "user", audio=tone, rate=24000))
    asyncio.run(conv.resample(16000))
    conv.add(Item("b", "assistant", text="first answer"))
    conv.add(Item("c", "user", audio=tone[:24000], rate=24000))
    asyncio.run(conv.resample(16000))
    assert calls == [len(tone), 24000]  # each item once, the first not again for the second turn
    req = chat_request(cfg, conv, ["audio"], None, None, engine_rate=16000)
    wavs = [
        base64.b64decode(p.input_audio.data)
        for m in req.messages
        if isinstance(m.content, list)
        for p in m.content
        if p.type == "input_audio"
    ]
    assert [struct.unpack_from("<I", w, 24)[0] for w in wavs] == [16000, 16000]
    # one second and half a second at 16 kHz, give or take the resampler's filter edge
    assert [abs(len(w) - 44 - n) <= 64 for w, n in zip(wavs, (32000, 16000), strict=True)] == [True, True]
    conv.forget_audio(0.5)
    assert conv.items[0].resampled is None  # let go of with the audio it was made from
    # an engine of another rate (a reload): the committed audio is resampled to it, not the kept copy sent
    assert conv.items[2].audio_at(24000) == (conv.items[2].audio, 24000)
