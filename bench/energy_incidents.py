"""The energy and held-out accuracy incidents of ``python -m bench.incidents`` (issue 17).

``energy`` serves BF16 first (INT4 beside it) with a scripted DCGM power gauge per engine and
raises BF16's draw until its tokens/J falls under 100; ``accuracy`` has INT8 answer the held-out
set wrong before INT4's latency spikes, so the roll-back must skip INT8 for BF16. Each scenario is
a config tweak, a preparation before the gateway starts and an injection, as ``run_scenario`` takes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import orjson
from aiohttp import web

from bench.common import free_port

VARIANTS = ("int4", "int8", "bf16")


class PowerGauges:
    """A DCGM exporter per engine (``DCGM_FI_DEV_POWER_USAGE``, watts), scripted from the bench."""

    def __init__(self) -> None:
        self.watts = {v: 1.0 for v in VARIANTS}
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    def url(self, v: str) -> str:
        return f"http://127.0.0.1:{self.port}/{v}/metrics"

    async def start(self) -> None:
        async def metrics(request: web.Request) -> web.Response:
            w = self.watts[request.match_info["variant"]]
            text = f'# TYPE DCGM_FI_DEV_POWER_USAGE gauge\nDCGM_FI_DEV_POWER_USAGE{{gpu="0"}} {w}\n'
            return web.Response(text=text, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/{variant}/metrics", metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


power = PowerGauges()

# The default rules' energy and accuracy thresholds; durations divided by ten, like the others.
ENERGY_RULE = {
    "name": "energy-efficiency",
    "select": {"variants": ["fp16", "bf16", "int8"]},
    "signal": "tokens_per_joule",
    "below": 100.0,
    "for_s": 30,
    "min_samples": 0,
    "recover_above": 125.0,
    "recover_for_s": 60,
    "action": {"kind": "shift", "to_variants": ["int4"], "trickle_weight": 0.05},
}
ACCURACY_RULE = {
    "name": "accuracy-floor",
    "signal": "accuracy",
    "below": 0.9,
    "for_s": 0,
    "min_samples": 10,
    "recover_above": 0.9,
    "recover_for_s": 0,
    "action": {"kind": "exclude_target"},
}


def energy_layout(cfg: dict) -> None:
    """BF16 serves first, INT4 beside it; each engine's GPU power from its scripted DCGM gauge."""
    roles = {"bf16": "primary", "int4": "fallback", "int8": "fallback"}
    for e in cfg["engines"]:
        e["role"] = roles[e["variant"]]
        e["telemetry"] = {"dcgm_url": power.url(e["variant"]), "gpus": ["0"]}
    cfg["routing"]["energy"] = {"min_joules": 5.0}
    cfg["routing"]["controller"]["rules"].append(ENERGY_RULE)


async def energy_prepare(s, ups, t0):
    # ~20 requests/s of 10 tokens each on BF16: 1.2 W reads ~170 tokens/J, above the line.
    power.watts.update({"int4": 1.0, "int8": 1.0, "bf16": 1.2})


async def energy_inject(s, ups, t0):
    power.watts["bf16"] = 4.0  # ~50 tokens/J: under 100


def accuracy_layout(cfg: dict) -> None:
    """INT4's roll-back prefers INT8, then BF16; the held-out set is replayed on every engine."""
    rules = cfg["routing"]["controller"]["rules"]
    latency = next(r for r in rules if r["name"] == "int4-latency")
    latency["action"]["to_variants"] = ["int8", "bf16"]
    rules.append(ACCURACY_RULE)
    cfg["routing"]["accuracy"] = {"enabled": True, "set_path": str(held_out_set()), "interval_s": 600}


def held_out_set() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="omnigate-held-out-"))
    rows = [{"prompt": f"Question {i}", "choices": ["no", "yes"], "answer": "B"} for i in range(10)]
    path = folder / "held-out.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


async def accuracy_prepare(s, ups, t0):
    for v, text in (("int4", "B"), ("int8", "A"), ("bf16", "B")):  # INT8 answers every item wrong
        await ups.script(s, v, first_byte_delay_s=0.2, text=text)


async def accuracy_inject(s, ups, t0):
    await ups.script(s, "int4", first_byte_delay_s=0.9, text="B")
