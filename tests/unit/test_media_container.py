"""Structural media checks: end markers, trailers, polyglots, declared types, lying audio and MP4 headers.

Hostile files come from the corpus the hardening suite sends (``bench.hostile_corpus``);
ordinary files are made here by the real encoders, in the variants cameras and
tools write, to show the checks do not refuse them.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image, ImageCms

from bench import hostile_corpus
from core.errors import InvalidMedia
from core.schemas import ChatCompletionRequest
from policies.media.audio import AudioConfig, normalise_audio, probe_audio
from policies.media.container import check_declared, check_isobmff, hidden_file
from policies.media.image import ImageConfig, normalise_image
from policies.media.parts import declared_type, media_parts
from policies.media.video import probe_video
from tests.media import lying_wav, tone, wav

CORPUS = {s.name: s for s in hostile_corpus.build()}
PARAM = "messages.0.content.1.image_url.url"
_rng = np.random.default_rng(21)


def _noise(w: int = 96, h: int = 64) -> Image.Image:
    return Image.fromarray(_rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif() -> bytes:
    exif = Image.Exif()
    exif[0x010E] = "a description"
    return exif.tobytes()


def _srgb() -> bytes:
    return ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()


ORDINARY_IMAGES = {
    "jpeg-baseline": lambda: _save(_noise(), "JPEG"),
    "jpeg-progressive": lambda: _save(_noise(), "JPEG", progressive=True),
    "jpeg-optimized-q100-444": lambda: _save(_noise(), "JPEG", optimize=True, quality=100, subsampling=0),
    "jpeg-restart-markers": lambda: _save(_noise(), "JPEG", restart_marker_blocks=2),
    "jpeg-exif-icc-comment": lambda: _save(
        _noise(), "JPEG", exif=_exif(), icc_profile=_srgb(), comment=b"hi"
    ),
    "jpeg-cmyk": lambda: _save(_noise().convert("CMYK"), "JPEG"),
    "png": lambda: _save(_noise(), "PNG"),
    "png-16-bit": lambda: _save(Image.fromarray(_rng.integers(0, 65535, (40, 50)).astype(np.uint16)), "PNG"),
    "apng": lambda: _save(_noise(), "PNG", save_all=True, append_images=[_noise() for _ in range(3)]),
    "gif-animated-with-comment": lambda: _save(
        _noise().convert("P"),
        "GIF",
        save_all=True,
        append_images=[_noise().convert("P") for _ in range(5)],
        comment=b"made here",
        loop=0,
    ),
    "gif-interlaced": lambda: _save(_noise().convert("P"), "GIF", interlace=True),
    "webp-lossy-exif": lambda: _save(_noise(), "WEBP", exif=_exif()),
    "webp-lossless": lambda: _save(_noise(), "WEBP", lossless=True),
    "webp-animated": lambda: _save(
        _noise(), "WEBP", save_all=True, append_images=[_noise() for _ in range(3)]
    ),
    "bmp": lambda: _save(_noise(), "BMP"),
    "tiff-deflate": lambda: _save(_noise(), "TIFF", compression="tiff_deflate"),
}


@pytest.mark.parametrize("make", ORDINARY_IMAGES.values(), ids=ORDINARY_IMAGES.keys())
def test_ordinary_images_pass(make):
    data = make()
    result = normalise_image(data, ImageConfig(), PARAM)
    assert "image-trailer-dropped" not in result.actions
    assert hidden_file(data) is None


def test_a_multi_picture_jpeg_is_served_as_its_first_picture():
    """MPO (and Ultra HDR gain maps) store further JPEGs after the first one's end marker."""
    data = _save(_noise(), "MPO", save_all=True, append_images=[_noise()])
    result = normalise_image(data, ImageConfig(), PARAM)
    assert result.source_format == "MPO" and Image.open(io.BytesIO(result.data)).format == "JPEG"


@pytest.mark.parametrize(
    "name", ["png-cut-minus-12b", "jpeg-cut-minus-2b", "gif-cut-minus-1b", "png-cut-90pct"]
)
def test_an_image_cut_before_its_end_marker_is_refused(name):
    with pytest.raises(InvalidMedia, match="truncated") as exc:
        normalise_image(CORPUS[name].data, ImageConfig(), PARAM)
    assert exc.value.param == PARAM


