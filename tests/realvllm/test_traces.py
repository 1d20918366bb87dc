"""The gateway's trace and the real vLLM's own spans are one trace.

vLLM 0.32 is started for the suite with ``--otlp-traces-endpoint`` at the suite's OTLP receiver
(conftest.py); a gateway with tracing on exports to the same receiver. A streamed request carrying a
client's ``traceparent`` yields the gateway's spans in the client's trace, and vLLM's ``llm_request``
span in that trace too, a child of the gateway's engine attempt (it read the ``traceparent`` the gateway
sent).
"""

from __future__ import annotations

import time

import openai
import pytest
from prometheus_client import CollectorRegistry

from tests.harness import GatewayServer
from tests.otlp import Receiver, Span
from tests.realvllm.conftest import MODEL, real_settings

pytestmark = pytest.mark.timeout(300)

TRACE = "6e0c63257de34c926f9efcd03927272e"
CLIENT_SPAN = "b9c7c989f97918e1"


def _trace(receiver: Receiver, want: set[str], timeout: float = 60) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.of_trace(TRACE)
        if want <= {s.name for s in spans}:
            return spans
        time.sleep(0.2)
    raise AssertionError(
        f"wanted {want} in the trace, got {sorted({s.name for s in receiver.of_trace(TRACE)})}"
    )


def test_vllm_spans_join_the_gateways_trace(bg, vllm, otlp, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    settings = real_settings(
        vllm,
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        tracing={"enabled": "on", "endpoint": otlp.url},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        with openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180
        ) as client:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                stream=True,
                extra_headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"},
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        spans = _trace(otlp, {"POST /v1/chat/completions", "chat smollm2", "llm_request"})
    finally:
        server.stop()
    by_name = {s.name: s for s in spans}
    request, attempt, engine = (
        by_name["POST /v1/chat/completions"],
        by_name["chat smollm2"],
        by_name["llm_request"],
    )
    assert request.parent_span_id == CLIENT_SPAN
    assert attempt.parent_span_id == request.span_id
    # vLLM's span is the engine's side of the gateway's attempt: same trace, the attempt as its parent.
    assert engine.parent_span_id == attempt.span_id
    assert engine.resource.get("service.name") != request.resource.get("service.name")
