"""Finds policy plugins in the ``omnigate.policies`` entry-point group and builds the chain.

Plugins are checked when they are loaded (stage, config model, lifecycle, hook signature),
not on first call, so a broken plugin fails the boot with its name. So is a plugin whose
libraries come with an optional extra of the package that is not installed (its ``extra``,
an :class:`Extra`, or what its ``extra_for(config)`` names for the config it is given): the boot fails
naming the extra, not an ImportError at the first request.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, cast

from pydantic import ValidationError

from policies.base import RESOURCES, STAGE_PROTOCOL, PolicyConfig, Stage
from policies.settings import PolicyChainConfig, PolicySpec

ENTRY_POINT_GROUP = "omnigate.policies"


class PolicyConfigError(ValueError):
    """A policy named in the config is unknown, misplaced or badly configured."""


@dataclass(frozen=True, slots=True)
class Extra:
    """An optional extra of the omnigate package a plugin needs (pyproject.toml's optional-dependencies).

    ``modules`` are the top-level modules the plugin imports from it; the extra counts as installed
    when each of them can be found (found, not imported: the check loads no model runtime).
    """

    name: str
    modules: tuple[str, ...]

    def missing(self) -> list[str]:
        """The modules of ``modules`` that cannot be imported here."""
        out = []
        for module in self.modules:
            if module in sys.modules:
                continue
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:  # a finder that refuses the module (or its parent package)
                found = False
            if not found:
                out.append(module)
        return out

    def refusal(self, what: str) -> str | None:
        """Why ``what`` cannot run here (the extra and how to install it), or None when it can."""
        missing = self.missing()
        if not missing:
            return None
        return (
            f"{what} needs the {self.name!r} extra, which is not installed ({', '.join(missing)} missing): "
            f"pip install 'omnigate[{self.name}]'"
        )


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    name: str
    stage: str
    shadow: bool
    impl: Any
    config: PolicyConfig
    #: what happens when it cannot judge (policies/settings.py ``PolicySpec.on_error``)
    on_error: str = "fail_closed"


@dataclass(frozen=True, slots=True)
class PolicyChain:
    """The resolved chain; the order of each tuple is the order policies run in."""

    pre: tuple[LoadedPolicy, ...]
    stream: tuple[LoadedPolicy, ...]
    post: tuple[LoadedPolicy, ...]
    max_retries: int

    def all(self) -> tuple[LoadedPolicy, ...]:
        return self.pre + self.stream + self.post

    def implementing(self, protocol: type) -> tuple[LoadedPolicy, ...]:
        """The policies whose implementation is a ``protocol`` (a ``runtime_checkable`` one), in chain order."""
        return tuple(p for p in self.all() if isinstance(p.impl, protocol))

    def describe(self) -> dict[str, list[str]]:
        def names(ps: tuple[LoadedPolicy, ...]) -> list[str]:
            return [p.name + (" (shadow)" if p.shadow else "") for p in ps]

        return {"pre": names(self.pre), "stream": names(self.stream), "post": names(self.post)}


class PluginIndex(Mapping[str, type]):
    """The installed plugins by name, each imported only when asked for.

    Importing every plugin would pull in every policy's libraries (image and video
    codecs, NLI tooling) whether the configured chain uses them or not.
    """

    def __init__(self) -> None:
        self._eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        self._loaded: dict[str, type] = {}

    def __getitem__(self, name: str) -> type:
        if name not in self._loaded:
            self._loaded[name] = self._eps[name].load()
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._eps)

    def __len__(self) -> int:
        return len(self._eps)


def available_plugins() -> PluginIndex:
    return PluginIndex()


class PluginClass(Protocol):
    """A policy plugin's class as :func:`check_plugin` has found it (an entry point gives only a ``type``)."""

    stage: Stage
    Config: type[PolicyConfig]
    uses: frozenset[str]
    runs_after: tuple[str, ...]
    media_only: bool

    def __call__(self, config: PolicyConfig) -> Any: ...


def check_plugin(name: str, cls: type) -> PluginClass:
    """``cls`` checked member by member; returned as what the checks showed it to be."""
    for attr in ("name", "stage", "Config"):
        if not hasattr(cls, attr):
            raise PolicyConfigError(f"policy plugin {name!r} lacks the class attribute {attr!r}")
    stage, config = (getattr(cls, a) for a in ("stage", "Config"))
    if stage not in STAGE_PROTOCOL:
        raise PolicyConfigError(f"policy plugin {name!r} declares unknown stage {stage!r}")
    if not (isinstance(config, type) and issubclass(config, PolicyConfig)):
        raise PolicyConfigError(f"policy plugin {name!r}: Config must subclass PolicyConfig")
    _check_lifecycle(name, cls)
    return cast(PluginClass, cls)  # each member is checked above: the cast states what they showed


def _check_lifecycle(name: str, cls: type) -> None:
    """The lifecycle members of :class:`policies.base.Policy`, typed (``PolicyBase`` gives them all)."""
    hint = "(subclass policies.base.PolicyBase for the defaults)"
    for hook in ("start", "aclose"):
        if not inspect.iscoroutinefunction(getattr(cls, hook, None)):
            raise PolicyConfigError(f"policy plugin {name!r}: {hook} must be an async method {hint}")
    uses, runs_after, media_only = (getattr(cls, a, None) for a in ("uses", "runs_after", "media_only"))
    if not isinstance(uses, frozenset) or not all(isinstance(u, str) for u in uses):
        raise PolicyConfigError(f"policy plugin {name!r}: uses must be a frozenset of names {hint}")
    if uses - RESOURCES:
        raise PolicyConfigError(
            f"policy plugin {name!r} uses unknown resources {sorted(uses - RESOURCES)} (known: {sorted(RESOURCES)})"
        )
    if not isinstance(runs_after, tuple) or not all(isinstance(r, str) for r in runs_after):
        raise PolicyConfigError(f"policy plugin {name!r}: runs_after must be a tuple of policy names {hint}")
    if not isinstance(media_only, bool):
        raise PolicyConfigError(f"policy plugin {name!r}: media_only must be a bool {hint}")


