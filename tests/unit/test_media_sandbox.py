"""Issue 15, the decoder side: allow-listed demuxers, confined worker processes, bounded decodes.

Every attack here is a real file the test builds (or a decoder made to misbehave), shown to work
against plain FFmpeg first where that is the point, then refused or bounded by the gateway's code.
"""

from __future__ import annotations

import asyncio
import io
import socket
import struct
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf

from core.errors import InvalidMedia, MediaTooLarge, MediaURLForbidden, Overloaded
from policies.media.audio import AudioConfig, decode_pcm, normalise_audio
from policies.media.container import open_av, sniff_demuxer
from policies.media.sandbox import ByteBudget, DecoderFailed, RequestBudget, Sandbox
from policies.media.video import sample_frames
from policies.settings import MediaSettings
from tests import hostile_decoders as bad

pytestmark = pytest.mark.timeout(120)


def _wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(
        buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16"
    )
    return buf.getvalue()


def ffconcat_script(name: str) -> bytes:
    return f"ffconcat version 1.0\nfile {name}\n".encode()


# -- the demuxer is never FFmpeg's guess ------------------------------------------------------------------


def test_the_ffconcat_attack_is_real_against_plain_ffmpeg(tmp_path, monkeypatch):
    """The attack first: 42 bytes of text make FFmpeg's probe read a file from the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recording-1.wav").write_bytes(_wav(2.0))
    script = ffconcat_script("recording-1.wav")
    assert len(script) == 42
    with av.open(io.BytesIO(script)) as container:
        assert container.format.name == "concat"
        samples = sum(f.samples for f in container.decode(audio=0))
    assert samples == 32000  # the host's file, decoded as if the client had sent it


def test_the_ffconcat_script_is_refused_as_audio(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recording-1.wav").write_bytes(_wav(2.0))
    with pytest.raises(InvalidMedia) as err:
        normalise_audio(ffconcat_script("recording-1.wav"), AudioConfig(), 16000, "p")
    assert err.value.param == "p"
    assert "recording" not in err.value.message


@pytest.mark.parametrize(
    "payload",
    [
        b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nsegment.ts\n#EXT-X-ENDLIST\n",  # hls
        b'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011"></MPD>',  # dash
        b"v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=audio 5004 RTP/AVP 0\n",  # sdp
        b"ffconcat version 1.0\nfile /etc/hostname\n",
        b"\x89PNG\r\n\x1a\n" + b"\0" * 64,  # an image2-style guess
        b"plain text that FFmpeg's tty demuxer would take",
    ],
    ids=["hls", "dash", "sdp", "concat-absolute", "image2", "tty"],
)
@pytest.mark.parametrize("kind", ["audio", "video"])
def test_playlists_and_other_file_opening_demuxers_are_never_chosen(payload, kind):
    assert sniff_demuxer(payload) is None
    with pytest.raises(InvalidMedia):
        open_av(payload, kind, "p")


def test_the_opened_demuxer_is_checked_against_the_list():
    data = _wav()
    with open_av(data, "audio", "p") as c:
        assert c.format.name == "wav"
    with pytest.raises(InvalidMedia):
        open_av(data, "video", "p")  # a WAV is not on the video list


# -- bounded decodes ---------------------------------------------------------------------------------------


def _flac_silence(seconds: float, rate: int) -> bytes:
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros(rate * 10, np.int16)
        for _ in range(int(seconds // 10)):
            f.write(block)
    return buf.getvalue()


def test_a_flac_declaring_a_high_rate_is_refused_before_decoding():
    data = _flac_silence(10, 192000)
    with pytest.raises(InvalidMedia, match="192,000 Hz"):
        normalise_audio(data, AudioConfig(), 16000, "p")


def test_high_rate_audio_is_resampled_while_decoding_and_bounded_by_the_room():
    """96 kHz silence: small as FLAC, 1.1 GB at its own rate; decoded at 16 kHz, or refused past the room."""
    data = _flac_silence(600, 96000)
    assert len(data) < 2_000_000
    pcm, rate = decode_pcm(data, 16000, "p", 700)
    assert rate == 16000 and pcm.nbytes == 600 * 16000 * 2
    with pytest.raises(MediaTooLarge) as err:
        decode_pcm(data, 16000, "p", 700, max_bytes=4_000_000)
    assert err.value.status == 413 and err.value.param == "p"
    # No engine rate: at most max_output_rate, never the source's 96 kHz.
    out = normalise_audio(data, AudioConfig(), None, "p")
    assert out.sample_rate == 48000


def _lying_mp4(frames: int = 600, claim_s: int = 120) -> bytes:
    """Frames 1/6000 s apart whose header claims ``claim_s`` seconds: the timestamps never reach 1/fps."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=Fraction(6000))
        vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
        vs.options = {"preset": "ultrafast"}
        for i in range(frames):
            arr = np.full((64, 64, 3), i % 255, np.uint8)
            for p in vs.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(p)
        for p in vs.encode(None):
            out.mux(p)
    data = bytearray(buf.getvalue())
    for box in (b"mvhd", b"mdhd"):
        i = data.find(box)
        scale = struct.unpack_from(">I", data, i + 16)[0]
        struct.pack_into(">I", data, i + 20, claim_s * scale)
    return bytes(data)


