"""Structural checks on media bytes that decoders do not make: one file, of the type declared, that fits.

Decoders are lenient by design: Pillow stops reading where the pixels end,
FFmpeg sizes its MP4 index from the declared sample count before it reads a
sample, and neither looks at what else the bytes hold. The gateway hands the
file on, so it checks what they do not: the bytes are not also a ZIP archive
or a PDF (a polyglot), an image ends where its format says it ends (nothing
cut off, no script or markup after the end marker), the media type a client
declared is the one the bytes are, and an MP4's sample tables describe
samples the file really holds.

Its length: one structural check per container format (PNG, JPEG, GIF, WebP, ZIP and PDF markers,
ISO BMFF boxes), each a few small functions with no state; kept together as the one place that reads
container structure by hand.
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


from core.errors import InvalidMedia

# -- which demuxer opens the bytes ---------------------------------------------------------------------------

#: FFmpeg demuxers the gateway opens, by the kind of part. Nothing else is ever chosen: not by FFmpeg's
#: probe (which would pick ``concat``/``ffconcat``, ``hls``, ``dash``, ``image2``, ``tty`` or ``sdp`` from a
#: few text bytes, and those open other files or URLs), not by the client's declared type. The names are
#: the ones ``container.format.name`` reports, checked again after the open.
DEMUXERS: dict[str, frozenset[str]] = {
    "audio": frozenset({"wav", "flac", "ogg", "mp3", "aac", "mov", "matroska"}),
    "video": frozenset({"mov", "matroska", "avi", "mpegts", "flv", "mpeg", "mpegvideo", "ogg"}),
}
_ISOBMFF_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"})


def sniff_demuxer(data: bytes) -> str | None:
    """The allow-listed demuxer the bytes' magic number names, or None: no guessing beyond these."""
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if len(head) >= 8 and head[4:8] in _ISOBMFF_BOXES:
        return "mov"
    if head[:3] == b"FLV":
        return "flv"
    if head[:4] == b"\x00\x00\x01\xba":
        return "mpeg"
    if head[:4] == b"\x00\x00\x01\xb3":
        return "mpegvideo"
    if len(data) > 376 and data[0] == data[188] == data[376] == 0x47:
        return "mpegts"
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # ADTS (AAC) has layer bits 00, MPEG audio layers I-III never do.
        return "aac" if head[1] & 0x06 == 0 else "mp3"
    return None


def open_av(data: bytes, kind: str, param: str) -> Any:
    """Open in-memory bytes with an allow-listed demuxer chosen from their magic number, never by FFmpeg.

    The container is read from a memory buffer only (no file name, so no protocol is involved), and the
    demuxer FFmpeg really used is checked against the list too.
    """
    import av  # here, not at the top: parts imports this module and a text-only gateway needs no codecs

    name = sniff_demuxer(data)
    if name is None or name not in DEMUXERS[kind]:
        raise InvalidMedia(f"{param}: not {kind} in a supported container", param=param)
    try:
        container = av.open(io.BytesIO(data), mode="r", format=name)
    except (av.FFmpegError, ValueError, OSError, IndexError):
        raise InvalidMedia(f"{param}: not {kind} in a supported container", param=param) from None
    if container.format.name not in DEMUXERS[kind]:
        container.close()
        raise InvalidMedia(f"{param}: not {kind} in a supported container", param=param)
    return container


# -- declared type against content ---------------------------------------------------------------------------

_GENERIC = frozenset({"application/octet-stream", "binary/octet-stream", "application/unknown"})


def _types(formats: set[str], *names: str) -> dict[str, frozenset[str]]:
    return {n: frozenset(formats) for n in names}


