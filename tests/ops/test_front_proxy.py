"""The nginx front proxy of ops/proxy in front of a real gateway: rendered the way the nginx
image renders it (envsubst over the OMNIGATE_* variables), checked by ``nginx -t``, then run.

What it must do: cut off clients that dribble their request head or stall their body (uvicorn
alone waits for them), cap connections per address, refuse absurd bodies, all in OpenAI's
error shape; and pass streams on frame by frame, with client disconnects reaching the engine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TEXT_MODEL
from tests.harness import wait_until
from tests.ops.catalogue import OPS
from tests.ops.tools import run
from tests.upstream import Script

TEMPLATE = OPS / "proxy" / "omnigate.conf.template"
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 4  # also how long the held connections of the per-address test stay counted
CONN_PER_ADDRESS = 3
MAX_BODY = 1024 * 1024
HANG_GUARD_S = 30  # generous bound against hangs, never a performance assertion


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
    if path is None:
        pytest.skip(f"{name} not found: install Debian's nginx and gettext-base packages (.ci/run does)")
    return path


def render_template(upstream: str, port: int) -> str:
    env = {
        "OMNIGATE_UPSTREAM": upstream,
        "OMNIGATE_PROXY_PORT": f"127.0.0.1:{port}",
        "OMNIGATE_PROXY_RESOLVER": "127.0.0.1",
        "OMNIGATE_PROXY_HEADER_TIMEOUT": f"{HEADER_TIMEOUT_S}s",
        "OMNIGATE_PROXY_BODY_TIMEOUT": f"{BODY_TIMEOUT_S}s",
        "OMNIGATE_PROXY_SEND_TIMEOUT": "10s",
        "OMNIGATE_PROXY_READ_TIMEOUT": "60s",
        "OMNIGATE_PROXY_MAX_BODY": str(MAX_BODY),
        "OMNIGATE_PROXY_CONN_PER_ADDRESS": str(CONN_PER_ADDRESS),
    }
    # As the nginx image does: substitute exactly the defined variables, leave nginx's own alone.
    shell_format = " ".join(f"${{{k}}}" for k in env)
    result = run(
        [_binary("envsubst"), shell_format],
        stdin=TEMPLATE.read_text(),
        env={**env, "PATH": os.environ["PATH"]},
    )
    assert result.returncode == 0, result.stderr
    assert "${" not in result.stdout
    return result.stdout


class Nginx:
    def __init__(self, workdir: Path, upstream: str) -> None:
        self.port = _free_port()
        self.dir = workdir
        for sub in ("body", "proxy", "logs"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
            (workdir / sub).chmod(0o777)  # workers drop to an unprivileged user when started as root
        (workdir / "omnigate.conf").write_text(render_template(upstream, self.port))
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(f"""
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/logs/error.log warn;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    include {workdir}/omnigate.conf;
}}
""")
        self.proc: subprocess.Popen | None = None

    def check(self) -> subprocess.CompletedProcess[str]:
        return run([_binary("nginx"), "-t", "-c", str(self.conf), "-p", str(self.dir)])

    def start(self) -> Nginx:
        with open(self.dir / "logs" / "stdout.log", "wb") as out:  # nginx keeps its own descriptor
            self.proc = subprocess.Popen(
                [_binary("nginx"), "-c", str(self.conf), "-p", str(self.dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        assert wait_until(listening, timeout=HANG_GUARD_S, interval=0.05), (
            self.dir / "logs" / "error.log"
        ).read_text()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def proxy(gateway, tmp_path_factory) -> Iterator[Nginx]:
    nginx = Nginx(tmp_path_factory.mktemp("nginx"), f"127.0.0.1:{gateway.port}")
    checked = nginx.check()
    assert checked.returncode == 0, checked.stderr
    nginx.start()
    yield nginx
    nginx.stop()


def _requests_seen(gateway) -> float:
    return sum(
        s.value
        for m in gateway.registry.collect()
        if m.name == "omnigate_requests"
        for s in m.samples
        if s.name == "omnigate_requests_total"
    )


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(HANG_GUARD_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _body(n: int) -> bytes:
    return (
        b'{"model": "'
        + TEXT_MODEL.encode()
        + b'", "messages": [{"role": "user", "content": "'
        + b"x" * n
        + b'"}]}'
    )


def test_nginx_accepts_the_rendered_template(proxy):
    assert proxy.check().returncode == 0


def test_requests_pass_through_with_a_request_id(proxy, ups):
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        timeout=HANG_GUARD_S,
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert len(r.headers["x-request-id"]) == 32  # made by the gateway
    assert len(r.headers["x-client-request-id"]) == 32  # the proxy's id, kept beside it
    r = httpx.get(
        proxy.url + "/v1/models", headers={"x-request-id": "client-chosen-id"}, timeout=HANG_GUARD_S
    )
    # A client cannot choose the gateway's id; its own is echoed as x-client-request-id.
    assert r.status_code == 200 and r.headers["x-request-id"] != "client-chosen-id"
    assert r.headers["x-client-request-id"] == "client-chosen-id"


def test_streams_are_relayed_frame_by_frame_and_disconnects_reach_the_engine(proxy, ups):
    # Forty pieces half a second apart: the whole answer takes twenty seconds upstream.
    ups.vllm.default = Script(flavour="vllm", text=" ".join(f"w{i}" for i in range(40)), chunk_delay_s=0.5)
    with (
        httpx.Client(timeout=HANG_GUARD_S) as client,
        client.stream(
            "POST",
            proxy.url + "/v1/chat/completions",
            json={"model": TEXT_MODEL, "stream": True, "messages": [{"role": "user", "content": "Count."}]},
        ) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: ") and '"content":"w' in line)
        assert '"content":"w0' in first
        # The first words arrived while the engine was still generating: nothing was buffered.
        assert ups.bg.call(lambda: ups.vllm.stats())["completed"] == 0
    # Leaving mid-stream closes the gateway's connection, which closes the engine's request.
    assert wait_until(lambda: ups.bg.call(lambda: ups.vllm.stats())["aborts"] == 1, timeout=HANG_GUARD_S)


def test_a_client_dribbling_its_request_head_is_cut_off(proxy, gateway):
    before = _requests_seen(gateway)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: omnigate\r\nContent-Type: application/json\r\n"
        b"X-Padding: " + b"a" * 200
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_GUARD_S) as sock:
        closed = False
        deadline = time.monotonic() + HANG_GUARD_S
        # One byte every 0.2 s, for ever: the header timeout bounds the whole head, not each read.
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
            assert time.monotonic() < deadline
        assert closed, "the proxy kept a dribbling client"
    assert _requests_seen(gateway) == before  # the gateway never saw it


def test_a_stalled_body_is_cut_off_before_the_gateway(proxy, gateway):
    before = _requests_seen(gateway)
    body = _body(500)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_GUARD_S) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: omnigate\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:20]
        )
        answer = _read_until_closed(sock)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert _requests_seen(gateway) == before


def test_bodies_over_the_limit_get_an_openai_shaped_413(proxy):
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=_body(MAX_BODY + 10),
        headers={"content-type": "application/json"},
        timeout=HANG_GUARD_S,
    )
    assert r.status_code == 413
    assert r.json() == {
        "error": {
            "message": "request body is larger than the front proxy accepts",
            "type": "invalid_request_error",
            "param": None,
            "code": "payload_too_large",
        }
    }


def test_connections_per_address_are_capped(proxy, gateway):
    body = _body(100)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: omnigate\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    held = []
    try:
        # Requests whose head has arrived count against the limit while their body is awaited.
        for _ in range(CONN_PER_ADDRESS):
            s = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_GUARD_S)
            s.sendall(head + body[:10])
            held.append(s)
        refused: list[httpx.Response] = []

        def over_the_limit() -> bool:
            # Until nginx has read the held heads a request may still pass; once it has, none does.
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=HANG_GUARD_S,
            )
            if r.status_code == 429:
                refused.append(r)
                return True
            assert r.status_code == 200, r.text
            return False

        assert wait_until(over_the_limit, timeout=HANG_GUARD_S, interval=0.05)
        r = refused[0]
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "too many concurrent connections from this address",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    finally:
        for s in held:
            s.close()
    # Released: the next request goes through again.
    assert wait_until(
        lambda: httpx.get(proxy.url + "/v1/models", timeout=HANG_GUARD_S).status_code == 200,
        timeout=HANG_GUARD_S,
    )


def test_metrics_stay_private_and_admin_passes_from_loopback(proxy):
    assert httpx.get(proxy.url + "/metrics", timeout=HANG_GUARD_S).status_code == 404
    r = httpx.get(proxy.url + "/admin/engines", timeout=HANG_GUARD_S)
    # Loopback is allowed through; this gateway has no admin key, so the gateway itself answers 404.
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.headers.get("x-request-id")


def test_a_gateway_that_is_down_gets_an_openai_shaped_503(tmp_path):
    dead = Nginx(tmp_path, f"127.0.0.1:{_free_port()}").start()
    try:
        r = httpx.get(dead.url + "/v1/models", timeout=HANG_GUARD_S)
    finally:
        dead.stop()
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"] == {
        "message": "the gateway is unavailable",
        "type": "overloaded_error",
        "param": None,
        "code": "gateway_unavailable",
    }


def test_a_realtime_session_passes_the_proxy(proxy, ups):
    """/v1/realtime's WebSocket upgrade reaches the gateway through the proxy (its default location drops
    the Connection header), and a spoken turn is answered."""
    from tests.conftest import OMNI_MODEL
    from tests.http.realtime_helpers import Client, tone

    ups.omni_a.default = Script(flavour="omni", text="Hello.", audio_chunks=2)
    c = Client(proxy.url, None, model=OMNI_MODEL)
    try:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        c.until("session.updated")
        c.append(tone(0.5))
        c.send({"type": "input_audio_buffer.commit"})
        c.send({"type": "response.create"})
        events = c.until("response.done", timeout=HANG_GUARD_S)
    finally:
        c.close()
    assert events[-1]["response"]["status"] == "completed"
    assert any(e["type"] == "response.output_audio.delta" for e in events)