def resources_used(cfg: PolicyChainConfig, plugins: Mapping[str, type] | None = None) -> set[str]:
    """The shared resources (``uses``) the plugins a chain names ask for (unknown names: build_chain reports)."""
    plugins = available_plugins() if plugins is None else plugins
    out: set[str] = set()
    for stage in ("pre", "stream", "post"):
        for spec in getattr(cfg, stage):
            cls = plugins.get(spec.name)
            if cls is not None:
                out |= check_plugin(spec.name, cls).uses
    return out


def _load_one(spec: PolicySpec, stage: str, where: str, plugins: Mapping[str, type]) -> LoadedPolicy:
    found = plugins.get(spec.name)
    if found is None:
        known = ", ".join(sorted(plugins)) or "none"
        raise PolicyConfigError(f"{where}.name: unknown policy {spec.name!r} (installed: {known})")
    cls = check_plugin(spec.name, found)
    if cls.stage != stage:
        raise PolicyConfigError(f"{where}.name: policy {spec.name!r} is a {cls.stage} policy, not {stage}")
    try:
        config = cls.Config.model_validate(spec.config)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        raise PolicyConfigError(f"{where}.config.{field}: {first['msg']}") from exc
    # What the plugin needs may depend on its config (``extra_for``: a model served elsewhere needs no
    # runtime here), else its class's ``extra``.
    extra_for = getattr(cls, "extra_for", None)
    extra = extra_for(config) if callable(extra_for) else getattr(cls, "extra", None)
    if isinstance(extra, Extra) and (why := extra.refusal(f"policy {spec.name!r}")) is not None:
        raise PolicyConfigError(f"{where}.name: {why}")
    impl = cls(config)
    if not isinstance(impl, STAGE_PROTOCOL[stage]):
        raise PolicyConfigError(f"policy {spec.name!r} does not implement the {stage} hook")
    return LoadedPolicy(
        name=spec.name, stage=stage, shadow=spec.shadow, impl=impl, config=config, on_error=spec.on_error
    )


def _check_order(stage: str, loaded: tuple[LoadedPolicy, ...]) -> None:
    for i, policy in enumerate(loaded):
        acting_before = {p.name for p in loaded[:i] if not p.shadow}
        for needed in type(policy.impl).runs_after:
            if needed not in acting_before:
                raise PolicyConfigError(
                    f"policies.{stage}[{i}].name: policy {policy.name!r} needs {needed!r} earlier in the "
                    f"{stage} chain (and not in shadow mode)"
                )


#: Pre-policies every chain runs, acting: the first turns every media URL into bytes fetched the safe way,
#: the second sandboxes, bounds and normalises every part. Without them an engine would fetch a client's
#: URL itself, or decode whatever it is sent, so no chain or tenant policy set may go without them.
FIXED_MEDIA_STEPS = ("media-fetch", "media-limits")
#: What may run before the media steps when they are added: decisions that cost no media work.
_BEFORE_MEDIA = frozenset({"load-shedding", "request-limits"})


def with_media_steps(specs: list[PolicySpec]) -> list[tuple[int | None, PolicySpec]]:
    """The pre chain with the fixed media steps: refused in shadow mode, added (defaults) where missing.

    A missing step is inserted after the leading policies that do no media work (load shedding,
    request limits), ``media-fetch`` before ``media-limits``; ``check-config`` and the start-up log
    show the resolved chain.
    """
    for i, spec in enumerate(specs):
        if spec.name in FIXED_MEDIA_STEPS and spec.shadow:
            raise PolicyConfigError(
                f"policies.pre[{i}].shadow: {spec.name!r} is a fixed step of every chain and cannot run in "
                "shadow mode (media would reach the engine unfetched or unchecked)"
            )
    out: list[tuple[int | None, PolicySpec]] = list(enumerate(specs))  # None: added here
    names = [s.name for _, s in out]
    at = 0
    while at < len(out) and out[at][1].name in _BEFORE_MEDIA:
        at += 1
    if "media-fetch" not in names:
        limits = names.index("media-limits") if "media-limits" in names else len(out)
        out.insert(min(at, limits), (None, PolicySpec(name="media-fetch")))
    names = [s.name for _, s in out]
    if "media-limits" not in names:
        out.insert(names.index("media-fetch") + 1, (None, PolicySpec(name="media-limits")))
    return out


def build_chain(cfg: PolicyChainConfig, plugins: Mapping[str, type] | None = None) -> PolicyChain:
    plugins = available_plugins() if plugins is None else plugins
    stages: dict[str, tuple[LoadedPolicy, ...]] = {}
    for stage in ("pre", "stream", "post"):
        specs: list[PolicySpec] = getattr(cfg, stage)
        placed = with_media_steps(specs) if stage == "pre" else list(enumerate(specs))
        stages[stage] = tuple(
            _load_one(
                spec,
                stage,
                f"policies.{stage}[{i}]" if i is not None else f"policies.{stage} (fixed step)",
                plugins,
            )
            for i, spec in placed
        )
        _check_order(stage, stages[stage])
    return PolicyChain(max_retries=cfg.max_retries, **stages)
