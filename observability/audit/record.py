"""What one request's audit record says, built off the request path from its :class:`RequestContext`.

The pipeline only keeps references (the request as received, the completion, a
running digest of what it released); hashing the input parts, redacting and
serialising happen in the audit writer's worker thread. A request with media is
the exception: its input is hashed on a thread when its media steps start
(:class:`InputDigests`), so that the client's media need not live until the record.

Digests are SHA-256 of each input part as the client sent it (the text; the URL
or ``data:`` URI; the base64 of ``input_audio``) and of the output released to
the client: its text, its 16-bit PCM audio, its spoken transcript, its tool calls
(each call's name and arguments, in the order released) and its reasoning text.

``request_sha256`` covers everything else the model is given: the SHA-256 of the
whole request's canonical JSON (sorted keys, no spaces, unset fields left out),
each media payload replaced by its digest and length. Tool definitions,
``tool_choice``, ``response_format``, message names, ``tool_call_id``, an assistant
turn's tool calls and every sampling parameter are in it because the whole request
is, so a field added to the wire model cannot be left out of the record.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.digest import OutputDigest
from core.spooled import SpooledMedia
from observability.audit.chain import canonical
from observability.audit.redact import Budget

if TYPE_CHECKING:
    from core.context import PolicyRun, RequestContext, Scan
    from core.events import Completion
    from core.schemas import ChatCompletionRequest


@dataclass(slots=True)
class RequestSnapshot:
    """The fields of a finished request, copied on the request path (cheap), encoded later."""

    ctx: RequestContext
    received: ChatCompletionRequest | None
    output: OutputDigest | None
    completion: Completion | None
    duration_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


#: characters hashed at a time: a media part's string is never copied whole to be hashed
_SHA_PIECE = 1 << 20


def _sha(s: str) -> str:
    h = hashlib.sha256()
    for i in range(0, len(s), _SHA_PIECE):
        h.update(s[i : i + _SHA_PIECE].encode())
    return h.hexdigest()


class InputDigests:
    """A request's :func:`input_digests` and :func:`request_digest`, made once: early on a thread by the
    pipeline, which then lets go of the client's media strings, or by the audit writer if that never
    finished (a refused request)."""

    __slots__ = ("_lock", "_request", "_value")

    def __init__(self, request: ChatCompletionRequest) -> None:
        self._request: ChatCompletionRequest | None = request
        self._value: tuple[list[dict[str, Any]], str] | None = None
        self._lock = threading.Lock()

    def _made(self) -> tuple[list[dict[str, Any]], str]:
        with self._lock:
            if self._value is None:
                assert self._request is not None
                self._value, self._request = digests(self._request), None
            return self._value

    def get(self) -> list[dict[str, Any]]:
        """The record's ``input``."""
        return self._made()[0]

    def request(self) -> str:
        """The record's ``request_sha256``."""
        return self._made()[1]


