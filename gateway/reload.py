"""Config hot reload (SIGHUP or ``POST /admin/config/reload``): validate and open everything, then swap.

A file that does not validate (settings, policy chains, policy sets, tenants) is
refused as a whole and the running config stays; the reason is logged
(``config_reload_failed``) and returned to the admin caller.

What applies at once: tenants, keys, policy chains and policy sets, rate limits, the
admin key, requests, models (sampling defaults). What needs a restart (the running
copy is kept, and a reload that changes it says so in ``restart_required``):
``server``, ``engines``, ``audit``, ``logging``, ``rate_limits``, ``traffic`` (the admission
gate and its store), ``redis`` (the one connection pool), ``auth``, ``metrics``, ``media`` (the
decoding sandbox), ``routing`` (the engine pool, the rollback controller, its telemetry,
sentinels and shared state are built from it once) and ``grounding`` (the scorer and its
model). Whether a key is required is decided at boot: a reload that removes the last
tenant or the admin key does not open the gateway (it reports ``auth`` as needing a
restart).

The policy chains of the new file are a new generation (gateway/chains.py): built and
*started* before the swap, so a media step's session, a screen's model and the grounding
scorer are ready when the first request takes them; a policy that cannot start refuses
the file, what was started for it is closed, and the running generation keeps serving.
After the swap, requests that began on the old generation finish on it (streams
included), and its policies are closed, in reverse order, when the last of them ends.
What the gateway owns (the media sandbox and its worker processes, the grounding scorer,
the metrics) is kept: the new generation takes the same ones. A reload that first names a
policy using the scorer builds and loads it (from the ``grounding`` settings the gateway
booted with), and from then on it is the gateway's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from gateway import heap, secret_check
from gateway.chains import ChainSet
from gateway.services import Services, build_scorer_if_used
from gateway.settings import Settings, load_settings, unmeasured_audio
from policies.registry import PolicyConfigError

log = structlog.get_logger(__name__)

RESTART_ONLY = (
    "server",
    "engines",
    "audit",
    "rate_limits",
    "logging",
    "traffic",
    "redis",
    "auth",
    "metrics",
    "media",
    "routing",
    "grounding",
)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    message: str
    restart_required: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": "reloaded" if self.ok else "refused",
            "message": self.message,
            "restart_required": self.restart_required,
        }


def format_config_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            msg = e["msg"].removeprefix("Value error, ")
            where = ".".join(str(x) for x in e["loc"])
            parts.append(f"{where}: {msg}" if where else msg)
        return "; ".join(parts)
    plain = (PolicyConfigError, FileNotFoundError, secret_check.WeakSecret)
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, plain) else str(exc)


async def _open_chains(services: Services, settings: Settings) -> ChainSet:
    """The new generation, built from ``settings`` and started; closed again (and raising) if it cannot start."""
    chains = ChainSet.build(settings, services.plugins, generation=services.chains.current.generation + 1)
    if services.live is not None:
        for t in services.live.tenants:
            if t.policy_set is not None and t.policy_set not in chains.sets:
                raise PolicyConfigError(
                    f"policy_sets: tenant {t.name!r} (admin) uses the policy set {t.policy_set!r}, "
                    "which the new file no longer defines"
                )
            if (why := unmeasured_audio(settings, t)) is not None:
                raise PolicyConfigError(f"tenant {t.name!r} (admin) audio_seconds_per_minute: {why}")
    scorer = None
    if services.scorer is None:
        scorer = build_scorer_if_used(settings, services.metrics, chains.uses())
        if scorer is not None:
            await scorer.start()  # a model that cannot load refuses the file, as at boot
    deps = services.deps(settings)
    if scorer is not None:
        deps = dataclasses.replace(deps, resources={**deps.resources, "scorer": scorer})
    try:
        await chains.open(deps)
    except BaseException:
        if scorer is not None:
            await scorer.aclose()
        raise
    if scorer is not None:
        services.scorer = scorer  # the gateway's from now on
    return chains


async def reload_config(
    services: Services, path: str | Path, by: dict[str, str] | None = None
) -> ReloadResult:
    """``by`` says who asked: the admin credential, or the signal (recorded with the reload)."""
    async with services.reload_lock:  # a SIGHUP and an admin call at once: one after the other
        return await _reload(services, path, by)


async def _reload(services: Services, path: str | Path, by: dict[str, str] | None) -> ReloadResult:
    old = services.settings
    try:
        new = load_settings(path)
        secret_check.check(new)
        # What runs: the new file, with the sections that need a restart as they are running.
        effective = new.model_copy(update={k: getattr(old, k) for k in RESTART_ONLY})
        chains = await _open_chains(services, effective)
    except Exception as exc:  # a YAML syntax error, a bad value, an unknown policy: all refuse the file
        message = format_config_error(exc)
        services.metrics.config_reloads.labels("failed").inc()
        log.error("config_reload_failed", path=str(path), error=message)
        return ReloadResult(False, message)
    pending = [k for k in RESTART_ONLY if getattr(new, k) != getattr(old, k)]
    if new.auth_required != services.auth_required and "auth" not in pending:
        # Decided at boot: removing the last tenant or the admin key by reload never opens the gateway.
        pending.append("auth")
    services.settings = effective
    retired = services.chains.swap(chains)  # closes once the requests that took it have ended
    services.pipeline.sampling_defaults = {m: c.sampling_defaults.values() for m, c in new.models.items()}
    await services.refresh_directory()
    services.metrics.config_reloads.labels("ok").inc()
    log.info(
        "config_reloaded",
        path=str(path),
        restart_required=pending or None,
        generation=chains.generation,
        retired_in_flight=retired.inflight,
        policies=chains.chain.describe(),
        policy_sets=sorted(chains.sets),
        tenants=len(services.directory.tenants),
    )
    if services.audit is not None:
        await services.audit.append_event(
            "config_reload",
            {
                "by": by,
                "path": str(path),
                "restart_required": pending,
                "policies": chains.chain.describe(),
                "policy_sets": sorted(chains.sets),
                "tenants": sorted(services.directory.tenants),
            },
        )
    heap.refreeze()
    message = "reloaded" + (f"; restart to apply: {', '.join(pending)}" if pending else "")
    return ReloadResult(True, message, pending)
