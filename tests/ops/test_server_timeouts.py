"""The gateway's own server closes a connection whose request head does not arrive in time.

The Helm chart serves ``omnigate serve`` with no proxy in front, and uvicorn has no header timeout of
its own: half-sent requests stayed open for good. ``server.header_timeout_s`` bounds the time from a
connection's start (or a request's first byte) to the end of its head; ``server.body_timeout_s``
bounds the body, ``server.keepalive_timeout_s`` an idle connection between requests, and
``server.max_header_bytes`` the size of a head (httptools has no cap of its own). The chart sets the
three timeouts, and the gateway is started here from the rendered chart, command and config as its
Deployment runs them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import time

import httpx
import pytest
import yaml

from tests.harness import free_port, omnigate_command, wait_until
from tests.ops.test_helm_chart import one, render

pytestmark = pytest.mark.timeout(120)

HEADER_TIMEOUT_S = 2
# A hang must fail the test fast, not hold it: the most any read below waits.
GUARD_S = HEADER_TIMEOUT_S + 20


def _values(**server: object) -> dict:
    """Values for a test render: one replica on its own stores, no metrics port, a chain without models."""
    return {
        "directory": {"backend": "sqlite"},
        "audit": {"store": "sqlite", "witness": {"claimName": ""}},
        "redis": {"existingSecret": ""},
        "autoscaling": {"enabled": False},
        "replicaCount": 1,
        "metrics": {"port": 0},
        "config": {
            "server": server,
            "policies": {"pre": [{"name": "request-limits"}], "stream": [], "post": []},
        },
    }


def test_the_rendered_chart_carries_the_server_timeouts():
    objects = render()
    config = yaml.safe_load(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    server = config["server"]
    assert 0 < server["header_timeout_s"] <= 30
    assert 0 < server["body_timeout_s"] <= 120
    assert 0 < server["keepalive_timeout_s"] <= 75
    changed = render({"config": {"server": {"header_timeout_s": 5}}})
    assert (
        yaml.safe_load(changed[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])["server"][
            "header_timeout_s"
        ]
        == 5
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``omnigate serve`` as the chart's Deployment starts it: its args and config, its env's values."""
    tmp = tmp_path_factory.mktemp("chart")
    objects = render(_values(header_timeout_s=HEADER_TIMEOUT_S))
    config = objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"]
    (tmp / "omnigate.yaml").write_text(config)
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    secrets = {
        (name, key): base64.b64decode(value).decode()
        for (kind, name), obj in objects.items()
        if kind == "Secret"
        for key, value in obj["data"].items()
    }
    env = dict(os.environ)
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
    port = free_port()
    args = list(container["args"])
    # The rendered command, on this machine's loopback and a free port; its config at the test's path.
    args[args.index("--config") + 1] = str(tmp / "omnigate.yaml")
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        [*omnigate_command(), *args], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError((tmp / "serve.log").read_text()[-3000:])
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(up, timeout=90, interval=0.2), (tmp / "serve.log").read_text()[-3000:]
        yield port, url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _closed_by_server(sock: socket.socket) -> tuple[bool, bytes]:
    """Read until the server closes the connection (or the guard runs out: then False)."""
    sock.settimeout(GUARD_S)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got
    return True, got


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, sent nothing
        b"POST /v1/chat/completions HT",  # half a request line
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: appl",  # half the headers
    ],
    ids=["nothing", "half-a-request-line", "half-the-headers"],
)
def test_a_half_sent_request_head_is_closed_by_the_deadline(served, sent):
    port, url = served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        closed, got = _closed_by_server(sock)
        assert closed, f"still open after {time.monotonic() - start:.1f} s"
        assert b"200 OK" not in got
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200  # the server itself is unaffected


def test_a_trickled_head_is_closed_even_while_bytes_keep_coming(served):
    # Slowloris: a byte now and then does not move the deadline, which runs from the request's start.
    port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        deadline = time.monotonic() + GUARD_S
        closed = False
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.5)
            try:
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
        assert closed


def test_many_half_sent_requests_do_not_hold_the_server(served):
    port, url = served
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n")
        assert all(_closed_by_server(s)[0] for s in socks)
    finally:
        for s in socks:
            s.close()
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200


def test_a_whole_request_is_served_and_keep_alive_still_works(served):
    _, url = served
    with httpx.Client(base_url=url, timeout=5) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/healthz").status_code == 200  # the same connection, a second request


