"""The Prometheus config and rules: promtool's checks and unit tests, and the names the rules use."""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml

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
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), name


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


def _threshold(expr: str) -> tuple[set[str], float]:
    """The metrics on the left of the first ``> number`` comparison of an expression, and the number."""
    found: list[tuple[set[str], float]] = []

    def visit(node: object) -> bool:
        if (
            isinstance(node, promql_parser.BinaryExpr)
            and str(node.op) == ">"
            and isinstance(node.rhs, promql_parser.NumberLiteral)
            and not found
        ):
            found.append((metric_names(str(node.lhs)), node.rhs.val))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    assert found, expr
    return found[0]


def test_thresholds_are_the_documented_ones():
    alerts = alert_rules()

    def threshold(name: str) -> tuple[set[str], float]:
        return _threshold(alerts[name]["expr"])

    ttft = "engine_variant:omnigate_time_to_first_token_seconds:{}_5m"
    assert threshold("OmnigateFirstAudioPacketSlow") == (
        {"engine_variant:omnigate_time_to_first_audio_seconds:p99_5m"},
        0.3,
    )
    assert threshold("OmnigateTTFTAboveTarget") == ({ttft.format("p50")}, 0.3)
    assert threshold("OmnigateLatencyP95ScaleOut") == ({ttft.format("p95")}, 0.5)
    # The rollback alerts read the engine's own TTFT, as the int4-latency rule does.
    engine_ttft = "engine_variant:omnigate_engine_time_to_first_token_seconds:p99_5m"
    assert threshold("OmnigateLatencyP99RollbackExpected") == ({engine_ttft}, 0.6)
    assert threshold("OmnigateRollbackNotTaken") == ({engine_ttft}, 0.6)
    assert threshold("OmnigateEngineVRAMHigh") == ({"omnigate_engine_vram_usage_ratio"}, 0.9)
    assert alerts["OmnigateEngineVRAMHigh"]["for"] == "30s"
    wer = "engine_variant:omnigate_sentinel_wer:mean15m"
    assert threshold("OmnigateSentinelWERHigh") == ({wer}, 0.05)
    # The windowed mean of the sentinel's histogram: rate of its sum over rate of its count.
    assert resolve({wer}) == {"omnigate_sentinel_wer_sum", "omnigate_sentinel_wer_count"}
    assert threshold("OmnigateRequestFailuresHigh") == ({"omnigate:request_failures:ratio_rate5m"}, 0.05)
