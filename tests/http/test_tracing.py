"""OpenTelemetry traces as a collector receives them (an OTLP/HTTP receiver in the test, tests/otlp.py).

Two scripted vLLM engines for one model, the first failing before its headers (so the request fails over),
the default chain, the SQLite audit trail on. A streamed request that carries a client's ``traceparent``
is one trace: the request span under the client's span, admission, a guard span per policy that ran, two
engine attempts as siblings (the first an error), the audit commit; the engine that answered received a
``traceparent`` naming its attempt's span. With ``client_context: link`` the request starts a new trace
linked to the client's span; with tracing off nothing is exported and the engine gets no ``traceparent``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from tests.harness import GatewayServer, ServeProcess, wait_until
from tests.media import data_uri, plain_image, png
from tests.otlp import GrpcReceiver, Receiver, Span
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(90)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def engines(bg):
    bad = ScriptedUpstream(Script(flavour="vllm", fault="500_before_headers"))
    good = ScriptedUpstream(Script(flavour="vllm", text="traced answer"))
    for up in (bad, good):
        bg.run(up.start())
    yield bad, good
    for up in (bad, good):
        bg.run(up.stop())


@pytest.fixture(scope="module")
def receiver(bg):
    r = bg.run(Receiver().start())
    yield r
    bg.run(r.stop())


def _settings(bad: ScriptedUpstream, good: ScriptedUpstream, tmp_path, **tracing) -> Settings:
    return Settings(
        engines=[
            EngineConfig(
                name=name,
                kind="vllm",
                base_url=up.base_url,
                model="m",
                serves=["m"],
                role=role,
                first_byte_timeout_s=5,
                read_timeout_s=5,
                input_modalities=["text", "image"],
            )
            for name, up, role in (("bad", bad, "primary"), ("good", good, "fallback"))
        ],
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        audit={"enabled": True, "sqlite_path": str(tmp_path / "audit.db")},
        tracing=tracing,
    )


@pytest.fixture
def serve(bg, engines, monkeypatch, tmp_path):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not the SDK's 5 s
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    started: list[GatewayServer] = []

    def start(**tracing) -> GatewayServer:
        for up in engines:
            up.reset_stats()
        server = GatewayServer(bg, _settings(*engines, tmp_path, **tracing)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _stream(server: GatewayServer, headers: dict[str, str]) -> str:
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=BODY, headers=headers) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "traced" in text and "data: [DONE]" in text
    return text


def _wait_for(receiver: Receiver, trace_id: str, name: str, timeout: float = 10) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.of_trace(trace_id)
        if any(s.name == name for s in spans):
            return spans
        time.sleep(0.05)
    raise AssertionError(f"no {name!r} span in trace {trace_id}: {[s.name for s in receiver.spans]}")


def test_a_streamed_request_is_one_trace_from_the_client_into_the_engine(serve, receiver, engines):
    _, good = engines
    server = serve(enabled="on", endpoint=receiver.url)
    _stream(server, {"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    spans = _wait_for(receiver, CLIENT_TRACE, "POST /v1/chat/completions")
    by_name = {s.name: s for s in spans}
    request = by_name["POST /v1/chat/completions"]
    assert request.parent_span_id == CLIENT_SPAN  # the client's trace continues
    assert request.resource["service.name"] == "omnigate"
    attrs = request.attributes
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.usage.output_tokens"] > 0 and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.request.stream"] is True and attrs["gen_ai.response.time_to_first_chunk"] > 0
    assert attrs["omnigate.outcome"] == "served" and attrs["omnigate.engine"] == "good"
    assert attrs["omnigate.attempts"] == 2 and attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"] and attrs["omnigate.finish_reason"] == "stop"

    children = [s for s in spans if s.parent_span_id == request.span_id]
    names = sorted(s.name for s in children)
    assert names.count("chat m") == 2, names  # the failed attempt and the failover, siblings
    assert "admission" in names and "audit commit" in names
    guards = [s for s in children if s.name.startswith("apply_guardrail ")]
    assert {g.attributes["omnigate.policy.name"] for g in guards} >= {"load-shedding", "request-limits"}
    for g in guards:
        (event,) = g.events
        assert event[0] == "gen_ai.evaluation.result"
        assert event[1]["gen_ai.evaluation.name"] == g.attributes["omnigate.policy.name"]
        assert event[1]["gen_ai.evaluation.score.label"] == g.attributes["omnigate.policy.verdict"]

    first, second = sorted((s for s in children if s.name == "chat m"), key=lambda s: s.start_ns)
    assert first.attributes["omnigate.engine"] == "bad" and first.status == 2  # STATUS_CODE_ERROR
    assert second.attributes["omnigate.engine"] == "good" and second.status != 2
    assert second.attributes["gen_ai.provider.name"] == "vllm"
    # The engine that answered got its attempt's span as parent: vLLM's own spans join this trace.
    (sent,) = [h for h in good.headers if "traceparent" in h]
    assert sent["traceparent"].split("-")[1:3] == [CLIENT_TRACE, second.span_id]
    # The latency histograms' exemplars link their buckets to this trace (in the OpenMetrics format).
    openmetrics = {"accept": "application/openmetrics-text; version=1.0.0"}
    scraped = httpx.get(server.url + "/metrics", headers=openmetrics).text
    exemplars = [ln for ln in scraped.splitlines() if f'trace_id="{CLIENT_TRACE}"' in ln]
    assert any(ln.startswith("omnigate_request_duration_seconds_bucket") for ln in exemplars), exemplars[:3]
    audit = by_name["audit commit"]
    assert audit.attributes["omnigate.audit.seq"] >= 1
    assert request.start_ns <= audit.start_ns and audit.end_ns <= request.end_ns


def test_an_untrusted_client_trace_is_linked_not_continued(serve, receiver):
    server = serve(enabled="on", endpoint=receiver.url, client_context="link")
    other = "0af7651916cd43dd8448eb211c80319c"
    _stream(server, {"traceparent": f"00-{other}-b7ad6b7169203331-01"})
    deadline = time.monotonic() + 10
    mine: list[Span] = []
    while time.monotonic() < deadline and not mine:
        mine = [s for s in receiver.spans if (other, "b7ad6b7169203331") in s.links]
        time.sleep(0.05)
    (request,) = mine
    assert request.name == "POST /v1/chat/completions"
    assert request.trace_id != other and request.parent_span_id == ""  # a new root, linked
    assert not receiver.of_trace(other)


def test_tracing_off_exports_nothing_and_sends_no_traceparent(serve, receiver, engines):
    _, good = engines
    before = len(receiver.spans)
    server = serve(enabled="off", endpoint=receiver.url)
    assert server.services.tracing is None
    _stream(server, {"traceparent": TRACEPARENT})
    time.sleep(0.3)
    assert len(receiver.spans) == before
    assert good.headers and all("traceparent" not in h for h in good.headers)


def test_the_standard_otel_variables_configure_it(serve, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "omnigate-eu1")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    server = serve()  # tracing: auto
    assert server.services.tracing is not None
    trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    _stream(server, {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
    spans = _wait_for(receiver, trace, "POST /v1/chat/completions")
    assert {s.resource["service.name"] for s in spans} == {"omnigate-eu1"}
    assert {s.resource["deployment.environment"] for s in spans} == {"test"}


def test_otel_sdk_disabled_turns_it_off(serve, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert serve().services.tracing is None


def test_a_whole_answer_with_an_image_counts_it_on_its_span(serve, receiver):
    server = serve(enabled="on", endpoint=receiver.url)
    trace = "7bf92f3577b34da6a3ce929d0e0e4738"
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(64)))}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}],
    }
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    spans = _wait_for(receiver, trace, "POST /v1/chat/completions")
    request = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert request.attributes["omnigate.usage.input_images"] == 1
    assert request.attributes["gen_ai.request.stream"] is False
    screen = next(s for s in spans if s.name == "apply_guardrail nsfw-screen")
    assert screen.attributes["omnigate.policy.verdict"] == "accept"
    # the image decoded in the media sandbox: once by media-limits, once for the screen's view of it
    decodes = [s for s in spans if s.name == "media decode"]
    assert len(decodes) >= 2 and {d.parent_span_id for d in decodes} == {request.span_id}
    assert {d.attributes["omnigate.media.part"] for d in decodes} == {"messages.0.content.1.image_url.url"}


def test_a_sample_ratio_of_zero_keeps_only_the_clients_sampled_traces(serve, receiver):
    server = serve(enabled="on", endpoint=receiver.url, sample_ratio=0.0)
    before = len(receiver.spans)
    _stream(server, {})  # a new root: not sampled, nothing exported
    kept = "8bf92f3577b34da6a3ce929d0e0e4739"
    _stream(server, {"traceparent": f"00-{kept}-{CLIENT_SPAN}-01"})  # the client sampled it: parent-based
    _wait_for(receiver, kept, "POST /v1/chat/completions")
    time.sleep(0.3)
    assert {s.trace_id for s in receiver.spans[before:]} == {kept}


def test_omnigate_serve_set_up_by_the_otel_variables_logs_each_requests_trace(
    engines, receiver, tmp_path, monkeypatch
):
    """The shape users run: ``omnigate serve`` configured by the OTEL_* variables alone, JSON log lines."""
    _, good = engines
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "omnigate-proc")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    config = tmp_path / "omnigate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {"name": "good", "kind": "vllm", "base_url": good.base_url, "model": "m", "serves": ["m"]}
                ],
                "auth": {"required": False},
                "audit": {"sqlite_path": str(tmp_path / "audit.db")},
                "routing": {"controller": {"enabled": False}},
            }
        )
    )
    proc = ServeProcess(config, tmp_path / "gateway.log")
    try:
        assert wait_until(proc.ready, timeout=60)
        trace = "9bf92f3577b34da6a3ce929d0e0e4740"
        url = proc.url + "/v1/chat/completions"
        headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=BODY, headers=headers) as r:
            assert r.status_code == 200
            "".join(r.iter_text())
        spans = _wait_for(receiver, trace, "POST /v1/chat/completions")
    finally:
        proc.stop()
    request = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert request.resource["service.name"] == "omnigate-proc"
    lines = [json.loads(ln) for ln in proc.log_path.read_text().splitlines() if ln.startswith("{")]
    (finished,) = [ln for ln in lines if ln.get("event") == "request_finished"]
    assert (finished["trace_id"], finished["span_id"]) == (trace, request.span_id)


def test_otlp_over_grpc(bg, serve):
    grpc_receiver = bg.run(GrpcReceiver().start())
    try:
        server = serve(enabled="on", endpoint=grpc_receiver.endpoint, protocol="grpc")
        trace = "abf92f3577b34da6a3ce929d0e0e4741"
        _stream(server, {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
        spans = _wait_for(grpc_receiver, trace, "POST /v1/chat/completions")
    finally:
        bg.run(grpc_receiver.stop())
    assert {"admission", "chat m", "audit commit"} <= {s.name for s in spans}
