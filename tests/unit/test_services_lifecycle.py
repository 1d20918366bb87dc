"""The gateway's resources: each closed once, in the reverse order of start, by aclose or by a start
that fails part-way; a close that fails is logged and the teardown goes on."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.auth_failures import AuthFailures
from gateway.ratelimit import RateLimiter
from gateway.redis_client import SharedRedis
from gateway.services import Services
from gateway.settings import Settings
from observability.metrics import Metrics
from policies.base import Deps, PolicyBase
from policies.registry import PolicyConfigError, available_plugins
from tests.plugins import PLUGINS, Empty

#: what the spies saw, in order: ``(event, resource)`` with event ``start`` or ``close``
EVENTS: list[tuple[str, str]] = []


class ChainProbe(PolicyBase):
    """Pre: records the chain generation's start and close (a policy opens and closes with its chain)."""

    name: ClassVar[str] = "chain-probe"
    stage: ClassVar[str] = "pre"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def start(self, deps: Deps) -> None:
        EVENTS.append(("start", "chains"))

    async def aclose(self) -> None:
        EVENTS.append(("close", "chains"))

    async def pre(self, request, ctx):
        return request


class SpyScorer:
    """Stands in for the grounding scorer (a real one loads a model): counts its start and close."""

    def __init__(self) -> None:
        self.closed = 0

    async def start(self) -> None:
        EVENTS.append(("start", "scorer"))

    async def aclose(self) -> None:
        self.closed += 1
        EVENTS.append(("close", "scorer"))

    def describe(self) -> dict[str, Any]:
        return {"kind": "spy"}


ALL = {**available_plugins(), **PLUGINS, ChainProbe.name: ChainProbe}


def _settings(tmp_path: Path, **extra: Any) -> Settings:
    # An engine nobody listens for: its session and health probes are real, no model is loaded.
    engine = {"name": "e", "kind": "vllm", "base_url": "http://127.0.0.1:9/v1", "model": "m", "serves": ["m"]}
    return Settings(
        engines=[engine],
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        **extra,
    )


def _spy(obj: Any, name: str, start: str | None, close: str) -> None:
    """Record ``obj``'s start (its first call only) and each of its closes, then do the real thing."""
    for attr, event in ((start, "start"), (close, "close")):
        if attr is None:
            continue
        real = getattr(obj, attr)

        def record(event: str = event) -> None:
            if event == "close" or ("start", name) not in EVENTS:
                EVENTS.append((event, name))

        if inspect.iscoroutinefunction(real):

            async def wrapped(*args: Any, _real: Any = real, _record: Any = record, **kw: Any) -> Any:
                _record()
                return await _real(*args, **kw)

        else:

            def wrapped(*args: Any, _real: Any = real, _record: Any = record, **kw: Any) -> Any:
                _record()
                return _real(*args, **kw)

        setattr(obj, attr, wrapped)


