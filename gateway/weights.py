"""Verified weights: a model folder checked against a manifest of SHA-256 sums before an engine loads it.

The manifest is what ``sha256sum`` writes (``<hex>  <path>`` per line, paths relative to
the folder, ``#`` comments allowed); ``omnigate weights-manifest DIR`` writes one. A folder
passes only when every listed file is there with its sum and nothing else is (the
metadata a Hugging Face download keeps under ``.cache/huggingface/`` aside): a missing, a
changed or an extra file fails, and so does an empty or unreadable manifest. The folder
is the pinned snapshot, ``.../snapshots/<revision>``: the engine loads it by that path, so
its ``/v1/models`` root names the revision the gateway checks (:mod:`engines.selection.identity`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")
#: what huggingface_hub keeps beside the files of a download into a folder (its own bookkeeping)
_DOWNLOAD_METADATA = (".cache/huggingface/",)
_CHUNK = 1 << 20


class ManifestError(ValueError):
    """The manifest cannot be read as SHA-256 sums of relative paths."""


@dataclass
class Report:
    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def is_commit(revision: str) -> bool:
    return _COMMIT.match(revision) is not None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """Relative path -> SHA-256 (lowercase); raises :class:`ManifestError` on any line it cannot trust."""
    sums: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ManifestError(f"line {n}: not '<sha256>  <path>'")
        digest, path = m.group(1).lower(), m.group(2).strip().removeprefix("./")
        parts = Path(path).parts
        if not parts or Path(path).is_absolute() or ".." in parts:
            raise ManifestError(f"line {n}: {path!r} is not a path inside the folder")
        if path in sums:
            raise ManifestError(f"line {n}: {path!r} is listed twice")
        sums[path] = digest
    if not sums:
        raise ManifestError("the manifest lists no files")
    return sums


def _files(folder: Path) -> list[str]:
    found = []
    for p in folder.rglob("*"):
        if p.is_dir():
            continue
        rel = p.relative_to(folder).as_posix()
        if not rel.startswith(_DOWNLOAD_METADATA):
            found.append(rel)
    return sorted(found)


def write_manifest(folder: Path) -> str:
    """The manifest of ``folder`` as it is now (sorted, ``sha256sum`` format)."""
    return "".join(f"{sha256_file(folder / rel)}  {rel}\n" for rel in _files(folder))


def verify(folder: Path, manifest: dict[str, str], revision: str | None = None) -> Report:
    """Every problem that keeps ``folder`` from being the weights the manifest pins (none: it is)."""
    report = Report()
    if not folder.is_dir():
        report.problems.append(f"{folder}: no such folder")
        return report
    if revision is not None and folder.name != revision:
        report.problems.append(
            f"{folder}: not the snapshot of revision {revision} (its folder is {folder.name})"
        )
    present = set(_files(folder))
    for rel, want in sorted(manifest.items()):
        if rel not in present:
            report.problems.append(f"{rel}: missing")
            continue
        got = sha256_file(folder / rel)
        report.checked += 1
        if got != want:
            report.problems.append(f"{rel}: sha256 {got}, the manifest pins {want}")
    for rel in sorted(present - set(manifest)):
        report.problems.append(f"{rel}: not in the manifest")
    return report


def download(model: str, revision: str, folder: Path) -> None:
    """Fetch the snapshot of ``model`` at ``revision`` into ``folder`` (huggingface_hub; HF_TOKEN if needed)."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=model, revision=revision, local_dir=str(folder))