def test_video_decoding_stops_at_the_frame_budget_whatever_the_timestamps_say():
    data = _lying_mp4()
    unbounded: dict[str, int] = {}
    sample_frames(data, 120.0, 240, 2.0, (64, 64), "p", max_decoded=10**6, stats=unbounded)
    assert unbounded["decoded"] == 600  # without a budget every frame is decoded for one kept frame
    stats: dict[str, int] = {}
    kept = sample_frames(data, 120.0, 240, 2.0, (64, 64), "p", max_decoded=50, stats=stats)
    assert stats["decoded"] == 50
    assert 1 <= len(kept) <= 50


# -- worker processes --------------------------------------------------------------------------------------


def _run(coro):
    return asyncio.run(coro)


def _sandbox(**kw) -> Sandbox:
    cfg = {"decode_workers": 1, "decode_deadline_s": 1.5, "decode_cpu_s": 2, "decode_memory_mb": 512, **kw}
    return Sandbox(MediaSettings(**cfg))


def test_a_worker_is_confined():
    async def go():
        box = _sandbox()
        await box.start()
        try:
            seen = await box.probe_worker()
            listing = await box.run(bad.reads_cwd, (), param="p")
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            try:
                reached = await box.run(bad.connects, (listener.getsockname()[1],), param="p")
            finally:
                listener.close()
            return seen, listing, reached
        finally:
            await box.aclose()

    seen, listing, reached = _run(go())
    assert listing == [] and seen["cwd_entries"] == 0
    assert seen["rlimit_as"] > 0 and seen["rlimit_cpu"] > 0
    assert "seccomp" in seen["network"].split("+")  # no socket but a Unix one, privileged or not
    assert reached == "PermissionError", reached  # the host's loopback, listening, is not reachable


def test_the_forkserver_is_given_only_the_allowed_environment():
    from policies.media.worker import forkserver_environment

    gateway = {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/srv/omnigate",
        "OMP_NUM_THREADS": "16",
        "OMNIGATE_ADMIN__API_KEY": "k" * 64,
        "AWS_SECRET_ACCESS_KEY": "s",
        "HOME": "/var/lib/omnigate",
    }
    assert forkserver_environment(gateway) == {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/srv/omnigate",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@pytest.mark.parametrize(
    "culprit",
    [bad.sleeps, bad.hangs_in_c, bad.spins, bad.crashes, bad.allocates],
    ids=["sleeps", "hangs-in-c", "spins", "crashes", "allocates"],
)
def test_a_misbehaving_decoder_costs_its_part_a_400_and_the_pool_goes_on(culprit):
    async def go():
        box = _sandbox()
        await box.start()
        try:
            with pytest.raises(DecoderFailed) as err:
                await box.run(culprit, (), param="messages.0.content.1.image_url.url")
            after = await box.run(bad.reads_cwd, (), param="p")
            return err.value, after
        finally:
            await box.aclose()

    error, after = _run(go())
    assert error.status == 400 and error.code == "invalid_media"
    assert error.param == "messages.0.content.1.image_url.url"
    assert error.message.split(": ", 1)[1] in (
        "the media took too long to decode",
        "the media could not be decoded",
        "the media needs too much memory to decode",
    )
    assert after == []


