"""``omnigate serve --workers 2`` as a process on this machine's Redis and PostgreSQL: one gateway in two
processes. Admission's hard limit and an engine's cap hold across both workers (each worker's own
/metrics, on ``metrics.port + i``, shows that both served); SIGHUP reloads both; SIGTERM ends both
workers, each sealing its head of the one audit chain, which then verifies; and two workers without the state that must be
global refuse to start, naming what to set."""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import yaml

from tests.harness import free_port, omnigate_command, wait_until
from tests.stores import fresh_pg_database, redis_prefix
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

REDIS = "redis://127.0.0.1:6379/0"
#: admission's hard (and soft) limit in flight, for the whole gateway
HARD = 8
#: the capped engine's max_in_flight
CAP = 2


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "Talk to me."}]}


def _config(dsn: str, prefix: str, held: ScriptedUpstream, capped: ScriptedUpstream) -> dict[str, Any]:
    return {
        "engines": [
            {
                "name": "held",
                "kind": "vllm",
                "base_url": held.base_url,
                "model": "scripted",
                "serves": ["held"],
                "max_in_flight": 64,
            },
            {
                "name": "capped",
                "kind": "vllm",
                "base_url": capped.base_url,
                "model": "scripted",
                "serves": ["capped"],
                "max_in_flight": CAP,
            },
        ],
        "redis": {"url": REDIS},
        "traffic": {"soft_limit": HARD, "hard_limit": HARD, "key_prefix": f"{prefix}:traffic"},
        "rate_limits": {"key_prefix": f"{prefix}:rate"},
        "routing": {"state": {"backend": "redis", "key_prefix": f"{prefix}:routing"}},
        "audit": {"store": "postgres", "postgres_dsn": dsn, "signing": {"key": secrets.token_hex(32)}},
        "metrics": {"host": "127.0.0.1", "port": _two_free_ports()},
        "server": {"drain_delay_s": 0.2, "graceful_shutdown_s": 5},
        "logging": {"level": "info"},
    }


def _two_free_ports() -> int:
    """A port P with P + 1 also free (each worker's /metrics), outside the range the kernel hands out."""
    for _ in range(200):
        p = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        return p
    raise RuntimeError("no two free ports in a row")


