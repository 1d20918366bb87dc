"""``omnigate audit verify`` and ``omnigate audit export``: walk a store's chain, or write it as JSON lines."""

from __future__ import annotations

from typing import IO

import orjson

from observability.audit.chain import ChainVerifier, Checkpoint, Problem, Report, Signer
from observability.audit.store import AuditStore

PAGE = 5000


async def verify_store(
    store: AuditStore,
    signer: Signer | None,
    expect: dict[int, str] | None = None,
    require_covered: bool = False,
) -> Report:
    verifier = ChainVerifier(await store.checkpoints(), signer, store.seq_of_hash, expect, require_covered)
    await feed_pages(verifier, store, 0)
    return verifier.finish()


async def verify_tail(
    store: AuditStore, signer: Signer | None, expect: dict[int, str] | None = None
) -> tuple[Report, Checkpoint | None]:
    """What a writer checks before it appends to a chain; the report and the newest checkpoint.

    The newest checkpoint (its signature, the record it signs) and every record after
    it, whose number its cadence bounds; with no checkpoint yet, the whole chain, which
    the cadence record 1 states keeps as short (a forged one fails after that many).
    ``expect``: heads published outside the store; the newest must still be there.
    """
    checkpoints = await store.checkpoints()
    newest = checkpoints[-1] if checkpoints else None
    if newest is None:
        return await verify_store(store, signer, expect), None
    start = newest.seq - 1
    first = await store.rows(start, 1)
    anchor = (start, first[0].prev_hash) if first and first[0].seq == newest.seq and start > 0 else None
    verifier = ChainVerifier([newest], signer, store.seq_of_hash, anchor=anchor, tail=True)
    await feed_pages(verifier, store, start)
    report = verifier.finish()
    if report.ok and expect:
        seq = max(expect)
        at = await store.rows(seq - 1, 1)
        head_seq = max(report.head_seq, newest.seq)
        if seq > head_seq:
            report.problem = Problem(
                "truncated",
                head_seq + 1,
                f"a head was published for record {seq} but the log ends at record {head_seq}: "
                f"records {head_seq + 1}..{seq} were cut off",
            )
        elif at and at[0].seq == seq and at[0].hash != expect[seq]:
            report.problem = Problem(
                "witness",
                seq,
                f"record {seq} differs from the head published for it: the chain was rewritten",
            )
    return report, newest


async def feed_pages(
    verifier: ChainVerifier, store: AuditStore, after: int, to_seq: int | None = None
) -> None:
    """Feed ``verifier`` the records after ``after`` (through ``to_seq``), a page at a time, up to the first problem."""
    while not verifier.failed and (to_seq is None or after < to_seq):
        limit = PAGE if to_seq is None else min(PAGE, to_seq - after)
        rows = [r for r in await store.rows(after, limit) if to_seq is None or r.seq <= to_seq]
        if not rows:
            break
        for row in rows:
            if not await verifier.feed(row):
                break
        after = rows[-1].seq


async def export_store(store: AuditStore, out: IO[bytes], after_seq: int = 0) -> int:
    """Write records with ``seq > after_seq`` as JSON lines (each with its hashes); return how many."""
    n = 0
    while True:
        rows = await store.rows(after_seq, PAGE)
        if not rows:
            return n
        out.write(b"".join(orjson.dumps(r.to_json()) + b"\n" for r in rows))
        n += len(rows)
        after_seq = rows[-1].seq
