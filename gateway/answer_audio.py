"""Spoken answers a client may send back by id: each answer's audio id, its transcript, until its audio expires.

An answer with speech carries ``audio: {"id", "data", "expires_at", "transcript"}`` (gateway/render.py
mints the id from the request id). A client continuing the conversation sends that turn back as
``{"role": "assistant", "audio": {"id": ...}}`` (OpenAI's reference shape) or echoes the whole object, as
the SDKs do with ``messages.append(answer.message)``. The engine is given the turn as text, the transcript
the gateway served, never the audio: :meth:`AnswerAudio.resolve` fills it in before the pre-policies run.
An id the gateway did not serve, one whose audio has expired or one served to another tenant is a 400
(``audio_not_found``, the same words for each: an id of another tenant's is not confirmed to exist).

Where ``redis.url`` is set the ids live in Redis (every replica resolves an id any of them served, each
key expiring with its audio); otherwise in this process, bounded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import orjson
import structlog

from core.errors import InvalidRequest, Overloaded
from core.schemas import ChatCompletionRequest, Message
from gateway.render import AUDIO_TTL_S

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from gateway.redis_client import SharedRedis

log = structlog.get_logger("omnigate.answer_audio")

#: the most answers an in-process store keeps, and the most transcript characters it holds in all
MEMORY_MAX_ANSWERS = 50_000
MEMORY_MAX_CHARS = 32 << 20


def audio_id(request_id: str) -> str:
    """The id an answer's audio carries (as gateway/render.py renders it)."""
    return "audio_" + request_id


@dataclass(frozen=True, slots=True)
class Spoken:
    """One answer's audio as remembered: what it said, until when, to whom."""

    transcript: str
    expires_at: float
    tenant: str | None


class AnswerStore(Protocol):
    async def put(self, audio: str, spoken: Spoken) -> None: ...

    async def get(self, audio: str) -> Spoken | None: ...


class MemoryAnswers:
    """This process's answers, oldest first; an answer past its expiry, or past the bounds, is forgotten."""

    def __init__(self, max_answers: int = MEMORY_MAX_ANSWERS, max_chars: int = MEMORY_MAX_CHARS) -> None:
        self._answers: OrderedDict[str, Spoken] = OrderedDict()
        self._chars = 0
        self._max_answers = max_answers
        self._max_chars = max_chars

    async def put(self, audio: str, spoken: Spoken) -> None:
        old = self._answers.pop(audio, None)
        if old is not None:
            self._chars -= len(old.transcript)
        self._answers[audio] = spoken
        self._chars += len(spoken.transcript)
        now = time.time()
        while self._answers:
            first = next(iter(self._answers.values()))
            if (
                first.expires_at > now
                and len(self._answers) <= self._max_answers
                and (self._chars <= self._max_chars)
            ):
                break
            _, gone = self._answers.popitem(last=False)
            self._chars -= len(gone.transcript)

    async def get(self, audio: str) -> Spoken | None:
        return self._answers.get(audio)


class RedisAnswers:
    """The replicas' answers in the shared Redis, one key per answer expiring with its audio."""

    def __init__(self, redis: SharedRedis, key_prefix: str) -> None:
        self._redis = redis
        self._prefix = f"{key_prefix}:answer-audio:"
        self._client: aioredis.Redis | None = None

    def _conn(self) -> aioredis.Redis:
        # Made on first use: a replica that serves no speech never opens the pool for this.
        if self._client is None:
            self._client = self._redis.client()
        return self._client

    async def put(self, audio: str, spoken: Spoken) -> None:
        ttl_ms = int((spoken.expires_at - time.time()) * 1000)
        if ttl_ms <= 0:
            return
        value = orjson.dumps({"t": spoken.transcript, "e": spoken.expires_at, "tenant": spoken.tenant})
        await self._conn().set(self._prefix + audio, value, px=ttl_ms)

    async def get(self, audio: str) -> Spoken | None:
        raw = await self._conn().get(self._prefix + audio)
        if raw is None:
            return None
        doc = orjson.loads(raw)
        return Spoken(str(doc["t"]), float(doc["e"]), doc.get("tenant"))


class AnswerAudio:
    """Remembers each spoken answer's transcript and puts it back where a client sends the answer's id."""

    def __init__(self, store: AnswerStore, ttl_s: float = AUDIO_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s

    @classmethod
    def build(cls, redis: SharedRedis | None, key_prefix: str) -> AnswerAudio:
        """Shared through Redis where one is configured (as admission and the rate limits are), else local."""
        if redis is not None and redis.configured:
            return cls(RedisAnswers(redis, key_prefix))
        return cls(MemoryAnswers())

    async def remember(self, request_id: str, transcript: str, tenant: str | None) -> None:
        """Keep a served answer's transcript under its audio id until its audio expires.

        A store that fails (Redis unreachable) costs the answer nothing: it is logged, and the id is
        refused when sent back (the client can send the turn as text).
        """
        spoken = Spoken(transcript, time.time() + self.ttl_s, tenant)
        try:
            await self.store.put(audio_id(request_id), spoken)
        except Exception as exc:  # Redis down or slow: the answer is already served
            log.warning("answer_audio_unrecorded", error=type(exc).__name__)

    async def resolve(self, request: ChatCompletionRequest, tenant: str | None) -> ChatCompletionRequest:
        """``request`` with each assistant turn sent as an audio id given its transcript as content."""
        if not any(m.audio is not None for m in request.messages):
            return request
        messages: list[Message] = []
        for i, m in enumerate(request.messages):
            if m.audio is None:
                messages.append(m)
                continue
            param = f"messages.{i}.audio.id"
            try:
                spoken = await self.store.get(m.audio.id)
            except Exception as exc:  # Redis unreachable: the id cannot be judged now
                log.warning("answer_audio_unreadable", error=type(exc).__name__)
                raise Overloaded(
                    "the conversation's earlier spoken answers cannot be read right now; retry shortly",
                    param=param,
                    code="answer_audio_unavailable",
                    retry_after=1,
                ) from None
            if spoken is None or spoken.expires_at <= time.time() or spoken.tenant != tenant:
                raise InvalidRequest(
                    f"{param}: no answer audio {m.audio.id[:64]!r} is available (unknown, or expired: "
                    f"an answer's audio lives {int(self.ttl_s)} s); send the turn's text as content instead",
                    param=param,
                    code="audio_not_found",
                )
            # The turn's own text where the client sent it (the SDKs echo content beside the audio), else
            # the transcript: either way the engine reads the turn as text.
            content = m.content if m.content else spoken.transcript
            messages.append(m.model_copy(update={"content": content}))
        return request.model_copy(update={"messages": messages})
