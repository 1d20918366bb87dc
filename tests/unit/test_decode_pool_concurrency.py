"""The decoding pool under many concurrent parts: every part is decoded, none waits for a worker that is gone.

A realtime turn sends every audio part of the conversation so far in one request, decoded at once: many
more parts than workers, queued in the pool while its workers exit after ``decode_tasks_per_child``
parts and are replaced.
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import soundfile as sf

from policies.media.audio import AudioConfig, normalise_audio
from policies.media.sandbox import Sandbox
from policies.settings import MediaSettings

pytestmark = pytest.mark.timeout(120)


def _wav(seconds: float, rate: int) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    sf.write(buf, pcm, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize(("workers", "per_child"), [(1, 2), (2, 3), (2, 64)])
def test_parts_queued_past_the_workers_lives_are_all_decoded(workers, per_child):
    wav = _wav(2.0, 24000)  # a realtime turn's part: 2 s at 24 kHz, resampled to the engine's rate
    parts = 150

    async def go() -> tuple[list[object], int]:
        box = Sandbox(
            MediaSettings(
                decode_workers=workers,
                decode_tasks_per_child=per_child,
                decode_deadline_s=5,
                decode_cpu_s=5,
                decode_memory_mb=512,
            )
        )
        await box.start()
        try:
            results: list[object] = []
            for _ in range(2):  # the second batch finds the workers part-way through their lives
                results += await asyncio.gather(
                    *(
                        box.run(normalise_audio, (wav, AudioConfig(), 16000, f"p.{i}"), param=f"p.{i}")
                        for i in range(parts)
                    ),
                    return_exceptions=True,
                )
            return results, box.replaced
        finally:
            await box.aclose()

    results, replaced = asyncio.run(go())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} parts failed, the first: {failed[0]!r}"
    assert replaced == 0  # no part hung or broke its pool
