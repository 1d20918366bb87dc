"""The transcription route's form reader (gateway/api/audio_form.py), fed bodies a chunk at a time: fields and
the file as sent, a large file on the spool with the digest of the base64 a chat client would have sent, and
every malformed or oversized form a 400 that names what is wrong, leaving no spool file behind."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from core import spooled
from core.errors import InvalidRequest, MediaTooLarge
from gateway.api.audio_form import MAX_FIELD_BYTES, MAX_FIELDS, FormReader, boundary_of
from gateway.api.body import SPOOL_MIN

B = "XyZb0undary"


def _part(name: str, value: bytes, filename: str | None = None, ctype: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{B}\r\ncontent-disposition: {disposition}\r\n" + (
        f"content-type: {ctype}\r\n" if ctype else ""
    )
    return head.encode() + b"\r\n" + value + b"\r\n"


def _body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{B}--\r\n".encode()


def _feed(body: bytes, step: int = 7919, budget=None) -> FormReader:
    reader = FormReader(B.encode(), budget)
    for at in range(0, len(body), step):
        reader.feed(body[at : at + step])
    return reader


def _spool_files() -> set[str]:
    mine = f"{spooled.PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(spooled.SHM_DIR) if n.startswith(mine)} if spooled.available() else set()


def test_fields_and_a_small_file_as_sent():
    audio = b"RIFF" + bytes(range(256)) * 10
    upload = _feed(
        _body(_part("model", b"m"), _part("file", audio, "a.wav", "audio/wav"), _part("language", b"en"))
    ).result()
    assert upload.fields == {"model": "m", "language": "en"}
    assert upload.file == audio and upload.size == len(audio) and upload.head == audio[:16]
    assert (upload.filename, upload.content_type) == ("a.wav", "audio/wav")
    assert upload.sha256 == hashlib.sha256(audio).hexdigest()


@pytest.mark.skipif(not spooled.available(), reason="no shared-memory file system")
def test_a_large_file_is_spooled_with_the_digest_of_its_base64():
    audio = os.urandom(SPOOL_MIN * 3 + 1)  # not a multiple of 3: the last base64 group is padded
    before = _spool_files()
    upload = _feed(_body(_part("model", b"m"), _part("file", audio, "a.flac")), step=65521).result()
    media = upload.file
    assert isinstance(media, spooled.SpooledMedia) and len(_spool_files() - before) == 1
    assert media.read() == audio and media.header == ""
    b64 = base64.b64encode(audio)
    assert media.sha256() == hashlib.sha256(b64).hexdigest() and len(media) == len(b64)
    assert media.text() == b64.decode()
    media.release()
    assert _spool_files() == before


@pytest.mark.skipif(not spooled.available(), reason="no shared-memory file system")
def test_a_body_cut_mid_file_leaves_no_spool_file_once_discarded():
    before = _spool_files()
    body = _body(_part("file", os.urandom(SPOOL_MIN * 4), "a.wav"))
    reader = FormReader(B.encode())
    reader.feed(body[: len(body) // 2])
    assert len(_spool_files() - before) == 1
    with pytest.raises(InvalidRequest, match="closing boundary"):
        reader.result()
    reader.discard()
    assert _spool_files() == before


class _Budget:
    def __init__(self, room: int) -> None:
        self.room = room

    def charge(self, n: int) -> None:
        if n > self.room:
            raise MediaTooLarge("over the request's media budget")
        self.room -= n

    def refund(self, n: int) -> None:
        self.room += n


@pytest.mark.skipif(not spooled.available(), reason="no shared-memory file system")
def test_a_file_over_the_media_budget_is_refused_while_it_arrives():
    before = _spool_files()
    budget = _Budget(SPOOL_MIN * 2)
    reader = FormReader(B.encode(), budget)
    with pytest.raises(MediaTooLarge):
        reader.feed(_body(_part("file", os.urandom(SPOOL_MIN * 8), "a.wav")))
    reader.discard()
    assert _spool_files() == before and budget.room == SPOOL_MIN * 2


@pytest.mark.parametrize(
    "body, match",
    [
        (_body(_part("file", b"a", "a.wav"), _part("file", b"b", "b.wav")), "more than one file"),
        (_body(_part("prompt", b"x" * (MAX_FIELD_BYTES + 1))), "longer than"),
        (_body(*(_part(f"f{i}", b"1") for i in range(MAX_FIELDS + 1))), "more than"),
        (_body(_part("model", b"a"), _part("model", b"b")), "more than once"),
        (_body(_part("model", b"\xff\xfe")), "not UTF-8"),
        (f"--{B}\r\ncontent-disposition: attachment\r\n\r\nx\r\n--{B}--\r\n".encode(), "no form-data name"),
        (b"this is not multipart at all", "malformed|closing boundary"),
    ],
)
def test_malformed_forms_are_400s(body, match):
    with pytest.raises(InvalidRequest, match=match):
        _feed(body).result()


def test_repeated_array_fields_are_kept_together():
    upload = _feed(_body(_part("include[]", b"a"), _part("include[]", b"b"))).result()
    assert upload.fields == {"include[]": "a,b"}


@pytest.mark.parametrize(
    "ctype", [None, "application/json", "multipart/form-data", "multipart/mixed; boundary=x"]
)
def test_a_body_that_is_not_a_form_is_a_400_naming_the_file(ctype):
    with pytest.raises(InvalidRequest) as err:
        boundary_of(ctype)
    assert err.value.param == "file"


def test_the_boundary_is_read_from_the_content_type():
    assert boundary_of(f'multipart/form-data; boundary="{B}"') == B.encode()
