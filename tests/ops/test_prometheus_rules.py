"""The Prometheus config and rules: promtool's checks and unit tests, and the names the rules use."""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry, Histogram

from engines.rollout.rules import default_rules
from observability.metrics import Metrics
from tests.ops.catalogue import (
    EXPORTED,
    OPS,
    PENDING_GROUP_SUFFIX,
    PLANNED,
    PROMETHEUS_SYNTHETIC,
    RULE_TESTS_DIR,
    RUNBOOKS,
    alert_rules,
    load_groups,
    metric_names,
    recording_rules,
    resolve,
    rule_files,
)
from tests.ops.tools import promtool, run

PROMETHEUS_YML = OPS / "prometheus" / "prometheus.yml"
SEVERITIES = {"critical", "warning", "info"}


def test_promtool_check_rules():
    files = [str(p) for p in rule_files()]
    assert len(files) == 2
    result = run([promtool(), "check", "rules", *files])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(files)


def test_promtool_check_config_loads_the_rule_files():
    result = run([promtool(), "check", "config", str(PROMETHEUS_YML)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_files())} rule files found" in result.stdout


def test_promtool_unit_tests_pass():
    tests = sorted(RULE_TESTS_DIR.glob("*.test.yaml"))
    assert tests
    result = run([promtool(), "test", "rules", *map(str, tests)], cwd=RULE_TESTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


def test_promtool_unit_tests_catch_a_wrong_threshold(tmp_path):
    """The unit tests are not vacuous: with the rollback threshold moved they fail."""
    rules = tmp_path / "rules"
    tests = tmp_path / "tests"
    rules.mkdir()
    tests.mkdir()
    for p in rule_files():
        text = p.read_text()
        if p.name == "omnigate-alerts.yaml":
            assert "p99_5m > 0.6\n" in text
            text = text.replace("p99_5m > 0.6\n", "p99_5m > 0.8\n", 1)
        (rules / p.name).write_text(text)
    for p in RULE_TESTS_DIR.glob("*.test.yaml"):
        (tests / p.name).write_text(p.read_text())
    result = run([promtool(), "test", "rules", *map(str, tests.glob("*.test.yaml"))], cwd=tests)
    assert result.returncode != 0
    assert "OmnigateLatencyP99RollbackExpected" in result.stdout + result.stderr


def test_every_alert_has_a_positive_unit_test():
    tested: set[str] = set()
    for p in RULE_TESTS_DIR.glob("*.test.yaml"):
        for case in yaml.safe_load(p.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                if t.get("exp_alerts"):
                    tested.add(t["alertname"])
    untested = set(alert_rules()) - tested
    assert not untested, f"alerts no promtool test expects to fire: {sorted(untested)}"


def _known(name: str) -> bool:
    return name in EXPORTED or name in PLANNED or name in PROMETHEUS_SYNTHETIC


@pytest.mark.parametrize("group", [g["name"] for g in load_groups()])
def test_rules_name_only_known_metrics_and_planned_ones_only_in_pending_groups(group):
    recordings = recording_rules()
    for rule in next(g for g in load_groups() if g["name"] == group)["rules"]:
        label = rule.get("alert") or rule["record"]
        names = resolve(metric_names(rule["expr"]), recordings)
        unknown = {n for n in names if not _known(n)}
        assert not unknown, f"{label} uses metrics the gateway neither exports nor plans: {sorted(unknown)}"
        planned = names & set(PLANNED)
        if group.endswith(PENDING_GROUP_SUFFIX):
            assert planned, f"{label} is in {group} but uses only exported metrics: move it to its group"
        else:
            assert not planned, (
                f"{label} uses planned metrics {sorted(planned)}: "
                f"it belongs in a *{PENDING_GROUP_SUFFIX} group"
            )


def test_recording_rule_names_follow_the_convention():
    for name in recording_rules():
        # level:metric:operations; a metric's own name may hold digits (..._per_1k_prompt_tokens_...)
        assert re.fullmatch(r"[a-z_]+:[a-z][a-z0-9_]*:[a-z0-9_]+", name), name


@pytest.mark.parametrize("name,rule", sorted(alert_rules().items()))
def test_alert_has_severity_summary_and_its_runbook(name, rule):
    assert name.startswith("Omnigate")
    assert rule["labels"]["severity"] in SEVERITIES
    ann = rule["annotations"]
    assert ann["summary"] and ann["description"]
    assert ann["runbook_url"] == f"ops/runbooks/{name}.md"
    page = RUNBOOKS / f"{name}.md"
    assert page.is_file(), f"no runbook page for {name}"
    assert name in page.read_text()


def _comparison(expr: str) -> tuple[set[str], str, float] | None:
    """The metrics on the left of the first ``> number`` or ``< number`` comparison, the operator, the number
    (None for an expression without one, such as ``up == 0``)."""
    found: list[tuple[set[str], str, float]] = []

    def visit(node: object) -> bool:
        if (
            isinstance(node, promql_parser.BinaryExpr)
            and str(node.op) in (">", "<")
            and isinstance(node.rhs, promql_parser.NumberLiteral)
            and not found
        ):
            found.append((metric_names(str(node.lhs)), str(node.op), node.rhs.val))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found[0] if found else None


def _threshold(expr: str) -> tuple[set[str], float]:
    """The metrics on the left of the first threshold comparison of an expression, and the number."""
    found = _comparison(expr)
    assert found, expr
    names, _, value = found
    return names, value


def test_thresholds_are_the_documented_ones():
    alerts = alert_rules()

    def threshold(name: str) -> tuple[set[str], float]:
        return _threshold(alerts[name]["expr"])

    ttft = "engine_variant:omnigate_time_to_first_token_seconds:{}_5m"
    assert threshold("OmnigateFirstAudioPacketSlow") == (
        {"engine_variant:omnigate_time_to_first_audio_seconds:p99_5m"},
        0.3,
    )
    # The deployment's TTFT target is engine-true: from sending the engine its request to its first
    # chunk, per 1,000 prompt tokens as the rollback rules read it (a short prompt's is its TTFT).
    per_1k = "engine_variant:omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds:p99_5m"
    assert threshold("OmnigateTTFTAboveTarget") == ({per_1k}, 0.234)
    # Scale-out reads the engine's own first tokens: not a whole answer's duration (no first token),
    # nor a wait in the gateway, which more engines would not shorten.
    engine_ttft = "engine_variant:omnigate_engine_time_to_first_token_seconds:{}_5m"
    assert threshold("OmnigateLatencyP95ScaleOut") == ({engine_ttft.format("p95")}, 0.5)
    # The rollback alerts read what the int4-latency rule reads, so they fire where it acts.
    assert threshold("OmnigateLatencyP99RollbackExpected") == ({per_1k}, 0.6)
    assert threshold("OmnigateRollbackNotTaken") == ({per_1k}, 0.6)
    assert not any(
        ttft.format("p95") in r["expr"] or ttft.format("p99") in r["expr"] for r in alerts.values()
    )
    assert threshold("OmnigateEngineVRAMHigh") == ({"omnigate_engine_vram_usage_ratio"}, 0.9)
    assert alerts["OmnigateEngineVRAMHigh"]["for"] == "30s"
    # Peak VRAM of the BF16 deployment, absolute: 144 GB in bytes, the highest reading of 5 minutes.
    assert threshold("OmnigateEngineVRAMAboveBudget") == ({"omnigate_engine_vram_used_bytes"}, 144e9)
    budget = alerts["OmnigateEngineVRAMAboveBudget"]["expr"]
    assert 'variant="bf16"' in budget and "max_over_time(" in budget
    # Cross-modal accuracy: an alert below 90 %.
    assert _comparison(alerts["OmnigateEngineAccuracyLow"]["expr"]) == (
        {"omnigate_engine_accuracy_ratio"},
        "<",
        0.9,
    )
    wer = "engine_variant:omnigate_sentinel_wer:mean15m"
    assert threshold("OmnigateSentinelWERHigh") == ({wer}, 0.05)
    # The windowed mean of the sentinel's histogram: rate of its sum over rate of its count.
    assert resolve({wer}) == {"omnigate_sentinel_wer_sum", "omnigate_sentinel_wer_count"}
    assert threshold("OmnigateRequestFailuresHigh") == ({"omnigate:request_failures:ratio_rate5m"}, 0.05)


# -- the thresholds can be read off the histograms exactly ------------------------------------------
def _histogram_bounds() -> dict[str, set[float]]:
    """Each histogram family of the gateway's registry -> its finite bucket bounds (from a real scrape)."""
    metrics = Metrics(CollectorRegistry())
    for metric in vars(metrics).values():
        if isinstance(metric, Histogram):
            # One series per histogram, so the registry shows its buckets.
            (metric.labels(*["x"] * len(metric._labelnames)) if metric._labelnames else metric).observe(0)
    bounds: dict[str, set[float]] = {}
    for family in metrics.registry.collect():
        if family.type == "histogram":
            les = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            bounds[family.name] = {b for b in les if b != float("inf")}
    return bounds


def _quantile_sources(name: str, recordings: dict[str, str]) -> set[str]:
    """The histogram families a recording rule's ``histogram_quantile`` reads (through other rules)."""
    expr = recordings.get(name)
    if expr is None or "histogram_quantile" not in expr:
        return set()
    return {n.removesuffix("_bucket") for n in resolve({name}, recordings) if n.endswith("_bucket")}


PER_1K = "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds"
QUANTILE_ALERTS = {
    # alert -> the histogram its percentile is read from
    "OmnigateTTFTAboveTarget": PER_1K,
    "OmnigateFirstAudioPacketSlow": "omnigate_time_to_first_audio_seconds",
    "OmnigateLatencyP95ScaleOut": "omnigate_engine_time_to_first_token_seconds",
    "OmnigateLatencyP99RollbackExpected": PER_1K,
    "OmnigateRollbackNotTaken": PER_1K,
}


def test_every_threshold_on_a_histogram_quantile_is_a_bucket_bound():
    """A percentile is interpolated inside a bucket: only at a bound does "above the threshold" mean it."""
    bounds = _histogram_bounds()
    recordings = recording_rules()
    found: dict[str, str] = {}
    for name, rule in alert_rules().items():
        comparison = _comparison(rule["expr"])
        if comparison is None:
            continue
        lhs, _, value = comparison
        sources = set().union(*(_quantile_sources(n, recordings) for n in lhs))
        if "histogram_quantile" in rule["expr"]:
            sources |= {n.removesuffix("_bucket") for n in lhs if n.endswith("_bucket")}
        for family in sources:
            assert family in bounds, f"{name} reads {family}, which is no histogram of the gateway"
            assert value in bounds[family], (
                f"{name}'s threshold {value} is not a bucket bound of {family}: {sorted(bounds[family])}"
            )
            found[name] = family
    # The parse found every percentile alert (and no other).
    assert found == QUANTILE_ALERTS


def test_the_deployments_latency_thresholds_are_bounds_of_the_histograms_involved():
    """0.234 s engine TTFT target, 0.3 s first audio packet, 0.4 s P50 (raise the batch limit), 0.5 s P95
    (scale out), 0.6 s P99 (roll back): each can be read on every latency histogram those rules look at."""
    bounds = _histogram_bounds()
    for family in (
        "omnigate_engine_time_to_first_token_seconds",
        PER_1K,
        "omnigate_time_to_first_token_seconds",
        "omnigate_time_to_first_audio_seconds",
        "omnigate_request_duration_seconds",
    ):
        assert {0.234, 0.3, 0.4, 0.5, 0.6} <= bounds[family], (family, sorted(bounds[family]))
    # The sentinel's mean WER threshold is a bound of its histogram as well.
    assert 0.05 in bounds["omnigate_sentinel_wer"]


def test_the_rollback_alerts_read_the_signal_the_rollback_rules_read():
    """OmnigateRollbackNotTaken and OmnigateLatencyP99RollbackExpected check on the int4-latency rule: the
    same figure (the engine's TTFT per 1,000 prompt tokens, its P99) and the same threshold."""
    rules = {r.name: r for r in default_rules()}
    rule = rules["int4-latency"]
    assert rule.signal == "upstream_ttft_per_1k_prompt_tokens_p99"
    assert rules["canary-latency"].signal == rule.signal
    recordings = recording_rules()
    for alert in ("OmnigateRollbackNotTaken", "OmnigateLatencyP99RollbackExpected"):
        names, value = _threshold(alert_rules()[alert]["expr"])
        assert value == rule.above
        [recorded] = names
        assert "histogram_quantile(0.99," in recordings[recorded]
        assert resolve(names, recordings) == {f"{PER_1K}_bucket"}
    # The histogram is what the window computes: the same function, the same floor.
    metrics = Metrics(CollectorRegistry())
    assert metrics.upstream_ttft_per_1k._name == PER_1K
    assert metrics.upstream_ttft_per_1k._labelnames == ("engine", "variant", "model")


THRESHOLD_MOVES = [
    # alert, its threshold as written, moved so that its promtool tests must fail
    ("OmnigateTTFTAboveTarget", "p99_5m > 0.234\n", "p99_5m > 0.3\n"),
    ("OmnigateTTFTAboveTarget", "p99_5m > 0.234\n", "p99_5m > 0.2\n"),
    ("OmnigateFirstAudioPacketSlow", "p99_5m > 0.3\n", "p99_5m > 0.4\n"),
    ("OmnigateFirstAudioPacketSlow", "p99_5m > 0.3\n", "p99_5m > 0.234\n"),
    ("OmnigateLatencyP95ScaleOut", "p95_5m > 0.5\n", "p95_5m > 0.4\n"),
    ("OmnigateLatencyP95ScaleOut", "p95_5m > 0.5\n", "p95_5m > 0.75\n"),
    ("OmnigateLatencyP99RollbackExpected", "p99_5m > 0.6\n", "p99_5m > 0.75\n"),
    ("OmnigateLatencyP99RollbackExpected", "p99_5m > 0.6\n", "p99_5m > 0.1\n"),
    ("OmnigateEngineVRAMAboveBudget", "[5m])) > 144e9\n", "[5m])) > 160e9\n"),
    ("OmnigateEngineVRAMAboveBudget", "[5m])) > 144e9\n", "[5m])) > 143e9\n"),
    ("OmnigateEngineAccuracyLow", "< 0.9\n", "< 0.8\n"),
    ("OmnigateEngineAccuracyLow", "< 0.9\n", "< 0.95\n"),
]


@pytest.mark.parametrize("alert,written,moved", THRESHOLD_MOVES, ids=lambda v: str(v).strip())
def test_each_thresholds_promtool_tests_catch_it_moved_either_way(tmp_path, alert, written, moved):
    """Firing and quiet cases sit on both sides of each threshold: moving it up or down fails them."""
    rules, tests = tmp_path / "rules", tmp_path / "tests"
    rules.mkdir()
    tests.mkdir()
    for p in rule_files():
        text = p.read_text()
        if p.name == "omnigate-alerts.yaml":
            assert text.count(written) == 1, written
            text = text.replace(written, moved)
        (rules / p.name).write_text(text)
    for p in RULE_TESTS_DIR.glob("*.test.yaml"):
        (tests / p.name).write_text(p.read_text())
    result = run([promtool(), "test", "rules", *map(str, tests.glob("*.test.yaml"))], cwd=tests)
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr
