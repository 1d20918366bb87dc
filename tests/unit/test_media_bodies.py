"""The two ends of a media request's body: parsing the client's without a third copy, and writing the
engine's in pieces. Both must give exactly what orjson gives for the whole document."""

from __future__ import annotations

import base64
import os

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.adapters.base import BODY_PIECE, LARGE_STRING, Body, request_body
from gateway.api import body as client_body

B64 = base64.b64encode(os.urandom(3 * (1 << 19))).decode()  # 2 MiB of base64


def _doc(*parts: dict, **extra) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}],
        **extra,
    }


DOCS = {
    "data URI": _doc({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + B64}}),
    "input_audio": _doc({"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}),
    "several": _doc(
        *[
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64[: 200_000 + i]}}
            for i in (0, 4, 8)
        ]
    ),
    "escaped quotes around base64": _doc({"type": "text", "text": 'say \\"' + B64 + '\\" twice'}),
    "text with a long run": _doc({"type": "text", "text": "x" * 1_500_000 + " " + B64[:100_000]}),
    "base64 as a key": {B64[:80_000]: 1, "pad": "y" * 1_200_000},
    "deep": {"a": [[[[[[{"b": B64}]]]]]], "n": [1, 2.5, None, True]},
    "header with params": _doc(
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;rate=16000;base64," + B64}}
    ),
    "non-ASCII text": _doc({"type": "text", "text": "é" * 600_000}, user="ü"),
}


@pytest.mark.parametrize("name", DOCS)
def test_a_parsed_body_is_what_orjson_parses(name):
    raw = orjson.dumps(DOCS[name])
    body = bytearray(raw)
    assert client_body.loads(body) == orjson.loads(raw)
    assert len(body) == 0  # emptied: the parsed strings are the request from here on


def test_a_body_with_escaped_quotes_is_parsed_the_same():
    # A base64 run between an escaped quote and a real one: lifting it would change the string.
    raw = b'{"text": "a \\"' + B64.encode() + b'", "pad": "' + b"z" * (1 << 20) + b'"}'
    assert client_body.loads(bytearray(raw)) == orjson.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + B64.encode() + b'"',  # cut short
        b'{"a": "x"' + B64.encode() + b'"}',  # base64 outside a string
        b'{"a": "' + B64.encode() + b'" "b": 1}' + b" " * (1 << 20),  # missing comma after it
        b'["' + B64.encode() + b'\x01"]',  # a control character in the string
        b'{"a": "' + B64.encode() + b'\xff"}',  # not UTF-8
        b"[" * 2000 + b'"' + B64.encode() + b'"' + b"]" * 2000,  # deeper than orjson parses
    ],
)
def test_an_invalid_body_gets_orjsons_own_error(raw):
    with pytest.raises(orjson.JSONDecodeError) as expected:
        orjson.loads(raw)
    with pytest.raises(orjson.JSONDecodeError) as got:
        client_body.loads(bytearray(raw))
    assert got.value.msg == expected.value.msg


def test_a_small_body_goes_to_orjson_as_it_is():
    body = bytearray(orjson.dumps(_doc()))
    assert client_body.loads(body) == _doc() and len(body) == 0


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(max_size=40),
    run=st.integers(min_value=LARGE_STRING, max_value=LARGE_STRING * 3),
    noise=st.sampled_from(["", '"', "\\", "\\\\", "\n", " ", "é", '\\"']),
    where=st.integers(min_value=0, max_value=LARGE_STRING * 3),
)
def test_any_string_around_a_long_run_parses_as_orjson_parses_it(prefix, run, noise, where):
    payload = B64[:run]
    payload = payload[:where] + noise + payload[where:]
    raw = orjson.dumps({"p": prefix, "pad": "q" * (1 << 20), "s": payload, "t": [prefix, payload]})
    assert client_body.loads(bytearray(raw)) == orjson.loads(raw)


# -- the engine's body --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCS)
def test_the_engine_body_in_pieces_is_orjsons_document(name):
    doc = DOCS[name]
    body = request_body(doc)
    whole = orjson.dumps(doc)
    if isinstance(body, bytes):
        assert body == whole
        return
    assert isinstance(body, Body)
    chunks = list(body.chunks())
    assert b"".join(chunks) == whole
    assert orjson.loads(bytes(body)) == doc
    # No piece is a copy of a whole media string: at most a slice of BODY_PIECE characters, encoded.
    lifted = [p for p in body.pieces if isinstance(p, str)]
    assert lifted and all(len(p) >= LARGE_STRING for p in lifted)
    assert max(len(c) for c in chunks) <= max(
        6 * BODY_PIECE, *(len(p) for p in body.pieces if isinstance(p, bytes))
    )


def test_a_text_request_is_one_orjson_body():
    doc = _doc()
    assert request_body(doc) == orjson.dumps(doc)


def test_the_pieces_are_the_requests_own_strings():
    doc = DOCS["input_audio"]
    body = request_body(doc)
    assert isinstance(body, Body)
    assert any(p is doc["messages"][0]["content"][1]["input_audio"]["data"] for p in body.pieces)
