"""The grounding guard end to end: the official openai SDK, a real gateway, the scripted engines.

The scorer is the real fallback scorer (all-MiniLM-L6-v2 from its package plus
the fact checks). The first scripted answer contradicts the premise (a wrong
year), the second is supported.
"""

from __future__ import annotations

import base64
import re
import secrets

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from policies.grounding.policy import DEFAULT_INSTRUCTION
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)
ADMIN_KEY = secrets.token_hex(32)
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

CONTEXT = (
    "Use this document. The Eiffel Tower in Paris was completed on 31 March 1889. "
    "It is 330 metres tall and was built by the company of Gustave Eiffel."
)
QUESTION = "When was the Eiffel Tower completed and how tall is it?"
WRONG = "The Eiffel Tower was completed in 1925. It is 330 metres tall."
RIGHT = "The Eiffel Tower was completed on 31 March 1889. It is 330 metres tall."
WRONG_TWICE = "The Eiffel Tower was completed in 1925. It is 400 metres tall."
VAGUE = "Many visitors climb tall iron structures like this one every single year."


def _messages() -> list[dict]:
    return [{"role": "system", "content": CONTEXT}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def servers(bg, upstreams):
    made: dict[tuple, GatewayServer] = {}

    def get(mode: str, on_exhausted: str = "flag", max_retries: int = 2) -> GatewayServer:
        key = (mode, on_exhausted, max_retries)
        if key not in made:
            chain = PolicyChainConfig(
                pre=[PolicySpec(name="request-limits")],
                post=[PolicySpec(name="grounding", config={"mode": mode, "on_exhausted": on_exhausted})],
                max_retries=max_retries,
            )
            # /readyz detail is the admin's; the front door itself is tested elsewhere.
            settings = gateway_settings(
                upstreams, chain, admin={"api_key": ADMIN_KEY}, auth={"required": False}
            )
            made[key] = GatewayServer(bg, settings, CollectorRegistry()).start()
        return made[key]

    yield get
    for s in made.values():
        s.stop()


@pytest.fixture
def serve(servers, upstreams):
    def get(*a, **kw) -> tuple[GatewayServer, openai.OpenAI]:
        upstreams.reset()
        server = servers(*a, **kw)
        server.bg.run(server.services.pool.probe_now())
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        return server, client

    return get


def _metric(server: GatewayServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _collect(stream) -> dict:
    out = {"text": "", "audio": b"", "finish": None, "notes": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        extra = chunk.model_extra or {}
        if "omnigate" in extra:
            out["notes"] = extra["omnigate"]
        for choice in chunk.choices:
            if choice.delta.content:
                out["text"] += choice.delta.content
            audio = getattr(choice.delta, "audio", None)
            if audio:
                if isinstance(audio, dict):
                    data, transcript = audio.get("data"), audio.get("transcript")
                else:
                    data, transcript = getattr(audio, "data", None), getattr(audio, "transcript", None)
                if data:
                    out["audio"] += base64.b64decode(data)
                if transcript:
                    out["text"] += transcript
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def _finished_event(logs: list[dict]) -> dict:
    events = [e for e in logs if e.get("event") == "request_finished"]
    assert events, "no request_finished event was logged"
    return events[-1]


def test_readyz_and_startup_event_name_the_active_scorer(serve):
    server, _ = serve("hold")
    body = httpx.get(server.url + "/readyz", headers=ADMIN).json()
    assert body["grounding_scorer"]["kind"] == "fallback"
    assert body["grounding_scorer"]["loaded"] is True
    assert body["policies"]["post"] == ["grounding"]


def test_hold_mode_retries_and_releases_only_the_supported_answer(serve, upstreams):
    server, client = serve("hold")
    upstreams.vllm.enqueue(Script(flavour="vllm", text=WRONG), Script(flavour="vllm", text=RIGHT))
    with capture_logs() as logs:
        raw = client.chat.completions.with_raw_response.create(
            model=TEXT_MODEL, messages=_messages(), stream=True, temperature=0.9
        )
        got = _collect(raw.parse())
    assert got["text"] == RIGHT
    assert "1925" not in got["text"]
    assert got["finish"] == "stop"
    assert got["notes"]["grounding"]["verdict"] == "pass"
    assert got["notes"]["grounding"]["attempt"] == 2
    assert "x-omnigate-grounding" not in raw.headers
    assert "grounding=accept" in raw.headers["x-omnigate-guards"]  # its last verdict, before the release
    # The retry was adjusted: colder, with the grounding instruction first.
    first, second = upstreams.vllm.requests
    assert first["temperature"] == 0.9 and second["temperature"] == 0.0
    assert second["messages"][0] == {"role": "system", "content": DEFAULT_INSTRUCTION}
    assert first["messages"][0]["content"] == CONTEXT
    # The audit record shows each attempt.
    log = _finished_event(logs)
    attempts = log["attempt_log"]
    assert [(a["attempt"], a["verdict"]) for a in attempts] == [(1, "retry"), (2, "accept")]
    assert attempts[0]["score"] == 0.0 and attempts[1]["score"] >= 0.8
    assert log["retries"] == 1 and log["outcome"] == "served"
    # And the metrics.
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="hold", verdict="fail") == 1
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="hold", verdict="pass") == 1
    assert _metric(server, "omnigate_retries_total", policy="grounding") == 1
    assert _metric(server, "omnigate_holdback_wait_seconds_count", mode="hold") >= 1
    assert _metric(server, "omnigate_grounding_scorer_seconds_count", scorer="fallback") >= 2


def test_window_mode_retries_before_the_first_release(serve, upstreams):
    server, client = serve("window")
    upstreams.vllm.enqueue(Script(flavour="vllm", text=WRONG), Script(flavour="vllm", text=RIGHT))
    with capture_logs() as logs:
        got = _collect(
            client.chat.completions.create(
                model=TEXT_MODEL, messages=_messages(), stream=True, temperature=0.7
            )
        )
    assert got["text"] == RIGHT
    assert got["notes"]["grounding"]["mode"] == "window"
    assert got["notes"]["grounding"]["verdict"] == "pass"
    assert upstreams.vllm.request_count == 2
    assert upstreams.vllm.requests[1]["temperature"] == 0.0
    attempts = _finished_event(logs)["attempt_log"]
    assert [(a["attempt"], a["verdict"]) for a in attempts] == [(1, "retry"), (2, "accept")]
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="window", verdict="fail") == 1
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="window", verdict="pass") >= 1
    assert _metric(server, "omnigate_retries_total", policy="grounding") == 1
    assert _metric(server, "omnigate_holdback_wait_seconds_count", mode="window") >= 1


