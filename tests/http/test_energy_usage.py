"""Energy per token end to end: DCGM power over real sockets, the controller's figure, usage.energy_joules."""

from __future__ import annotations

import time

import httpx
import pytest
from aiohttp import web

from engines.adapters.settings import EngineConfig
from engines.rollout.settings import EnergySettings, EngineTelemetry, RoutingSettings, SignalSettings
from gateway.settings import Settings
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import ADMIN, ADMIN_KEY
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)


class Dcgm:
    """A DCGM exporter's power gauge for GPUs "0" and "1" (the engine owns "0"): the network edge."""

    def __init__(self) -> None:
        self.watts = {"0": 300.0, "1": 50.0}
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).", "# TYPE DCGM_FI_DEV_POWER_USAGE gauge"]
        lines += [
            f'DCGM_FI_DEV_POWER_USAGE{{gpu="{g}",modelName="NVIDIA H200"}} {w}' for g, w in self.watts.items()
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture(scope="module")
def stack(bg):
    up = ScriptedUpstream(Script(flavour="vllm", text="one two three four five six seven eight nine ten"))
    dcgm = Dcgm()
    bg.run(up.start())
    bg.run(dcgm.start())
    dark = ScriptedUpstream(Script(flavour="vllm"))
    bg.run(dark.start())
    engines = [
        EngineConfig(name="lit", kind="vllm", base_url=up.base_url, model="q", variant="bf16", serves=["m"],
                     telemetry=EngineTelemetry(dcgm_url=f"http://127.0.0.1:{dcgm.port}/metrics", gpus=["0"])),
        # no power source: its answers carry no estimate
        EngineConfig(name="dark", kind="vllm", base_url=dark.base_url, model="q", variant="bf16", serves=["d"],
                     telemetry=EngineTelemetry(scrape=False)),
    ]  # fmt: skip
    routing = RoutingSettings(
        signals=SignalSettings(window_s=30, scrape_interval_s=0.1, scrape_timeout_s=1),
        energy=EnergySettings(min_joules=1.0),
        # One tick a second: the figure a request is charged with rarely changes while it is served.
        controller={"interval_s": 1.0, "rules": []},
    )
    settings = Settings(engines=engines, routing=routing, admin={"api_key": ADMIN_KEY},
                        logging={"level": "warning"}, auth={"required": False})  # fmt: skip
    server = GatewayServer(bg, settings).start()
    yield server, dcgm
    server.stop()
    for u in (up, dark):
        bg.run(u.stop())
    bg.run(dcgm.stop())


def _ask(url: str, model: str = "m", stream: bool = False) -> dict:
    body: dict = {"model": model, "messages": [{"role": "user", "content": "count"}], "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                import orjson

                usage = orjson.loads(line[6:])["usage"]
    assert usage is not None
    return usage


def _signals(url: str, engine: str) -> dict:
    st = httpx.get(url + "/admin/routing", headers=ADMIN, timeout=5).json()
    return next(e for e in st["engines"] if e["name"] == engine)["signals"]


def test_the_engines_gpu_power_becomes_tokens_per_joule_and_each_answer_its_energy(stack):
    server, _dcgm = stack
    url = server.url
    assert "energy_joules" not in _ask(url)  # no figure yet: no estimate rather than a guess
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "tokens_per_joule" not in _signals(url, "lit"):
        _ask(url)
    sig = _signals(url, "lit")
    assert sig["power_watts"] == 300.0  # GPU "0" only: GPU "1" belongs to no engine here
    tpj = sig["tokens_per_joule"]
    assert 0 < tpj < 10  # ten tokens a request, a few requests a second, 300 W
    assert tpj == pytest.approx(1 / server.bg.call(lambda: server.services.pipeline.energy.joules_per_token("lit")),
                                rel=0.5)  # fmt: skip
    book = server.services.pipeline.energy
    for stream in (False, True):
        before = server.bg.call(lambda: book.joules_per_token("lit"))
        usage = _ask(url, stream=stream)
        after = server.bg.call(lambda: book.joules_per_token("lit"))
        assert usage["completion_tokens"] == 10
        # The estimate is the answer's tokens times the engine's joules per token when it was served.
        assert any(usage["energy_joules"] == pytest.approx(10 * f, abs=1e-3) for f in (before, after)), usage
    assert "energy_joules" not in _ask(url, model="d")
    reg = server.registry
    assert reg.get_sample_value("omnigate_engine_tokens_per_joule", {"engine": "lit", "variant": "bf16"}) > 0
    joules = reg.get_sample_value("omnigate_engine_energy_joules_total", {"engine": "lit", "variant": "bf16"})
    assert joules > 1.0
    assert (
        reg.get_sample_value("omnigate_engine_energy_joules_total", {"engine": "dark", "variant": "bf16"})
        is None
    )


def test_an_idle_engine_is_charged_nothing(stack):
    server, _ = stack
    reg = server.registry

    def joules() -> float:
        return (
            reg.get_sample_value("omnigate_engine_energy_joules_total", {"engine": "lit", "variant": "bf16"})
            or 0.0
        )

    _ask(server.url)
    assert wait_until(lambda: server.bg.call(lambda: server.services.pool.in_flight("lit")) == 0, timeout=5)
    time.sleep(2.2)  # the tick after the last request still counts the interval it ended in
    before = joules()
    time.sleep(2.5)  # 300 W for 2.5 s would be 750 J
    assert joules() == pytest.approx(before, abs=1e-6)
