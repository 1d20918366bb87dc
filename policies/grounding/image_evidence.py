"""Images as evidence: the claims the request's text cannot judge, checked against its images by an engine.

The grounding guard's scorers read text. An answer about a picture ("the apple is green") finds nothing in
the text to support or contradict it: unverifiable. When the request carries images (video frames reach
the engines as images too), the guard asks an engine that sees them: one chat call per answer, the
request's images and the open claims numbered, and a constrained JSON answer naming each claim
``supported``, ``contradicted`` or ``unverifiable``. The call goes through the gateway's own routing
(:class:`policies.base.EngineChat`): the model it asks is a public model name, usually the omni model
that answered. Verdicts are cached per (images, claim), so a retry of the same answer, or the next turn
over the same picture, does not ask again.

Why a verification call rather than captions fed to the text scorer: a caption names what its writer
noticed, and a misstated colour, count or position that the caption left out would stay unverifiable; a
question about the claim itself is answered by looking for it. What it costs: one engine call per
answer that has open claims and images, of about the answer's claims in output tokens (docs/policies).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from core.errors import GuardUnavailable
from core.request_parts import ImagePart
from core.schemas import ChatCompletionRequest
from core.spooled import SpooledMedia
from policies.base import EngineChat
from policies.grounding.claims import Premise
from policies.grounding.judgement import LABELS, ClaimLabel, ClaimScore, Judgement
from policies.grounding.scorer import Scorer

Label = ClaimLabel

INSTRUCTION = (
    "You check statements against the images you are given, and nothing else. For each numbered "
    "statement answer one word: supported (the images show it is true), contradicted (the images show it "
    "is false) or unverifiable (the images do not show whether it is true). Answer with JSON only."
)


class ImageEvidenceConfig(BaseModel):
    """``images:`` of the grounding guard's config."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="check claims against the request's images")
    model: str | None = Field(
        default=None,
        description="the public model asked (routed as clients' requests are); null: the model the request named",
    )
    max_images: int = Field(
        default=8, ge=1, le=64, description="most images sent with one check (the request's first ones)"
    )
    max_claims: int = Field(default=16, ge=1, le=64, description="most claims checked in one call")
    timeout_s: float = Field(
        default=20.0, gt=0, description="the check's deadline; past it the guard could not judge (on_error)"
    )
    cache_size: int = Field(default=4096, ge=0, description="verdicts kept per (images, claim); 0: none")


@dataclass(frozen=True, slots=True)
class Seen:
    """What one image check looked at and said: a label per claim asked, in the claims' order."""

    labels: tuple[Label, ...]
    images: int
    of_images: int
    asked: int  # claims sent to the engine (the rest came from the cache)


def images_of(request: ChatCompletionRequest) -> list[ImagePart]:
    """The image parts of the request's user messages, in order."""
    out: list[ImagePart] = []
    for m in request.messages:
        if m.role == "user" and isinstance(m.content, list):
            out.extend(p for p in m.content if isinstance(p, ImagePart))
    return out


def _digest(part: ImagePart) -> str:
    url = part.image_url.url
    if isinstance(url, SpooledMedia):
        return url.sha256()
    return hashlib.sha256(url.encode()).hexdigest()


def _schema(n: int) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "verdicts",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {
                    "verdicts": {
                        "type": "array",
                        "items": {"type": "string", "enum": list(LABELS)},
                        "minItems": n,
                        "maxItems": n,
                    }
                },
                "required": ["verdicts"],
                "additionalProperties": False,
            },
        },
    }


def _question(model: str, images: Sequence[ImagePart], claims: Sequence[str]) -> ChatCompletionRequest:
    numbered = "\n".join(f"{i}. {c.strip()}" for i, c in enumerate(claims, 1))
    # placeholders, replaced below by the parts as parsed: a spooled image stays spooled, never copied
    # into a string
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": "data:,"}} for _ in images]
    content.append({"type": "text", "text": f"Statements:\n{numbered}"})
    request = ChatCompletionRequest.model_validate(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": content},
            ],
            "temperature": 0,
            "max_tokens": 16 + 8 * len(claims),
            "response_format": _schema(len(claims)),
        }
    )
    user = request.messages[1]
    assert isinstance(user.content, list)
    user.content[: len(images)] = list(images)
    return request