def input_digests(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The record's ``input``: a digest of every part and tool call as the client sent it.

    The pipeline calls it (on a thread) once the media steps start, so that the client's media
    strings need not live until the record is written; otherwise the writer calls it.
    """
    return digests(req)[0]


def request_digest(req: ChatCompletionRequest) -> str:
    """The record's ``request_sha256`` (see the module docstring)."""
    return digests(req)[1]


#: the field of each media part that holds its payload: (part type, field, key)
_MEDIA = {
    "image_url": ("image_url", "url"),
    "input_audio": ("input_audio", "data"),
    "audio_url": ("audio_url", "url"),
    "video_url": ("video_url", "url"),
}


def digests(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str]:
    """``input`` and ``request_sha256`` in one pass: each media payload is hashed once, for both."""
    inputs: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        doc = m.model_dump(mode="json", exclude_none=True, exclude={"content"})
        if isinstance(m.content, str):
            doc["content"] = m.content
        elif m.content is not None:
            doc["content"] = []
        for part in m.parts():
            digest = _part_digest(m.role, part)
            inputs.append(digest)
            if isinstance(m.content, list):
                doc["content"].append(_part_doc(part, digest))
        for call in m.tool_calls or ():
            # The calls an assistant turn made are input too (a client can rewrite them).
            raw = call.function.name + call.function.arguments
            inputs.append({"role": m.role, "type": "tool_call", "sha256": _sha(raw), "chars": len(raw)})
        messages.append(doc)
    whole = req.model_dump(mode="json", exclude_none=True, exclude={"messages"})
    whole["messages"] = messages
    return inputs, _sha(canonical(whole))


def _part_doc(part: Any, digest: dict[str, Any]) -> dict[str, Any]:
    """A content part as the request digest sees it: a media payload by its digest, the rest as sent."""
    media = _MEDIA.get(part.type)
    if media is None:
        doc: dict[str, Any] = part.model_dump(mode="json", exclude_none=True)
        return doc
    field_name, key = media
    doc = part.model_dump(mode="json", exclude_none=True, exclude={field_name: {key}})
    doc[field_name].update({"sha256": digest["sha256"], "chars": digest["chars"]})
    return doc


def _part_digest(role: str, part: Any) -> dict[str, Any]:
    kind = part.type
    media = _MEDIA.get(kind)
    raw = part.text if media is None else getattr(getattr(part, media[0]), media[1])
    digest = raw.sha256() if isinstance(raw, SpooledMedia) else _sha(raw)  # a spooled payload: from its file
    return {"role": role, "type": kind, "sha256": digest, "chars": len(raw)}


def _content(req: ChatCompletionRequest, mode: str, budget: Budget) -> list[dict[str, Any]]:
    """The prompt as kept: text redacted (``redacted``) or as sent with media (``raw``)."""
    kept: list[dict[str, Any]] = []
    for m in req.messages:
        if mode == "raw":
            kept.append(m.model_dump(mode="json", exclude_none=True))
        else:
            kept.append({"role": m.role, "text": budget.redact(m.text())})
    return kept


def _receipt(p: PolicyRun, scan: Scan | None) -> dict[str, Any]:
    """One policy run as the record keeps it: its verdict, and the receipt of what it saw (``saw``;
    ``complete`` is false where it could not look at something, ``on_error`` says what followed)."""
    out: dict[str, Any] = {
        "name": p.name,
        "stage": p.stage,
        "verdict": p.verdict,
        "duration_ms": round(p.duration_ms, 3),
        "shadow": p.shadow,
        "mode": "shadow" if p.shadow else "enforce",
        "detail": p.detail,
        "attempt": p.attempt,
        "score": p.score,
    }
    if scan is not None:
        out["saw"] = scan.to_json()
        out["complete"] = not scan.missed
    return out


def request_payload(snap: RequestSnapshot) -> dict[str, Any]:
    ctx = snap.ctx
    payload: dict[str, Any] = {
        # the id the client sent (sanitised), beside the gateway's own request_id of the record
        "client_request_id": ctx.identity.client_request_id,
        "key_id": ctx.identity.key_id,
        "priority": ctx.identity.priority,
        "max_concurrency": ctx.identity.tenant_max_concurrency,
        "policy_set": ctx.identity.policy_set,
        "public_model": ctx.record.public_model,
        "stream": ctx.record.stream,
        "engine": ctx.record.engine,
        "variant": ctx.record.variant,
        "outcome": ctx.record.outcome,
        "status": ctx.record.status,
        "error_code": ctx.record.error_code,
        # each policy that ran, with its receipt: what it looked at and whether it could look at all of it
        "policies": [_receipt(p, ctx.outputs.scans.get(p.name)) for p in ctx.record.policy_runs],
        "degraded": list(ctx.outputs.degraded),
        "notes": dict(ctx.outputs.notes),
        # the traffic decisions: the admission's (the gateway's record) and the policies' (shedding)
        "control": {
            **({"admission": ctx.record.admission} if ctx.record.admission else {}),
            **ctx.outputs.control,
        },
        **({"sampling_defaults": dict(ctx.record.sampling_defaults)} if ctx.record.sampling_defaults else {}),
        # where a long input was cut into consecutive engine calls (seconds into the client's part)
        **({"segments": [list(b) for b in ctx.record.segments]} if ctx.record.segments else {}),
        "attempts": ctx.record.attempts,
        "retries": ctx.record.retries,
        "usage": {
            "prompt_tokens": ctx.record.prompt_tokens,
            "completion_tokens": ctx.record.completion_tokens,
            # speech is metered in seconds: it adds no completion tokens
            **({"audio_seconds": round(ctx.record.audio_seconds, 3)} if ctx.record.audio_seconds else {}),
            # an answer cut before the engine's usage came: counted by the gateway from what was relayed
            **({"counted_by": ctx.record.usage_counted_by} if ctx.record.usage_counted_by else {}),
            # an estimate (engines/rollout/energy.py), present only where the engine's GPU power is measured
            **(
                {"energy_joules": round(ctx.record.energy_joules, 3)}
                if ctx.record.energy_joules is not None
                else {}
            ),
        },
        "duration_ms": round(snap.duration_ms, 3),
        # a stream's time to first token; a whole answer has none (its duration says how long it took)
        "ttft_ms": (
            round(ctx.record.ttft_s * 1000, 3)
            if ctx.record.ttft_s is not None and ctx.record.stream
            else None
        ),
        "body_bytes": ctx.record.body_bytes,
    }
    if ctx.record.realtime is not None:
        # a turn of a /v1/realtime session: which session, which turn, the committed audio it answered
        payload["realtime"] = dict(ctx.record.realtime)
    req = snap.received
    if req is not None:
        # Who the client says its end user is, and the pairs it attached: for an auditor to find its
        # requests by (OpenAI's safety_identifier and the legacy user; metadata, 16 short pairs at most).
        end_user = {k: v for k in ("safety_identifier", "user") if (v := getattr(req, k)) is not None}
        if end_user:
            payload["end_user"] = end_user
        if req.metadata:
            payload["metadata"] = dict(req.metadata)
    if isinstance(ctx.record.input_digests, InputDigests):
        # made before the pipeline let go of the client's media
        payload["input"] = ctx.record.input_digests.get()
        payload["request_sha256"] = ctx.record.input_digests.request()
    elif req is not None:
        payload["input"], payload["request_sha256"] = digests(req)
    output = snap.output
    if output is None and snap.completion is not None:
        output = OutputDigest.of(snap.completion, keep_text=ctx.identity.audit_content != "digests")
    if output is not None:
        payload["output"] = output.to_json()
    if ctx.identity.audit_content != "digests" and req is not None:
        # One budget per record: what redaction may spend on it is bounded however many messages it has.
        budget = Budget()
        kept: dict[str, Any] = {
            "mode": ctx.identity.audit_content,
            "messages": _content(req, ctx.identity.audit_content, budget),
        }
        if output is not None:
            text = output.text()
            kept["output_text"] = text if ctx.identity.audit_content == "raw" else budget.redact(text)
        payload["content"] = kept
    payload.update(snap.extra)
    return payload