def test_window_mode_releases_sentence_sized_chunks(serve, upstreams):
    _server, client = serve("window")
    upstreams.vllm.default = Script(flavour="vllm", text=RIGHT)
    pieces = []
    for chunk in client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert pieces == ["The Eiffel Tower was completed on 31 March 1889. ", "It is 330 metres tall."]


def test_window_mode_terminates_with_an_error_frame_after_a_release(serve, upstreams):
    server, client = serve("window")
    upstreams.vllm.default = Script(flavour="vllm", text="It is 330 metres tall. It was completed in 1925.")
    text = ""
    with pytest.raises(openai.APIError) as err:
        for chunk in client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
    assert text == "It is 330 metres tall. "
    assert "1925" not in text
    assert "contradicts the evidence" in str(err.value)
    assert upstreams.vllm.request_count == 1  # no retry once something was released
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="window", verdict="terminated") == 1


def test_passthrough_mode_releases_at_once_and_reports_the_verdict_last(serve, upstreams):
    server, client = serve("passthrough")
    upstreams.vllm.enqueue(Script(flavour="vllm", text=WRONG), Script(flavour="vllm", text=RIGHT))
    with capture_logs() as logs:
        got = _collect(
            client.chat.completions.create(
                model=TEXT_MODEL, messages=_messages(), stream=True, stream_options={"include_usage": True}
            )
        )
    # Released as generated: the contradicting answer reaches the client, and the gateway says so.
    assert got["text"] == WRONG
    verdict = got["notes"]["grounding"]
    assert verdict["verdict"] == "fail" and verdict["blocked"] is False and verdict["score"] < 0.8
    assert upstreams.vllm.request_count == 1
    assert _finished_event(logs)["notes"]["grounding"]["verdict"] == "fail"
    assert _metric(server, "omnigate_grounding_verdicts_total", mode="passthrough", verdict="fail") == 1


def test_exhausted_retries_serve_the_best_scoring_answer_flagged(serve, upstreams):
    _server, client = serve("hold", "flag", 1)
    # Both contradict the document (the fallback scores a contradiction 0): of equal scores the later
    # attempt is served (the choice among different scores: tests/unit/test_rounds.py).
    upstreams.vllm.enqueue(Script(flavour="vllm", text=WRONG), Script(flavour="vllm", text=WRONG_TWICE))
    raw = client.chat.completions.with_raw_response.create(
        model=TEXT_MODEL, messages=_messages(), stream=True
    )
    got = _collect(raw.parse())
    assert raw.headers["x-omnigate-grounding"] == "low"
    assert "retries-exhausted" in raw.headers["x-omnigate-degraded"]
    assert got["text"] == WRONG_TWICE
    assert got["notes"]["grounding"]["verdict"] == "low"
    assert got["notes"]["grounding"]["attempt"] == 2
    assert got["notes"]["grounding"]["contradicted"] == 2
    assert upstreams.vllm.request_count == 2