@pytest.mark.parametrize("name", ["gif+script", "png+html-after-iend"])
def test_text_after_the_end_marker_is_refused(name):
    with pytest.raises(
        InvalidMedia, match=r"bytes of text \(script or markup\) follow the image's end marker"
    ):
        normalise_image(CORPUS[name].data, ImageConfig(), PARAM)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_binary_trailer_is_dropped_and_the_image_served_byte_for_byte(fmt):
    """A phone's motion-photo clip after the picture never reaches the engine; the picture does, unchanged."""
    image = _save(_noise(), fmt)
    clip = (
        struct.pack(">I", 24) + b"ftypmp42" + b"\x00" * 12 + struct.pack(">I", 16) + b"mdat" + bytes(range(8))
    )
    result = normalise_image(image + clip, ImageConfig(), PARAM)
    assert result.data == image
    assert result.actions == ["image-trailer-dropped"]


def test_whitespace_or_padding_after_the_end_marker_is_not_text():
    image = _save(_noise(), "JPEG")
    assert normalise_image(image + b"\r\n", ImageConfig(), PARAM).data == image
    assert normalise_image(image + b"\x00" * 64, ImageConfig(), PARAM).data == image


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("jpeg+zip", "a ZIP archive"),
        ("png+zip", "a ZIP archive"),
        ("jpeg-app-segment-zip", "a ZIP archive"),
        ("webp+zip", "a ZIP archive"),
        ("wav+zip", "a ZIP archive"),
        ("flac+zip", "a ZIP archive"),
        ("zip-in-mp4-free-box", "a ZIP archive"),
        ("mp4+zip", "a ZIP archive"),
        ("pdf+jpeg", "a PDF document"),
    ],
)
def test_polyglots_are_found(name, other):
    assert hidden_file(CORPUS[name].data) == other


def test_a_stray_zip_end_signature_is_not_an_archive():
    """The end record alone is not enough: its central directory must be where it says."""
    image = _save(_noise(), "PNG")
    fake_end = b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, 1, 1, 46, 0, 0)
    assert hidden_file(image + fake_end) is None


@pytest.mark.parametrize(
    ("kind", "declared", "found", "ok"),
    [
        ("image", "image/png", "PNG", True),
        ("image", "image/jpg", "JPEG", True),
        ("image", "image/jpeg", "MPO", True),
        ("image", "application/octet-stream", "GIF", True),
        ("image", None, "WEBP", True),
        ("image", "image/png", "JPEG", False),
        ("image", "text/html", "PNG", False),
        ("image", "image/heic", "JPEG", False),
        ("image", "image/x-unknown", "PNG", False),
        ("audio", "audio/wav", "wav", True),
        ("audio", "audio/mpeg", "mp3", True),
        ("audio", "audio/mp4", "mp4", True),
        ("audio", "audio/amr", "amr", True),  # an audio type the table does not know is not judged
        ("audio", "audio/wav", "flac", False),
        ("audio", "image/png", "wav", False),
        ("video", "video/mp4", "mov", True),
        ("video", "video/webm", "matroska", True),
        ("video", "video/mp4", "gif", False),
        ("video", "text/html", "mov", False),
    ],
)
def test_declared_type_against_content(kind, declared, found, ok):
    if ok:
        check_declared(kind, declared, found, "p")
    else:
        with pytest.raises(InvalidMedia, match=f"declares {declared} but the bytes are"):
            check_declared(kind, declared, found, "p")


def test_input_audio_format_is_a_declaration_only_when_the_client_sets_it():
    def refs(audio: dict) -> list:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]}],
        }
        return list(media_parts(ChatCompletionRequest.model_validate(body)))

    (unset,) = refs({"data": "AAAA"})
    (mp3,) = refs({"data": "AAAA", "format": "mp3"})
    (uri,) = refs({"data": "data:audio/flac;base64,AAAA", "format": "wav"})
    assert declared_type(unset) is None
    assert declared_type(mp3) == "audio/mpeg"
    assert declared_type(uri) == "audio/flac"


# -- audio ---------------------------------------------------------------------------------------------------


