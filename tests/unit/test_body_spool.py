"""The body read as it arrives: long base64 payloads decoded into the spool, the rest exactly orjson's.

A spooled payload must be indistinguishable from the client's string wherever the request is looked
at as JSON (the document, the engine body, the audit record), must never be a client's choice (only a
media part's payload is spooled) and must not outlive the request (nor a killed gateway).
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import spooled
from core.schemas import ChatCompletionRequest
from core.spooled import SpooledMedia
from engines.adapters.base import Body, request_body, whole_strings, wire_messages
from gateway.api import body as client_body

RAW = os.urandom(3 * (1 << 19) + 2)  # decodes from 2 MiB of base64 with padding
B64 = base64.b64encode(RAW).decode()


def _doc(*parts: dict, **extra) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}],
        **extra,
    }


def _audio(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _url(kind: str, url: str) -> dict:
    return {"type": kind, kind: {"url": url}}


def _read(raw: bytes, chunk: int = 65536, spool: bool = True) -> tuple[object, client_body.Reader]:
    reader = client_body.Reader(spool=spool)
    for i in range(0, len(raw), chunk):
        reader.feed(raw[i : i + chunk])
    return reader.result(), reader


def _as_sent(value: object) -> object:
    """The document with every spooled payload as the client's string."""
    if isinstance(value, SpooledMedia):
        return value.text()
    if isinstance(value, dict):
        return {k: _as_sent(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_sent(v) for v in value]
    return value


def _files() -> set[str]:
    """This process's spool files (others' tests may be spooling at the same time)."""
    return {f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{os.getpid()}-")}


DOCS = {
    "input_audio": _doc(_audio(B64)),
    "data URI": _doc(_url("audio_url", "data:audio/wav;base64," + B64)),
    "header with params": _doc(_url("video_url", "data:video/mp4;codecs=avc1;base64," + B64)),
    "several": _doc(
        *[_url("image_url", "data:image/png;base64," + B64[: (1 << 20) + 4 * i]) for i in range(3)]
    ),
    "small and large": _doc(_url("image_url", "data:image/png;base64," + B64[:4000]), _audio(B64)),
}


@pytest.mark.parametrize("name", DOCS)
@pytest.mark.parametrize("chunk", [7, 65536, 1 << 22])
def test_a_read_body_is_what_orjson_parses(name, chunk):
    raw = orjson.dumps(DOCS[name])
    doc, reader = _read(raw, chunk)
    assert _as_sent(doc) == orjson.loads(raw)
    assert reader.spooled  # every one of these has a payload of 1 MiB or more


def test_a_body_trickled_a_byte_at_a_time_reads_the_same():
    raw = orjson.dumps(DOCS["data URI"])
    doc, reader = _read(raw, 1)
    assert _as_sent(doc) == orjson.loads(raw) and len(reader.spooled) == 1


def test_a_spooled_payload_is_the_parts_bytes_and_no_string_of_it():
    doc, _reader = _read(orjson.dumps(DOCS["small and large"]))
    parts = doc["messages"][0]["content"]
    assert isinstance(parts[1]["image_url"]["url"], str)  # small: an ordinary string
    media = parts[2]["input_audio"]["data"]
    assert isinstance(media, SpooledMedia)
    assert media.read() == RAW and media.size == len(RAW) and media.header == ""
    assert len(media) == len(B64) and media.text() == B64
    assert os.path.getsize(os.path.join(spooled.SHM_DIR, media.name)) == len(RAW)


def test_a_data_uri_keeps_its_header():
    doc, _ = _read(orjson.dumps(DOCS["header with params"]))
    media = doc["messages"][0]["content"][1]["video_url"]["url"]
    assert media.header == "data:video/mp4;codecs=avc1;base64," and media.read() == RAW


@pytest.mark.parametrize(
    "doc",
    [
        # an escape inside the payload (PHP's json_encode writes "\/"): read as an ordinary string
        _doc(_audio(B64[: 1 << 21].replace("/", "\\/", 1) + B64[1 << 21 :])),
        _doc(_audio(B64[: (1 << 20) + 8] + "\\/" + B64[(1 << 20) + 8 :])),
        # a character outside the alphabet, past the point where spooling began
        _doc(_audio(B64[: 1 << 21] + "!" + B64[1 << 21 :])),
        _doc(_audio(B64[: 1 << 21] + " " + B64[1 << 21 :])),
        # padding before the end
        _doc(_audio(B64[: 1 << 21] + "==" + B64[1 << 21 :])),
        _doc(_audio(B64[: (1 << 21) + 2] + "==AAAA")),
        # a length that is not whole groups
        _doc(_audio(B64[:-1])),
        # plain base64 in a URL field: a malformed URL, refused as such later, never a payload
        _doc(_url("image_url", B64)),
        # a data URI in a text part or another field: not media, left a string
        _doc({"type": "text", "text": "data:image/png;base64," + B64}),
        {"model": "m", "messages": [], "user": B64},
        # a header too long or with a character a header cannot have
        _doc(_url("image_url", "data:" + "a" * 600 + ";base64," + B64)),
        _doc(_url("image_url", 'data:image/png;x="y";base64,' + B64)),
    ],
    ids=lambda d: str(len(orjson.dumps(d)) % 97),
)
def test_anything_but_a_media_payload_is_read_as_sent(doc):
    raw = orjson.dumps(doc)
    before = _files()
    got, reader = _read(raw)
    assert got == orjson.loads(raw)
    assert not reader.spooled
    del reader
    assert _files() <= before  # whatever was written for it is gone


@pytest.mark.parametrize("kind", [["input_audio"], {"a": 1}, 7, None])
def test_a_part_whose_type_is_not_a_string_is_left_for_validation(kind):
    # A spooled payload is placed by its part's type; a type that is a list or an object (unhashable)
    # must not break the placing: the body reads as sent (here the reader keeps the strings, as for any
    # payload it cannot place), and validation refuses the part.
    doc = _doc({"type": kind, "input_audio": {"data": B64, "format": "wav"}}, _audio(B64))
    got, _reader = _read(orjson.dumps(doc))
    assert _as_sent(got) == doc


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "'
        + B64.encode(),  # cut short inside the payload
        orjson.dumps(DOCS["input_audio"])[:-1],  # cut short after it
        orjson.dumps(DOCS["input_audio"]).replace(b'"format"', b'"format" "x"'),  # broken after it
        b"[" + orjson.dumps(DOCS["input_audio"]) + b'"',
    ],
)
def test_an_invalid_body_with_a_payload_gets_orjsons_own_error(raw):
    with pytest.raises(orjson.JSONDecodeError) as expected:
        orjson.loads(raw)
    before = _files()
    reader = client_body.Reader()
    for i in range(0, len(raw), 65536):
        reader.feed(raw[i : i + 65536])
    with pytest.raises(orjson.JSONDecodeError) as got:
        reader.result()
    assert got.value.msg == expected.value.msg
    del reader, got
    assert _files() <= before