def test_a_vague_answer_is_unverifiable_and_served_without_a_retry(serve, upstreams):
    _server, client = serve("hold")
    # No fact, nothing the document says: the document neither supports nor contradicts it.
    upstreams.vllm.enqueue(Script(flavour="vllm", text=VAGUE), Script(flavour="vllm", text=WRONG))
    raw = client.chat.completions.with_raw_response.create(
        model=TEXT_MODEL, messages=_messages(), stream=True
    )
    got = _collect(raw.parse())
    assert got["text"] == VAGUE
    assert "x-omnigate-grounding" not in raw.headers
    assert got["notes"]["grounding"]["verdict"] == "unverifiable"  # not "pass": nothing was checked
    assert got["notes"]["grounding"]["unverifiable"] == 1
    assert upstreams.vllm.request_count == 1


def test_exhausted_retries_refuse_when_configured(serve, upstreams):
    _server, client = serve("hold", "refuse", 1)
    upstreams.vllm.default = Script(flavour="vllm", text=WRONG)
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True)
    assert err.value.status_code == 422
    assert err.value.body["code"] == "grounding_failed"
    assert "1925" in err.value.body["message"]
    assert upstreams.vllm.request_count == 2
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=TEXT_MODEL, messages=_messages())


def test_non_streaming_retry(serve, upstreams):
    _server, client = serve("hold")
    upstreams.vllm.enqueue(Script(flavour="vllm", text=WRONG), Script(flavour="vllm", text=RIGHT))
    resp = client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), temperature=1.0)
    assert resp.choices[0].message.content == RIGHT
    assert resp.model_extra["omnigate"]["grounding"]["verdict"] == "pass"
    assert [r["temperature"] for r in upstreams.vllm.requests] == [1.0, 0.0]


# --- speech ----------------------------------------------------------------------------------------


def _speech(client, **kw):
    return client.chat.completions.create(
        model=OMNI_MODEL,
        messages=_messages(),
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
        **kw,
    )


def _seconds(pcm: bytes, rate: int = 24000) -> float:
    return len(pcm) / (2 * rate)


def test_hold_mode_releases_no_audio_of_a_failing_answer(serve, upstreams):
    _server, client = serve("hold")
    # The failing first answer speaks 7 chunks, the supported second one 3: only those 3 may arrive.
    upstreams.omni_a.enqueue(
        Script(flavour="omni", text=WRONG, audio_chunks=7),
        Script(flavour="omni", text=RIGHT, audio_chunks=3),
    )
    got = _collect(_speech(client))
    assert got["text"] == RIGHT
    assert _seconds(got["audio"]) == pytest.approx(3 * 0.2)
    assert upstreams.omni_a.request_count == 2


def test_hold_mode_refusal_releases_no_audio_at_all(serve, upstreams):
    server, _client = serve("hold", "refuse", 1)
    upstreams.omni_a.default = Script(flavour="omni", text=WRONG, audio_chunks=5, audio_interleave=1)
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": OMNI_MODEL,
            "messages": _messages(),
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "pcm16"},
        },
    ) as r:
        body = r.read()
    assert r.status_code == 422
    assert b"audio" not in body and b"data:" not in body
    assert upstreams.omni_a.request_count == 2


def test_window_mode_releases_audio_only_within_the_passed_text_bound(serve, upstreams):
    _server, client = serve("window")
    first = "It is 330 metres tall. "
    # Audio arrives interleaved with the text; the second sentence names a wrong year.
    upstreams.omni_a.default = Script(
        flavour="omni",
        text=first + "It was completed in 1925 by the company of Gustave Eiffel.",
        audio_chunks=12,
        audio_seconds_per_chunk=0.2,
        audio_interleave=1,
    )
    got = {"text": "", "audio": b""}
    with pytest.raises(openai.APIError):
        for chunk in _speech(client):
            for choice in chunk.choices:
                audio = getattr(choice.delta, "audio", None)
                if audio:
                    data = audio.get("data") if isinstance(audio, dict) else getattr(audio, "data", None)
                    transcript = (
                        audio.get("transcript")
                        if isinstance(audio, dict)
                        else getattr(audio, "transcript", None)
                    )
                    got["audio"] += base64.b64decode(data) if data else b""
                    got["text"] += transcript or ""
    assert got["text"] == first
    bound = len(first) / 30.0  # passed characters at the fastest speaking rate (30 chars/s)
    released = _seconds(got["audio"])
    assert 0 < released <= bound + 1e-9
    # More audio than the bound had arrived by then (it was held back, then dropped with the stream).
    assert bound < 12 * 0.2


