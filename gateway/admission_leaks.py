"""Finding the admission leases whose request ended without giving them back (gateway/admission_redis.py's
heartbeat, off the request path): renewal is tied to the request, so such a lease is given back, not renewed."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["take_leaked"]


def take_leaked(
    owners: dict[str, asyncio.Task[Any]], held: dict[str, str | None]
) -> list[tuple[str, str | None]]:
    """The leases whose request has ended without giving them back, taken out of ``owners`` and ``held``."""
    gone = [lease for lease, owner in owners.items() if owner.done()]
    out = []
    for lease in gone:
        del owners[lease]
        if lease in held:
            out.append((lease, held.pop(lease)))
    return out
