"""Group commit against a real SQLite store: a lone record is written alone, records in company share a commit.

The wait for company (``group_commit_ms``) applies only when the previous batch held more than
one record or more than one is already queued, as PostgreSQL's ``commit_delay`` applies only
with ``commit_siblings`` others active.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from gateway.settings import AuditSettings
from observability.audit import AuditLog
from observability.audit import build_store as build_audit_store
from observability.metrics import Metrics


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
    """PostgreSQL drops the writer's connection: the batch is retried with backoff and written once, in order."""
    import asyncpg

    from observability.audit.chain import Signer
    from observability.audit.verify import verify_store
    from tests.stores import fresh_pg_database_async

    async with fresh_pg_database_async() as dsn:
        settings = AuditSettings(store="postgres", postgres_dsn=dsn)
        registry = CollectorRegistry()
        audit = AuditLog(settings, build_audit_store(settings), Metrics(registry))
        await audit.start()
        try:
            assert await audit.append_event("before", {"n": 1}) == 1
            admin = await asyncpg.connect(dsn)
            try:
                dropped = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            finally:
                await admin.close()
            assert dropped >= 1
            futures = [audit.submit("request", request_id=f"r{i}", payload={"i": i}) for i in range(3)]
            assert [await audit.wait(f) for f in futures] == [2, 3, 4]
            assert (registry.get_sample_value("omnigate_audit_store_errors_total") or 0) >= 1
        finally:
            await audit.aclose()
        store = build_audit_store(settings)
        await store.open()
        try:
            rows = await store.rows(0, 100)
            assert [(r.seq, r.kind, r.request_id) for r in rows] == [
                (1, "before", None), (2, "request", "r0"), (3, "request", "r1"), (4, "request", "r2")]
            assert (await verify_store(store, Signer.from_settings(settings.signing))).ok
        finally:
            await store.close()
