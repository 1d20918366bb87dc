"""Shared fixtures: scripted upstreams and a gateway under real uvicorn, on a background loop."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import BackgroundLoop, GatewayServer
from tests.upstream import Script, ScriptedUpstream

OMNI_MODEL = "qwen3-omni-flash"
TEXT_MODEL = "text-model"
LITELLM_MODEL = "litellm-text"


#: Suites a plain `pytest` (and `make test`) leaves out; each runs when its marker is asked for with `-m`.
ON_REQUEST = {
    # its server holds about 10 GB and both cores: `make test-omni` (`-m realomni`)
    "realomni",
    # the benchmarks' smoke runs (tests/bench): CI's own step after `make test`, `make bench-smoke` (`-m bench`)
    "bench",
}

#: What must not share the machine with a second pytest-xdist worker: `make test` runs the rest on two
#: workers (`-n 2 -m "not serial"`), then these alone (`-m serial`). Path prefix -> why.
SERIAL = {
    # figures with ceilings (peak RSS, process growth, refusal and abort latencies, grace periods) that a
    # second worker on the other core would move
    "tests/hardening/": "RSS and latency ceilings, 16 streams at once, SIGTERM grace periods",
    "tests/http/test_media_memory.py": "peak RSS of the gateway process under media bodies",
    # two gateway replicas on Redis, the leader's controller ticking: beside a second worker their
    # shutdowns overran the harness's 15 s (measured, -n 2); alone they pass in seconds
    "tests/http/test_engine_signals.py": "replicas' controller ticks and shutdowns on deadlines",
    "tests/http/test_rollout_replicas.py": "replicas' leader ticks and shutdowns on deadlines",
    "tests/http/test_energy_replicas.py": "replicas' leases on a half-second TTL, renewed on a beat of a third of it",
    # two forked workers and their supervisor, stopped on a deadline: one stop overran 40 s beside a
    # second pytest worker in CI once; alone they stop in about a second
    "tests/http/test_workers.py": "a two-worker gateway's processes and their stop deadline",
    "tests/unit/test_redaction_time.py": "the redactor's time bound",
    "tests/unit/test_footprint.py": "the import and memory footprint of the gateway",
    "tests/system/": "kill -9 of gateways and decode workers mid-write, timed recoveries",
    # vLLM on the CPU keeps both cores busy; a second worker would starve it (and be starved)
    "tests/realvllm/": "a real vLLM server on both cores",
    "tests/browser/": "headless Chromium, timed page loads",
}


# First, so that the serial marker is on the items before `-m` selects by it (the mark plugin's own
# pytest_collection_modifyitems does that selection).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(tuple(SERIAL)):
            item.add_marker(pytest.mark.serial)
    markexpr = config.getoption("markexpr") or ""
    left_out = {name for name in ON_REQUEST if name not in markexpr}
    if not left_out:
        return
    deselected = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not any(item.get_closest_marker(m) for m in left_out)]


@pytest.fixture(scope="session")
def bg() -> BackgroundLoop:
    loop = BackgroundLoop()
    yield loop
    loop.close()


class Upstreams:
    """Three scripted engines: two vLLM-Omni (primary INT4, fallback BF16) and one plain vLLM."""

    def __init__(self, bg: BackgroundLoop) -> None:
        self.bg = bg
        self.omni_a = ScriptedUpstream(Script(flavour="omni"))
        self.omni_b = ScriptedUpstream(Script(flavour="omni"))
        self.vllm = ScriptedUpstream(Script(flavour="vllm"))
        for u in self.all:
            bg.run(u.start())

    @property
    def all(self) -> list[ScriptedUpstream]:
        return [self.omni_a, self.omni_b, self.vllm]

    def reset(self) -> None:
        def _reset() -> None:
            for u, flavour in zip(self.all, ("omni", "omni", "vllm"), strict=True):
                u.default = Script(flavour=flavour)
                u.clear_queue()
                u.reset_stats()

        self.bg.call(_reset)

    def stop(self) -> None:
        for u in self.all:
            self.bg.run(u.stop())


@pytest.fixture(scope="module")
def eng(bg: BackgroundLoop):
    """The console tests' scripted engines (tests/console_setup.py), started once per module."""
    from tests.console_setup import Engines

    e = Engines(bg)
    yield e
    e.stop()


@pytest.fixture(scope="session")
def upstreams(bg: BackgroundLoop) -> Upstreams:
    ups = Upstreams(bg)
    yield ups
    ups.stop()


def gateway_settings(ups: Upstreams, policies: PolicyChainConfig | None = None, **extra) -> Settings:
    return Settings(
        engines=[
            EngineConfig(
                name="omni-int4",
                kind="vllm-omni",
                base_url=ups.omni_a.base_url,
                model="Qwen/Qwen3-Omni-30B-A3B-Instruct-AWQ",
                variant="int4",
                serves=[OMNI_MODEL],
                first_byte_timeout_s=1.0,
                read_timeout_s=5,
            ),
            EngineConfig(
                name="omni-bf16",
                kind="vllm-omni",
                base_url=ups.omni_b.base_url,
                model="Qwen/Qwen3-Omni-30B-A3B-Instruct",
                variant="bf16",
                role="fallback",
                serves=[OMNI_MODEL],
                first_byte_timeout_s=5,
                read_timeout_s=5,
            ),
            EngineConfig(
                name="text-vllm",
                kind="vllm",
                base_url=ups.vllm.base_url,
                model="scripted",
                variant="fp16",
                serves=[TEXT_MODEL],
                first_byte_timeout_s=5,
                read_timeout_s=5,
            ),
            EngineConfig(
                name="via-litellm",
                kind="litellm",
                base_url=ups.vllm.base_url,
                model="hosted_vllm/scripted",
                variant="fp16",
                serves=[LITELLM_MODEL],
                api_key="sk-test",
            ),
        ],
        policies=policies or PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        **{
            # The wire tests must not see traffic shifted by the rollback controller; its own tests enable it.
            "routing": {"controller": {"enabled": False}},
            **extra,
        },
    )


@pytest.fixture(scope="session")
def gateway(
    bg: BackgroundLoop, upstreams: Upstreams, tmp_path_factory: pytest.TempPathFactory
) -> GatewayServer:
    # An audit file of this run's own (per pytest-xdist worker), not the shared default var/omnigate-audit.db.
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    server = GatewayServer(bg, gateway_settings(upstreams, audit={"sqlite_path": str(db)})).start()
    yield server
    server.stop()


@pytest.fixture
def ups(upstreams: Upstreams, gateway: GatewayServer) -> Upstreams:
    """The upstreams, reset to their default scripts, with every engine marked healthy again."""
    upstreams.reset()
    pool = gateway.services.pool

    async def _heal() -> None:
        await pool.probe_now()
        for name in pool.engines:
            pool.readmit(name)  # close circuits a previous test's faults opened

    gateway.bg.run(_heal())
    return upstreams