def test_window_mode_speech_passes_whole_when_grounded(serve, upstreams):
    _server, client = serve("window")
    upstreams.omni_a.default = Script(flavour="omni", text=RIGHT, audio_chunks=6, audio_interleave=2)
    got = _collect(_speech(client))
    assert got["text"] == RIGHT
    assert _seconds(got["audio"]) == pytest.approx(6 * 0.2)


def test_a_client_leaving_during_the_hold_aborts_the_upstream(serve, upstreams):
    server, _ = serve("hold")
    upstreams.vllm.default = Script(flavour="vllm", text=RIGHT, chunk_delay_s=0.3)
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            timeout=httpx.Timeout(5, read=0.5),
            json={"model": TEXT_MODEL, "messages": _messages(), "stream": True},
        ) as r,
    ):
        r.read()
    assert wait_until(lambda: upstreams.vllm.aborts == 1, timeout=10)
    assert upstreams.vllm.completed == 0


def test_a_configured_cross_encoder_boots_the_gateway(bg, upstreams, tmp_path):
    from tests.unit.test_grounding_scorer import tiny_cross_encoder

    path = tiny_cross_encoder(tmp_path / "nli", (-4.0, 4.0, -4.0))
    chain = PolicyChainConfig(post=[PolicySpec(name="grounding")])
    settings = gateway_settings(
        upstreams,
        chain,
        grounding={"model": str(path)},
        admin={"api_key": ADMIN_KEY},
        auth={"required": False},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        upstreams.reset()
        ready = httpx.get(server.url + "/readyz", headers=ADMIN).json()
        assert ready["grounding_scorer"]["kind"] == "cross-encoder"
        assert ready["grounding_scorer"]["entailment_label"] == "entailment"
        upstreams.vllm.default = Script(flavour="vllm", text=RIGHT)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            got = _collect(
                client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True)
            )
        assert got["text"] == RIGHT
        assert got["notes"]["grounding"]["scorer"] == "cross-encoder"
    finally:
        server.stop()


def test_shadow_grounding_records_but_never_holds_or_retries(bg, upstreams):
    chain = PolicyChainConfig(post=[PolicySpec(name="grounding", shadow=True, config={"mode": "hold"})])
    server = GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()
    try:
        upstreams.reset()
        upstreams.vllm.default = Script(flavour="vllm", text=WRONG)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            got = _collect(
                client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True)
            )
        assert got["text"] == WRONG
        assert upstreams.vllm.request_count == 1
        assert (
            _metric(
                server,
                "omnigate_policy_decisions_total",
                policy="grounding",
                shadow="true",
                stage="post",
                verdict="retry",
            )
            == 1
        )
    finally:
        server.stop()


def test_window_mode_last_attempt_is_held_whole_and_served_flagged(serve, upstreams):
    _server, client = serve("window", "flag", 1)
    upstreams.vllm.default = Script(flavour="vllm", text=WRONG)
    raw = client.chat.completions.with_raw_response.create(
        model=TEXT_MODEL, messages=_messages(), stream=True
    )
    got = _collect(raw.parse())
    # Attempt 1 was cut at its first failing sentence; attempt 2, the last, was held to its end and served.
    assert raw.headers["x-omnigate-grounding"] == "low"
    assert got["text"] == WRONG
    assert got["notes"]["grounding"]["verdict"] == "low" and got["notes"]["grounding"]["attempt"] == 2
    assert upstreams.vllm.request_count == 2


def test_window_mode_refuses_before_any_release(serve, upstreams):
    _server, client = serve("window", "refuse", 0)
    upstreams.vllm.default = Script(flavour="vllm", text=WRONG)
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model=TEXT_MODEL, messages=_messages(), stream=True)
    assert err.value.body["code"] == "grounding_failed"
    assert upstreams.vllm.request_count == 1


def test_a_failing_scorer_is_a_503_not_an_unjudged_answer(bg, upstreams, tmp_path):
    from tests.unit.test_grounding_scorer import tiny_cross_encoder

    path = tiny_cross_encoder(tmp_path / "overflows", (-4.0, 4.0, -4.0))  # 128 positions, fed 512
    chain = PolicyChainConfig(post=[PolicySpec(name="grounding")])
    server = GatewayServer(
        bg, gateway_settings(upstreams, chain, grounding={"model": str(path)}), CollectorRegistry()
    ).start()
    try:
        upstreams.reset()
        upstreams.vllm.default = Script(flavour="vllm", text=RIGHT)
        long_context = "The Eiffel Tower is 330 metres tall. " * 60
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
            pytest.raises(openai.InternalServerError) as err,
        ):
            client.chat.completions.create(
                model=TEXT_MODEL,
                stream=True,
                messages=[{"role": "system", "content": long_context}, {"role": "user", "content": QUESTION}],
            )
        assert err.value.status_code == 503
        assert err.value.body["code"] == "guard_unavailable"
    finally:
        server.stop()
