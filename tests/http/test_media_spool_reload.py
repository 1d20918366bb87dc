"""The media spool right after a hot reload: a large base64 part is spooled, reaches the engine as the
client sent it through the new chain's media steps, and leaves no file behind."""

from __future__ import annotations

import base64
import gc
import os
import secrets
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry

from core import spooled
from gateway.api.body import SPOOL_MIN
from gateway.settings import load_settings
from gateway.tenants import mint_key
from policies.registry import available_plugins
from tests.conftest import OMNI_MODEL
from tests.harness import GatewayServer
from tests.media import tone, wav
from tests.plugins import PLUGINS
from tests.stores import redis_prefix

pytestmark = pytest.mark.timeout(240)

ADMIN_KEY = secrets.token_hex(32)
AUDIO = wav(tone(40.0), 16000)  # 1.28 MB at 16 kHz: forwarded as sent


def _files() -> set[str]:
    return {f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{os.getpid()}-")}


def _chain(tag: str) -> dict:
    # The recorder ends each answer with ``[tag]``: the client sees which chain served it.
    return {
        "pre": [{"name": "media-fetch"}, {"name": "media-limits"}],
        "stream": [{"name": "recorder", "config": {"tag": tag}}],
    }


@pytest.fixture
def served(bg, upstreams, tmp_path: Path):
    upstreams.reset()
    key = mint_key()
    doc = {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": upstreams.omni_a.base_url,
                "model": "scripted",
                "serves": [OMNI_MODEL],
                "read_timeout_s": 10,
            }
        ],
        "policies": _chain("before"),
        "tenants": [{"name": "acme"}],
        "api_keys": [{"id": key.id, "tenant": "acme", "sha256": key.sha256}],
        "admin": {"api_key": ADMIN_KEY},
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": {"sqlite_path": str(tmp_path / "audit.db")},
        "logging": {"level": "warning"},
        "routing": {"controller": {"enabled": False}},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    plugins = {**available_plugins(), **PLUGINS}
    server = GatewayServer(
        bg, load_settings(path), CollectorRegistry(), plugins=plugins, config_path=str(path)
    ).start()
    server.key, server.doc, server.path = key.key, doc, path
    yield server
    server.stop()


def _ask(server: GatewayServer, b64: str) -> httpx.Response:
    part = {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    body = {
        "model": OMNI_MODEL,
        "max_tokens": 8,
        "stream": True,  # the recorder's tag ends the stream
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is said?"}, part]}],
    }
    return httpx.post(
        server.url + "/v1/chat/completions",
        content=orjson.dumps(body),
        timeout=60,
        headers={"content-type": "application/json", "authorization": f"Bearer {server.key}"},
    )


def test_a_large_part_is_spooled_served_and_its_file_gone_right_after_a_reload(
    served, upstreams, monkeypatch
):
    b64 = base64.b64encode(AUDIO).decode()
    assert len(b64) > SPOOL_MIN  # spooled, not kept in the body
    served.doc["policies"] = _chain("after")
    served.path.write_text(yaml.safe_dump(served.doc))
    resp = httpx.post(
        served.url + "/admin/config/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
    )
    assert resp.status_code == 200 and resp.json()["status"] == "reloaded", resp.text
    upstreams.reset()
    spooled_names: list[str] = []
    finish = spooled.SpoolWriter.finish

    def recording_finish(self, header: str, b64_length: int) -> spooled.SpooledMedia:
        media = finish(self, header, b64_length)
        spooled_names.append(media.name)
        return media

    monkeypatch.setattr(spooled.SpoolWriter, "finish", recording_finish)
    gc.collect()
    gc.disable()  # only reference counts free the request's files: a cycle holding one would show
    try:
        before = _files()
        resp = _ask(served, b64)
        assert resp.status_code == 200, resp.text
        assert "[after]" in resp.text and "[before]" not in resp.text  # served by the new chain
        assert resp.text.rstrip().endswith("data: [DONE]")
        assert len(spooled_names) == 1 and spooled_names[0].startswith(f"omnigate-{os.getpid()}-")
        [sent] = upstreams.omni_a.requests
        assert sent["messages"][0]["content"][1]["input_audio"]["data"] == b64
        deadline = time.monotonic() + 10
        while not _files() <= before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _files() <= before, _files() - before
    finally:
        gc.enable()
