"""What was produced is counted and audited when the client leaves mid-answer.

A spoken answer streamed slowly by a scripted vLLM-Omni; the client reads a few events and closes the
connection. The engine's usage never comes (it is in the stream's last chunk), yet the audit record counts
the answer's pieces that were produced and the seconds of speech relayed, and says the count is the
gateway's own (``usage.counted_by``).
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from tests.harness import GatewayServer, audit_payload
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

ADMIN = "3c1f0e9a7b3d2e8f4a6c1b9d0e7f3a2c5b8d4e1f"


@pytest.fixture
def server(bg, tmp_path):
    up = ScriptedUpstream(
        Script(
            flavour="omni",
            text="one two three four five six seven eight nine ten eleven twelve",
            audio_chunks=12,
            audio_interleave=1,
            chunk_delay_s=0.15,
        )
    )
    bg.run(up.start())
    settings = Settings(
        engines=[EngineConfig(name="omni", kind="vllm-omni", base_url=up.base_url, model="m", serves=["m"])],
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield s
    s.stop()
    bg.run(up.stop())


def test_a_client_that_leaves_mid_answer_still_leaves_its_usage(server):
    body = {
        "model": "m",
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "Ethan", "format": "pcm16"},
        "messages": [{"role": "user", "content": "count"}],
    }
    events = 0
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: ") and '"audio"' in line:
                events += 1
            if events >= 4:
                break  # the client hangs up mid-answer
    payload = audit_payload(server.url, ADMIN, rid)
    assert payload["outcome"] == "cancelled"
    usage = payload["usage"]
    assert usage["completion_tokens"] >= 2, usage
    assert usage["audio_seconds"] > 0, usage
    assert usage["counted_by"] == "gateway"
