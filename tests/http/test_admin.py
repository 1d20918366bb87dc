"""The admin surface: hidden without a key, 401 with a wrong one, served with the right one."""

from __future__ import annotations

import secrets

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import gateway_settings
from tests.harness import GatewayServer

pytestmark = pytest.mark.timeout(60)
KEY = secrets.token_hex(32)  # the boot refuses typed keys


def test_admin_is_404_without_a_configured_key(gateway):
    resp = httpx.get(gateway.url + "/admin/engines", headers={"authorization": "Bearer anything"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"


def test_admin_needs_the_key_and_stays_out_of_the_schema(bg, upstreams):
    settings = gateway_settings(upstreams, admin={"api_key": KEY})
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        assert httpx.get(server.url + "/admin/engines").status_code == 401
        wrong = httpx.get(server.url + "/admin/engines", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = httpx.get(server.url + "/admin/engines", headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        names = {e["name"] for e in ok.json()["engines"]}
        assert names == {"omni-int4", "omni-bf16", "text-vllm", "via-litellm"}
        assert "sk-test" not in ok.text
        schema = httpx.get(server.url + "/openapi.json").json()
        assert not any(p.startswith("/admin") for p in schema["paths"])
    finally:
        server.stop()


@pytest.mark.parametrize("key", ["", "short"])
def test_an_empty_or_short_admin_key_is_refused_at_start(key):
    from pydantic import ValidationError

    from gateway.settings import Settings

    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(admin={"api_key": key})
