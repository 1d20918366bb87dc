"""``omnigate audit verify`` and ``omnigate audit export``: walk a store's chain, or write it as JSON lines."""

from __future__ import annotations

from typing import IO

import orjson

from observability.audit.chain import ChainVerifier, Report, Signer
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
