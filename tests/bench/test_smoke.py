"""Every benchmark still runs: ``python -m bench.<name> --smoke``, tiny sizes, one fact of its result checked.

A smoke run takes the benchmark's own code path (its gateway and engines, its workload, its result
file) at sizes that take seconds; what it cannot measure on this host (a GPU, NVML, py-spy,
LiteLLM's proxy) it names under ``not_measured``. A new module under ``bench/`` without a smoke
run here fails ``test_every_bench_module_has_a_smoke_run``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.bench, pytest.mark.timeout(180)]

#: modules of bench/ that are libraries, run through the benchmarks that use them
LIBRARIES = {
    "__init__": "the package",
    "common": "shared by every benchmark",
    "energy_incidents": "the energy and accuracy scenarios of bench.incidents",
    "hostile_corpus": "the files bench.hostile_media sends",
    "locustfile": "run by bench.load",
}


def _levels_served(doc: dict) -> None:
    for level in doc["levels"]:
        assert level["requests"] > 0 and level["errors"] == 0, level


def _adapters(doc: dict) -> None:
    assert doc["vllm"]["chunks"] > 0 and doc["litellm"]["chunks"] > 0


def _audit(doc: dict) -> None:
    assert {r["store"] for r in doc["rows"]} == {"sqlite", "postgres"}
    assert all(r["records"] > 0 and r["records_per_s"] > 0 for r in doc["rows"])


def _cancels(doc: dict) -> None:
    assert doc["stream"]["aborts_seen"] > 0 and doc["json"]["aborts_seen"] > 0


def _compare(doc: dict) -> None:
    for target in ("relay", "omnigate-off", "omnigate-noaudit", "omnigate", "omnigate-traced"):
        for level in doc["targets"][target]["levels"].values():
            assert level["requests"] > 0 and level["errors"] == 0, (target, level)
        assert doc["targets"][target]["held_streams"] > 0
    # the traced gateway's spans reached the receiver, every request's
    assert all(lv["spans_per_request"] >= 1 for lv in doc["targets"]["omnigate-traced"]["levels"].values())
    assert "litellm" in doc["targets"] or "litellm" in doc["not_measured"]


def _console_search(doc: dict) -> None:
    assert set(doc["stores"]) == {"sqlite", "postgres"}
    for rows in doc["stores"].values():
        assert "newest page, no filter" in rows and rows["newest page, no filter"]["median_ms"] > 0


def _energy_gpu(doc: dict) -> None:
    assert all(r["tokens"] > 0 for r in doc["measure"]["runs"])
    assert doc["integrate"]["runs"] and all(r["joules"] > 0 for r in doc["integrate"]["runs"])
    assert doc["measure"]["samples"] or "gpu power (NVML)" in doc["not_measured"]


def _faults(doc: dict) -> None:
    for mode, row in doc["modes"].items():
        assert row["requests"] > 0 and row["clean"] == row["requests"], (mode, row)
    keepalive = doc["keepalive_closed_after_5s_idle"]
    assert keepalive["requests"] > 0 and keepalive["clean"] == keepalive["requests"]


def _front_door(doc: dict) -> None:
    assert doc["keys"] > 0 and all(v > 0 for v in doc["seconds_per_operation"].values())


def _gpu_models(doc: dict) -> None:
    assert doc["whisper"]["cpu"] and doc["nli"]["minilm_l12_h384"]["cpu"] and doc["nsfw"]["cpu_onnxruntime"]
    assert doc["gpu"] is not None or "cuda" in doc["not_measured"]


def _served_guards(doc: dict) -> None:
    rows = doc["throughput"]
    assert rows and all(r["pairs"] > 0 for r in rows)
    # answers judged at once through the batcher share engine calls
    assert all(r["engine_calls"] < r["answers"] for r in rows if r["batched"] and r["concurrent_answers"] > 1)
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in doc["ttfb"]["rows"])


def _grounding(doc: dict) -> None:
    assert doc["scorer_latency"]["rows"]
    assert [r["mode"] for r in doc["ttfb"]["rows"]] == ["no guard", "passthrough", "window", "hold"]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in doc["ttfb"]["rows"])


def _hostile_media(doc: dict) -> None:
    summary = doc["summary"]
    assert doc["gateway_alive_after"] and summary["files"] > 0 and summary["5xx"] == 0
    assert summary["not_as_expected"] == [] and summary["bad_error_shape"] == []


def _incidents(doc: dict) -> None:
    assert [r["scenario"] for r in doc["results"]] == ["energy"]
    assert all(r["requests"] > 0 for r in doc["results"])


def _load(doc: dict) -> None:
    assert doc["locust_exit_code"] == 0 and doc["requests"] > 0 and doc["failures"] == 0


def _media(doc: dict) -> None:
    assert len(doc["rows"]) >= 6 and doc["bomb"]["refused"] is True


def _media_sandbox(doc: dict) -> None:
    assert doc["sandbox"]["figures"] and doc["sandbox"]["hostile"] == "DecoderFailed"
    assert all(r["status"] == 200 for r in doc["gateway_rss"]["rows"])


def _nvml_check(doc: dict) -> None:
    assert doc.get("vram_usage_during") is not None or "vram_usage (NVML)" in doc["not_measured"]


def _omni_adapter(doc: dict) -> None:
    assert doc["vllm"]["chunks"] > 0 and doc["vllm-omni"]["chunks"] > 0


def _pool_overhead(doc: dict) -> None:
    assert doc["requests"] > 0 and doc["per_request_us"] > 0 and doc["ticks"] > 0


def _profile(doc: dict) -> None:
    if "py-spy samples" in doc["not_measured"]:
        assert doc["requests"] > 0  # the gateway served the load py-spy would have sampled
    else:
        assert doc["samples"] > 0 and doc["layers_pct"]


def _install_size(doc: dict) -> None:
    assert doc["base"]["has_torch"] is False and doc["full"]["has_torch"] is True
    # Both measured; their order is not: the gateway may answer a moment before its gateway_ready line.
    assert doc["current"]["ready_s_median"] > 0 and doc["current"]["first_answer_s_median"] > 0


def _request_line(doc: dict) -> None:
    assert doc["status"] == 200
    assert (
        "gateway.pipeline.relay" in doc["module_list"]
        and "engines.adapters.openai_compat" in doc["module_list"]
    )
    assert doc["modules"] == len(doc["module_list"]) and doc["package_crossings"] > 0
    assert doc["lines"] > 0 and all(n > 300 for n in doc["over_300_lines"].values())


def _relay(doc: dict) -> None:
    assert doc["chunks"] > 0 and doc["done"] is True


def _shedding(doc: dict) -> None:
    assert [r["store"] for r in doc["ramps"]] == ["local", "redis"]
    for ramp in doc["ramps"]:  # the smoke run's levels are soft 2, hard 4: every zone is reached
        assert ramp["below_soft"]["requests"] > 0 and ramp["below_soft"]["errors"] == 0, ramp
        assert 0 < ramp["above_hard"]["requests"] == ramp["above_hard"]["refused_503"], ramp


def _soak(doc: dict) -> None:
    assert doc["requests"] > 0 and doc["errors"] == 0 and doc["samples"]


def _whisper_weights(doc: dict) -> None:
    assert doc["shards"] and doc["loaded_parameters"] > 0
    assert doc.get("check") or "check against faster-whisper" in doc["not_measured"]


def _realtime(doc: dict) -> None:
    assert doc["latency"]["turns"] > 0 and math.isfinite(doc["latency"]["added_ms"]["p50"])
    (level,) = doc["levels"]
    assert level["turns"] > 0 and level["cpu_s_per_session_minute"] > 0


def _workers(doc: dict) -> None:
    for target in doc["targets"].values():
        assert all(lv["requests"] > 0 and lv["errors"] == 0 for lv in target["levels"].values()), target
    assert doc["cpu_per_request_workers2_over_workers1"]


#: module -> (what its result must show, timeout in seconds)
def _instructions(doc: dict) -> None:
    # callgrind counted the gateway's instructions for the level's requests (a streamed request is millions)
    assert doc["trees"]["this"]["instructions_per_request_2"] > 100_000, doc


SMOKE: dict[str, tuple[Callable[[dict], None], int]] = {
    "adapters": (_adapters, 60),
    "audit": (_audit, 60),
    "cancels": (_cancels, 60),
    "compare": (_compare, 90),
    "console_search": (_console_search, 60),
    "energy_gpu": (_energy_gpu, 60),
    "faults": (_faults, 90),
    "front_door": (_front_door, 60),
    "gpu_models": (_gpu_models, 90),
    "grounding": (_grounding, 90),
    # boots the real vLLM (tests/realvllm) with a tiny pooling model: about 40 s of it
    "served_guards": (_served_guards, 170),
    "hostile_media": (_hostile_media, 90),
    "incidents": (_incidents, 120),
    "install_size": (_install_size, 120),
    "instructions": (_instructions, 170),
    "load": (_load, 90),
    "media": (_media, 60),
    "media_sandbox": (_media_sandbox, 90),
    "nvml_check": (_nvml_check, 60),
    "omni_adapter": (_omni_adapter, 60),
    "overhead": (_levels_served, 60),
    "pool_overhead": (_pool_overhead, 60),
    "profile": (_profile, 60),
    "realtime": (_realtime, 60),
    "relay": (_relay, 60),
    "request_line": (_request_line, 60),
    "shedding": (_shedding, 90),
    "soak": (_soak, 60),
    "whisper_weights": (_whisper_weights, 90),
    "workers": (_workers, 120),
}


def test_every_bench_module_has_a_smoke_run():
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert modules - set(LIBRARIES) == set(SMOKE), "a bench module without a smoke run (or a stale entry)"
    for name in LIBRARIES:
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert 'if __name__ == "__main__"' not in text, f"bench/{name}.py runs: give it a smoke run"


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke(name: str, tmp_path: Path) -> None:
    check, timeout = SMOKE[name]
    out = tmp_path / f"{name}.json"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["smoke"] is True and isinstance(doc["not_measured"], dict)
    check(doc)
