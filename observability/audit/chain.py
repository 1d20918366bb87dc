"""The hash chain, its signed checkpoints, and the walk that verifies them.

Each record stores ``hash = SHA-256("omnigate-audit-v1\\n" + prev_hash + "\\n" + data)``
where ``data`` is the record's canonical JSON (sorted keys, no spaces) exactly as
stored and ``prev_hash`` is the hash of the record before it (64 zeros for the
first). The order is the chain itself, not the ``seq`` column: a record moved to
another place no longer links to its neighbour.

A checkpoint signs ``(seq, hash)`` of the chain's head with the configured key
(HMAC-SHA256, or Ed25519 so that auditors can verify with the public key alone),
together with the digest of the checkpoint before it (``prev``: checkpoints form a
chain of their own, so one cannot be removed from the middle) and the cadence in
force (``every``). The store writes a checkpoint in the same transaction as the
append that makes ``every`` records since the last one, so after any commit, crash
or not, the records after the newest checkpoint are fewer than its ``every``, and
two checkpoints are less than ``every + MAX_BATCH`` records apart: checkpoints
dropped from the end or the middle are a gap in that cadence. A record changed and
every later hash recomputed to match is still caught at the next checkpoint; a
log cut short before a checkpoint's ``seq`` is caught as truncated. A tail cut
together with its checkpoints leaves a shorter chain that is consistent in
itself; the heads the gateway published outside the store (``verify --expect``)
catch it.

Retention deletes a prefix ending at a checkpoint, which then anchors the first
kept record, and appends a ``retention_cut`` record naming that anchor, signed by
a checkpoint in the same transaction; a chain that starts after record 1 without
that record was cut by someone else.

The cadence is part of the chain itself: record 1 carries, in its hashed body, the
chain's statement (``"chain": {"v", "every", "algorithm", "key_id", "signature"}``),
the cadence it is checkpointed at and the key that signs it, signed over the whole
record. Deleting every checkpoint (after editing a record and re-linking the rest)
then leaves a chain longer than its own cadence allows without one, and a forger
cannot restate the cadence without the key. The verifier fails such a chain, and the
writer refuses to append to it (:mod:`.guard`).

When the verifier holds a key (or the Ed25519 public key), a checkpoint or a statement
it cannot check (unsigned, or signed by another key) is a failure, not a pass.

Its length: the chain's link rule, the checkpoint signatures and the verifier that walks both are one
format; a reader checks the verifier against the writer's rules here, in one file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from observability.settings import AuditSigning

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
        return {
            "seq": self.seq,
            "ts": self.ts,
            "kind": self.kind,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
            "data": orjson.loads(self.data),
        }


#: the most records one append transaction writes (the writer's batch; the spool's replay batch)
MAX_BATCH = 256


@dataclass(frozen=True, slots=True)
class Checkpoint:
    seq: int
    hash: str
    created_at: str
    algorithm: str  # "hmac-sha256", "ed25519" or "none"
    key_id: str
    signature: str
    #: digest of the checkpoint before it (GENESIS for the first); "" for a checkpoint of format v1
    prev: str = ""
    #: the cadence the writer was configured with (0 for v1)
    every: int = 0

    def message(self) -> bytes:
        return checkpoint_message(self.seq, self.hash, self.created_at, self.key_id, self.prev, self.every)

    def digest(self) -> str:
        """What the next checkpoint's ``prev`` holds: it covers the message and the signature."""
        return hashlib.sha256(self.message() + b"\n" + self.signature.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "hash": self.hash,
            "created_at": self.created_at,
            "algorithm": self.algorithm,
            "key_id": self.key_id,
            "signature": self.signature,
            "prev": self.prev,
            "every": self.every,
        }


def checkpoint_message(
    seq: int, head: str, created_at: str, key_id: str, prev: str = "", every: int = 0
) -> bytes:
    if not prev:
        return canonical(
            {"v": 1, "seq": seq, "hash": head, "created_at": created_at, "key_id": key_id}
        ).encode()
    return canonical(
        {
            "v": 2,
            "seq": seq,
            "hash": head,
            "created_at": created_at,
            "key_id": key_id,
            "prev": prev,
            "every": every,
        }
    ).encode()


