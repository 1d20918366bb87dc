"""A request body nests at most ``MAX_JSON_DEPTH`` levels of objects and arrays; deeper is a 400, never a 500.

A tool's parameters or a ``response_format`` schema nested a few hundred levels deep went through
validation and then hit the serialisers' recursion limits on the way to the engine (a 500). The
depth is now judged on the parsed body, before any recursive code reads it, on both body readers:
the in-memory one and the one that spools large media as it arrives.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from core.errors import InvalidRequest
from core.schemas import MAX_JSON_DEPTH
from gateway.api import body as json_body
from gateway.api.chat import _parse
from tests.conftest import TEXT_MODEL

pytestmark = pytest.mark.timeout(60)


def deep(levels: int) -> dict[str, Any]:
    """An object ``levels`` objects deep (1: ``{}``)."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def with_tool(parameters_levels: int) -> dict[str, Any]:
    # body (1) > tools (2) > the tool (3) > function (4) > parameters (5 ...)
    return {
        "model": TEXT_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": deep(parameters_levels)}}],
    }


def with_schema(schema_levels: int) -> dict[str, Any]:
    # body (1) > response_format (2) > json_schema (3) > schema (4 ...)
    return {
        "model": TEXT_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": deep(schema_levels)},
        },
    }


def with_content(levels: int) -> dict[str, Any]:
    # body (1) > messages (2) > the message (3) > content (4) > the part (5) > text (6 ...)
    return {
        "model": TEXT_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": deep(levels)}]}],
    }


def _post(gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=20)


def _is_depth_error(resp: httpx.Response, param_prefix: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"].startswith(param_prefix), err
    assert str(MAX_JSON_DEPTH) in err["message"] and "nest" in err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        (with_tool(300), "tools.0.function.parameters"),
        (with_schema(300), "response_format.json_schema.schema"),
        (with_content(300), "messages.0.content.0"),
    ],
    ids=["tool", "response_format", "content"],
)
def test_300_levels_deep_is_a_400_naming_the_field(ups, gateway, body, param):
    _is_depth_error(_post(gateway, body), param)
    assert ups.vllm.stats()["requests"] == 0  # refused before any engine was asked


@pytest.mark.parametrize("stream", [False, True])
def test_one_level_past_the_limit_is_refused_and_the_limit_itself_passes(ups, gateway, stream):
    past = {**with_tool(MAX_JSON_DEPTH - 3), "stream": stream}
    _is_depth_error(_post(gateway, past), "tools.0.function.parameters")
    at = {**with_tool(MAX_JSON_DEPTH - 4), "stream": stream}
    resp = _post(gateway, at)
    assert resp.status_code == 200, resp.text
    # The engine got the tool as the client wrote it, all its levels.
    sent = ups.vllm.requests[-1]["tools"][0]["function"]["parameters"]
    assert sent == deep(MAX_JSON_DEPTH - 4)


def test_a_schema_at_the_limit_reaches_the_engine(ups, gateway):
    resp = _post(gateway, with_schema(MAX_JSON_DEPTH - 3))
    assert resp.status_code == 200, resp.text
    assert ups.vllm.requests[-1]["response_format"]["json_schema"]["schema"] == deep(MAX_JSON_DEPTH - 3)


def _spooled_reader(body: dict[str, Any]) -> json_body.Reader:
    """``body`` with an image part large enough for the reader to spool it as it arrives."""
    payload = base64.b64encode(b"\x89PNG" + bytes(400_000)).decode()
    body = {**body, "messages": [*body["messages"], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}]}]}  # fmt: skip
    raw = json.dumps(body).encode()  # orjson's writer stops at 254 levels: the client's bytes need not
    reader = json_body.Reader()
    for i in range(0, len(raw), 65536):
        reader.feed(raw[i : i + 65536])
    assert reader.spooled, "the payload was meant to take the spooling path"
    return reader


@pytest.mark.parametrize(
    "body, param",
    [
        (with_tool(300), "tools.0.function.parameters"),
        (with_schema(300), "response_format.json_schema.schema"),
    ],
    ids=["tool", "response_format"],
)
def test_the_spooling_reader_refuses_the_same_depth(body, param):
    reader = _spooled_reader(body)
    with pytest.raises(InvalidRequest) as caught:
        _parse(reader)
    assert caught.value.param is not None and caught.value.param.startswith(param)
    assert caught.value.status == 400


def test_the_spooling_reader_passes_the_limit():
    reader = _spooled_reader(with_tool(MAX_JSON_DEPTH - 4))
    chat = _parse(reader)
    assert chat.tools is not None and chat.tools[0].function.parameters == deep(MAX_JSON_DEPTH - 4)
    assert not isinstance(chat.messages[-1].content, str)


def test_the_in_memory_reader_refuses_a_body_deeper_than_orjson_reads_as_a_400():
    # Past orjson's own limit (1024) the JSON reader refuses it: still a 400, as invalid JSON.
    raw = bytearray(b'{"model":"m","messages":' + b"[" * 2000 + b"]" * 2000 + b"}")
    with pytest.raises(InvalidRequest) as caught:
        _parse(raw)
    assert caught.value.status == 400