def test_gateway_errors_raised_in_a_worker_keep_their_status_and_param():
    async def go():
        box = _sandbox()
        try:
            return await box.run(
                normalise_audio, (b"RIFF\0\0\0\0WAVE", AudioConfig(), 16000, "x.y"), param="x.y"
            )
        finally:
            await box.aclose()

    with pytest.raises(InvalidMedia) as err:
        _run(go())
    assert err.value.param == "x.y"


# -- byte budgets ------------------------------------------------------------------------------------------


def test_the_request_budget_is_413_naming_the_part_that_crosses_it():
    async def go():
        shared = ByteBudget(10_000)
        budget = RequestBudget(shared, 3_000, 0.1)
        await budget.take(2_000, "messages.0.content.1.input_audio.data")
        with pytest.raises(MediaTooLarge) as err:
            await budget.take(2_000, "messages.0.content.2.input_audio.data")
        held = shared.used
        budget.release()
        return err.value, held, shared.used

    err, held, after = _run(go())
    assert err.status == 413 and err.param == "messages.0.content.2.input_audio.data"
    assert held == 2_000 and after == 0


def test_the_process_budget_makes_requests_wait_then_503():
    async def go():
        shared = ByteBudget(5_000)
        a = RequestBudget(shared, 5_000, 0.2)
        b = RequestBudget(shared, 5_000, 0.2)
        await a.take(4_000, "a")
        with pytest.raises(Overloaded):
            await b.take(2_000, "b")
        waiter = asyncio.create_task(b.take(2_000, "b"))
        await asyncio.sleep(0.01)
        a.release()
        await waiter
        return shared.used

    assert _run(go()) == 2_000


def test_urls_never_reach_an_engine_adapter():
    from core.schemas import ChatCompletionRequest
    from engines.adapters.base import wire_messages

    for url in ("https://example.com/a.png", "http://127.0.0.1/x", "file:///etc/passwd", "ftp://x/y"):
        req = ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi"},
                            {"type": "video_url", "video_url": {"url": url}},
                        ],
                    }
                ],
            }
        )
        with pytest.raises(MediaURLForbidden) as err:
            wire_messages(req)
        assert err.value.status == 400 and err.value.param == "messages.0.content.1.video_url.url"
    ok = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ],
        }
    )
    assert wire_messages(ok)[0]["content"][0]["image_url"]["url"].startswith("data:")


# -- the gateway's own copies of a part --------------------------------------------------------------------


def _peak_bytes(fn):
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", ["data-uri", "plain-base64"])
def test_undoing_a_parts_base64_costs_only_its_bytes(shape):
    """Decoding allocates the decoded bytes and, for a data URI, one transient byte copy of the URI to
    view the payload in: no str slices of it, no second copy (each would be another 4/3 of the part at
    the request's peak). Counting a part's bytes, or reading its declared type, allocates nothing."""
    import base64

    from policies.media.parts import MediaRef, declared_type, decode_payload, payload_size

    raw = np.random.default_rng(1).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes()
    text = base64.b64encode(raw).decode()
    if shape == "data-uri":
        ref = MediaRef(0, 1, "audio", "audio_url", "data:audio/wav;base64," + text)
    else:
        ref = MediaRef(0, 1, "audio", "input_audio", text, "wav")
    data, peak = _peak_bytes(lambda: decode_payload(ref))
    assert data == raw
    transient = len(ref.value) if shape == "data-uri" else 0
    # tracemalloc counts every thread of the process: under pytest-xdist a test's background threads
    # (servers of earlier tests in this worker) allocated 250 kB during one measurement. A second copy of
    # the part would add 4 MB, so a 1 MiB margin still catches it.
    assert peak < len(raw) + transient + 1024 * 1024, (
        f"decoding a {len(raw):,}-byte part peaked at {peak:,} bytes"
    )
    size, peak = _peak_bytes(lambda: payload_size(ref))
    assert size == len(raw)
    assert peak < 64 * 1024, f"counting a part's bytes allocated {peak:,} bytes"
    _, peak = _peak_bytes(lambda: declared_type(ref))
    assert peak < 64 * 1024


