"""The hash chain, its signed checkpoints, and the walk that verifies them.

Each record stores ``hash = SHA-256("omnigate-audit-v1\\n" + prev_hash + "\\n" + data)``
where ``data`` is the record's canonical JSON (sorted keys, no spaces) exactly as
stored and ``prev_hash`` is the hash of the record before it (64 zeros for the
first). The order is the chain itself, not the ``seq`` column: a record moved to
another place no longer links to its neighbour.

A checkpoint signs ``(seq, hash)`` of the chain's head with the configured key
(HMAC-SHA256, or Ed25519 so that auditors can verify with the public key alone).
A record changed and every later hash recomputed to match is still caught at the
next checkpoint; a log cut short before a checkpoint's ``seq`` is caught as
truncated. Retention deletes whole prefixes ending at a checkpoint, which then
anchors the first kept record.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal

import orjson

from gateway.settings import AuditSigning

GENESIS = "0" * 64
_DOMAIN = b"omnigate-audit-v1\n"


def canonical(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()


def link(prev_hash: str, data: str) -> str:
    return hashlib.sha256(_DOMAIN + prev_hash.encode() + b"\n" + data.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Row:
    seq: int
    ts: str
    kind: str
    request_id: str | None
    tenant: str | None
    data: str
    prev_hash: str
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "kind": self.kind, "request_id": self.request_id,
                "tenant": self.tenant, "prev_hash": self.prev_hash, "hash": self.hash,
                "data": orjson.loads(self.data)}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    seq: int
    hash: str
    created_at: str
    algorithm: str  # "hmac-sha256", "ed25519" or "none"
    key_id: str
    signature: str

    def message(self) -> bytes:
        return checkpoint_message(self.seq, self.hash, self.created_at, self.key_id)


def checkpoint_message(seq: int, head: str, created_at: str, key_id: str) -> bytes:
    return canonical({"v": 1, "seq": seq, "hash": head, "created_at": created_at, "key_id": key_id}).encode()


class Signer:
    """Signs and checks checkpoints; ``algorithm`` ``none`` when no key is configured."""

    def __init__(self, algorithm: str, key_id: str, secret: bytes | None, public: bytes | None = None) -> None:
        self.algorithm = algorithm
        self.key_id = key_id
        self._secret = secret
        self._private = None
        self._public = None
        if algorithm == "ed25519":
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

            if secret is not None:
                self._private = Ed25519PrivateKey.from_private_bytes(secret)
                self._public = self._private.public_key()
            elif public is not None:
                self._public = Ed25519PublicKey.from_public_bytes(public)

    @classmethod
    def from_settings(cls, s: AuditSigning, public_key_b64: str | None = None) -> "Signer":
        if s.key is None and public_key_b64 is None:
            return cls("none", s.key_id, None)
        raw = s.key.get_secret_value().encode() if s.key is not None else None
        if s.algorithm == "ed25519":
            secret = base64.b64decode(raw, validate=True) if raw is not None else None
            public = base64.b64decode(public_key_b64, validate=True) if public_key_b64 else None
            if secret is not None and len(secret) != 32:
                raise ValueError("audit.signing.key: an Ed25519 key is 32 bytes, base64-encoded")
            return cls("ed25519", s.key_id, secret, public)
        return cls("hmac-sha256", s.key_id, raw)

    @property
    def can_sign(self) -> bool:
        return self.algorithm != "none" and (self._secret is not None)

    def public_key_b64(self) -> str | None:
        if self._public is None:
            return None
        from cryptography.hazmat.primitives import serialization

        raw = self._public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()

    def sign(self, message: bytes) -> str:
        if self.algorithm == "hmac-sha256" and self._secret is not None:
            return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
        if self.algorithm == "ed25519" and self._private is not None:
            return base64.b64encode(self._private.sign(message)).decode()
        return ""

    def check(self, cp: Checkpoint) -> bool | None:
        """True/False for a signed checkpoint this signer can check; None when it cannot tell."""
        if cp.algorithm == "none" or cp.algorithm != self.algorithm or cp.key_id != self.key_id:
            return None
        if cp.algorithm == "hmac-sha256":
            if self._secret is None:
                return None
            return hmac.compare_digest(self.sign(cp.message()), cp.signature)
        if self._public is None:
            return None
        from cryptography.exceptions import InvalidSignature

        try:
            self._public.verify(base64.b64decode(cp.signature), cp.message())
        except (InvalidSignature, ValueError):
            return False
        return True


ProblemKind = Literal["edited", "deleted", "reordered", "truncated", "bad_signature", "unanchored"]


@dataclass(frozen=True, slots=True)
class Problem:
    kind: ProblemKind
    seq: int
    message: str


@dataclass(slots=True)
class Report:
    records: int = 0
    first_seq: int | None = None
    head_seq: int = 0
    head_hash: str = GENESIS
    anchored_at: int | None = None
    checkpoints_signed: int = 0
    checkpoints_unchecked: int = 0
    covered_through: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    problem: Problem | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "records": self.records, "first_seq": self.first_seq, "head_seq": self.head_seq,
            "head_hash": self.head_hash, "anchored_at": self.anchored_at,
            "checkpoints_signed": self.checkpoints_signed, "checkpoints_unchecked": self.checkpoints_unchecked,
            "covered_through": self.covered_through,
            "uncovered_records": max(0, self.head_seq - self.covered_through),
            "gaps": [{"seq": s, "lost": n} for s, n in self.gaps],
            "problem": None if self.problem is None else {
                "kind": self.problem.kind, "seq": self.problem.seq, "message": self.problem.message},
        }


_COLUMNS = ("ts", "kind", "request_id", "tenant")


class ChainVerifier:
    """Walks rows in ``seq`` order and stops at the first problem.

    ``lookup(hash)`` returns the ``seq`` of the stored record with that hash, so a
    broken link can be told apart: pointing forward means reordered, pointing
    nowhere means the record before was changed or removed.
    """

    def __init__(
        self,
        checkpoints: list[Checkpoint],
        signer: Signer | None,
        lookup: Callable[[str], Awaitable[int | None]],
    ) -> None:
        self.report = Report()
        self._lookup = lookup
        self._by_seq: dict[int, Checkpoint] = {}
        self._prev_seq = 0
        self._prev_hash = GENESIS
        self._started = False
        self._last_cp = 0
        for cp in sorted(checkpoints, key=lambda c: c.seq):
            verdict = signer.check(cp) if signer is not None else None
            if verdict is False:
                self._fail("bad_signature", cp.seq, f"checkpoint at record {cp.seq} has an invalid signature")
                break
            if verdict is True:
                self.report.checkpoints_signed += 1
            else:
                self.report.checkpoints_unchecked += 1
            self._by_seq[cp.seq] = cp
        self._newest = max(self._by_seq) if self._by_seq else 0

    def _fail(self, kind: ProblemKind, seq: int, message: str) -> None:
        if self.report.problem is None:
            self.report.problem = Problem(kind, seq, message)

    @property
    def failed(self) -> bool:
        return self.report.problem is not None

    async def feed(self, row: Row) -> bool:
        """Check one row; False once a problem was found (stop walking)."""
        if self.failed:
            return False
        r = self.report
        if not self._started:
            self._started = True
            r.first_seq = row.seq
            if row.seq != 1:
                anchor = self._by_seq.get(row.seq - 1)
                if anchor is None or anchor.hash != row.prev_hash:
                    self._fail("deleted", 1, f"records 1..{row.seq - 1} are missing and no checkpoint anchors "
                                             f"a retention cut at record {row.seq - 1}")
                    return False
                r.anchored_at = self._last_cp = anchor.seq
                self._prev_seq, self._prev_hash = anchor.seq, anchor.hash
        if row.seq != self._prev_seq + 1:
            missing = f"{self._prev_seq + 1}" if row.seq == self._prev_seq + 2 else \
                f"{self._prev_seq + 1}..{row.seq - 1}"
            self._fail("deleted", self._prev_seq + 1, f"record {missing} is missing (deleted)")
            return False
        if link(row.prev_hash, row.data) != row.hash or not self._columns_match(row):
            self._fail("edited", row.seq, f"record {row.seq} was edited: its content no longer matches its hash")
            return False
        if row.prev_hash != self._prev_hash:
            where = await self._lookup(row.prev_hash)
            if where is not None and where != self._prev_seq:
                self._fail("reordered", row.seq,
                           f"record {row.seq} is out of order: it was written after record {where}")
            else:
                self._fail("edited", self._prev_seq,
                           f"record {self._prev_seq} was replaced: record {row.seq} links to a different "
                           f"predecessor")
            return False
        cp = self._by_seq.get(row.seq)
        if cp is not None and cp.hash != row.hash:
            since = self._last_cp + 1
            self._fail("edited", since, f"records {since}..{row.seq} were rewritten: record {row.seq} differs "
                                        f"from the signed checkpoint at it")
            return False
        if row.kind == "gap":
            lost = orjson.loads(row.data).get("payload", {}).get("lost", 0)
            r.gaps.append((row.seq, int(lost)))
        if cp is not None:
            r.covered_through = self._last_cp = row.seq
        r.records += 1
        r.head_seq, r.head_hash = row.seq, row.hash
        self._prev_seq, self._prev_hash = row.seq, row.hash
        return True

    @staticmethod
    def _columns_match(row: Row) -> bool:
        try:
            doc = orjson.loads(row.data)
        except orjson.JSONDecodeError:
            return False
        return all(doc.get(c) == getattr(row, c) for c in _COLUMNS)

    def finish(self) -> Report:
        if not self.failed and self._newest > self.report.head_seq:
            self._fail("truncated", self.report.head_seq + 1,
                       f"the log ends at record {self.report.head_seq} but a signed checkpoint covers record "
                       f"{self._newest}: records {self.report.head_seq + 1}..{self._newest} were cut off")
        return self.report