#: media type -> what the bytes may be: Pillow's format names for images, FFmpeg or libsndfile container
#: names otherwise. Image types the gateway does not decode map to nothing, so any content mismatches them.
DECLARED: dict[str, frozenset[str]] = {
    **_types({"JPEG", "MPO"}, "image/jpeg", "image/jpg", "image/pjpeg"),
    **_types({"PNG"}, "image/png", "image/apng", "image/x-png"),
    **_types({"GIF", "gif"}, "image/gif"),
    **_types({"WEBP"}, "image/webp"),
    **_types({"BMP"}, "image/bmp", "image/x-bmp", "image/x-ms-bmp"),
    **_types({"TIFF"}, "image/tiff"),
    **_types(
        set(),
        "image/svg+xml",
        "image/heic",
        "image/heif",
        "image/avif",
        "image/jxl",
        "image/x-icon",
        "image/vnd.microsoft.icon",
    ),
    **_types({"wav"}, "audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"),
    **_types({"flac"}, "audio/flac", "audio/x-flac"),
    **_types({"ogg"}, "audio/ogg", "audio/opus", "audio/vorbis", "application/ogg", "video/ogg"),
    **_types({"mp3"}, "audio/mpeg", "audio/mp3", "audio/mpeg3", "audio/x-mp3", "audio/x-mpeg"),
    **_types({"mp4", "aac"}, "audio/mp4", "audio/m4a", "audio/x-m4a", "audio/aac", "audio/x-aac"),
    **_types({"matroska"}, "audio/webm", "video/webm", "video/x-matroska", "audio/x-matroska"),
    **_types(
        {"mov", "mp4"},
        "video/mp4",
        "video/quicktime",
        "video/x-m4v",
        "video/3gpp",
        "video/3gpp2",
        "application/mp4",
    ),
    **_types({"avi"}, "video/x-msvideo", "video/avi", "video/msvideo"),
    **_types({"mpegts"}, "video/mp2t"),
    **_types({"mpeg", "mpegvideo"}, "video/mpeg"),
    **_types({"flv"}, "video/x-flv"),
}

#: ``input_audio.format`` values, as the media type they stand for.
AUDIO_FORMATS = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "ogg": "audio/ogg",
    "opus": "audio/ogg",
    "m4a": "audio/mp4",
    "mp4": "audio/mp4",
    "aac": "audio/aac",
    "webm": "audio/webm",
}


def check_declared(kind: str, declared: str | None, found: str, param: str) -> None:
    """Refuse a part whose client-declared media type names another format than the bytes hold.

    ``application/octet-stream`` and an absent type declare nothing. A type this
    table does not know is not judged for audio and video when it is of the
    part's own kind (``audio/amr`` on an audio part); every image format the
    gateway decodes is in the table, so an unknown image type is a mismatch.
    """
    if declared is None or declared in _GENERIC:
        return
    allowed = DECLARED.get(declared)
    if allowed is None:
        if kind != "image" and declared.partition("/")[0] == kind:
            return
        allowed = frozenset()
    if found not in allowed:
        what = {"image": f"a {found} image", "audio": f"{found} audio", "video": f"a {found} video"}[kind]
        raise InvalidMedia(f"{param}: the part declares {declared} but the bytes are {what}", param=param)


# -- a second file in the same bytes -------------------------------------------------------------------------

_EOCD = b"PK\x05\x06"
_ZIP_SEARCH = 65535 + 22  # the end record sits within the last 64 KiB (its comment) + its own 22 bytes


def hidden_file(data: bytes) -> str | None:
    """What else the bytes are, when they are also a file a reader opens by its own rules; else None.

    A ZIP reader finds its archive from the end of the file (the end-of-central-directory
    record, then the central directory it points to), so an archive appended to or embedded
    in a media file opens as an archive; a PDF reader accepts ``%PDF-`` anywhere in the
    first 1,024 bytes. Both are checked the way those readers look, in bounded time.
    """
    if b"%PDF-" in data[:1024]:
        return "a PDF document"
    tail_from = max(0, len(data) - _ZIP_SEARCH)
    pos = data.rfind(_EOCD, tail_from)
    while pos >= 0 and pos + 22 <= len(data):
        _, _, _, entries, cd_size, cd_offset, _ = struct.unpack_from("<4H2IH", data, pos + 4)
        cd_start = pos - cd_size
        # Archives may sit after other data (readers shift every offset by the prefix), so only the
        # central directory's own position is checked: right before the end record, with its signature.
        if (
            entries
            and cd_start >= 0
            and cd_offset <= cd_start
            and data[cd_start : cd_start + 4] == b"PK\x01\x02"
        ):
            return "a ZIP archive"
        if entries == 0xFFFF and pos >= 20 and data[pos - 20 : pos - 16] == b"PK\x06\x07":
            return "a ZIP archive"  # ZIP64: the locator sits right before the end record
        pos = data.rfind(_EOCD, tail_from, pos)
    return None


