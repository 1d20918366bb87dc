"""A real ``omnigate serve`` process under load, killed with SIGKILL: every acknowledged request has its record.

Also: SIGHUP reloads the config of the running process, and no API key reaches its log output.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.tenants import mint_key
from observability.audit.backends import build_store
from observability.audit.chain import Signer
from observability.audit.verify import verify_store
from observability.settings import AuditSettings
from tests.stores import fresh_pg_database, redis_prefix

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "text-model"
CHECKPOINT_KEY = secrets.token_hex(32)  # the boot refuses typed keys
ADMIN_KEY = secrets.token_hex(32)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _config(upstream_port: int, audit: dict, tenants: list, keys: list) -> dict:
    return {
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
        "tenants": tenants,
        "api_keys": keys,
        "admin": {"api_key": ADMIN_KEY},
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": {**audit, "signing": {"key": CHECKPOINT_KEY}, "checkpoint_every": 25},
        "logging": {"level": "info", "json": True},
    }


async def _load(url: str, key: str, acked: list[str], stop: asyncio.Event, prefix: str) -> None:
    """Concurrent clients, half streaming; a request counts as acknowledged once its response is complete."""
    headers = {"authorization": f"Bearer {key}"}
    n = 0

    async def one(client: httpx.AsyncClient, worker: int) -> None:
        nonlocal n
        while not stop.is_set():
            n += 1
            rid = f"{prefix}-{worker}-{n}"
            stream = n % 2 == 0
            body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": f"req {rid}"}]}
            try:
                if stream:
                    async with client.stream(
                        "POST",
                        url + "/v1/chat/completions",
                        json=body,
                        headers={**headers, "x-request-id": rid},
                    ) as r:
                        lines = [line async for line in r.aiter_lines()]
                    if (
                        r.status_code == 200
                        and lines
                        and lines[-1] == "data: [DONE]"
                        and not any('"error"' in line for line in lines)
                    ):
                        acked.append(rid)
                else:
                    r = await client.post(
                        url + "/v1/chat/completions", json=body, headers={**headers, "x-request-id": rid}
                    )
                    if r.status_code == 200 and r.json()["choices"]:
                        acked.append(rid)
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.05)
                if stop.is_set():
                    return

    async with httpx.AsyncClient(timeout=10) as client:
        await asyncio.gather(*(one(client, w) for w in range(12)))


async def _kill_under_load(url: str, key: str, gateway: subprocess.Popen) -> list[str]:
    acked: list[str] = []
    stop = asyncio.Event()
    task = asyncio.create_task(_load(url, key, acked, stop, "k"))
    deadline = time.monotonic() + 60
    while len(acked) < 80 and time.monotonic() < deadline:  # noqa: ASYNC110 - a count the clients grow, polled until it is high enough
        await asyncio.sleep(0.01)
    os.kill(gateway.pid, signal.SIGKILL)  # mid-load: requests are in flight
    killed_at = len(acked)
    gateway.wait(10)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert killed_at >= 80, "the load never got going"
    return acked


async def _records(audit: AuditSettings) -> tuple[set[str], object]:
    store = build_store(audit)
    await store.open()
    try:
        ids: set[str] = set()
        after = 0
        while rows := await store.rows(after, 1000):
            # The id each request was sent with; the record's request_id is the gateway's own.
            ids.update(
                json.loads(r.data)["payload"]["client_request_id"] for r in rows if r.kind == "request"
            )
            after = rows[-1].seq
        report = await verify_store(store, Signer.from_settings(audit.signing))
    finally:
        await store.close()
    return ids, report


def _run(tmp_path: Path, audit: dict, reload_with_sighup: bool) -> None:
    upstream_port, port = _port(), _port()
    key, later = mint_key(), mint_key()
    cfg = tmp_path / "omnigate.yaml"
    doc = _config(
        upstream_port, audit, [{"name": "acme"}], [{"id": key.id, "tenant": "acme", "sha256": key.sha256}]
    )
    cfg.write_text(yaml.safe_dump(doc))
    log_path = tmp_path / "gateway.log"
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
            "12",
            "--chunk-delay-ms",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"http://127.0.0.1:{upstream_port}/health", upstream)
        _wait_ready(url + "/readyz", gateway)
        if reload_with_sighup:
            doc["tenants"].append({"name": "later"})
            doc["api_keys"].append({"id": later.id, "tenant": "later", "sha256": later.sha256})
            cfg.write_text(yaml.safe_dump(doc))
            probe = {"authorization": f"Bearer {later.key}"}
            assert httpx.get(url + "/v1/models", headers=probe).status_code == 401
            gateway.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while httpx.get(url + "/v1/models", headers=probe).status_code != 200:
                assert time.monotonic() < deadline, "SIGHUP did not reload the config"
                time.sleep(0.05)
            cfg.write_text("tenants: [{name: broken, policy_set: nowhere}]\n")
            gateway.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while b"config_reload_failed" not in log_path.read_bytes():
                assert time.monotonic() < deadline, "the refused reload was not logged"
                time.sleep(0.05)
            assert httpx.get(url + "/v1/models", headers=probe).status_code == 200  # old config kept
            minted = httpx.post(
                url + "/admin/keys", json={"tenant": "acme"}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
            ).json()["key"]
            assert (
                httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {minted}"}).status_code
                == 200
            )
        acked = asyncio.run(_kill_under_load(url, key.key, gateway))
    finally:
        for proc in (gateway, upstream):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    settings = AuditSettings.model_validate(doc["audit"])
    recorded, report = asyncio.run(_records(settings))
    missing = [rid for rid in acked if rid not in recorded]
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged requests have no record: {missing[:5]}"
    assert report.ok, report.problem
    assert report.checkpoints_signed >= 1
    output = log_path.read_bytes().decode(errors="replace")
    assert "audit_checkpoint" in output
    secrets_ = [key.key, later.key] + ([minted] if reload_with_sighup else [])
    for k in secrets_:
        assert k not in output and k.split("_", 2)[2] not in output


def test_kill9_under_load_sqlite(tmp_path):
    _run(tmp_path, {"store": "sqlite", "sqlite_path": str(tmp_path / "audit.db")}, reload_with_sighup=True)


def test_kill9_under_load_postgres(tmp_path):
    with fresh_pg_database("omnigate_kill9") as dsn:
        _run(tmp_path, {"store": "postgres", "postgres_dsn": dsn}, reload_with_sighup=False)
