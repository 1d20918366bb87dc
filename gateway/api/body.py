"""Parsing a request body that carries media without holding it three times.

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
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from typing import Any

import orjson

from core import spooled

#: bodies below this are parsed by orjson as they are; strings below LIFT stay in the skeleton
MIN_BODY = 1 << 20
LIFT = 1 << 16
_B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
#: what a data URI's header may hold here (printable ASCII but the quote and the backslash)
_HEADER = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')
_MAX_HEADER = 512


def loads(body: bytearray) -> Any:
    """``orjson.loads(body)``, emptying ``body``; long base64 strings never pass through orjson."""
    spans = _spans(body) if len(body) >= MIN_BODY else []
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


# -- reading a body a chunk at a time ---------------------------------------------------------------------
#: a base64 payload this long or longer goes to the spool (core/spooled.py) as it arrives
SPOOL_MIN = 1 << 18
_STOP = re.compile(rb'["\\]')
_NOT_B64 = re.compile(rb"[^A-Za-z0-9+/=]")
_MEDIA_FIELDS = {"image_url": "url", "audio_url": "url", "video_url": "url", "input_audio": "data"}


class Reader:
    """A request body fed a chunk at a time; long base64 payloads are decoded into the spool as they come.

    The bytes are followed with a JSON string lexer (is this byte inside a string, after a backslash?)
    that jumps from quote to quote with ``find``. A string that grows past :data:`SPOOL_MIN` characters
    with nothing but a data URI's header and base64 in it has those characters moved to a
    :class:`~core.spooled.SpoolWriter`, and from then on its base64 is decoded group by group into
    the file instead of being kept; the skeleton gets a marker in its place. The skeleton is what the
    body would be with those strings replaced, so orjson parses it, and each marker found as a media
    part's ``url`` / ``data`` becomes the part's :class:`~core.spooled.SpooledMedia`.

    Exact: a spooled string's characters are its header and the base64 of the bytes written, which
    re-encode to the same characters (four alphabet characters without padding are three bytes and
    back); anything else in the string (a backslash, a character outside the alphabet, padding before
    the end) restores it into the skeleton as it was and the string is parsed as usual. A body
    without a spooled string is parsed by :func:`loads`, exactly as before.
    """

    def __init__(self, spool: bool = True, budget: spooled.SpoolBudget | None = None) -> None:
        self.size = 0
        #: where spooled bytes are counted as they are written (its error refuses the body mid-way)
        self._budget = budget
        self._skel = bytearray()
        self._in_string = False
        self._escape = False  # the previous byte was a backslash inside a string
        self._start = 0  # where the current string's characters start in the skeleton
        self._plain = True  # the current string may still be spooled
        self._spool = spool and spooled.available()
        self._writer: spooled.SpoolWriter | None = None
        self._header = ""
        self._pend = b""  # base64 characters not written yet: part of a group, or a padded group
        self._b64 = 0
        self._marker = secrets.token_hex(16)
        self._spooled: list[spooled.SpooledMedia] = []

    @property
    def spooled(self) -> list[spooled.SpooledMedia]:
        return self._spooled

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        skel = self._skel
        i, n = 0, len(chunk)
        while i < n:
            if self._writer is not None:
                i = self._feed_spool(chunk, i)
            elif not self._in_string:
                j = chunk.find(b'"', i)
                if j < 0:
                    skel += chunk[i:]
                    return
                skel += chunk[i : j + 1]
                self._in_string, self._start, self._plain = True, len(skel), True
                i = j + 1
            elif self._escape:
                skel.append(chunk[i])
                self._escape = False
                i += 1
            else:
                m = _STOP.search(chunk, i)
                j = n if m is None else m.start()
                skel += chunk[i:j]
                if self._plain and self._spool and len(skel) - self._start >= SPOOL_MIN and self._begin():
                    i = j  # the rest of the string, from its next quote or backslash, is the spool's
                    continue
                if m is None:
                    return
                if chunk[j] == 0x22:
                    self._in_string = False
                else:
                    self._escape, self._plain = True, False
                skel.append(chunk[j])
                i = j + 1

    def result(self) -> Any:
        """The document (what ``orjson.loads`` of the whole body returns, spooled payloads in their parts)."""
        if self._writer is not None:  # the body ended inside a spooled string: not JSON, as orjson will say
            self._abort()
        if not self._spooled:
            return loads(self._skel)
        try:
            doc = orjson.loads(self._skel)
        except orjson.JSONDecodeError:
            return orjson.loads(self._rebuild())  # orjson's own error, at its real position
        found = _place(doc, self._marker, self._spooled) if isinstance(doc, dict) else 0
        if found != len(self._spooled):  # a marker that is not a media part's payload: as sent
            doc = orjson.loads(self._rebuild())
            self._spooled.clear()
        self._skel.clear()
        return doc

    # -- the spool ---------------------------------------------------------------------------------------
    def _begin(self) -> bool:
        """Move the current string to a new spool file if it is a base64 payload; whether it was."""
        self._plain = False  # looked at once, spooled or not
        skel = self._skel
        with memoryview(skel)[self._start :] as content:
            at = 0
            if content[:5].tobytes() == b"data:":
                at = bytes(content[:_MAX_HEADER]).find(b",") + 1
                if at <= 0 or bytes(content[5 : at - 1]).translate(None, _HEADER):
                    return False
            if _NOT_B64.search(content, at):
                return False
            try:
                writer = spooled.SpoolWriter(self._budget)
            except spooled.SpoolFull:
                self._spool = False
                return False
            self._writer, self._header, self._pend, self._b64 = writer, str(content[:at], "ascii"), b"", 0
            writer.text(bytes(content[:at]))
            taken = self._take(bytes(content[at:]))
        if not taken:
            writer.discard()
            self._writer, self._pend = None, b""
            return False
        del skel[self._start :]
        return True

    def _feed_spool(self, chunk: bytes, i: int) -> int:
        m = _STOP.search(chunk, i)
        j = len(chunk) if m is None else m.start()
        run = chunk[i:j]
        if _NOT_B64.search(run) or not self._take(run):
            self._abort()
            return i  # the string goes on as an ordinary one, from here
        if m is None:
            return j
        if chunk[j] != 0x22 or not self._finish():
            self._abort()
            return j
        return j + 1

    def _take(self, data: bytes) -> bool:
        """Write the whole groups of ``data``; False (nothing written) where it cannot be a payload."""
        assert self._writer is not None
        buf = self._pend + data if self._pend else data
        pad = buf.find(b"=")
        cut = len(buf) // 4 * 4 if pad < 0 else pad // 4 * 4
        if pad >= 0 and len(buf) > cut + 4:  # characters after a padded group: not base64
            return False
        try:
            if cut:
                self._writer.write(binascii.a2b_base64(buf[:cut], strict_mode=True))
        except spooled.SpoolFull:
            self._spool = False
            return False
        except BaseException:  # the budget refused the bytes: the body is refused, its file goes now
            writer, self._writer = self._writer, None
            writer.discard()
            raise
        self._writer.text(data)  # the client's characters as sent: the record's digest is of them
        self._pend = buf[cut:]
        self._b64 += len(data)
        return True

    def _finish(self) -> bool:
        assert self._writer is not None
        try:
            tail = binascii.a2b_base64(self._pend, strict_mode=True) if self._pend else b""
            if tail:
                self._writer.write(tail)
        except (binascii.Error, ValueError, spooled.SpoolFull):
            return False
        except BaseException:
            writer, self._writer = self._writer, None
            writer.discard()
            raise
        if self._writer.size == 0:
            return False
        self._spooled.append(self._writer.finish(self._header, self._b64))
        self._skel += f"{self._marker}{len(self._spooled) - 1}".encode() + b'"'
        self._writer, self._in_string, self._pend = None, False, b""
        return True

    def _abort(self) -> None:
        """Put the spooled string's characters back in the skeleton, as they came; it stays an ordinary one."""
        assert self._writer is not None
        writer, self._writer = self._writer, None
        self._skel += self._header.encode("ascii")
        self._skel += base64.b64encode(writer.read_back())
        self._skel += self._pend
        writer.discard()
        self._pend, self._plain = b"", False

    def _rebuild(self) -> bytes:
        out = bytes(self._skel)
        for i, media in enumerate(self._spooled):
            out = out.replace(f'"{self._marker}{i}"'.encode(), b'"' + media.text().encode("ascii") + b'"', 1)
        return out


def _place(doc: dict[str, Any], marker: str, media: list[spooled.SpooledMedia]) -> int:
    """Put each spooled payload where its marker is a media part's payload; how many were."""
    found = 0
    messages = doc.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            field = _MEDIA_FIELDS.get(kind) if isinstance(kind, str) else None
            inner = part.get(kind) if field is not None else None
            value = inner.get(field) if isinstance(inner, dict) else None
            if isinstance(value, str) and value.startswith(marker) and value[len(marker) :].isdigit():
                index = int(value[len(marker) :])
                # A URL field's payload is a data URI's; plain base64 is input_audio's alone (elsewhere it
                # is a malformed URL, refused as one: left as sent).
                fits = index < len(media) and (field == "data" or media[index].header.startswith("data:"))
                if fits and isinstance(inner, dict):
                    inner[field] = media[index]
                    found += 1
    return found