class Signer:
    """Signs and checks checkpoints; ``algorithm`` ``none`` when no key is configured."""

    def __init__(
        self, algorithm: str, key_id: str, secret: bytes | None, public: bytes | None = None
    ) -> None:
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
    def from_settings(cls, s: AuditSigning, public_key_b64: str | None = None) -> Signer:
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

    @property
    def can_check(self) -> bool:
        """Whether it holds what checks a signature (the secret, or the Ed25519 public key)."""
        return self.algorithm != "none" and (self._secret is not None or self._public is not None)

    def make(self, seq: int, head: str, created_at: str, prev: Checkpoint | None, every: int) -> Checkpoint:
        """The checkpoint of ``(seq, head)`` that follows ``prev``, signed when a key is configured."""
        link_to = GENESIS if prev is None else prev.digest()
        sig = self.sign(checkpoint_message(seq, head, created_at, self.key_id, link_to, every))
        return Checkpoint(
            seq,
            head,
            created_at,
            self.algorithm if self.can_sign else "none",
            self.key_id,
            sig,
            link_to,
            every,
        )

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
        return self.check_message(cp.algorithm, cp.key_id, cp.message(), cp.signature)

    def check_message(self, algorithm: str, key_id: str, message: bytes, signature: str) -> bool | None:
        """True/False for a message signed as ``algorithm`` by ``key_id``; None when this signer cannot tell."""
        if algorithm == "none" or algorithm != self.algorithm or key_id != self.key_id:
            return None
        if algorithm == "hmac-sha256":
            if self._secret is None:
                return None
            return hmac.compare_digest(self.sign(message), signature)
        if self._public is None:
            return None
        from cryptography.exceptions import InvalidSignature

        try:
            self._public.verify(base64.b64decode(signature), message)
        except (InvalidSignature, ValueError):
            return False
        return True


#: the key of the chain's statement in record 1's canonical JSON
STATEMENT = "chain"
_STATEMENT_DOMAIN = b"omnigate-audit-chain-v1\n"


def open_chain(data: str, signer: Signer, every: int) -> str:
    """Record 1's data with the chain's statement added: its cadence and key, signed over the whole record."""
    doc = orjson.loads(data)
    doc[STATEMENT] = {
        "v": 1,
        "every": every,
        "algorithm": signer.algorithm if signer.can_sign else "none",
        "key_id": signer.key_id,
    }
    doc[STATEMENT]["signature"] = signer.sign(_STATEMENT_DOMAIN + canonical(doc).encode())
    return canonical(doc)


def plain_data(data: str) -> str:
    """``data`` as it was encoded, without the statement the store added if it became record 1."""
    if f'"{STATEMENT}":' not in data:
        return data
    doc = orjson.loads(data)
    if doc.pop(STATEMENT, None) is None:
        return data
    return canonical(doc)


def read_statement(data: str, signer: Signer | None) -> tuple[int, Problem | None]:
    """The cadence record 1 states, or the problem with its statement (absent, unsigned, forged)."""
    try:
        doc = orjson.loads(data)
        stated = doc.get(STATEMENT)
        every = int(stated["every"]) if isinstance(stated, dict) else 0
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        stated, every = None, 0
    if not isinstance(stated, dict) or every < 1:
        return 0, Problem(
            "unanchored",
            1,
            "record 1 does not state the chain's checkpoint cadence: it is not the record the chain "
            "was started with",
        )
    claimed = dict(stated)
    signature = str(claimed.pop("signature", ""))
    doc[STATEMENT] = claimed
    message = _STATEMENT_DOMAIN + canonical(doc).encode()
    algorithm, key_id = str(claimed.get("algorithm", "")), str(claimed.get("key_id", ""))
    verdict = signer.check_message(algorithm, key_id, message, signature) if signer is not None else None
    if verdict is False:
        return every, Problem(
            "bad_signature", 1, "record 1's statement of the chain has an invalid signature"
        )
    if verdict is None and signer is not None and signer.can_check:
        what = "unsigned" if algorithm == "none" else f"signed by another key ({algorithm} {key_id})"
        return every, Problem(
            "unsigned",
            1,
            f"record 1's statement of the chain is {what}: with a signing key configured, it cannot "
            "vouch for the chain's cadence",
        )
    return every, None


