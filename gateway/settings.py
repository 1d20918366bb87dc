"""The root settings model: every layer's settings composed into one document, and ``load_settings``.

The YAML file is read first, then ``OMNIGATE_`` environment overrides (:mod:`gateway.settings_sources`).
Each layer declares its own models beside its code (``engines/adapters/settings.py``, ``engines/rollout/settings.py``,
``policies/settings.py``, ``observability/settings.py``, ``gateway/auth_settings.py``,
``gateway/traffic_settings.py``, the kernel's ``core/settings.py``); here they validate as one, with
the checks that span them. Each policy validates its own ``config`` block against the model it
declares (see :mod:`policies.registry`); a bad value fails the boot with the field named.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Annotated, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from core.settings import Name, TenantConfig
from engines.adapters.settings import EngineConfig, default_engines
from engines.rollout.rules import RuleScope, active_rules, why_rule_cannot_act
from engines.rollout.settings import RoutingSettings
from gateway.auth_settings import AdminKey, AuthSettings, MetricsSettings
from gateway.realtime_settings import RealtimeSettings
from gateway.settings_sources import EnvOverYaml
from gateway.traffic_settings import RateLimitSettings, RedisSettings, TrafficSettings
from observability.settings import AuditSettings, LoggingSettings, TracingSettings
from policies.settings import GroundingSettings, MediaSettings, PolicyChainConfig

_log = structlog.get_logger("omnigate.settings")

KeyId = Annotated[str, Field(pattern=r"^[a-z0-9]{8,32}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Strict):
    """The HTTP listener: bind address, body limits, keep-alive and shutdown."""

    host: str = Field(default="127.0.0.1", description="bind address")
    port: Annotated[int, Field(ge=0, le=65535)] = Field(default=8080, description="bind port")
    max_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=16 * 1024 * 1024,
        description="hard cap on a request body, from Content-Length and again while reading (413); pass "
        "large media by URL",
    )
    body_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description="the whole request body must arrive within this (408 otherwise)",
    )
    header_timeout_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=10.0,
        description="a connection's request line and headers must arrive within this of its opening (or of "
        "the request's first byte on a kept-alive connection); otherwise the connection is closed (omnigate "
        "serve; uvicorn has no header timeout of its own)",
    )
    max_header_bytes: Annotated[int, Field(ge=4096, le=1024 * 1024)] = Field(
        default=64 * 1024,
        description="the most bytes a request line and headers may take; a larger head is answered 431 and "
        "its connection closed (omnigate serve; uvicorn's httptools parser has no cap of its own)",
    )
    keepalive_timeout_s: Annotated[int, Field(ge=1, le=300)] = Field(
        default=5, description="an idle connection between two requests is closed after this many seconds"
    )
    sse_keepalive_s: Annotated[float, Field(gt=0)] = Field(
        default=15.0, description="keep-alive comment on idle streams"
    )
    stream_write_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=20.0,
        description="a write to a client (a stream's frame, a piece of a JSON answer) that makes no progress "
        "for this long cuts the response: the engine request is aborted, the request's slots are given back "
        "and its audit record says client_stalled",
    )
    graceful_shutdown_s: Annotated[float, Field(ge=0)] = Field(
        default=30.0,
        description="after the drain delay, time open streams get to finish; then an error frame (code "
        "shutting_down) and [DONE]",
    )
    drain_delay_s: Annotated[float, Field(ge=0)] = Field(
        default=5.0, description="on SIGTERM, readiness fails at once and the gateway keeps serving this long"
    )
    workers: Annotated[int, Field(ge=1, le=256)] = Field(
        default=1,
        description="worker processes serving the port (omnigate serve --workers overrides it); above 1, "
        "omnigate serve refuses to start unless admission, rate limits, engine caps and the routing state "
        "are in Redis, the audit trail (and the directory, where keys are checked) in PostgreSQL and /metrics "
        "on metrics.port",
    )


class ConsoleSettings(_Strict):
    """The operator console under ``/admin/console``: off by default, signed in with ``admin.api_key``."""

    enabled: bool = Field(default=False, description="serve the browser console (needs admin.api_key)")
    session_ttl_s: Annotated[float, Field(gt=0, le=86400)] = Field(
        default=8 * 3600, description="how long a console sign-in lasts before the operator signs in again"
    )


class AdminSettings(_Strict):
    """The admin API under ``/admin``: off the public OpenAPI schema, and 404 unless a key is set."""

    api_key: SecretStr | None = Field(
        default=None,
        description="Bearer key for /admin (recorded as credential api_key); unset with no keys: off",
    )
    keys: list[AdminKey] = Field(default_factory=list, description="named admin credentials (SHA-256 only)")
    console: ConsoleSettings = ConsoleSettings()

    @property
    def enabled(self) -> bool:
        return self.api_key is not None or bool(self.keys)

    @model_validator(mode="after")
    def _console_needs_key(self) -> AdminSettings:
        # The console signs in with the admin key; enabled without one it would be a door with no lock.
        if self.console.enabled and self.api_key is None:
            raise ValueError("admin.console.enabled needs admin.api_key (the console signs in with it)")
        return self

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        # An empty or short key would let "Authorization: Bearer " (or a guess) through.
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("admin.api_key must be at least 16 characters (unset it to disable /admin)")
        return v


class RequestSettings(_Strict):
    """How request bodies are read."""

    unknown_fields: Literal["refuse", "drop"] = Field(
        default="refuse",
        description="a field the gateway does not forward: refuse the request (400 naming it) or drop it "
        "and name it in x-omnigate-dropped-fields",
    )


class ApiKeyConfig(_Strict):
    """A key from the config: only its SHA-256 is written down (``omnigate keys new`` makes one)."""

    id: KeyId = Field(description="the key's public 12-character id (og_<id>_<secret>)")
    tenant: Name = Field(description="the tenant the key belongs to")
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] = Field(
        description="SHA-256 of the whole key, from omnigate keys new"
    )
    enabled: bool = Field(default=True, description="false: the key is refused")


class SamplingDefaults(_Strict):
    """Sampling parameters a model is served with when the client sends none of its own (each on its own)."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = Field(
        default=None, description="default temperature"
    )
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(default=None, description="default top_p")
    top_k: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, description="default top_k (vLLM's; -1: off)"
    )
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = Field(
        default=None, description="default repetition_penalty (vLLM's)"
    )
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        default=None, description="default presence_penalty"
    )
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        default=None, description="default frequency_penalty"
    )

    def values(self) -> dict[str, float | int]:
        return self.model_dump(exclude_none=True)


