"""Whether an engine serves the model id and revision it was configured with (``expected_model``/``_revision``).

vLLM's ``/v1/models`` lists each served name as ``id`` and the ``--model`` it loaded as
``root``; the revision it was started with is not listed. The convention: the engine
loads the verified snapshot by its path, ``.../snapshots/<revision>`` (what
``omnigate verify-weights`` checked), under ``--served-model-name <model id>``, so
``id`` is the model id and the last segment of ``root`` is the revision. An engine
that lists neither is never routed to (see :mod:`engines.selection.pool`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ListsModels(Protocol):
    """An engine that can list what it serves (the vLLM adapters: the settings allow ``expected_*`` on them only)."""

    async def served_models(self) -> list[dict[str, Any]]:
        """The engine's ``/v1/models`` cards (``id``, ``root``)."""
        ...


def revision_of(root: str) -> str:
    """The revision a served model's ``root`` names: its last path segment."""
    return root.rstrip("/").rsplit("/", 1)[-1]


def identity_problem(
    expected_model: str | None, expected_revision: str | None, served: list[dict[str, Any]]
) -> str | None:
    """Why the engine's ``/v1/models`` listing does not match what it was configured with; None when it does."""
    if expected_model is None and expected_revision is None:
        return None
    cards = [c for c in served if isinstance(c, dict) and isinstance(c.get("id"), str)]
    if expected_model is not None:
        cards = [c for c in cards if c["id"] == expected_model]
        if not cards:
            ids = ", ".join(sorted(str(c.get("id")) for c in served if isinstance(c, dict))) or "none"
            return f"serves {ids}, not the configured model {expected_model!r}"
    if expected_revision is None:
        return None
    roots = [c["root"] for c in cards if isinstance(c.get("root"), str)]
    if any(revision_of(r) == expected_revision for r in roots):
        return None
    found = ", ".join(sorted({revision_of(r) for r in roots})) or "none"
    return f"serves revision {found}, not the configured revision {expected_revision!r}"
