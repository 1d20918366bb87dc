"""Putting idle engines' weights to sleep and waking them: vLLM-Omni's control routes, carried out for the controller.

:func:`engines.rollout.rollback.decide` says which engine should sleep or wake (an
:class:`~engines.rollout.rollback.Intent`); :class:`OffloadClient` sends it and reads back the
engine's ``vllm:engine_sleep_state`` gauge, which is what routing trusts: an engine is
routed to again only once the gauge says every slept stage is awake.

vLLM-Omni (started with ``--enable-sleep-mode``) serves:

* ``POST /v1/omni/sleep`` with ``{"stage_ids": [...], "level": N}`` (``stage_ids`` at least
  one, ``level`` 0 or more, default 2): 200 ``{"status": "SUCCESS", "acks": [...]}``;
* ``POST /v1/omni/wakeup`` with ``{"stage_ids": [...]}``: 200 with ``SUCCESS`` and the acks,
  or ``{"status": "SKIPPED"}`` when none of the stages sleeps;
* 501 when the engine cannot sleep, 409 when several API servers share the stages, 422 on a bad body.

The gauge is vLLM's, relabelled per stage and replica by vLLM-Omni: one series per
``sleep_state`` (``awake``, ``weights_offloaded`` for level 1, ``discard_all`` for level
2), the current one at 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from engines.rollout.rollback import Intent
from engines.rollout.settings import OffloadSettings
from observability.metrics import Metrics

log = structlog.get_logger("omnigate.offload")

SLEEP_GAUGE = "vllm:engine_sleep_state"
_LEVEL = {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 2.0}


def parse_sleep_state(text: str, stage_ids: Iterable[int] | None = None) -> float | None:
    """The engine's sleep state from its exposition: 0 every stage awake, else the deepest sleep level
    (1 weights offloaded, 2 all discarded); None: no gauge (or none for these stages)."""
    wanted = None if stage_ids is None else {str(s) for s in stage_ids}
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != SLEEP_GAUGE:
            continue
        for sample in family.samples:
            labels = sample.labels
            state = labels.get("sleep_state")
            if sample.name != SLEEP_GAUGE or state not in _LEVEL:
                continue
            stage = labels.get("stage")
            if wanted is not None and stage is not None and stage not in wanted:
                continue
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "sleep_state"))
            if sample.value >= 0.5:
                seen = groups.get(key, math.nan)
                groups[key] = _LEVEL[state] if math.isnan(seen) else max(seen, _LEVEL[state])
            else:
                groups.setdefault(key, math.nan)  # a series at 0: this group's state is another one
    known = [v for v in groups.values() if not math.isnan(v)]
    return max(known) if known else None


@dataclass(frozen=True, slots=True)
class OffloadTarget:
    name: str
    #: the engine's root URL (its base_url without /v1)
    root_url: str
    metrics_url: str | None
    api_key: str | None = None
    gpus: tuple[str, ...] = ()


class OffloadClient:
    """Sends sleep and wake intents and reads the sleep gauge, for the leader's controller loop."""

    def __init__(
        self,
        targets: Iterable[OffloadTarget],
        settings: OffloadSettings,
        metrics: Metrics,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._targets = {t.name: t for t in targets}
        self._client = httpx.AsyncClient(timeout=settings.timeout_s, transport=transport)
        self._state: dict[str, float | None] = {}

    def gpus(self, name: str) -> tuple[str, ...]:
        t = self._targets.get(name)
        return t.gpus if t is not None else ()

    def latest(self, name: str) -> float | None:
        """The last sleep state read (0 awake, 1 or 2 the sleep level; None: not read or no gauge)."""
        return self._state.get(name)

    def _headers(self, t: OffloadTarget) -> dict[str, str]:
        return {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}

    async def refresh(self, names: Iterable[str]) -> None:
        """Read the gauge of these engines (those asleep or waking); a failed read leaves None."""
        for name in names:
            t = self._targets.get(name)
            if t is None or t.metrics_url is None:
                continue
            try:
                r = await self._client.get(t.metrics_url, headers=self._headers(t))
                r.raise_for_status()
                self._state[name] = parse_sleep_state(r.text, self.settings.stage_ids)
            except (httpx.HTTPError, ValueError) as exc:
                self._state[name] = None
                log.warning("sleep_state_unread", engine=name, error=str(exc) or type(exc).__name__)

    async def send(self, intent: Intent) -> bool:
        """POST the intent to the engine; True when the engine answered 200."""
        t = self._targets.get(intent.engine)
        if t is None:
            self._metrics.engine_sleep_requests.labels(intent.engine, intent.action, "unknown").inc()
            return False
        body: dict[str, object] = {"stage_ids": list(self.settings.stage_ids)}
        path = "/v1/omni/wakeup"
        if intent.action == "sleep":
            body["level"] = intent.level
            path = "/v1/omni/sleep"
        try:
            r = await self._client.post(t.root_url + path, json=body, headers=self._headers(t))
        except httpx.HTTPError as exc:
            self._metrics.engine_sleep_requests.labels(intent.engine, intent.action, "unreachable").inc()
            log.warning("engine_sleep_failed", engine=intent.engine, action=intent.action, error=str(exc))
            return False
        ok = r.status_code == 200
        self._metrics.engine_sleep_requests.labels(
            intent.engine, intent.action, "ok" if ok else "refused"
        ).inc()
        status = None
        if ok:
            try:
                status = r.json().get("status")
            except ValueError:
                status = None
        log.info(
            "engine_sleep_sent",
            engine=intent.engine,
            action=intent.action,
            http_status=r.status_code,
            status=status,
        )
        return ok

    async def aclose(self) -> None:
        await self._client.aclose()


def targets_from(engines: Iterable[object], metrics_url_for: Mapping[str, str | None]) -> list[OffloadTarget]:
    """One target per vLLM-Omni engine of the configuration (the only kind with these routes)."""
    out = []
    for e in engines:
        if getattr(e, "kind", None) != "vllm-omni" or getattr(e, "base_url", None) is None:
            continue
        root = str(e.base_url).rstrip("/")  # type: ignore[attr-defined]
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        key = e.api_key.get_secret_value() if getattr(e, "api_key", None) is not None else None  # type: ignore[attr-defined]
        telemetry = getattr(e, "telemetry", None)
        gpus = tuple(telemetry.gpus) if telemetry is not None else ()
        name = e.name  # type: ignore[attr-defined]
        out.append(OffloadTarget(name, root, metrics_url_for.get(name) or root + "/metrics", key, gpus))
    return out