@pytest.mark.parametrize(
    "payload",
    ["", "QUJD=", "QU=D", "QUJD\n", "QUJ*", "Zm9v\u00e9"],
    ids=["empty", "bad-length", "padding-inside", "newline", "bad-char", "non-ascii"],
)
def test_counting_a_parts_bytes_refuses_what_decoding_refuses(payload):
    from policies.media.parts import MediaRef, decode_payload, payload_size

    for ref in (
        MediaRef(0, 1, "audio", "audio_url", "data:audio/wav;base64," + payload),
        MediaRef(0, 1, "audio", "input_audio", payload, "wav"),
    ):
        with pytest.raises(InvalidMedia) as counted:
            payload_size(ref)
        with pytest.raises(InvalidMedia) as decoded:
            decode_payload(ref)
        assert counted.value.message == decoded.value.message
        assert counted.value.param == ref.param


def test_a_large_part_crosses_to_a_worker_without_a_copy_left_in_the_gateway():
    """Sent through the pool's queue, a part's pickle stays referenced by the queue's feeder thread until
    the next task: held while the request goes on to its engine. Large parts go through shared memory
    instead, given back when the task returns."""
    import os
    import tracemalloc

    data = np.random.default_rng(2).integers(0, 256, 8_000_000, dtype=np.uint8).tobytes()
    has_shm = os.path.isdir("/dev/shm")

    async def go():
        box = _sandbox()
        await box.start()
        try:
            segments = set(os.listdir("/dev/shm")) if has_shm else set()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                n = await box.run(len, (data,), param="p")
                held = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            left = (set(os.listdir("/dev/shm")) - segments) if segments else set()
            return n, held, left
        finally:
            await box.aclose()

    n, held, left = _run(go())
    assert n == len(data)
    assert held < 1_000_000, f"{held:,} bytes still held after the task returned"
    assert not left, left


def test_a_part_decodes_into_a_shared_segment_a_piece_at_a_time():
    """media-limits decodes a large part straight into the segment its workers read: the gateway holds
    no decoded copy beside it, only one piece of the payload at a time."""
    import base64

    from policies.media.parts import MediaRef, payload_size
    from policies.media.sandbox import shared_part

    raw = np.random.default_rng(3).integers(0, 256, 8_000_001, dtype=np.uint8).tobytes()
    ref = MediaRef(0, 1, "audio", "audio_url", "data:audio/wav;base64," + base64.b64encode(raw).decode())
    seg, peak = _peak_bytes(lambda: shared_part(ref, payload_size(ref)))
    assert seg is not None
    try:
        assert peak < 3_000_000, f"decoding into the segment allocated {peak:,} bytes"  # the part is 8 MB
        with seg.view() as view:
            assert view == raw
        assert seg.handle.size == len(raw)
    finally:
        seg.release()
    bad = MediaRef(0, 1, "audio", "input_audio", "QUJ*", "wav")
    with pytest.raises(InvalidMedia):
        shared_part(bad, 3)


def test_without_shared_memory_a_large_part_is_pickled_as_before(monkeypatch):
    """A full or missing /dev/shm is no failure: the part crosses in the task's pickle."""
    import base64

    from policies.media import sandbox
    from policies.media.parts import MediaRef

    monkeypatch.setattr(sandbox, "_segment", lambda size: None)
    data = bytes(range(256)) * 8192  # 2 MiB
    ref_text = "data:audio/wav;base64," + base64.b64encode(data).decode()
    assert sandbox.shared_part(MediaRef(0, 1, "audio", "audio_url", ref_text), len(data)) is None

    async def go():
        box = _sandbox()
        await box.start()
        try:
            return await box.run(len, (data,), param="p")
        finally:
            await box.aclose()

    assert _run(go()) == len(data)
