"""A pydantic validation error as the OpenAI-shaped ``invalid_request_error`` a client is given.

Split from :mod:`gateway.api.chat`, which re-exports :func:`validation_to_error` (the admin routes and
the app import it from there): it runs only for a request that fails validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.errors import InvalidRequest

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "body"})


def _is_tag(part: str) -> bool:
    # pydantic names union branches in error locations ('str', 'list[...]', 'TextPart', ...).
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def validation_to_error(errors: Sequence[Any]) -> InvalidRequest:
    """The most specific validation error as an OpenAI ``invalid_request_error`` naming the field."""
    if not errors:
        return InvalidRequest("invalid request body")
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    param = ".".join(str(x) for x in best.get("loc", ()) if not _is_tag(str(x))) or None
    msg = best.get("msg", "invalid value")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)