def check_one_file(data: bytes, what: str, param: str) -> None:
    other = hidden_file(data)
    if other is not None:
        raise InvalidMedia(f"{param}: the {what} is also {other}; polyglot files are refused", param=param)


# -- where an image ends -------------------------------------------------------------------------------------


class Truncated(Exception):
    """The format's end marker is missing: the file was cut short."""


_JPEG_MARKER = re.compile(
    rb"\xff[^\x00\xd0-\xd7]"
)  # a marker after entropy-coded data (not a stuffed 0xFF00 or RSTn)
_GIF_BLOCKS = 0x21, 0x2C


def image_end(data: bytes, fmt: str) -> int | None:
    """The offset just past the image's end marker (PNG IEND, JPEG EOI, GIF trailer, WebP's RIFF size).

    None for formats without a reliable end (BMP, TIFF: they are re-encoded anyway) and for
    structures this walk does not follow; :class:`Truncated` when the end marker is missing.
    """
    try:
        if fmt == "PNG":
            return _png_end(data)
        if fmt in ("JPEG", "MPO"):
            return _jpeg_end(data)
        if fmt == "GIF":
            return _gif_end(data)
        if fmt == "WEBP":
            end = 8 + int(struct.unpack_from("<I", data, 4)[0])
            if end > len(data):
                raise Truncated
            return end
    except (struct.error, IndexError):
        raise Truncated from None
    return None


def _png_end(data: bytes) -> int:
    pos = 8
    while True:
        length, kind = struct.unpack_from(">I4s", data, pos)
        pos += 12 + int(length)
        if pos > len(data):
            raise Truncated
        if kind == b"IEND":
            return pos


def _jpeg_end(data: bytes) -> int | None:
    pos = 2  # after SOI
    while True:
        if data[pos] != 0xFF:
            return None  # bytes between segments: decoders skip them, this walk does not guess
        while data[pos] == 0xFF:  # fill bytes
            pos += 1
        marker = data[pos]
        pos += 1
        if marker == 0xD9:
            return pos
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue
        (length,) = struct.unpack_from(">H", data, pos)
        pos += length
        if pos > len(data):
            raise Truncated
        if marker == 0xDA:  # start of scan: entropy-coded data runs to the next marker
            found = _JPEG_MARKER.search(data, pos)
            if found is None:
                raise Truncated
            pos = found.start()


def _gif_end(data: bytes) -> int | None:
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while True:
        block = data[pos]
        if block == 0x3B:
            return pos + 1
        if block not in _GIF_BLOCKS:
            return None
        if block == 0x21:
            pos += 2  # introducer, label
        else:
            lflags = data[pos + 9]
            pos += (
                10 + (3 << ((lflags & 7) + 1) if lflags & 0x80 else 0) + 1
            )  # descriptor, local table, LZW size
        while (size := data[pos]) != 0:  # data sub-blocks
            pos += 1 + size
        pos += 1
        if pos > len(data):
            raise Truncated


_PRINTABLE = frozenset(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}


def is_text(trailer: bytes) -> bool:
    """Mostly printable ASCII: a script, markup or document body rather than a camera's binary trailer."""
    head = trailer[:512]
    return len(head) >= 4 and sum(b in _PRINTABLE for b in head) >= 0.9 * len(head)


# -- ISO-BMFF (MP4, MOV, M4A) sample tables ------------------------------------------------------------------

_TOP_LEVEL = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"styp", b"uuid"})
_PATH = (b"mdia", b"minf", b"stbl")


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        head = 8
        if size == 1:
            if pos + 16 > end:
                return
            size, head = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < head or pos + size > end:
            return  # a box that does not fit ends the walk; FFmpeg reports what it makes of the rest
        yield kind, pos + head, pos + size
        pos += size


def _child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for k, s, e in _boxes(data, start, end):
        if k == kind:
            return s, e
    return None


