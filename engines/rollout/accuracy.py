"""The held-out accuracy sentinel: an operator's question set replayed against each engine, scored exactly.

The set is JSON lines, one item a line::

    {"prompt": "Which organ is shown?", "media": ["images/q1.png"], "choices": ["heart", "lung"], "answer": "B"}
    {"prompt": "Capital of France? One word.", "answer": "Paris"}

``media`` entries are data URIs or paths relative to the set's folder (never outside it): images go
as ``image_url``, audio (wav, mp3, flac, ogg) as ``input_audio``, video as ``video_url``. With
``choices`` (multiple choice, as MMMU's) the choices are listed as ``A. ...`` lines and the answer
is scored by its normalised choice letter; without, by the exact string after case and whitespace
are folded. The set is replayed per engine (so per variant) every ``interval_s``, and for the
engines a routing transition touches, straight to the engine adapter (no policies: it measures
the model, not the gateway). Each engine's last replay gives its ``accuracy`` signal; the
``accuracy-floor`` rule keeps an engine under 90 % from being any shift's destination.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import mimetypes
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from core.schemas import ChatCompletionRequest
from engines.rollout.settings import AccuracySettings
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

LETTERS = "ABCDEFGHIJ"
_AUDIO = {"wav": "wav", "x-wav": "wav", "mpeg": "mp3", "mp3": "mp3", "flac": "flac", "ogg": "ogg"}
_CHOICE_PATTERNS = (
    # "B", "(B)", "B.", "B) lung", "[B]"
    re.compile(r"^\s*[\(\[]?([A-J])[\)\]]?(?:[\.\):,]|\s|$)"),
    # "The answer is B", "Answer: (B)", "answer - B"
    re.compile(r"\banswer\s*(?:is|:|-)?\s*[\(\[]?([A-J])[\)\]]?(?![A-Za-z])", re.IGNORECASE),
)


class HeldOutSetError(ValueError):
    """The held-out set cannot be used as written (the message names the line)."""


@dataclass(frozen=True, slots=True)
class HeldOutItem:
    prompt: str
    answer: str
    choices: tuple[str, ...] = ()
    #: content parts for the media, ready for the request (resolved when the set is loaded)
    media: tuple[dict[str, Any], ...] = ()

    def message_content(self) -> list[dict[str, Any]]:
        text = self.prompt
        if self.choices:
            listed = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(self.choices))
            text = f"{text}\n{listed}\nAnswer with the letter of the correct choice only."
        return [*self.media, {"type": "text", "text": text}]


def normalise_text(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".")


def choice_letter(text: str, n_choices: int) -> str | None:
    """The choice letter an answer gives ("B", "(b)", "B. lung", "The answer is B"), or None."""
    allowed = LETTERS[:n_choices]
    head = text.strip()
    for pattern in _CHOICE_PATTERNS:
        m = pattern.search(head if pattern is _CHOICE_PATTERNS[1] else head.upper())
        if m and m.group(1).upper() in allowed:
            return m.group(1).upper()
    return None


def is_correct(item: HeldOutItem, answer: str) -> bool:
    if item.choices:
        return choice_letter(answer, len(item.choices)) == item.answer
    return normalise_text(answer) == normalise_text(item.answer)


def _media_part(entry: str, root: Path, where: str) -> dict[str, Any]:
    if entry.startswith("data:"):
        mime = entry[5:].split(";", 1)[0].split(",", 1)[0]
        data = entry.split(",", 1)[1] if "," in entry else ""
    else:
        rel = Path(entry)
        path = (root / rel).resolve()
        if rel.is_absolute() or root.resolve() not in path.parents:
            raise HeldOutSetError(f"{where}: media path {entry!r} is not inside the set's folder")
        if not path.is_file():
            raise HeldOutSetError(f"{where}: media file {entry!r} not found")
        mime = mimetypes.guess_type(path.name)[0] or ""
        data = base64.b64encode(path.read_bytes()).decode()
        entry = f"data:{mime};base64,{data}"
    kind, _, sub = mime.partition("/")
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": entry}}
    if kind == "audio" and sub in _AUDIO:
        return {"type": "input_audio", "input_audio": {"data": data, "format": _AUDIO[sub]}}
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": entry}}
    raise HeldOutSetError(f"{where}: media of type {mime or 'unknown'!r} is not an image, audio or video")


def parse_item(raw: Any, root: Path, where: str) -> HeldOutItem:
    if not isinstance(raw, dict):
        raise HeldOutSetError(f"{where}: each line is a JSON object")
    unknown = set(raw) - {"prompt", "media", "choices", "answer", "id"}
    if unknown:
        raise HeldOutSetError(f"{where}: unknown fields {sorted(unknown)}")
    prompt, answer = raw.get("prompt"), raw.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise HeldOutSetError(f"{where}: prompt must be a non-empty string")
    if not isinstance(answer, str) or not answer.strip():
        raise HeldOutSetError(f"{where}: answer must be a non-empty string")
    choices = raw.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices) or len(choices) > 10:
        raise HeldOutSetError(f"{where}: choices must be a list of at most 10 strings")
    if choices:
        answer = answer.strip().upper()
        if len(answer) != 1 or answer not in LETTERS[: len(choices)]:
            raise HeldOutSetError(
                f"{where}: a multiple-choice answer is one of the letters A..{LETTERS[len(choices) - 1]}"
            )
    media = raw.get("media") or []
    if isinstance(media, str):
        media = [media]
    if not isinstance(media, list) or not all(isinstance(m, str) for m in media):
        raise HeldOutSetError(f"{where}: media must be a string or a list of strings")
    parts = tuple(_media_part(m, root, where) for m in media)
    return HeldOutItem(prompt=prompt, answer=answer, choices=tuple(choices), media=parts)


def load_set(path: str | Path, max_items: int = 1000) -> list[HeldOutItem]:
    p = Path(path)
    items: list[HeldOutItem] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p.name} line {n}"
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise HeldOutSetError(f"{where}: not JSON ({exc})") from exc
        items.append(parse_item(raw, p.parent, where))
        if len(items) > max_items:
            raise HeldOutSetError(f"{p.name}: more than {max_items} items (routing.accuracy.max_items)")
    if not items:
        raise HeldOutSetError(f"{p.name}: no items")
    return items


@dataclass(frozen=True, slots=True)
class Replay:
    engine: str
    variant: str
    at: float
    correct: int
    scored: int
    failed: int

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.scored if self.scored else None


class HeldOutSentinel:
    """Replays the set per engine, off the request path; :meth:`latest` feeds the controller's snapshot."""

    def __init__(
        self,
        settings: AccuracySettings,
        engines: Callable[[], dict[str, Any]],
        metrics: Metrics,
        *,
        active: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        items: Iterable[HeldOutItem] | None = None,
    ) -> None:
        self.settings = settings
        self._engines = engines
        self._metrics = metrics
        self._active = active
        self._clock = clock
        self.items: list[HeldOutItem] = list(items) if items is not None else []
        self.results: dict[str, Replay] = {}
        #: when each engine was last replayed, scored or not (an engine that only fails waits its interval)
        self._tried: dict[str, float] = {}
        self._pending: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if not self.items:
            assert self.settings.set_path is not None
            try:
                self.items = await asyncio.to_thread(
                    load_set, self.settings.set_path, self.settings.max_items
                )
            except (OSError, HeldOutSetError) as exc:
                log.error("accuracy_set_unusable", error=str(exc))
                return
        log.info("accuracy_sentinel_started", items=len(self.items))
        self._task = asyncio.create_task(self._run(), name="accuracy-sentinel")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _wanted(self) -> list[str]:
        names = sorted(self._engines())
        return [n for n in names if not self.settings.engines or n in self.settings.engines]

    def request(self, engines: Iterable[str]) -> None:
        """Replay these engines soon (a routing transition touched them)."""
        wanted = set(self._wanted())
        self._pending.update(e for e in engines if e in wanted)
        self._wake.set()

    def on_transition(self, transition: Any) -> None:
        """The controller's transition hook: replay the engine it concerns and those serving its models."""
        if not self.settings.on_transition:
            return
        touched = {transition.engine} if transition.engine else set()
        for name, engine in self._engines().items():
            if set(getattr(engine.config, "serves", ())) & set(transition.models):
                touched.add(name)
        self.request(touched)

    def _due(self) -> list[str]:
        now = self._clock()
        interval = self.settings.interval_s
        due = [n for n in self._wanted() if n not in self._tried or now - self._tried[n] >= interval]
        return sorted(set(due) | self._pending)

    async def _run(self) -> None:
        while True:
            if self._active():
                for name in self._due():
                    self._pending.discard(name)
                    await self.replay(name)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=min(self.settings.interval_s, 5.0))

    async def replay(self, name: str) -> Replay | None:
        """Ask the engine every item, one at a time; an engine error leaves the item unscored."""
        engine = self._engines().get(name)
        if engine is None:
            return None
        model = engine.config.serves[0] if engine.config.serves else name
        self._tried[name] = self._clock()
        correct = scored = failed = 0
        for item in self.items:
            request = ChatCompletionRequest.model_validate(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": item.message_content()}],
                    "max_tokens": self.settings.max_tokens,
                    "temperature": 0.0,
                }
            )
            try:
                completion = await asyncio.wait_for(engine.complete(request), self.settings.timeout_s)
            except Exception as exc:  # an engine fault is not a wrong answer: the item goes unscored
                failed += 1
                log.debug("accuracy_item_failed", engine=name, error=str(exc) or type(exc).__name__)
                continue
            scored += 1
            correct += is_correct(item, completion.text)
        variant = engine.config.variant
        result = Replay(name, variant, self._clock(), correct, scored, failed)
        self._metrics.accuracy_replays.labels(name, "scored" if scored else "failed").inc()
        if result.accuracy is not None:
            self.results[name] = result
            self._metrics.engine_accuracy.labels(name, variant).set(result.accuracy)
        log.info(
            "accuracy_replayed", engine=name, variant=variant, correct=correct, scored=scored, failed=failed
        )
        return result

    def latest(self, name: str) -> tuple[float, int] | None:
        """(accuracy, items scored) of the engine's last replay that scored anything."""
        r = self.results.get(name)
        if r is None or r.accuracy is None:
            return None
        return r.accuracy, r.scored