class ModelSettings(_Strict):
    """Settings of one public model (a key of ``models``), whichever engine serves it."""

    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="applied to a request that does not set the parameter itself (the deployment's: "
        "temperature 0.7, top_p 0.9); recorded in the audit record as sampling_defaults",
    )


_yaml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("omnigate_yaml", default=None)


class Settings(BaseSettings):
    """Root settings. Precedence: constructor arguments, environment, YAML file, defaults."""

    model_config = SettingsConfigDict(
        env_prefix="OMNIGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = ServerSettings()
    requests: RequestSettings = RequestSettings()
    engines: Annotated[list[EngineConfig], Field(min_length=1)] = Field(default_factory=default_engines)
    policies: PolicyChainConfig = PolicyChainConfig()
    logging: LoggingSettings = LoggingSettings()
    tracing: TracingSettings = TracingSettings()
    admin: AdminSettings = AdminSettings()
    grounding: GroundingSettings = GroundingSettings()
    policy_sets: dict[Name, PolicyChainConfig] = Field(default_factory=dict)
    tenants: list[TenantConfig] = Field(default_factory=list)
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    rate_limits: RateLimitSettings = RateLimitSettings()
    audit: AuditSettings = AuditSettings()
    routing: RoutingSettings = RoutingSettings()
    traffic: TrafficSettings = TrafficSettings()
    redis: RedisSettings = RedisSettings()
    auth: AuthSettings = AuthSettings()
    metrics: MetricsSettings = MetricsSettings()
    media: MediaSettings = MediaSettings()
    realtime: RealtimeSettings = RealtimeSettings()
    models: dict[Name, ModelSettings] = Field(
        default_factory=dict, description="per public model: its sampling defaults"
    )

    @property
    def auth_required(self) -> bool:
        """Decided from the config alone: never from how many tenants exist at run time."""
        if self.auth.required is not None:
            return self.auth.required
        return bool(self.tenants or self.api_keys or self.admin.enabled or self.auth.directory.shared)

    @model_validator(mode="after")
    def _redis_where_needed(self) -> Settings:
        if self.redis.url is None:
            if self.routing.state.backend == "redis":
                raise ValueError("routing.state.backend is redis, but redis.url is not set")
            if self.auth.failures.store == "redis":
                raise ValueError("auth.failures.store is redis, but redis.url is not set")
        return self

    @model_validator(mode="after")
    def _directory_path(self) -> Settings:
        d = self.auth.directory
        if d.sqlite_path is None:
            d.sqlite_path = self.audit.sqlite_path.with_name("omnigate-directory.db")
        return self

    @model_validator(mode="after")
    def _auth_cannot_be_off_with_keys(self) -> Settings:
        if self.auth.required is False:
            named = [
                what
                for what, present in (
                    ("tenants", self.tenants),
                    ("api_keys", self.api_keys),
                    ("a shared directory", self.auth.directory.shared),
                )
                if present
            ]
            if named:
                raise ValueError(
                    f"auth.required is false, but the config names {' and '.join(named)}: "
                    "keys that nothing checks would only look like protection"
                )
        return self

    @model_validator(mode="after")
    def _unique_engines(self) -> Settings:
        seen: set[str] = set()
        for e in self.engines:
            if e.name in seen:
                raise ValueError(f"engine name {e.name!r} is used twice")
            seen.add(e.name)
        return self

    @model_validator(mode="after")
    def _tenants_consistent(self) -> Settings:
        names: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in names:
                raise ValueError(f"tenants[{i}].name: tenant {t.name!r} is defined twice")
            names.add(t.name)
            if t.policy_set is not None and t.policy_set not in self.policy_sets:
                raise ValueError(f"tenants[{i}].policy_set: no policy set named {t.policy_set!r}")
            classes = [c.name for c in self.traffic.priorities]
            if t.priority not in classes:
                raise ValueError(
                    f"tenants[{i}].priority: no request class named {t.priority!r} "
                    f"(traffic.priorities: {', '.join(classes)})"
                )
        ids: set[str] = set()
        for i, k in enumerate(self.api_keys):
            if k.id in ids:
                raise ValueError(f"api_keys[{i}].id: key id {k.id!r} is used twice")
            ids.add(k.id)
            if k.tenant not in names:
                raise ValueError(f"api_keys[{i}].tenant: no tenant named {k.tenant!r}")
        return self

    @model_validator(mode="after")
    def _audio_limits_measured(self) -> Settings:
        """A tenant's audio seconds count the input audio media-limits measures: its chain must not be able
        to pass audio on unmeasured (media-limits failing open), or the limit would be a promise not kept."""
        for i, t in enumerate(self.tenants):
            if (why := unmeasured_audio(self, t)) is not None:
                raise ValueError(f"tenants[{i}].audio_seconds_per_minute: {why}")
        return self

    @model_validator(mode="after")
    def _passthrough_keeps_the_guards(self) -> Settings:
        """A passthrough engine's realtime answers never pass the output guards (stream and post policies):
        a chain that promises them to a model on such an engine would refuse every session, so it is refused
        here, where the operator sees it, not at each caller's upgrade."""
        for e in self.engines:
            if e.realtime != "passthrough":
                continue
            chains: dict[str, PolicyChainConfig | None] = {}
            if not self.tenants or any(t.policy_set is None for t in self.tenants):
                chains["policies"] = self.policies
            for t in self.tenants:
                if t.policy_set is not None and (t.models is None or set(t.models) & set(e.serves)):
                    chains[f"policy_sets.{t.policy_set}"] = self.policy_sets.get(t.policy_set)
            for where, chain in chains.items():
                guards = [p.name for p in (*chain.stream, *chain.post)] if chain is not None else []
                if guards:
                    raise ValueError(
                        f"engines.{e.name}.realtime: passthrough relays the engine's own answers, which never "
                        f"pass the output guards of {where} ({', '.join(guards)}) that serve its models; "
                        "configure the engine realtime: chat, or a chain without stream or post policies"
                    )
        return self

    @model_validator(mode="after")
    def _models_are_served(self) -> Settings:
        served = {m for e in self.engines for m in e.serves}
        for name in self.models:
            if name not in served:
                raise ValueError(f"models.{name}: no engine serves a model named {name!r}")
        return self

    @model_validator(mode="after")
    def _weights(self) -> Settings:
        for model in {m for e in self.engines for m in e.serves}:
            fixed = [e for e in self.engines if model in e.serves and e.role != "primary" and e.weight]
            if sum(e.weight or 0 for e in fixed) > 1 + 1e-9:
                raise ValueError(f"the weights of {model!r}'s canaries and fallbacks add up to more than 1")
        return self

    @model_validator(mode="after")
    def _rules_can_act(self) -> Settings:
        """A rule listed in the file that can never act refuses the file; a default one is left out.

        Never acting: its selector matches no engine, or its shift has no engine of a target variant
        serving the models of the engines it watches. The defaults are the deployment's rules for any
        layout, so a small one (one INT4 engine, the embedded model) keeps only those that can act here.
        """
        controller = self.routing.controller
        scope = [RuleScope(e.name, e.variant, e.role, tuple(e.serves)) for e in self.engines]
        if "rules" in controller.model_fields_set:
            for i, rule in enumerate(controller.rules):
                why = why_rule_cannot_act(rule, scope)
                if why is not None:
                    raise ValueError(
                        f"routing.controller.rules[{i}] {rule.name}: {why}; it could never act: "
                        "leave it out, or add the engine it needs"
                    )
            return self
        kept, left_out = active_rules(controller.rules, scope)
        if left_out:
            # A copy (the routing block given may be another Settings' too), the list still unset: the
            # defaults of this layout, checked again against the engines of any Settings built from it.
            fields = {**dict(controller), "rules": kept}
            narrowed = type(controller).model_construct(_fields_set=controller.model_fields_set, **fields)
            self.routing = self.routing.model_copy(update={"controller": narrowed})
            _log.info(
                "rollback_rules_inactive",
                rules=left_out,
                detail="default rollback rules that cannot act on the configured engines are left out",
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _yaml_file.get()
        file = YamlConfigSettingsSource(settings_cls, yaml_file=path) if path is not None else None
        return (init_settings, EnvOverYaml(settings_cls, env_settings, file))


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from an optional YAML file plus the environment."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
    token = _yaml_file.set(Path(path) if path is not None else None)
    try:
        return Settings(**overrides)
    finally:
        _yaml_file.reset(token)


def unmeasured_audio(settings: Settings, tenant: TenantConfig) -> str | None:
    """Why ``tenant``'s audio seconds per minute would not hold under ``settings`` (None when it would): its
    chain runs media-limits in shadow mode or failing open, so input audio it could not measure would be
    served uncounted. The config's tenants are checked when it loads; the admin API's, when one is written
    and when a reload would change their chain."""
    if not tenant.audio_seconds_per_minute:
        return None
    chain = settings.policies if tenant.policy_set is None else settings.policy_sets.get(tenant.policy_set)
    where = "policies" if tenant.policy_set is None else f"the policy set {tenant.policy_set!r}"
    for spec in chain.pre if chain is not None else []:
        if spec.name == "media-limits" and (spec.on_error == "fail_open" or spec.shadow):
            return (
                f"the tenant's chain ({where}) runs media-limits "
                f"{'in shadow mode' if spec.shadow else 'with on_error: fail_open'}, so input audio "
                "it could not measure would be served uncounted; make it act and fail closed, or "
                "give the tenant a policy set that does"
            )
    return None
