"""Every Prometheus metric omnigate exports, defined once, with bounded labels.

Labels come from configured sets (engine, variant, public model, policy, stage,
verdict, outcome, reason, error kind); never a request id, user or tenant id.
Tests pass their own ``CollectorRegistry``.

Its length: one declaration per metric, on purpose in one place (rule 18 of the style guide), so that
every name, label set and bucket list can be read and reviewed together. The metrics are made once at
start-up; what the request path calls (``Children``) lives in :mod:`observability.metrics`, which
re-exports these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Latency buckets sized for LLM serving: tens of ms up to a minute. The deployment's thresholds are
# bounds, so a percentile read against one is exact, not interpolated across it: 0.234 (engine TTFT
# target), 0.3 (first audio packet), 0.4 (P50: raise the batch limit), 0.5 (P95: scale out), 0.6
# (P99: roll back). tests/ops checks every alert threshold on a quantile against these.
_LATENCY = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.234,
    0.3,
    0.4,
    0.5,
    0.6,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ADMISSION = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_AUDIT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_WER = (0.0, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
#: the values of the ``state`` label of ``omnigate_engine_state`` (one of them is 1 per engine)
ENGINE_STATES = ("serving", "standby", "half_open", "ejected", "down")
#: the values of the ``reason`` label of ``omnigate_admission_shed_total``
SHED_REASONS = ("text_only", "tenant_quota", "overload", "engine_busy")
_POLICY = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_MEDIA_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES = tuple(float(1 << k) for k in range(10, 31, 2))  # 1 KiB .. 1 GiB
_TOKENS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_SCORE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
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
        self.endpoint_requests = Counter(
            "omnigate_endpoint_requests_total",
            "Requests by the endpoint they came to (chat, transcriptions, speech; realtime: one per response "
            "of a session) and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "omnigate_requests_in_flight", "Chat completion requests being served now", registry=r
        )
        self.ttft = Histogram(
            "omnigate_time_to_first_token_seconds",
            "From request arrival to the first token released to the client (streamed requests: a whole "
            'answer\'s time is omnigate_request_duration_seconds{stream="false"})',
            ["engine", "variant"],
            buckets=_LATENCY,
            registry=r,
        )
        self.upstream_ttft = Histogram(
            "omnigate_engine_time_to_first_token_seconds",
            "From sending the engine request to the engine's first token (streamed requests; what rollback reads)",
            ["engine", "variant"],
            buckets=_LATENCY,
            registry=r,
        )
        # Seconds per 1,000 prompt tokens (a prompt under routing.signals.prompt_tokens_floor counts as that
        # long): what the shipped latency rollback rules read, so the alerts that check them read it too.
        self.upstream_ttft_per_1k = Histogram(
            "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds",
            "The engine's time to first token per 1,000 prompt tokens, a prompt under the window's "
            "prompt_tokens_floor counted as that long (streamed requests whose engine reported prompt tokens)",
            ["engine", "variant", "model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "omnigate_engine_request_seconds",
            "From sending the engine request to the end of the engine's answer",
            ["engine", "variant", "stream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.audio_output = Counter(
            "omnigate_audio_output_seconds_total",
            "Seconds of speech served (vLLM-Omni counts no completion tokens for audio)",
            ["engine", "variant"],
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
            "End-to-end duration of chat completion requests, streamed or not (a whole answer's only latency)",
            ["engine", "variant", "outcome", "stream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.chunk_gap = Histogram(
            "omnigate_inter_chunk_gap_seconds",
            "Widest gap between consecutive chunks of a stream relayed to the client (one observation per stream)",
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
            "omnigate_engine_errors_total",
            "Engine failures by engine and kind",
            ["engine", "kind"],
            registry=r,
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
        self.engine_model_verified = Gauge(
            "omnigate_engine_model_verified",
            "1 when the engine's last probe showed the model id and revision it is configured to serve "
            "(expected_model, expected_revision); 0 while it serves other weights or is not verified yet. "
            "Only engines with an expectation",
            ["engine", "variant"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            "omnigate_engine_healthy",
            "1 when the engine's last health probe passed",
            ["engine", "variant"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "omnigate_client_disconnects_total", "Streams the client left before the end", registry=r
        )
        # -- identity, limits, audit, config (enterprise front door) --------------------------------
        self.auth_failures = Counter(
            "omnigate_auth_failures_total",
            "Requests refused for their API key, by reason",
            ["reason"],
            registry=r,
        )
        # -- the tenant directory and unauthenticated traffic (gateway/directory, gateway/api/auth.py)
        self.directory_fresh = Gauge(
            "omnigate_directory_fresh",
            "1 while directory keys are accepted; 0 once the directory went unread past fail_closed_after_s",
            registry=r,
        )
        self.directory_read_age = Gauge(
            "omnigate_directory_read_age_seconds",
            "Seconds since the tenant directory was last read",
            registry=r,
        )
        self.directory_read_errors = Counter(
            "omnigate_directory_read_errors_total",
            "Failed or timed-out reads of the tenant directory",
            registry=r,
        )
        self.auth_throttled = Counter(
            "omnigate_auth_throttled_total",
            "Requests refused with 429 because their client address failed authentication too often",
            registry=r,
        )
        self.rate_limited = Counter(
            "omnigate_rate_limited_total",
            "Requests refused by a tenant rate limit, by limit",
            ["limit"],
            registry=r,
        )
        self.rate_limiter_errors = Counter(
            "omnigate_rate_limiter_errors_total", "Rate limit checks that could not reach Redis", registry=r
        )
        self.audit_written = Counter(
            "omnigate_audit_records_written_total",
            "Audit records committed to the store, by kind",
            ["kind"],
            registry=r,
        )
        self.audit_buffered = Gauge(
            "omnigate_audit_buffer_records", "Audit records waiting to be committed", registry=r
        )
        self.audit_dropped = Counter(
            "omnigate_audit_records_dropped_total",
            "Audit records not written because the buffer was full (shed: request refused; gap: served)",
            ["reason"],
            registry=r,
        )
        self.audit_buffer_full = Counter(
            "omnigate_audit_buffer_full_total", "Times the audit buffer filled up", registry=r
        )
        self.audit_commit = Histogram(
            "omnigate_audit_commit_seconds",
            "Time to commit one batch of audit records",
            ["store"],
            buckets=_AUDIT,
            registry=r,
        )
        self.audit_batch = Histogram(
            "omnigate_audit_batch_records",
            "Records per audit commit",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.audit_ack_timeouts = Counter(
            "omnigate_audit_ack_timeouts_total",
            "Requests whose audit record was not durable within ack_timeout_s (refused with 503)",
            registry=r,
        )
        self.audit_store_errors = Counter(
            "omnigate_audit_store_errors_total", "Failed audit store operations (retried)", registry=r
        )
        self.config_reloads = Counter(
            "omnigate_config_reloads_total", "Config reloads by result", ["result"], registry=r
        )
        # -- media pre-filters (outcome, kind, source and policy are bounded sets)
        self.media_fetches = Counter(
            "omnigate_media_fetches_total",
            "Media URL fetches by outcome (ok, forbidden, too_large, timeout, http_error, failed)",
            ["outcome"],
            registry=r,
        )
        self.media_fetch_bytes = Histogram(
            "omnigate_media_fetch_bytes", "Bytes read per successful media fetch", buckets=_BYTES, registry=r
        )
        self.media_parts = Counter(
            "omnigate_media_parts_total",
            "Media content parts by kind and outcome (passed, rewritten, refused)",
            ["kind", "outcome"],
            registry=r,
        )
        self.media_seconds = Histogram(
            "omnigate_media_processing_seconds",
            "Time to probe and normalise one media part (off the event loop)",
            ["kind"],
            buckets=_MEDIA_S,
            registry=r,
        )
        self.modal_tokens = Histogram(
            "omnigate_modal_tokens", "Estimated modal tokens per engine call", buckets=_TOKENS, registry=r
        )
        self.screen_scores = Histogram(
            "omnigate_screen_score",
            "Scores of content classifiers by policy and source (image, video, audio)",
            ["policy", "source"],
            buckets=_SCORE,
            registry=r,
        )
        self.segments = Counter(
            "omnigate_segment_calls_total", "Engine calls made for the segments of long inputs", registry=r
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
            "Grounding verdicts per attempt: pass, fail, unverifiable (no claim the evidence bears on), "
            "skipped (a turn that only calls tools, or a request with no evidence to judge against); "
            "and per request: served_low, refused, terminated",
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
        # -- engine pool and rollback controller
        self.engine_state = Gauge(
            "omnigate_engine_state",
            "1 for the engine's current state (serving, standby, half_open, ejected, down)",
            ["engine", "state"],
            registry=r,
        )
        self.engine_weight = Gauge(
            "omnigate_engine_traffic_weight",
            "Largest share of new requests the routing table gives the engine",
            ["engine"],
            registry=r,
        )
        self.engine_limit = Gauge(
            "omnigate_engine_concurrency_limit",
            "Requests in flight this replica allows the engine (-1: no limit)",
            ["engine"],
            registry=r,
        )
        self.routing_transitions = Counter(
            "omnigate_routing_transitions_total",
            "Routing and engine state transitions by action, reason (rule name or fixed word) and source",
            ["action", "reason", "source"],
            registry=r,
        )
        self.routing_holds = Counter(
            "omnigate_routing_actions_held_total",
            "Rule actions due but held back (cooldown, min-dwell, switch-limit, frozen, pinned, no-target)",
            ["rule", "reason"],
            registry=r,
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
        self.engine_vram = Gauge(
            "omnigate_engine_vram_usage_ratio",
            "GPU memory the engine uses, 0..1, as the controller reads it (DCGM, PromQL or NVML; "
            "without one of those, vLLM's KV-cache usage); exported by the controller's leader",
            ["engine"],
            registry=r,
        )
        self.engine_vram_bytes = Gauge(
            "omnigate_engine_vram_used_bytes",
            "GPU memory the engine's GPUs use, in bytes, summed over them (DCGM_FI_DEV_FB_USED or NVML); "
            "exported by the controller's leader",
            ["engine", "variant"],
            registry=r,
        )
        self.engine_kv_cache = Gauge(
            "omnigate_engine_kv_cache_usage_ratio",
            "KV-cache usage the engine reports (vllm:kv_cache_usage_perc), 0..1; "
            "exported by the controller's leader",
            ["engine"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "omnigate_telemetry_scrape_errors_total",
            "Failed telemetry reads by engine and source",
            ["engine", "source"],
            registry=r,
        )
        self.sentinel_wer = Histogram(
            "omnigate_sentinel_wer",
            "Word error rate of sampled speech answers (whisper vs the engine's transcript)",
            ["engine", "variant"],
            buckets=_WER,
            registry=r,
        )
        self.sentinel_samples = Counter(
            "omnigate_sentinel_samples_total",
            "Speech answers offered to the accuracy sentinel, by outcome",
            ["engine", "outcome"],
            registry=r,
        )
        # -- energy and the held-out accuracy sentinel (controller's leader) ----------------------
        self.engine_tokens_per_joule = Gauge(
            "omnigate_engine_tokens_per_joule",
            "Tokens the gateway counted for the engine (completion tokens plus speech seconds converted) "
            "per joule of GPU power integrated over its active time, over the signal window; an estimate",
            ["engine", "variant"],
            registry=r,
        )
        self.engine_energy = Counter(
            "omnigate_engine_energy_joules_total",
            "GPU energy integrated over the engine's active time (DCGM or NVML power, trapezoid); an estimate",
            ["engine", "variant"],
            registry=r,
        )
        self.engine_accuracy = Gauge(
            "omnigate_engine_accuracy_ratio",
            "Share of the held-out set the engine answered exactly right at its last replay, 0..1",
            ["engine", "variant"],
            registry=r,
        )
        self.accuracy_replays = Counter(
            "omnigate_accuracy_replays_total",
            "Replays of the held-out set, by engine and outcome",
            ["engine", "outcome"],
            registry=r,
        )
        # reason: language-config (a configured tenant/model/deployment language the ASR model does not cover)
        # or language-detected (the transcript's script or words say it is not one of those languages)
        self.sentinel_unscored = Counter(
            "omnigate_sentinel_unscored_total",
            "Speech answers the accuracy sentinel did not score because its ASR model does not cover their "
            "language (never counted as word errors)",
            ["engine", "reason"],
            registry=r,
        )
        self.engine_sleep_requests = Counter(
            "omnigate_engine_sleep_requests_total",
            "Sleep and wake requests the controller sent to engines (vLLM-Omni /v1/omni/sleep, /v1/omni/wakeup), "
            "by outcome (ok, refused, unreachable, unknown)",
            ["engine", "action", "outcome"],
            registry=r,
        )
        self.engine_sleep_state = Gauge(
            "omnigate_engine_sleep_state",
            "An engine's sleep state as its vllm:engine_sleep_state reads (0 awake, 1 weights offloaded, "
            "2 discarded); exported by the controller's leader for engines it put to sleep",
            ["engine"],
            registry=r,
        )
        # -- traffic control: admission, load shedding, per-engine limits ------------------------
        self.admissions = Counter(
            "omnigate_admission_total",
            "Admission decisions by priority class and result "
            "(admitted, above_soft_limit, refused_quota, refused_overload)",
            ["priority", "result"],
            registry=r,
        )
        self.admission_shed = Counter(
            "omnigate_admission_shed_total",
            "Requests shed for load, by reason: text_only (speech dropped above the soft limit), "
            "tenant_quota (429), overload (503 above the hard limit), engine_busy (503, every engine full)",
            ["reason"],
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
            "omnigate_overloaded",
            "1 while the gateway is overloaded and engine limits are lowered",
            registry=r,
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
        # /v1/realtime (gateway/realtime): a session's turns are chat requests too, counted above as well
        self.realtime_sessions = Gauge(
            "omnigate_realtime_sessions_open", "Realtime WebSocket sessions open", registry=r
        )
        self.realtime_turns = Counter(
            "omnigate_realtime_turns_total",
            "Realtime responses by how they ended (completed, cancelled, failed)",
            ["status"],
            registry=r,
        )
        self.realtime_first_audio = Histogram(
            "omnigate_realtime_first_audio_seconds",
            "From a realtime response's start (commit, VAD stop or response.create) to its first audio delta sent",
            buckets=_LATENCY,
            registry=r,
        )
        self.realtime_barge_ins = Counter(
            "omnigate_realtime_barge_ins_total",
            "Realtime answers the caller's speech interrupted",
            registry=r,
        )
        self.realtime_cancellations = Counter(
            "omnigate_realtime_cancellations_total",
            "Realtime responses cancelled, by reason (barge_in, client, closed)",
            ["reason"],
            registry=r,
        )
        self.realtime_barge_in_stop = Histogram(
            "omnigate_realtime_barge_in_stop_seconds",
            "From the caller's speech start to the interrupted answer's stop (engine request closed)",
            buckets=_LATENCY,
            registry=r,
        )
        self.realtime_closed = Counter(
            "omnigate_realtime_sessions_closed_total",
            "Realtime sessions closed, by reason (client, limit, abuse, stalled, shutdown)",
            ["reason"],
            registry=r,
        )
        self.engine_in_flight = Gauge(
            "omnigate_engine_in_flight", "Requests holding a slot on the engine", ["engine"], registry=r
        )
        self.engine_waiting = Gauge(
            "omnigate_engine_waiting", "Requests waiting for a slot on the engine", ["engine"], registry=r
        )
        self.engine_queue_wait = Histogram(
            "omnigate_engine_queue_wait_seconds",
            "Time a request waited for a slot on the engine it was given",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