class Workers:
    """One ``omnigate serve --workers 2`` process tree."""

    def __init__(self, config: dict[str, Any], folder: Path) -> None:
        self.config_path = folder / "omnigate.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.metrics_ports = [config["metrics"]["port"], config["metrics"]["port"] + 1]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "serve.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                *omnigate_command(),
                "serve",
                "--config",
                str(self.config_path),
                "--port",
                str(self.port),
                "--workers",
                "2",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def log(self) -> str:
        return self.log_path.read_text()[-12000:]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"omnigate serve --workers 2 exited: {self.log()}")
        try:  # every worker: its /metrics answers once its app has started
            for p in self.metrics_ports:
                httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=1).raise_for_status()
            return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def metric(self, worker: int, name: str) -> float:
        """The sum of a metric's samples on one worker's /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[worker]}/metrics", timeout=5).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{")) or ("{" in name and line.startswith(name))
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for w in self.workers():
                    w.kill()
                self.proc.kill()
                self.proc.wait(5)
        if not self._log.closed:
            self._log.close()


@pytest.fixture(scope="module")
def engines(bg) -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    slow = Script(text=" ".join(["word"] * 400), chunk_delay_s=0.05)
    held, capped = ScriptedUpstream(slow), ScriptedUpstream(Script(text="one two three", chunk_delay_s=0.3))
    for up in (held, capped):
        bg.run(up.start())
    yield held, capped
    for up in (held, capped):
        bg.run(up.stop())


@contextlib.contextmanager
def _two_workers(
    engines: tuple[ScriptedUpstream, ScriptedUpstream], folder: Path
) -> Iterator[tuple[Workers, str]]:
    prefix = redis_prefix()
    rdb = redis.Redis.from_url(REDIS)
    with fresh_pg_database() as dsn:
        gw = Workers(_config(dsn, prefix, *engines), folder)
        try:
            assert wait_until(gw.ready, timeout=120, interval=0.2), gw.log()
            yield gw, dsn
        finally:
            gw.stop()
            keys = list(rdb.scan_iter(match=f"*{prefix}*"))
            if keys:
                rdb.delete(*keys)
            rdb.close()


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory) -> Iterator[Workers]:
    with _two_workers(engines, tmp_path_factory.mktemp("workers")) as (gw, _):
        yield gw


def test_admission_is_one_limit_across_the_workers(gateway):
    assert len(gateway.workers()) == 2
    with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        opened = []
        try:
            for _ in range(2 * HARD):  # each on a connection of its own: the kernel picks its worker
                r = client.send(
                    client.build_request("POST", gateway.url + "/v1/chat/completions", json=_chat("held")),
                    stream=True,
                )
                opened.append(r)
                if r.status_code != 200:
                    r.read()
            codes = [r.status_code for r in opened]
            assert codes.count(200) == HARD and codes.count(503) == HARD, codes
            assert all(r.json()["error"]["code"] == "overloaded" for r in opened if r.status_code == 503)
            in_flight = [gateway.metric(w, "omnigate_requests_in_flight") for w in (0, 1)]
            assert sum(in_flight) == HARD, in_flight
            # Both workers answered some of the 2 x HARD requests (held, or refused at the shared limit).
            answered = [gateway.metric(w, "omnigate_requests_total") + in_flight[w] for w in (0, 1)]
            assert all(n > 0 for n in answered), answered
        finally:
            for r in opened:
                r.close()
    assert wait_until(lambda: sum(gateway.metric(w, "omnigate_requests_in_flight") for w in (0, 1)) == 0, 10)


def test_an_engine_cap_holds_across_the_workers(gateway, engines):
    _, capped = engines
    capped.max_in_flight = 0
    before = [gateway.metric(w, "omnigate_requests_total") for w in (0, 1)]

    def one(_: int) -> int:
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            r = c.post(gateway.url + "/v1/chat/completions", json=_chat("capped"))
            return r.status_code

    n = 6 * CAP
    with ThreadPoolExecutor(n) as pool:
        codes = list(pool.map(one, range(n)))
    assert codes.count(200) >= CAP and set(codes) <= {200, 503}, codes
    assert capped.max_in_flight == CAP  # reached, never passed, with both workers sending
    after = [gateway.metric(w, "omnigate_requests_total") for w in (0, 1)]
    assert sum(after) - sum(before) == n
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_sighup_reloads_and_sigterm_ends_both_workers_and_the_one_chain_verifies(engines, tmp_path):
    with _two_workers(engines, tmp_path) as (gw, _):
        workers = gw.workers()
        assert len(workers) == 2
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(12):
                assert c.post(gw.url + "/v1/chat/completions", json=_chat("capped")).status_code == 200
        served = [gw.metric(w, "omnigate_requests_total") for w in (0, 1)]
        assert sum(served) == 12 and all(n > 0 for n in served), served
        # SIGHUP to the supervisor: every worker reads the file again, each with its own port (no restart owed)
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_until(
            lambda: all(gw.metric(w, 'omnigate_config_reloads_total{result="ok"}') == 1 for w in (0, 1)),
            30,
            0.2,
        ), gw.log()
        reloads = [
            json.loads(line) for line in gw.log_path.read_text().splitlines() if "config_reloaded" in line
        ]
        assert [r["restart_required"] for r in reloads] == [None, None], reloads
        gw.proc.send_signal(signal.SIGTERM)
        try:
            code = gw.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the workers did not stop: {gw.log()}") from None
        assert code == 0, gw.log()
        for w in workers:  # each worker drained and stopped on its own, none left behind
            assert not w.is_running() or w.status() == psutil.STATUS_ZOMBIE
        log = gw.log()
        assert log.count("Application shutdown complete") == 2, log
        verify = subprocess.run(
            [
                *omnigate_command(),
                "audit",
                "verify",
                "--config",
                str(gw.config_path),
                "--json",
                "--require-covered",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        report = json.loads(verify.stdout)
        assert report["ok"] and report["records"] >= 12, report


def test_two_workers_without_global_state_refuse_to_start(tmp_path):
    path = tmp_path / "omnigate.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {
                        "name": "e",
                        "kind": "vllm",
                        "base_url": "http://127.0.0.1:9",
                        "model": "m",
                        "serves": ["m"],
                    }
                ],
                "audit": {"sqlite_path": str(tmp_path / "audit.db")},
                "admin": {"api_key": secrets.token_urlsafe(32)},  # keys are checked: the directory matters
            }
        )
    )
    env = {**os.environ, "OMNIGATE_SERVER__WORKERS": "2"}
    done = subprocess.run(
        [*omnigate_command(), "serve", "--config", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 1
    assert "refusing to start 2 workers" in done.stderr, done.stderr
    for what in (
        "set redis.url",
        "routing.state.backend: redis",
        "audit.store: postgres",
        "auth.directory.backend: postgres",
        "set metrics.port",
    ):
        assert what in done.stderr, (what, done.stderr)
    assert not (tmp_path / "audit.db").exists()  # refused before anything was opened
    # --workers 1 overrides the setting: the same config starts (and is stopped at once).
    one = subprocess.Popen(
        [*omnigate_command(), "serve", "--config", str(path), "--port", str(free_port()), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        assert wait_until(lambda: (tmp_path / "audit.db").exists() or one.poll() is not None, 60, 0.2)
        assert one.poll() is None
    finally:
        one.send_signal(signal.SIGTERM)
        one.wait(30)


def test_what_two_workers_need_and_one_does_not(tmp_path):
    from gateway.cli import workers_refused
    from gateway.settings import load_settings

    global_state = _config("postgresql://postgres@127.0.0.1:5432/x", "p", *(_Addr(),) * 2)
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(global_state))
    settings = load_settings(path)
    assert workers_refused(settings, 2) == []
    assert (
        workers_refused(
            settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": None})}), 1
        )
        == []
    )
    metrics = global_state["metrics"]["port"]
    (clash,) = workers_refused(settings, 2, port=metrics + 1)  # worker 1's /metrics would take the port
    assert f"{metrics}..{metrics + 1} take the server's port" in clash
    assert workers_refused(settings, 3, port=metrics + 3) == []


class _Addr:
    base_url = "http://127.0.0.1:9/v1"
