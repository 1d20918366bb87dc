"""Generated bodies against the audio endpoints (hypothesis), through a real gateway and the scripted
vLLM-Omni: whatever the body, the answer is a 200 or an OpenAI-shaped 4xx, never an internal error or a
hang, and the gateway holds nothing afterwards (no admission slot, no spool file)."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import spooled
from tests.conftest import OMNI_MODEL
from tests.media import tone, wav

pytestmark = pytest.mark.timeout(600)

CASES = 60
_FIELDS = ["model", "input", "voice", "response_format", "speed", "instructions", "stream_format", "extra"]
_FORM_FIELDS = ["model", "language", "prompt", "response_format", "temperature", "stream", "include[]", "x"]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(
        [OMNI_MODEL, "Ethan", "wav", "mp3", "pcm", "aac", "sse", "json", "text", "srt", "1.0", "en"]
    ),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_WAV = wav(tone(0.3), 16000)


def _check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # A body is never the gateway's failure: a 5xx may only be the engines' (a scripted engine slow to
    # answer on a loaded machine times out like any other), never an internal error.
    assert r.status_code < 500 or err["code"] in ("engine_timeout", "engine_unavailable"), (
        r.status_code,
        err,
    )


def _idle(gateway) -> bool:
    store = gateway.services.admission.store
    mine = f"{spooled.PREFIX}{os.getpid()}-"
    files = [n for n in os.listdir(spooled.SHM_DIR) if n.startswith(mine)] if spooled.available() else []
    return gateway.bg.call(lambda: store.count) == 0 and not files


@settings(max_examples=CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=8), _JSON, st.binary(max_size=64)
    )
)
def test_generated_speech_bodies_are_never_the_gateways_error(gateway, ups, body):
    with httpx.Client(timeout=30) as client:
        if isinstance(body, bytes):
            r = client.post(
                gateway.url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"}
            )
        else:
            r = client.post(gateway.url + "/v1/audio/speech", json=body)
    _check(r)


@settings(max_examples=CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    fields=st.dictionaries(
        st.sampled_from(_FORM_FIELDS),
        st.text(max_size=30) | st.sampled_from([OMNI_MODEL, "json", "text", "0.5", "true"]),
        max_size=6,
    ),
    file=st.one_of(
        st.none(),
        st.binary(max_size=2048),
        st.just(_WAV),
        st.binary(max_size=64).map(lambda b: _WAV[:44] + b),
    ),
    name=st.sampled_from(["a.wav", "a.mp3", "a", "", "../../etc/passwd", "a.flac"]),
    cut=st.one_of(st.none(), st.integers(0, 400)),
)
def test_generated_transcription_forms_are_never_the_gateways_error(gateway, ups, fields, file, name, cut):
    files = {"file": (name, file)} if file is not None else {"none": (None, "")}
    request = httpx.Request("POST", gateway.url + "/v1/audio/transcriptions", data=fields, files=files)
    body = request.read()
    headers = {"content-type": request.headers["content-type"]}
    if cut is not None:  # a body cut short (but whole on the wire): not multipart's end
        body = body[:cut]
    with httpx.Client(timeout=30) as client:
        r = client.post(gateway.url + "/v1/audio/transcriptions", content=body, headers=headers)
    _check(r)


def test_nothing_is_held_after_the_generated_bodies(gateway, ups):
    with httpx.Client(timeout=30) as client:
        r = client.post(
            gateway.url + "/v1/audio/speech", json={"model": OMNI_MODEL, "input": "x", "voice": "Ethan"}
        )
    assert r.status_code == 200
    import time

    deadline = time.monotonic() + 10
    while not _idle(gateway) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _idle(gateway)
