"""The policy chains a gateway serves with: one generation per config, opened, served, retired, closed.

A :class:`ChainSet` is the default chain and the tenants' policy sets built from one config, each
policy instance once. :meth:`ChainSet.open` is the one place policies are started: the lifespan opens
the boot generation with it, a reload opens the next one with it before the swap. Each started
instance's ``aclose`` goes on the generation's :class:`~contextlib.AsyncExitStack`, so teardown runs
in the reverse order of start, and a start that fails closes what was started before raising.

A request takes a reference to the generation that is current when it begins
(:meth:`ChainSet.acquire`) and runs on it to the end, its stream included; it lets go in the
pipeline's ``_finish``. :meth:`Chains.swap` makes a new generation current and retires the old one:
a retired generation closes when its last request lets go (at once when none is in flight).
Shutdown closes the current generation and any retired one still finishing.

What a generation owns and what the gateway owns (``Deps``, policies/base.py):

- owned by the generation, closed with it: every policy instance and what its ``start`` opened
  (media-fetch's HTTP session, the NSFW and audio screens' model threads);
- owned by the gateway, kept across reloads: the media sandbox's worker processes and byte budgets
  (one per process; ``media`` needs a restart), the grounding scorer and its model thread
  (``grounding`` needs a restart; a reload that first names a policy using it builds and loads it
  once, then it stays), the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from policies.base import Deps
from policies.registry import LoadedPolicy, PolicyChain, PolicyConfigError, build_chain

if TYPE_CHECKING:
    from gateway.settings import Settings

log = structlog.get_logger(__name__)


def build_policy_sets(
    settings: Settings, plugins: Mapping[str, type] | None = None
) -> dict[str, PolicyChain]:
    """Every tenant policy set, built and checked like the default chain (a bad one names itself)."""
    chains: dict[str, PolicyChain] = {}
    for name, cfg in settings.policy_sets.items():
        try:
            chains[name] = build_chain(cfg, plugins)
        except PolicyConfigError as exc:
            raise PolicyConfigError(f"policy_sets.{name}: {exc}".replace("policies.", "")) from exc
    return chains


@dataclass(eq=False, slots=True)
class ChainSet:
    """One generation: the default chain and the policy sets, with the teardown of what they started."""

    chain: PolicyChain
    sets: dict[str, PolicyChain] = field(default_factory=dict)
    generation: int = 0
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _inflight: int = 0
    _opened: bool = False
    _retired: bool = False
    _closing: asyncio.Task[None] | None = None
    _closed: bool = False

    @classmethod
    def build(
        cls, settings: Settings, plugins: Mapping[str, type] | None = None, generation: int = 0
    ) -> ChainSet:
        """Built and checked, not started: a bad chain or policy set raises :class:`PolicyConfigError`."""
        return cls(build_chain(settings.policies, plugins), build_policy_sets(settings, plugins), generation)

    def for_set(self, name: str | None) -> PolicyChain:
        """The chain a tenant's requests run: its policy set, or the default chain."""
        return self.sets.get(name, self.chain) if name else self.chain

    def policies(self) -> list[LoadedPolicy]:
        """Every policy instance once, in the order they start: the default chain, then each policy set."""
        seen: dict[int, LoadedPolicy] = {}
        for chain in (self.chain, *self.sets.values()):
            for policy in chain.all():
                seen.setdefault(id(policy.impl), policy)
        return list(seen.values())

    def uses(self) -> set[str]:
        """The shared resources the policies declare they use."""
        return set().union(*(type(p.impl).uses for p in self.policies()))

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def closed(self) -> bool:
        return self._closed

    async def open(self, deps: Deps) -> None:
        """Start each policy once and register its ``aclose``; a failed start closes the rest and raises."""
        if self._opened:
            raise RuntimeError("a chain set is opened once")
        self._opened = True
        try:
            for policy in self.policies():
                try:
                    await policy.impl.start(deps)
                except Exception as exc:
                    raise PolicyConfigError(
                        f"policy {policy.name!r} could not start: {type(exc).__name__}: {exc}"
                    ) from exc
                self._stack.push_async_callback(_close_one, policy)
        except BaseException:
            await self.aclose()
            raise

    def acquire(self) -> ChainSet:
        """A request begins on this generation; it stays open until the matching :meth:`release`."""
        self._inflight += 1
        return self

    def release(self) -> None:
        """A request that began on this generation ended; the last one of a retired generation closes it."""
        self._inflight -= 1
        if self._inflight == 0 and self._retired:
            self._schedule_close()

    def retire(self) -> None:
        """Superseded by a reload: no new request takes it; closed once its requests ended."""
        self._retired = True
        if self._inflight == 0:
            self._schedule_close()

    def _schedule_close(self) -> None:
        if self._closing is None and not self._closed:
            self._closing = asyncio.get_running_loop().create_task(
                self.aclose(), name=f"policy-chains-{self.generation}-close"
            )

    async def wait_closed(self) -> None:
        if self._closing is not None:
            await asyncio.shield(self._closing)

    async def aclose(self) -> None:
        """Close what was started, in reverse order; once (later calls return at once)."""
        if self._closed:
            return
        self._closed = True
        await self._stack.aclose()
        log.debug("policy_chains_closed", generation=self.generation)


async def _close_one(policy: LoadedPolicy) -> None:
    # One policy's failing close must not keep the others open.
    try:
        await policy.impl.aclose()
    except Exception as exc:
        log.warning("policy_close_failed", policy=policy.name, error=f"{type(exc).__name__}: {exc}")


class Chains:
    """The generation new requests take, and the retired ones still finishing their requests."""

    def __init__(self, current: ChainSet) -> None:
        self.current = current
        self._retired: set[ChainSet] = set()

    def swap(self, new: ChainSet) -> ChainSet:
        """Make ``new`` (opened) current; the old one closes after its last request. Returns the old one."""
        old, self.current = self.current, new
        self._retired = {c for c in self._retired if not c.closed}
        self._retired.add(old)
        old.retire()
        return old

    @property
    def retired(self) -> list[ChainSet]:
        """Retired generations not closed yet (their requests are still running)."""
        return [c for c in self._retired if not c.closed]

    async def aclose(self) -> None:
        """Shutdown: the current generation, then any retired one (its streams were ended by the drain)."""
        try:
            await self.current.aclose()
        finally:
            for old in list(self._retired):
                await old.aclose()
                if old._closing is not None:
                    with contextlib.suppress(Exception):
                        await old._closing
            self._retired.clear()