def _labels(text: str, n: int) -> tuple[Label, ...]:
    try:
        doc = orjson.loads(text)
        verdicts = doc["verdicts"] if isinstance(doc, dict) else None
    except (orjson.JSONDecodeError, KeyError):
        verdicts = None
    if not isinstance(verdicts, list) or len(verdicts) != n or any(v not in LABELS for v in verdicts):
        raise GuardUnavailable("the image check's engine did not answer with a verdict for each claim")
    return tuple(verdicts)


class ImageEvidence:
    """One per grounding policy instance: the check and its cache (bounded, least recently used out)."""

    def __init__(self, config: ImageEvidenceConfig, chat: EngineChat) -> None:
        self.config = config
        self.chat = chat
        self._cache: OrderedDict[tuple[str, str], Label] = OrderedDict()

    def _cached(self, key: tuple[str, str]) -> Label | None:
        label = self._cache.get(key)
        if label is not None:
            self._cache.move_to_end(key)
        return label

    def _keep(self, key: tuple[str, str], label: Label) -> None:
        if self.config.cache_size <= 0:
            return
        self._cache[key] = label
        self._cache.move_to_end(key)
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    async def check(self, request: ChatCompletionRequest, claims: Sequence[str]) -> Seen | None:
        """Labels for ``claims`` from the request's images; None when it has none (nothing to look at).

        Raises :class:`core.errors.GuardUnavailable` when the engine cannot be asked or answers out of
        shape: the policy's ``on_error`` decides what that means for the answer.
        """
        every = images_of(request)
        if not every or not claims:
            return None
        images = every[: self.config.max_images]
        seen = "|".join(_digest(p) for p in images)
        claims = list(claims)[: self.config.max_claims]
        labels: list[Label | None] = [self._cached((seen, c)) for c in claims]
        open_ = [c for c, label in zip(claims, labels, strict=True) if label is None]
        if open_:
            answer = await self.chat(
                _question(self.config.model or request.model, images, open_), timeout_s=self.config.timeout_s
            )
            fresh = iter(_labels(answer.text, len(open_)))
            for i, label in enumerate(labels):
                if label is None:
                    got = next(fresh)
                    labels[i] = got
                    self._keep((seen, claims[i]), got)
        return Seen(
            labels=tuple(label for label in labels if label is not None),
            images=len(images),
            of_images=len(every),
            asked=len(open_),
        )


def _seen_claim(claim: ClaimScore, label: Label | None) -> ClaimScore:
    if label == "supported":
        return ClaimScore(claim.claim, 1.0, "the request's images show it", "supported")
    if label == "contradicted":
        return ClaimScore(claim.claim, 0.0, "the request's images show otherwise", "contradicted")
    return claim


async def judge(
    scorer: Scorer,
    images: ImageEvidence | None,
    request: ChatCompletionRequest,
    premise: Premise,
    claims: Sequence[str],
) -> tuple[Judgement, Seen | None]:
    """The answer's claims judged against the request's text (``scorer``, when the text states anything),
    then those still unverifiable against its images (``images``, when it has any)."""
    if premise.has_evidence:
        j = await scorer.judge(premise, claims)
    else:
        j = Judgement.of(
            [ClaimScore(c, 0.0, "the request's text states nothing", "unverifiable") for c in claims]
        )
    if images is None:
        return j, None
    open_ = [c.claim for c in j.claims if c.label == "unverifiable"]
    seen = await images.check(request, open_)
    if seen is None:
        return j, None
    by_claim = dict(zip(open_, seen.labels, strict=False))  # claims past max_claims keep their label
    relabelled = [_seen_claim(c, by_claim.get(c.claim)) if c.label == "unverifiable" else c for c in j.claims]
    return Judgement.of(relabelled), seen