def check_isobmff(data: bytes, param: str) -> None:
    """Refuse an MP4/MOV/M4A whose sample tables declare samples the file does not hold.

    FFmpeg allocates its index from ``stsz``'s sample count before it reads a
    sample: a 35 KB file declaring 4x10^7 samples of a constant size costs it
    half a gigabyte. So the count is checked against the bytes (each sample at
    its declared size, or one table entry each), and every chunk's samples must
    end inside the file (a file cut after its ``moov`` is refused here rather
    than served short). QuickTime's sound convention (one-byte samples, each
    lasting one tick), which FFmpeg indexes per chunk, is left to FFmpeg.
    """
    if len(data) < 16 or data[4:8] not in _TOP_LEVEL:
        return
    moov = _child(data, 0, len(data), b"moov")
    if moov is None:
        return
    for kind, start, end in _boxes(data, *moov):
        if kind != b"trak":
            continue
        mdia = _child(data, start, end, b"mdia")
        minf = _child(data, *mdia, b"minf") if mdia else None
        stbl = _child(data, *minf, b"stbl") if minf else None
        if stbl is not None and mdia is not None:
            hdlr = _child(data, *mdia, b"hdlr")
            handler = data[hdlr[0] + 8 : hdlr[0] + 12] if hdlr and hdlr[1] - hdlr[0] >= 12 else b""
            _check_track(data, stbl, handler, param)


def _check_track(data: bytes, stbl: tuple[int, int], handler: bytes, param: str) -> None:
    import numpy as np

    stsz = _child(data, *stbl, b"stsz")
    if stsz is None or stsz[1] - stsz[0] < 12:
        return
    s0, s1 = stsz
    sample_size, count = struct.unpack_from(">II", data, s0 + 4)
    if sample_size == 1 and handler == b"soun" and _one_tick_samples(data, stbl):
        return
    if sample_size == 0 and count * 4 > s1 - s0 - 12:
        raise InvalidMedia(
            f"{param}: a track declares {count:,} samples but its size table holds {(s1 - s0 - 12) // 4:,}",
            param=param,
        )
    if sample_size and count * sample_size > len(data):
        raise InvalidMedia(
            f"{param}: a track declares {count:,} samples of {sample_size:,} bytes, more than the "
            f"{len(data):,}-byte file holds",
            param=param,
        )
    offsets = _chunk_offsets(data, stbl)
    stsc = _child(data, *stbl, b"stsc")
    if offsets is None or stsc is None or count == 0 or len(offsets) == 0:
        return
    n = struct.unpack_from(">I", data, stsc[0] + 4)[0]
    if n == 0 or n * 12 > stsc[1] - stsc[0] - 8:
        return
    table = np.frombuffer(data, ">u4", n * 3, stsc[0] + 8).reshape(n, 3).astype(np.int64)
    first = table[:, 0] - 1
    if first[0] != 0 or np.any(np.diff(first) <= 0) or first[-1] >= len(offsets):
        return  # an irregular table: FFmpeg's own checks judge it
    runs = np.diff(np.append(first, len(offsets)))
    per_chunk = np.repeat(table[:, 1], runs)
    last = np.minimum(np.cumsum(per_chunk), count)
    begin = np.concatenate(([0], last[:-1]))
    if sample_size:
        chunk_bytes = (last - begin) * sample_size
    else:
        sizes = np.frombuffer(data, ">u4", count, s0 + 12).astype(np.int64)
        cum = np.concatenate(([0], np.cumsum(sizes)))
        chunk_bytes = cum[last] - cum[begin]
    ends = offsets + chunk_bytes
    beyond = int(ends[last > begin].max(initial=0)) - len(data)
    if beyond > 0:
        raise InvalidMedia(
            f"{param}: the file is truncated: its sample tables place {beyond:,} bytes of samples "
            "past its end",
            param=param,
        )


def _one_tick_samples(data: bytes, stbl: tuple[int, int]) -> bool:
    stts = _child(data, *stbl, b"stts")
    if stts is None or stts[1] - stts[0] < 16:
        return False
    entries, _, delta = struct.unpack_from(">III", data, stts[0] + 4)
    return bool(entries == 1 and delta == 1)


def _chunk_offsets(data: bytes, stbl: tuple[int, int]) -> np.ndarray | None:
    import numpy as np

    for kind, width in ((b"stco", 4), (b"co64", 8)):
        box = _child(data, *stbl, kind)
        if box is None:
            continue
        n = struct.unpack_from(">I", data, box[0] + 4)[0]
        if n * width > box[1] - box[0] - 8:
            return None
        return np.frombuffer(data, ">u4" if width == 4 else ">u8", n, box[0] + 8).astype(np.int64)
    return None
