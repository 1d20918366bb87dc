"""Fuzzing: schema-driven cases against the served OpenAPI schema, and property tests of the request parser.

No input may produce a 5xx; every refusal is an OpenAI-shaped 4xx naming its field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.common import free_port, rss_kib
from core.errors import InvalidRequest
from gateway.api.chat import _parse
from tests.conftest import TEXT_MODEL

pytestmark = pytest.mark.timeout(600)

CASES = int(os.environ.get("OMNIGATE_FUZZ_CASES", "1000"))
PARSER_EXAMPLES = int(os.environ.get("OMNIGATE_PARSER_EXAMPLES", "3000"))


def _assert_openai_error(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["message"]


@pytest.fixture(scope="module")
def gateway_process(upstreams, tmp_path_factory):
    """omnigate as its own process, so its memory is measured alone."""
    port = free_port()
    cfg = tmp_path_factory.mktemp("fuzz") / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {
                        "name": "text-vllm",
                        "kind": "vllm",
                        "base_url": upstreams.vllm.base_url,
                        "model": "scripted",
                        "serves": [TEXT_MODEL],
                    }
                ],
                "logging": {"level": "warning"},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield proc, url
    proc.terminate()
    proc.wait(15)


def test_schema_driven_cases_never_5xx(gateway_process, ups, figures):
    proc, url = gateway_process
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operation = schema["/v1/chat/completions"]["POST"]
    seen = {"cases": 0, "ok": 0}
    statuses: Counter[int] = Counter()
    started = time.monotonic()

    with httpx.Client(base_url=url, timeout=20) as http:
        for _ in range(20):  # warm the process up before taking the baseline
            http.post(
                "/v1/chat/completions",
                json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "x"}]},
            )
        rss_before = rss_kib(proc.pid)

        @settings(max_examples=CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case) -> None:
            body = case.body
            # Mostly well-formed requests reach the scripted engine; the rest probe refusals.
            if isinstance(body, dict) and body.get("messages") and isinstance(body.get("model"), str):
                body = {**body, "model": TEXT_MODEL}
            content = b"" if type(body).__name__ == "NotSet" else json.dumps(body).encode()
            resp = http.post(
                "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
            )
            seen["cases"] += 1
            seen["ok"] += resp.status_code == 200
            statuses[resp.status_code] += 1
            _assert_openai_error(resp)

        check()
    growth_mib = (rss_kib(proc.pid) - rss_before) / 1024
    figures(
        cases=seen["cases"],
        statuses=dict(sorted(statuses.items())),
        rss_growth_mib=growth_mib,
        seconds=time.monotonic() - started,
    )
    assert seen["cases"] >= CASES
    assert seen["ok"] > 0  # the generator did reach the engine, not only refusals
    assert growth_mib < 50


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "audio_url", "video_url", "bogus"])},
    optional={
        "text": json_values,
        "image_url": json_values,
        "input_audio": json_values,
        "audio_url": json_values,
        "video_url": json_values,
    },
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard"])},
    optional={"content": st.one_of(st.text(max_size=50), st.lists(part, max_size=4), json_values)},
)
request_doc = st.fixed_dictionaries(
    {"model": st.one_of(st.text(max_size=30), json_values)},
    optional={
        "messages": st.one_of(st.lists(message, max_size=4), json_values),
        "stream": json_values,
        "modalities": json_values,
        "audio": json_values,
        "max_tokens": json_values,
        "temperature": json_values,
        "top_p": json_values,
        "stop": json_values,
        "n": json_values,
        "stream_options": json_values,
        "chat_template_kwargs": json_values,
    },
)


# Well-formed requests (every field in range), so acceptance is exercised as much as refusal.
url = st.sampled_from(
    ["https://example.com/a.png", "data:image/png;base64,iVBORw0KGgo=", "http://10.0.0.1/x.mp4"]
)
valid_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": url})}),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {"data": st.text(min_size=1, max_size=40), "format": st.sampled_from(["wav", "mp3"])}
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.just("audio_url"), "audio_url": st.fixed_dictionaries({"url": url})}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": url})}),
)
_content = st.one_of(st.text(max_size=50), st.lists(valid_part, min_size=1, max_size=3))
valid_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": _content,
        }
    ),
    # A tool message answers a call, as OpenAI requires.
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": _content, "tool_call_id": st.text(min_size=1, max_size=20)}
    ),
)
valid_doc = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=30), "messages": st.lists(valid_message, min_size=1, max_size=4)},
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 1 << 20),
        "temperature": st.floats(0.0, 2.0),
        "top_p": st.floats(0.01, 1.0),
        "stop": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=10), max_size=4)),
        "modalities": st.sampled_from([["text"], ["text", "audio"]]),
        "audio": st.fixed_dictionaries(
            {
                "voice": st.sampled_from(["Chelsie", "Ethan"]),
                "format": st.sampled_from(["wav", "mp3", "pcm16"]),
            }
        ),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "seed": st.integers(-(1 << 31), 1 << 31),
    },
)


def test_parser_accepts_or_names_the_field(figures):
    seen = Counter()

    @settings(max_examples=PARSER_EXAMPLES, deadline=None, database=None)
    @given(doc=st.one_of(request_doc, valid_doc, json_values))
    def check(doc) -> None:
        try:
            parsed = _parse(json.dumps(doc).encode())
        except InvalidRequest as exc:
            seen["refused"] += 1
            assert exc.status == 400 and exc.message
            err = exc.to_dict()["error"]
            assert err["type"] == "invalid_request_error"
            return
        seen["accepted"] += 1
        assert parsed.messages and parsed.model

    check()
    figures(examples=seen.total(), **seen)
    assert seen.total() >= PARSER_EXAMPLES


def test_parser_survives_arbitrary_bytes(figures):
    seen = Counter()

    @settings(max_examples=PARSER_EXAMPLES // 3, deadline=None, database=None)
    @given(raw=st.binary(max_size=200))
    def check(raw) -> None:
        try:
            _parse(raw)
            seen["accepted"] += 1
        except InvalidRequest:
            seen["refused"] += 1

    check()
    figures(examples=seen.total(), **seen)


def test_well_formed_requests_are_accepted(figures):
    seen = Counter()

    @settings(max_examples=PARSER_EXAMPLES // 3, deadline=None, database=None)
    @given(doc=valid_doc)
    def check(doc) -> None:
        parsed = _parse(json.dumps(doc).encode())
        assert parsed.model == doc["model"] and len(parsed.messages) == len(doc["messages"])
        seen["accepted"] += 1

    check()
    figures(examples=seen.total(), **seen)
