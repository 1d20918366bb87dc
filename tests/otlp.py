"""OTLP trace receivers for tests: what a collector would get, decoded from its protobuf.

:class:`Receiver`: ``POST /v1/traces`` takes an ``ExportTraceServiceRequest`` (gzip or not) as the OTLP/HTTP
exporters send it; :class:`GrpcReceiver` the same over OTLP/gRPC. Each keeps every span, flattened to a
:class:`Span` with hex ids and plain attribute values.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    start_ns: int
    end_ns: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)


class Receiver:
    """Start with ``await receiver.start()``; ``url`` is the exporter's endpoint (``.../v1/traces``)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.keep(ExportTraceServiceRequest.FromString(body))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def keep(self, export: ExportTraceServiceRequest) -> None:
        for rs in export.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            attributes=_attrs(s.attributes),
                            resource=resource,
                            status=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        )
                    )

    async def start(self) -> Receiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[union-attr]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


class GrpcReceiver(Receiver):
    """The same, over OTLP/gRPC (``TraceService/Export``); ``endpoint`` is what an exporter is given."""

    def __init__(self) -> None:
        super().__init__()
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"  # http: the exporter connects without TLS

    async def start(self) -> GrpcReceiver:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class _Service(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(
                self, request: ExportTraceServiceRequest, context: Any
            ) -> ExportTraceServiceResponse:
                receiver.keep(request)
                return ExportTraceServiceResponse()

        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