def _spy_class(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
    """Record each ``aclose`` of ``cls``'s instances (build registers the bound method as it builds them)."""
    real = cls.aclose

    async def aclose(self: Any) -> None:
        EVENTS.append(("close", name))
        await real(self)

    monkeypatch.setattr(cls, "aclose", aclose)


def _spied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Services:
    """Real services with every resource observed: an admission gate, a metrics port, a chain."""
    settings = _settings(
        tmp_path,
        policies={"pre": [{"name": "chain-probe"}]},
        metrics={"port": 0, "host": "127.0.0.1"},
    )
    # Built by build, started by nobody: they close after everything that started.
    _spy_class(monkeypatch, SharedRedis, "redis")
    _spy_class(monkeypatch, RateLimiter, "limiter")
    _spy_class(monkeypatch, AuthFailures, "auth_failures")
    services = Services.build(settings, Metrics(CollectorRegistry()), ALL)
    assert services.admission is not None and services.metrics_server is not None
    services.scorer = SpyScorer()
    _spy(services.audit, "audit", "start", "aclose")
    _spy(services.live, "live", "read", "aclose")
    _spy(services.media, "media", "start", "aclose")
    _spy(services.admission, "admission", "start", "aclose")
    _spy(services.pool, "pool", "start", "aclose")
    _spy(services.controller, "controller", "start", "aclose")
    _spy(services.metrics_server, "metrics_server", "start", "stop")
    original = services.audit.aclose

    async def audit_close() -> None:
        # The failure summary's last interval goes into the audit trail: its task ends first.
        EVENTS.append(("tasks_done", str(all(t.done() for t in services._tasks))))
        await original()

    services.audit.aclose = audit_close
    return services


def _order(event: str) -> list[str]:
    return [name for e, name in EVENTS if e == event]


async def _eventually(done: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _leftover_threads(before: set[threading.Thread]) -> list[str]:
    def extra() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]

    await _eventually(lambda: not extra())
    return extra()


async def test_a_start_that_fails_at_the_policy_chain_closes_everything_started_before_it(tmp_path):
    before = set(threading.enumerate())
    settings = _settings(
        tmp_path,
        policies={
            "pre": [{"name": "media-fetch"}, {"name": "media-limits"}],
            "post": [{"name": "fail-start"}],
        },
    )
    services = Services.build(settings, Metrics(CollectorRegistry()), ALL)
    scorer = services.scorer = SpyScorer()
    assert services.media is not None and services.media.eager  # media-limits: its workers start with it
    workers: list[Any] = []
    sandbox_start = services.media.sandbox.start

    async def keep_the_pool() -> None:
        await sandbox_start()
        workers.extend(services.media.sandbox._pool._processes.values())

    services.media.sandbox.start = keep_the_pool
    with pytest.raises(PolicyConfigError, match="policy 'fail-start' could not start") as err:
        await services.start()
    assert isinstance(err.value.__cause__, RuntimeError)  # the policy's own error, not a teardown's
    assert services.audit is not None and services.audit._task is not None and services.audit._task.done()
    assert services.audit.store._db is None  # the audit writer drained and closed its store
    assert services._tasks and all(t.cancelled() for t in services._tasks)
    assert services.media.sandbox._pool is None and workers
    assert scorer.closed == 1
    assert await _leftover_threads(before) == []
    assert await _eventually(lambda: not any(p.is_alive() for p in workers))
    await services.aclose()  # after a failed start: nothing is closed a second time
    assert scorer.closed == 1


async def test_the_lifespan_closes_what_a_failed_start_opened_once(tmp_path):
    before = set(threading.enumerate())
    settings = _settings(tmp_path, policies={"post": [{"name": "fail-start"}]})
    app = create_app(settings, registry=CollectorRegistry(), plugins=ALL)
    services: Services = app.state.services
    scorer = services.scorer = SpyScorer()
    with pytest.raises(PolicyConfigError, match="the model file cannot be read"):
        async with app.router.lifespan_context(app):
            pytest.fail("the gateway served after its start failed")
    assert scorer.closed == 1
    assert services.audit is not None and services.audit.store._db is None
    assert await _leftover_threads(before) == []


async def test_start_then_aclose_closes_each_resource_once_in_the_reverse_order_of_start(
    tmp_path, monkeypatch
):
    EVENTS.clear()
    before = set(threading.enumerate())
    services = _spied(tmp_path, monkeypatch)
    await services.start()
    starts = _order("start")
    assert starts[0] == "scorer" and set(starts) == {
        "scorer",
        "audit",
        "live",
        "media",
        "chains",
        "admission",
        "pool",
        "controller",
        "metrics_server",
    }
    assert _order("close") == []
    await services.aclose()
    closes = _order("close")
    assert closes == [*reversed(starts), "auth_failures", "limiter", "redis"]  # the Redis pool last
    assert ("tasks_done", "True") in EVENTS
    assert await _leftover_threads(before) == []


async def test_a_close_that_fails_is_logged_and_the_teardown_goes_on(tmp_path, monkeypatch):
    EVENTS.clear()
    services = _spied(tmp_path, monkeypatch)
    spied_close = services.pool.aclose

    async def failing_close() -> None:
        await spied_close()
        raise RuntimeError("an engine session would not close")

    services.pool.aclose = failing_close
    await services.start()
    with structlog.testing.capture_logs() as logs:
        await services.aclose()
    closes = _order("close")
    assert closes == [*reversed(_order("start")), "auth_failures", "limiter", "redis"]
    failed = [e for e in logs if e["event"] == "service_close_failed"]
    assert len(failed) == 1 and failed[0]["resource"] == "pool", logs
    assert "an engine session would not close" in failed[0]["error"]
    assert services.audit is not None and services.audit.store._db is None


async def test_a_close_that_hangs_is_abandoned_by_name_and_the_teardown_goes_on(tmp_path, monkeypatch):
    # A store that stops answering at shutdown must not hold the process past its stop for good.
    import gateway.services as services_module

    monkeypatch.setattr(services_module, "_CLOSE_S", 0.2)
    EVENTS.clear()
    services = _spied(tmp_path, monkeypatch)
    spied_close = services.pool.aclose

    async def hanging_close() -> None:
        await spied_close()
        await asyncio.Event().wait()

    services.pool.aclose = hanging_close
    await services.start()
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(services.aclose(), 10)
    assert _order("close") == [*reversed(_order("start")), "auth_failures", "limiter", "redis"]
    hung = [e for e in logs if e["event"] == "service_close_timed_out"]
    assert [e["resource"] for e in hung] == ["pool"], logs
    assert services.audit is not None and services.audit.store._db is None


async def test_aclose_twice_closes_nothing_the_second_time(tmp_path, monkeypatch):
    EVENTS.clear()
    services = _spied(tmp_path, monkeypatch)
    await services.start()
    await services.aclose()
    closed = list(EVENTS)
    await services.aclose()
    assert closed == EVENTS


async def test_services_built_and_never_started_close_what_build_opened(tmp_path, monkeypatch):
    EVENTS.clear()
    services = _spied(tmp_path, monkeypatch)
    await services.aclose()
    assert _order("close") == ["auth_failures", "limiter", "redis"]
    await services.aclose()
    assert _order("close") == ["auth_failures", "limiter", "redis"]


class _Part:
    """A control-loop component that records its start and close; ``fail`` makes its start raise."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    async def start(self) -> None:
        EVENTS.append(("start", self.name))
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")

    async def aclose(self) -> None:
        EVENTS.append(("close", self.name))


async def test_a_controller_whose_part_fails_to_start_closes_the_parts_it_started(tmp_path):
    EVENTS.clear()
    services = Services.build(_settings(tmp_path), Metrics(CollectorRegistry()), ALL)
    controller = services.controller
    controller.telemetry = _Part("telemetry")  # type: ignore[assignment]  # stand-ins for the real loops
    controller.accuracy = _Part("accuracy", fail=True)  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="accuracy cannot start"):
            await controller.start()
        assert ("close", "telemetry") in EVENTS and controller._task is None
    finally:
        await services.aclose()


async def test_a_transition_hook_stuck_at_shutdown_does_not_hold_the_controller_open(tmp_path, monkeypatch):
    from engines import controller as controller_module
    from engines.rollout.rollback import Transition

    monkeypatch.setattr(controller_module, "_HOOKS_CLOSE_S", 0.2)
    services = Services.build(_settings(tmp_path), Metrics(CollectorRegistry()), ALL)
    controller = services.controller
    stuck = asyncio.Event()

    async def hook(t: Transition) -> None:
        await stuck.wait()  # a peer that never answers

    controller.on_transition.append(hook)
    try:
        await controller.start()
        controller.emit(Transition(at=0, action="shift", reason="test", source="auto", engine="a"))
        assert controller._hook_tasks
        t0 = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            await asyncio.wait_for(controller.aclose(), 10)
        assert time.monotonic() - t0 < 5
        assert not controller._hook_tasks
        assert any(e["event"] == "transition_hook_abandoned" for e in logs)
    finally:
        await services.aclose()
