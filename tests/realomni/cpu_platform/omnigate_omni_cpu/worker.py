"""vLLM-Omni's stage workers and model runners on the CPU.

As in vLLM-Omni's XPU port: a worker is vLLM-Omni's worker mixin over the device's vLLM worker (here
``CPUWorker``), whose device set-up is kept, and which then builds vLLM-Omni's runner instead of vLLM's. The
runners are vLLM-Omni's, with what vLLM's ``CPUModelRunner`` changes for a CPU underneath them in the MRO
(buffers kept in host memory, no device events, streams or graphs), so vLLM-Omni's own overrides still win.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


class _CpuRunner:
    """The CPU runner's device tweaks, applied after vLLM-Omni's runner has built its own buffers too."""

    def _finish_cpu_init(self) -> None:
        # vLLM-Omni allocates buffers of its own after vLLM's runner did: their "device" halves are made the
        # host halves as well, as CPUModelRunner does for vLLM's.
        CPUModelRunner._postprocess_tensors(self)  # type: ignore[arg-type]
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False

    # vLLM-Omni's runners (GPU code) override these; the CPU's own answers are the ones that hold here.
    _init_device_properties = CPUModelRunner._init_device_properties
    _sync_device = CPUModelRunner._sync_device
    _to_list = CPUModelRunner._to_list
    _zero_block_ids = CPUModelRunner._zero_block_ids


class CpuARModelRunner(_CpuRunner, GPUARModelRunner, CPUModelRunner):
    """Thinker and talker (autoregressive stages)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _torch_cuda_wrapper():
            super().__init__(*args, **kwargs)
        self._finish_cpu_init()


class CpuGenerationModelRunner(_CpuRunner, GPUGenerationModelRunner, CPUModelRunner):
    """Code2wav (the waveform stage, not autoregressive)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _torch_cuda_wrapper():
            super().__init__(*args, **kwargs)
        self._finish_cpu_init()


class _CpuOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type

    def init_device(self) -> None:
        compilation = self.vllm_config.compilation_config
        # vLLM's CPU platform captures no graphs and leaves the largest capture size unset (None); vLLM-Omni's
        # runners size their buffers with max(max_num_seqs, it), so "no capture" is said as 0.
        if compilation.max_cudagraph_capture_size is None:
            compilation.max_cudagraph_capture_size = 0
        super().init_device()  # the CPU's thread binding, distributed set-up and seed; then vLLM's runner
        if self.use_v2_model_runner:
            # vLLM-Omni's hooks live in its v1 runners only (as in its own XPU and CUDA workers).
            logger.warning("vLLM-Omni on CPU uses the v1 model runner for its stage hooks.")
            self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, torch.device("cpu"))


class CpuARWorker(_CpuOmniWorker):
    model_runner_cls = CpuARModelRunner


class CpuGenerationWorker(_CpuOmniWorker):
    model_runner_cls = CpuGenerationModelRunner
