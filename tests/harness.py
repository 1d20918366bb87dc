"""Real servers for tests: the scripted upstream and the gateway under uvicorn, on a background loop.

Both run in one thread with its own event loop, so tests may use blocking
clients (the official ``openai`` SDK) without starving the servers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.settings import Settings

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def _call() -> T:
            return fn()

        return self.run(_call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class GatewayServer:
    """omnigate under a real uvicorn server on an ephemeral port."""

    def __init__(
        self,
        bg: BackgroundLoop,
        settings: Settings,
        registry: CollectorRegistry | None = None,
        plugins: dict[str, type] | None = None,
        config_path: str | None = None,
    ) -> None:
        self.bg = bg
        self.registry = registry or CollectorRegistry()
        self.app = create_app(settings, registry=self.registry, plugins=plugins, config_path=config_path)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=0,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def services(self):
        return self.app.state.services

    def start(self, ready_timeout: float = 120.0, wait_ready: bool = True) -> GatewayServer:
        async def _start() -> None:
            self._task = asyncio.create_task(self.server.serve())
            while not self.server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.01)

        self.bg.run(_start())
        if wait_ready:
            deadline = time.monotonic() + ready_timeout
            while not self.bg.call(lambda: self.services.pool.ready):
                if time.monotonic() > deadline:
                    raise TimeoutError("gateway engines never became healthy")
                time.sleep(0.05)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def _stop() -> None:
            self.server.should_exit = True
            if self._task is None:
                return
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 15)
                return
            except TimeoutError:
                # Say where the shutdown is slow: every task of the loop, with its stack.
                print("gateway stop still running after 15 s; its tasks:", file=sys.stderr)
                for task in asyncio.all_tasks():
                    task.print_stack(limit=12, file=sys.stderr)
            # One resource's close may take up to its own budget (gateway/services.py _CLOSE_S, 15 s)
            # before it is abandoned and logged; a stop is stuck only when it outlasts that too.
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 30)
            except TimeoutError:
                self._task.cancel()
                raise

        self.bg.run(_stop())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def omnigate_command() -> list[str]:
    script = Path(sys.executable).with_name("omnigate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]


class ServeProcess:
    """A real ``omnigate serve`` process on a port of its own, its output in ``log``."""

    #: names the process in the error raised when it exits early
    role = "gateway"

    def __init__(self, config: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.log_path = log
        self.proc = subprocess.Popen(
            [*omnigate_command(), "serve", "--config", str(config), "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.role} exited: {self.log_path.read_text()[-2000:]}")
        try:
            return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def eventually(predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = predicate()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return True
        await asyncio.sleep(0.01)
    return False


def audit_payload(url: str, admin_key: str, request_id: str, timeout: float = 10) -> dict[str, Any]:
    """The payload of a request's audit record, through the admin API, once it is written."""
    headers = {"authorization": f"Bearer {admin_key}"}
    found: list[dict[str, Any]] = []

    def written() -> bool:
        got = httpx.get(url + "/admin/audit/records", params={"request_id": request_id}, headers=headers)
        found[:] = got.json()["records"]
        return bool(found)

    assert wait_until(written, timeout=timeout), f"no audit record of {request_id}"
    r = httpx.get(url + f"/admin/audit/records/{found[0]['seq']}", headers=headers)
    assert r.status_code == 200, r.text
    payload: dict[str, Any] = r.json()["data"]["payload"]
    return payload
