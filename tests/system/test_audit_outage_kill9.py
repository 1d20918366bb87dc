"""The audit store goes away under load, the gateway is killed with SIGKILL, then restarted.

A real ``omnigate serve`` process; the test holds the store's write lock (SQLite: a
write transaction of its own; PostgreSQL: ``LOCK TABLE audit_log``), kills the
process while it holds it, releases it and starts the gateway again. No request
whose response was complete may be missing from the chain, none may be there twice,
and the chain must verify against the heads the gateway published outside the store.
``spool`` keeps serving from its journal; ``refuse`` answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import asyncpg
import httpx
import pytest
import yaml

from gateway.tenants import mint_key
from observability.audit.backends import build_store
from observability.audit.chain import Signer
from observability.audit.verify import verify_store
from observability.audit.witness import read_heads
from observability.settings import AuditSettings
from tests.stores import fresh_pg_database, redis_prefix
from tests.system.test_kill9 import MODEL, ROOT, _port, _wait_ready

pytestmark = pytest.mark.timeout(240)

KEY = secrets.token_hex(32)  # the boot refuses typed and low-entropy keys


class Load:
    """Clients in a thread of their own; a request is acknowledged once its response is complete."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.acked: list[str] = []
        self.refused: list[dict] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            stream = (n + worker) % 2 == 0
            body = {
                "model": MODEL,
                "stream": stream,
                "messages": [{"role": "user", "content": f"w{worker} {n}"}],
            }
            headers = {"authorization": f"Bearer {self.key}"}
            try:
                if stream:
                    async with client.stream(
                        "POST", self.url + "/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        lines = [line async for line in r.aiter_lines()]
                        if (
                            r.status_code == 200
                            and lines
                            and lines[-1] == "data: [DONE]"
                            and not any('"error"' in line for line in lines)
                        ):
                            self.acked.append(r.headers["x-request-id"])
                        elif r.status_code == 503:
                            self.refused.append({"stream": True, "lines": lines})
                else:
                    r = await client.post(self.url + "/v1/chat/completions", json=body, headers=headers)
                    if r.status_code == 200 and r.json()["choices"]:
                        self.acked.append(r.headers["x-request-id"])
                    elif r.status_code == 503:
                        self.refused.append(r.json())
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.05)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=15) as client:
            await asyncio.gather(*(self._one(client, w) for w in range(6)))

    def start(self) -> Load:
        self._thread.start()
        return self

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acked) < n:
            assert time.monotonic() < deadline, f"only {len(self.acked)} of {n} requests were acknowledged"
            time.sleep(0.02)

    def join(self) -> None:
        self.stop.set()
        self._thread.join(30)


class StoreLock:
    """The store's writes blocked by another client, as an outage or a long maintenance lock does."""

    def __init__(self, audit: dict) -> None:
        self.audit = audit
        self._sqlite: sqlite3.Connection | None = None
        self._release = threading.Event()
        self._held = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StoreLock:
        if self.audit["store"] == "sqlite":
            self._sqlite = sqlite3.connect(self.audit["sqlite_path"], isolation_level=None, timeout=30)
            self._sqlite.execute("BEGIN EXCLUSIVE")
            return self

        async def hold() -> None:
            conn = await asyncpg.connect(self.audit["postgres_dsn"])
            try:
                async with conn.transaction():
                    await conn.execute("LOCK TABLE audit_log IN ACCESS EXCLUSIVE MODE")
                    self._held.set()
                    while not self._release.is_set():  # noqa: ASYNC110 - a threading.Event, set from the test's thread
                        await asyncio.sleep(0.05)
            finally:
                await conn.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(hold()), daemon=True)
        self._thread.start()
        assert self._held.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sqlite is not None:
            self._sqlite.execute("ROLLBACK")
            self._sqlite.close()
        else:
            self._release.set()
            assert self._thread is not None
            self._thread.join(30)


