"""The engine pool and the rollback controller in one gateway, over real sockets and scripted engines.

Each test starts a gateway with fast loops (ticks of 0.1 s, a 3 s window) and
drives its upstreams into an incident; "within N seconds" waits are only guards
against hangs: the assertions are on what happened.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import structlog
from prometheus_client import CollectorRegistry

from engines.rollout.rules import Rule, RuleAction, RuleSelector
from engines.rollout.settings import CircuitSettings, EngineTelemetry, SentinelSettings, SignalSettings
from engines.rollout.telemetry import TelemetryCollector
from observability.metrics import Metrics
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import MODEL, admin, chat, engines, settings
from tests.speech import speech_set
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)


def _start(bg, s, registry=None) -> GatewayServer:
    return GatewayServer(bg, s, registry or CollectorRegistry()).start()


def _transitions(server: GatewayServer, action: str | None = None) -> list:
    recent = server.bg.call(lambda: list(server.services.controller.recent))
    return [t for t in recent if action is None or t.action == action]


def test_a_latency_spike_on_int4_moves_its_traffic_to_bf16_without_failing_a_request(bg, fresh):
    rule = Rule(
        name="int4-latency",
        select=RuleSelector(variants=["int4"]),
        signal="ttft_p99",
        above=0.15,
        for_s=0.3,
        min_samples=5,
        recover_below=0.05,
        recover_for_s=600,
        action=RuleAction(kind="shift", to_variants=["fp16", "bf16"], trickle_weight=0.0),
    )
    registry = CollectorRegistry()
    server = _start(bg, settings(engines(fresh), [rule]), registry)
    audit: list = []
    server.bg.call(lambda: server.services.controller.on_transition.append(audit.append))
    try:
        answers = [chat(server.url) for _ in range(10)]
        assert all(a.ok for a in answers) and fresh.counts()["int4"] == 10

        fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
        with structlog.testing.capture_logs() as logs:
            assert wait_until(
                lambda: answers.append(chat(server.url)) or bool(_transitions(server, "shift")),
                timeout=60,
                interval=0,
            )
        assert all(a.ok for a in answers), [a.error for a in answers if not a.ok]

        [shift] = _transitions(server, "shift")
        assert (shift.reason, shift.engine, shift.source) == ("int4-latency", "omni-int4", "auto")
        assert shift.detail["value"] > 0.15 and shift.detail["targets"] == {MODEL: ["omni-bf16"]}
        assert shift.detail["detected_at"] <= shift.at
        assert audit == [shift]
        events = [e for e in logs if e["event"] == "routing_transition"]
        assert len(events) == 1 and events[0]["action"] == "shift" and events[0]["reason"] == "int4-latency"

        before = fresh.counts()
        after = [chat(server.url) for _ in range(10)]
        assert all(a.ok for a in after)
        now = fresh.counts()
        assert now["int4"] == before["int4"] and now["bf16"] - before["bf16"] == 10

        sample = registry.get_sample_value
        assert (
            sample(
                "omnigate_routing_transitions_total",
                {"action": "shift", "reason": "int4-latency", "source": "auto"},
            )
            == 1
        )
        assert sample("omnigate_engine_state", {"engine": "omni-int4", "state": "standby"}) == 1
        assert sample("omnigate_engine_state", {"engine": "omni-bf16", "state": "serving"}) == 1
        assert sample("omnigate_engine_traffic_weight", {"engine": "omni-bf16"}) == 1.0
    finally:
        server.stop()


def test_a_crashed_engine_is_ejected_after_failing_over_and_readmitted_by_a_half_open_trial(bg, fresh):
    # Probes are slow here, so it is the passive outcomes that find the crash.
    s = settings(
        engines(fresh),
        [],
        probe_interval_s=60,
        # The ejection outlasts the ten requests below even on a loaded machine: a half-open trial among
        # them would fail over a fourth time.
        circuit=CircuitSettings(consecutive_failures=3, base_ejection_s=3, max_ejection_s=6),
    )
    registry = CollectorRegistry()
    server = _start(bg, s, registry)
    port = fresh.int4.port
    try:
        assert chat(server.url).ok
        bg.run(fresh.int4.stop())
        answers = [chat(server.url) for _ in range(10)]
        assert all(a.ok for a in answers)  # every request failed over before its first byte
        assert registry.get_sample_value("omnigate_engine_failovers_total", {"engine": "omni-int4"}) == 3
        pool = server.services.pool
        assert bg.call(lambda: pool.circuit_state("omni-int4")) in ("open", "half_open")
        [eject] = _transitions(server, "eject")
        assert eject.reason == "outlier-ejection" and eject.engine == "omni-int4"

        bg.run(fresh.int4.start(port=port))  # the engine is back
        fresh.set(fresh.int4, default=Script(flavour="omni"))
        assert wait_until(
            lambda: chat(server.url).ok and bg.call(lambda: pool.circuit_state("omni-int4")) == "closed",
            timeout=30,
            interval=0.1,
        )
        actions = [t.action for t in _transitions(server)]
        assert actions[-3:] == ["eject", "half_open", "readmit"]
        before = fresh.counts()["int4"]
        assert all(chat(server.url).ok for _ in range(5))
        assert fresh.counts()["int4"] == before + 5
    finally:
        server.stop()
        if bg.call(lambda: fresh.int4._runner is None):
            bg.run(fresh.int4.start(port=port))


def test_vram_pressure_in_the_engines_metrics_caps_its_concurrency_and_the_cap_is_lifted_after(bg, fresh):
    rule = Rule(
        name="vram-pressure",
        signal="vram_usage",
        above=0.9,
        for_s=0.3,
        min_samples=0,
        recover_below=0.8,
        recover_for_s=0.3,
        action=RuleAction(kind="limit_concurrency", concurrency_factor=0.5),
    )
    server = _start(bg, settings(engines(fresh), [rule]))
    pool = server.services.pool
    try:
        fresh.set(fresh.int4, kv_cache_usage_perc=0.95, num_requests_running=8)
        assert wait_until(lambda: bg.call(lambda: dict(pool.table.limits)) == {"omni-int4": 4}, timeout=30)
        [limit] = _transitions(server, "limit_concurrency")
        assert limit.reason == "vram-pressure" and limit.detail["value"] == pytest.approx(0.95)

        # Eight slow streams at once: the INT4 engine takes four, the others go on to the next engine.
        fresh.set(fresh.int4, default=Script(flavour="omni", chunk_delay_s=0.1))
        fresh.set(fresh.int8, default=Script(flavour="omni", chunk_delay_s=0.1))
        bg.call(lambda: [u.reset_stats() for u in fresh.all])
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(chat(server.url))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 8 and all(a.ok for a in results)
        assert bg.call(lambda: fresh.int4.max_in_flight) == 4
        assert fresh.counts()["int4"] == 4 and fresh.counts()["int8"] == 4

        fresh.set(fresh.int4, kv_cache_usage_perc=0.5)
        assert wait_until(lambda: bg.call(lambda: dict(pool.table.limits)) == {}, timeout=30)
        assert _transitions(server)[-1].action == "restore"
    finally:
        server.stop()


def test_gpu_memory_from_a_dcgm_exporter_is_the_vram_signal(bg, fresh):
    engine_list = engines(fresh)
    engine_list[0] = engine_list[0].model_copy(
        update={
            "telemetry": engine_list[0].telemetry.model_copy(
                update={"dcgm_url": fresh.int4.base_url[:-3] + "/metrics", "gpus": ["0"]}
            )
        }
    )
    server = _start(bg, settings(engine_list, []))
    try:
        fresh.set(
            fresh.int4,
            kv_cache_usage_perc=0.1,
            gpu_fb_used_mib=72000.0,
            gpu_fb_free_mib=8000.0,
            num_requests_waiting=3,
        )

        def signals() -> dict:
            status = admin(server.url, "").json()
            return next(e for e in status["engines"] if e["name"] == "omni-int4")["signals"]

        assert wait_until(lambda: signals().get("vram_usage") == 0.9, timeout=30)
        got = signals()
        assert got["kv_cache_usage"] == 0.1 and got["requests_waiting"] == 3.0
    finally:
        server.stop()


def test_the_engines_vram_and_kv_cache_readings_are_exported_as_gauges_while_fresh(bg, fresh):
    engine_list = engines(fresh)
    engine_list[0] = engine_list[0].model_copy(
        update={
            "telemetry": engine_list[0].telemetry.model_copy(
                update={"dcgm_url": fresh.int4.base_url[:-3] + "/metrics", "gpus": ["0"]}
            )
        }
    )
    registry = CollectorRegistry()
    server = _start(bg, settings(engine_list, []), registry)
    port = fresh.int4.port

    def gauges(engine: str) -> tuple[float | None, float | None]:
        return (
            registry.get_sample_value("omnigate_engine_vram_usage_ratio", {"engine": engine}),
            registry.get_sample_value("omnigate_engine_kv_cache_usage_ratio", {"engine": engine}),
        )

    try:
        # INT4: GPU memory from its DCGM gauges; INT8: no GPU source, so VRAM is its KV-cache usage.
        fresh.set(fresh.int4, kv_cache_usage_perc=0.25, gpu_fb_used_mib=76000.0, gpu_fb_free_mib=4000.0)
        fresh.set(fresh.int8, kv_cache_usage_perc=0.6)
        fresh.set(fresh.bf16, kv_cache_usage_perc=0.125)
        assert wait_until(lambda: gauges("omni-int4") == (0.95, 0.25), timeout=30)
        assert wait_until(lambda: gauges("omni-int8") == (0.6, 0.6), timeout=30)
        assert gauges("omni-bf16") == (0.125, 0.125)
        scrape = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'omnigate_engine_vram_usage_ratio{engine="omni-int4"} 0.95' in scrape
        assert 'omnigate_engine_kv_cache_usage_ratio{engine="omni-int8"} 0.6' in scrape

        # The engine's /metrics stops answering: once the reading is stale its gauges go, not stay put.
        bg.run(fresh.int4.stop())
        assert wait_until(lambda: gauges("omni-int4") == (None, None), timeout=30)
        assert gauges("omni-int8") == (0.6, 0.6)
        assert registry.get_sample_value(
            "omnigate_telemetry_scrape_errors_total", {"engine": "omni-int4", "source": "engine"}
        )
    finally:
        server.stop()
        if bg.call(lambda: fresh.int4._runner is None):
            bg.run(fresh.int4.start(port=port))


def test_a_replica_that_stops_leading_stops_exporting_the_readings(bg, fresh):
    leading = {"now": True}
    metrics = Metrics(CollectorRegistry())
    url = fresh.int4.base_url[:-3] + "/metrics"
    collector = TelemetryCollector(
        [("omni-int4", url, EngineTelemetry())],
        SignalSettings(scrape_interval_s=0.05, scrape_timeout_s=1),
        metrics,
        active=lambda: leading["now"],
    )
    fresh.set(fresh.int4, kv_cache_usage_perc=0.5)

    def gauges() -> tuple[float | None, float | None]:
        labels = {"engine": "omni-int4"}
        return (
            metrics.registry.get_sample_value("omnigate_engine_vram_usage_ratio", labels),
            metrics.registry.get_sample_value("omnigate_engine_kv_cache_usage_ratio", labels),
        )

    bg.run(collector.start())
    try:
        assert wait_until(lambda: gauges() == (0.5, 0.5), timeout=30)
        leading["now"] = False  # another replica took the lease: it exports the readings now
        assert wait_until(lambda: gauges() == (None, None), timeout=30)
    finally:
        bg.run(collector.aclose())


def test_wer_drift_on_sampled_speech_degrades_int4_to_int8(bg, fresh, tmp_path):
    speech = speech_set(tmp_path)
    said, own, drifted = speech[0]
    rule = Rule(
        name="wer-drift",
        select=RuleSelector(variants=["int4"]),
        signal="wer",
        above=0.05,
        for_s=0,
        min_samples=2,
        recover_below=0.03,
        recover_for_s=600,
        action=RuleAction(kind="shift", to_variants=["int8", "bf16"], trickle_weight=0.0),
    )
    s = settings(
        engines(fresh),
        [rule],
        sentinel=SentinelSettings(enabled=True, sample_share=1.0, queue_size=4),
        window_s=60,
    )
    fresh.set(fresh.int4, default=Script(flavour="omni", text=said, audio_wav=str(drifted)))
    fresh.set(fresh.int8, default=Script(flavour="omni", text=said, audio_wav=str(own)))
    server = _start(bg, s)
    try:
        answers = []
        assert wait_until(
            lambda: answers.append(chat(server.url, speech=True)) or bool(_transitions(server, "shift")),
            timeout=120,
            interval=0.2,
        )
        assert all(a.ok and a.audio_bytes > 0 for a in answers)
        [shift] = _transitions(server, "shift")
        assert shift.reason == "wer-drift" and shift.detail["value"] >= 0.3
        assert shift.detail["targets"] == {MODEL: ["omni-int8"]}
        before = fresh.counts()
        assert all(chat(server.url, speech=True).ok for _ in range(3))
        assert fresh.counts()["int8"] == before["int8"] + 3 and fresh.counts()["int4"] == before["int4"]
        sentinel = server.services.controller.sentinel
        bg.run(sentinel.drain())
        assert bg.call(lambda: sentinel.totals("omni-int8"))[0] == 0  # INT8's speech matches its transcript
    finally:
        server.stop()


def test_a_canary_takes_its_weight_and_is_set_to_zero_when_it_fails(bg, fresh):
    canary = ScriptedUpstream(Script(flavour="omni"))
    bg.run(canary.start())
    rule = Rule(
        name="canary-errors",
        select=RuleSelector(roles=["canary"]),
        signal="error_rate",
        above=0.05,
        for_s=0,
        min_samples=5,
        auto_recover=False,
        action=RuleAction(kind="set_weight", weight=0.0),
    )
    server = _start(bg, settings(engines(fresh, canary, canary_weight=0.3), [rule], window_s=60))
    try:
        assert all(chat(server.url).ok for _ in range(100))
        took = bg.call(lambda: canary.request_count)
        assert 15 <= took <= 45 and fresh.counts()["int4"] == 100 - took

        bg.call(lambda: setattr(canary, "default", Script(flavour="omni", fault="500_before_headers")))
        answers = []
        assert wait_until(
            lambda: answers.append(chat(server.url)) or bool(_transitions(server, "set_weight")),
            timeout=60,
            interval=0,
        )
        assert all(a.ok for a in answers)  # the canary's failures failed over to the primary
        before = bg.call(lambda: canary.request_count)
        assert all(chat(server.url).ok for _ in range(30))
        assert bg.call(lambda: canary.request_count) == before
        status = admin(server.url, "").json()
        assert status["weights"][MODEL]["omni-next"] == 0.0
        assert list(status["incidents"]) == ["canary-errors@omni-next"]

        bg.call(lambda: setattr(canary, "default", Script(flavour="omni")))
        r = admin(server.url, "/clear", {"incident": "canary-errors@omni-next", "note": "fixed in 1.2.1"})
        assert r.status_code == 200 and r.json()["weights"][MODEL]["omni-next"] == pytest.approx(0.3)
    finally:
        server.stop()
        bg.run(canary.stop())
