"""openai-node's realtime client (``OpenAIRealtimeWS`` from ``openai/realtime/ws``, on the ``ws`` package),
unmodified, in a spoken two-turn conversation through ``/v1/realtime`` over the scripted vLLM-Omni.

The SDK always opens ``wss://``, so the gateway is reached through a TLS terminator (as deployed, behind
one) whose self-signed certificate node is told to trust (``NODE_EXTRA_CA_CERTS``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import subprocess
from pathlib import Path

import pytest

from tests.conftest import OMNI_MODEL
from tests.harness import wait_until
from tests.http.realtime_helpers import RATE, tone
from tests.node import sdk
from tests.upstream import Script

pytestmark = pytest.mark.timeout(600)  # node and npm come from scripts/test-env.sh

FIRST = "Good morning to you."
SECOND = "The second answer."


def _certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _tls_terminator(port: int, cert: Path, key: Path) -> asyncio.Server:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return await asyncio.start_server(relay, "127.0.0.1", 0, ssl=ctx)


@pytest.fixture
def tls_url(gateway, tmp_path, monkeypatch):
    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("NODE_EXTRA_CA_CERTS", str(cert))
    server = gateway.bg.run(_tls_terminator(gateway.port, cert, key))
    yield f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    server.close()


def test_a_two_turn_spoken_conversation_through_openai_node(tls_url, ups):
    ups.omni_a.enqueue(Script(flavour="omni", text=FIRST), Script(flavour="omni", text=SECOND))
    turns = [base64.b64encode(tone(0.5)).decode(), base64.b64encode(tone(0.4, hz=660)).decode()]
    got = sdk.call(tls_url, "realtime", {"model": OMNI_MODEL, "turns": turns}, timeout=120)
    events = got["events"]
    assert not [e for e in events if e["type"] in ("error", "sdk_error")], events
    done = [e for e in events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["completed", "completed"]
    words = [d["response"]["output"][0]["content"][0]["transcript"] for d in done]
    assert words == [FIRST, SECOND]
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    assert len(audio) > RATE  # seconds of PCM16 at 24 kHz
    roles = [m["role"] for m in ups.omni_a.requests[-1]["messages"]]
    assert roles == ["user", "assistant", "user"]


def test_a_barge_in_through_openai_node_aborts_the_engine_request(tls_url, ups):
    """openai-node's client as a voice app drives it when its caller speaks over the answer: response.cancel,
    then conversation.item.truncate at what was played. The engine's request is aborted, and the next turn
    carries only the words of the audio that was played."""
    ups.omni_a.enqueue(
        Script(
            flavour="omni",
            text="one two three four five six seven eight nine ten",
            audio_chunks=60,
            chunk_delay_s=0.1,
        ),
        Script(flavour="omni", text=SECOND),
    )
    turns = [base64.b64encode(tone(0.5)).decode(), base64.b64encode(tone(0.4, hz=660)).decode()]
    job = {"model": OMNI_MODEL, "turns": turns, "barge_in": {"at": "response.output_audio.delta"}}
    got = sdk.call(tls_url, "realtime", job, timeout=120)
    events = got["events"]
    assert not [e for e in events if e["type"] in ("error", "sdk_error")], events
    done = [e for e in events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["cancelled", "completed"]
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=5)
    assert any(e["type"] == "conversation.item.truncated" for e in events)
    full = done[0]["response"]["output"][0]["content"][0]["transcript"]
    spoken = next(m for m in ups.omni_a.requests[-1]["messages"] if m["role"] == "assistant")["content"]
    assert full.startswith(spoken) and len(spoken) < len(full)  # what was not played left the context