def test_a_wav_cut_short_is_repaired_but_one_claiming_more_than_the_limit_is_refused():
    cut = probe_audio(lying_wav(seconds=5.0, claimed_seconds=2700.0), "p")
    assert cut.header_lies and abs(cut.duration_s - 5.0) < 0.01 and abs(cut.declared_s - 2700.0) < 0.5
    result = normalise_audio(lying_wav(seconds=5.0, claimed_seconds=2700.0), AudioConfig(), 16000, "p")
    assert "audio-header-repaired" in result.actions
    with pytest.raises(
        InvalidMedia, match=r"the WAV header declares 360,000 s of audio \(the file holds 1.0 s\)"
    ):
        normalise_audio(CORPUS["wav-declares-100-hours"].data, AudioConfig(), 16000, "p")


@pytest.mark.parametrize("placeholder", [0, 0x7FFFF000, 0x7FFFFFFF, 0xFFFFFFFF])
def test_streaming_writers_size_placeholders_are_not_claims(placeholder):
    """FFmpeg writes 0xFFFFFFFF and SoX 0x7FFFF000 when they cannot seek back: served with the true length."""
    blob = bytearray(wav(tone(2.0), 16000))
    pos = blob.find(b"data")
    struct.pack_into("<I", blob, pos + 4, placeholder)
    struct.pack_into("<I", blob, 4, placeholder)
    result = normalise_audio(bytes(blob), AudioConfig(), 16000, "p")
    assert "audio-header-repaired" in result.actions
    assert result.info.declared_s is None and abs(result.info.duration_s - 2.0) < 0.01


def test_a_wav_whose_block_align_contradicts_its_format_is_rewritten():
    result = normalise_audio(CORPUS["wav-block-align-0"].data, AudioConfig(), 16000, "p")
    assert "audio-header-repaired" in result.actions
    pcm, rate = sf.read(io.BytesIO(result.data), dtype="int16")
    assert rate == 16000 and len(pcm) == 16000


@pytest.mark.parametrize("name", ["flac-cut-42b", "flac-cut-50pct", "flac-cut-90pct"])
def test_a_flac_that_ends_before_its_declared_samples_is_refused(name):
    with pytest.raises(InvalidMedia, match="ends before the 64,000 samples its header declares"):
        probe_audio(CORPUS[name].data, "p")


def test_an_audio_codec_without_a_decoder_is_a_400_not_a_crash():
    with pytest.raises(InvalidMedia, match="no decoder"):
        probe_audio(CORPUS["wav-bits-0"].data, "p")


# -- MP4 sample tables ---------------------------------------------------------------------------------------


def _mp4(fmt: str = "mp4", options: dict | None = None, video: bool = True) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt, options=options or {}) as out:
        vs = None
        if video:
            vs = out.add_stream("libx264", rate=Fraction(10))
            vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
        aus = out.add_stream("aac", rate=16000)
        if vs is not None:
            for _ in range(20):
                frame = av.VideoFrame.from_ndarray(
                    _rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), format="rgb24"
                )
                for p in vs.encode(frame):
                    out.mux(p)
            for p in vs.encode(None):
                out.mux(p)
        for start in range(0, 32000, 1024):
            frame = av.AudioFrame.from_ndarray(
                _rng.normal(0, 0.1, (1, 1024)).astype(np.float32), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = 16000, start
            for p in aus.encode(frame):
                out.mux(p)
        for p in aus.encode(None):
            out.mux(p)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "options", "video"),
    [
        ("mp4", None, True),
        ("mov", None, True),
        ("mp4", {"movflags": "frag_keyframe+empty_moov"}, True),
        ("ipod", None, False),
    ],
    ids=["mp4", "mov", "fragmented-mp4", "m4a"],
)
def test_ordinary_mp4_family_files_pass(fmt, options, video):
    data = _mp4(fmt, options, video)
    check_isobmff(data, "p")
    if video:
        assert probe_video(data, "p").frames > 0
    else:
        assert probe_audio(data, "p").container == "mp4"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("mp4-declares-1e6-frames", "declares 1,000,000 samples but its size table holds 10"),
        ("mp4-declares-1e6-frames-constant-size", "declares 1,000,000 samples of 512 bytes"),
        ("mp4-declares-4e7-frames-constant-size", "declares 40,000,000 samples of 512 bytes"),
        ("mp4-faststart-cut-90pct", "truncated: its sample tables place"),
    ],
)
def test_mp4_sample_tables_must_fit_the_file(name, message):
    """Refused before FFmpeg opens the file: it would size its index from the declared count."""
    with pytest.raises(InvalidMedia, match=message):
        check_isobmff(CORPUS[name].data, "p")
