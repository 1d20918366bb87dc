"""The gateway's own chat call to its engines, for guards that ask an engine a question.

A guard's call goes where a client's request for the same model would (the routing view, the engines'
caps and circuits, failover), but holds no admission slot and makes no audit record of its own: it is part
of the client's request that asked for the check, whose record names the guard's verdict.
"""

from __future__ import annotations

import asyncio

from core.errors import EngineError, GuardUnavailable, OmnigateError
from core.events import Completion
from core.schemas import ChatCompletionRequest
from engines.selection import choice
from engines.selection.pool import EnginePool


class PoolChat:
    """:class:`policies.base.EngineChat` over the gateway's engine pool."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    async def __call__(self, request: ChatCompletionRequest, *, timeout_s: float) -> Completion:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._call(request)
        except TimeoutError:
            raise GuardUnavailable(
                f"no engine answered the guard's question within {timeout_s:g} s"
            ) from None
        except OmnigateError as exc:
            # the engine's own words stay in the log: the client hears only that the guard could not judge
            raise GuardUnavailable(
                f"the guard's engine call failed ({exc.code or type(exc).__name__})"
            ) from exc

    async def _call(self, request: ChatCompletionRequest) -> Completion:
        view = self.pool.view
        engines = choice.able(self.pool.candidates(request.model, view), request)
        last: EngineError | None = None
        while engines:
            lease = await self.pool.lease(engines, request.model, view)
            if lease is None:
                break
            engine = lease.engine
            engines = [e for e in engines if e is not engine]
            fitted, _ = choice.fit(engine, request)
            try:
                async with lease:  # settles the slot, and counts a failover-worthy error on the circuit
                    if fitted is None:
                        continue
                    return await engine.complete(fitted)
            except EngineError as exc:
                last = exc
                if not exc.retryable:
                    raise
        raise last or GuardUnavailable(f"no engine can serve {request.model!r} now")
