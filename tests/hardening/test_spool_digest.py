"""Issue 25: a spooled payload's audit digest is of the client's exact string.

Base64 whose last group has non-zero padding bits (``QR==`` decodes to the byte ``A``, which encodes
back as ``QQ==``) is valid to a lenient decoder and decodes to the same bytes as its canonical form.
The spool kept only the decoded bytes and hashed them re-encoded, so the record's digest of a spooled
part was not the digest of what the client sent, and differed from the in-memory path's.
"""

from __future__ import annotations

import base64
import hashlib

import orjson
import pytest

from core.schemas import ChatCompletionRequest
from core.spooled import SpooledMedia
from gateway.api import body as json_body
from observability.audit.record import input_digests

pytestmark = pytest.mark.timeout(60)


def _body(payload: str) -> bytes:
    return orjson.dumps(
        {
            "model": "omni",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "input_audio", "input_audio": {"data": payload, "format": "wav"}},
                    ],
                }
            ],
        }
    )


def _spooled(body: bytes, chunk: int = 7919) -> dict:
    reader = json_body.Reader()
    for at in range(0, len(body), chunk):
        reader.feed(body[at : at + chunk])
    return reader.result()


@pytest.mark.parametrize(
    "tail", ["QR==", "QUJ=", "QUJD"], ids=["two-pad-bits-set", "one-pad-bits-set", "none"]
)
def test_a_spooled_payloads_digest_is_of_the_exact_string_the_client_sent(tail):
    head = base64.b64encode(bytes(range(256)) * 1500).decode()  # 384 KB: past the spool's threshold
    payload = head + tail
    assert len(payload) >= json_body.SPOOL_MIN
    exact = hashlib.sha256(payload.encode()).hexdigest()

    doc = _spooled(_body(payload))
    value = doc["messages"][0]["content"][1]["input_audio"]["data"]
    assert isinstance(value, SpooledMedia)  # the spool path, not a fallback
    assert len(value) == len(payload)
    assert value.sha256() == exact

    in_memory = ChatCompletionRequest.model_validate(orjson.loads(_body(payload)))
    spooled = ChatCompletionRequest.model_validate(doc)
    assert input_digests(spooled) == input_digests(in_memory)
    assert input_digests(spooled)[1]["sha256"] == exact
    value.release()


def test_a_data_uri_payload_digest_includes_its_header_as_sent():
    payload = "data:audio/wav;base64," + base64.b64encode(b"\x01" * 300_000).decode()[:-4] + "AQE="
    body = orjson.dumps(
        {
            "model": "omni",
            "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": payload}}]}],
        }
    )
    doc = _spooled(body)
    value = doc["messages"][0]["content"][0]["audio_url"]["url"]
    assert isinstance(value, SpooledMedia)
    assert value.sha256() == hashlib.sha256(payload.encode()).hexdigest()
    value.release()
