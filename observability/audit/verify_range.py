"""Verify part of the chain: records ``from_seq..to_seq``, the same checks as a full walk, on fewer rows.

The walk starts at the record just before the range, whose stored link anchors it
(a signed checkpoint there, when there is one, is checked as usual); each record
must match its hash and link to the one before it, every checkpoint inside the
range must match its record, and none may be cut off. What a range walk cannot
see is a change before the range that was hidden by rewriting every later hash up
to it: only a walk from the start (``GET /admin/audit/verify``) catches that.
"""

from __future__ import annotations

from observability.audit.chain import ChainVerifier, Problem, Report, Signer
from observability.audit.store import AuditStore
from observability.audit.verify import feed_pages


async def verify_range(store: AuditStore, signer: Signer | None, from_seq: int, to_seq: int) -> Report:
    """Walk from the record before the range (its anchor) through ``to_seq``; stop at the first problem."""
    start = max(1, from_seq - 1)
    checkpoints = [c for c in await store.checkpoints() if start - 1 <= c.seq <= to_seq]
    anchor: tuple[int, str] | None = None
    first = await store.rows(start - 1, 1)
    if first and first[0].seq == start and start > 1:
        # The walk starts mid-chain: the stored link of its first record anchors it.
        anchor = (start - 1, first[0].prev_hash)
    verifier = ChainVerifier(checkpoints, signer, store.seq_of_hash, anchor=anchor)
    await feed_pages(verifier, store, start - 1, to_seq)
    report = verifier.finish()
    p = report.problem
    if p is not None and p.kind == "deleted" and p.seq == 1 and start > 1:
        # The full walk's wording ("records 1..N are missing") does not fit a walk that starts mid-chain.
        report.problem = Problem(
            "deleted", start, f"record {start}, where the walk starts, is missing (deleted)"
        )
    return report
