"""Reading a ``multipart/form-data`` upload a chunk at a time: its fields kept, its file spooled.

python-multipart's streaming parser is fed the body as it arrives. The one file part is kept in memory
while it is small and moved to a spool file (core/spooled.py, counted against the request's media
budget as it is written) once it reaches :data:`gateway.api.body.SPOOL_MIN`, as a chat body's long
base64 payload is. The spooled file stands for the base64 string a chat client would have sent in an
``input_audio`` part: its digest is that string's, so a transcription's audit record reads like the
chat request it is served as. Fields are short strings with bounded counts and sizes; anything else in
the body (a second file, a field too long, a part without a name) is refused with a 400 naming it.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from core import spooled
from core.errors import InvalidRequest
from gateway.api.body import SPOOL_MIN

#: the form's one file field (OpenAI's name)
FILE_FIELD = "file"
#: characters a field other than the file may hold
MAX_FIELD_BYTES = 16 * 1024
#: fields a form may hold, the file included
MAX_FIELDS = 32
#: bytes base64-encoded at a time for the digest (a multiple of 3: the pieces join to one string)
_B64_STEP = 3 << 14
#: the file's first bytes kept aside
_HEAD = 16


@dataclass(slots=True)
class Upload:
    """The parsed form: its text fields, and the file as bytes (small) or a spool file (large)."""

    fields: dict[str, str]
    #: the file's bytes, or its spool file; None: no file part was sent
    file: bytes | spooled.SpooledMedia | None
    filename: str
    content_type: str
    #: decoded bytes of the file
    size: int
    #: SHA-256 of the file's bytes as uploaded
    sha256: str
    #: the file's first bytes (what its container is, where its name and type say nothing)
    head: bytes


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary of a ``Content-Type``; a 400 when the body is not ``multipart/form-data``."""
    mime, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if mime != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "the request body must be multipart/form-data with a boundary (the file and the form fields)",
            param="file",
        )
    if len(boundary) > 200:  # RFC 2046 allows 70 characters
        raise InvalidRequest("the multipart boundary is too long", param="file")
    return boundary


