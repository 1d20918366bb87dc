"""Engine facts are the adapter's: each adapter declares what its engine takes (modalities, video form,
audio rate, context) in its capabilities, and the media steps read them there (``Deps.engines``), not in
the settings."""

from __future__ import annotations

import pytest

from core.capabilities import Capabilities, EngineFacts
from engines.adapters.litellm_engine import LiteLLMEngine
from engines.adapters.openai_compat import OpenAICompatEngine
from engines.adapters.settings import EngineConfig
from policies.media.targets import MediaTarget, targets_from


def _config(**kw) -> EngineConfig:
    base = {
        "name": "e",
        "kind": "vllm-omni",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "serves": ["omni"],
    }
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("cls", [OpenAICompatEngine, LiteLLMEngine])
def test_an_adapter_declares_what_its_engine_takes(cls):
    kind = "vllm-omni" if cls is OpenAICompatEngine else "litellm"
    cfg = _config(
        kind=kind,
        video_input="frames",
        audio_input_rate=24000,
        max_context_tokens=8192,
        input_modalities=["text", "image", "audio", "video"],
    )
    caps = cls(cfg).capabilities
    assert caps.video_form == "frames" and caps.audio_rate == 24000 and caps.context_tokens == 8192
    assert caps.input_modalities == frozenset({"text", "image", "audio", "video"})


def test_the_defaults_of_a_kind_are_declared_too():
    caps = OpenAICompatEngine(_config(kind="vllm-omni")).capabilities
    cfg = _config(kind="vllm-omni")
    assert (caps.video_form, caps.audio_rate, caps.context_tokens) == (
        cfg.video_form(),
        cfg.audio_rate(),
        cfg.max_context_tokens,
    )


def _facts(name: str, role: str, **caps) -> EngineFacts:
    return EngineFacts(name, ("omni",), role, Capabilities(**caps))


def test_a_models_target_is_the_most_conservative_of_its_engines():
    targets = targets_from(
        [
            _facts(
                "a",
                "fallback",
                video_form="frames",
                audio_rate=24000,
                context_tokens=32768,
                input_modalities=frozenset({"text", "video"}),
            ),
            _facts(
                "b",
                "primary",
                video_form="video",
                audio_rate=16000,
                context_tokens=65536,
                input_modalities=frozenset({"text", "audio"}),
            ),
        ]
    )
    t = targets["omni"]
    assert t.video_form == "frames"  # one engine takes frames only: every video is sent as frames
    assert t.audio_rate == 16000  # the primary's
    assert t.context_tokens == 32768  # the smallest
    assert t.accepts == (frozenset({"text", "audio"}), frozenset({"text", "video"}))  # primary first


def test_without_facts_there_is_no_target():
    assert targets_from([]) == {}
    assert MediaTarget().video_form == "video"


def test_the_gateway_hands_the_policies_each_engines_capabilities(bg, upstreams):
    from prometheus_client import CollectorRegistry

    from tests.conftest import gateway_settings
    from tests.harness import GatewayServer

    server = GatewayServer(bg, gateway_settings(upstreams), CollectorRegistry()).start()
    try:
        services = server.services
        deps = services.deps()
        by_name = {f.name: f for f in deps.engines}
        assert set(by_name) == set(services.pool.engines)
        for name, engine in services.pool.engines.items():
            assert by_name[name].capabilities is engine.capabilities
            assert by_name[name].serves == tuple(engine.config.serves)
    finally:
        server.stop()
