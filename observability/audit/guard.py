"""The writer's side of the chain: what it last saw, judged under the store's write lock before each append.

A writer that extends a chain vouches for it: the next checkpoint it signs covers
every record before. So before each append, each checkpoint of the head and each
retention cut, the store hands the chain's end (:class:`~.store.Tip`) to
:meth:`ChainGuard.admit`, which refuses it (:class:`~.chain.ChainBroken`, nothing
written) when it no longer verifies against its newest checkpoint:

- the newest checkpoint is older than one this writer saw, or another one at the
  same record (checkpoints were removed or replaced);
- the newest checkpoint is unsigned, signed by another key or badly signed (with a
  key configured);
- the record at the newest checkpoint no longer has the hash it signed (records
  before it were rewritten and re-linked);
- more records follow the newest checkpoint than its cadence allows, or, with no
  checkpoint, more than record 1 states; record 1 states no cadence, or a forged one
  (checkpoints were removed);
- the record this writer appended last is gone or has another hash (records after
  the newest checkpoint were rewritten).

Each is one indexed lookup or two per transaction. At start-up the writer first
walks from the newest checkpoint to the head (:func:`.verify.verify_tail`). A
refused chain stays refused until a restart: restore the store, then start again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from observability.audit.chain import (
    GENESIS,
    ChainBroken,
    Checkpoint,
    Problem,
    Signer,
    open_chain,
    read_statement,
)
from observability.audit.store import Entry, Sealer, Tip


class ChainGuard:
    """One writer's memory of the chain it extends (shared by its appends, checkpoints and cuts)."""

    def __init__(self, signer: Signer, every: int, clock: Callable[[], str]) -> None:
        self.signer = signer
        self.every = every
        self.clock = clock
        self._known: tuple[int, str] = (0, GENESIS)
        self._known_cp: Checkpoint | None = None
        #: the cadence record 1 states (0 until read)
        self._stated = 0
        #: digests of checkpoints whose signature was checked, or that this writer made
        self._vouched: set[str] = set()
        #: the problem that made this writer refuse the chain, for good
        self.broken: Problem | None = None
        # admit runs where the store runs its transaction (SQLite: its thread), the rest on the loop
        self._lock = threading.Lock()

    def prime(self, head: tuple[int, str], newest: Checkpoint | None, stated: int) -> None:
        """What the start-up walk found good: the head, the newest checkpoint, record 1's cadence."""
        with self._lock:
            self._known, self._known_cp, self._stated = head, newest, stated
            if newest is not None:
                self._vouched.add(newest.digest())

    def sealer(self, force: bool, made: list[Checkpoint]) -> Sealer:
        """The :class:`~.store.Sealer` of one store call: checkpoints the head when due (or ``force``)."""
        return _Seal(self, force, made)

    def appended(self, seq: int, head: str, made: list[Checkpoint]) -> None:
        """After a commit: the head this writer wrote, and the checkpoints it signed."""
        with self._lock:
            if seq > self._known[0]:
                self._known = (seq, head)
            for cp in made:
                self._vouched.add(cp.digest())
                if self._known_cp is None or cp.seq > self._known_cp.seq:
                    self._known_cp = cp

    # -- under the store's write lock -------------------------------------------------------------------
    def wants(self, newest: Checkpoint | None, head_seq: int) -> tuple[tuple[int, ...], bool]:
        with self._lock:
            seqs = [newest.seq] if newest is not None else []
            if self._known[0] > (newest.seq if newest is not None else 0):
                seqs.append(self._known[0])
            return tuple(seqs), newest is None and head_seq > 0 and not self._stated

    def admit(self, tip: Tip, entries: list[Entry]) -> list[Entry]:
        with self._lock:
            problem = self.broken or self._judge(tip)
            if problem is not None:
                self.broken = problem
                raise ChainBroken(problem)
            if tip.head_seq > self._known[0]:
                self._known = (tip.head_seq, tip.head_hash)
            if tip.newest is not None and (self._known_cp is None or tip.newest.seq > self._known_cp.seq):
                self._known_cp = tip.newest
        if tip.head_seq == 0 and tip.newest is None and entries:
            # A new chain: its first record states the cadence and the key, signed (see chain.py).
            e = entries[0]
            opened = Entry(e.ts, e.kind, e.request_id, e.tenant, open_chain(e.data, self.signer, self.every))
            return [opened, *entries[1:]]
        return entries

    def _judge(self, tip: Tip) -> Problem | None:
        newest, seen = tip.newest, self._known_cp
        if newest is None:
            if seen is not None:
                return Problem(
                    "deleted",
                    seen.seq,
                    f"the checkpoint at record {seen.seq} is gone and no later one is there: "
                    "checkpoints were removed",
                )
            if tip.head_seq == 0:
                return None  # a new chain
            if not self._stated:
                if tip.first is None:
                    return Problem("deleted", 1, "record 1 is missing and no checkpoint anchors the chain")
                stated, problem = read_statement(tip.first, self.signer)
                if problem is not None:
                    return problem
                self._stated = stated
            if tip.head_seq >= self._stated:
                return Problem(
                    "checkpoint_gap",
                    1,
                    f"records 1..{tip.head_seq} have no checkpoint although record 1 states one every "
                    f"{self._stated} records: checkpoints were removed",
                )
        else:
            problem = self._judge_checkpoint(tip, newest, seen)
            if problem is not None:
                return problem
        seq, digest = self._known
        if seq > (newest.seq if newest is not None else 0) and tip.hashes.get(seq) != digest:
            what = "is gone" if seq not in tip.hashes else "has another hash"
            return Problem(
                "edited",
                seq,
                f"record {seq}, which this writer appended as {digest[:16]}..., {what}: "
                "the chain was rewritten after it",
            )
        return None

    def _judge_checkpoint(self, tip: Tip, newest: Checkpoint, seen: Checkpoint | None) -> Problem | None:
        if seen is not None and (
            newest.seq < seen.seq or (newest.seq == seen.seq and newest.digest() != seen.digest())
        ):
            return Problem(
                "deleted",
                newest.seq,
                f"the newest checkpoint is at record {newest.seq}, not the one this writer saw at record "
                f"{seen.seq}: checkpoints were removed or replaced",
            )
        digest = newest.digest()
        if digest not in self._vouched:
            if self.signer.can_check:
                verdict = self.signer.check(newest)
                if verdict is False:
                    return Problem(
                        "bad_signature",
                        newest.seq,
                        f"checkpoint at record {newest.seq} has an invalid signature",
                    )
                if verdict is None:
                    return Problem(
                        "unsigned",
                        newest.seq,
                        f"checkpoint at record {newest.seq} is not signed by the configured key",
                    )
            self._vouched.add(digest)
        stored = tip.hashes.get(newest.seq)
        if stored is None and tip.head_seq != newest.seq:
            # (an empty log after a retention cut continues from its anchor: the head is the checkpoint)
            return Problem(
                "deleted", newest.seq, f"record {newest.seq}, which the newest checkpoint signs, is gone"
            )
        if stored is not None and stored != newest.hash:
            return Problem(
                "edited",
                newest.seq,
                f"record {newest.seq} no longer has the hash the checkpoint at it signed: the records "
                "up to it were rewritten",
            )
        if newest.every and tip.head_seq - newest.seq >= newest.every:
            return Problem(
                "checkpoint_gap",
                newest.seq + 1,
                f"records {newest.seq + 1}..{tip.head_seq} have no checkpoint although one is written every "
                f"{newest.every} records: checkpoints were removed",
            )
        return None

    def due(self, newest: Checkpoint | None) -> int:
        """Records after ``newest`` that make a checkpoint due: the least of every cadence in force."""
        if newest is not None:
            return min(self.every, newest.every) if newest.every else self.every
        with self._lock:
            return min(self.every, self._stated) if self._stated else self.every


class _Seal:
    """One store call's :class:`~.store.Sealer`: the guard's judgement, then the checkpoint when due."""

    def __init__(self, guard: ChainGuard, force: bool, made: list[Checkpoint]) -> None:
        self._guard, self._force, self._made = guard, force, made

    def wants(self, newest: Checkpoint | None, head_seq: int) -> tuple[tuple[int, ...], bool]:
        return self._guard.wants(newest, head_seq)

    def admit(self, tip: Tip, entries: list[Entry]) -> list[Entry]:
        return self._guard.admit(tip, entries)

    def seal(self, newest: Checkpoint | None, seq: int, head: str) -> Checkpoint | None:
        """The cadence is counted on the store's chain, not on this writer's records, so every replica
        sharing the store keeps it (see observability/audit/chain.py)."""
        if seq == 0 or (newest is not None and newest.seq >= seq):
            return None
        since = seq - (newest.seq if newest is not None else 0)
        if not self._force and since < self._guard.due(newest):
            return None
        g = self._guard
        cp = g.signer.make(seq, head, g.clock(), newest, g.every)
        self._made.append(cp)
        return cp
