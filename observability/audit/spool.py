"""The spool: an fsynced local journal of records the store did not take in time (``on_unavailable: spool``).

One JSON line per record, ``{"t": "rec", "after": SEQ, "e": [ts, kind, request_id,
tenant, data]}``, written and fsynced before its request is acknowledged; ``after``
is the newest store ``seq`` the writer knew then, so a copy of the record that did
reach the store (an append that was slow, not failed) can only be found after it.
Replay appends the records in journal order and then writes ``{"t": "done", "n":
N}`` (the first N records are in the store); a crash between the two is undone by
skipping records whose exact data is already stored after their ``after``: each
record goes in once. An emptied journal is truncated.

A line that cannot be read, other than a torn last one (written but not fsynced,
so never acknowledged), is counted as lost and becomes a ``gap`` record.

The journal also holds, in every ``on_unavailable`` mode, ``{"t": "gap_open", "id":
N, "since": TS}`` before the first response served without a record (a full
buffer) is acknowledged, and ``{"t": "gap_closed", "id": N}`` once that gap's
record is durable; a marker still open at start-up becomes a gap record. Marker
ids are random and each line is one ``O_APPEND`` write, so processes sharing a
SQLite file may share the journal in ``refuse`` mode (a restart then also reports
a gap another live process is about to record: twice, never not at all);
spooling records takes the journal's lock, so a second process fails to start.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

from observability.audit.durable import append_fsynced
from observability.audit.store import Entry

T = TypeVar("T")


class Spool:
    def __init__(self, path: Path) -> None:
        self.path = path
        #: (after_seq, entry) of the records not yet in the store, in journal order
        self.pending: list[tuple[int, Entry]] = []
        #: records in the journal file already replayed (what the last "done" line says)
        self._done = 0
        self._in_file = 0
        self.unreadable = 0
        #: gap markers opened and not closed: id -> since
        self.open_gaps: dict[str, str] = {}
        #: held by whoever adds to the journal or decides it is empty (see AuditLog._recover)
        self.lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-spool")
        self._lock_fd: int | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _load(self) -> None:
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return
        records: list[tuple[int, Entry]] = []
        done = 0
        last = len(lines) - 1
        while last >= 0 and not lines[last].strip():
            last -= 1
        for i, raw in enumerate(lines[: last + 1]):
            if not raw.strip():
                continue
            try:
                doc = orjson.loads(raw)
                if doc["t"] == "done":
                    done = int(doc["n"])
                    continue
                if doc["t"] == "gap_open":
                    self.open_gaps[str(doc["id"])] = str(doc["since"])
                    continue
                if doc["t"] == "gap_closed":
                    self.open_gaps.pop(str(doc["id"]), None)
                    continue
                ts, kind, rid, tenant, data = doc["e"]
                records.append((int(doc["after"]), Entry(ts, kind, rid, tenant, data)))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                if i != last:  # a torn last line was never fsynced, so never acknowledged
                    self.unreadable += 1
        self._in_file = len(records)
        self._done = min(done, len(records))
        self.pending = records[self._done :]

    def _lock(self) -> None:
        # Two processes appending to one journal would interleave and replay each other's records: the
        # second one does not start.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"another gateway process uses the audit journal {self.path}; give each its "
                "own audit.spool_path"
            ) from None
        self._lock_fd = fd

    async def open(self, exclusive: bool) -> None:
        """Read the journal; ``exclusive`` (spooling records) also takes its lock (see ``_lock``)."""
        if exclusive:
            await self._run(self._lock)
        await self._run(self._load)

    def _append(self, lines: bytes) -> None:
        append_fsynced(self.path, lines, 0o600)

    async def add(self, after_seq: int, entries: list[Entry]) -> None:
        """Journal ``entries`` durably (call with :attr:`lock` held)."""
        lines = b"".join(
            orjson.dumps(
                {"t": "rec", "after": after_seq, "e": [e.ts, e.kind, e.request_id, e.tenant, e.data]}
            )
            + b"\n"
            for e in entries
        )
        await self._run(self._append, lines)
        self._in_file += len(entries)
        self.pending.extend((after_seq, e) for e in entries)

    async def replayed(self, n: int) -> None:
        """The first ``n`` pending records are in the store."""
        self._done += n
        del self.pending[:n]
        await self._run(self._append, orjson.dumps({"t": "done", "n": self._done}) + b"\n")

    def _truncate(self, keep: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)
            if keep:
                os.write(fd, keep)
            os.fsync(fd)
        finally:
            os.close(fd)

    async def gap_open(self, gap_id: str, since: str) -> None:
        self.open_gaps[gap_id] = since
        await self._run(self._append, orjson.dumps({"t": "gap_open", "id": gap_id, "since": since}) + b"\n")

    async def gap_closed(self, gap_id: str) -> None:
        if self.open_gaps.pop(gap_id, None) is not None:
            await self._run(self._append, orjson.dumps({"t": "gap_closed", "id": gap_id}) + b"\n")

    async def clear(self) -> None:
        """Empty the journal once everything in it is in the store (call with :attr:`lock` held)."""
        if self.pending:
            raise RuntimeError("the spool still holds records")
        # Open gap markers outlive the truncation (their gap records are not durable yet).
        keep = b"".join(
            orjson.dumps({"t": "gap_open", "id": i, "since": since}) + b"\n"
            for i, since in self.open_gaps.items()
        )
        if not self.path.exists() and not keep:
            return
        await self._run(self._truncate, keep)
        self._done = self._in_file = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
