"""The PostgreSQL audit store's close is bounded: a connection still in use (a query stuck on a server
that stopped answering) does not hold the gateway's stop for good."""

from __future__ import annotations

import asyncio

import structlog

from observability.audit import postgres
from observability.audit.postgres import PostgresStore
from tests.stores import fresh_pg_database_async


async def test_a_connection_never_given_back_is_cut_after_the_close_deadline(monkeypatch):
    monkeypatch.setattr(postgres, "_CLOSE_S", 0.3)
    async with fresh_pg_database_async() as dsn:
        store = PostgresStore(dsn)
        await store.open()
        held = await store.pool.acquire()  # never released: asyncpg's close alone would wait for it
        with structlog.testing.capture_logs() as logs:
            await asyncio.wait_for(store.close(), 10)
        assert [e["event"] for e in logs] == ["audit_store_close_timed_out"]
        assert held is not None and store._pool is None and store._read_pool is None


async def test_a_store_with_nothing_in_use_closes_at_once():
    async with fresh_pg_database_async() as dsn:
        store = PostgresStore(dsn)
        await store.open()
        with structlog.testing.capture_logs() as logs:
            await asyncio.wait_for(store.close(), 10)
        assert logs == []
