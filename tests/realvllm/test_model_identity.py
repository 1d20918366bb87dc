"""The served-model check against the real vLLM server: its /v1/models id and the revision its root names.

The session's server loads the prepared folder by its path under ``--served-model-name smollm2``, so
``id`` is ``smollm2`` and the last segment of ``root`` (the folder's name; a pinned snapshot's would be
its revision) is what ``expected_revision`` must be.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.selection.identity import identity_problem
from tests.harness import GatewayServer
from tests.realvllm.conftest import ENGINE, MODEL, real_settings

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(900)]


def _gateway(bg, vllm, tmp_path, model: str, revision: str) -> GatewayServer:
    settings = real_settings(vllm, audit={"sqlite_path": str(tmp_path / "audit.db")})
    settings.engines[0].expected_model = model
    settings.engines[0].expected_revision = revision
    return GatewayServer(bg, settings, CollectorRegistry()).start(wait_ready=False)


def _ask(gw: GatewayServer) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )


def test_what_vllm_lists_is_what_the_check_reads(vllm):
    cards = httpx.get(vllm.base_url + "/models", timeout=10).json()["data"]
    revision = vllm.prepared.model_dir.name
    assert identity_problem("smollm2", revision, cards) is None
    assert "not the configured model" in identity_problem("smollm2-other", revision, cards)
    assert "not the configured revision" in identity_problem("smollm2", "0" * 40, cards)


def test_the_right_id_and_revision_are_routed_to(bg, vllm, tmp_path):
    gw = _gateway(bg, vllm, tmp_path, "smollm2", vllm.prepared.model_dir.name)
    try:
        bg.run(gw.services.pool.probe_now())
        assert gw.services.pool.is_healthy(ENGINE) and gw.services.pool.mismatches() == {}
        resp = _ask(gw)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    finally:
        gw.stop()


@pytest.mark.parametrize(
    ("model", "revision", "words"),
    [
        ("smollm2-int4", None, "not the configured model 'smollm2-int4'"),
        ("smollm2", "0123456789abcdef0123456789abcdef01234567", "not the configured revision"),
    ],
)
def test_a_wrong_id_or_revision_is_never_routed_to(bg, vllm, tmp_path, model, revision, words):
    gw = _gateway(bg, vllm, tmp_path, model, revision or vllm.prepared.model_dir.name)
    try:
        bg.run(gw.services.pool.probe_now())
        assert not gw.services.pool.is_healthy(ENGINE)
        assert words in gw.services.pool.mismatches()[ENGINE]
        assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 503
        before = vllm.metric("vllm:request_success_total")
        resp = _ask(gw)
        assert resp.status_code == 503
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert vllm.metric("vllm:request_success_total") == before  # vLLM was never asked
    finally:
        gw.stop()
