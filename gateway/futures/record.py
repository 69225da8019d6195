"""A future's record and the claim on an idempotency key: the data the future store keeps.

Owns: `fingerprint` (the digest that tells a retry from a different request under one key),
`FutureRecord` (one future: its state, result or error, and its JSON form in the shared KV),
`ReplayJob` (a future's engine call as data, which another replica can run again), `Claim` (the
right to submit the one future of a key; see `FutureStore.claim`) and the 409 a key reused by
another payload answers.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ConflictError


def fingerprint(payload: bytes | str | dict | None) -> str | None:
    """A stable digest of a request payload (dicts are serialised with sorted keys)."""
    if payload is None:
        return None
    if isinstance(payload, dict):
        payload = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    if isinstance(payload, str):
        payload = payload.encode()
    return hashlib.sha256(payload).hexdigest()


@dataclass(frozen=True)
class ReplayJob:
    """A future's engine call as JSON data: which call (``name``) with what (``params``), enough
    for another gateway replica to run it again after the one that accepted it died (takeover).
    gateway/tinker_api/jobs.py builds and runs them; the store only keeps and hands them back."""

    name: str
    params: dict[str, Any]

    def to_json(self) -> list:
        return [self.name, self.params]

    @classmethod
    def from_json(cls, raw: Any) -> ReplayJob | None:
        return None if raw is None else cls(str(raw[0]), dict(raw[1]))


@dataclass
class FutureRecord:
    request_id: str
    user_id: int
    kind: str
    created: float = field(default_factory=time.monotonic)
    submitted_at: float = field(default_factory=time.time)  # wall clock, for session traces
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float | None = None
    json_result: dict[str, Any] | None = None
    proto_result: bytes | None = None
    error: str | None = None
    category: str = "server"
    idem_key: tuple[str, int] | None = None
    fingerprint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    owner: str | None = None
    job: ReplayJob | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "request_id": self.request_id,
                "user_id": self.user_id,
                "kind": self.kind,
                "finished": self.done.is_set(),
                "json_result": self.json_result,
                "proto_result": None
                if self.proto_result is None
                else base64.b64encode(self.proto_result).decode(),
                "error": self.error,
                "category": self.category,
                "idem_key": list(self.idem_key) if self.idem_key else None,
                "fingerprint": self.fingerprint,
                "extra": self.extra,
                "owner": self.owner,
                "job": None if self.job is None else self.job.to_json(),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> FutureRecord:
        d = json.loads(raw)
        rec = cls(
            request_id=d["request_id"],
            user_id=int(d["user_id"]),
            kind=d["kind"],
            json_result=d["json_result"],
            proto_result=None if d["proto_result"] is None else base64.b64decode(d["proto_result"]),
            error=d["error"],
            category=d["category"],
            idem_key=tuple(d["idem_key"]) if d["idem_key"] else None,  # type: ignore[arg-type]
            fingerprint=d["fingerprint"],
            extra=d.get("extra") or {},
            owner=d.get("owner"),
            job=ReplayJob.from_json(d.get("job")),
        )
        if d["finished"]:
            rec.finished_at = time.monotonic()
            rec.done.set()
        return rec


#: the coroutine's return: ("json", dict) or ("proto", bytes)
Result = tuple[str, Any]


@dataclass
class Claim:
    """The right to submit the one future of an idempotency key (see `FutureStore.claim`)."""

    key: tuple[str, int]
    fp: str | None
    #: resolved with the future id on submit, or None when released; same-replica claimants await it
    settled: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def conflict(key: tuple[str, int]) -> ConflictError:
    return ConflictError(
        f"seq_id: {key[1]} of {key[0]} was already used by a different request; "
        "a retry must resend the same request (use the next seq_id for a new one)"
    )
