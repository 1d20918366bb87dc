"""OpenTelemetry traces: one span per request, with its admission, guards, engine attempts and audit commit.

Set up the standard way: the OpenTelemetry SDK's ``TracerProvider`` with a batch processor and the OTLP
exporter (http/protobuf or gRPC), configured by the ``OTEL_*`` variables and by ``tracing`` in the config
(a field set there wins; see observability/settings.py ``TracingSettings``). Off unless configured: then
:func:`build` returns None, a request carries no trace (``ctx.trace is None``) and nothing here runs.

A request's trace (:class:`RequestTrace`):

- the **request** span (``SERVER``), a child of the client's W3C ``traceparent`` when it sent one and
  ``client_context`` is ``continue`` (a sampled client trace is kept, an unsampled one is not: the sampler is
  parent-based); with ``link``, a new root linked to the client's span; with ``ignore``, a new root;
- **admission** (the slot wait, shed or refused), **apply_guardrail {policy}** for each policy that ran
  (its verdict as a ``gen_ai.evaluation.result`` event), **audit commit**: spans made when the step has
  ended, from its measured duration, so the request path keeps no span open for them;
- **chat {model}** (``CLIENT``) for each engine attempt, failovers and retries as siblings; its span
  context goes to the engine as ``traceparent`` (:func:`engine_headers`), so vLLM's own spans (served with
  ``--otlp-traces-endpoint``) join the trace.

Attributes: ``omnigate.*`` names always; OpenTelemetry's GenAI names (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.input_tokens``/``output_tokens``,
``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk``, ``gen_ai.request.stream``,
``gen_ai.provider.name``) only when ``OTEL_SEMCONV_STABILITY_OPT_IN`` names ``gen_ai_latest_experimental``:
those conventions are still in development (docs/observability.md lists every name).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from core.context import LoadSnapshot
    from observability.settings import TracingSettings

log = structlog.get_logger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
#: the current engine attempt's ``traceparent`` (and ``tracestate``), read by the adapters' calls
_ENGINE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("omnigate_engine_trace", default=None)

OPT_IN = "gen_ai_latest_experimental"


def engine_headers() -> dict[str, str]:
    """The W3C trace headers for the engine call being made in this task; empty when it is not traced."""
    return _ENGINE_HEADERS.get() or {}


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def enabled(settings: TracingSettings) -> bool:
    if settings.enabled != "auto":
        return settings.enabled == "on"
    if (_env("OTEL_SDK_DISABLED") or "").lower() == "true":
        return False
    if settings.endpoint:
        return True
    if (_env("OTEL_TRACES_EXPORTER") or "").lower() in ("none", "console"):
        return False
    return _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT") is not None


def _exporter(settings: TracingSettings) -> SpanExporter:
    protocol = settings.protocol or _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=settings.endpoint) if settings.endpoint else Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=settings.endpoint) if settings.endpoint else Http()


class Tracing:
    """The gateway's tracer: the SDK's provider (its own, not the process-global one), and a request's start."""

    def __init__(
        self, settings: TracingSettings, exporter: SpanExporter | None = None, *, batch: bool = True
    ) -> None:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        name = settings.service_name or _env("OTEL_SERVICE_NAME") or "omnigate"
        # Resource.create reads OTEL_RESOURCE_ATTRIBUTES; the service name given here wins over it.
        resource = Resource.create({SERVICE_NAME: name})
        sampler = (
            None if settings.sample_ratio is None else ParentBased(TraceIdRatioBased(settings.sample_ratio))
        )
        # sampler None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parent-based, on)
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        exporter = exporter or _exporter(settings)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        )
        self.tracer = self.provider.get_tracer("omnigate")
        self.client_context = settings.client_context
        self.genai = OPT_IN in (os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN") or "").split(",")

    def start(self, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        """The request's span, under the client's ``traceparent`` as ``client_context`` says."""
        parent: Context | None = None
        links: Sequence[Link] = ()
        if self.client_context != "ignore" and "traceparent" in headers:
            carried = _PROPAGATOR.extract(
                {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
            )
            remote = trace.get_current_span(carried).get_span_context()
            if remote.is_valid:
                if self.client_context == "continue":
                    parent = carried
                else:
                    links = (Link(remote, {"omnigate.link": "client"}),)
        span = self.tracer.start_span(
            "POST /v1/chat/completions",
            context=parent if parent is not None else Context(),
            kind=SpanKind.SERVER,
            attributes={
                "omnigate.request_id": request_id,
                "http.request.method": "POST",
                "url.path": "/v1/chat/completions",
            },
            links=links,
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Flush what is buffered (the batch processor's export) and stop."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. Per request, never shared; the pipeline calls it where a step ends."""

    __slots__ = ("_attempt", "_ended", "_parent", "genai", "span", "span_id", "trace_id", "tracer")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracer = tracing.tracer
        self.genai = tracing.genai
        self.span = span
        sc = span.get_span_context()
        self.trace_id = format(sc.trace_id, "032x")
        self.span_id = format(sc.span_id, "016x")
        self._parent = trace.set_span_in_context(span)
        self._attempt: Span | None = None
        self._ended = False

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
        for key in ("engine", "variant", "tenant", "error_code"):
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
            if record.get("finish_reasons"):
                attrs[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = list(record["finish_reasons"])
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


def build(settings: TracingSettings) -> Tracing | None:
    """The tracer the settings and the ``OTEL_*`` variables ask for; None when tracing is off."""
    if not enabled(settings):
        return None
    tracing = Tracing(settings)
    log.info("tracing_started", client_context=settings.client_context, genai_attributes=tracing.genai)
    return tracing
