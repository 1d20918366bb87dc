"""The Grafana dashboard and its provisioning: every query names metrics the gateway exports.

A panel may query a planned metric only if its description starts the pending note, so the
dashboard says plainly which panels stay empty until another work stream lands.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.ops.catalogue import (
    DASHBOARD,
    EXPORTED,
    OPS,
    PENDING_PANEL_MARKER,
    PLANNED,
    PROMETHEUS_SYNTHETIC,
    grafana_to_promql,
    label_values_metric,
    metric_names,
    recording_rules,
    resolve,
)

# Exported metrics with no panel, and why.
NOT_ON_DASHBOARD = {
    "omnigate_build_info": "constant; carries no signal",
}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _query_panels() -> list[dict]:
    return [p for p in _panels(_dashboard()) if p["type"] != "row"]


def _resolved(expr: str) -> set[str]:
    return resolve(metric_names(grafana_to_promql(expr)))


def _known(name: str) -> bool:
    return name in EXPORTED or name in PLANNED or name in PROMETHEUS_SYNTHETIC


def test_dashboard_is_well_formed():
    d = _dashboard()
    assert d["uid"] == "omnigate-overview" and d["title"] == "omnigate"
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    # Panels sit on a 24-column grid without overlapping.
    cells: set[tuple[int, int]] = set()
    for p in _panels(d):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for p in _query_panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]


@pytest.mark.parametrize("panel", _query_panels(), ids=lambda p: p["title"])
def test_panel_queries_parse_and_name_exported_or_marked_planned_metrics(panel):
    names: set[str] = set()
    for t in panel["targets"]:
        found = _resolved(t["expr"])
        assert found, f"{t['expr']!r} selects no metric"
        assert not any(n.startswith("~") for n in found), f"{t['expr']!r}: select metrics by name, not regex"
        names |= found
    unknown = {n for n in names if not _known(n)}
    assert not unknown, f"{panel['title']}: the gateway exports no {sorted(unknown)}"
    planned = names & set(PLANNED)
    marked = panel.get("description", "").startswith(PENDING_PANEL_MARKER)
    if planned:
        assert marked, (
            f"{panel['title']} uses planned {sorted(planned)}: "
            f"start its description with {PENDING_PANEL_MARKER!r}"
        )
        for n in planned:
            assert n in panel["description"], f"{panel['title']}: the pending note should name {n}"
    else:
        assert not marked, f"{panel['title']} uses only exported metrics: drop the pending note"


def test_variables_and_annotations_name_real_metrics():
    d = _dashboard()
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            names = label_values_metric(v["query"]["query"])
            assert names and names <= EXPORTED, (v["name"], names)
            assert v["definition"] == v["query"]["query"]
    for a in d["annotations"]["list"]:
        if "expr" in a:
            names = _resolved(a["expr"])
            assert names and all(_known(n) for n in names), (a["name"], names)


def test_every_exported_metric_is_on_the_dashboard():
    shown: set[str] = set()
    for p in _query_panels():
        for t in p["targets"]:
            shown |= _resolved(t["expr"])

    def family(name: str) -> str:
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name

    missing = {family(n) for n in EXPORTED} - {family(n) for n in shown} - set(NOT_ON_DASHBOARD)
    assert not missing, f"exported metrics no panel shows: {sorted(missing)}"


def test_the_dashboard_covers_what_operators_watch():
    text = {p["title"] for p in _query_panels()}
    for title in (
        "Time to first token",
        "First audio packet",
        "End-to-end duration",
        "Shed requests by reason",
        "Degradations by reason",
        "Policy verdicts",
        "Engine health",
        "Routing transitions",
        "VRAM usage",
        "KV-cache usage",
        "Audit write failures",
    ):
        assert title in text


def test_recording_rules_the_dashboard_reads_exist():
    recordings = recording_rules()
    for p in _query_panels():
        for t in p["targets"]:
            for n in metric_names(grafana_to_promql(t["expr"])):
                if ":" in n and not n.startswith("vllm:"):
                    assert n in recordings, f"{p['title']} reads {n}, which no recording rule defines"


def test_provisioning_points_at_the_dashboard_and_prometheus():
    prov = OPS / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert [d["type"] for d in ds] == ["prometheus"] and ds[0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards" / "omnigate.yaml").read_text())["providers"][0]
    assert provider["type"] == "file"
    compose = yaml.safe_load((OPS / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


# Each alert on one of the deployment's thresholds, and the panel that draws its threshold as a line.
THRESHOLD_PANELS = {
    "OmnigateTTFTAboveTarget": "Engine time to first token",
    "OmnigateLatencyP99RollbackExpected": "Engine time to first token",
    "OmnigateLatencyP95ScaleOut": "Engine time to first token",
    "OmnigateFirstAudioPacketSlow": "First audio packet",
    "OmnigateEngineVRAMHigh": "VRAM usage",
    "OmnigateEngineVRAMAboveBudget": "VRAM used",
    "OmnigateSentinelWERHigh": "Sampled speech WER",
    "OmnigateEngineAccuracyLow": "Cross-modal accuracy",
}


@pytest.mark.parametrize("alert,title", sorted(THRESHOLD_PANELS.items()))
def test_each_threshold_has_a_panel_drawing_it_as_a_line(alert, title):
    from tests.ops.catalogue import alert_rules
    from tests.ops.test_prometheus_rules import _threshold

    panel = next(p for p in _query_panels() if p["title"] == title)
    lhs, value = _threshold(alert_rules()[alert]["expr"])
    shown: set[str] = set()
    for t in panel["targets"]:
        shown |= _resolved(t["expr"])
    assert resolve(lhs) <= shown, f"{title} does not show what {alert} reads ({sorted(resolve(lhs))})"
    defaults = panel["fieldConfig"]["defaults"]
    steps = [s["value"] for s in defaults["thresholds"]["steps"]]
    assert value in steps, f"{title} draws no line at {alert}'s threshold {value} (steps {steps})"
    assert defaults["custom"]["thresholdsStyle"]["mode"] in ("line", "dashed", "line+area", "dashed+area")
