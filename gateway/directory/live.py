"""This process's view of the tenant directory: re-read every ``refresh_s``, failing closed when it cannot be.

A refresh reads the store's revision number and re-reads the tenants and keys only
when it changed, so a key created or revoked on one replica is honoured or refused on
every other within ``refresh_s + timeout_s`` (:attr:`DirectorySettings.bound_s`).
A read that fails or takes longer than ``timeout_s`` keeps the last snapshot; once no
read succeeded for ``fail_closed_after_s``, keys from the directory are refused
(the check is in :meth:`gateway.tenants.Directory.authenticate`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from core.errors import Conflict, DirectoryUnavailable
from core.settings import TenantConfig
from gateway.auth_settings import DirectorySettings
from gateway.directory.backends import build_store
from gateway.directory.store import DirectoryStore
from gateway.settings import Settings
from gateway.tenants import KeyEntry
from observability.metrics import Metrics

log = structlog.get_logger(__name__)
_WARN_EVERY_S = 30.0


def write_refusal(settings: Settings, auth_required: bool, store_shared: bool) -> str | None:
    """Why an admin write must be refused in this deployment, or None when it may go ahead."""
    if not auth_required:
        return (
            "authentication is off (auth.required: false): a tenant or key made here would not be "
            "checked; turn authentication on first"
        )
    if settings.auth.replicas > 1 and not store_shared:
        return (
            f"auth.replicas is {settings.auth.replicas}, but the tenant directory is this process's own "
            f"{settings.auth.directory.backend} store: the change would hold on this replica only; "
            "set auth.directory.backend: postgres"
        )
    return None


class LiveDirectory:
    def __init__(
        self, settings: DirectorySettings, metrics: Metrics, store: DirectoryStore | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.store = store if store is not None else build_store(settings)
        self._opened = False
        self.revision: int | None = None
        self.tenants: list[TenantConfig] = []
        self.keys: list[KeyEntry] = []
        #: monotonic time of the last successful read; None until one succeeds
        self.read_at: float | None = None
        self._last_warning = 0.0
        # Computed when scraped, so the gauges agree with the request path's own check at every moment.
        metrics.directory_read_age.set_function(self._age)
        metrics.directory_fresh.set_function(lambda: int(self._age() <= self.settings.fail_closed_after_s))

    def _age(self) -> float:
        return float("inf") if self.read_at is None else time.monotonic() - self.read_at

    async def read(self) -> bool:
        """One refresh; never raises (a failure leaves the last snapshot and its age)."""
        try:
            await asyncio.wait_for(self._read(), self.settings.timeout_s)
        # BLE001 allowed: the store's errors, a timeout, a bad row all count as one failed read (fail closed later)
        except Exception as exc:
            self.metrics.directory_read_errors.inc()
            now = time.monotonic()
            if now - self._last_warning >= _WARN_EVERY_S:
                self._last_warning = now
                log.warning(
                    "directory_read_failed",
                    store=self.store.name,
                    error=f"{type(exc).__name__}: {exc}"[:300],
                    fail_closed_after_s=self.settings.fail_closed_after_s,
                )
            return False
        self.read_at = time.monotonic()
        return True

    async def _read(self) -> None:
        if not self._opened:
            await self.store.open()
            self._opened = True
        rev = await self.store.revision()
        if rev == self.revision:
            return
        rev, tenants, keys = await self.store.load()
        self.tenants = [TenantConfig.model_validate_json(t) for t in tenants]
        self.keys = keys
        self.revision = rev

    async def write(
        self, settings: Settings, auth_required: bool, op: Callable[[DirectoryStore], Awaitable[object]]
    ) -> None:
        """Run one admin write (``op(store)``), refused where it could not hold on every replica."""
        why = write_refusal(settings, auth_required, self.store.shared)
        if why is not None:
            raise Conflict(why)
        try:
            if not self._opened:
                await self.store.open()
                self._opened = True
            await asyncio.wait_for(op(self.store), self.settings.timeout_s)
        except Exception as exc:
            log.warning(
                "directory_write_failed", store=self.store.name, error=f"{type(exc).__name__}: {exc}"[:300]
            )
            raise DirectoryUnavailable(
                "the tenant directory cannot be written right now", retry_after=5
            ) from exc

    async def aclose(self) -> None:
        if self._opened:
            await self.store.close()
