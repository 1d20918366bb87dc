"""Built-in ``text-screen`` (pre) and ``text-screen-answers`` (post): text classified by a served model.

A classification model an engine serves (vLLM ``--runner pooling`` answering ``/classify``, or TEI's
``/predict``: a prompt-injection or moderation head) gives each text the probability of each of its
labels; a generative safety model (Llama Guard style, ``chat-guard``: any engine's chat completions)
gives ``safe`` or ``unsafe`` with the category codes it names, scored by its verdict's probability. ``categories`` map labels to what the operator blocks: a category's score is the sum of its
labels' probabilities, and at or above its ``threshold`` the text is flagged.

``text-screen`` classifies the prompt before any engine sees it: the text of the messages of ``roles``,
each cut into pieces of at most ``max_chars`` (all of a request's pieces go in one batched call). A
flagged prompt is refused with a 400 ``content_policy_violation`` naming the category.

``text-screen-answers`` classifies the answer. Not streamed: the whole answer, before it is served.
Streamed, per ``mode``: ``window`` holds the answer back until ``window_chars`` of text are pending,
classifies that window (with the last ``overlap_chars`` already released before it, so a phrase cut
by a window edge is still read whole), and releases it only when it is clean; ``hold`` releases nothing
before the whole answer is clean. A flagged answer is refused with a 422 ``answer_withheld`` naming the
category before anything of it was sent; after a window went out, the stream ends with that error as
an error frame. Everything the engine sent (text, speech, tool calls) is held and released in order.

Both fill a receipt (the model, the lowest threshold, the messages or the answer they read, each
category's highest score), honour ``shadow`` (recorded, never acted on) and ``on_error``: the model
unreachable, failing or past ``served.timeout_s`` is a guard that cannot judge (fail_closed: 503
``guard_unavailable``; fail_open: served, the receipt saying it was not scanned).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from core.context import RequestContext, Scan, Screening
from core.errors import AnswerWithheld, ContentPolicyViolation
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from policies.base import Accept, Deps, Halt, PolicyBase, PolicyConfig, Reject, StreamCheck, Verdict
from policies.served.client import ServedModel
from policies.settings import ServedModelSettings

Role = Literal["system", "developer", "user", "tool", "assistant"]
_ROLES: tuple[Role, ...] = ("user", "tool")


class Category(PolicyConfig):
    """One thing the screen blocks: the model's labels that make it up, and the score that flags it."""

    labels: Annotated[list[str], Field(min_length=1)] = Field(
        description="the model's labels whose probabilities add up to this category's score"
    )
    threshold: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        description="a text whose category score is at or above this is flagged"
    )


class TextScreenConfig(PolicyConfig):
    """The served classifier, the categories it blocks, and what it reads."""

    served: ServedModelSettings = Field(
        description="the classifier's engine: endpoint classify (vLLM) or tei-predict (TEI); labels: the "
        "model's labels in index order (vLLM names only the top one in its answer)"
    )
    categories: Annotated[dict[str, Category], Field(min_length=1)] = Field(
        description="category name -> the labels that make it up and its threshold"
    )
    roles: Annotated[list[Role], Field(min_length=1)] = Field(
        default_factory=lambda: list(_ROLES),
        description="text-screen: the roles whose messages are classified",
    )
    max_chars: Annotated[int, Field(ge=64, le=100_000)] = Field(
        default=2000, description="a longer text is cut into pieces of this many characters, each classified"
    )
    mode: Literal["window", "hold"] = Field(
        default="window",
        description="text-screen-answers, streamed: window (release each clean window) or hold (release "
        "the answer once it is clean whole)",
    )
    window_chars: Annotated[int, Field(ge=16, le=20_000)] = Field(
        default=400,
        description="text-screen-answers, window mode: the text held back before it is classified",
    )
    overlap_chars: Annotated[int, Field(ge=0, le=5_000)] = Field(
        default=120, description="text-screen-answers: the released text read again with the next window"
    )

    @model_validator(mode="after")
    def _labels_known(self) -> TextScreenConfig:
        if self.served.endpoint not in ("classify", "tei-predict", "chat-guard"):
            raise ValueError(
                "served.endpoint: the text screen classifies texts: classify, tei-predict or chat-guard"
            )
        if self.served.endpoint == "classify" and self.served.labels is None:
            raise ValueError("served.labels: name the model's labels in index order (its id2label)")
        known = set(self.served.labels or ())
        if self.served.endpoint == "chat-guard":
            # A chat guard's labels: its verdict words, and the category codes it may name (upper case).
            if any(lab != lab.upper() for lab in known):
                raise ValueError("served.labels: a chat guard's category codes are upper case (S1, S10)")
            known |= {"safe", "unsafe"}
        for name, cat in self.categories.items():
            unknown = [lab for lab in cat.labels if known and lab not in known]
            if unknown:
                raise ValueError(
                    f"categories.{name}.labels: {unknown} are not labels of the model {sorted(known)}"
                )
        return self


