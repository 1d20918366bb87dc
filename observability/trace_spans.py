"""A request's spans (:class:`RequestTrace`) and the trace headers of its engine calls.

Made by observability/tracing.py's ``Tracing.start`` for each request while tracing is on; the module
docstring there says which spans there are and what they carry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from core.context import LoadSnapshot

_PROPAGATOR = TraceContextTextMapPropagator()
#: the current engine attempt's ``traceparent`` (and ``tracestate``), read by the adapters' calls
_ENGINE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("omnigate_engine_trace", default=None)


#: the request being served in this task, where tracing is on (steps deep in a policy add their spans to it)
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("omnigate_request_trace", default=None)


def step(
    name: str, seconds: float, attributes: Mapping[str, Any], error: BaseException | None = None
) -> None:
    """A span for a step of the request served in this task that has just ended (e.g. a media decode in
    the sandbox); nothing when the request is not traced."""
    current = _CURRENT.get()
    if current is not None:
        span = current._after(name, seconds, attributes)
        if span is not None and error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))


def engine_headers() -> dict[str, str]:
    """The W3C trace headers for the engine call being made in this task; empty when it is not traced."""
    return _ENGINE_HEADERS.get() or {}


class RequestTrace:
    """One request's spans. Per request, never shared; the pipeline calls it where a step ends."""

    __slots__ = ("_attempt", "_ended", "_parent", "genai", "span", "span_id", "trace_id", "tracer")

    def __init__(self, tracer: Tracer, span: Span, *, genai: bool) -> None:
        self.tracer = tracer
        self.genai = genai
        self.span = span
        sc = span.get_span_context()
        self.trace_id = format(sc.trace_id, "032x")
        self.span_id = format(sc.span_id, "016x")
        self._parent = trace.set_span_in_context(span)
        self._attempt: Span | None = None
        self._ended = False
        _CURRENT.set(self)

    @property
    def sampled(self) -> bool:
        return self.span.is_recording()

    def _after(self, name: str, seconds: float, attributes: Mapping[str, Any]) -> Span | None:
        """A child span for a step that has just ended, ``seconds`` long (None: the trace is not sampled)."""
        if not self.sampled:
            return None
        end = time.time_ns()
        span = self.tracer.start_span(
            name, context=self._parent, start_time=end - int(seconds * 1e9), attributes=dict(attributes)
        )
        span.end(end_time=end)
        return span

    def admission(self, seconds: float, outcome: str, load: LoadSnapshot | None) -> None:
        attrs: dict[str, Any] = {"omnigate.admission.outcome": outcome}
        if load is not None:
            attrs["omnigate.priority"] = load.priority
            attrs["omnigate.admission.in_flight"] = load.in_flight
            attrs["omnigate.admission.above_soft_limit"] = load.above_soft_limit
        self._after("admission", seconds, attrs)

    def policy(
        self,
        name: str,
        stage: str,
        verdict: str,
        seconds: float,
        *,
        shadow: bool,
        score: float | None,
        attempt: int,
    ) -> None:
        if not self.sampled:
            return
        end = time.time_ns()
        span = self.tracer.start_span(
            f"apply_guardrail {name}",
            context=self._parent,
            start_time=end - int(seconds * 1e9),
            attributes={
                "omnigate.policy.name": name,
                "omnigate.policy.stage": stage,
                "omnigate.policy.verdict": verdict,
                "omnigate.policy.shadow": shadow,
                "omnigate.attempt": attempt,
            },
        )
        event: dict[str, Any] = {
            gen_ai.GEN_AI_EVALUATION_NAME: name,
            gen_ai.GEN_AI_EVALUATION_SCORE_LABEL: verdict,
        }
        if score is not None:
            event[gen_ai.GEN_AI_EVALUATION_SCORE_VALUE] = score
        span.add_event("gen_ai.evaluation.result", event, timestamp=end)
        span.end(end_time=end)

    def attempt(self, engine: str, variant: str | None, model: str, provider: str) -> Span:
        """An engine attempt's span, open until :meth:`attempt_failed` or the request's end; the engine call
        made next in this task carries its span context."""
        attrs: dict[str, Any] = {"omnigate.engine": engine, "omnigate.model": model}
        if variant is not None:
            attrs["omnigate.variant"] = variant
        if self.genai:
            attrs[gen_ai.GEN_AI_OPERATION_NAME] = "chat"
            attrs[gen_ai.GEN_AI_REQUEST_MODEL] = model
            attrs[gen_ai.GEN_AI_PROVIDER_NAME] = provider
        span = self.tracer.start_span(
            f"chat {model}", context=self._parent, kind=SpanKind.CLIENT, attributes=attrs
        )
        self._end_attempt(None)
        self._attempt = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        _ENGINE_HEADERS.set(carrier)
        return span

    def attempt_failed(self, error: BaseException) -> None:
        self._end_attempt(error)

    def _end_attempt(self, error: BaseException | None) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.set_attribute("error.type", getattr(error, "kind", None) or type(error).__name__)
        span.end()

    def audit(self, seconds: float, seq: int | None, error: BaseException | None) -> None:
        span = self._after("audit commit", seconds, {} if seq is None else {"omnigate.audit.seq": seq})
        if span is not None and error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))

    def finished(self, record: Mapping[str, Any]) -> None:
        """The request's outcome and usage on its span (from its one record)."""
        if not self.sampled:
            return
        span = self.span
        status = int(record.get("status") or 0)
        model = record.get("model")
        attrs: dict[str, Any] = {
            "omnigate.outcome": record["outcome"],
            "http.response.status_code": status,
            "omnigate.attempts": record["attempts"],
            "omnigate.retries": record["retries"],
            "omnigate.usage.input_tokens": record["prompt_tokens"],
            "omnigate.usage.output_tokens": record["completion_tokens"],
            "omnigate.stream": record["stream"],
        }
        for key in ("engine", "variant", "tenant", "error_code", "finish_reason"):
            if record.get(key) is not None:
                attrs[f"omnigate.{key}"] = record[key]
        if record.get("audio_seconds"):
            attrs["omnigate.usage.output_audio_seconds"] = record["audio_seconds"]
        for key, value in (record.get("modalities") or {}).items():
            attrs[f"omnigate.usage.input_{key}"] = value
        if record.get("ttft_s") is not None:
            attrs["omnigate.time_to_first_chunk_s"] = record["ttft_s"]
        if self.genai:
            attrs[gen_ai.GEN_AI_OPERATION_NAME] = "chat"
            attrs[gen_ai.GEN_AI_REQUEST_STREAM] = record["stream"]
            if model is not None:
                attrs[gen_ai.GEN_AI_REQUEST_MODEL] = model
                attrs[gen_ai.GEN_AI_RESPONSE_MODEL] = model
            attrs[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] = record["prompt_tokens"]
            attrs[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] = record["completion_tokens"]
            if record.get("finish_reason"):
                attrs[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = [record["finish_reason"]]
            if record.get("ttft_s") is not None:
                attrs[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = record["ttft_s"]
        span.set_attributes(attrs)
        if status >= 500 or record["outcome"] == "failed":
            span.set_status(Status(StatusCode.ERROR, record.get("error_code") or "failed"))

    def end(self) -> None:
        """End the request's span (and an attempt still open: a stream's, which lasts to the end), once."""
        if self._ended:
            return
        self._ended = True
        self._end_attempt(None)
        self.span.end()
