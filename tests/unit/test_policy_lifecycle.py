"""The policy lifecycle: checked when a plugin loads, started once per generation, closed in reverse order."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry

from gateway.chains import Chains, ChainSet
from gateway.settings import Settings
from observability.metrics import Metrics
from policies.base import Deps, Policy, PolicyBase
from policies.registry import PolicyConfigError, available_plugins, build_chain
from policies.settings import PolicyChainConfig, PolicySpec
from tests.plugins import LIFECYCLE, PLUGINS, Empty, TagConfig


class Bare:
    """A plugin written against the stage hook alone, without the lifecycle."""

    name: ClassVar[str] = "bare"
    stage: ClassVar[str] = "pre"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def pre(self, request, ctx):
        return request


class WantsGpu(PolicyBase):
    name: ClassVar[str] = "wants-gpu"
    stage: ClassVar[str] = "pre"
    Config = Empty
    uses: ClassVar[frozenset[str]] = frozenset({"gpu"})

    def __init__(self, config: Empty) -> None:
        pass

    async def pre(self, request, ctx):
        return request


class ListOrder(WantsGpu):
    name: ClassVar[str] = "list-order"
    uses: ClassVar[frozenset[str]] = frozenset()
    runs_after: ClassVar = ["media-fetch"]  # mistyped on purpose


class SyncStart(WantsGpu):
    name: ClassVar[str] = "sync-start"
    uses: ClassVar[frozenset[str]] = frozenset()

    def start(self, deps: Deps) -> None:  # type: ignore[override]
        pass


class PreRecorder(PolicyBase):
    """Pre: records its start and close."""

    name: ClassVar[str] = "pre-recorder"
    stage: ClassVar[str] = "pre"
    Config = TagConfig

    def __init__(self, config: TagConfig) -> None:
        self.tag = config.tag

    async def start(self, deps: Deps) -> None:
        LIFECYCLE.append(("start", self.tag))

    async def aclose(self) -> None:
        LIFECYCLE.append(("aclose", self.tag))

    async def pre(self, request, ctx):
        return request


TEST_PLUGINS = {**PLUGINS, **{c.name: c for c in (Bare, WantsGpu, ListOrder, SyncStart, PreRecorder)}}
ALL = {**available_plugins(), **TEST_PLUGINS}


def _one(name: str) -> PolicyChainConfig:
    return PolicyChainConfig(pre=[PolicySpec(name=name)])


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("bare", "start must be an async method"),
        ("wants-gpu", "uses unknown resources ['gpu']"),
        ("list-order", "runs_after must be a tuple"),
        ("sync-start", "start must be an async method"),
    ],
)
def test_the_registry_refuses_a_plugin_whose_lifecycle_is_missing_or_mistyped(name, why):
    with pytest.raises(PolicyConfigError, match=rf"policy plugin {name!r}") as err:
        build_chain(_one(name), ALL)
    assert why in str(err.value)


#: the config a built-in cannot be built without (what its model is and what it blocks): no default would
#: be a promise kept
_REQUIRED: dict[str, dict] = {
    name: {
        "served": {
            "url": "http://guard:8000",
            "model": "guard",
            "endpoint": "classify",
            "labels": ["ok", "bad"],
        },
        "categories": {"harm": {"labels": ["bad"], "threshold": 0.5}},
    }
    for name in ("text-screen", "text-screen-answers")
}


def test_every_built_in_policy_implements_the_lifecycle():
    for name, cls in available_plugins().items():
        spec = PolicySpec(name=name, config=_REQUIRED.get(name, {}))
        build_chain(PolicyChainConfig(**{cls.stage: [spec]}), available_plugins())
        assert isinstance(cls.__new__(cls), Policy), name


def test_the_built_ins_that_need_a_model_refuse_to_build_without_one():
    for name in _REQUIRED:
        cls = available_plugins()[name]
        with pytest.raises(PolicyConfigError, match="served"):
            build_chain(PolicyChainConfig(**{cls.stage: [PolicySpec(name=name)]}), available_plugins())


def _settings(pre: list[dict], **sets: list[dict]) -> Settings:
    return Settings(
        policies={"pre": pre},
        policy_sets={k: {"pre": v} for k, v in sets.items()},
        logging={"level": "warning"},
    )


def _deps(settings: Settings) -> Deps:
    return Deps(settings=settings, metrics=Metrics(CollectorRegistry()))


def _rec(tag: str) -> dict:
    return {"name": "pre-recorder", "config": {"tag": tag}}


async def test_a_generation_starts_each_policy_once_and_closes_them_in_reverse_order():
    LIFECYCLE.clear()
    settings = _settings([_rec("a"), _rec("b")], tenant=[_rec("c")])
    chains = ChainSet.build(settings, ALL)
    await chains.open(_deps(settings))
    assert LIFECYCLE == [("start", "a"), ("start", "b"), ("start", "c")]
    await chains.aclose()
    await chains.aclose()  # once
    assert LIFECYCLE[3:] == [("aclose", "c"), ("aclose", "b"), ("aclose", "a")]


async def test_a_failed_start_closes_what_started_before_it_and_names_the_policy():
    LIFECYCLE.clear()
    settings = Settings(
        policies={"pre": [_rec("a")], "post": [{"name": "fail-start"}]}, logging={"level": "warning"}
    )
    chains = ChainSet.build(settings, ALL)
    with pytest.raises(PolicyConfigError, match="policy 'fail-start' could not start: RuntimeError"):
        await chains.open(_deps(settings))
    assert LIFECYCLE == [("start", "a"), ("aclose", "a")] and chains.closed


async def test_a_retired_generation_closes_when_its_last_request_ends():
    LIFECYCLE.clear()
    settings = _settings([_rec("old")])
    old = ChainSet.build(settings, ALL)
    await old.open(_deps(settings))
    live = Chains(old)
    a, b = live.current.acquire(), live.current.acquire()
    new_settings = _settings([_rec("new")])
    new = ChainSet.build(new_settings, ALL, generation=1)
    await new.open(_deps(new_settings))
    assert live.swap(new) is old and live.current is new
    assert live.current.acquire() is new
    a.release()
    await asyncio.sleep(0)
    assert ("aclose", "old") not in LIFECYCLE and live.retired == [old]
    b.release()
    await old.wait_closed()
    assert LIFECYCLE[-1] == ("aclose", "old") and live.retired == []
    new.release()
    assert not new.closed  # current: closed at shutdown
    await live.aclose()
    assert LIFECYCLE[-1] == ("aclose", "new")


async def test_shutdown_closes_a_retired_generation_whose_requests_are_still_open():
    LIFECYCLE.clear()
    settings = _settings([_rec("old")])
    old = ChainSet.build(settings, ALL)
    await old.open(_deps(settings))
    live = Chains(old)
    old.acquire()  # a stream the drain cut without its end reaching the pipeline
    new_settings = _settings([_rec("new")])
    new = ChainSet.build(new_settings, ALL, generation=1)
    await new.open(_deps(new_settings))
    live.swap(new)
    await live.aclose()
    assert old.closed and new.closed
    assert LIFECYCLE[2:] == [("aclose", "new"), ("aclose", "old")]