class FormReader:
    """A ``multipart/form-data`` body fed a chunk at a time (:meth:`feed`), then :meth:`result`.

    ``budget`` counts the spooled bytes of the file as they are written (its error refuses the body
    mid-way). :meth:`discard` lets go of the file (spooled or not) whatever state the body is in: the
    request's exit stack calls it, so a body cut half-way leaves no spool file behind.
    """

    def __init__(self, boundary: bytes, budget: spooled.SpoolBudget | None = None) -> None:
        self.size = 0
        self._budget = budget
        self._spool = spooled.available()
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_end": self._end,
            },
        )
        self._fields: dict[str, str] = {}
        self._count = 0
        self._hname = bytearray()
        self._hvalue = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._is_file = False
        self._value = bytearray()
        self._ended = False
        # the file part
        self._file_seen = False
        self._filename = ""
        self._file_type = ""
        self._memory = bytearray()
        self._writer: spooled.SpoolWriter | None = None
        self._media: spooled.SpooledMedia | None = None
        self._file_size = 0
        self._head = b""
        self._raw_hash = hashlib.sha256()
        self._b64_pend = b""  # spooled bytes not yet hashed as base64 (fewer than 3 at a time)

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise InvalidRequest(f"the multipart body is malformed: {exc}", param="file") from None

    def result(self) -> Upload:
        """The form, once the whole body was fed; a 400 when it did not end as multipart ends."""
        if not self._ended:
            raise InvalidRequest("the multipart body ended before its closing boundary", param="file")
        file: bytes | spooled.SpooledMedia | None = None
        if self._media is not None:
            # Handed over: the spool file lives as long as the request's part does (core/spooled.py), as a
            # chat body's does, and goes when the media steps have replaced the part.
            file, self._media = self._media, None
        elif self._file_seen:
            file = bytes(self._memory)
            self._memory.clear()
        return Upload(
            self._fields,
            file,
            self._filename,
            self._file_type,
            self._file_size,
            self._raw_hash.hexdigest(),
            self._head,
        )

    def discard(self) -> None:
        """Let go of the file of a body not read to its end: a spool file being written is removed now."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.discard()
        media, self._media = self._media, None
        if media is not None:
            media.release()
        self._memory.clear()

    # -- the parser's callbacks ----------------------------------------------------------------------------
    def _part_begin(self) -> None:
        self._count += 1
        if self._count > MAX_FIELDS:
            raise InvalidRequest(f"the form has more than {MAX_FIELDS} fields", param="file")
        self._headers = {}
        self._name, self._is_file = "", False
        self._value.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._hname).lower()] = bytes(self._hvalue)
        self._hname.clear()
        self._hvalue.clear()

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition"))
        name = params.get(b"name")
        if disposition != b"form-data" or not name:
            raise InvalidRequest("a form part has no form-data name", param="file")
        self._name = name.decode("utf-8", "replace")
        if self._name == FILE_FIELD:
            if self._file_seen:
                raise InvalidRequest("the form carries more than one file", param="file")
            self._file_seen, self._is_file = True, True
            self._filename = params.get(b"filename", b"").decode("utf-8", "replace")[:256]
            mime, _ = parse_options_header(self._headers.get(b"content-type"))
            self._file_type = mime.decode("latin-1")[:128]
        elif self._name in self._fields and not self._name.endswith("[]"):
            raise InvalidRequest(f"{self._name}: sent more than once", param=self._name)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self._is_file:
            self._file_data(piece)
            return
        if len(self._value) + len(piece) > MAX_FIELD_BYTES:
            raise InvalidRequest(f"{self._name}: longer than {MAX_FIELD_BYTES} bytes", param=self._name[:64])
        self._value += piece

    def _part_end(self) -> None:
        if self._is_file:
            self._file_end()
            return
        try:
            value = bytes(self._value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{self._name}: not UTF-8 text", param=self._name[:64]) from None
        # A repeated array field (``include[]``) keeps its values joined; each is refused or read by name.
        self._fields[self._name] = (
            self._fields[self._name] + "," + value if self._name in self._fields else value
        )

    def _end(self) -> None:
        self._ended = True

    # -- the file ----------------------------------------------------------------------------------------
    def _file_data(self, piece: bytes) -> None:
        if len(self._head) < _HEAD:
            self._head += piece[: _HEAD - len(self._head)]
        self._file_size += len(piece)
        self._raw_hash.update(piece)
        if self._writer is not None:
            self._writer.write(piece)
            self._hash_b64(self._writer, piece)
            return
        self._memory += piece
        if self._spool and len(self._memory) >= SPOOL_MIN:
            self._to_spool()

    def _to_spool(self) -> None:
        try:
            writer = spooled.SpoolWriter(self._budget)
        except spooled.SpoolFull:
            self._spool = False  # kept in memory, as a chat body's payload would be
            return
        try:
            writer.write(bytes(self._memory))
        except BaseException:  # the budget refused the bytes (or the file system is full): no file is left
            writer.discard()
            raise
        self._hash_b64(writer, bytes(self._memory))
        self._writer = writer
        self._memory.clear()

    def _hash_b64(self, writer: spooled.SpoolWriter, piece: bytes) -> None:
        """Hash the file's base64 as it grows: the spool file's digest is that of the string it stands for."""
        buf = self._b64_pend + piece if self._b64_pend else piece
        cut = len(buf) // 3 * 3
        for at in range(0, cut, _B64_STEP):
            writer.text(base64.b64encode(buf[at : min(at + _B64_STEP, cut)]))
        self._b64_pend = buf[cut:]

    def _file_end(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if self._b64_pend:
            writer.text(base64.b64encode(self._b64_pend))
            self._b64_pend = b""
        # The spool file stands for the base64 string a chat client would send: its length and digest.
        self._media = writer.finish("", 4 * ((self._file_size + 2) // 3))