# -- both of uvicorn's HTTP implementations, in process -------------------------------------------------
async def _hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["httptools", "h11"])
def plain_server(request, bg):
    import asyncio

    import uvicorn

    from gateway.header_deadline import protocol_class

    port = free_port()
    config = uvicorn.Config(
        _hello, host="127.0.0.1", port=port, http=protocol_class(HEADER_TIMEOUT_S, request.param),
        lifespan="off", log_config=None, access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config)

    async def start() -> asyncio.Task[None]:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # it failed to start: say why
            await asyncio.sleep(0.01)
        return task

    task = bg.run(start())
    yield port

    async def stop() -> None:
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    bg.run(stop())


def test_each_http_implementation_closes_a_half_sent_head_and_serves_a_whole_one(plain_server):
    port = plain_server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert _closed_by_server(sock)[0]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        # A whole request, then half of a second one on the same connection: the deadline starts again.
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\nHo")
        assert _closed_by_server(sock)[0]
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"


# -- the size of a request head ---------------------------------------------------------------------------
MAX_HEADER_BYTES = 16 * 1024


def _send_head(port: int, head: bytes) -> tuple[bool, bytes]:
    """Send ``head`` (as much of it as the server takes) and read what comes back until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            for i in range(0, len(head), 64 * 1024):
                sock.sendall(head[i : i + 64 * 1024])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while it was still coming: what was answered is read below
        return _closed_by_server(sock)


def _one_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (its head and body may come in separate reads)."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(4096)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _refused_as_too_large(closed: bool, got: bytes) -> bool:
    """431 in OpenAI's error shape, or (the answer lost to a reset) a close without an answer."""
    if not closed:
        return False
    if not got:
        return True
    head, _, body = got.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 431"):
        return False
    import orjson

    err = orjson.loads(body)["error"]
    return err["code"] == "request_header_fields_too_large" and err["type"] == "invalid_request_error"


def _big_heads(limit: int) -> dict[str, bytes]:
    return {
        "one-huge-header": b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (limit * 4) + b"\r\n\r\n",
        "many-headers": b"GET / HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(limit // 50))
        + b"\r\n",
        "huge-url": b"GET /?" + b"q" * (limit * 2) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "never-ending-header": b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (limit * 8),
    }


@pytest.fixture(params=["httptools", "h11"])
def capped_server(request, bg):
    import asyncio

    import uvicorn

    from gateway.header_deadline import protocol_class

    port = free_port()
    http = protocol_class(HEADER_TIMEOUT_S, request.param, max_header_bytes=MAX_HEADER_BYTES)
    config = uvicorn.Config(_hello, host="127.0.0.1", port=port, http=http, lifespan="off", log_config=None,
                            access_log=False)  # fmt: skip
    server = uvicorn.Server(config)

    async def start() -> asyncio.Task[None]:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return task

    task = bg.run(start())
    yield port

    async def stop() -> None:
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    bg.run(stop())


@pytest.mark.parametrize("kind", list(_big_heads(MAX_HEADER_BYTES)))
def test_each_http_implementation_refuses_a_request_head_over_the_cap(capped_server, kind):
    port = capped_server
    closed, got = _send_head(port, _big_heads(MAX_HEADER_BYTES)[kind])
    assert _refused_as_too_large(closed, got), got[:300]
    # A head under the cap is served, with a body in the same packet, and the server itself is unaffected.
    fits = b"POST / HTTP/1.1\r\nHost: x\r\nX-Fits: " + b"f" * (MAX_HEADER_BYTES // 2) + b"\r\n"
    body = b"z" * (MAX_HEADER_BYTES * 4)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(fits + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"


def test_the_served_gateway_refuses_megabytes_of_headers(served):
    # omnigate serve with the chart's config: server.max_header_bytes (64 KiB) bounds a request head.
    port, url = served
    head = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * (2 * 1024 * 1024) + b"\r\n\r\n"
    closed, got = _send_head(port, head)
    assert _refused_as_too_large(closed, got), got[:300]
    assert b"200 OK" not in got
    ok = httpx.get(url + "/healthz", headers={"x-fits": "f" * 16 * 1024}, timeout=5)
    assert ok.status_code == 200


def test_a_later_request_on_a_kept_alive_connection_is_capped_too(capped_server):
    port = capped_server
    body = b"z" * (MAX_HEADER_BYTES * 4)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.settimeout(5)
        first = _one_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(_big_heads(MAX_HEADER_BYTES)["one-huge-header"])
        assert _refused_as_too_large(*_closed_by_server(sock))
