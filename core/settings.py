"""The settings types the kernel needs: the name pattern every layer's settings share, and a tenant.

The request context (:mod:`core.context`) carries a tenant's model; the other layers' settings models
sit beside the packages that own them (``engines/adapters/settings.py``, ``policies/settings.py``,
``observability/settings.py``, ``gateway/settings.py``, which composes the root model).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]
#: a request class of ``traffic.priorities`` (default: interactive, standard, batch)
Priority = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantConfig(_Strict):
    """A tenant: what its keys may use and how its requests are limited, prioritised and audited."""

    name: Name = Field(description="the tenant's name (in audit records and logs)")
    enabled: bool = Field(
        default=True, description="false: every key of the tenant is refused with the same 401"
    )
    models: list[Name] | None = Field(default=None, description="allowed public models; unset: all")
    policy_set: Name | None = Field(default=None, description="a key of policy_sets; unset: policies")
    priority: Priority = Field(default="standard", description="its request class, one of traffic.priorities")
    requests_per_minute: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="moving-window request limit, shared through Redis; unset: none"
    )
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="token budget per fixed minute, charged with real usage; unset: none"
    )
    audio_seconds_per_minute: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="seconds of audio per fixed minute (the request's input audio as media-limits measured it, "
        "and the speech of the answer), charged after each request; unset: none",
    )
    max_concurrency: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="the tenant's requests in flight at once (429 above it); unset: unlimited"
    )
    audit_content: Literal["digests", "redacted", "raw"] = Field(
        default="digests", description="what the audit keeps of prompts and output besides digests"
    )
    unknown_fields: Literal["refuse", "drop"] | None = Field(
        default=None, description="request fields the gateway does not know; unset: requests.unknown_fields"
    )
