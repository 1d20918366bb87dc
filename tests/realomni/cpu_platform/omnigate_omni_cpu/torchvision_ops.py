"""torchvision without its C extension: PyPI's torchvision is a CUDA build whose extension cannot load beside a
`+cpu` torch, so the suite's environment removes it (prepare.py). torchvision's Python half still imports (vLLM
imports transformers' Qwen2-VL image processor, which uses torchvision's transforms), except that it registers
fake kernels for two operators its extension would have defined. Defining those two schemas first lets it
import; the operators themselves stay unimplemented, and nothing on the serving path calls them.

Installed as a `.pth` hook (prepare.py writes it): the finder waits for the first `import torchvision` of each
process, so processes that never import it pay nothing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries: list[Any] = []  # a torch Library unregisters its definitions when collected


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None  # the regular finders import it


def define_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        with contextlib.suppress(RuntimeError):  # defined already: the extension did load
            lib.define(schema)
    _libraries.append(lib)


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
