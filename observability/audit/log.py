"""The audit writer: a bounded buffer in front of the store, group commits, checkpoints and retention.

The request path calls :meth:`AuditLog.submit` (never blocks: it appends to a
bounded buffer and returns a future) and awaits :meth:`AuditLog.wait` before it
acknowledges the response as complete, for at most ``ack_timeout_s``. One writer
task drains the buffer: it hands each batch to the store, which encodes the
records off the event loop (digests, redaction, canonical JSON; SQLite on its own
thread, in the same hand-off as the write) and commits them, each batch one
transaction (``commit: group`` gathers what arrives within ``group_commit_ms``;
``commit: sync`` writes one record per transaction). Like PostgreSQL's
``commit_delay`` with ``commit_siblings``, the group-commit wait applies only when
records come in company: when the previous batch held more than one, or more than
one is already waiting. A lone request's record is written at once, since waiting
for company that is not coming only adds latency.

When the buffer is full the configured choice applies, loudly (a log event when
it fills and when it recovers, ``omnigate_audit_buffer_full_total``,
``omnigate_audit_records_dropped_total``): ``shed`` refuses new requests with 503
until there is room; ``mark_gap`` keeps serving, and the chain gets a ``gap``
record saying how many records are missing there. A store that fails is retried
with backoff; its records stay in the buffer.

Start-up, the chain check (why a chain is refused), close, the full buffer, checkpoints and retention are
in :mod:`.upkeep`, the outage modes and the journal's replay in :mod:`.outage`, the state in
:mod:`.writer_state`: the bases of :class:`AuditLog`, which a record written on time does not run through.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from core.errors import AuditUnavailable, Overloaded
from observability.audit.chain import MAX_BATCH, Checkpoint, Row, canonical
from observability.audit.outage import log
from observability.audit.record import RequestSnapshot, request_payload
from observability.audit.store import Entry, Sealer
from observability.audit.upkeep import AuditUpkeep

__all__ = ["AuditLog", "AuditUpkeep", "Pending", "now_iso"]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class Pending:
    ts: str
    kind: str
    request_id: str | None
    tenant: str | None
    payload: dict[str, Any] | None
    snapshot: RequestSnapshot | None
    future: asyncio.Future[int] | None
    #: a gap record: the id of the journal's open gap marker it closes once durable
    closes: str | None = None


class AuditLog(AuditUpkeep):
    _queue: deque[Pending]
    _waiting: dict[asyncio.Future[int], Pending]

    _now = staticmethod(now_iso)

    @property
    def broken(self) -> bool:
        """Whether this writer refused the chain (it stays refused until a restart)."""
        return self.guard.broken is not None

    # -- the request path -------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._queue) + self._writing

    def admit(self) -> None:
        """Refuse new requests while the store is unavailable (``refuse``), or the buffer full (``shed``);
        in either mode while the chain is refused (see :mod:`.upkeep`'s docstring)."""
        if self.broken or (self._outage and not self._spooling):
            raise AuditUnavailable(
                "the audit trail cannot record requests right now; try again shortly", retry_after=1
            )
        if self.settings.when_full == "shed" and self.depth >= self.settings.buffer:
            self._mark_full()
            raise Overloaded("the audit trail is behind; try again shortly", retry_after=1)

    def submit(
        self,
        kind: str,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        payload: dict[str, Any] | None = None,
        snapshot: RequestSnapshot | None = None,
    ) -> asyncio.Future[int] | None:
        """Buffer one record; None when the buffer is full (the record is counted into the next gap)."""
        if self.depth >= self.settings.buffer or self._closing:
            self._drop()
            return None
        if self._lost:
            self._queue.append(self._gap_record())
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        pending = Pending(now_iso(), kind, request_id, tenant, payload, snapshot, fut)
        self._queue.append(pending)
        if request_id is not None:
            self._waiting[fut] = pending
            fut.add_done_callback(self._waiting.pop)
        self.metrics.audit_buffered.set(self.depth)
        self._wake.set()
        return fut

    async def wait(self, fut: asyncio.Future[int] | None) -> int | None:
        """Wait until the record is durable, at most ``ack_timeout_s``: its ``seq`` (0: in the spool).

        None only for a record the buffer had no room for (``mark_gap``: counted in
        a gap record). A record that is not durable in time raises
        :class:`AuditUnavailable`: no response is acknowledged on a record held in memory only.
        """
        if fut is None:
            await self._gap_durable()
            return None
        try:
            async with asyncio.timeout(self.settings.ack_timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise self._ack_timed_out(fut) from None
        except Exception as exc:
            raise AuditUnavailable(
                "the audit trail could not record this request; try again shortly", retry_after=1
            ) from exc

    def _gap_record(self) -> Pending:
        payload = {"lost": self._lost, "reason": self._lost_reason, "from": self._lost_since, "to": now_iso()}
        log.error("audit_gap_recorded", **payload)
        self._lost = 0
        closes = self._gap_id if self._gap_marked is not None else None
        self._gap_marked = None
        return Pending(now_iso(), "gap", None, None, payload, None, None, closes)

    def _queue_event(self, kind: str, payload: dict[str, Any], closes: str | None = None) -> None:
        self._queue.append(Pending(now_iso(), kind, None, None, payload, None, None, closes))

    def _entry(self, kind: str, payload: dict[str, Any]) -> Entry:
        return self._encode([Pending(now_iso(), kind, None, None, payload, None, None)])[0]

    # -- the writer -------------------------------------------------------------------------------------
    async def _run(self) -> None:
        s = self.settings
        linger = s.group_commit_ms / 1000.0 if s.commit == "group" else 0.0
        limit = MAX_BATCH if s.commit == "group" else 1
        while True:
            if not self._queue:
                if self._closing:
                    return
                if self._full and self.depth < s.buffer:
                    self._full = False
                    log.warning("audit_buffer_recovered", lost=self._lost)
                    if self._lost:
                        self._queue.append(self._gap_record())
                        continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(s.checkpoint_interval_s):
                        await self._wake.wait()
                if not self._queue:
                    await self._maybe_checkpoint()
                    continue
            if linger and self._in_company(limit):
                await asyncio.sleep(linger)
            batch = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
            self._last_batch = len(batch)
            self._writing = len(batch)
            try:
                await self._write(batch)
            finally:
                self._writing = 0
                self.metrics.audit_buffered.set(self.depth)
                # Not kept while this loop waits for the next record: the batch holds its requests (their
                # media, under audit_content: raw) until then.
                del batch
            await self._maybe_checkpoint()

    def _in_company(self, limit: int) -> bool:
        """Whether waiting ``group_commit_ms`` for more records is worth it (see the module docstring)."""
        waiting = len(self._queue)
        return not self._closing and waiting < limit and (waiting > 1 or self._last_batch > 1)

    def _encode(self, batch: list[Pending]) -> list[Entry]:
        out = []
        for p in batch:
            try:
                payload = request_payload(p.snapshot) if p.snapshot is not None else (p.payload or {})
            except Exception as exc:  # a record must never be lost to a bug in its builder
                payload = {"encode_error": type(exc).__name__}
            data = canonical(
                {
                    "ts": p.ts,
                    "kind": p.kind,
                    "request_id": p.request_id,
                    "tenant": p.tenant,
                    "payload": payload,
                }
            )
            out.append(Entry(p.ts, p.kind, p.request_id, p.tenant, data))
        return out

    async def _write(self, batch: list[Pending]) -> None:
        encoded: list[Entry] = []
        once = threading.Lock()

        def encode() -> list[Entry]:
            # Once per batch: a retry after a store failure (or the spool) takes the same entries.
            with once:
                if not encoded:
                    encoded.extend(self._encode(batch))
            return encoded

        if self._outage and self._spooling:
            await self._to_spool(batch, encode)
            return
        patience = self.settings.ack_timeout_s / 2
        started = time.monotonic()
        delay = 0.05
        attempt: asyncio.Future[list[Row]] | None = None
        made: list[Checkpoint] = []
        while True:
            if attempt is None:
                t0 = time.perf_counter()
                made = []
                attempt = asyncio.ensure_future(self.store.append_encoded(encode, self._sealer(False, made)))
            left = patience - (time.monotonic() - started)
            done, _ = await asyncio.wait({attempt}, timeout=left if left > 0 else None)
            if not done:  # the store is slow past patience (a lock held, a server that does not answer)
                if await self._store_slow(batch, encode, attempt):
                    return
                continue  # refuse: new requests get 503 meanwhile; this batch keeps waiting
            exc = attempt.exception()
            if exc is None:
                rows = attempt.result()
                break
            attempt = None
            if await self._store_failed(batch, encode, exc, started, delay):
                return
            delay = min(delay * 2, 2.0)
        if self._outage and not self._spooling:
            self._outage = False
            log.warning("audit_store_recovered", on_unavailable="refuse")
        self._commit.observe(time.perf_counter() - t0)
        self.metrics.audit_batch.observe(len(rows))
        for p, row in zip(batch, rows, strict=True):  # one row per record written
            self._written(p.kind).inc()
            if p.future is not None and not p.future.done():
                p.future.set_result(row.seq)
        self._head = (rows[-1].seq, rows[-1].hash)
        self.guard.appended(*self._head, made)
        self._since_checkpoint += len(rows)
        await self._published(made)
        await self._gaps_closed(batch)

    async def _gaps_closed(self, batch: list[Pending]) -> None:
        for p in batch:
            if p.closes is not None:
                try:
                    await self.spool.gap_closed(p.closes)
                except OSError as exc:
                    self._warn("audit_journal_failed", error=f"{type(exc).__name__}: {exc}")

    # -- checkpoints ------------------------------------------------------------------------------------
    async def _maybe_checkpoint(self) -> None:
        if self._outage or self.broken:
            return
        # The count cadence is kept by the store, inside each append (see _sealer); this is the time one.
        due = (
            self._since_checkpoint
            and time.monotonic() - self._last_checkpoint >= self.settings.checkpoint_interval_s
        )
        if due:
            try:
                await self._checkpoint()
            except Exception as exc:
                self.metrics.audit_store_errors.inc()
                self._warn("audit_checkpoint_failed", error=f"{type(exc).__name__}: {exc}")

    def _sealer(self, force: bool, made: list[Checkpoint]) -> Sealer:
        """What the store calls under its write lock: the guard's judgement of the chain's end, then a
        checkpoint of the head when the cadence (or ``force``) says so (see observability/audit/guard.py)."""
        return self.guard.sealer(force, made)

    async def _published(self, made: list[Checkpoint]) -> None:
        """Each committed checkpoint goes outside the store too: the log, and the witness file if configured."""
        if made:
            await self._publish(made)
