"""The audit writer's outage handling: a store that fails or is slow past patience (``refuse``: new
requests get 503 meanwhile; ``spool``: records go to the local journal and are replayed in order once
the store answers), a chain refused under the writer, and the publication of checkpoints.

None of it runs for a record written on time. The writer's state it shares
with :mod:`.log` and :mod:`.upkeep` is declared in :mod:`.writer_state`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from observability.audit.chain import MAX_BATCH, ChainBroken, Checkpoint, Row, plain_data
from observability.audit.store import Entry
from observability.audit.writer_state import WriterState

log = structlog.get_logger("omnigate.audit")

_WARN_EVERY_S = 10.0


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a stray append's outcome (so a failure is not reported as never retrieved)."""
    if not fut.cancelled():
        fut.exception()


class AuditOutage(WriterState):
    """A store that fails or is slow, a chain refused under the writer, and checkpoints' publication, for
    :class:`~observability.audit.log.AuditLog` (see :class:`WriterState` for why base classes)."""

    def _chain_broken(self, kind: str, seq: int, message: str, when: str) -> None:
        self.metrics.audit_store_errors.inc()
        log.error("audit_chain_broken", kind=kind, seq=seq, problem=message, found_at=when)

    async def _refused(self, batch: list[Any], encode: Callable[[], list[Entry]], exc: ChainBroken) -> None:
        """The store's chain was refused (see :mod:`.upkeep`'s docstring): this batch goes to the journal
        (``spool``) or fails its requests (``refuse``); nothing more is appended to the store."""
        p = exc.problem
        if not self._refused_logged:  # once: every batch after it is refused the same way
            self._refused_logged = True
            self._chain_broken(p.kind, p.seq, p.message, "append")
        else:
            self.metrics.audit_store_errors.inc()
        self._unavailable("chain_broken")
        if self._spooling:
            await self._to_spool(batch, encode)
            return
        for pending in batch:
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(exc)

    # -- store outage ---------------------------------------------------------------------------------
    async def _store_slow(
        self, batch: list[Any], encode: Callable[[], list[Entry]], attempt: asyncio.Future[list[Row]]
    ) -> bool:
        """The store is slow past patience: True when the batch went to the journal (``spool``)."""
        self._unavailable("slow")
        if self._spooling:
            attempt.add_done_callback(_consume)  # it may still land: the replay skips it then
            await self._to_spool(batch, encode)
            return True
        return False

    async def _store_failed(
        self,
        batch: list[Any],
        encode: Callable[[], list[Entry]],
        exc: BaseException,
        started: float,
        delay: float,
    ) -> bool:
        """A batch's append failed: True when the batch is dealt with (refused, spooled), False once the
        retry's ``delay`` has passed; on close, with retries long and no journal, its requests fail."""
        if isinstance(exc, ChainBroken):
            await self._refused(batch, encode, exc)
            return True
        self.metrics.audit_store_errors.inc()
        self._warn("audit_store_failed", error=f"{type(exc).__name__}: {exc}", buffered=self.depth)
        if self._closing and delay > 1.0 and not self._spooling:
            for p in batch:
                if p.future is not None and not p.future.done():
                    p.future.set_exception(exc)
            raise exc
        if time.monotonic() - started >= self.settings.ack_timeout_s / 2:
            self._unavailable("failing")
            if self._spooling:
                await self._to_spool(batch, encode)
                return True
        await asyncio.sleep(delay)
        return False

    def _unavailable(self, how: str) -> None:
        if not self._outage:
            self._outage = True
            log.error(
                "audit_store_unavailable",
                how=how,
                on_unavailable=self.settings.on_unavailable,
                patience_s=self.settings.ack_timeout_s / 2,
            )

    async def _to_spool(self, batch: list[Any], encode: Callable[[], list[Entry]]) -> None:
        entries = await asyncio.to_thread(encode)
        try:
            async with self.spool.lock:
                await self.spool.add(self._head[0], entries)
        except OSError as exc:
            log.error("audit_spool_failed", error=f"{type(exc).__name__}: {exc}", records=len(batch))
            for p in batch:
                if p.future is not None and not p.future.done():
                    p.future.set_exception(exc)
            return
        for p in batch:
            if p.future is not None and not p.future.done():
                p.future.set_result(0)
        await self._gaps_closed(batch)
        self._warn("audit_spooled", records=len(entries), spooled=len(self.spool.pending))
        self._ensure_recovery()

    def _ensure_recovery(self) -> None:
        # No replay into a refused chain: the journal keeps its records for the next start.
        if self._spooling and not self.broken and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.create_task(self._recover(), name="audit-spool-replay")

    async def _recover(self) -> None:
        delay = 0.2
        while True:
            try:
                if await self._replay():
                    return
            except ChainBroken as exc:
                self._chain_broken(exc.problem.kind, exc.problem.seq, exc.problem.message, "replay")
                return
            except Exception as exc:
                self._warn("audit_spool_replay_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _replay(self) -> bool:
        """Move the spool into the store, in order and once; True once it is empty (the outage is over)."""
        spool = self.spool
        while True:
            async with spool.lock:
                if not spool.pending:
                    await spool.clear()
                    if self._outage:
                        self._outage = False
                        log.warning("audit_spool_replayed")
                    return True
                chunk = spool.pending[:MAX_BATCH]
            present = await self._stored_after(chunk[0][0])
            todo = [e for _, e in chunk if e.data not in present]
            made: list[Checkpoint] = []
            if todo:
                # the spooled entries are encoded already: "encoding" them is handing them over
                rows = await self.store.append_encoded(todo.copy, self.guard.sealer(False, made))
                self._head = (rows[-1].seq, rows[-1].hash)
                self.guard.appended(*self._head, made)
                for e in todo:
                    self._written(e.kind).inc()
            await spool.replayed(len(chunk))
            await self._publish(made)

    async def _stored_after(self, after_seq: int) -> set[str]:
        found: set[str] = set()
        while rows := await self.store.rows(after_seq, 1000):
            # a record that became record 1 carries the chain's statement beside what was spooled
            found.update(plain_data(r.data) if r.seq == 1 else r.data for r in rows)
            after_seq = rows[-1].seq
        return found

    # -- checkpoints ----------------------------------------------------------------------------------
    async def _publish(self, made: list[Checkpoint]) -> None:
        """Each committed checkpoint goes outside the store too: the log, and the witness file if configured."""
        if not made:
            return
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        for cp in made:
            log.info(
                "audit_checkpoint",
                seq=cp.seq,
                hash=cp.hash,
                created_at=cp.created_at,
                algorithm=cp.algorithm,
                key_id=cp.key_id,
                signature=cp.signature,
                prev=cp.prev,
                every=cp.every,
            )
        try:
            await self.witness.publish(made)
        except OSError as exc:
            self.metrics.audit_store_errors.inc()
            self._warn("audit_witness_failed", error=f"{type(exc).__name__}: {exc}")

    def _warn(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.error(event, **fields)
