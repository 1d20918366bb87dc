"""The replica's one Redis connection pool (``redis`` settings), which every shared feature draws from.

Admission slots, rate limits, failed authentications and the routing state each take a client from
here; none opens a connection of its own. The pool is built on first use (a gateway that shares
nothing never imports redis) and closed once, by the services' shutdown, after its users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.traffic_settings import RedisSettings

if TYPE_CHECKING:
    import redis.asyncio as aioredis


class RedisNotConfigured(RuntimeError):
    """A feature asked for Redis where ``redis.url`` is not set (the settings refuse that at boot)."""


class SharedRedis:
    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self._pool: aioredis.BlockingConnectionPool | None = None
        self._closed = False

    @property
    def configured(self) -> bool:
        return self.settings.url is not None

    @property
    def url(self) -> str:
        if self.settings.url is None:
            raise RedisNotConfigured("redis.url is not set")
        return self.settings.url.get_secret_value()

    @property
    def opened(self) -> bool:
        """Whether anything has asked for a connection yet."""
        return self._pool is not None

    @property
    def pool(self) -> aioredis.BlockingConnectionPool:
        """The pool itself, for a library that builds its own client over it (``limits``)."""
        if self._closed:
            raise RuntimeError("the Redis pool is closed")
        if self._pool is None:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            s = self.settings
            # No retries: a slow or absent Redis costs at most one timeout before a feature falls back
            # (admission fails open, rate limits follow fail_open). Bounded and blocking: a burst queues
            # for a connection (up to the same timeout) rather than being taken for an outage.
            self._pool = aioredis.BlockingConnectionPool.from_url(
                self.url,
                max_connections=s.max_connections,
                timeout=s.timeout_s,
                socket_timeout=s.timeout_s,
                socket_connect_timeout=s.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        return self._pool

    def client(self) -> aioredis.Redis:
        """A client over the shared pool; closing it leaves the pool open (only :meth:`aclose` closes it)."""
        import redis.asyncio as aioredis

        return aioredis.Redis(connection_pool=self.pool)

    async def aclose(self) -> None:
        self._closed = True
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose()
