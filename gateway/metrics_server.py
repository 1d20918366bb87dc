"""``/metrics`` on a port of its own (``metrics.port``), so the public listener never serves it.

prometheus_client's own threaded WSGI server: scrapes never wait on the event loop,
and the main port answers 404 for ``/metrics``.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog
from prometheus_client import start_http_server

from gateway.settings import Settings
from observability.metrics import Metrics

log = structlog.get_logger(__name__)


class MetricsServer:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.host = settings.metrics.host or settings.server.host
        self.requested_port = settings.metrics.port
        self.metrics = metrics
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> None:
        assert self.requested_port is not None
        self._server, self._thread = start_http_server(self.requested_port, self.host, self.metrics.registry)
        self.port = self._server.server_port
        log.info("metrics_listening", host=self.host, port=self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