@settings(max_examples=25, deadline=None)
@given(
    cut=st.integers(min_value=1, max_value=70000),
    noise=st.sampled_from(["", '"', "\\\\", "\\n", "=", "==", "A=", "é", "\\u0041"]),
    where=st.integers(min_value=0, max_value=len(B64)),
    field=st.sampled_from(["input_audio", "image_url", "text"]),
)
def test_any_payload_reads_as_orjson_parses_it(cut, noise, where, field):
    payload = B64[:where] + noise + B64[where:]
    part = (
        _audio(payload)
        if field == "input_audio"
        else {"type": "text", "text": payload}
        if field == "text"
        else _url(field, "data:image/png;base64," + payload)
    )
    raw = orjson.dumps(_doc(part))
    doc, _ = _read(raw, cut)
    assert _as_sent(doc) == orjson.loads(raw)


def test_without_a_shared_memory_file_system_the_body_is_read_in_memory(monkeypatch):
    monkeypatch.setattr(spooled, "SHM_DIR", "/nonexistent-omnigate")
    raw = orjson.dumps(DOCS["input_audio"])
    doc, reader = _read(raw)
    assert doc == orjson.loads(raw) and not reader.spooled


def test_a_full_file_system_mid_payload_falls_back_to_memory(monkeypatch):
    calls = {"n": 0}
    real = os.posix_fallocate

    def fallocate(fd: int, at: int, n: int) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(28, "No space left on device")
        real(fd, at, n)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    raw = orjson.dumps(DOCS["input_audio"])
    before = _files()
    doc, reader = _read(raw)
    assert calls["n"] > 1  # it did run out
    assert doc == orjson.loads(raw) and not reader.spooled
    assert _files() <= before


def test_the_file_goes_with_the_last_reference():
    before = _files()
    doc, reader = _read(orjson.dumps(DOCS["several"]))
    assert len(_files() - before) == 3
    request = ChatCompletionRequest.model_validate(doc)
    del doc, reader
    assert len(_files() - before) == 3  # the request holds them
    del request
    assert _files() <= before


def test_a_killed_process_leaves_no_file():
    # The resource tracker unlinks what a process registered and did not unregister.
    code = (
        "import os, sys, signal\n"
        "from core.spooled import SpoolWriter\n"
        "w = SpoolWriter(); w.write(b'x' * 4096); m = w.finish('', 4)\n"
        "print(m.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    name = proc.stdout.strip()
    assert name.startswith("omnigate-")
    path = os.path.join(spooled.SHM_DIR, name)
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path)


def test_a_spooled_part_validates_only_as_a_media_payload():
    doc, _ = _read(orjson.dumps(DOCS["input_audio"]))
    request = ChatCompletionRequest.model_validate(doc)
    media = request.messages[0].content[1].input_audio.data
    assert isinstance(media, SpooledMedia)
    # JSON (the audit record's raw mode, any dump) says the client's string; Python mode keeps the file.
    dumped = request.model_dump(mode="json")
    assert dumped["messages"][0]["content"][1]["input_audio"]["data"] == B64
    assert request.messages[0].wire()["content"][1]["input_audio"]["data"] is media
    with pytest.raises(TypeError):
        __import__("pickle").dumps(media)
    # the OpenAPI schema shows a string, once
    schema = ChatCompletionRequest.model_json_schema()["$defs"]["InputAudio"]["properties"]["data"]
    assert schema == {"minLength": 1, "title": "Data", "type": "string"}


def test_the_engine_body_streams_a_spooled_payload_as_the_client_sent_it():
    raw = orjson.dumps(DOCS["small and large"])
    doc, _ = _read(raw)
    request = ChatCompletionRequest.model_validate(doc)
    wire = {"model": "m", "messages": wire_messages(request)}
    body = request_body(wire)
    assert isinstance(body, Body)
    assert orjson.loads(bytes(body))["messages"] == orjson.loads(raw)["messages"]
    # never the payload whole: its pieces are at most the spool's re-encoding unit
    assert max(len(c) for c in body.chunks()) < len(B64) // 2
    # a library that takes messages gets the one string it needs
    assert whole_strings(wire["messages"])[0]["content"][2]["input_audio"]["data"] == B64
