"""Audit search on both stores: every filter, their combinations, paging both ways, and hostile values."""

from __future__ import annotations

import pytest

from observability.audit.chain import canonical
from observability.audit.search import AuditQuery
from observability.audit.sqlite import SQLiteStore
from observability.audit.store import Entry
from tests.stores import fresh_pg_database_async

pytestmark = pytest.mark.timeout(60)


def _entry(i: int, kind: str = "request", tenant: str | None = "acme", **payload) -> Entry:
    ts = f"2026-03-01T10:00:{i:02d}.000000Z"
    rid = f"req-{i}" if kind == "request" else None
    data = canonical({"ts": ts, "kind": kind, "request_id": rid, "tenant": tenant, "payload": payload})
    return Entry(ts, kind, rid, tenant, data)


ENTRIES = [
    _entry(
        1,
        outcome="served",
        engine="omni-int4",
        degraded=[],
        client_request_id="their-id-1",
        policies=[
            {"name": "request-limits", "verdict": "rewrite"},
            {"name": "nsfw-screen", "verdict": "accept"},
        ],
    ),
    _entry(
        2,
        outcome="degraded",
        engine="omni-int4",
        degraded=["load-text-only"],
        policies=[{"name": "request-limits", "verdict": "rewrite"}],
    ),
    _entry(
        3,
        tenant="globex",
        outcome="refused",
        engine=None,
        degraded=[],
        policies=[{"name": "nsfw-screen", "verdict": "reject"}],
    ),
    _entry(4, kind="routing_transition", tenant=None, action="pin"),
    _entry(
        5,
        tenant="globex",
        outcome="served",
        engine="omni-bf16",
        degraded=["load-text-only", "other"],
        policies=[{"name": "nsfw-screen", "verdict": "accept"}],
    ),
]


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "audit.db")
        await s.open()
        await s.append_encoded(lambda: list(ENTRIES))
        yield s
        await s.close()
    else:
        from observability.audit.postgres import PostgresStore

        async with fresh_pg_database_async() as dsn:
            s = PostgresStore(dsn)
            await s.open()
            await s.append_encoded(lambda: list(ENTRIES))
            yield s
            await s.close()


async def _seqs(store, limit: int = 50, **kw) -> list[int]:
    return [r.seq for r in await store.search(AuditQuery(**kw), limit)]


@pytest.mark.parametrize(
    "filters, expected",
    [
        ({}, [5, 4, 3, 2, 1]),
        ({"kind": "request"}, [5, 3, 2, 1]),
        ({"tenant": "globex"}, [5, 3]),
        ({"request_id": "req-2"}, [2]),
        ({"client_request_id": "their-id-1"}, [1]),
        ({"client_request_id": "req-1"}, []),
        ({"outcome": "served"}, [5, 1]),
        ({"engine": "omni-int4"}, [2, 1]),
        ({"policy": "nsfw-screen"}, [5, 3, 1]),
        ({"verdict": "reject"}, [3]),
        ({"policy": "nsfw-screen", "verdict": "accept"}, [5, 1]),
        # the policy and the verdict must belong to the same run: request-limits never said accept
        ({"policy": "request-limits", "verdict": "accept"}, []),
        ({"degraded": "load-text-only"}, [5, 2]),
        ({"degraded": "other"}, [5]),
        ({"since": "2026-03-01T10:00:02.000000Z"}, [5, 4, 3, 2]),
        ({"until": "2026-03-01T10:00:02.000000Z"}, [1]),
        (
            {
                "since": "2026-03-01T10:00:02.000000Z",
                "until": "2026-03-01T10:00:05.000000Z",
                "tenant": "globex",
            },
            [3],
        ),
        ({"tenant": "globex", "outcome": "served", "degraded": "load-text-only", "engine": "omni-bf16"}, [5]),
    ],
)
async def test_filters(store, filters, expected):
    assert await _seqs(store, **filters) == expected


async def test_paging_newest_first_and_forward(store):
    assert await _seqs(store, limit=2) == [5, 4]
    assert await _seqs(store, limit=2, before_seq=4) == [3, 2]
    assert await _seqs(store, limit=2, before_seq=2) == [1]
    assert await _seqs(store, limit=2, after_seq=0) == [1, 2]  # export order
    assert await _seqs(store, limit=10, after_seq=3, kind="request") == [5]


@pytest.mark.parametrize("value", ["' OR 1=1 --", "acme' --", "%", '"', "\\", "$.payload", "a" * 200, "é中"])
async def test_hostile_values_match_literally(store, value):
    for field in (
        "tenant",
        "client_request_id",
        "outcome",
        "engine",
        "policy",
        "verdict",
        "degraded",
        "request_id",
        "kind",
    ):
        assert await _seqs(store, **{field: value}) == []
