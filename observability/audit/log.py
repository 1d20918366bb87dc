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

The writer extends only a chain that verifies against its newest checkpoint
(:mod:`.guard`): at start-up it walks from that checkpoint to the head, and a chain
that fails is refused from the start (the gateway runs so the admin API and the
console can show where it breaks, and appends nothing); live, a chain found rewritten
under it is refused for good (an ``audit_chain_broken`` error event,
``omnigate_audit_store_errors_total``): new requests get 503 ``audit_unavailable``
in either ``on_unavailable`` mode, records already taken go to the journal
(``spool``) or fail their requests (``refuse``), and nothing is signed on top of it.

Its length: the buffer, the writer task, checkpoints, the outage modes (refuse, spool, gap records) and
retention share one ordering of records, so they are kept in one module.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from core.errors import AuditUnavailable, Overloaded
from observability.audit.chain import MAX_BATCH, ChainBroken, Checkpoint, Row, Signer, canonical, plain_data
from observability.audit.guard import ChainGuard
from observability.audit.record import RequestSnapshot, request_payload
from observability.audit.spool import Spool
from observability.audit.store import AuditStore, Entry, Sealer
from observability.audit.verify import verify_tail
from observability.audit.witness import Witness, read_heads
from observability.metrics import Children, Metrics
from observability.settings import AuditSettings

log = structlog.get_logger("omnigate.audit")

_CLOSE_DRAIN_S = 10.0
_WARN_EVERY_S = 10.0


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a stray append's outcome (so a failure is not reported as never retrieved)."""
    if not fut.cancelled():
        fut.exception()


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


