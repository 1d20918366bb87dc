"""The ``omnigate`` command: ``serve``, ``check-config``, ``audit verify|export``, ``keys new``,
``directory import``, ``verify-weights`` and ``weights-manifest``.

Its length: one small function per subcommand and the argument parser that names them all; each
imports what it uses when it runs, so the command starts without the gateway's libraries. The
``--workers`` supervisor (forking, signal forwarding, the refusals above one worker) is the largest
part and is the piece to move into a module of its own next.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:  # the commands import what they use when they run: the CLI starts without them
    import socket
    from collections.abc import Callable
    from types import FrameType

    import uvicorn

    from gateway.readiness import Readiness
    from gateway.services import Services
    from gateway.settings import Settings
    from observability.settings import AuditSettings


def _format_validation(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(x) for x in err["loc"]) or "(root)"
        lines.append(f"  {field}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def _load(path: str | None) -> Settings:
    from gateway.settings import load_settings

    return load_settings(path)


def check_config(path: str) -> int:
    from gateway.secret_check import WeakSecret, check
    from policies.registry import PolicyConfigError, build_chain

    try:
        settings = _load(path)
        check(settings)
        chain = build_chain(settings.policies)
        from gateway.chains import build_policy_sets

        sets = build_policy_sets(settings)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(_format_validation(exc), file=sys.stderr)
        return 1
    except WeakSecret as exc:
        print("invalid configuration:\n" + "\n".join(f"  {p}" for p in exc.problems), file=sys.stderr)
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
    for name, c in sets.items():
        print(f"policy set {name}:")
        for stage, names in c.describe().items():
            print(f"  {stage}: {' -> '.join(names) if names else '(none)'}")
    for line in auth_banner(settings):
        print(line)
    a = settings.audit
    if a.enabled:
        signed = (
            f"signed ({a.signing.algorithm})"
            if a.signing.key is not None
            else "UNSIGNED (no audit.signing.key)"
        )
        witness = str(a.witness_path) if a.witness_path else "the log only"
        print(
            f"audit: {a.store}, on_unavailable {a.on_unavailable}, checkpoints {signed} every "
            f"{a.checkpoint_every}, heads published to {witness}"
        )
    else:
        print("audit: disabled")
    if any("scorer" in getattr(p.impl, "uses", ()) for c in (chain, *sets.values()) for p in c.all()):
        g = settings.grounding
        which = (
            f"cross-encoder {g.model}" if g.model else "fallback (numbers, dates, names + all-MiniLM-L6-v2)"
        )
        if g.scorer == "served" and g.served is not None:  # an engine runs the model, not this process
            which, where = f"served {g.served.model} ({g.served.endpoint})", g.served.url
        else:
            where = g.device
        print(f"grounding scorer: {which} on {where}")
    t = settings.traffic
    if not t.enabled:
        print("traffic: admission off")
    else:
        shared = (
            f"shared through Redis (prefix {t.key_prefix}, lease {t.lease_ttl_s:g} s)"
            if settings.redis.url is not None
            else "in-process"
        )
        print(f"traffic: soft limit {t.soft_limit}, hard limit {t.hard_limit} in flight; {shared}")
        classes = ", ".join(f"{c.name} {'/'.join(map(str, t.class_limits(c.name)))}" for c in t.priorities)
        print(f"  classes (soft/hard, highest first): {classes}")
    return 0


def auth_banner(settings: Settings) -> list[str]:
    """What the start-up banner and ``check-config`` say about authentication (decided here, at boot)."""
    d = settings.auth.directory
    where = "shared PostgreSQL" if d.shared else f"SQLite {d.sqlite_path}, this process only"
    if not settings.auth_required:
        why = (
            "auth.required: false"
            if settings.auth.required is False
            else ("no config names tenants, API keys, an admin key or a shared directory")
        )
        return [f"authentication: OFF ({why}): every request is served, unauthenticated"]
    lines = [
        (
            f"authentication: required (keys checked on every /v1 request); directory: {where}, "
            f"changes honoured on every replica within {d.bound_s:g} s, directory keys refused after "
            f"{d.fail_closed_after_s:g} s without a read"
        )
    ]
    if settings.tenants:
        lines.append(
            f"tenants: {', '.join(t.name for t in settings.tenants)} ({len(settings.api_keys)} keys)"
            " in the config, plus those of the directory"
        )
    else:
        lines.append("tenants: none in the config; until the directory has some, every request gets 401")
    if settings.auth.replicas > 1 and not d.shared:
        lines.append(
            f"admin writes to tenants and keys: refused (auth.replicas is {settings.auth.replicas} "
            "and the directory is per process; use auth.directory.backend: postgres)"
        )
    return lines


def stop_deadline_s(settings: Settings) -> float:
    """How long a stop may take before it counts as stuck: the drain, the streams' grace, the resources'
    closes (gateway/services.py ``_CLOSE_S``) and a margin."""
    return settings.server.drain_delay_s + settings.server.graceful_shutdown_s + 30.0


class _DrainingServer:
    """uvicorn's Server, with a drain phase before it stops listening.

    The first SIGTERM/SIGINT fails readiness at once and keeps serving for
    ``server.drain_delay_s`` (so load balancers move traffic away), then uvicorn's
    graceful shutdown gives open streams ``server.graceful_shutdown_s``. A second
    signal stops at once.
    """

    @staticmethod
    def build(
        config: uvicorn.Config,
        services: Services,
        readiness: Readiness,
        on_listening: Callable[[], None] | None = None,
    ) -> uvicorn.Server:
        import asyncio
        import faulthandler
        from collections.abc import Sequence

        import uvicorn

        class Server(uvicorn.Server):
            def _log_started_message(self, listeners: Sequence[socket.SocketType]) -> None:
                # Instead of uvicorn's "running on": listening is not answering (the engines are probed
                # after the lifespan), so the one line says "ready" when the gateway can answer.
                host, port = listeners[0].getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                scheme = "https" if self.config.ssl is not None else "http"
                readiness.announce(f"{scheme}://{shown}:{port}")
                if on_listening is not None:
                    on_listening()

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if services.draining.is_set():
                    super().handle_exit(sig, frame)
                    return
                # A stop that overruns its deadline by far prints every thread's stack to stderr (what
                # it is stuck in), then goes on waiting: the supervisor or the orchestrator decides.
                faulthandler.dump_traceback_later(stop_deadline_s(services.settings), exit=False)
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(services.begin_drain)
                loop.call_soon_threadsafe(
                    loop.call_later, services.settings.server.drain_delay_s, super().handle_exit, sig, frame
                )

        return Server(config)


def workers_refused(settings: Settings, workers: int, port: int | None = None) -> list[str]:
    """Why ``workers`` processes would not be one gateway (empty: they would), as the Helm chart refuses
    more than one replica: every worker keeps in its own memory what is not in Redis or PostgreSQL."""
    if workers <= 1:
        return []
    why = f"{workers} workers"
    out = []
    if settings.redis.url is None:
        out.append(
            f"redis.url is not set, but {why} would each keep their own admission limits, rate limits and "
            "engine caps: set redis.url"
        )
    if not settings.traffic.enabled:
        out.append(
            f"traffic.enabled is false, but {why} share their admission limits through Redis: remove it"
        )
    if settings.routing.state.backend != "redis":
        out.append(
            f"routing.state.backend is {settings.routing.state.backend}, but {why} would each run their own "
            "rollback controller and a pin or freeze would hold in one worker: set routing.state.backend: redis"
        )
    audit = settings.audit
    if not audit.enabled:
        out.append(f"audit.enabled is false, but {why} need one audit chain: remove it")
    elif audit.store != "postgres":
        out.append(
            f"audit.store is {audit.store}, but {why} cannot write one chain to one SQLite file: set "
            "audit.store: postgres (with audit.postgres_dsn)"
        )
    if settings.auth_required and not settings.auth.directory.shared:
        out.append(
            f"auth.directory.backend is {settings.auth.directory.backend}, but with {why} tenants and keys "
            "made through /admin would hold in one worker: set auth.directory.backend: postgres (with "
            "auth.directory.postgres_dsn)"
        )
    metrics_port = settings.metrics.port
    if metrics_port is None:
        out.append(
            f"metrics.port is not set, but with {why} a scrape of /metrics on the main port would see one "
            f"worker: set metrics.port (worker i serves /metrics on metrics.port + i)"
        )
    elif metrics_port and metrics_port + workers - 1 > 65535:
        out.append(f"metrics.port + {workers - 1} (the last worker's /metrics) is above 65535")
    elif (
        metrics_port
        and metrics_port <= (settings.server.port if port is None else port) < metrics_port + workers
    ):
        out.append(
            f"the workers' /metrics ports {metrics_port}..{metrics_port + workers - 1} take the server's port: "
            "set metrics.port outside it"
        )
    return out


def serve(path: str | None, host: str | None, port: int | None, workers: int | None = None) -> int:
    from observability.logging import configure_logging

    try:
        settings = _load(path)
    except (FileNotFoundError, ValidationError) as exc:
        msg = _format_validation(exc) if isinstance(exc, ValidationError) else str(exc)
        print(msg, file=sys.stderr)
        return 1
    n = settings.server.workers if workers is None else workers
    refused = workers_refused(settings, n, port)
    if refused:
        print(f"refusing to start {n} workers:\n" + "\n".join(f"  {p}" for p in refused), file=sys.stderr)
        return 1
    configure_logging(settings.logging.level, settings.logging.json_output)
    for line in auth_banner(settings):
        print(f"omnigate: {line}", file=sys.stderr)
    host = host or settings.server.host
    port = port if port is not None else settings.server.port
    if n == 1:
        return _serve_one(settings, path, host, port, None, None)
    return _Supervisor(settings, path, host, port, n).run()


def _serve_one(
    settings: Settings,
    path: str | None,
    host: str,
    port: int,
    sock: socket.socket | None,
    on_listening: Callable[[], None] | None,
) -> int:
    import uvicorn

    from engines.rollout.sentinel import SentinelUnavailable
    from gateway.app import create_app
    from gateway.header_deadline import protocol_class
    from gateway.secret_check import WeakSecret
    from policies.registry import PolicyConfigError

    try:
        app = create_app(settings, config_path=path, freeze_heap=True)
    except WeakSecret as exc:
        print("refusing to start:\n" + "\n".join(f"  {p}" for p in exc.problems), file=sys.stderr)
        return 1
    except (PolicyConfigError, SentinelUnavailable) as exc:  # e.g. a policy whose extra is not installed
        print(f"refusing to start:\n  {exc}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.server.graceful_shutdown_s),
        # uvicorn bounds no request head: its protocol, with the head's deadline (gateway/header_deadline.py)
        http=protocol_class(
            settings.server.header_timeout_s, max_header_bytes=settings.server.max_header_bytes
        ),
        timeout_keep_alive=settings.server.keepalive_timeout_s,
        h11_max_incomplete_event_size=settings.server.max_header_bytes,
        # /v1/realtime's WebSockets (websockets' sans-I/O protocol); with it off, no implementation is loaded.
        # A frame over twice the session's bound closes the connection (1009) before it is read whole; a
        # smaller oversized one gets the session's own error event.
        ws="websockets-sansio" if settings.realtime.enabled else "none",
        ws_max_size=2 * settings.realtime.max_frame_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
    )
    server = _DrainingServer.build(config, app.state.services, app.state.readiness, on_listening)
    server.run(sockets=None if sock is None else [sock])
    return 0


class _Supervisor:
    """``omnigate serve --workers N``: N forked processes, each with its own app and its own listening
    socket on the one port (SO_REUSEPORT: the kernel spreads the connections over the workers by their
    addresses, where one shared socket lets whichever worker wakes first take a whole burst).

    The parent serves nothing: it binds the port first (so a port in use, or port 0's pick, is settled
    once), forwards SIGTERM/SIGINT (drain, then stop; a second one stops at once) and SIGHUP (reload the
    config) to every worker, and restarts a worker that dies after it was listening. A worker that exits
    before it listens (a refused config) stops them all, with its exit status. Each worker's settings
    differ (through its environment, see ``_worker_environment``) in /metrics on ``metrics.port + i``, its
    own audit journal and, where one is named, the routing replica id suffixed with ``-i``.
    """

    def __init__(self, settings: Settings, path: str | None, host: str, port: int, workers: int) -> None:
        self.settings = settings
        self.path = path
        self.host = host
        self.workers = workers
        self.reserved = self._socket(port, listen=False)
        self.port: int = self.reserved.getsockname()[1]
        self.children: dict[int, tuple[int, int]] = {}  # pid -> (worker index, read end of its pipe)
        self.stopping = False
        self.status = 0

    def _socket(self, port: int, *, listen: bool) -> socket.socket:
        import socket

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, port))
        if listen:
            sock.listen(2048)  # uvicorn's default backlog
        return sock

    def _worker_environment(self, i: int) -> dict[str, str]:
        """What differs in worker ``i``, as environment variables: its settings and every reload of its
        config file then agree on them (a reload reads the environment again)."""
        s = self.settings
        assert s.metrics.port is not None  # workers_refused
        env = {"OMNIGATE_METRICS__PORT": str(s.metrics.port + i if s.metrics.port else 0)}
        if i > 0:  # the audit journal takes one process (observability/audit/spool.py)
            env["OMNIGATE_AUDIT__SPOOL_PATH"] = f"{s.audit.spool_file}.{i}"
        if s.routing.state.replica_id is not None:
            env["OMNIGATE_ROUTING__STATE__REPLICA_ID"] = f"{s.routing.state.replica_id}-{i}"
        return env

    def _spawn(self, i: int) -> None:
        import os
        import signal

        read, write = os.pipe()
        pid = os.fork()
        if pid:
            os.close(write)
            os.set_blocking(read, False)
            self.children[pid] = (i, read)
            return
        code = 1
        try:  # the worker: default signal handling until uvicorn and the app set theirs
            os.close(read)
            for r in (r for _, r in self.children.values()):
                os.close(r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the app reloads on it once started
            _term_with_parent()
            self.reserved.close()
            sock = self._socket(self.port, listen=True)

            def listening() -> None:
                os.write(write, b"1")
                os.close(write)

            os.environ.update(self._worker_environment(i))
            code = _serve_one(_load(self.path), self.path, self.host, self.port, sock, listening)
        except BaseException:  # a forked worker never returns into the parent's code: it exits here
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        import os
        import signal

        if sig != signal.SIGHUP:
            self._stop_by_deadline()
            if sig == signal.SIGINT and _terminal_signals_the_group():
                return  # Ctrl-C at a terminal reached every worker already
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _stop_by_deadline(self) -> None:
        """The workers are stopping: those still running at the deadline (a worker stuck in its stop has
        printed its stacks by then, see ``_DrainingServer``) are killed, and the supervisor exits 1."""
        import math
        import signal

        if not self.stopping:
            self.stopping = True
            signal.alarm(math.ceil(stop_deadline_s(self.settings)) + 5)

    def _overran(self, sig: int, frame: FrameType | None) -> None:
        import os
        import signal

        for pid, (i, _) in self.children.items():
            print(f"omnigate: worker {i} (pid {pid}) did not stop by its deadline: killed", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.status = self.status or 1

    def run(self) -> int:
        import os
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)
        signal.signal(signal.SIGALRM, self._overran)
        print(
            f"omnigate: {self.workers} workers on port {self.port} (supervisor pid {os.getpid()})",
            file=sys.stderr,
        )
        for i in range(self.workers):
            self._spawn(i)
        while self.children:
            pid, wait_status = os.wait()
            if pid not in self.children:
                continue
            i, read = self.children.pop(pid)
            try:
                listened = os.read(read, 1) == b"1"
            except BlockingIOError:
                listened = False
            os.close(read)
            code = os.waitstatus_to_exitcode(wait_status)
            if self.stopping:
                self.status = self.status or (code if code > 0 else 0)
            elif listened:
                print(f"omnigate: worker {i} (pid {pid}) exited ({code}): starting another", file=sys.stderr)
                self._spawn(i)
            else:
                self._stop_by_deadline()
                self.status = code if code > 0 else 1
                for other in self.children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGTERM)
        self.reserved.close()
        return self.status


def _term_with_parent() -> None:
    """A worker whose supervisor dies (SIGKILL, OOM) gets SIGTERM and drains, rather than serving on alone."""
    import ctypes
    import ctypes.util
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def _terminal_signals_the_group() -> bool:
    """Whether this process is in the foreground of a terminal (a Ctrl-C there signals the whole group)."""
    import os

    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _audit_settings(args: argparse.Namespace) -> AuditSettings:
    settings = _load(args.config)
    audit = settings.audit
    if args.sqlite:
        audit = audit.model_copy(update={"store": "sqlite", "sqlite_path": Path(args.sqlite)})
    if args.postgres:
        from pydantic import SecretStr

        audit = audit.model_copy(update={"store": "postgres", "postgres_dsn": SecretStr(args.postgres)})
    return audit


def audit_command(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from observability.audit.backends import build_store
    from observability.audit.chain import Signer
    from observability.audit.verify import export_store, verify_store

    try:
        audit = _audit_settings(args)
    except (FileNotFoundError, ValidationError) as exc:
        print(_format_validation(exc) if isinstance(exc, ValidationError) else str(exc), file=sys.stderr)
        return 2
    if audit.store == "sqlite" and not audit.sqlite_path.is_file():
        print(f"no audit database at {audit.sqlite_path}", file=sys.stderr)
        return 2
    expect: dict[int, str] = {}
    if args.audit_command == "verify":
        from observability.audit.witness import parse_expect, read_heads

        try:
            for path in args.expect_file or ():
                expect.update(read_heads(Path(path)))
            expect.update(parse_expect(v) for v in args.expect or ())
        except (OSError, ValueError) as exc:
            print(str(exc), file=sys.stderr)
            return 2
    store = build_store(audit)

    async def run() -> int:
        await store.open()
        try:
            if args.audit_command == "verify":
                signer = Signer.from_settings(audit.signing, getattr(args, "public_key", None))
                report = await verify_store(store, signer, expect, args.require_covered)
                doc = report.to_json()
                if args.json:
                    print(json.dumps(doc, indent=2))
                elif report.ok:
                    print(
                        f"audit chain OK: {report.records} records (seq {report.first_seq or 0}.."
                        f"{report.head_seq}), {report.checkpoints_signed} signed checkpoints verified, "
                        f"{report.checkpoints_unchecked} not checkable, head {report.head_hash}"
                    )
                    if report.anchored_at:
                        print(
                            f"  starts after a retention cut anchored by the checkpoint at record "
                            f"{report.anchored_at}"
                        )
                    if doc["uncovered_records"]:
                        print(
                            f"  {doc['uncovered_records']} records after the newest checkpoint are not yet "
                            "covered by a signature"
                        )
                    for g in report.gaps:
                        print(f"  gap record at seq {g[0]}: {g[1]} records were not written (buffer full)")
                else:
                    p = report.problem
                    assert p is not None
                    print(f"audit chain BROKEN at record {p.seq} ({p.kind}): {p.message}")
                return 0 if report.ok else 1
            to_file = args.out and args.out != "-"
            with open(args.out, "wb") if to_file else contextlib.nullcontext(sys.stdout.buffer) as out:  # noqa: ASYNC230 - the command's only task: nothing else waits on the loop
                n = await export_store(store, out, args.after)
            print(f"exported {n} records", file=sys.stderr)
            return 0
        finally:
            await store.close()

    return asyncio.run(run())


def keys_new(tenant: str) -> int:
    from gateway.tenants import mint_key

    minted = mint_key()
    print(f"key (shown once): {minted.key}", file=sys.stderr)
    print("config entry (api_keys:):")
    print(f"  - id: {minted.id}\n    tenant: {tenant}\n    sha256: {minted.sha256}")
    return 0


def directory_import(config: str | None) -> int:
    import asyncio

    from gateway.directory.migrate import import_from_audit

    try:
        settings = _load(config)
    except (FileNotFoundError, ValidationError) as exc:
        print(_format_validation(exc) if isinstance(exc, ValidationError) else str(exc), file=sys.stderr)
        return 2
    done = asyncio.run(import_from_audit(settings))
    print(
        f"imported {done.tenants} tenants and {done.keys} keys into the {settings.auth.directory.backend} "
        f"directory ({done.skipped} already there, left as they are)"
    )
    return 0


def verify_weights(args: argparse.Namespace) -> int:
    """Check a model folder against its manifest (downloading it first with --download); fails closed."""
    from gateway import weights

    folder = Path(args.dir)
    if args.revision is not None and not weights.is_commit(args.revision):
        print(
            f"weights NOT verified: revision {args.revision!r} is not a commit (40 hex digits): a branch or "
            "tag can move, so only a commit pins the weights",
            file=sys.stderr,
        )
        return 1
    try:
        manifest = weights.parse_manifest(Path(args.manifest).read_text())
    except (OSError, UnicodeDecodeError, weights.ManifestError) as exc:
        print(f"weights NOT verified: manifest {args.manifest}: {exc}", file=sys.stderr)
        return 1
    if args.download:
        if not (args.model and args.revision):
            print("--download needs --model and --revision", file=sys.stderr)
            return 2
        try:
            weights.download(args.model, args.revision, folder)
        except Exception as exc:  # any failure to fetch is a failure to verify
            print(
                f"weights NOT verified: download of {args.model}@{args.revision} failed: {exc}",
                file=sys.stderr,
            )
            return 1
    report = weights.verify(folder, manifest, args.revision)
    if not report.ok:
        print(f"weights NOT verified: {folder}", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"weights verified: {folder} ({report.checked} files match the manifest)")
    return 0


def weights_manifest(folder: str) -> int:
    from gateway import weights

    if not Path(folder).is_dir():
        print(f"{folder}: no such folder", file=sys.stderr)
        return 2
    sys.stdout.write(weights.write_manifest(Path(folder)))
    return 0


def _positive(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"{n} is not between 1 and 256")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omnigate", description="A guarded gateway for omni-modal LLM engines."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the gateway")
    p_serve.add_argument("--config", help="YAML config file (default: the embedded local engine)")
    p_serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p_serve.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p_serve.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="worker processes on the port (default server.workers, 1); above 1 needs the state that must "
        "be global in Redis and PostgreSQL",
    )
    p_check = sub.add_parser("check-config", help="validate a config file and print what it resolves to")
    p_check.add_argument("file", type=Path)
    p_audit = sub.add_parser("audit", help="verify or export the audit trail")
    audit_sub = p_audit.add_subparsers(dest="audit_command", required=True)
    for name, text in (
        ("verify", "re-walk the hash chain and check the signed checkpoints"),
        ("export", "write the records as JSON lines (for a SIEM)"),
    ):
        p = audit_sub.add_parser(name, help=text)
        p.add_argument("--config", help="the gateway's config file (names the store and the signing key)")
        p.add_argument("--sqlite", help="verify/export this SQLite file instead of the configured store")
        p.add_argument("--postgres", help="verify/export this PostgreSQL DSN instead of the configured store")
        if name == "verify":
            p.add_argument("--public-key", help="Ed25519 public key (base64) to check checkpoints with")
            p.add_argument("--json", action="store_true", help="print the report as JSON")
            p.add_argument(
                "--expect",
                action="append",
                metavar="SEQ:HASH",
                help="a head published outside the store (repeatable): record SEQ must have HASH",
            )
            p.add_argument(
                "--expect-file",
                action="append",
                metavar="PATH",
                help="a file of published heads (audit.witness_path, or SEQ:HASH lines)",
            )
            p.add_argument(
                "--require-covered",
                action="store_true",
                help="fail if records after the newest checkpoint are not covered by a signature "
                "(a stopped gateway seals its head)",
            )
        else:
            p.add_argument("--after", type=int, default=0, help="only records with seq greater than this")
            p.add_argument("--out", default="-", help="output file (default: standard output)")
    p_keys = sub.add_parser("keys", help="API keys")
    keys_sub = p_keys.add_subparsers(dest="keys_command", required=True)
    p_new = keys_sub.add_parser(
        "new", help="mint a key: prints it once, and the config entry with its digest"
    )
    p_new.add_argument("--tenant", required=True)
    p_dir = sub.add_parser("directory", help="the tenant directory")
    dir_sub = p_dir.add_subparsers(dest="directory_command", required=True)
    p_imp = dir_sub.add_parser(
        "import", help="copy tenants and keys an older version kept in the audit database"
    )
    p_imp.add_argument("--config", help="the gateway's config file (names the audit store and the directory)")
    p_vw = sub.add_parser(
        "verify-weights",
        help="check a model snapshot against its SHA-256 manifest "
        "before an engine loads it (exit 1 on any difference)",
    )
    p_vw.add_argument("--dir", required=True, help="the snapshot folder (.../snapshots/<revision>)")
    p_vw.add_argument("--manifest", required=True, help="SHA-256 sums of every file, sha256sum format")
    p_vw.add_argument("--model", help="the Hugging Face model id (with --download)")
    p_vw.add_argument("--revision", help="the pinned revision: the folder must be named after it")
    p_vw.add_argument(
        "--download", action="store_true", help="fetch the snapshot at --revision into --dir first"
    )
    p_wm = sub.add_parser("weights-manifest", help="print the SHA-256 manifest of a model folder")
    p_wm.add_argument("dir")
    args = parser.parse_args(argv)
    if args.command != "serve":
        # A command's standard output is its data (an export's records, a key, a manifest): what it or
        # the settings it loads log goes to standard error. serve configures its own log from its config.
        from observability.logging import configure_logging

        configure_logging("info", json_output=False, stream=sys.stderr)
    if args.command == "verify-weights":
        return verify_weights(args)
    if args.command == "weights-manifest":
        return weights_manifest(args.dir)
    if args.command == "serve":
        return serve(args.config, args.host, args.port, args.workers)
    if args.command == "audit":
        return audit_command(args)
    if args.command == "keys":
        return keys_new(args.tenant)
    if args.command == "directory":
        return directory_import(args.config)
    return check_config(str(args.file))


if __name__ == "__main__":
    raise SystemExit(main())
