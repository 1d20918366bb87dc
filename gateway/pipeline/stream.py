"""The committed stream: :class:`ResponseStream`, and the loop that serves it (:func:`run_stream`).

It relays one attempt through the relay (gateway/pipeline/relay.py); a post-policy's retry opens a new
attempt through the attempt loop (gateway/pipeline/attempt.py) only while nothing has been released.
Its teardown accounts for the request (gateway/pipeline/accounting.py) and waits for the audit record
before the stream's last frame.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from core.context import RequestContext, SegmentPlan
from core.digest import OutputDigest
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from gateway.pipeline import verdicts
from gateway.pipeline.accounting import Outcome
from gateway.pipeline.attempt import Attempt
from gateway.pipeline.segments import concat, segmented
from policies.base import Accept, Halt, Verdict

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline


@dataclass(slots=True)
class ResponseStream:
    """A committed stream. Iterate :meth:`deltas` once, then always :meth:`aclose`.

    :meth:`Pipeline.stream` primes it: it has already run up to the first
    released delta (held in ``_head``), so ``request`` is the attempt being
    served and ``ctx.outputs.response_headers`` holds what the verdicts added.
    """

    pipeline: Pipeline
    request: ChatCompletionRequest
    ctx: RequestContext
    attempt: Attempt
    #: the segments of a long input (a pre-policy's plan), None: one engine call
    plan: SegmentPlan | None = None
    #: why the transport ended the stream early, when it said (:meth:`cut`); the record takes it
    cause: BaseException | None = None
    _released: bool = False
    _gen: AsyncGenerator[list[Delta], None] | None = None
    _head: list[Delta] | None = None
    _ended: bool = False
    _iterated: bool = False

    async def _prime(self) -> None:
        """Run until the first released batch or the end; errors before that reach the caller."""
        self._gen = run_stream(self.pipeline, self)
        async with _ClosedOnError(self._gen):  # cancellation included: the generator's finally accounts
            try:
                self._head = await anext(self._gen)
            except StopAsyncIteration:
                self._ended = True

    def batches(self) -> AsyncIterator[list[Delta]]:
        """The released pieces, a batch at a time (what goes to the client in one write)."""
        if self._iterated or self._gen is None:
            raise RuntimeError("a response stream is primed, then iterated once")
        self._iterated = True
        return self._iter()

    async def deltas(self) -> AsyncIterator[Delta]:
        """The released pieces one at a time."""
        async for batch in self.batches():
            for d in batch:
                yield d

    async def _iter(self) -> AsyncIterator[list[Delta]]:
        assert self._gen is not None
        # A spoken answer's words, as its transcript went out: kept under its audio id once it is served.
        spoken: list[str] | None = [] if self.request.wants_audio else None
        if self._head is not None:
            head, self._head = self._head, None
            if spoken is not None:
                spoken.extend(d.text for d in head if d.text and not d.index)
            yield head
        if not self._ended:
            async for batch in self._gen:
                if spoken is not None:
                    spoken.extend(d.text for d in batch if d.text and not d.index)
                yield batch
        if spoken is not None and self.ctx.record.outcome in ("served", "degraded"):
            ctx = self.ctx
            await self.pipeline.answers.remember(
                ctx.identity.request_id, "".join(spoken), ctx.identity.tenant
            )

    def cut(self, cause: BaseException) -> None:
        """The transport is ending the stream for ``cause`` (e.g. the client stopped reading): the request
        is accounted for with it rather than as a plain cancellation. Call it before the stream is closed
        or its task cancelled."""
        if self.cause is None:
            self.cause = cause

    async def aclose(self) -> None:
        """Release the upstream; safe to call whether or not iteration started or ended, and more than once."""
        if self._gen is None:
            self._gen = _closed()
            await self.attempt.upstream.aclose()
            self.pipeline.accounting.finish(self.ctx, self.cause or GeneratorExit())
        else:
            await self._gen.aclose()


class _ClosedOnError:
    """Closes a generator when the block ends by an exception (any); the exception goes on."""

    __slots__ = ("_gen",)

    def __init__(self, gen: AsyncGenerator[list[Delta], None]) -> None:
        self._gen = gen

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            await self._gen.aclose()


async def _closed() -> AsyncGenerator[list[Delta], None]:
    return
    yield  # pragma: no cover


async def run_stream(p: Pipeline, rs: ResponseStream) -> AsyncGenerator[list[Delta], None]:
    """Relay one stream through filters and checks; retry only while nothing was released."""
    ctx, attempt = rs.ctx, rs.attempt
    relay, accounting = p.relay, p.accounting
    chain = p.chain_for(ctx)
    rounds = verdicts.Rounds(chain, ctx, p.metrics, accounting)
    ended = Outcome()  # GeneratorExit and cancellation are outcomes too (a client that left)
    released = ctx.record.output = (
        OutputDigest(ctx.identity.audit_content != "digests") if accounting.audit is not None else None
    )
    produced = [Completion()]  # the current attempt's answer so far: counted even when it is cut
    try:
        with ended:
            while True:
                ctx.retries_left = rounds.budget
                rs.attempt, rs.request = attempt, attempt.request
                filters = [(pol, pol.impl.open_stream(attempt.request, ctx)) for pol in chain.stream]
                checks = relay.open_checks(chain.post, attempt.request, ctx)
                completion = produced[0] = Completion()
                relayed = attempt
                plan = rs.plan
                if plan is not None and segmented(plan):
                    joined = concat(
                        attempt, plan, ctx, p.open_attempt, p.attempts.unbind, p.metrics.segments.inc
                    )
                    relayed = Attempt(attempt.engine, attempt.request, joined, await anext(joined))
                halted: Halt | None = None
                try:
                    async for batch in relay.relay(relayed, filters, checks, completion, ctx):
                        rs._released = True
                        if released is not None:
                            for delta in batch:
                                released.add(delta)
                        yield batch
                except Halt as h:
                    halted = h
                accepted: list[Accept] = []
                if halted is not None:
                    verdict: Verdict = halted.verdict
                    release: Callable[[], list[Delta]] = list
                elif checks:
                    verdict, release, accepted = await relay.end(
                        attempt.request, completion, ctx, filters, checks
                    )
                else:
                    verdict, accepted = await relay.post(chain.post, attempt.request, completion, ctx)
                    release = partial(relay.flush, filters)
                step = rounds.judge(
                    verdict,
                    accepted,
                    attempt.request,
                    completion,
                    release,
                    released=rs._released,
                    whole=halted is None,
                )
                if step.again is not None:
                    p.attempts.unbind(ctx)
                    attempt = await p.open_attempt(step.again, ctx)
                    continue
                assert step.request is not None and step.completion is not None
                rs.request = step.request
                if outs := step.release():
                    rs._released = True
                    yield [relay.mark(ctx, out) for out in outs]
                accounting.account(ctx, step.completion)
                return
    finally:
        # Finished (and the record handed to the audit) before any await a cancelled task may not complete.
        error = None if ended.error is None else (rs.cause or ended.error)
        if error is not None:
            accounting.account_cut(ctx, produced[0])
        fut = accounting.finish(ctx, error)
        error = ended.error = None  # its traceback holds this frame: no cycle through it
        try:
            await attempt.upstream.aclose()
        finally:
            # The audit record is committed before the stream's last frame and [DONE] go out.
            await accounting.durable(ctx, fut)
