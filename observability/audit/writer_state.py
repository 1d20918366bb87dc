"""The audit writer's state and its construction, shared by the request path (:mod:`.log`), the outage
modes (:mod:`.outage`) and start-up, close and retention (:mod:`.upkeep`).

:class:`WriterState` is the base of :class:`~observability.audit.log.AuditLog`; it declares every field
the three share, builds them, and names what ``AuditLog`` itself defines.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from prometheus_client import Histogram

from observability.audit.chain import Signer
from observability.audit.guard import ChainGuard
from observability.audit.spool import Spool
from observability.audit.store import AuditStore, Entry
from observability.audit.witness import Witness
from observability.metrics import Children, Metrics
from observability.settings import AuditSettings


class WriterState:
    """The state of :class:`~observability.audit.log.AuditLog` (its base, through
    :class:`~observability.audit.upkeep.AuditUpkeep` and :class:`~observability.audit.outage.AuditOutage`).

    Base classes rather than separate objects: the methods of both read and write the writer's own state
    (the buffer, the head, the outage flag, the count of lost records) that the request path shares, and
    the record type lives beside that path; as base classes mypy checks each access against one set of
    declarations below, where objects of their own would need that state handed back and forth.
    """

    settings: AuditSettings
    store: AuditStore
    metrics: Metrics
    _written: Children[Any]
    signer: Signer
    guard: ChainGuard
    witness: Witness
    spool: Spool
    _spooling: bool
    _gap_id: str
    _gap_marked: asyncio.Future[None] | None
    _gap_marker: asyncio.Future[None] | None
    _outage: bool
    _refused_logged: bool
    _recovery: asyncio.Task[None] | None
    _waiting: dict[asyncio.Future[int], Any]
    _queue: deque[Any]
    _task: asyncio.Task[None] | None
    _retention: asyncio.Task[None] | None
    _wake: asyncio.Event
    _closing: bool
    _full: bool
    _lost: int
    _lost_reason: str
    _lost_since: str
    _since_checkpoint: int
    _last_checkpoint: float
    _head: tuple[int, str]
    _commit: Histogram
    _writing: int
    _last_batch: int
    _last_warning: float

    def __init__(self, settings: AuditSettings, store: AuditStore, metrics: Metrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self._written = Children(metrics.audit_written)
        self._commit = metrics.audit_commit.labels(store.name)
        self.signer = Signer.from_settings(settings.signing)
        self.guard = ChainGuard(self.signer, settings.checkpoint_every, self._now)
        self.witness = Witness(settings.witness_path)
        # The local journal: spooled records (on_unavailable: spool) and, in every mode, the open marker of
        # records served without one (a full buffer), so that a crash cannot erase that gap.
        self.spool = Spool(settings.spool_file)
        self._spooling = settings.on_unavailable == "spool"
        self._gap_id = ""
        self._gap_marked: asyncio.Future[None] | None = None
        self._gap_marker: asyncio.Future[None] | None = None  # the newest, kept for wait(None)
        #: the store did not take a batch within half of ack_timeout_s (refuse: 503s; spool: journal)
        self._outage = False
        self._refused_logged = False
        self._recovery: asyncio.Task[None] | None = None
        self._waiting = {}
        self._queue = deque()
        self._writing = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        self._closing = False
        self._full = False
        self._lost = 0
        self._lost_reason = ""
        self._lost_since = ""
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._head: tuple[int, str] = (0, "")
        self._last_warning = 0.0
        self._last_batch = 0

    # -- defined by AuditLog, which builds the records ----------------------------------------------------
    @property
    def depth(self) -> int:
        raise NotImplementedError

    def submit(
        self,
        kind: str,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        payload: dict[str, Any] | None = None,
    ) -> asyncio.Future[int] | None:
        raise NotImplementedError

    async def wait(self, fut: asyncio.Future[int] | None) -> int | None:
        raise NotImplementedError

    async def _run(self) -> None:
        raise NotImplementedError

    def _queue_event(self, kind: str, payload: dict[str, Any], closes: str | None = None) -> None:
        """Buffer one record that no request waits for (a gap record, ...)."""
        raise NotImplementedError

    def _gap_record(self) -> Any:
        """The gap record of the records lost so far (a ``Pending``), to buffer."""
        raise NotImplementedError

    def _entry(self, kind: str, payload: dict[str, Any]) -> Entry:
        """One record encoded as the writer encodes it, for the store to append in its own transaction."""
        raise NotImplementedError

    async def _gaps_closed(self, batch: list[Any]) -> None:
        raise NotImplementedError

    @property
    def broken(self) -> bool:
        raise NotImplementedError

    @staticmethod
    def _now() -> str:
        raise NotImplementedError
