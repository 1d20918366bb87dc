"""Where the routing table and the controller's state live: in this process, or in Redis for many replicas.

One document holds the version, the controller state and the routing table; it is
only ever changed by a read-modify-write that Redis checks (``WATCH``/``MULTI``), so
a manual pin on one replica and the leader's tick on another cannot overwrite each
other. The leader holds a lease, a redis-py ``Lock`` whose token is the replica id
(taken without waiting, its TTL reset while held, released on shutdown); its writes
are fenced on it. Every replica publishes a summary of its own measurements under a
key that expires, which the leader merges.

    {prefix}:doc        JSON {"version", "state", "table"}
    {prefix}:version    the document's version, for followers to poll cheaply
    {prefix}:leader     the replica id holding the lease
    {prefix}:replicas   sorted set: replica id -> last publish (ms)
    {prefix}:summary:ID JSON of that replica's measurements (expires)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import structlog
from pydantic import ConfigDict, TypeAdapter

if TYPE_CHECKING:
    from redis.asyncio.lock import Lock

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Doc:
    __pydantic_config__ = ConfigDict(defer_build=True)  # built on first use, not at import

    version: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    table: dict[str, Any] = field(default_factory=dict)

    def dumps(self) -> bytes:
        return _DOC.dump_json(self)

    @classmethod
    def loads(cls, raw: bytes | str | None) -> Doc:
        if not raw:
            return cls()
        return _DOC.validate_json(raw)


#: the document as Redis holds it: {"version", "state", "table"} (a key it does not know is ignored)
_DOC = TypeAdapter(Doc)


#: an update function: the current document in, the new state and table out (None: leave it alone)
Updater = Callable[[Doc], "tuple[dict[str, Any], dict[str, Any]] | None"]


class NotLeader(Exception):
    """The lease was lost between deciding and writing; the write did not happen."""


class StateStore(Protocol):
    replica_id: str

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def load(self) -> Doc: ...
    async def version(self) -> int: ...
    async def update(self, fn: Updater, *, fenced: bool = False) -> tuple[Doc, bool]: ...
    async def acquire_lease(self, ttl_s: float) -> bool: ...
    async def release_lease(self) -> None: ...
    async def leader(self) -> str | None: ...
    async def publish_summary(self, data: dict[str, Any], ttl_s: float) -> None: ...
    async def summaries(self, max_age_s: float) -> dict[str, dict[str, Any]]: ...
    async def withdraw(self) -> None: ...


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class MemoryStore:
    """One process: the lease is always held."""

    def __init__(self, replica_id: str | None = None) -> None:
        self.replica_id = replica_id or default_replica_id()
        self._doc = Doc()
        self._summary: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def load(self) -> Doc:
        return Doc(self._doc.version, dict(self._doc.state), dict(self._doc.table))

    async def version(self) -> int:
        return self._doc.version

    async def update(self, fn: Updater, *, fenced: bool = False) -> tuple[Doc, bool]:
        async with self._lock:
            out = fn(await self.load())
            if out is None:
                return self._doc, False
            state, table = out
            self._doc = Doc(self._doc.version + 1, state, {**table, "version": self._doc.version + 1})
            return self._doc, True

    async def acquire_lease(self, ttl_s: float) -> bool:
        return True

    async def release_lease(self) -> None:
        return None

    async def leader(self) -> str | None:
        return self.replica_id

    async def publish_summary(self, data: dict[str, Any], ttl_s: float) -> None:
        self._summary = data

    async def summaries(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        return {self.replica_id: self._summary} if self._summary is not None else {}

    async def withdraw(self) -> None:
        self._summary = None


class RedisStore:
    """Many replicas sharing one Redis; see the module docstring for the keys."""

    def __init__(self, client: Any, prefix: str, replica_id: str | None = None) -> None:
        """``client``: a ``redis.asyncio.Redis`` over the gateway's shared pool (not opened here)."""
        self.replica_id = replica_id or default_replica_id()
        self._redis = client
        self._p = prefix
        self._lease: Lock | None = None

    def _k(self, name: str) -> str:
        return f"{self._p}:{name}"

    async def start(self) -> None:
        await self._redis.ping()

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def load(self) -> Doc:
        return Doc.loads(await self._redis.get(self._k("doc")))

    async def version(self) -> int:
        raw = await self._redis.get(self._k("version"))
        return int(raw) if raw else 0

    async def update(self, fn: Updater, *, fenced: bool = False) -> tuple[Doc, bool]:
        from redis.exceptions import WatchError

        doc_key, ver_key, lead_key = self._k("doc"), self._k("version"), self._k("leader")
        for _ in range(50):
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(doc_key, lead_key) if fenced else await pipe.watch(doc_key)
                    if fenced:
                        holder = await pipe.get(lead_key)
                        if holder is None or holder.decode() != self.replica_id:
                            raise NotLeader(f"replica {self.replica_id} does not hold the lease")
                    doc = Doc.loads(await pipe.get(doc_key))
                    out = fn(doc)
                    if out is None:
                        await pipe.unwatch()
                        return doc, False
                    state, table = out
                    new = Doc(doc.version + 1, state, {**table, "version": doc.version + 1})
                    pipe.multi()
                    pipe.set(doc_key, new.dumps())
                    pipe.set(ver_key, new.version)
                    await pipe.execute()
                    return new, True
                except WatchError:
                    await asyncio.sleep(0.005)
                    continue
        raise RuntimeError("the routing document kept changing under this update")

    async def acquire_lease(self, ttl_s: float) -> bool:
        """Renew the lease this replica holds, or take it if nobody does; False while another replica holds it."""
        from redis.asyncio.lock import Lock  # only where the state is shared: a text gateway loads no redis
        from redis.exceptions import LockError

        if self._lease is None:
            # One token for the replica, whichever task renews it (not one per thread).
            self._lease = Lock(self._redis, self._k("leader"), timeout=ttl_s, thread_local=False)
        self._lease.timeout = ttl_s
        try:
            return await self._lease.reacquire()
        except LockError:  # not taken yet, or lapsed (expired, or taken by another replica)
            return bool(await self._lease.acquire(blocking=False, token=self.replica_id))

    async def release_lease(self) -> None:
        from redis.exceptions import LockError

        if self._lease is None:
            return
        with contextlib.suppress(LockError):  # not held (any more): nothing to give back
            await self._lease.release()

    async def leader(self) -> str | None:
        raw = await self._redis.get(self._k("leader"))
        return raw.decode() if raw else None

    async def publish_summary(self, data: dict[str, Any], ttl_s: float) -> None:
        now_ms = int(time.time() * 1000)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k(f"summary:{self.replica_id}"), orjson.dumps(data), px=max(1, int(ttl_s * 1000)))
            pipe.zadd(self._k("replicas"), {self.replica_id: now_ms})
            pipe.zremrangebyscore(self._k("replicas"), 0, now_ms - int(max(ttl_s, 60.0) * 1000 * 10))
            await pipe.execute()

    async def summaries(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        since = int((time.time() - max_age_s) * 1000)
        ids = [i.decode() for i in await self._redis.zrangebyscore(self._k("replicas"), since, "+inf")]
        if not ids:
            return {}
        raws = await self._redis.mget([self._k(f"summary:{i}") for i in ids])
        return {i: orjson.loads(r) for i, r in zip(ids, raws, strict=True) if r}

    async def withdraw(self) -> None:
        """Leave the replica set (shutdown): the leader stops counting this replica at once."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k(f"summary:{self.replica_id}"))
            pipe.zrem(self._k("replicas"), self.replica_id)
            await pipe.execute()


def build_store(backend: str, prefix: str, replica_id: str | None, client: Callable[[], Any]) -> StateStore:
    """``client`` hands out a Redis client over the gateway's pool; called only for the redis backend."""
    if backend == "redis":
        return RedisStore(client(), prefix, replica_id)
    return MemoryStore(replica_id)