def _start(cfg: Path, port: int, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def _chain(audit: AuditSettings, witness: Path):
    store = build_store(audit)
    await store.open()
    try:
        kinds: Counter[tuple[str, str]] = Counter()
        after = 0
        while rows := await store.rows(after, 1000):
            kinds.update((r.kind, r.request_id) for r in rows if r.request_id)
            after = rows[-1].seq
        report = await verify_store(
            store, Signer.from_settings(audit.signing), read_heads(witness), require_covered=True
        )
    finally:
        await store.close()
    return kinds, report


def _run(tmp_path: Path, audit: dict, mode: str) -> None:
    upstream_port, port = _port(), _port()
    key = mint_key()
    witness = tmp_path / "heads.jsonl"
    spool = tmp_path / "audit.spool"
    audit = {
        **audit,
        "on_unavailable": mode,
        "ack_timeout_s": 2.0,
        "spool_path": str(spool),
        "witness_path": str(witness),
        "checkpoint_every": 20,
        "signing": {"key": KEY},
    }
    doc = {
        "engines": [
            {
                "name": "text-vllm",
                "kind": "vllm",
                "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                "model": "scripted",
                "variant": "fp16",
                "serves": [MODEL],
            }
        ],
        "tenants": [{"name": "acme"}],
        "api_keys": [{"id": key.id, "tenant": "acme", "sha256": key.sha256}],
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": audit,
        "logging": {"level": "info", "json": True},
    }
    cfg = tmp_path / "omnigate.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    log = tmp_path / "gateway.log"
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.upstream",
            "--port",
            str(upstream_port),
            "--flavour",
            "vllm",
            "--chunks",
            "6",
            "--chunk-delay-ms",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    gateway = _start(cfg, port, log)
    procs = [upstream, gateway]
    try:
        _wait_ready(f"http://127.0.0.1:{upstream_port}/health", upstream)
        _wait_ready(url + "/readyz", gateway)
        load = Load(url, key.key).start()
        try:
            load.wait_for(30)
            with StoreLock(audit):
                before = len(load.acked)
                if mode == "spool":
                    load.wait_for(before + 40)  # served from the journal while the store is locked
                    assert spool.stat().st_size > 0
                else:
                    deadline = time.monotonic() + 60
                    while len(load.refused) < 5:
                        assert time.monotonic() < deadline, (
                            "requests were not refused while the store was locked"
                        )
                        time.sleep(0.02)
                os.kill(gateway.pid, signal.SIGKILL)
                gateway.wait(10)
            load.join()
        finally:
            load.stop.set()
        if mode == "refuse":
            for body in load.refused:
                if "error" in body:
                    assert body["error"]["code"] in ("audit_unavailable", "overloaded"), body
        # The store is back. A port of its own: the killed process's port is free for any new socket by
        # now, an outgoing connection's included, so binding it again could fail for reasons of the test's.
        port = _port()
        url = f"http://127.0.0.1:{port}"
        gateway = _start(cfg, port, log)
        procs.append(gateway)
        try:
            _wait_ready(url + "/readyz", gateway)
        except RuntimeError as exc:  # say why the restart failed, not only that it did
            raise RuntimeError(f"{exc}; the gateway's log ends: {log.read_text()[-3000:]}") from None
        deadline = time.monotonic() + 60
        while spool.exists() and spool.stat().st_size > 0:
            assert time.monotonic() < deadline, "the spool was not replayed"
            time.sleep(0.1)
        gateway.send_signal(signal.SIGTERM)  # a graceful stop seals the head
        gateway.wait(60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    settings = AuditSettings.model_validate(audit)
    kinds, report = asyncio.run(_chain(settings, witness))
    acked = load.acked
    assert len(acked) >= 30
    missing = [rid for rid in acked if kinds[("request", rid)] == 0]
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged requests have no record: {missing[:5]}"
    twice = [rid for rid in acked if kinds[("request", rid)] > 1]
    assert not twice, f"records written twice: {twice[:5]}"
    assert report.ok, report.problem
    assert report.checkpoints_signed >= 1


def test_store_locked_kill9_restart_spool_sqlite(tmp_path):
    _run(tmp_path, {"store": "sqlite", "sqlite_path": str(tmp_path / "audit.db")}, "spool")


def test_store_locked_kill9_restart_refuse_sqlite(tmp_path):
    _run(tmp_path, {"store": "sqlite", "sqlite_path": str(tmp_path / "audit.db")}, "refuse")


def test_store_locked_kill9_restart_spool_postgres(tmp_path):
    with fresh_pg_database("omnigate_outage") as dsn:
        _run(tmp_path, {"store": "postgres", "postgres_dsn": dsn}, "spool")


def test_store_locked_kill9_restart_refuse_postgres(tmp_path):
    with fresh_pg_database("omnigate_outage") as dsn:
        _run(tmp_path, {"store": "postgres", "postgres_dsn": dsn}, "refuse")
