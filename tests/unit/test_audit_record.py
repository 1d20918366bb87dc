"""What a request's audit record says: digests of every input part and of the output, kept content by mode."""

from __future__ import annotations

import hashlib

from core.context import Identity, PolicyRun, Record, RequestContext
from core.digest import OutputDigest
from core.events import Completion, Delta, Usage
from core.schemas import ChatCompletionRequest
from observability.audit.record import RequestSnapshot, request_payload


def _sha(s: str | bytes) -> str:
    return hashlib.sha256(s.encode() if isinstance(s, str) else s).hexdigest()


IMAGE = "data:image/png;base64,iVBORw0KGgo="
AUDIO = "UklGRiQAAABXQVZF"
REQUEST = ChatCompletionRequest.model_validate(
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Call me at +1 415 555 0132."},
                    {"type": "image_url", "image_url": {"url": IMAGE}},
                    {"type": "input_audio", "input_audio": {"data": AUDIO, "format": "wav"}},
                ],
            },
        ],
    }
)


def _ctx(mode: str) -> RequestContext:
    ctx = RequestContext(
        Identity("r1", tenant="acme", audit_content=mode),
        Record(outcome="served", prompt_tokens=7, completion_tokens=3),
    )
    ctx.record.policy_runs.append(PolicyRun("request-limits", "pre", "accept", 0.0123456))
    ctx.outputs.control["shedding"] = {"action": "text-only"}
    return ctx


def test_digests_of_every_input_part_and_the_output():
    completion = Completion(
        text="Sure, at noon.", audio=b"\x01\x02" * 10, transcript="Sure", usage=Usage(7, 3)
    )
    p = request_payload(RequestSnapshot(_ctx("digests"), REQUEST, None, completion, 12.0))
    assert p["input"] == [
        {"role": "system", "type": "text", "sha256": _sha("Be brief."), "chars": 9},
        {"role": "user", "type": "text", "sha256": _sha("Call me at +1 415 555 0132."), "chars": 27},
        {"role": "user", "type": "image_url", "sha256": _sha(IMAGE), "chars": len(IMAGE)},
        {"role": "user", "type": "input_audio", "sha256": _sha(AUDIO), "chars": len(AUDIO)},
    ]
    assert p["output"] == {
        "text_sha256": _sha("Sure, at noon."),
        "text_chars": 14,
        "audio_sha256": _sha(b"\x01\x02" * 10),
        "audio_bytes": 20,
        "transcript_sha256": _sha("Sure"),
    }
    assert p["policies"] == [
        {
            "name": "request-limits",
            "stage": "pre",
            "verdict": "accept",
            "duration_ms": 0.012,
            "shadow": False,
            "mode": "enforce",
            "detail": None,
            "attempt": 1,
            "score": None,
        }
    ]
    assert p["control"] == {"shedding": {"action": "text-only"}}
    assert p["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    assert "content" not in p


def test_streamed_output_digest_equals_the_digest_of_the_whole():
    out = OutputDigest(keep_text=True)
    for piece in ("Sure, ", "at ", "noon."):
        out.add(Delta(text=piece))
    assert out.to_json()["text_sha256"] == _sha("Sure, at noon.") and out.text() == "Sure, at noon."


def test_redacted_and_raw_content():
    completion = Completion(text="Mail bob@example.com")
    red = request_payload(RequestSnapshot(_ctx("redacted"), REQUEST, None, completion, 1.0))["content"]
    assert red["messages"] == [
        {"role": "system", "text": "Be brief."},
        {"role": "user", "text": "Call me at [PHONE]."},
    ]
    assert red["output_text"] == "Mail [EMAIL]"
    raw = request_payload(RequestSnapshot(_ctx("raw"), REQUEST, None, completion, 1.0))["content"]
    assert raw["messages"][1]["content"][1] == {"type": "image_url", "image_url": {"url": IMAGE}}
    assert raw["output_text"] == "Mail bob@example.com"


def test_the_energy_estimate_is_in_the_usage_only_where_power_was_measured():
    completion = Completion(text="Sure.", usage=Usage(7, 3))
    ctx = _ctx("digests")
    assert (
        "energy_joules" not in request_payload(RequestSnapshot(ctx, REQUEST, None, completion, 1.0))["usage"]
    )
    ctx.record.energy_joules = 0.123456
    p = request_payload(RequestSnapshot(ctx, REQUEST, None, completion, 1.0))
    assert p["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "energy_joules": 0.123}


def test_a_whole_answer_has_no_time_to_first_token_only_a_duration():
    """Time to first token is a stream's; a whole answer's ttft_s (when a path set it) is its duration."""
    completion = Completion(text="Sure.", usage=Usage(7, 3))
    ctx = _ctx("digests")
    ctx.record.ttft_s = 0.25
    ctx.record.stream = False
    whole = request_payload(RequestSnapshot(ctx, REQUEST, None, completion, 250.0))
    assert whole["ttft_ms"] is None and whole["duration_ms"] == 250.0
    ctx.record.stream = True
    assert request_payload(RequestSnapshot(ctx, REQUEST, None, completion, 250.0))["ttft_ms"] == 250.0