class _Screen(PolicyBase):
    """What both stages share: the served model, the categories, the receipt."""

    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]] = TextScreenConfig

    def __init__(self, config: TextScreenConfig) -> None:
        self.config = config
        self._model: ServedModel | None = None
        self._metrics: Any = None

    async def start(self, deps: Deps) -> None:
        self._metrics = deps.metrics
        self._model = ServedModel(self.config.served, name=self.name)

    async def aclose(self) -> None:
        if self._model is not None:
            await self._model.aclose()

    @property
    def model(self) -> ServedModel:
        if self._model is None:
            self._model = ServedModel(self.config.served, name=self.name)
        return self._model

    def receipt(self, ctx: RequestContext) -> Scan:
        scan = ctx.outputs.scan(self.name)
        scan.model = self.config.served.model
        scan.threshold = min(c.threshold for c in self.config.categories.values())
        return scan

    async def scores(self, texts: list[str]) -> list[dict[str, float]]:
        """Each text's category scores (a long text: the highest over its pieces)."""
        pieces: list[str] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            cut = _cut(text, self.config.max_chars)
            pieces.extend(cut)
            owner.extend([i] * len(cut))
        out: list[dict[str, float]] = [dict.fromkeys(self.config.categories, 0.0) for _ in texts]
        if not pieces:
            return out
        for i, probs in zip(owner, await self.model.classify(pieces), strict=True):
            for name, cat in self.config.categories.items():
                out[i][name] = max(out[i][name], sum(probs.get(label, 0.0) for label in cat.labels))
        return out

    def flagged(self, scores: dict[str, float]) -> tuple[str, float] | None:
        """The category most over its threshold, if any is reached."""
        hits = [
            (s - self.config.categories[c].threshold, c, s)
            for c, s in scores.items()
            if s >= self.config.categories[c].threshold
        ]
        if not hits:
            return None
        _, name, score = max(hits)
        return name, score

    def observe(self, source: str, scores: dict[str, float]) -> None:
        if self._metrics is not None and scores:
            self._metrics.screen_scores.labels(self.name, source).observe(max(scores.values()))


class TextScreen(_Screen):
    """Pre: the prompt's text, classified before any engine sees it."""

    name: ClassVar[str] = "text-screen"
    stage: ClassVar[str] = "pre"

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        scan = self.receipt(ctx)
        roles = set(self.config.roles)
        texts = [
            (i, t) for i, m in enumerate(request.messages) if m.role in roles and (t := m.text()).strip()
        ]
        if not texts:
            return request
        scores = await self.scores([t for _, t in texts])
        scan.messages = [i for i, _ in texts]
        scan.chars = sum(len(t) for _, t in texts)
        worst = {c: max(s[c] for s in scores) for c in self.config.categories}
        scan.parts.append({"part": "prompt", "kind": "text", "categories": _rounded(worst)})
        first: tuple[int, str, float] | None = None
        for (i, _), s in zip(texts, scores, strict=True):
            hit = self.flagged(s)
            ctx.outputs.screenings.append(
                Screening(self.name, f"messages.{i}", round(max(s.values()), 4), hit is not None)
            )
            self.observe("text", s)
            if hit is not None and first is None:
                first = (i, *hit)
        if first is not None:
            i, category, score = first
            raise ContentPolicyViolation(
                f"messages.{i}: the prompt was refused by the text screen (category {category!r}, "
                f"score {score:.2f} >= {self.config.categories[category].threshold})",
                param="messages",
            )
        return request


