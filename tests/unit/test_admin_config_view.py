"""GET /admin/config shows engines as configured, never a credential they carry."""

from __future__ import annotations

from engines.adapters.settings import EngineConfig
from gateway.api.admin_state import _engine_json


def test_engine_credentials_are_left_out():
    e = EngineConfig(
        name="hosted",
        kind="litellm",
        model="openai/gpt",
        serves=["m"],
        api_key="sk-live-secret",
        base_url="https://svc-user:pa55word@llm.example:8443/v1",
        telemetry={
            "metrics_url": "http://scrape:s3cret@10.0.0.9:9100/metrics",
            "dcgm_url": "http://dcgm:9400/metrics",
        },
    )
    doc = _engine_json(e)
    text = str(doc)
    for secret in ("sk-live-secret", "pa55word", "svc-user", "s3cret", "scrape:"):
        assert secret not in text
    assert "api_key" not in doc
    assert doc["base_url"] == "https://llm.example:8443/v1"
    assert doc["telemetry"]["metrics_url"] == "http://10.0.0.9:9100/metrics"
    assert doc["telemetry"]["dcgm_url"] == "http://dcgm:9400/metrics"
    assert doc["name"] == "hosted" and doc["serves"] == ["m"]
