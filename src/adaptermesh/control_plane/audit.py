"""The audit of writes: every accepted or refused write to the control plane, with its caller.

A row holds who (the caller's Principal name: ``token:alice``, ``sa:ns/agent@node-a``,
``cert:node-a``), when, the method, the outcome (``OK`` or the gRPC status code) and message,
and the state of the objects the call names before and after it, as JSON (``subjects``:
``shard/<id>``, ``override/<shard>``, ``pin/<cidr>``, ``instance/<name>``, ``rules``,
``rollout/<adapter>``, ``node/<id>``).

Rows live in the control plane's SQLite store (``Store.append_audit``): durable, and bounded to
the newest ``Store.audit_limit`` rows, each field bounded here (``MAX_*``). An accepted write's
row is written right after the write's own transaction commits; a crash between the two loses
that one row, never the write. A failed audit write (a full disk) is logged and counted
(``failures``) and never changes the call's answer.

Which calls: ``auth.AUDITED_METHODS``. ReportLoad only when refused: an accepted report is a
node's periodic load sample, not a change anyone made, and would crowd out the operators'
rows.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from adaptermesh import assignment_rules as rules
from adaptermesh.assignment_rules import RuleError
from adaptermesh.control_plane.auth import AUDITED_METHODS, Denied, current_principal
from adaptermesh.control_plane.store import AuditRow, Store, StoreError
from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2

__all__ = [
    "MAX_CALLER",
    "MAX_MESSAGE",
    "MAX_STATE_BYTES",
    "AuditLog",
    "bounded_json",
    "record_message",
    "subjects",
]

MAX_CALLER = 256
MAX_MESSAGE = 1024
# Each of before/after; a larger state (an Apply of hundreds of shards) keeps its size and
# digest instead.
MAX_STATE_BYTES = 16 * 1024
# Objects named per call (an Apply may name up to MAX_SHARDS of each kind).
MAX_SUBJECTS = 256
# An object's name as recorded (a refused call may name anything).
MAX_NAME = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def bounded_json(state: dict[str, Any]) -> str:
    """``state`` as compact JSON of at most MAX_STATE_BYTES (its digest when larger)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), default=str)
    if len(text.encode()) <= MAX_STATE_BYTES:
        return text
    return json.dumps(
        {
            "truncated": True,
            "bytes": len(text.encode()),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            # 16 names of at most 64 characters (12 bytes each as JSON escapes): < 16 KiB.
            "objects": [_clip(name, 64) for name in sorted(state)[:16]],
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _cidr(text: str) -> str:
    try:
        return rules.normalise_cidr(text, "cidr")
    except RuleError:
        return text


def subjects(method: str, request: Any) -> list[str]:
    """The objects a write names, as ``kind/key`` (the first MAX_SUBJECTS)."""
    out: list[str] = []
    if method == "UpsertShard":
        out += [f"shard/{request.shard.id}", f"override/{request.shard.id}"]
    elif method == "DeleteShard":
        out += [f"shard/{request.id}", f"override/{request.id}"]
    elif method in ("SetOverride", "ClearOverride"):
        out.append(f"override/{request.shard_id}")
    elif method in ("PinTenant", "UnpinTenant"):
        out.append(f"pin/{_cidr(request.cidr)}")
    elif method == "UpsertAdapterInstance":
        out.append(f"instance/{request.instance.name}")
    elif method == "DeleteAdapterInstance":
        out.append(f"instance/{request.name}")
    elif method == "Apply":
        out += [f"shard/{s.id}" for s in request.shards]
        out += [f"instance/{i.name}" for i in request.instances]
        out += [f"pin/{_cidr(p.cidr)}" for p in request.pins]
        out += [f"override/{o.shard_id}" for o in request.overrides]
    elif method == "ApplyRules":
        out.append("rules")
    elif method == "StartRollout":
        out.append(f"rollout/{request.spec.adapter}")
    elif method == "ControlRollout":
        out.append(f"rollout/{request.adapter}")
    elif method == "ReportLoad":
        out.append(f"node/{request.node_id}")
    return list(dict.fromkeys(_clip(name, MAX_NAME) for name in out))[:MAX_SUBJECTS]


def _message(msg: Any) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True)


def _read(store: Store, subject: str) -> Any:
    kind, _, key = subject.partition("/")
    if kind == "shard":
        shard = store.get_shard(key)
        return None if shard is None else _message(shard)
    if kind == "override":
        for sid, weight, reason, expires, _created in store.list_overrides():
            if sid == key:
                return {"weight": weight, "reason": reason, "expires_at": expires}
        return None
    if kind == "pin":
        return dict(store.list_pins()).get(key)
    if kind == "instance":
        for inst in store.list_adapter_instances():
            if inst.name == key:
                found = _message(inst)
                found.pop("updated_at", None)
                return found
        return None
    if kind == "rules":
        live = store.rule_set()
        return None if live is None else {"version": live.version, "reason": live.reason}
    if kind == "rollout":
        rollouts = store.rollouts(key)
        if not rollouts:
            return None
        latest = _message(rollouts[-1])
        latest.pop("events", None)
        return latest
    if kind == "node":
        for node_id, applied, last, error in store.list_nodes():
            if node_id == key:
                return {"applied_version": applied, "last_report": last, "apply_error": error}
        return None
    return None


def record_message(row: AuditRow) -> control_plane_pb2.AuditRecord:
    out = control_plane_pb2.AuditRecord(
        seq=row.seq,
        caller=row.caller,
        method=row.method,
        outcome=row.outcome,
        message=row.message,
        before_json=row.before,
        after_json=row.after,
    )
    out.at.FromNanoseconds(int(row.at * 1e9))
    return out


class AuditLog:
    """Writes audit rows for the servicer's write handlers and for refused calls."""

    def __init__(
        self, store: Store, clock: Callable[[], float], logger: logging.Logger | None = None
    ) -> None:
        self.store = store
        self.clock = clock
        self.log = logger or logging.getLogger("adaptermesh.control_plane.audit")
        self.failures = 0

    def state(self, names: Iterable[str]) -> dict[str, Any]:
        return {name: _read(self.store, name) for name in names}

    def record(
        self,
        caller: str,
        method: str,
        outcome: str,
        message: str = "",
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
    ) -> None:
        row = AuditRow(
            0,
            self.clock(),
            _clip(caller, MAX_CALLER),
            method,
            outcome,
            _clip(message, MAX_MESSAGE),
            bounded_json(before or {}),
            bounded_json(after or {}),
        )
        try:
            self.store.append_audit(row)
        except StoreError as exc:
            self.failures += 1
            self.log.warning("audit row for %s by %s not stored: %s", method, caller, exc)

    def denied(self, method: str, refusal: Denied) -> None:
        """A call refused before its handler ran (no credential, a missing scope)."""
        if method in AUDITED_METHODS:
            self.record(refusal.caller, method, refusal.code.name, refusal.message)

    def wrap(self, method: str, behaviour: Any, streaming: bool) -> Any:
        """``behaviour`` (a servicer method) with an audit row for each call of ``method``."""
        if method not in AUDITED_METHODS or streaming:
            return behaviour

        async def audited(request: Any, context: Any) -> Any:
            names = subjects(method, request)
            before = self.state(names)
            try:
                result = await behaviour(request, context)
            except BaseException as exc:
                code = context.code()
                if isinstance(code, grpc.StatusCode):
                    outcome = code.name
                elif isinstance(exc, asyncio.CancelledError):
                    outcome = "CANCELLED"  # the caller went away mid-call
                else:
                    outcome = "UNKNOWN"
                self.record(
                    current_principal().name,
                    method,
                    outcome,
                    str(context.details() or ""),
                    before,
                    self.state(names),
                )
                raise
            if method != "ReportLoad":
                self.record(current_principal().name, method, "OK", "", before, self.state(names))
            return result

        return audited
