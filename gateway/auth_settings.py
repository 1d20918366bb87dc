"""Settings of the front door: whether a key is required, the tenant directory, failed-attempt limits, /metrics.

They are decided once at boot (:meth:`AuthSettings.resolve_required`); nothing at run
time, such as the number of tenants, turns authentication on or off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DirectorySettings(_Strict):
    """Where admin-managed tenants and keys live. PostgreSQL is shared by replicas; SQLite is one process's."""

    backend: Literal["sqlite", "postgres"] = Field(
        default="sqlite", description="sqlite (one process) or postgres (shared by the replicas)"
    )
    sqlite_path: Path | None = Field(
        default=None,
        description="default: omnigate-directory.db beside audit.sqlite_path (a file of its own)",
    )
    postgres_dsn: SecretStr | None = Field(
        default=None, description="PostgreSQL DSN of the shared directory (secret)"
    )
    refresh_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=2.0, description="how often a replica checks the directory for changes made on another"
    )
    fail_closed_after_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0, description="after this long without a successful read, directory keys are refused"
    )
    timeout_s: Annotated[float, Field(gt=0, le=30)] = Field(
        default=2.0, description="a directory read slower than this counts as a failed read"
    )

    @model_validator(mode="after")
    def _needs_dsn(self) -> DirectorySettings:
        if self.backend == "postgres" and self.postgres_dsn is None:
            raise ValueError("auth.directory.backend postgres needs auth.directory.postgres_dsn")
        return self

    @property
    def shared(self) -> bool:
        return self.backend == "postgres"

    @property
    def bound_s(self) -> float:
        """How long a change made on one replica can take to be honoured on another (one refresh, one read)."""
        return self.refresh_s + self.timeout_s


class FailureLimitSettings(_Strict):
    """Authentication failures per client address: over the limit, the address gets 429 until the window ends.

    There is no switch to turn it off: the limit and window can only be tuned.
    """

    max_failures: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=20, description="failed authentications from one client address within window_s before 429"
    )
    window_s: Annotated[int, Field(ge=1, le=86_400)] = Field(
        default=60, description="the failure window in seconds"
    )
    store: Literal["auto", "memory", "redis"] = Field(
        default="auto",
        description="auto: Redis when redis.url is set (the replicas share the window), else memory",
    )
    summary_interval_s: Annotated[float, Field(ge=1, le=3600)] = Field(
        default=60.0, description="one aggregated audit record and log line of refused requests per interval"
    )


class AuthSettings(_Strict):
    """Whether a key is required, the tenant directory and the failed-attempt limit."""

    required: bool | None = Field(
        default=None,
        description="require an API key on /v1; default: required whenever the config names tenants, "
        "API keys, an admin key or a shared directory",
    )
    replicas: Annotated[int, Field(ge=1, le=10_000)] = Field(
        default=1, description="how many gateway processes serve this deployment (the Helm chart sets it)"
    )
    directory: DirectorySettings = DirectorySettings()
    failures: FailureLimitSettings = FailureLimitSettings()


class AdminKey(_Strict):
    """A named admin credential: only the SHA-256 of the Bearer key is written down.

    Each admin call is recorded with the name of the credential that made it.
    """

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")] = Field(
        description="the credential's name, recorded with each admin call"
    )
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] = Field(description="SHA-256 of the Bearer key")


class MetricsSettings(_Strict):
    """``/metrics`` on a port of its own, so the public listener does not serve it."""

    port: Annotated[int, Field(ge=0, le=65535)] | None = Field(
        default=None, description="serve /metrics only on this port; unset: on the main port"
    )
    host: str | None = Field(
        default=None, description="bind address of the metrics port; default server.host"
    )
