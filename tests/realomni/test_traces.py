"""What vLLM-Omni's tracing can do, held against the real server: the reason the shipped deployments do
not start their vLLM-Omni engines with ``--otlp-traces-endpoint``.

vLLM-Omni 0.30 refuses the flag for Qwen3-Omni's pipeline before it loads anything (no stage's
structured config owns ``otlp_traces_endpoint``). The Helm chart leaves the flag off engines started with
``--omni`` and compose off both of its engines (tests/ops): were either to pass it, the engine would not
start. When a vLLM-Omni release accepts it, this test fails, and the deployments can pass it again.
"""

from __future__ import annotations

import pytest

from tests.realomni.prepare import prepare
from tests.realomni.server import OmniServer

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(600)]


def test_vllm_omni_refuses_otlp_traces_endpoint_for_qwen3_omni():
    server = OmniServer(prepare(), otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")
    with pytest.raises(RuntimeError) as exited:
        server.start()
    assert "exited with" in str(exited.value)
    assert "no structured config owner: otlp_traces_endpoint" in str(exited.value)
