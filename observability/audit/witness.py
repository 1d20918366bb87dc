"""Signed heads published outside the store: a file appended with fsync, one JSON line per checkpoint.

Someone who controls the database can cut the chain's tail together with its
checkpoints; a head kept elsewhere still names the record that must be there
(``omnigate audit verify --expect-file``). Ship the file (or the
``audit_checkpoint`` log events) to storage the database's operators cannot rewrite.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from observability.audit.chain import Checkpoint
from observability.audit.durable import append_fsynced


class Witness:
    def __init__(self, path: Path | None) -> None:
        self.path = path

    async def publish(self, checkpoints: list[Checkpoint]) -> None:
        if self.path is None or not checkpoints:
            return
        lines = b"".join(orjson.dumps(cp.to_json()) + b"\n" for cp in checkpoints)
        await asyncio.to_thread(append_fsynced, self.path, lines, 0o640)


def read_heads(path: Path) -> dict[int, str]:
    """``seq -> hash`` from a witness file (JSON lines) or from lines of ``SEQ:HASH``."""
    heads: dict[int, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        try:
            if line.startswith("{"):
                doc = orjson.loads(line)
                seq, digest = int(doc["seq"]), str(doc["hash"])
            else:
                seq_s, digest = line.split(":", 1)
                seq = int(seq_s)
        except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{n}: not a published head ({exc})") from exc
        heads[seq] = digest
    return heads


def parse_expect(value: str) -> tuple[int, str]:
    seq_s, sep, digest = value.partition(":")
    if not sep or not seq_s.isdigit() or len(digest) != 64:
        raise ValueError(f"--expect takes SEQ:HASH (a record number and its 64-hex hash), not {value!r}")
    return int(seq_s), digest.lower()