class AuditLog:
    def __init__(self, settings: AuditSettings, store: AuditStore, metrics: Metrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self._written = Children(metrics.audit_written)
        self._commit = metrics.audit_commit.labels(store.name)
        self.signer = Signer.from_settings(settings.signing)
        self.guard = ChainGuard(self.signer, settings.checkpoint_every, now_iso)
        self.witness = Witness(settings.witness_path)
        # The local journal: spooled records (on_unavailable: spool) and, in every mode, the open marker of
        # records served without one (a full buffer), so that a crash cannot erase that gap.
        self.spool = Spool(settings.spool_file)
        self._spooling = settings.on_unavailable == "spool"
        self._gap_id = ""
        self._gap_marked: asyncio.Future[None] | None = None
        self._gap_marker: asyncio.Future[None] | None = None  # the newest, kept for wait(None)
        #: the store did not take a batch within half of ack_timeout_s (refuse: 503s; spool: journal)
        self._outage = False
        self._refused_logged = False
        self._recovery: asyncio.Task[None] | None = None
        self._waiting: dict[asyncio.Future[int], Pending] = {}
        self._queue: deque[Pending] = deque()
        self._writing = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        self._closing = False
        self._full = False
        self._lost = 0
        self._lost_reason = ""
        self._lost_since = ""
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._head: tuple[int, str] = (0, "")
        self._last_warning = 0.0
        self._last_batch = 0

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
                "to": now_iso(),
            }
            log.error("audit_gap_recorded", **payload)
            self._queue.append(Pending(now_iso(), "gap", None, None, payload, None, None, gap_id))
        if self._spooling:
            if self.spool.unreadable:
                # Acknowledged records the journal no longer yields: the chain says so.
                self._lost, self._lost_reason, self._lost_since = (
                    self.spool.unreadable,
                    "spool_unreadable",
                    now_iso(),
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

    def _chain_broken(self, kind: str, seq: int, message: str, when: str) -> None:
        self.metrics.audit_store_errors.inc()
        log.error("audit_chain_broken", kind=kind, seq=seq, problem=message, found_at=when)

    @property
    def broken(self) -> bool:
        """Whether this writer refused the chain (it stays refused until a restart)."""
        return self.guard.broken is not None

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

    # -- the request path -------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._queue) + self._writing

    def admit(self) -> None:
        """Refuse new requests while the store is unavailable (``refuse``), or the buffer full (``shed``);
        in either mode while the chain is refused (see the module docstring)."""
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
            if self._gap_marker is not None:
                try:
                    await asyncio.shield(self._gap_marker)
                except OSError as exc:
                    self._warn("audit_journal_failed", error=f"{type(exc).__name__}: {exc}")
            return None
        try:
            async with asyncio.timeout(self.settings.ack_timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
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
            raise AuditUnavailable(
                "the audit trail could not record this request; try again shortly", retry_after=1
            ) from None
        except Exception as exc:
            raise AuditUnavailable(
                "the audit trail could not record this request; try again shortly", retry_after=1
            ) from exc

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
            self._lost_since = now_iso()
            self._lost_reason = reason
            # Its request is served without a record: the open gap is made durable before that response
            # is acknowledged (wait(None) awaits it), so a crash before the gap record leaves a trace.
            self._gap_id = uuid.uuid4().hex
            self._gap_marked = self._gap_marker = asyncio.ensure_future(
                self.spool.gap_open(self._gap_id, self._lost_since)
            )
        self._lost += 1

    def _gap_record(self) -> Pending:
        payload = {"lost": self._lost, "reason": self._lost_reason, "from": self._lost_since, "to": now_iso()}
        log.error("audit_gap_recorded", **payload)
        self._lost = 0
        closes = self._gap_id if self._gap_marked is not None else None
        self._gap_marked = None
        return Pending(now_iso(), "gap", None, None, payload, None, None, closes)

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
                self._unavailable("slow")
                if self._spooling:
                    attempt.add_done_callback(_consume)  # it may still land: the replay skips it then
                    await self._to_spool(batch, encode)
                    return
                continue  # refuse: new requests get 503 meanwhile; this batch keeps waiting
            exc = attempt.exception()
            if exc is None:
                rows = attempt.result()
                break
            attempt = None
            if isinstance(exc, ChainBroken):
                await self._refused(batch, encode, exc)
                return
            self.metrics.audit_store_errors.inc()
            self._warn("audit_store_failed", error=f"{type(exc).__name__}: {exc}", buffered=self.depth)
            if self._closing and delay > 1.0 and not self._spooling:
                for p in batch:
                    if p.future is not None and not p.future.done():
                        p.future.set_exception(exc)
                raise exc
            if time.monotonic() - started >= patience:
                self._unavailable("failing")
                if self._spooling:
                    await self._to_spool(batch, encode)
                    return
            await asyncio.sleep(delay)
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

    async def _refused(
        self, batch: list[Pending], encode: Callable[[], list[Entry]], exc: ChainBroken
    ) -> None:
        """The store's chain was refused (see the module docstring): this batch goes to the journal
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
    def _unavailable(self, how: str) -> None:
        if not self._outage:
            self._outage = True
            log.error(
                "audit_store_unavailable",
                how=how,
                on_unavailable=self.settings.on_unavailable,
                patience_s=self.settings.ack_timeout_s / 2,
            )

    async def _to_spool(self, batch: list[Pending], encode: Callable[[], list[Entry]]) -> None:
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
                rows = await self.store.append_encoded(todo.copy, self._sealer(False, made))
                self._head = (rows[-1].seq, rows[-1].hash)
                self.guard.appended(*self._head, made)
                for e in todo:
                    self._written(e.kind).inc()
            await spool.replayed(len(chunk))
            await self._published(made)

    async def _stored_after(self, after_seq: int) -> set[str]:
        found: set[str] = set()
        while rows := await self.store.rows(after_seq, 1000):
            # a record that became record 1 carries the chain's statement beside what was spooled
            found.update(plain_data(r.data) if r.seq == 1 else r.data for r in rows)
            after_seq = rows[-1].seq
        return found

    # -- checkpoints and retention ----------------------------------------------------------------------
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

    async def _checkpoint(self) -> None:
        made: list[Checkpoint] = []
        await self.store.seal_head(self._sealer(True, made))
        if made:
            self.guard.appended(made[-1].seq, made[-1].hash, made)
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        await self._published(made)

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
            return self._encode([Pending(now_iso(), "retention_cut", None, None, payload, None, None)])[0]

        made: list[Checkpoint] = []
        cp = await self.store.cut_before(cutoff, record, self._sealer(True, made))
        if made:
            self.guard.appended(made[-1].seq, made[-1].hash, made)
        if cp is not None:
            log.info("audit_retention_cut", through_seq=cp.seq, anchor_hash=cp.hash, cutoff=cutoff)
            await self._published(made)
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

    def _warn(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.error(event, **fields)

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