ProblemKind = Literal[
    "edited",
    "deleted",
    "reordered",
    "truncated",
    "bad_signature",
    "unanchored",
    "unsigned",
    "checkpoint_gap",
    "witness",
    "uncovered",
]


@dataclass(frozen=True, slots=True)
class Problem:
    kind: ProblemKind
    seq: int
    message: str


class ChainBroken(Exception):
    """The chain does not verify against its newest checkpoint: nothing is appended to it (or signed)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(
            f"the audit chain is broken at record {problem.seq} ({problem.kind}): {problem.message}; "
            "nothing is appended to it: run `omnigate audit verify` and restore the store"
        )
        self.problem = problem


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
    #: the checkpoint cadence record 1 states (0: the walk did not start at record 1)
    stated_every: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            "first_seq": self.first_seq,
            "head_seq": self.head_seq,
            "head_hash": self.head_hash,
            "anchored_at": self.anchored_at,
            "checkpoints_signed": self.checkpoints_signed,
            "checkpoints_unchecked": self.checkpoints_unchecked,
            "covered_through": self.covered_through,
            "uncovered_records": max(0, self.head_seq - self.covered_through),
            "gaps": [{"seq": s, "lost": n} for s, n in self.gaps],
            "stated_every": self.stated_every,
            "problem": None
            if self.problem is None
            else {"kind": self.problem.kind, "seq": self.problem.seq, "message": self.problem.message},
        }


_COLUMNS = ("ts", "kind", "request_id", "tenant")


class ChainVerifier:
    """Walks rows in ``seq`` order and stops at the first problem.

    ``lookup(hash)`` returns the ``seq`` of the stored record with that hash, so a
    broken link can be told apart: pointing forward means reordered, pointing
    nowhere means the record before was changed or removed. ``expect`` holds heads
    published outside the store (``seq -> hash``); ``require_covered`` fails a chain
    whose newest records no signed checkpoint covers yet (a stopped gateway seals
    its head, so an archived chain has none).
    """

    def __init__(
        self,
        checkpoints: list[Checkpoint],
        signer: Signer | None,
        lookup: Callable[[str], Awaitable[int | None]],
        expect: dict[int, str] | None = None,
        require_covered: bool = False,
        anchor: tuple[int, str] | None = None,
        tail: bool = False,
    ) -> None:
        # ``anchor``: a walk over part of the chain starts after this (seq, hash), the stored link of its
        # first record; it is not a retention cut, and what lies outside the range is not judged.
        # ``tail``: that part runs to the head and ``checkpoints`` end with the chain's newest, so the
        # cadence after it is judged too (the writer's start-up walk).
        self._anchor = anchor
        self._tail = tail
        self._signer = signer
        #: the cadence record 1 states (0 until the walk has read it)
        self._stated = 0
        self.report = Report()
        self._lookup = lookup
        self._expect = dict(expect or {})
        self._require_covered = require_covered
        self._by_seq: dict[int, Checkpoint] = {}
        self._prev_seq = 0
        self._prev_hash = GENESIS
        self._started = False
        self._last_cp = 0
        self._cut_recorded = False
        strict = signer is not None and signer.can_check
        ordered = sorted(checkpoints, key=lambda c: c.seq)
        for i, cp in enumerate(ordered):
            verdict = signer.check(cp) if signer is not None else None
            if verdict is False:
                self._fail("bad_signature", cp.seq, f"checkpoint at record {cp.seq} has an invalid signature")
                break
            if verdict is None and strict:
                what = (
                    "unsigned"
                    if cp.algorithm == "none"
                    else f"signed by another key ({cp.algorithm} {cp.key_id})"
                )
                self._fail(
                    "unsigned",
                    cp.seq,
                    f"checkpoint at record {cp.seq} is {what}: with a signing key "
                    f"configured, it cannot vouch for the chain",
                )
                break
            if verdict is True:
                self.report.checkpoints_signed += 1
            else:
                self.report.checkpoints_unchecked += 1
            before = ordered[i - 1] if i else None
            if not self._linked(before, cp):
                break
            self._by_seq[cp.seq] = cp
        self._ordered = ordered
        # A chain whose first checkpoint is of format v1 was started before record 1 stated its cadence.
        self._legacy = bool(ordered) and not ordered[0].prev
        self._first_cp = ordered[0] if ordered else None
        self._newest_cp = ordered[-1] if ordered else None
        self._newest = max(self._by_seq) if self._by_seq else 0

    def _linked(self, before: Checkpoint | None, cp: Checkpoint) -> bool:
        """Checkpoints chain to each other and keep their cadence (v2; a v1 one has no link)."""
        if not cp.prev:
            return True
        if before is None:
            # The first kept checkpoint links to a deleted one only as a retention cut's anchor (checked when
            # the walk finds the chain's first record and its retention_cut record).
            return True
        if cp.prev != before.digest():
            self._fail(
                "deleted",
                before.seq + 1,
                f"checkpoint at record {cp.seq} does not link to the one at "
                f"record {before.seq}: checkpoints between them were removed",
            )
            return False
        if before.every and cp.seq - before.seq >= before.every + MAX_BATCH:
            self._fail(
                "checkpoint_gap",
                before.seq + 1,
                f"no checkpoint between records {before.seq} and {cp.seq} although one is written every "
                f"{before.every} records: checkpoints were removed",
            )
            return False
        return True

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
            first = self._first_cp
            if row.seq == 1 and first is not None and first.prev and first.prev != GENESIS:
                self._fail(
                    "deleted",
                    1,
                    f"the first checkpoint (at record {first.seq}) links to an earlier one that is gone",
                )
                return False
            if row.seq != 1 and self._anchor is not None:
                self._prev_seq, self._prev_hash = self._anchor
            elif row.seq != 1:
                anchor = self._by_seq.get(row.seq - 1)
                if anchor is None or anchor.hash != row.prev_hash or anchor is not first:
                    self._fail(
                        "deleted",
                        1,
                        f"records 1..{row.seq - 1} are missing and no checkpoint anchors "
                        f"a retention cut at record {row.seq - 1}",
                    )
                    return False
                r.anchored_at = self._last_cp = anchor.seq
                self._prev_seq, self._prev_hash = anchor.seq, anchor.hash
        if row.seq != self._prev_seq + 1:
            missing = (
                f"{self._prev_seq + 1}"
                if row.seq == self._prev_seq + 2
                else f"{self._prev_seq + 1}..{row.seq - 1}"
            )
            self._fail("deleted", self._prev_seq + 1, f"record {missing} is missing (deleted)")
            return False
        if link(row.prev_hash, row.data) != row.hash or not self._columns_match(row):
            self._fail(
                "edited", row.seq, f"record {row.seq} was edited: its content no longer matches its hash"
            )
            return False
        if row.prev_hash != self._prev_hash:
            where = await self._lookup(row.prev_hash)
            if where is not None and where != self._prev_seq:
                self._fail(
                    "reordered",
                    row.seq,
                    f"record {row.seq} is out of order: it was written after record {where}",
                )
            else:
                self._fail(
                    "edited",
                    self._prev_seq,
                    f"record {self._prev_seq} was replaced: record {row.seq} links to a different "
                    f"predecessor",
                )
            return False
        cp = self._by_seq.get(row.seq)
        if cp is not None and cp.hash != row.hash:
            since = self._last_cp + 1
            self._fail(
                "edited",
                since,
                f"records {since}..{row.seq} were rewritten: record {row.seq} differs "
                f"from the signed checkpoint at it",
            )
            return False
        seen = self._expect.get(row.seq)
        if seen is not None and seen != row.hash:
            self._fail(
                "witness",
                row.seq,
                f"record {row.seq} differs from the head published for it "
                f"({seen[:16]}...): the chain was rewritten",
            )
            return False
        if row.seq == 1 and self._anchor is None:
            every, problem = read_statement(row.data, self._signer)
            if problem is not None and not (problem.kind == "unanchored" and self._legacy):
                self._fail(problem.kind, problem.seq, problem.message)
                return False
            self._stated = r.stated_every = every
        if row.kind == "gap":
            lost = orjson.loads(row.data).get("payload", {}).get("lost", 0)
            r.gaps.append((row.seq, int(lost)))
        elif row.kind == "retention_cut" and r.anchored_at is not None:
            payload = orjson.loads(row.data).get("payload", {})
            anchor = self._by_seq[r.anchored_at]
            if payload.get("through_seq") == anchor.seq and payload.get("anchor_hash") == anchor.hash:
                self._cut_recorded = True
        if cp is not None:
            r.covered_through = self._last_cp = row.seq
        r.records += 1
        r.head_seq, r.head_hash = row.seq, row.hash
        self._prev_seq, self._prev_hash = row.seq, row.hash
        return self._cadence_kept(row.seq)

    def _cadence_kept(self, seq: int) -> bool:
        """A full walk past the newest checkpoint (or with none) stops as soon as the cadence is broken.

        After any commit the records after the newest checkpoint are fewer than its cadence, and a
        chain with no checkpoint yet is shorter than the cadence its record 1 states (see the module
        docstring): more, and checkpoints were removed. Found here, a forged chain of millions of
        records fails after one cadence's worth of them, not at the end.
        """
        if self._anchor is not None and not self._tail:
            return True  # a range walk does not see the whole chain's checkpoints
        newest = self._newest_cp
        if newest is None:
            if self._stated and seq >= self._stated:
                self._fail(
                    "checkpoint_gap",
                    1,
                    f"records 1..{seq} have no checkpoint although record 1 states one every "
                    f"{self._stated} records: checkpoints were removed",
                )
                return False
            return True
        if newest.every and seq - newest.seq >= newest.every:
            self._fail(
                "checkpoint_gap",
                newest.seq + 1,
                f"records {newest.seq + 1}..{seq} have no checkpoint although one is written every "
                f"{newest.every} records: checkpoints were removed",
            )
            return False
        return True

    @staticmethod
    def _columns_match(row: Row) -> bool:
        try:
            doc = orjson.loads(row.data)
        except orjson.JSONDecodeError:
            return False
        return all(doc.get(c) == getattr(row, c) for c in _COLUMNS)

    def finish(self) -> Report:
        r = self.report
        if self.failed:
            return r
        head = r.head_seq
        if self._newest > r.head_seq:
            self._fail(
                "truncated",
                r.head_seq + 1,
                f"the log ends at record {r.head_seq} but a signed checkpoint covers record "
                f"{self._newest}: records {r.head_seq + 1}..{self._newest} were cut off",
            )
        elif r.anchored_at is not None and not self._cut_recorded:
            self._fail(
                "deleted",
                1,
                f"records 1..{r.anchored_at} are gone and no signed retention_cut record "
                f"says that retention removed them",
            )
        elif (
            (newest := self._newest_cp) is not None
            and newest.every
            and r.first_seq is not None
            and self._anchor is None
            and r.head_seq - newest.seq >= newest.every
        ):
            self._fail(
                "checkpoint_gap",
                newest.seq + 1,
                f"records {newest.seq + 1}..{r.head_seq} have no checkpoint although one is written every "
                f"{newest.every} records: checkpoints were removed",
            )
        elif self._expect and max(self._expect) > head:
            top = max(self._expect)
            self._fail(
                "truncated",
                head + 1,
                f"a head was published for record {top} but the log ends at "
                f"record {head}: records {head + 1}..{top} were cut off",
            )
        elif self._require_covered and r.covered_through < r.head_seq:
            self._fail(
                "uncovered",
                r.covered_through + 1,
                f"records {r.covered_through + 1}..{r.head_seq} are covered by no signed checkpoint",
            )
        return r
