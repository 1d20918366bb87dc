"""Reading a request body that carries media without holding it three times.

:class:`Reader` takes the body a chunk at a time and decodes each long base64 payload into the spool as
it arrives (core/spooled.py); what is left is parsed by :func:`loads`, which hands a body of
:data:`MIN_BODY` bytes or more to :mod:`gateway.api.body_lift` (its long base64 strings lifted out before
orjson parses the rest; why that is exact is said there). A small body is orjson's parse, as it is.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from typing import Any

import orjson

from core import spooled
from gateway.api.body_lift import _HEADER, _MAX_HEADER, loads_lifted

# Re-exported: the lifting's bounds are imported from here.
from gateway.api.body_lift import LIFT as LIFT
from gateway.api.body_lift import MIN_BODY as MIN_BODY


def loads(body: bytearray) -> Any:
    """``orjson.loads(body)``, emptying ``body``; long base64 strings never pass through orjson."""
    if len(body) >= MIN_BODY:
        return loads_lifted(body)
    doc = orjson.loads(body)
    body.clear()
    return doc


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
