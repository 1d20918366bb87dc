"""A client that stops reading holds nothing for long: every write to a client has a deadline.

Raw sockets with a small receive buffer that never read, against a served gateway whose write deadline
(``server.stream_write_timeout_s``) is short. A streamed speech answer is cut once the buffers are full
and no write makes progress: the engine request is aborted, the slot goes back (another tenant is
served), and the audit record says ``client_stalled``. A large JSON answer is written in pieces under the
same deadline, so the server does not keep the whole of it buffered for a client that never takes it.
"""

from __future__ import annotations

import socket
import sqlite3

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, eventually
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

# About six minutes of speech: tens of megabytes of base64, far more than the kernel and the server buffer.
LONG_SPEECH = Script(flavour="omni", text=" ".join(["word"] * 1200), audio_seconds_per_chunk=1.0)
SPEECH = {
    "model": OMNI_MODEL,
    "messages": [{"role": "user", "content": "Talk to me for a long time."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Ethan", "format": "wav"},
}
WRITE_TIMEOUT_S = 1.0


@pytest.fixture
def serve(bg, upstreams, tmp_path):
    servers: list[GatewayServer] = []

    def _make(**extra) -> GatewayServer:
        upstreams.reset()
        db = tmp_path / f"audit-{len(servers)}.db"
        settings = gateway_settings(
            upstreams,
            PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
            audit={"sqlite_path": str(db)},
            server={"stream_write_timeout_s": WRITE_TIMEOUT_S},
            **extra,
        )
        server = GatewayServer(bg, settings, CollectorRegistry()).start()
        server.db = db
        servers.append(server)
        return server

    yield _make
    for s in servers:
        s.stop()


def _record(server: GatewayServer, rid: str) -> dict | None:
    db = sqlite3.connect(server.db)
    try:
        row = db.execute(
            "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?", (rid,)
        ).fetchone()
    finally:
        db.close()
    return None if row is None else orjson.loads(row[0])["payload"]


def _never_reading(port: int, body: dict, headers: dict[str, str]) -> socket.socket:
    """A connection that sends its request and then reads nothing, with a receive buffer kept small."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    raw = orjson.dumps(body)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n{head}\r\n"
        ).encode()
        + raw
    )
    return sock


def _script(upstreams) -> None:
    """Both speech engines answer at length (the first may be left for the second if slow to start)."""

    def set_both() -> None:
        upstreams.omni_a.default = LONG_SPEECH
        upstreams.omni_b.default = LONG_SPEECH

    upstreams.bg.call(set_both)


def _tenants() -> tuple[dict, dict[str, dict[str, str]]]:
    keys = {name: mint_key() for name in ("acme", "globex")}
    extra = {
        "tenants": [{"name": "acme"}, {"name": "globex"}],
        "api_keys": [{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
    }
    return extra, {name: {"authorization": f"Bearer {k.key}"} for name, k in keys.items()}


async def test_a_stream_nobody_reads_is_cut_and_gives_its_slot_back(serve, upstreams):
    extra, auth = _tenants()
    # One slot for the whole gateway: while the stalled stream holds it, every other request is refused.
    server = serve(traffic={"soft_limit": 1, "hard_limit": 1}, **extra)
    omni = (upstreams.omni_a, upstreams.omni_b)
    _script(upstreams)

    def total(attr: str) -> int:
        return server.bg.call(lambda: sum(getattr(u, attr) for u in omni))

    sock = _never_reading(
        server.port, {**SPEECH, "stream": True}, {**auth["acme"], "x-client-request-id": "stalled"}
    )
    try:
        assert await eventually(lambda: total("request_count") >= 1, timeout=10)

        def admitted() -> int:
            return server.bg.call(lambda: server.services.admission.store.count)

        assert admitted() == 1
        # The buffers fill, no write makes progress for the deadline, and the stream is cut.
        assert await eventually(lambda: admitted() == 0, timeout=30), "the stalled stream kept its slot"
        # The engine saw the request aborted (the first engine may also have been left for slowness).
        assert await eventually(lambda: total("aborts") == total("request_count"), timeout=10)
        async with httpx.AsyncClient(timeout=20) as client:
            other = await client.post(
                server.url + "/v1/chat/completions",
                json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi."}]},
                headers=auth["globex"],
            )
        assert other.status_code == 200, other.text
        assert await eventually(lambda: _record(server, "stalled") is not None, timeout=10)
        record = _record(server, "stalled")
        assert (record["outcome"], record["status"], record["error_code"]) == (
            "cancelled",
            499,
            "client_stalled",
        )
        assert total("completed") == 0  # no engine ran the answer to its end
    finally:
        sock.close()


async def test_a_json_answer_nobody_reads_is_not_held_whole(serve, upstreams):
    server = serve(traffic={"soft_limit": 1, "hard_limit": 1})
    _script(upstreams)
    sock = _never_reading(server.port, {**SPEECH, "stream": False}, {"x-client-request-id": "json"})
    try:
        assert await eventually(lambda: _record(server, "json") is not None, timeout=30)
        assert _record(server, "json")["outcome"] == "served"

        def held() -> list[tuple[bool, int]]:
            conns = server.server.server_state.connections
            return [(c.transport.is_closing(), c.transport.get_write_buffer_size()) for c in conns]

        # Past the deadline the server gives up on this client: its connection is being closed and what
        # the server keeps of the answer for it is a piece or two, not the whole answer.
        assert await eventually(
            lambda: all(closing and size < 1024 * 1024 for closing, size in server.bg.call(held)),
            timeout=10 + 4 * WRITE_TIMEOUT_S,
        ), server.bg.call(held)
        assert server.bg.call(lambda: server.services.admission.store.count) == 0
    finally:
        sock.close()
