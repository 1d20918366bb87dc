"""Parsing a large request body that carries media without holding it three times.

orjson builds each string it parses in a buffer of its own before copying it into the ``str``: for
a body carrying 13 MB of base64, the body and twice its media are resident at once. Here the long
base64 strings (a data URI's or ``input_audio``'s payload) are lifted out of the body first, each
decoded once from the bytes into its ``str``, and the small rest is parsed by orjson with a marker
in their place; the body is emptied before that. The result is the document orjson would have
returned, or, when anything is not exactly as expected, orjson's own parse of the whole body.

Why it is exact: a string is lifted only when it lies between two unescaped quotes with nothing but
base64 (after an optional ``data:`` header without quotes, backslashes or control characters) in
between. The skeleton differs from the body only inside that range, so its tokens are the body's
up to the first quote; the marker (a nonce no client can know) is accepted only where orjson finds
it as a whole string value, which makes the body's token there that same string.

Split from :mod:`gateway.api.body` (which re-exports the bounds): only a body of :data:`MIN_BODY` bytes
or more comes here; an ordinary request's body is parsed there.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

#: bodies below this are parsed by orjson as they are; strings below LIFT stay in the skeleton
MIN_BODY = 1 << 20
LIFT = 1 << 16
_B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
#: what a data URI's header may hold here (printable ASCII but the quote and the backslash)
_HEADER = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')
_MAX_HEADER = 512


def loads_lifted(body: bytearray) -> Any:
    """``orjson.loads(body)`` of a body of :data:`MIN_BODY` bytes or more, emptying ``body``; long base64
    strings never pass through orjson."""
    spans = _spans(body)
    if not spans:
        doc = orjson.loads(body)
        body.clear()
        return doc
    view = memoryview(body)
    try:
        marker = secrets.token_hex(16)
        lifted: dict[str, str] = {}
        pieces: list[bytes] = []
        at = 0
        for start, end in spans:
            key = f"{marker}{len(lifted)}"
            lifted[key] = str(view[start:end], "ascii")
            pieces += (bytes(view[at:start]), key.encode())
            at = end
        pieces.append(bytes(view[at:]))
    finally:
        view.release()
    skeleton = b"".join(pieces)
    del pieces
    body.clear()  # the lifted strings and the skeleton are the body from here on
    try:
        doc = orjson.loads(skeleton)
    except orjson.JSONDecodeError:
        # Invalid as a whole (lifting changes no token outside the strings): orjson's own error for the
        # body, with its real position, from the body rebuilt from its pieces.
        return orjson.loads(_rebuild(skeleton, lifted))
    found = _restore(doc, lifted)
    if found != len(lifted):  # a marker that is not a whole string value: parse the body as it was
        return orjson.loads(_rebuild(skeleton, lifted))
    return doc


def _spans(body: bytearray) -> list[tuple[int, int]]:
    """The (start, end) of every long base64 string's characters, between its quotes."""
    spans: list[tuple[int, int]] = []
    n = len(body)
    probe = LIFT
    while probe < n:
        if body[probe] in _B64:
            q1 = body.rfind(b'"', spans[-1][1] + 1 if spans else 0, probe)
            q2 = body.find(b'"', probe)
            if q1 < 0 or q2 < 0:
                break
            if q2 - q1 - 1 >= LIFT and body[q1 - 1] != 0x5C and _base64_string(body, q1 + 1, q2):
                spans.append((q1 + 1, q2))
            probe = max(q2 + 1, probe + LIFT)  # each range is looked at once
            continue
        probe += LIFT
    return spans


def _base64_string(body: bytearray, start: int, end: int) -> bool:
    payload = start
    if body.startswith(b"data:", start):
        comma = body.find(b",", start, min(end, start + _MAX_HEADER))
        if comma < 0 or body[start:comma].translate(None, _HEADER):
            return False
        payload = comma + 1
    step = 1 << 20  # checked a slice at a time: never a copy of the whole string
    with memoryview(body) as view:
        return all(
            not bytes(view[i : min(i + step, end)]).translate(None, _B64) for i in range(payload, end, step)
        )


def _restore(doc: Any, lifted: dict[str, str]) -> int:
    """Put the lifted strings back where orjson found their markers as values; how many were.

    A stack, not recursion: orjson accepts deeper documents than Python's recursion limit.
    """
    found = 0
    stack = [doc]
    while stack:
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, str):
                real = lifted.get(item)
                if real is not None:
                    value[key] = real  # an existing key: the dict's size does not change
                    found += 1
            elif isinstance(item, (dict, list)):
                stack.append(item)
    return found


def _rebuild(skeleton: bytes, lifted: dict[str, str]) -> bytes:
    out = skeleton
    for key, real in lifted.items():
        out = out.replace(key.encode(), real.encode("ascii"), 1)
    return out
