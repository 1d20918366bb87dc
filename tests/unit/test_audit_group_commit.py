"""Group commit against a real SQLite store: a lone record is written alone, records in company share a commit.

The wait for company (``group_commit_ms``) applies only when the previous batch held more than
one record or more than one is already queued, as PostgreSQL's ``commit_delay`` applies only
with ``commit_siblings`` others active.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from observability.audit import AuditLog
from observability.audit import build_store as build_audit_store
from observability.metrics import Metrics
from observability.settings import AuditSettings


def _batches(registry: CollectorRegistry) -> tuple[float, float]:
    """(transactions, records) so far, from the batch-size histogram."""
    count = registry.get_sample_value("omnigate_audit_batch_records_count") or 0.0
    total = registry.get_sample_value("omnigate_audit_batch_records_sum") or 0.0
    return count, total


async def test_lone_records_commit_alone_and_a_burst_shares_commits(tmp_path) -> None:
    settings = AuditSettings(sqlite_path=tmp_path / "audit.db", group_commit_ms=10)
    registry = CollectorRegistry()
    audit = AuditLog(settings, build_audit_store(settings), Metrics(registry))
    await audit.start()
    try:
        for i in range(5):
            assert await audit.wait(audit.submit("event", payload={"i": i})) is not None
            assert not audit._in_company(256)  # the last batch was alone: no wait for the next one
        assert _batches(registry) == (5.0, 5.0)

        futures = [audit.submit("event", payload={"burst": i}) for i in range(40)]
        seqs = await asyncio.gather(*(audit.wait(f) for f in futures))
        assert sorted(seqs) == seqs and len(set(seqs)) == 40
        transactions, records = _batches(registry)
        assert records == 45.0 and transactions - 5 < 40  # the burst shared commits
    finally:
        await audit.aclose()


async def test_a_failed_append_is_retried_and_its_records_land_once() -> None:
    """PostgreSQL drops the writer's connection mid-append: the batch is retried and written once, in order."""
    import asyncpg

    from observability.audit.chain import Signer
    from observability.audit.postgres import _LOCK
    from observability.audit.verify import verify_store
    from tests.stores import fresh_pg_database_async

    async with fresh_pg_database_async() as dsn:
        settings = AuditSettings(store="postgres", postgres_dsn=dsn)
        registry = CollectorRegistry()
        audit = AuditLog(settings, build_audit_store(settings), Metrics(registry))
        await audit.start()
        holder = await asyncpg.connect(dsn)
        watcher = await asyncpg.connect(dsn)
        try:
            assert await audit.append_event("before", {"n": 1}) == 1
            # Another gateway holds the append lock, so the writer's next append waits inside its
            # transaction; its connection is terminated there.
            hold = holder.transaction()
            await hold.start()
            await holder.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            futures = [audit.submit("request", request_id=f"r{i}", payload={"i": i}) for i in range(3)]
            waiting: list = []
            for _ in range(500):
                waiting = await watcher.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> $1",
                    holder.get_server_pid(),
                )
                if waiting:
                    break
                await asyncio.sleep(0.01)
            assert waiting, "the writer never waited for the lock"
            for row in waiting:
                await watcher.execute("SELECT pg_terminate_backend($1)", row["pid"])
            await hold.rollback()
            assert [await audit.wait(f) for f in futures] == [2, 3, 4]
            assert (registry.get_sample_value("omnigate_audit_store_errors_total") or 0) >= 1
        finally:
            await holder.close()
            await watcher.close()
            await audit.aclose()
        store = build_audit_store(settings)
        await store.open()
        try:
            rows = await store.rows(0, 100)
            assert [(r.seq, r.kind, r.request_id) for r in rows] == [
                (1, "before", None),
                (2, "request", "r0"),
                (3, "request", "r1"),
                (4, "request", "r2"),
            ]
            assert (await verify_store(store, Signer.from_settings(settings.signing))).ok
        finally:
            await store.close()
