"""Fields the gateway does not know: refused by name (the default) or dropped and announced.

Every wire model forbids unknown fields (core/schemas.py), so validation
reports each one with its location. With ``unknown_fields: refuse`` the request
is answered 400 naming the first, as OpenAI answers an unknown parameter. With
``drop`` (set globally under ``requests`` or per tenant) they are removed from the
body, the rest is validated again, and the response says what was dropped in
``x-omnigate-dropped-fields``. Either way nothing the gateway does not forward is
lost without the client being told.

The names are the client's, so the header carries them percent-encoded (any byte outside
printable ASCII, and ``%`` and ``,``, as ``%XX`` of its UTF-8), comma-separated and cut at
:data:`DROPPED_HEADER_MAX` characters: whatever a client names a field, the header is valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import quote

from pydantic import ValidationError

from core.errors import UnknownField
from core.schemas import ChatCompletionRequest

UnknownFields = Literal["refuse", "drop"]
DROPPED_HEADER = "x-omnigate-dropped-fields"
#: the longest value of the dropped-fields header; names past it are left out (the list ends in ``...``)
DROPPED_HEADER_MAX = 1024
# Printable ASCII a header value may carry as it is, but the list's separator and the escape itself.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%,")
_EXTRA = "extra_forbidden"
# A dropped field can only uncover more of them inside itself, never loop: the body shrinks each round.
_MAX_ROUNDS = 8


def _locate(node: Any, loc: Sequence[Any], delete: bool) -> str | None:
    """The dotted path of the field at pydantic's ``loc`` in the raw body (deleting it if asked).

    pydantic puts union branch tags (``str``, ``list[...]``, a discriminator value) into
    locations; a step that does not match the body is taken for such a tag and skipped,
    trying the literal reading first.
    """
    if not loc:
        return None
    head, rest = loc[0], loc[1:]
    if not rest:
        if isinstance(node, dict) and head in node:
            if delete:
                del node[head]
            return str(head)
        return None
    child = None
    if isinstance(node, dict):
        child = node.get(head) if isinstance(head, str) else None
    elif isinstance(node, list) and isinstance(head, int) and 0 <= head < len(node):
        child = node[head]
    if child is not None:
        found = _locate(child, rest, delete)
        if found is not None:
            return f"{head}.{found}"
    return _locate(node, rest, delete)


def _extras(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [tuple(e["loc"]) for e in exc.errors() if e.get("type") == _EXTRA]


def parse_request(doc: dict[str, Any], mode: UnknownFields) -> tuple[ChatCompletionRequest, list[str]]:
    """Validate a request body; the request and the dotted paths of the fields dropped.

    Raises :class:`UnknownField` (refuse mode) or ``ValidationError`` for any other fault.
    """
    dropped: list[str] = []
    for _ in range(_MAX_ROUNDS):
        try:
            return ChatCompletionRequest.model_validate(doc), dropped
        except ValidationError as exc:
            extras = _extras(exc)
            if not extras:
                raise
            if mode == "refuse":
                path = _locate(doc, extras[0], delete=False) or ".".join(str(p) for p in extras[0])
                raise UnknownField(f"unrecognized request argument supplied: {path}", param=path) from None
            for loc in extras:
                gone = _locate(doc, loc, delete=True)
                if gone is not None and gone not in dropped:
                    dropped.append(gone)
            if not dropped:
                raise
    return ChatCompletionRequest.model_validate(doc), dropped


def dropped_header(names: Sequence[str]) -> str:
    """The dropped-fields header's value for ``names``: each percent-encoded, comma-separated, bounded."""
    out: list[str] = []
    size = 0
    for name in names:
        encoded = quote(name, safe=_HEADER_SAFE)
        if size + len(encoded) + 1 > DROPPED_HEADER_MAX - 4:
            out.append("...")
            break
        out.append(encoded)
        size += len(encoded) + 1
    return ",".join(out)
