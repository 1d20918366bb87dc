"""Built-in post-policy ``grounding``: does the answer contradict what the request says?

A scorer (:mod:`policies.grounding.scorer`) labels the answer's claim sentences
supported, contradicted or unverifiable against the request's evidence
(:mod:`policies.grounding.claims`); the answer's score is the minimum over the
claims it could check (unverifiable ones do not count). At or above ``threshold``
the answer is served; below (a contradiction, or a fact about the evidence's own
subject that differs from it), the pipeline retries with the configured
adjustment while its budget (``policies.max_retries``) lasts; then, per
``on_exhausted``, the best-scoring answer is served flagged
(``x-omnigate-grounding: low``) or the request is refused (422 ``grounding_failed``).

For streams the policy is a streaming post-check; its mode is chosen per tenant,
then per public model, then ``mode``:

``hold``
    nothing (text or audio) reaches the client before the whole answer passed;
    every retry is possible.
``window``
    text is released sentence by sentence once each sentence passed; a text
    window longer than ``window_chars`` without a sentence end is judged as it
    is. Audio is released only as far as the passed text can account for (see
    :class:`SpeechGate`). A failing sentence before the first release retries
    at once; after it, the stream ends with an error frame.
``passthrough``
    everything is released at once; the verdict is recorded and sent as the
    stream's final event. It never claims to have blocked anything.

A request whose messages of the ``evidence_roles`` state nothing (no sentence
that is not a question and names a fact or has six words: an open-domain
question) has nothing to judge an answer against: the guard abstains, and the
answer is served unjudged, with ``x-omnigate-grounding: no-evidence``, the
verdict ``skipped`` and the reason ``no_evidence``, and a receipt that says it
did not judge the answer. An answer with evidence but no claim it bears on is
served with the verdict ``unverifiable``, never ``pass``.

Its length (over 500 lines): the policy and its stream checks (hold, window, passthrough) share the
premise, the speech gate, the verdict rules, the retry adjustment and the receipt code; a check is only
read beside the others. What is not that shared core lives beside it: the judgement (judgement.py), facts
(facts.py), claims (claims.py) and the image check (image_evidence.py); the stream checks are the next
piece to move out.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from core.context import RequestContext
from core.errors import GroundingFailed
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest, Message
from observability.metrics import Metrics
from policies.base import (
    Accept,
    Deps,
    Halt,
    PolicyBase,
    PolicyConfig,
    Reject,
    Retry,
    StreamCheck,
    StreamMode,
    Verdict,
)
from policies.grounding.claims import Premise, claims_of, premise_of, split_sentences
from policies.grounding.image_evidence import ImageEvidence, ImageEvidenceConfig, Seen, images_of, judge
from policies.grounding.scorer import GUARDS, Judgement, Scorer
from policies.registry import Extra

DEFAULT_INSTRUCTION = (
    "Answer only with facts stated in this conversation and the documents it contains. "
    "Do not add names, numbers or dates that are not stated there; if the answer is not there, say so."
)
HEADER = "x-omnigate-grounding"
#: the header's value when the request carried no evidence (the answer was not judged)
NO_EVIDENCE = "no-evidence"
EvidenceRole = Literal["system", "developer", "user", "tool"]
_PREMISE_ROLES: tuple[EvidenceRole, ...] = ("system", "developer", "user", "tool")  # claims.PREMISE_ROLES


class GroundingConfig(PolicyConfig):
    """How answers are judged, streamed and retried."""

    threshold: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=0.8, description="the score an answer needs"
    )
    mode: StreamMode = Field(default="hold", description="stream mode: hold, window or passthrough")
    modes_by_model: dict[str, StreamMode] = Field(
        default_factory=dict, description="stream mode by public model (after modes_by_tenant)"
    )
    modes_by_tenant: dict[str, StreamMode] = Field(
        default_factory=dict, description="stream mode by tenant (first)"
    )
    on_exhausted: Literal["flag", "refuse"] = Field(
        default="flag",
        description="no retry left: flag (serve the best attempt, x-omnigate-grounding: low) or refuse (422)",
    )
    retry_temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = Field(
        default=0.0, description="temperature of retries, never raised (null: unchanged)"
    )
    retry_instruction: str | None = Field(
        default=DEFAULT_INSTRUCTION, description="added as the first system message of retries (null: none)"
    )
    window_chars: Annotated[int, Field(ge=40, le=20000)] = Field(
        default=400,
        description="window mode: the longest text held before it is judged without a sentence end",
    )
    speech_chars_per_second: Annotated[float, Field(gt=0.0, le=200.0)] = Field(
        default=30.0, description="window mode: the speaking-rate bound for releasing audio"
    )
    images: ImageEvidenceConfig = Field(
        default_factory=ImageEvidenceConfig,
        description=(
            "claims the text leaves unverifiable, checked against the request's images by an engine "
            "(policies/grounding/image_evidence.py)"
        ),
    )
    evidence_roles: Annotated[list[EvidenceRole], Field(min_length=1)] = Field(
        default_factory=lambda: list(_PREMISE_ROLES),
        description=(
            "the roles whose text is evidence: a request whose messages of these roles state nothing is served "
            "unjudged (skipped, no_evidence; x-omnigate-grounding: no-evidence); "
            "[tool]: judge only answers to retrieved documents"
        ),
    )


class SpeechGate:
    """Audio may only reach the client once the text it speaks has passed.

    The bound: after ``passed`` characters of text passed the check, at most
    ``passed / chars_per_second`` seconds of audio are released, the audio's
    duration taken from its PCM length (``bytes / (2 * channels * rate)``).
    ``chars_per_second`` is the fastest speaking rate assumed (30 by default:
    about 330 words a minute, faster than fast conversational speech), so audio
    released under the bound cannot run ahead of the passed text unless the
    engine speaks faster than that. A delta that crosses the bound is split at
    the sample where the bound falls.
    """

    def __init__(self, chars_per_second: float) -> None:
        self.rate = chars_per_second
        self.released_s = 0.0
        self._queue: deque[tuple[float, Delta]] = deque()

    def hold(self, delta: Delta) -> None:
        self._queue.append((time.perf_counter(), delta))

    def release(self, passed_chars: int) -> tuple[list[Delta], float | None]:
        """Deltas within the bound, and when the oldest of them arrived."""
        allowed = passed_chars / self.rate
        out: list[Delta] = []
        oldest: float | None = None
        while self._queue:
            t, d = self._queue[0]
            frame = 2 * max(1, d.channels)
            seconds = len(d.audio) / (frame * d.sample_rate) if d.sample_rate else 0.0
            if self.released_s + seconds <= allowed + 1e-9:
                self._queue.popleft()
                out.append(d)
                self.released_s += seconds
            else:
                frames = int((allowed - self.released_s) * d.sample_rate + 1e-6)  # float noise, not a sample
                if frames <= 0:
                    break
                cut = frames * frame
                head = Delta(audio=d.audio[:cut], sample_rate=d.sample_rate, channels=d.channels)
                tail = Delta(
                    audio=d.audio[cut:],
                    sample_rate=d.sample_rate,
                    channels=d.channels,
                    audio_done=d.audio_done,
                    transcript=d.transcript,
                )
                self._queue[0] = (t, tail)
                out.append(head)
                self.released_s += frames / d.sample_rate
            oldest = t if oldest is None else min(oldest, t)
            if self.released_s >= allowed:
                break
        return out, oldest

    def drain(self) -> tuple[list[Delta], float | None]:
        out = [d for _, d in self._queue]
        oldest = self._queue[0][0] if self._queue else None
        self._queue.clear()
        return out, oldest


class _Check:
    """State shared by the three modes; one object per attempt."""

    mode: StreamMode = "hold"

    def __init__(
        self,
        policy: Grounding,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        premise: Premise | None = None,
    ) -> None:
        self.policy = policy
        self.cfg = policy.config
        self.ctx = ctx
        self.request = request
        self.attempt = ctx.record.retries + 1
        self.premise = premise if premise is not None else policy.premise(request, ctx)
        self._text: list[str] = []  # the answer so far (joined once, at the end)
        self._calls = False  # the answer calls tools
        self._seen: list[Seen] = []  # what the image checks of this attempt looked at

    def _tool_turn(self) -> Verdict | None:
        """A turn that only calls tools states nothing to ground: served unscored (its arguments are no claims)."""
        if self._calls and not "".join(self._text).strip():
            return self.policy.tool_turn(self.mode, self.attempt)
        return None

    # -- verdict helpers --------------------------------------------------
    def _notes(self, j: Judgement, verdict: str) -> dict[str, Any]:
        # The receipt: the evidence it judged against (messages, characters), the claims of the answer, the scorer.
        scan = self.ctx.outputs.scan(self.policy.name)
        scan.model, scan.threshold = self.policy.scorer_kind, self.cfg.threshold
        roles = set(self.cfg.evidence_roles)
        evidence = [(i, m.text()) for i, m in enumerate(self.request.messages) if m.role in roles]
        scan.messages = [i for i, t in evidence if t.strip()]
        scan.chars = sum(len(t) for _, t in evidence)
        counts = j.counts()
        scan.parts = [
            {"part": "answer", "kind": "text", "claims": len(j.claims), "score": round(j.score, 4), **counts}
        ]
        if self._seen:
            images = self.cfg.images
            shown, of = max(x.images for x in self._seen), max(x.of_images for x in self._seen)
            scan.parts.append(
                {
                    "part": "images",
                    "kind": "image",
                    "images": shown,
                    "of": of,
                    "claims_checked": sum(len(x.labels) for x in self._seen),
                    "asked_engine": sum(x.asked for x in self._seen),
                    "model": images.model or self.request.model,
                }
            )
            if shown < of:
                scan.missed.append({"part": "images", "why": f"only the first {shown} of {of} were shown"})
        weakest = j.weakest
        if verdict == "pass" and not j.checked:
            verdict = "unverifiable"  # evidence, but nothing of the answer it bears on: not a pass
        return {
            "grounding": {
                "mode": self.mode,
                "scorer": self.policy.scorer_kind,
                "verdict": verdict,
                "score": round(j.score, 4),
                "threshold": self.cfg.threshold,
                "attempt": self.attempt,
                "claims": len(j.claims),
                **counts,
                "weakest": weakest.reason if weakest is not None and j.score < self.cfg.threshold else None,
            }
        }

    def _judged(self, j: Judgement) -> bool:
        ok = j.score >= self.cfg.threshold
        if j.checked:
            self.policy.observe(self.mode, j.score, "pass" if ok else "fail")
        elif j.claims:
            self.policy.metrics.grounding_verdicts.labels(self.mode, "unverifiable").inc()
        return ok

    def _verdict(self, j: Judgement) -> Verdict:
        if self._judged(j):
            return Accept(score=j.score, notes=self._notes(j, "pass"))
        return self.policy.retry(self.request, j, self._notes(j, "low"))

    def _holdback(self, since: float | None) -> None:
        if since is not None:
            self.policy.metrics.holdback_wait.labels(self.mode).observe(time.perf_counter() - since)

    async def judge_text(self, text: str) -> Judgement:
        claims = claims_of(split_sentences(text))
        j, seen = await judge(self.policy.scorer, self.policy.images, self.request, self.premise, claims)
        if seen is not None:
            self._seen.append(seen)
        return j


class HoldCheck(_Check):
    mode: StreamMode = "hold"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self._held: list[Delta] = []
        self._since: float | None = None

    async def feed(self, delta: Delta) -> list[Delta]:
        if self._since is None:
            self._since = time.perf_counter()
        self._text.append(delta.text or delta.transcript)
        self._calls = self._calls or bool(delta.tool_calls)
        self._held.append(delta)
        return []

    async def finish(self) -> Verdict:
        return self._tool_turn() or self._verdict(await self.judge_text("".join(self._text)))

    def release(self) -> list[Delta]:
        out, self._held = self._held, []
        self._holdback(self._since)
        return out


class PassthroughCheck(_Check):
    mode: StreamMode = "passthrough"

    async def feed(self, delta: Delta) -> list[Delta]:
        self._text.append(delta.text or delta.transcript)
        self._calls = self._calls or bool(delta.tool_calls)
        return [delta]

    async def finish(self) -> Verdict:
        skipped = self._tool_turn()
        if skipped is not None:
            return skipped
        j = await self.judge_text("".join(self._text))
        ok = self._judged(j)
        notes = self._notes(j, "pass" if ok else "fail")
        notes["grounding"]["blocked"] = False
        return Accept(score=j.score, notes=notes)

    def release(self) -> list[Delta]:
        return []


class WindowCheck(_Check):
    mode: StreamMode = "window"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self._pending = ""
        self._pending_since: float | None = None
        self._passed_chars = 0
        self._speech = SpeechGate(self.cfg.speech_chars_per_second)
        self._meta: list[Delta] = []
        self._released = False
        self._text_done = False
        self._judgement = Judgement.of(())
        self._failed: Judgement | None = None  # last attempt, flagged: hold the rest, serve it whole
        self._tail: list[Delta] = []  # the sentences judged at the end, released with the rest
        self._logprobs: list[dict[str, Any]] = []  # of the pending text, released with it

    async def feed(self, delta: Delta) -> list[Delta]:
        text = delta.text or delta.transcript
        if text:
            if self._pending_since is None:
                self._pending_since = time.perf_counter()
            self._pending += text
            if delta.logprobs:
                self._logprobs.extend(delta.logprobs)
        if delta.tool_calls or delta.reasoning:
            # Not text to judge, still the answer: released in order at the end, never dropped.
            self._calls = self._calls or bool(delta.tool_calls)
            self._meta.append(
                Delta(
                    tool_calls=delta.tool_calls, reasoning=delta.reasoning, reasoning_key=delta.reasoning_key
                )
            )
        if delta.audio:
            self._speech.hold(delta)
        elif delta.finish_reason is not None or delta.usage is not None:
            self._meta.append(Delta(finish_reason=delta.finish_reason, usage=delta.usage))
        if delta.finish_reason is not None:
            self._text_done = True
        if self._failed is not None:
            return []
        out = await self._judge_ready()
        audio, since = self._speech.release(self._passed_chars)
        self._holdback(since)
        out.extend(audio)
        if out:
            self._released = True
        return out

    async def _judge_ready(self) -> list[Delta]:
        sentences = split_sentences(self._pending)
        if not sentences:
            return []
        ready = sentences if self._text_done else sentences[:-1]
        if not ready and len(self._pending) > self.cfg.window_chars:
            ready = sentences  # the window is full without a sentence end: judge what is held
        if not ready:
            return []
        j = await self.judge_text("".join(ready))
        self._judgement = self._judgement.merge(j)
        if j.score < self.cfg.threshold:
            self._fail(j)
            return []
        self._judged(j)
        out = [Delta(text=s) for s in ready]
        self._attach_logprobs(out)
        n = sum(len(s) for s in ready)
        self._pending = self._pending[n:]
        self._passed_chars += n
        self._holdback(self._pending_since)
        self._pending_since = time.perf_counter() if self._pending else None
        return out

    def _fail(self, j: Judgement) -> None:
        self._judged(j)
        whole = self._judgement
        if self._released:
            self.policy.metrics.grounding_verdicts.labels(self.mode, "terminated").inc()
            raise Halt(
                Reject(
                    GroundingFailed(
                        f"the rest of the answer contradicts the evidence the request carries (grounding score "
                        f"{j.score:.2f} < {self.cfg.threshold}); the stream was ended",
                    )
                )
            )
        if self.ctx.retries_left > 0:
            raise Halt(self.policy.retry(self.request, whole, self._notes(whole, "low")))
        if self.cfg.on_exhausted == "refuse":
            raise Halt(Reject(self.policy.refusal(whole)))
        self._failed = whole  # the last attempt, to be served flagged: hold the rest until the end

    def _attach_logprobs(self, out: list[Delta]) -> None:
        if out and self._logprobs:
            out[0].logprobs, self._logprobs = self._logprobs, []

    async def finish(self) -> Verdict:
        self._text_done = True
        if not self._pending.strip() and not self._passed_chars:
            skipped = self._tool_turn()
            if skipped is not None:
                return skipped
        if self._failed is not None:
            return self.policy.retry(self.request, self._failed, self._notes(self._failed, "low"))
        try:
            # The text's last sentence may be judged only here: with speech, vLLM-Omni's text carries no
            # finish_reason (the audio's last chunk does), so feed() never saw the text end.
            self._tail = await self._judge_ready()
        except Halt as halt:
            return halt.verdict
        if self._failed is not None:
            return self.policy.retry(self.request, self._failed, self._notes(self._failed, "low"))
        j = self._judgement
        return Accept(score=j.score, notes=self._notes(j, "pass"))

    def release(self) -> list[Delta]:
        out: list[Delta] = self._tail + ([Delta(text=self._pending)] if self._pending else [])
        self._attach_logprobs(out)
        self._tail, self._pending = [], ""
        self._holdback(self._pending_since)
        audio, since = self._speech.drain()
        self._holdback(since)
        return out + audio + self._meta


class AbstainCheck:
    """No evidence in the request: everything is released as it comes, and nothing is judged.

    The header is set when the check opens, before the response starts (a verdict's headers come too
    late for a stream whose first chunk went out as it came).
    """

    def __init__(self, policy: Grounding, request: ChatCompletionRequest, ctx: RequestContext) -> None:
        self.policy = policy
        self.ctx = ctx
        self.mode = policy.stream_mode(request, ctx)
        self.attempt = ctx.record.retries + 1
        ctx.outputs.response_headers[HEADER] = NO_EVIDENCE

    async def feed(self, delta: Delta) -> list[Delta]:
        return [delta]

    async def finish(self) -> Verdict:
        return self.policy.no_evidence(self.mode, self.attempt, self.ctx)

    def release(self) -> list[Delta]:
        return []


_CHECKS: dict[str, type[HoldCheck | WindowCheck | PassthroughCheck]] = {
    "hold": HoldCheck,
    "window": WindowCheck,
    "passthrough": PassthroughCheck,
}


class Grounding(PolicyBase):
    """The grounding guard. Shared by all requests: per-attempt state lives in the check objects."""

    name: ClassVar[str] = "grounding"
    stage: ClassVar[str] = "post"
    Config: ClassVar[type[PolicyConfig]] = GroundingConfig
    uses: ClassVar[frozenset[str]] = frozenset({"scorer"})
    extra: ClassVar[Extra] = GUARDS  # its scorers' models: refused at boot without the guards extra

    def __init__(self, config: GroundingConfig) -> None:
        self.config = config
        self._scorer: Scorer | None = None
        self._metrics: Metrics | None = None
        #: the image check (None: off, or no engine to ask outside a gateway)
        self.images: ImageEvidence | None = None

    async def start(self, deps: Deps) -> None:
        """Take the gateway's scorer (built and loaded by the gateway because this policy ``uses`` it).

        The scorer stays the gateway's: this policy's ``aclose`` (the default) leaves it running.
        """
        scorer = deps.resources.get("scorer")
        if not isinstance(scorer, Scorer):
            raise RuntimeError("the grounding policy needs the grounding scorer")
        self._scorer = scorer
        self._metrics = deps.metrics
        if self.config.images.enabled and deps.engine_chat is not None:
            self.images = ImageEvidence(self.config.images, deps.engine_chat)

    @property
    def scorer(self) -> Scorer:
        if self._scorer is None:
            raise RuntimeError("the grounding policy was not started")
        return self._scorer

    @property
    def metrics(self) -> Metrics:
        assert self._metrics is not None
        return self._metrics

    @property
    def scorer_kind(self) -> str:
        return self.scorer.kind

    # -- the two hooks ------------------------------------------------------
    def stream_mode(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamMode:
        cfg = self.config
        if ctx.identity.tenant is not None and ctx.identity.tenant in cfg.modes_by_tenant:
            return cfg.modes_by_tenant[ctx.identity.tenant]
        return cfg.modes_by_model.get(request.model, cfg.mode)

    def open_check(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamCheck:
        premise = self.premise(request, ctx)
        if not self.judges(request, premise):
            return AbstainCheck(self, request, ctx)
        return _CHECKS[self.stream_mode(request, ctx)](self, request, ctx, premise)

    async def post(
        self, request: ChatCompletionRequest, completion: Completion, ctx: RequestContext
    ) -> Verdict:
        attempt = ctx.record.retries + 1
        premise = self.premise(request, ctx)
        if not self.judges(request, premise):
            return self.no_evidence("hold", attempt, ctx)
        check = HoldCheck(self, request, ctx, premise)  # a whole answer is judged as a held one
        text = completion.text or completion.transcript
        if completion.tool_calls and not text.strip():
            return self.tool_turn("hold", attempt)
        return check._verdict(await check.judge_text(text))

    def tool_turn(self, mode: str, attempt: int) -> Accept:
        return self.skipped(mode, attempt, "tool_calls")

    def skipped(self, mode: str, attempt: int, reason: str, headers: dict[str, str] | None = None) -> Accept:
        self.metrics.grounding_verdicts.labels(mode, "skipped").inc()
        return Accept(
            headers=headers or {},
            notes={"grounding": {"mode": mode, "verdict": "skipped", "reason": reason, "attempt": attempt}},
        )

    def no_evidence(self, mode: str, attempt: int, ctx: RequestContext) -> Accept:
        """Served unjudged: the header, the notes and the receipt say there was no evidence, never "passed"."""
        scan = ctx.outputs.scan(self.name)
        scan.model, scan.threshold = self.scorer_kind, self.config.threshold
        if not any(m.get("why") == "no_evidence" for m in scan.missed):
            scan.missed.append({"part": "answer", "why": "no_evidence"})
        return self.skipped(mode, attempt, "no_evidence", {HEADER: NO_EVIDENCE})

    def judges(self, request: ChatCompletionRequest, premise: Premise) -> bool:
        """Whether there is evidence to judge an answer against: text that states something, or images
        the image check can look at."""
        return premise.has_evidence or (self.images is not None and bool(images_of(request)))

    def has_evidence(self, request: ChatCompletionRequest, ctx: RequestContext) -> bool:
        """Whether the messages of ``evidence_roles`` (and input speech's transcripts, as the user's) state
        anything: a sentence that is not a question and names a fact or has six words.

        Without evidence the premise is at most the question itself, and an answer that says anything the
        question does not would be judged unsupported: there is nothing to judge it against.
        """
        return self.premise(request, ctx).has_evidence

    # -- pieces the checks share ---------------------------------------------
    def premise(self, request: ChatCompletionRequest, ctx: RequestContext) -> Premise:
        """The evidence: messages of ``evidence_roles``, input speech's transcripts (as the user's).

        Further evidence texts (what a request's images or video frames show) enter through
        :func:`policies.grounding.claims.premise_of`'s ``evidence``, once a policy produces them.
        """
        roles = self.config.evidence_roles
        return premise_of(
            request,
            ctx.outputs.input_transcripts if "user" in roles else (),
            exclude=[self.config.retry_instruction or ""],
            roles=roles,
        )

    def observe(self, mode: str, score: float, verdict: str) -> None:
        self.metrics.grounding_score.labels(mode).observe(score)
        self.metrics.grounding_verdicts.labels(mode, verdict).inc()

    def refusal(self, j: Judgement) -> GroundingFailed:
        weakest = j.weakest
        why = f": {weakest.reason}" if weakest is not None and weakest.reason else ""
        return GroundingFailed(
            f"the answer contradicts the evidence the request carries (grounding score {j.score:.2f} < "
            f"{self.config.threshold}){why}"
        )

    def retry(self, request: ChatCompletionRequest, j: Judgement, notes: dict[str, Any]) -> Retry:
        cfg = self.config
        exhausted: Accept | Reject
        if cfg.on_exhausted == "refuse":
            exhausted = Reject(self.refusal(j))
        else:
            exhausted = Accept(score=j.score, headers={HEADER: "low"}, notes=notes)
        return Retry(reason=self.name, update=self.adjust(request), score=j.score, exhausted=exhausted)

    def adjust(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The retry's request: a lower temperature and the grounding instruction as the first system message."""
        cfg = self.config
        update: dict[str, Any] = {}
        if cfg.retry_temperature is not None:
            current = request.temperature
            colder = cfg.retry_temperature
            update["temperature"] = colder if current is None else min(current, colder)
        if cfg.retry_instruction and not any(
            m.role == "system" and m.text().strip() == cfg.retry_instruction.strip() for m in request.messages
        ):
            update["messages"] = [Message(role="system", content=cfg.retry_instruction), *request.messages]
        return update
