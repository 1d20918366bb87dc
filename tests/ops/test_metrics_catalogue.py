"""The catalogue of metric names against the gateway's real registry, and promtool's lint of a real scrape."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import OMNI_MODEL, TEXT_MODEL
from tests.ops.catalogue import EXPORTED, PLANNED, gateway_sample_names
from tests.ops.tools import promtool, run
from tests.upstream import Script


def test_every_catalogued_name_is_exported_by_the_gateway():
    missing = EXPORTED - gateway_sample_names()
    assert not missing, (
        f"catalogued as exported but not defined in observability/metrics.py: {sorted(missing)}"
    )


def test_every_gateway_metric_is_catalogued():
    unknown = gateway_sample_names() - EXPORTED - set(PLANNED)
    assert not unknown, (
        f"the gateway exports {sorted(unknown)}, which tests/ops/catalogue.py does not list: "
        "add them to EXPORTED (and to the dashboard)"
    )


def test_planned_names_are_not_exported_yet():
    landed = sorted(set(PLANNED) & gateway_sample_names())
    assert not landed, (
        f"{landed} are exported now: move them from PLANNED to EXPORTED in tests/ops/catalogue.py, move their "
        "rules out of the *-pending-metrics groups and drop the 'Pending metric:' note from their panels"
    )


def _traffic(gateway, ups) -> None:
    """A little of everything, so that histograms and labelled counters have series."""
    url = gateway.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        speech = client.post(
            url,
            json={
                "model": OMNI_MODEL,
                "stream": True,
                "modalities": ["text", "audio"],
                "audio": {"voice": "Ethan", "format": "wav"},
                "messages": [{"role": "user", "content": "Say hello."}],
            },
        )
        assert speech.status_code == 200 and "data: [DONE]" in speech.text
        text = client.post(
            url,
            json={
                "model": TEXT_MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 100_000,
            },
        )
        assert text.status_code == 200 and "max-tokens-capped" in text.headers["x-omnigate-degraded"]
        # The INT4 engine fails before its first byte: the BF16 fallback answers.
        ups.omni_a.enqueue(Script(flavour="omni", fault="500_before_headers"))
        failover = client.post(
            url, json={"model": OMNI_MODEL, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        )
        assert failover.status_code == 200
        unknown = client.post(
            url, json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}
        )
        assert unknown.status_code == 404


def test_promtool_check_metrics_is_clean_on_a_real_scrape(gateway, ups):
    tool = promtool()
    _traffic(gateway, ups)
    scrape = httpx.get(gateway.url + "/metrics", timeout=10)
    assert scrape.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    samples = {s.name for f in families.values() for s in f.samples}
    # The traffic above gave the histograms and labelled counters real series.
    for name in (
        "omnigate_time_to_first_token_seconds_bucket",
        "omnigate_time_to_first_audio_seconds_bucket",
        "omnigate_request_duration_seconds_bucket",
        "omnigate_inter_chunk_gap_seconds_bucket",
        "omnigate_policy_duration_seconds_bucket",
        "omnigate_policy_decisions_total",
        "omnigate_degradations_total",
        "omnigate_engine_errors_total",
        "omnigate_engine_failovers_total",
        "omnigate_engine_healthy",
        "omnigate_requests_total",
    ):
        assert name in samples, name
    # Nothing in the scrape escapes the catalogue (the *_created timestamps aside).
    assert {s for s in samples if not s.endswith("_created")} <= EXPORTED

    result = run([tool, "check", "metrics"], stdin=scrape.text)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )
