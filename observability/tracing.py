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
  context goes to the engine as ``traceparent`` (observability/trace_spans.py ``engine_headers``), so vLLM's own spans (served with
  ``--otlp-traces-endpoint``) join the trace.

Attributes: ``omnigate.*`` names always; OpenTelemetry's GenAI names (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.input_tokens``/``output_tokens``,
``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk``, ``gen_ai.request.stream``,
``gen_ai.provider.name``) only when ``OTEL_SEMCONV_STABILITY_OPT_IN`` names ``gen_ai_latest_experimental``:
those conventions are still in development (docs/observability.md lists every name).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from observability.settings import TracingSettings

from observability.trace_spans import RequestTrace

log = structlog.get_logger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
OPT_IN = "gen_ai_latest_experimental"


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
        return RequestTrace(self.tracer, span, genai=self.genai)

    def shutdown(self) -> None:
        """Flush what is buffered (the batch processor's export) and stop."""
        self.provider.shutdown()


def build(settings: TracingSettings) -> Tracing | None:
    """The tracer the settings and the ``OTEL_*`` variables ask for; None when tracing is off."""
    if not enabled(settings):
        return None
    tracing = Tracing(settings)
    log.info("tracing_started", client_context=settings.client_context, genai_attributes=tracing.genai)
    return tracing
