"""What the operations kit may name: the metrics and admin routes the gateway has, and those it will have.

The one list to edit as work streams land. ``EXPORTED`` holds the sample names the gateway
exports now (the tests prove each one against the real ``Metrics`` registry); ``PLANNED``
holds the names other work streams are adding. A dashboard panel or a rule may use a planned
name only where it says so (a "Pending metric:" panel description, a ``*-pending-metrics``
rule group). When a planned metric lands, its test fails and says so: move the name from
``PLANNED`` to ``EXPORTED``, move its rules out of the pending group and drop the panel's note.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import promql_parser
import yaml
from prometheus_client import CollectorRegistry

from observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
RULES_DIR = OPS / "prometheus" / "rules"
RULE_TESTS_DIR = OPS / "prometheus" / "tests"
DASHBOARD = OPS / "grafana" / "dashboards" / "omnigate.json"
RUNBOOKS = OPS / "runbooks"
CHART = OPS / "helm" / "omnigate"

# -- metrics ------------------------------------------------------------------------------------
EXPORTED: frozenset[str] = frozenset(
    {
        "omnigate_admission_shed_total",
        "omnigate_build_info",
        "omnigate_requests_total",
        "omnigate_endpoint_requests_total",
        "omnigate_requests_in_flight",
        "omnigate_time_to_first_token_seconds_bucket",
        "omnigate_time_to_first_token_seconds_count",
        "omnigate_time_to_first_token_seconds_sum",
        "omnigate_engine_time_to_first_token_seconds_bucket",
        "omnigate_engine_time_to_first_token_seconds_count",
        "omnigate_engine_time_to_first_token_seconds_sum",
        "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds_bucket",
        "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds_count",
        "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds_sum",
        "omnigate_engine_request_seconds_bucket",
        "omnigate_engine_request_seconds_count",
        "omnigate_engine_request_seconds_sum",
        "omnigate_audio_output_seconds_total",
        "omnigate_time_to_first_audio_seconds_bucket",
        "omnigate_time_to_first_audio_seconds_count",
        "omnigate_time_to_first_audio_seconds_sum",
        "omnigate_realtime_sessions_open",
        "omnigate_realtime_turns_total",
        "omnigate_realtime_first_audio_seconds_bucket",
        "omnigate_realtime_first_audio_seconds_count",
        "omnigate_realtime_first_audio_seconds_sum",
        "omnigate_realtime_barge_ins_total",
        "omnigate_realtime_cancellations_total",
        "omnigate_realtime_barge_in_stop_seconds_bucket",
        "omnigate_realtime_barge_in_stop_seconds_count",
        "omnigate_realtime_barge_in_stop_seconds_sum",
        "omnigate_realtime_sessions_closed_total",
        "omnigate_request_duration_seconds_bucket",
        "omnigate_request_duration_seconds_count",
        "omnigate_request_duration_seconds_sum",
        "omnigate_inter_chunk_gap_seconds_bucket",
        "omnigate_inter_chunk_gap_seconds_count",
        "omnigate_inter_chunk_gap_seconds_sum",
        "omnigate_policy_decisions_total",
        "omnigate_policy_duration_seconds_bucket",
        "omnigate_policy_duration_seconds_count",
        "omnigate_policy_duration_seconds_sum",
        "omnigate_degradations_total",
        "omnigate_engine_errors_total",
        "omnigate_engine_failovers_total",
        "omnigate_retries_total",
        "omnigate_engine_healthy",
        "omnigate_engine_model_verified",
        "omnigate_client_disconnects_total",
        # -- API keys, tenants, rate limits, config reloads
        "omnigate_auth_failures_total",
        "omnigate_rate_limited_total",
        "omnigate_rate_limiter_errors_total",
        "omnigate_config_reloads_total",
        # -- the tenant directory and refused keys (front door)
        "omnigate_directory_fresh",
        "omnigate_directory_read_age_seconds",
        "omnigate_directory_read_errors_total",
        "omnigate_auth_throttled_total",
        # -- audit trail
        "omnigate_audit_records_written_total",
        "omnigate_audit_buffer_records",
        "omnigate_audit_records_dropped_total",
        "omnigate_audit_buffer_full_total",
        "omnigate_audit_commit_seconds_bucket",
        "omnigate_audit_commit_seconds_count",
        "omnigate_audit_commit_seconds_sum",
        "omnigate_audit_batch_records_bucket",
        "omnigate_audit_batch_records_count",
        "omnigate_audit_batch_records_sum",
        "omnigate_audit_ack_timeouts_total",
        "omnigate_audit_store_errors_total",
        # -- media pre-filters
        "omnigate_media_fetches_total",
        "omnigate_media_fetch_bytes_bucket",
        "omnigate_media_fetch_bytes_count",
        "omnigate_media_fetch_bytes_sum",
        "omnigate_media_parts_total",
        "omnigate_media_processing_seconds_bucket",
        "omnigate_media_processing_seconds_count",
        "omnigate_media_processing_seconds_sum",
        "omnigate_modal_tokens_bucket",
        "omnigate_modal_tokens_count",
        "omnigate_modal_tokens_sum",
        "omnigate_screen_score_bucket",
        "omnigate_screen_score_count",
        "omnigate_screen_score_sum",
        "omnigate_segment_calls_total",
        # -- engine pool, rollback controller, engine telemetry, accuracy sentinel
        "omnigate_engine_state",
        "omnigate_engine_traffic_weight",
        "omnigate_engine_concurrency_limit",
        "omnigate_routing_transitions_total",
        "omnigate_routing_actions_held_total",
        "omnigate_routing_table_version",
        "omnigate_controller_leader",
        "omnigate_controller_frozen",
        "omnigate_controller_errors_total",
        "omnigate_telemetry_scrape_errors_total",
        "omnigate_engine_vram_usage_ratio",
        "omnigate_engine_vram_used_bytes",
        "omnigate_engine_kv_cache_usage_ratio",
        "omnigate_sentinel_wer_bucket",
        "omnigate_sentinel_wer_count",
        "omnigate_sentinel_wer_sum",
        "omnigate_sentinel_samples_total",
        "omnigate_engine_tokens_per_joule",
        "omnigate_engine_energy_joules_total",
        "omnigate_engine_accuracy_ratio",
        "omnigate_accuracy_replays_total",
        "omnigate_sentinel_unscored_total",
        "omnigate_engine_sleep_requests_total",
        "omnigate_engine_sleep_state",
        "omnigate_grounding_verdicts_total",
        "omnigate_grounding_score_bucket",
        "omnigate_grounding_score_count",
        "omnigate_grounding_score_sum",
        "omnigate_grounding_scorer_seconds_bucket",
        "omnigate_grounding_scorer_seconds_count",
        "omnigate_grounding_scorer_seconds_sum",
        "omnigate_holdback_wait_seconds_bucket",
        "omnigate_holdback_wait_seconds_count",
        "omnigate_holdback_wait_seconds_sum",
        # -- traffic control: admission, shedding, per-engine caps
        "omnigate_admission_total",
        "omnigate_admission_duration_seconds_bucket",
        "omnigate_admission_duration_seconds_count",
        "omnigate_admission_duration_seconds_sum",
        "omnigate_admission_in_flight",
        "omnigate_admission_fail_open_total",
        "omnigate_admission_lease_renewals_total",
        "omnigate_overloaded",
        "omnigate_traffic_store_up",
        "omnigate_traffic_store_errors_total",
        "omnigate_engine_in_flight",
        "omnigate_engine_waiting",
        "omnigate_engine_queue_wait_seconds_bucket",
        "omnigate_engine_queue_wait_seconds_count",
        "omnigate_engine_queue_wait_seconds_sum",
    }
)

PLANNED: dict[str, str] = {
    # name -> the work stream adding it
}

# Series Prometheus makes itself rather than scraping them.
PROMETHEUS_SYNTHETIC: frozenset[str] = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE"})

# The engines' own metrics (vLLM and vLLM-Omni, scraped as job "vllm-omni"): runbooks may use them
# to look below the gateway; dashboards and rules stay on the gateway's.
ENGINE_METRICS: frozenset[str] = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    }
)

PENDING_GROUP_SUFFIX = "-pending-metrics"
PENDING_PANEL_MARKER = "Pending metric:"

# -- admin routes the runbooks use ----------------------------------------------------------------
ADMIN_ROUTES_PLANNED: dict[str, str] = {}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry's metrics can export, whether or not a series exists yet."""
    names: set[str] = set()
    for family in registry.collect():
        base = family.name
        if family.type == "counter":
            names.add(base + "_total")
        elif family.type == "histogram":
            names.update({base + "_bucket", base + "_count", base + "_sum"})
        elif family.type == "summary":
            names.update({base, base + "_count", base + "_sum"})
        elif family.type == "info":
            names.add(base + "_info")
        else:
            names.add(base)
    return names


