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
_WER = (0.0, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
#: the values of the ``state`` label of ``omnigate_engine_state`` (one of them is 1 per engine)
ENGINE_STATES = ("serving", "standby", "half_open", "ejected", "down")
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
        # -- engine pool and rollback controller
        self.engine_state = Gauge(
            "omnigate_engine_state",
            "1 for the engine's current state (serving, standby, half_open, ejected, down)",
            ["engine", "state"], registry=r,
        )
        self.engine_weight = Gauge(
            "omnigate_engine_traffic_weight",
            "Largest share of new requests the routing table gives the engine",
            ["engine"], registry=r,
        )
        self.engine_limit = Gauge(
            "omnigate_engine_concurrency_limit",
            "Requests in flight this replica allows the engine (-1: no limit)",
            ["engine"], registry=r,
        )
        self.routing_transitions = Counter(
            "omnigate_routing_transitions_total",
            "Routing and engine state transitions by action, reason (rule name or fixed word) and source",
            ["action", "reason", "source"], registry=r,
        )
        self.routing_holds = Counter(
            "omnigate_routing_actions_held_total",
            "Rule actions due but held back (cooldown, min-dwell, switch-limit, frozen, pinned, no-target)",
            ["rule", "reason"], registry=r,
        )
        self.routing_version = Gauge(
            "omnigate_routing_table_version", "Version of the routing table this replica applies", registry=r
        )
        self.controller_leader = Gauge(
            "omnigate_controller_leader", "1 while this replica holds the controller lease", registry=r
        )
        self.controller_frozen = Gauge(
            "omnigate_controller_frozen", "1 while the controller is frozen", registry=r
        )
        self.controller_errors = Counter(
            "omnigate_controller_errors_total", "Controller failures, by stage", ["stage"], registry=r
        )
        self.scrape_errors = Counter(
            "omnigate_telemetry_scrape_errors_total", "Failed telemetry reads by engine and source",
            ["engine", "source"], registry=r,
        )
        self.sentinel_wer = Histogram(
            "omnigate_sentinel_wer",
            "Word error rate of sampled speech answers (whisper vs the engine's transcript)",
            ["engine", "variant"], buckets=_WER, registry=r,
        )
        self.sentinel_samples = Counter(
            "omnigate_sentinel_samples_total", "Speech answers offered to the accuracy sentinel, by outcome",
            ["engine", "outcome"], registry=r,
        )

