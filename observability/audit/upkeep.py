"""The audit writer's upkeep: start-up and the chain check, close, the full buffer, a record not durable
in time, checkpoints on demand and retention, and the reads for tests and support.

None of it runs for a record written on time: :mod:`.log` keeps the buffer, the writer's loop and the
write of a batch, and :class:`~observability.audit.log.AuditLog` takes these methods from
:class:`AuditUpkeep` (and the outage modes from :class:`~observability.audit.outage.AuditOutage`).

The writer extends only a chain that verifies against its newest checkpoint
(:mod:`.guard`): at start-up it walks from that checkpoint to the head, and a chain
that fails is refused from the start (the gateway runs so the admin API and the
console can show where it breaks, and appends nothing); live, a chain found rewritten
under it is refused for good (an ``audit_chain_broken`` error event,
``omnigate_audit_store_errors_total``): new requests get 503 ``audit_unavailable``
in either ``on_unavailable`` mode, records already taken go to the journal
(``spool``) or fail their requests (``refuse``), and nothing is signed on top of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from core.errors import AuditUnavailable
from observability.audit.chain import Checkpoint, Row
from observability.audit.outage import AuditOutage, log
from observability.audit.store import Entry
from observability.audit.verify import verify_tail
from observability.audit.witness import read_heads

_CLOSE_DRAIN_S = 10.0


class AuditUpkeep(AuditOutage):
    """Start-up, close and retention of :class:`~observability.audit.log.AuditLog` (its base; see
    :class:`~observability.audit.writer_state.WriterState` for why base classes)."""

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the store and the journal and start the writer; a start that fails closes what it opened
        (the store's connection and thread, the journal's thread and lock) before it raises."""
        try:
            await self._start()
        except BaseException:
            with contextlib.suppress(Exception):  # the start's own error is the one to report
                await self.store.close()
            self.spool.close()
            raise

    async def _start(self) -> None:
        await self.store.open()
        self._head = await self.store.head()
        await self._check_chain()
        if not self.signer.can_sign:
            log.warning("audit_checkpoints_unsigned", reason="audit.signing.key is not set")
        log.info(
            "audit_started",
            store=self.store.name,
            head_seq=self._head[0],
            commit=self.settings.commit,
            when_full=self.settings.when_full,
            buffer=self.settings.buffer,
            on_unavailable=self.settings.on_unavailable,
            journal=str(self.spool.path),
            witness=str(self.settings.witness_path) if self.settings.witness_path else None,
        )
        await self.spool.open(exclusive=self._spooling)
        for gap_id, since in sorted(self.spool.open_gaps.items(), key=lambda kv: kv[1]):
            # Requests served without a record before a crash, whose gap record was never written.
            payload = {
                "lost": 1,
                "at_least": True,
                "reason": "unrecorded_before_restart",
                "from": since,
                "to": self._now(),
            }
            log.error("audit_gap_recorded", **payload)
            self._queue_event("gap", payload, gap_id)
        if self._spooling:
            if self.spool.unreadable:
                # Acknowledged records the journal no longer yields: the chain says so.
                self._lost, self._lost_reason, self._lost_since = (
                    self.spool.unreadable,
                    "spool_unreadable",
                    self._now(),
                )
                self._queue.append(self._gap_record())
            if self.spool.pending:
                log.warning("audit_spool_found", records=len(self.spool.pending))
                self._outage = True  # new records queue behind the spooled ones until they are replayed
        self._task = asyncio.create_task(self._run(), name="audit-writer")
        if self._outage:
            self._ensure_recovery()
        if self.settings.retention_days is not None:
            self._retention = asyncio.create_task(self._retain_forever(), name="audit-retention")

    async def _check_chain(self) -> None:
        """Walk from the newest checkpoint to the head (and the newest published head, if any) before
        appending anything: a chain that does not verify is refused before the first append (see the docstring)."""
        expect: dict[int, str] = {}
        witness = self.settings.witness_path
        if witness is not None and witness.is_file():
            try:
                heads = await asyncio.to_thread(read_heads, witness)
                if heads:
                    top = max(heads)
                    expect = {top: heads[top]}
            except (OSError, ValueError) as exc:
                log.warning("audit_witness_unreadable", path=str(witness), error=str(exc))
        report, newest = await verify_tail(self.store, self.signer, expect)
        if report.problem is not None:
            # Refused for good, but the gateway still starts: nothing is appended or signed (the guard
            # refuses every write, requests get 503 audit_unavailable), while the admin API and the
            # console stay up for the auditor who has to find where the chain breaks.
            self._chain_broken(report.problem.kind, report.problem.seq, report.problem.message, "start")
            self._refused_logged = True
            self.guard.broken = report.problem
            return
        self.guard.prime(self._head, newest, report.stated_every)

    async def aclose(self) -> None:
        """Drain what is buffered (bounded), sign the head, close the store."""
        self._closing = True
        self._wake.set()
        if self._retention is not None:
            self._retention.cancel()
            await asyncio.gather(self._retention, return_exceptions=True)
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), _CLOSE_DRAIN_S)
            except (TimeoutError, Exception):
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                log.error("audit_close_incomplete", unwritten=len(self._queue))
        if self._recovery is not None:
            # What is spooled stays in the journal if the store is still away: the next start replays it.
            try:
                await asyncio.wait_for(asyncio.shield(self._recovery), _CLOSE_DRAIN_S)
            except (TimeoutError, Exception):
                self._recovery.cancel()
                await asyncio.gather(self._recovery, return_exceptions=True)
        with contextlib.suppress(Exception):
            # also seals what a killed predecessor left uncovered (no-op if sealed); never a refused chain
            if not self._outage and not self.broken:
                await self._checkpoint()
        await self.store.close()
        self.spool.close()

    async def append_event(self, kind: str, payload: dict[str, Any]) -> int | None:
        """Append a non-request event (a routing transition, an admin change, ...) to the same chain.

        Returns the record's ``seq`` once it is committed, or None if it could not be
        written within ``ack_timeout_s`` (it is then counted in the next gap record).
        """
        deadline = time.monotonic() + self.settings.ack_timeout_s
        # Why the poll: the buffer's depth has no event of its own (the writer drains it in batches); a
        # 10 ms poll bounded by ack_timeout_s only runs while the buffer is full.
        while self.depth >= self.settings.buffer and time.monotonic() < deadline and not self._closing:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        try:
            return await self.wait(self.submit(kind, payload=payload))
        except AuditUnavailable:
            return None

    def _ack_timed_out(self, fut: asyncio.Future[int]) -> AuditUnavailable:
        """A record not durable within ``ack_timeout_s``: the error its request gets."""
        self.metrics.audit_ack_timeouts.inc()
        self._warn("audit_ack_timeout", timeout_s=self.settings.ack_timeout_s, buffered=self.depth)
        pending = self._waiting.get(fut)
        if pending is not None and pending.kind == "request":
            # Its record may still reach the store (it stays buffered); this one says the client got a 503.
            client_id = (
                pending.snapshot.ctx.identity.client_request_id if pending.snapshot is not None else None
            )
            self.submit(
                "request_refused",
                request_id=pending.request_id,
                tenant=pending.tenant,
                payload={
                    "status": 503,
                    "code": AuditUnavailable.code,
                    "client_request_id": client_id,
                    "reason": "its record was not durable within ack_timeout_s",
                },
            )
        return AuditUnavailable(
            "the audit trail could not record this request; try again shortly", retry_after=1
        )

    async def _gap_durable(self) -> None:
        """Wait until the open gap's marker is in the journal (a record the buffer had no room for)."""
        if self._gap_marker is not None:
            try:
                await asyncio.shield(self._gap_marker)
            except OSError as exc:
                self._warn("audit_journal_failed", error=f"{type(exc).__name__}: {exc}")

    # -- full buffer ------------------------------------------------------------------------------------
    def _mark_full(self) -> None:
        if not self._full:
            self._full = True
            self.metrics.audit_buffer_full.inc()
            log.error("audit_buffer_full", buffered=self.depth, when_full=self.settings.when_full)

    def _drop(self) -> None:
        self._mark_full()
        reason = "shed" if self.settings.when_full == "shed" else "gap"
        self.metrics.audit_dropped.labels(reason).inc()
        if not self._lost:
            self._lost_since = self._now()
            self._lost_reason = reason
            # Its request is served without a record: the open gap is made durable before that response
            # is acknowledged (wait(None) awaits it), so a crash before the gap record leaves a trace.
            self._gap_id = uuid.uuid4().hex
            self._gap_marked = self._gap_marker = asyncio.ensure_future(
                self.spool.gap_open(self._gap_id, self._lost_since)
            )
        self._lost += 1

    # -- checkpoints and retention ----------------------------------------------------------------------
    async def _checkpoint(self) -> None:
        made: list[Checkpoint] = []
        await self.store.seal_head(self.guard.sealer(True, made))
        if made:
            self.guard.appended(made[-1].seq, made[-1].hash, made)
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        await self._publish(made)

    async def retain(self) -> Checkpoint | None:
        """Delete records older than ``retention_days`` up to a checkpoint, which anchors what remains.

        The cut writes its own ``retention_cut`` record and a checkpoint of it in the
        same transaction: a prefix missing without that signed record was not retention.
        """
        days = self.settings.retention_days
        if days is None:
            return None
        cutoff = (datetime.now(UTC) - timedelta(days=days)).isoformat(timespec="microseconds")
        cutoff = cutoff.replace("+00:00", "Z")

        def record(anchor: Checkpoint) -> Entry:
            payload = {
                "through_seq": anchor.seq,
                "anchor_hash": anchor.hash,
                "anchor_checkpoint": anchor.digest(),
                "cutoff": cutoff,
            }
            return self._entry("retention_cut", payload)

        made: list[Checkpoint] = []
        cp = await self.store.cut_before(cutoff, record, self.guard.sealer(True, made))
        if made:
            self.guard.appended(made[-1].seq, made[-1].hash, made)
        if cp is not None:
            log.info("audit_retention_cut", through_seq=cp.seq, anchor_hash=cp.hash, cutoff=cutoff)
            await self._publish(made)
        return cp

    async def _retain_forever(self) -> None:
        assert self.settings.retention_days is not None
        every = min(3600.0, max(1.0, self.settings.retention_days * 86400 / 10))
        while True:
            try:
                await self.retain()
            except Exception as exc:
                self._warn("audit_retention_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(every)

    # -- reading ----------------------------------------------------------------------------------------
    async def rows_for(self, request_id: str) -> list[Row]:
        """Records of one request (tests and support)."""
        found: list[Row] = []
        after = 0
        while True:
            rows = await self.store.rows(after, 1000)
            if not rows:
                return found
            found.extend(r for r in rows if r.request_id == request_id)
            after = rows[-1].seq
