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
_POLICY = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GROUNDING_SCORE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


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
        # Grounding guard (policies/grounding): scorer cost, verdicts, and what holding back costs clients.
        self.grounding_scorer_seconds = Histogram(
            "omnigate_grounding_scorer_seconds",
            "Time one grounding scoring call took (queueing in the scorer's batcher included)",
            ["scorer"],
            buckets=_POLICY,
            registry=r,
        )
        self.grounding_verdicts = Counter(
            "omnigate_grounding_verdicts_total",
            "Grounding verdicts per attempt: pass, fail; and per request: served_low, refused, terminated",
            ["mode", "verdict"],
            registry=r,
        )
        self.grounding_score = Histogram(
            "omnigate_grounding_score",
            "Grounding score of each judged attempt (minimum over its claim sentences)",
            ["mode"],
            buckets=_GROUNDING_SCORE,
            registry=r,
        )
        self.holdback_wait = Histogram(
            "omnigate_holdback_wait_seconds",
            "How long released output waited in the gateway for the grounding check (per release)",
            ["mode"],
            buckets=_LATENCY,
            registry=r,
        )
