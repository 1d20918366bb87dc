"""Settings of observability: structured logging, traces and the audit trail (store, commits, signing, spool)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoggingSettings(_Strict):
    """Structured log events (structlog); prompts, answers and media are never logged (the audit record
    keeps them, as ``audit_content`` says)."""

    level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    json_output: bool = Field(
        default=True, alias="json", description="structlog JSON events (false: console lines)"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TracingSettings(_Strict):
    """OpenTelemetry traces (observability/tracing.py). The standard ``OTEL_*`` variables configure the
    SDK as everywhere else (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL``,
    ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_SDK_DISABLED``);
    a field set here wins over its variable."""

    enabled: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="auto: on when an OTLP endpoint is configured (here or by OTEL_EXPORTER_OTLP_"
        "[TRACES_]ENDPOINT) and OTEL_SDK_DISABLED is not true; off costs the request path nothing",
    )
    endpoint: str | None = Field(
        default=None,
        description="the collector's OTLP endpoint (http/protobuf: the full URL of /v1/traces; grpc: "
        "host:port or URL); unset: the OTEL_EXPORTER_OTLP_* variables, then the SDK's default",
    )
    protocol: Literal["http/protobuf", "grpc"] | None = Field(
        default=None, description="unset: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, then http/protobuf"
    )
    service_name: str | None = Field(default=None, description="unset: OTEL_SERVICE_NAME, then omnigate")
    sample_ratio: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None,
        description="share of new traces kept (parent-based: a sampled client trace is kept); "
        "unset: OTEL_TRACES_SAMPLER and its argument",
    )
    client_context: Literal["continue", "link", "ignore"] = Field(
        default="continue",
        description="a client's W3C traceparent: continue its trace; or start a new root that links to "
        "it (clients outside the trust boundary); or ignore it",
    )


class AuditSigning(_Strict):
    """The key that signs audit checkpoints."""

    algorithm: Literal["hmac-sha256", "ed25519"] = Field(
        default="hmac-sha256",
        description="checkpoint signatures: hmac-sha256, or ed25519 (auditors verify with the public key "
        "alone)",
    )
    key: SecretStr | None = Field(
        default=None, description="hmac-sha256: the secret; ed25519: base64 of the 32-byte private key"
    )
    key_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = Field(
        default="default", description="the key's name, recorded with each checkpoint"
    )


class AuditSettings(_Strict):
    """The audit trail: one hash-chained record per request, with signed checkpoints."""

    enabled: bool = Field(default=True, description="the audit trail; off, nothing is recorded")
    store: Literal["sqlite", "postgres"] = Field(
        default="sqlite", description="sqlite (one file, WAL, fsync per commit) or postgres"
    )
    sqlite_path: Path = Field(default=Path("var/omnigate-audit.db"), description="the SQLite file")
    postgres_dsn: SecretStr | None = Field(
        default=None, description="PostgreSQL DSN, e.g. postgresql://audit@db:5432/omnigate (secret)"
    )
    commit: Literal["sync", "group"] = Field(
        default="group", description="group: one transaction per batch; sync: one per record"
    )
    group_commit_ms: Annotated[float, Field(ge=0, le=10)] = Field(
        default=2.0, description="group commit: what arrives within this many ms goes in one transaction"
    )
    buffer: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        default=10_000, description="records the bounded buffer holds before when_full applies"
    )
    when_full: Literal["shed", "mark_gap"] = Field(
        default="shed",
        description="buffer full: shed (503 overloaded) or mark_gap (serve on, a gap record later)",
    )
    ack_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=5.0,
        description="longest a response waits for its record to be durable (then 503); half of it declares "
        "the store unavailable",
    )
    checkpoint_every: Annotated[int, Field(ge=1)] = Field(
        default=1000, description="a signed checkpoint every this many records"
    )
    checkpoint_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="and at least this often"
    )
    retention_days: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="delete older records at checkpoint boundaries; unset: keep all"
    )
    signing: AuditSigning = AuditSigning()
    witness_path: Path | None = Field(
        default=None,
        description="append each signed head here too (JSON lines, fsynced): a witness kept "
        "outside the store for `omnigate audit verify --expect-file`",
    )
    on_unavailable: Literal["refuse", "spool"] = Field(
        default="refuse",
        description="when the store does not take a record within half of ack_timeout_s: refuse (503 until it "
        "does) or spool (an fsynced local journal, replayed into the store in order when it returns)",
    )
    spool_path: Path | None = Field(
        default=None,
        description="the local journal (spooled records, open gap markers); default: the SQLite "
        "file's path with .spool, or var/omnigate-audit.spool",
    )

    @property
    def spool_file(self) -> Path:
        if self.spool_path is not None:
            return self.spool_path
        return (
            self.sqlite_path.with_suffix(".spool")
            if self.store == "sqlite"
            else Path("var/omnigate-audit.spool")
        )

    @model_validator(mode="after")
    def _needs_dsn(self) -> AuditSettings:
        if self.enabled and self.store == "postgres" and self.postgres_dsn is None:
            raise ValueError("audit.store postgres needs audit.postgres_dsn")
        return self
