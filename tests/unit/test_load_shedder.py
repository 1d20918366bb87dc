"""The gateway finds the chain's load shedder by what it implements (``policies.base.LoadShedder``),
not by the built-in's name: a plugin of another name that sheds counts, a chain without one is named."""

from __future__ import annotations

from typing import ClassVar

from core.context import RequestContext
from core.schemas import ChatCompletionRequest
from gateway.services import unshed_chains
from policies.base import LoadShedder, PolicyBase, PolicyConfig
from policies.registry import available_plugins, build_chain
from policies.settings import PolicyChainConfig, PolicySpec
from policies.shedding import LoadShedding


class QuietHours(PolicyBase):
    """A third party's shedder: above the soft limit it serves short answers (its own choice)."""

    name: ClassVar[str] = "quiet-hours"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig
    sheds_load: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        return request


class Tagger(PolicyBase):
    name: ClassVar[str] = "load-shedding-notes"  # a name like the built-in's is not what counts
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        return request


PLUGINS = {**available_plugins(), "quiet-hours": QuietHours, "load-shedding-notes": Tagger}


def _chain(*names: str):
    return build_chain(PolicyChainConfig(pre=[PolicySpec(name=n) for n in names]), PLUGINS)


def test_the_built_in_and_a_plugin_are_shedders_by_type():
    assert isinstance(LoadShedding(LoadShedding.Config()), LoadShedder)
    builtin, plugin, neither = _chain("load-shedding"), _chain("quiet-hours"), _chain("load-shedding-notes")
    assert [p.name for p in builtin.implementing(LoadShedder)] == ["load-shedding"]
    assert [p.name for p in plugin.implementing(LoadShedder)] == ["quiet-hours"]
    assert neither.implementing(LoadShedder) == ()


def test_the_chains_without_a_shedder_are_named():
    chains = {
        "policies": _chain("load-shedding", "request-limits"),
        "policy_sets.a": _chain("quiet-hours"),
        "policy_sets.b": _chain("load-shedding-notes"),
    }
    assert unshed_chains(chains) == ["policy_sets.b"]
