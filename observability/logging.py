"""structlog configuration: one JSON event per line, request id from contextvars."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TextIO

import orjson
import structlog


def _dumps(obj: object, default: Callable[[object], object] | None = None, **_: object) -> str:
    return orjson.dumps(obj, default=default, option=orjson.OPT_NON_STR_KEYS).decode()


def configure_logging(level: str = "info", json_output: bool = True, stream: TextIO | None = None) -> None:
    """Events to ``stream`` (standard output by default: the server's log; standard error for a command
    whose standard output is its data)."""
    out = stream if stream is not None else sys.stdout
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer: structlog.types.Processor = (
        # orjson, as structlog's performance notes advise: a request's log line is rendered on the request
        # path, and the standard library's json takes several times as long. Keys that are not strings are
        # written as strings (the standard library's json does the same) rather than failing the line.
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json_output
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    # Route the stdlib's loggers (uvicorn, litellm, transformers) through the same renderer.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    for noisy in ("uvicorn.access", "LiteLLM", "litellm", "httpx"):
        logging.getLogger(noisy).setLevel(max(lvl, logging.WARNING))
