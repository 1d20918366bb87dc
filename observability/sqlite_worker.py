"""One SQLite connection driven from one worker thread, for the stores that keep a file of their own.

A single thread keeps sqlite3 off the event loop and serialises this process's use of the
connection; WAL with ``synchronous=FULL`` fsyncs each commit. Reads that may run long (an
admin search or export, a chain walk) go to :meth:`SQLiteWorker._read`: a read-only
connection on a thread of its own. In WAL mode a reader never takes the write lock and
sees the last commit when its statement starts, so the writer never waits for it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SQLiteWorker(ABC):
    """The thread, the connection and the write transaction; subclasses say what ``_open`` creates."""

    #: names the worker thread and the error raised when the store is used before ``open``
    what = "sqlite"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.what}-sqlite")
        self._db: sqlite3.Connection | None = None
        self._read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.what}-sqlite-read")
        self._reader: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _reading(self) -> sqlite3.Connection:
        """On the read thread: the read-only connection, opened on first use (after ``open`` made the file)."""
        if self._reader is None:
            if self._db is None:
                raise RuntimeError(f"the {self.what} store is not open")
            uri = self.path.resolve().as_uri() + "?mode=ro"
            self._reader = sqlite3.connect(
                uri, uri=True, isolation_level=None, check_same_thread=False, timeout=10.0
            )
        return self._reader

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(reader)`` on the read thread: it never holds up the writer's thread or its lock."""
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, lambda: fn(self._reading()))

    def _connect(self, schema: str) -> sqlite3.Connection:
        """On the worker thread: open the file (creating its folder) and apply ``schema``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(schema)
        return db

    @abstractmethod
    def _open(self) -> None:
        """On the worker thread: connect (``_connect`` with the store's schema) and set ``self._db``."""

    async def open(self) -> None:
        await self._run(self._open)

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await asyncio.get_running_loop().run_in_executor(self._read_pool, reader.close)
        self._read_pool.shutdown(wait=True)
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"the {self.what} store is not open")
        return self._db

    def _locked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a transaction that holds the database's write lock from its start."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return out
