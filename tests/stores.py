"""The real databases tests use: a fresh PostgreSQL database per use, a unique Redis key prefix."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import asyncpg

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _pg_dsn(name: str) -> str:
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


async def _create(name: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def _drop(name: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@contextmanager
def fresh_pg_database(prefix: str = "omnigate_test") -> Iterator[str]:
    """A new, empty database for this test; dropped afterwards. Yields its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    asyncio.run(_create(name))
    try:
        yield _pg_dsn(name)
    finally:
        asyncio.run(_drop(name))


def redis_prefix() -> str:
    return f"omnigate-test-{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def fresh_pg_database_async(prefix: str = "omnigate_test") -> AsyncIterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    await _create(name)
    try:
        yield _pg_dsn(name)
    finally:
        await _drop(name)
