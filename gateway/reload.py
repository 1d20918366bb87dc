"""Config hot reload (SIGHUP or ``POST /admin/config/reload``): validate everything first, then swap.

A file that does not validate (settings, policy chains, policy sets, tenants) is
refused as a whole and the running config stays; the reason is logged
(``config_reload_failed``) and returned to the admin caller. Tenants, keys,
policy chains and policy sets, rate limits and the admin key take effect at once;
``server``, ``engines``, ``audit``, ``logging``, ``rate_limits`` (the Redis connection),
``traffic`` (the admission gate and its store), ``auth`` and ``metrics`` need a restart,
and a reload that changes them says so (``restart_required``). Whether a key is required
is decided at boot: a reload that removes the last tenant or the admin key does not
open the gateway (it reports ``auth`` as needing a restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from gateway import heap, secret_check
from gateway.services import Services, build_policy_sets
from gateway.settings import load_settings
from policies.registry import PolicyConfigError, build_chain

log = structlog.get_logger(__name__)

RESTART_ONLY = ("server", "engines", "audit", "rate_limits", "logging", "traffic", "auth", "metrics", "media")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    message: str
    restart_required: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": "reloaded" if self.ok else "refused", "message": self.message,
                "restart_required": self.restart_required}


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


async def _start_policies(services: Services, chains: Any) -> None:
    seen: set[int] = set()
    for c in chains:
        for policy in c.all():
            start = getattr(policy.impl, "start", None)
            if start is not None and id(policy.impl) not in seen:
                seen.add(id(policy.impl))
                await start(services)


async def reload_config(services: Services, path: str | Path, by: dict[str, str] | None = None) -> ReloadResult:
    """``by`` says who asked: the admin credential, or the signal (recorded with the reload)."""
    old = services.settings
    try:
        new = load_settings(path)
        secret_check.check(new)
        chain = build_chain(new.policies, services.plugins)
        chains = build_policy_sets(new, services.plugins)
        if services.live is not None:
            for t in services.live.tenants:
                if t.policy_set is not None and t.policy_set not in chains:
                    raise PolicyConfigError(
                        f"policy_sets: tenant {t.name!r} (admin) uses the policy set {t.policy_set!r}, "
                        "which the new file no longer defines"
                    )
        # Started before they are swapped in, as at boot: a media step whose fetcher or sandbox is not
        # open would fail every media request (and a policy that cannot start refuses the file).
        await _start_policies(services, (chain, *chains.values()))
    except Exception as exc:  # a YAML syntax error, a bad value, an unknown policy: all refuse the file
        message = format_config_error(exc)
        services.metrics.config_reloads.labels("failed").inc()
        log.error("config_reload_failed", path=str(path), error=message)
        return ReloadResult(False, message)
    pending = [k for k in RESTART_ONLY if getattr(new, k) != getattr(old, k)]
    if new.auth_required != services.auth_required and "auth" not in pending:
        # Decided at boot: removing the last tenant or the admin key by reload never opens the gateway.
        pending.append("auth")
    services.settings = new.model_copy(update={k: getattr(old, k) for k in RESTART_ONLY})
    services.chain = services.pipeline.chain = chain
    services.pipeline.chains = chains
    services.pipeline.sampling_defaults = {m: c.sampling_defaults.values() for m, c in new.models.items()}
    await services.refresh_directory()
    services.metrics.config_reloads.labels("ok").inc()
    log.info("config_reloaded", path=str(path), restart_required=pending or None,
             policies=chain.describe(), policy_sets=sorted(chains), tenants=len(services.directory.tenants))
    if services.audit is not None:
        await services.audit.append_event("config_reload", {
            "by": by, "path": str(path), "restart_required": pending, "policies": chain.describe(),
            "policy_sets": sorted(chains), "tenants": sorted(services.directory.tenants),
        })
    heap.refreeze()
    message = "reloaded" + (f"; restart to apply: {', '.join(pending)}" if pending else "")
    return ReloadResult(True, message, pending)