class TextScreenAnswers(_Screen):
    """Post: the answer, classified before it is released (streamed: window by window)."""

    name: ClassVar[str] = "text-screen-answers"
    stage: ClassVar[str] = "post"

    def stream_mode(self, request: ChatCompletionRequest, ctx: RequestContext) -> Literal["window", "hold"]:
        return self.config.mode

    def open_check(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamCheck:
        return AnswerCheck(self, ctx)

    async def post(
        self, request: ChatCompletionRequest, completion: Completion, ctx: RequestContext
    ) -> Verdict:
        check = AnswerCheck(self, ctx)
        text = completion.text or completion.transcript
        return await check.judged(text, released=False) or check.accept()

    def refusal(self, category: str, score: float) -> AnswerWithheld:
        threshold = self.config.categories[category].threshold
        return AnswerWithheld(
            f"the answer was withheld by the text screen (category {category!r}, score {score:.2f} >= {threshold})"
        )


class AnswerCheck:
    """One attempt's answer, held back window by window (or whole), released once classified clean."""

    def __init__(self, policy: TextScreenAnswers, ctx: RequestContext) -> None:
        self.policy = policy
        self.cfg: TextScreenConfig = policy.config
        self.scan = policy.receipt(ctx)
        self.ctx = ctx
        self._held: list[Delta] = []
        self._pending = ""
        self._before = ""  # the tail of what was released, read again with the next window
        self._released = False
        self._chars = 0
        self._windows = 0
        self._worst: dict[str, float] = dict.fromkeys(self.cfg.categories, 0.0)

    async def feed(self, delta: Delta) -> list[Delta]:
        self._held.append(delta)
        self._pending += delta.text or delta.transcript
        if self.cfg.mode == "hold" or len(self._pending) < self.cfg.window_chars:
            return []
        verdict = await self.judged(self._pending, released=self._released)
        if verdict is not None:
            raise Halt(verdict)
        out, self._held = self._held, []
        self._released = self._released or bool(out)
        return out

    async def finish(self) -> Verdict:
        if self._pending.strip():
            verdict = await self.judged(self._pending, released=self._released)
            if verdict is not None:
                return verdict
        return self.accept()

    def release(self) -> list[Delta]:
        out, self._held = self._held, []
        return out

    async def judged(self, text: str, *, released: bool) -> Reject | None:
        """Classify ``text`` (with the overlap before it); a refusal when it is flagged."""
        (scores,) = await self.policy.scores([self._before + text])
        self._windows += 1
        self._chars += len(text)
        self._worst = {c: max(self._worst[c], s) for c, s in scores.items()}
        self._before = (self._before + text)[-self.cfg.overlap_chars :] if self.cfg.overlap_chars else ""
        self._pending = ""
        self._record()
        self.policy.observe("answer", scores)
        hit = self.policy.flagged(scores)
        self.ctx.outputs.screenings.append(
            Screening(self.policy.name, "answer", round(max(scores.values()), 4), hit is not None)
        )
        if hit is None:
            return None
        return Reject(self.policy.refusal(*hit))

    def _record(self) -> None:
        part = {
            "part": "answer",
            "kind": "text",
            "chars": self._chars,
            "windows": self._windows,
            "categories": _rounded(self._worst),
        }
        self.scan.parts = [p for p in self.scan.parts if p.get("part") != "answer"] + [part]

    def accept(self) -> Accept:
        return Accept(notes={"text_screen": {"windows": self._windows, "categories": _rounded(self._worst)}})


def _cut(text: str, size: int) -> list[str]:
    text = text.strip()
    return [text[i : i + size] for i in range(0, len(text), size)] if text else []


def _rounded(scores: dict[str, float]) -> dict[str, float]:
    return {c: round(s, 4) for c, s in scores.items()}


__all__ = ["TextScreen", "TextScreenAnswers"]
