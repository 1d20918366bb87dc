"""Building an engine adapter from its configuration (start-up only; re-exported by engines/selection/pool.py).

Each kind's adapter module is imported only when an engine of that kind is configured.
"""

from __future__ import annotations

from engines.adapters.base import Engine
from engines.adapters.settings import EngineConfig

__all__ = ["build_engine"]


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "vllm":
        from engines.adapters.openai_compat import OpenAICompatEngine

        return OpenAICompatEngine(config)
    if config.kind == "vllm-omni":
        from engines.adapters.vllm_omni import VLLMOmniEngine

        return VLLMOmniEngine(config)
    if config.kind == "litellm":
        from engines.adapters.litellm_engine import LiteLLMEngine

        return LiteLLMEngine(config)
    if config.kind == "stt":
        from engines.adapters.stt import TranscriptionEngine

        return TranscriptionEngine(config)
    if config.kind == "local":
        from engines.adapters.local import LocalEngine

        return LocalEngine(config)
    raise ValueError(f"unknown engine kind {config.kind!r}")
