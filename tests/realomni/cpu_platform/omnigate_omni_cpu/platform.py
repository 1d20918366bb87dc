"""vLLM-Omni's platform interface on top of vLLM's CPU platform.

The split follows vLLM-Omni's own ports (XPU): vLLM's platform class supplies everything vLLM asks of a
device, ``OmniPlatform`` adds what vLLM-Omni asks, and the methods ``OmniPlatform`` leaves abstract are
answered here for a host whose only device is its memory.
"""

from __future__ import annotations

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

logger = init_logger(__name__)

_WORKERS = "omnigate_omni_cpu.worker"


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return f"{_WORKERS}.CpuARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return f"{_WORKERS}.CpuGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        # PyTorch's scaled-dot-product attention is the one backend that runs on a CPU.
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None  # CPU kernels have finished when they return

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @classmethod
    def supports_float64(cls) -> bool:
        return True
