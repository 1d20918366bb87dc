"""The ``omnigate`` command: ``serve`` and ``check-config``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError


def _format_validation(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(x) for x in err["loc"]) or "(root)"
        lines.append(f"  {field}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def _load(path: str | None):  # noqa: ANN202
    from gateway.settings import load_settings

    return load_settings(path)


def check_config(path: str) -> int:
    from policies.registry import PolicyConfigError, build_chain

    try:
        settings = _load(path)
        chain = build_chain(settings.policies)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(_format_validation(exc), file=sys.stderr)
        return 1
    except PolicyConfigError as exc:
        print(f"invalid configuration:\n  {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a YAML syntax error and the like
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 1
    print(f"configuration OK: {path}")
    print("engines:")
    for e in settings.engines:
        where = f" {e.base_url}" if e.base_url else ""
        print(f"  - {e.name}: kind={e.kind} variant={e.variant} role={e.role} model={e.model}{where}")
        print(f"    serves: {', '.join(e.serves)}")
    print("policy chain (in order):")
    for stage, names in chain.describe().items():
        print(f"  {stage}: {' -> '.join(names) if names else '(none)'}")
    if any("scorer" in getattr(p.impl, "uses", ()) for p in chain.all()):
        g = settings.grounding
        which = f"cross-encoder {g.model}" if g.model else "fallback (numbers, dates, names + all-MiniLM-L6-v2)"
        print(f"grounding scorer: {which} on {g.device}")
    return 0


def serve(path: str | None, host: str | None, port: int | None) -> int:
    import uvicorn

    from gateway.app import create_app
    from observability.logging import configure_logging

    try:
        settings = _load(path)
    except (FileNotFoundError, ValidationError) as exc:
        msg = _format_validation(exc) if isinstance(exc, ValidationError) else str(exc)
        print(msg, file=sys.stderr)
        return 1
    configure_logging(settings.logging.level, settings.logging.json_output)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=host or settings.server.host,
        port=port if port is not None else settings.server.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.server.graceful_shutdown_s),
        h11_max_incomplete_event_size=64 * 1024,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnigate", description="A guarded gateway for omni-modal LLM engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the gateway")
    p_serve.add_argument("--config", help="YAML config file (default: the embedded local engine)")
    p_serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p_serve.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p_check = sub.add_parser("check-config", help="validate a config file and print what it resolves to")
    p_check.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.config, args.host, args.port)
    return check_config(str(args.file))


if __name__ == "__main__":
    raise SystemExit(main())
