"""Every Prometheus metric omnigate exports, defined once, with bounded labels.

Labels come from configured sets (engine, variant, public model, policy, stage,
verdict, outcome, reason, error kind); never a request id, user or tenant id.
Tests pass their own ``CollectorRegistry``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Latency buckets sized for LLM serving: tens of ms up to a minute.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ADMISSION = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_POLICY = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("omnigate_build", "omnigate build information", registry=r)
        self.requests = Counter(
            "omnigate_requests_total",
            "Chat completion requests by public model and outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "omnigate_requests_in_flight", "Chat completion requests being served now", registry=r
        )
        self.ttft = Histogram(
            "omnigate_time_to_first_token_seconds",
            "From request arrival to the first token released to the client",
            ["engine", "variant"],
            buckets=_LATENCY,
            registry=r,
        )
        self.first_audio = Histogram(
            "omnigate_time_to_first_audio_seconds",
            "From request arrival to the first audio packet released to the client",
            ["engine", "variant"],
            buckets=_LATENCY,
            registry=r,
        )
        self.duration = Histogram(
            "omnigate_request_duration_seconds",
            "End-to-end duration of chat completion requests",
            ["engine", "variant", "outcome"],
            buckets=_LATENCY,
            registry=r,
        )
        self.chunk_gap = Histogram(
            "omnigate_inter_chunk_gap_seconds",
            "Gap between consecutive chunks relayed to the client",
            ["engine", "variant"],
            buckets=_GAP,
            registry=r,
        )
        self.policy_decisions = Counter(
            "omnigate_policy_decisions_total",
            "Policy decisions by policy, stage and verdict (shadow runs included, labelled)",
            ["policy", "stage", "verdict", "shadow"],
            registry=r,
        )
        self.policy_duration = Histogram(
            "omnigate_policy_duration_seconds",
            "Time spent in each policy",
            ["policy", "stage"],
            buckets=_POLICY,
            registry=r,
        )
        self.degradations = Counter(
            "omnigate_degradations_total",
            "Requests served differently from what the client asked, by reason",
            ["reason"],
            registry=r,
        )
        self.engine_errors = Counter(
            "omnigate_engine_errors_total", "Engine failures by engine and kind", ["engine", "kind"], registry=r
        )
        self.failovers = Counter(
            "omnigate_engine_failovers_total",
            "Requests moved to another engine before their first byte",
            ["engine"],
            registry=r,
        )
        self.retries = Counter(
            "omnigate_retries_total", "Attempts repeated on a post-policy's verdict", ["policy"], registry=r
        )
        self.engine_healthy = Gauge(
            "omnigate_engine_healthy", "1 when the engine's last health probe passed", ["engine", "variant"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "omnigate_client_disconnects_total", "Streams the client left before the end", registry=r
        )
        # -- traffic control: admission, load shedding, per-engine limits ------------------------
        self.admissions = Counter(
            "omnigate_admission_total",
            "Admission decisions by priority class and result "
            "(admitted, above_soft_limit, refused_quota, refused_overload)",
            ["priority", "result"],
            registry=r,
        )
        self.admission_duration = Histogram(
            "omnigate_admission_duration_seconds",
            "Time to take an admission slot, by the store that granted it (local, redis)",
            ["store"],
            buckets=_ADMISSION,
            registry=r,
        )
        self.admission_in_flight = Gauge(
            "omnigate_admission_in_flight",
            "Admitted requests in flight across the gateway (all replicas when shared), as last measured",
            registry=r,
        )
        self.overloaded = Gauge(
            "omnigate_overloaded", "1 while the gateway is overloaded and engine limits are lowered", registry=r
        )
        self.traffic_store_up = Gauge(
            "omnigate_traffic_store_up", "1 while the shared admission store (Redis) answers", registry=r
        )
        self.traffic_store_errors = Counter(
            "omnigate_traffic_store_errors_total",
            "Failed calls to the shared admission store, by operation",
            ["op"],
            registry=r,
        )
        self.admission_fail_open = Counter(
            "omnigate_admission_fail_open_total",
            "Admissions decided on local limits because the shared store was unreachable",
            registry=r,
        )
        self.lease_renewals = Counter(
            "omnigate_admission_lease_renewals_total",
            "Admission lease renewals by result (renewed, lost)",
            ["result"],
            registry=r,
        )
        self.engine_in_flight = Gauge(
            "omnigate_engine_in_flight", "Requests holding a slot on the engine", ["engine"], registry=r
        )
        self.engine_waiting = Gauge(
            "omnigate_engine_waiting", "Requests waiting for a slot on the engine", ["engine"], registry=r
        )
        self.engine_limit = Gauge(
            "omnigate_engine_concurrency_limit", "The engine's current concurrency limit (-1: none)", ["engine"],
            registry=r,
        )
        self.engine_queue_wait = Histogram(
            "omnigate_engine_queue_wait_seconds",
            "Time a request waited for a slot on the engine it was given",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
        self.engine_busy = Counter(
            "omnigate_engine_busy_total",
            "Requests refused because every engine for their public model was full",
            ["model"],
            registry=r,
        )
