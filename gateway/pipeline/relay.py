"""Between the engine and the client: stream filters, streaming post-checks and post-policies.

:meth:`Relay.relay` moves one attempt's deltas through the stream filters and the hold-back, window or
passthrough checks (NeMo's trade-off: release first and only be able to terminate, or hold back and be
able to block or retry); :meth:`Relay.end` and :meth:`Relay.post` judge a finished attempt. Per-stream
state lives in the filters and checks opened for each attempt, never here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog

from core.context import RequestContext
from core.errors import EngineError
from core.events import Completion, Delta, Usage
from core.schemas import ChatCompletionRequest
from engines.selection.pool import EnginePool
from gateway.pipeline import unjudged as judging
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.attempt import Attempt
from observability.metrics import Metrics
from policies.base import Accept, Halt, Retry, StreamCheck, StreamFilter, StreamingPostPolicy, Verdict
from policies.registry import LoadedPolicy

log = structlog.get_logger("omnigate.request")

_DEAD: Any = object()  # a shadow check that halted: not fed any more

Filters = list[tuple[LoadedPolicy, StreamFilter]]
Checks = list[tuple[LoadedPolicy, Any]]


class Relay:
    def __init__(self, pool: EnginePool, metrics: Metrics, accounting: Accounting) -> None:
        self.pool = pool
        self.metrics = metrics
        self._ran = accounting.policy_ran

    # -- judging a finished attempt -------------------------------------------
    async def post(
        self,
        post: Sequence[LoadedPolicy],
        request: ChatCompletionRequest,
        completion: Completion,
        ctx: RequestContext,
    ) -> tuple[Verdict, list[Accept]]:
        """Post-policies in order; the first acting non-Accept verdict wins. Also returns the Accepts seen."""
        accepted: list[Accept] = []
        for policy in post:
            t0 = time.perf_counter()
            verdict = await judging.post_verdict(policy, request, completion, ctx)
            out = self.judged(policy, ctx, verdict, t0, accepted)
            if out is not None:
                return out, accepted
        return Accept(), accepted

    def judged(
        self, policy: LoadedPolicy, ctx: RequestContext, verdict: Verdict, t0: float, accepted: list[Accept]
    ) -> Verdict | None:
        """Record one post verdict; the verdict to act on, or None to go on with the next policy."""
        name = judging.verdict_name(verdict)
        self._ran(
            policy,
            ctx,
            name,
            time.perf_counter() - t0,
            getattr(verdict, "reason", None) or getattr(verdict, "detail", None),
            getattr(verdict, "score", None),
        )
        if policy.shadow:
            return None
        if isinstance(verdict, Accept):
            accepted.append(verdict)
            return None
        if isinstance(verdict, Retry):
            return replace(verdict, reason=policy.name)
        return verdict

    @staticmethod
    def open_checks(
        post: Sequence[LoadedPolicy], request: ChatCompletionRequest, ctx: RequestContext
    ) -> Checks:
        """One entry per post-policy, in order: its stream check, or None for a plain post-policy."""
        out: Checks = []
        for p in post:
            impl = p.impl
            out.append((p, impl.open_check(request, ctx) if isinstance(impl, StreamingPostPolicy) else None))
        return out if any(c is not None for _, c in out) else []

    async def end(
        self,
        request: ChatCompletionRequest,
        completion: Completion,
        ctx: RequestContext,
        filters: Filters,
        checks: Checks,
    ) -> tuple[Verdict, Callable[[], list[Delta]], list[Accept]]:
        """End of an attempt: the filters' tails go through the checks, then each post verdict in order.

        A check's held deltas move on to the next check only after it accepted,
        so every check judges all that would reach the client.
        """
        batch = self.flush(filters)
        accepted: list[Accept] = []
        for policy, check in checks:
            if check is _DEAD:
                continue
            t0 = time.perf_counter()
            if check is None:
                verdict: Verdict = await judging.post_verdict(policy, request, completion, ctx)
                out = batch
            else:
                verdict, out = await judging.check_verdict(policy, check, batch, ctx)
            acting = self.judged(policy, ctx, verdict, t0, accepted)
            if acting is None:
                if check is not None:
                    batch = batch if policy.shadow else out + check.release()
                continue
            held: StreamCheck | None = check

            def release(out: list[Delta] = out, held: StreamCheck | None = held) -> list[Delta]:
                return out + (held.release() if held is not None else [])

            return acting, release, accepted
        return Accept(), (lambda batch=batch: batch), accepted

    # -- the stream -------------------------------------------------------------
    async def relay(
        self, attempt: Attempt, filters: Filters, checks: Checks, completion: Completion, ctx: RequestContext
    ) -> AsyncIterator[list[Delta]]:
        """The attempt's released pieces, a batch at a time: what one read of the engine brought
        (``Delta.more``) and the filters and checks let through goes out together, in one write."""
        engine = attempt.engine
        upstream = attempt.upstream
        first: Delta | None = attempt.first
        last_t = widest = 0.0
        cap = attempt.request.output_token_limit
        if cap is not None:
            cap *= attempt.request.choices  # n > 1: the pieces of every choice arrive on one stream
        pieces = 0
        batch: list[Delta] = []
        try:
            while True:
                if first is not None:
                    delta, first = first, None
                else:
                    try:
                        delta = await anext(upstream)
                    except StopAsyncIteration:
                        if attempt.sent:
                            ctx.record.upstream_e2e_s = time.perf_counter() - attempt.sent
                        break
                cut = False
                if cap is not None and (n := delta.output_pieces):
                    # The engine ignored max_tokens: each streamed piece (text, reasoning, a tool call's
                    # arguments) carries at least one token, so more pieces than the cap means more tokens
                    # than the cap. Cut it there.
                    pieces += n
                    if pieces > cap:
                        ctx.outputs.degrade("output-capped")
                        delta = Delta(finish_reason="length")
                        completion.usage = Usage(completion.usage.prompt_tokens, cap)
                        cut = True
                completion.add(delta)
                out = [delta] if not filters else self.feed(filters, delta)
                if checks:
                    try:
                        out = await self.feed_checks(checks, out, ctx)
                    except Halt:
                        if batch:  # released before the check halted: it goes out, then the stream ends
                            last_t, widest = self._released(batch, ctx, last_t, widest)
                            yield batch
                            batch = []
                        raise
                if out:
                    batch += out
                if batch and (cut or not delta.more):
                    last_t, widest = self._released(batch, ctx, last_t, widest)
                    yield batch
                    batch = []
                if cut:
                    break
            if batch:
                last_t, widest = self._released(batch, ctx, last_t, widest)
                yield batch
        except EngineError as exc:
            self.metrics.engine_errors.labels(engine.name, exc.kind).inc()
            self.pool.report_failure(engine)
            log.warning("engine_stream_failed", engine=engine.name, kind=exc.kind, error=exc.detail)
            if batch:  # what came before the failure in the same read still goes out, ahead of the error
                last_t, widest = self._released(batch, ctx, last_t, widest)
                yield batch
            raise
        finally:
            if widest:
                # One observation per stream, never per chunk: its widest gap between released batches.
                self.metrics.chunk_gap.labels(engine.name, engine.config.variant).observe(widest)
            await upstream.aclose()

    @staticmethod
    def _released(
        batch: list[Delta], ctx: RequestContext, last_t: float, widest: float
    ) -> tuple[float, float]:
        """A batch about to go out: the first text and audio times, and the widest gap so far."""
        now = time.perf_counter()
        if last_t and now - last_t > widest:
            widest = now - last_t
        record = ctx.record
        if record.ttft_s is None or record.first_audio_s is None:
            for d in batch:
                if record.ttft_s is None and (d.text or d.audio):
                    record.ttft_s = now - record.started
                if record.first_audio_s is None and d.audio:
                    record.first_audio_s = now - record.started
        return now, widest

    async def feed_checks(self, checks: Checks, batch: list[Delta], ctx: RequestContext) -> list[Delta]:
        for i, (policy, check) in enumerate(checks):
            if check is None or check is _DEAD or not batch:
                continue
            released: list[Delta] = []
            for j, d in enumerate(batch):
                t0 = time.perf_counter()
                try:
                    out = await check.feed(d)
                except Halt as h:
                    v = h.verdict
                    self._ran(
                        policy,
                        ctx,
                        type(v).__name__.lower(),
                        time.perf_counter() - t0,
                        "halted",
                        getattr(v, "score", None),
                    )
                    if not policy.shadow:
                        if isinstance(v, Retry):
                            h.verdict = replace(v, reason=policy.name)
                        raise
                    checks[i] = (policy, _DEAD)
                    released = batch
                    break
                except Exception as exc:
                    if not judging.could_not_judge(exc):
                        raise
                    refused = judging.unjudged(policy, ctx, exc)
                    verdict = judging.UNAVAILABLE if refused else judging.NOT_SCANNED
                    self._ran(policy, ctx, verdict, time.perf_counter() - t0, None)
                    if refused is not None:
                        raise refused from exc
                    checks[i] = (policy, _DEAD)  # failing open: it is fed no more
                    released += check.release() + batch[j:]
                    break
                released.extend([d] if policy.shadow else out)
            batch = released
        return batch

    @staticmethod
    def feed(filters: Filters, delta: Delta) -> list[Delta]:
        batch = [delta]
        for policy, f in filters:
            released: list[Delta] = []
            for d in batch:
                out = f.feed(d)
                released.extend([d] if policy.shadow else out)
            batch = released
        return batch

    @staticmethod
    def flush(filters: Filters) -> list[Delta]:
        """End of stream: each filter's held tail, passed through the filters after it."""
        batch: list[Delta] = []
        for policy, f in filters:
            if policy.shadow:
                f.finish()
                continue
            out: list[Delta] = []
            for d in batch:
                out.extend(f.feed(d))
            out.extend(f.finish())
            batch = out
        return batch

    @staticmethod
    def mark(ctx: RequestContext, d: Delta) -> Delta:
        """A delta released at the end of an attempt (held back until then): first text/audio, digest."""
        if ctx.record.output is not None:
            ctx.record.output.add(d)
        if ctx.record.ttft_s is None and (d.text or d.audio):
            ctx.record.ttft_s = ctx.record.elapsed()
        if ctx.record.first_audio_s is None and d.audio:
            ctx.record.first_audio_s = ctx.record.elapsed()
        return d