def gateway_sample_names() -> set[str]:
    return sample_names(Metrics(CollectorRegistry()).registry)


# -- PromQL ---------------------------------------------------------------------------------------
# Grafana's built-in interval variables, replaced by a duration before parsing.
_GRAFANA_DURATIONS = re.compile(
    r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}"
)


def grafana_to_promql(expr: str) -> str:
    return _GRAFANA_DURATIONS.sub("5m", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, from its parsed syntax tree.

    Covers ``name{...}`` as well as ``{__name__="name"}``; a ``__name__`` regex matcher is
    returned as-is (prefixed ``~``) so callers can refuse it.
    """
    tree = promql_parser.parse(expr)
    found: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                found.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    op = str(m.op)
                    found.add(m.value if op.endswith("Equal") and "Not" not in op else "~" + m.value)
        return True

    promql_parser.walk(tree, visit)
    return found


def label_values_metric(query: str) -> set[str]:
    """Metric names in a Grafana variable query such as ``label_values(metric{...}, label)``."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", query, re.S)
    if m:
        return metric_names(m.group(1))
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query, re.S)
    if m:
        return metric_names(m.group(1))
    raise AssertionError(f"unsupported variable query {query!r}")


# -- rules ----------------------------------------------------------------------------------------
def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yaml"))


def load_groups(paths: Iterable[Path] | None = None) -> list[dict]:
    groups: list[dict] = []
    for p in paths or rule_files():
        groups.extend(yaml.safe_load(p.read_text())["groups"])
    return groups


def recording_rules() -> dict[str, str]:
    out: dict[str, str] = {}
    for g in load_groups():
        for r in g["rules"]:
            if "record" in r:
                out[r["record"]] = r["expr"]
    return out


def alert_rules() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for g in load_groups():
        for r in g["rules"]:
            if "alert" in r:
                out[r["alert"]] = {**r, "group": g["name"]}
    return out


def resolve(names: Iterable[str], recordings: dict[str, str] | None = None) -> set[str]:
    """Replace recording-rule names by the metrics they are computed from, recursively."""
    recordings = recording_rules() if recordings is None else recordings
    out: set[str] = set()
    stack, seen = list(names), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in recordings:
            stack.extend(metric_names(recordings[n]))
        else:
            out.add(n)
    return out
