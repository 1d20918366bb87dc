"""Real speech for the accuracy sentinel's tests and the incident replay: sentences spoken by espeak-ng.

The sentences are ones whisper tiny.en hears word for word from espeak-ng's en-us
voice at 150 words a minute (after normalisation), so a matching engine scores 0 %
WER and any error the sentinel finds comes from the scripted mismatch.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

#: (what the engine's transcript says, a different sentence for a drifting engine's audio)
PAIRS = [
    (
        "Please send the report to the finance team before Friday.",
        "Please send the invoice to the legal office before Monday.",
    ),
    (
        "Turn left at the next corner and walk for two blocks.",
        "Turn right at the old bridge and drive for ten miles.",
    ),
    (
        "We need twenty five chairs for the meeting on Monday.",
        "Please send the invoice to the legal office before Monday.",
    ),
]


def espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("the speech tests need espeak-ng: apt-get install -y espeak-ng")
    return exe


def synthesize(text: str, path: Path) -> Path:
    """Speak ``text`` into a mono 16-bit WAV at ``path`` (espeak-ng's 22.05 kHz)."""
    subprocess.run(
        [espeak(), "-v", "en-us", "-s", "150", "-w", str(path), text],
        check=True,
        timeout=60,
        capture_output=True,
    )
    return path


def speech_set(folder: Path) -> list[tuple[str, Path, Path]]:
    """Per pair: the transcript, its own speech, and the drifted speech."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (said, drifted) in enumerate(PAIRS):
        out.append(
            (said, synthesize(said, folder / f"said-{i}.wav"), synthesize(drifted, folder / f"drift-{i}.wav"))
        )
    return out


def read_pcm(path: Path) -> tuple[bytes, int]:
    """A synthesized WAV as 16-bit PCM bytes and its sample rate (what the sentinel is handed)."""
    import soundfile as sf

    data, rate = sf.read(path, dtype="int16")
    return data.tobytes(), rate
