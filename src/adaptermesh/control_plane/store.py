"""Durable control-plane state in SQLite.

WAL mode with ``synchronous=FULL`` by default: a write is acknowledged only after its
transaction is on disk, so an acknowledged change survives ``kill -9`` and a power cut. Each
API write is one transaction, together with the Assignment it publishes, so the history and
the desired state never disagree.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes version ``i`` to
``i + 1`` inside one transaction. Add a migration, never edit a released one.

Objects are stored as serialised protobuf messages beside the columns that are queried, so
new proto fields need no migration.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2
from adaptermesh.rules import canonical_document, compile_rule_set, parse_rule_set

__all__ = [
    "AUDIT_LIMIT",
    "MIGRATIONS",
    "ROLLOUT_EVENT_LIMIT",
    "ROLLOUT_HISTORY_LIMIT",
    "RULE_SET_HISTORY_LIMIT",
    "SCHEMA_VERSION",
    "AlreadyExistsError",
    "AuditRow",
    "RuleSetRecord",
    "RuleSetSummary",
    "Store",
    "StoreError",
    "StoreWriteError",
    "override_message",
]

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 0 -> 1: the core objects.
    (
        """CREATE TABLE shards (
            id TEXT PRIMARY KEY,
            idx INTEGER NOT NULL UNIQUE,
            spec BLOB NOT NULL,
            updated_at REAL NOT NULL)""",
        # Indices of deleted shards, kept out of reuse for a quarantine so sticky flows that
        # still carry the index in a node's flow table cannot land on a different shard.
        "CREATE TABLE freed_indices (idx INTEGER PRIMARY KEY, freed_at REAL NOT NULL)",
        """CREATE TABLE overrides (
            shard_id TEXT PRIMARY KEY,
            weight INTEGER NOT NULL,
            reason TEXT NOT NULL,
            expires_at REAL,
            created_at REAL NOT NULL)""",
        """CREATE TABLE pins (
            cidr TEXT PRIMARY KEY,
            shard_id TEXT NOT NULL,
            created_at REAL NOT NULL)""",
        """CREATE TABLE assignments (
            version INTEGER PRIMARY KEY,
            reason TEXT NOT NULL,
            generated_at REAL NOT NULL,
            body BLOB NOT NULL)""",
        """CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,
            applied_version INTEGER NOT NULL,
            last_report REAL NOT NULL,
            apply_error TEXT NOT NULL,
            report BLOB NOT NULL)""",
    ),
    # 1 -> 2: declarative AdapterInstance documents.
    (
        """CREATE TABLE adapter_instances (
            name TEXT PRIMARY KEY,
            spec BLOB NOT NULL,
            updated_at REAL NOT NULL)""",
    ),
    # 2 -> 3: an Assignment's pins are stored once per distinct pin list, not once per
    # version (16,384 pins are ~0.5 MB; most versions only move weights). Rows written before
    # keep their pins in the body and a NULL pins_digest.
    (
        """CREATE TABLE pin_sets (
            digest BLOB PRIMARY KEY,
            body BLOB NOT NULL)""",
        "ALTER TABLE assignments ADD COLUMN pins_digest BLOB",
        "CREATE INDEX assignments_pins_digest ON assignments(pins_digest)",
        # Who created each node row (a digest of the reporting token), to bound them per token.
        "ALTER TABLE nodes ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    ),
    # Routing rules (adaptermesh.rules): every applied set is a new version, kept as history;
    # the newest row is the live set. The document is the set's canonical JSON form.
    (
        """CREATE TABLE rule_sets (
            version INTEGER PRIMARY KEY AUTOINCREMENT,
            document TEXT NOT NULL,
            digest BLOB NOT NULL,
            reason TEXT NOT NULL,
            created_at REAL NOT NULL)""",
    ),
    # Gray releases per adapter version (control_plane/rollout.py): one row per rollout (the
    # Rollout message, events left out) and its events in order. The newest rollout of an
    # adapter decides how the adapter's versions split.
    (
        """CREATE TABLE rollouts (
            id TEXT PRIMARY KEY,
            adapter TEXT NOT NULL,
            seq INTEGER NOT NULL UNIQUE,
            body BLOB NOT NULL)""",
        "CREATE INDEX rollouts_adapter ON rollouts(adapter, seq)",
        """CREATE TABLE rollout_events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            rollout_id TEXT NOT NULL REFERENCES rollouts(id),
            body BLOB NOT NULL)""",
    ),
    # A rollout's events are read and pruned by rollout (ROLLOUT_EVENT_LIMIT).
    ("CREATE INDEX rollout_events_rollout ON rollout_events(rollout_id, seq)",),
    # The audit of writes (control_plane/audit.py): who, when, which method, the state of the
    # objects it names before and after (JSON), and the outcome. The newest AUDIT_LIMIT rows.
    (
        """CREATE TABLE audit (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            caller TEXT NOT NULL,
            method TEXT NOT NULL,
            outcome TEXT NOT NULL,
            message TEXT NOT NULL,
            before TEXT NOT NULL,
            after TEXT NOT NULL)""",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

# Rollouts kept per adapter, with their events: the newest ones (the newest decides the
# adapter's split and is never dropped). An older one goes when a new one starts.
ROLLOUT_HISTORY_LIMIT = 100
# Events kept per rollout: its first (the start) and the newest others. Steps, pauses and
# resumes each add one, so an operator pausing and resuming in a loop would grow it without end.
ROLLOUT_EVENT_LIMIT = 256
# Routing-rule versions kept: the newest ones (the newest is the live set). A set is up to
# MAX_RULES rules of MAX_WHEN_CHARS each (a few MB), one version per apply that changes it.
RULE_SET_HISTORY_LIMIT = 256
# Audit rows kept: the newest ones. Each is at most a few tens of KB (audit.py bounds its
# fields), so the table stays within a few hundred MB even under a write loop.
AUDIT_LIMIT = 10_000


@dataclass(frozen=True)
class AuditRow:
    """One audited write (control_plane/audit.py gives the fields their meaning)."""

    seq: int
    at: float
    caller: str
    method: str
    outcome: str  # "OK" or the gRPC status code's name
    message: str
    before: str  # JSON
    after: str  # JSON


@dataclass(frozen=True)
class RuleSetSummary:
    """A stored rule-set version without its document (a listing)."""

    version: int
    reason: str
    created_at: float
    rules: int  # how many rules the set holds


@dataclass(frozen=True)
class RuleSetRecord:
    version: int
    document: dict[str, Any]
    reason: str
    created_at: float
    # True when the set equals the one before it (an apply that changed nothing).
    unchanged: bool = False


class StoreError(Exception):
    pass


class AlreadyExistsError(StoreError):
    pass


class StoreWriteError(StoreError):
    """A write the database could not make (its transaction is rolled back: nothing of it is
    stored, nothing acknowledged before it is lost). ``full``: the disk (or the database's
    size limit) is full, so the write may succeed once space returns; otherwise an I/O error
    of the disk under the state directory."""

    def __init__(self, message: str, *, full: bool) -> None:
        super().__init__(message)
        self.full = full


# SQLite's primary result codes for a full disk and a failed read or write of the files.
_SQLITE_FULL = 13
_SQLITE_IOERR = 10


def _write_error(exc: sqlite3.Error, path: Path) -> StoreWriteError | None:
    """The StoreWriteError for a full disk or an I/O error; None for any other error."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(exc)
    if primary == _SQLITE_FULL or "disk is full" in text:
        return StoreWriteError(
            f"the control plane's state store is out of space ({text}; {path}): the write "
            "was not applied and nothing stored before it is lost; free space and retry",
            full=True,
        )
    if primary == _SQLITE_IOERR or "disk I/O error" in text:
        return StoreWriteError(
            f"the control plane's state store could not write ({text}; {path}): the write "
            "was not applied; retry later",
            full=False,
        )
    return None


class Store:
    """One SQLite database; every method runs on the caller's thread.

    The control plane calls it from its event loop only, so a lock is enough to keep the
    ``transaction()`` nesting straight if a test touches it from another thread.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "FULL",
        index_quarantine_s: float = 300.0,
        history_limit: int = 10_000,
        rollout_history_limit: int = ROLLOUT_HISTORY_LIMIT,
        rollout_event_limit: int = ROLLOUT_EVENT_LIMIT,
        rule_set_history_limit: int = RULE_SET_HISTORY_LIMIT,
        audit_limit: int = AUDIT_LIMIT,
    ) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, not {synchronous}")
        self.path = Path(path)
        self.index_quarantine_s = index_quarantine_s
        self.history_limit = history_limit
        if rollout_history_limit < 1:
            raise ValueError(f"rollout_history_limit must be >= 1, not {rollout_history_limit}")
        self.rollout_history_limit = rollout_history_limit
        if rollout_event_limit < 2:
            raise ValueError(f"rollout_event_limit must be >= 2, not {rollout_event_limit}")
        self.rollout_event_limit = rollout_event_limit
        if rule_set_history_limit < 1:
            raise ValueError(f"rule_set_history_limit must be >= 1, not {rule_set_history_limit}")
        self.rule_set_history_limit = rule_set_history_limit
        if audit_limit < 1:
            raise ValueError(f"audit_limit must be >= 1, not {audit_limit}")
        self.audit_limit = audit_limit
        self._lock = threading.RLock()
        self._depth = 0
        # Bumped by every write to shards or adapter instances made through this object (and
        # by every rollback, which may undo one): readers that cache a layout derived from
        # them compare ``layout_key()`` instead of re-reading 1,000 shard specs every tick.
        self._layout_generation = 0
        # Autocommit mode: transactions are explicit BEGIN IMMEDIATE ... COMMIT.
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        self.migrate()

    # -- plumbing --------------------------------------------------------------------------

    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        row = self._db.execute("PRAGMA user_version").fetchone()
        return int(row[0])

    @property
    def journal_mode(self) -> str:
        return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def migrate(self) -> int:
        """Bring the schema to SCHEMA_VERSION; returns the number of migrations applied."""
        current = self.schema_version
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"database schema {current} is newer than this release ({SCHEMA_VERSION})"
            )
        applied = 0
        for version in range(current, SCHEMA_VERSION):
            with self.transaction():
                for statement in MIGRATIONS[version]:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={version + 1}")
            applied += 1
        return applied

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic write; nested uses join the outer transaction."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                self._raise_write_error(exc)
                raise
            self._depth = 1
            try:
                yield
            except BaseException as exc:
                self._depth = 0
                self._layout_generation += 1
                self._rollback()
                if isinstance(exc, sqlite3.Error):
                    self._raise_write_error(exc)
                raise
            self._depth = 0
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                # Not on disk, so not acknowledged: undo it whole (SQLite may have already).
                self._layout_generation += 1
                self._rollback()
                self._raise_write_error(exc)
                raise

    def _rollback(self) -> None:
        if self._db.in_transaction:
            with suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _raise_write_error(self, exc: sqlite3.Error) -> None:
        error = _write_error(exc, self.path)
        if error is not None:
            raise error from exc

    def layout_key(self) -> tuple[int, int]:
        """Changes whenever the shard specs or adapter instances may have changed.

        The first part counts this object's own writes; the second is SQLite's
        ``data_version``, which moves when another connection commits.
        """
        row = self._db.execute("PRAGMA data_version").fetchone()
        return self._layout_generation, int(row[0])

    # -- shards ----------------------------------------------------------------------------

    def list_shards(self) -> list[assignment_pb2.Shard]:
        rows = self._db.execute("SELECT spec FROM shards ORDER BY id").fetchall()
        return [assignment_pb2.Shard.FromString(r[0]) for r in rows]

    def get_shard(self, shard_id: str) -> assignment_pb2.Shard | None:
        row = self._db.execute("SELECT spec FROM shards WHERE id=?", (shard_id,)).fetchone()
        return assignment_pb2.Shard.FromString(row[0]) if row else None

    def upsert_shard(self, shard: assignment_pb2.Shard, now: float) -> assignment_pb2.Shard:
        """Store the shard; a new one gets the smallest free index, an existing one keeps its."""
        self._layout_generation += 1
        with self.transaction():
            row = self._db.execute("SELECT idx FROM shards WHERE id=?", (shard.id,)).fetchone()
            stored = assignment_pb2.Shard()
            stored.CopyFrom(shard)
            stored.index = int(row[0]) if row else self._allocate_index(now)
            self._db.execute(
                "INSERT INTO shards(id, idx, spec, updated_at) VALUES(?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET spec=excluded.spec, updated_at=excluded.updated_at",
                (stored.id, stored.index, stored.SerializeToString(), now),
            )
            self._db.execute("DELETE FROM freed_indices WHERE idx=?", (stored.index,))
        return stored

    def _allocate_index(self, now: float) -> int:
        used = {r[0] for r in self._db.execute("SELECT idx FROM shards")}
        held = {
            r[0]
            for r in self._db.execute(
                "SELECT idx FROM freed_indices WHERE freed_at > ?", (now - self.index_quarantine_s,)
            )
        }
        idx = 0
        while idx in used or idx in held:
            idx += 1
        return idx

    def delete_shard(self, shard_id: str, now: float) -> bool:
        self._layout_generation += 1
        with self.transaction():
            row = self._db.execute("SELECT idx FROM shards WHERE id=?", (shard_id,)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM shards WHERE id=?", (shard_id,))
            self._db.execute("DELETE FROM overrides WHERE shard_id=?", (shard_id,))
            self._db.execute(
                "INSERT OR REPLACE INTO freed_indices(idx, freed_at) VALUES(?,?)", (row[0], now)
            )
        return True

    # -- overrides -------------------------------------------------------------------------

    def set_override(
        self, shard_id: str, weight: int, reason: str, expires_at: float | None, now: float
    ) -> None:
        with self.transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO overrides(shard_id, weight, reason, expires_at, created_at)"
                " VALUES(?,?,?,?,?)",
                (shard_id, weight, reason, expires_at, now),
            )

    def clear_override(self, shard_id: str) -> bool:
        with self.transaction():
            cur = self._db.execute("DELETE FROM overrides WHERE shard_id=?", (shard_id,))
        return cur.rowcount > 0

    def list_overrides(self) -> list[tuple[str, int, str, float | None, float]]:
        """(shard_id, weight, reason, expires_at, created_at) rows."""
        rows = self._db.execute(
            "SELECT shard_id, weight, reason, expires_at, created_at FROM overrides ORDER BY shard_id"
        ).fetchall()
        return [(str(a), int(b), str(c), d, float(e)) for a, b, c, d, e in rows]

    def live_overrides(self, now: float) -> list[assignment_pb2.Override]:
        """The overrides in force at ``now`` (expired ones wait for the next tick's delete),
        as the Assignment and ListOverrides carry them."""
        return [
            override_message(sid, weight, reason, created_at, expires_at)
            for sid, weight, reason, expires_at, created_at in self.list_overrides()
            if expires_at is None or expires_at > now
        ]

    def delete_expired_overrides(self, now: float) -> list[str]:
        with self.transaction():
            rows = self._db.execute(
                "SELECT shard_id FROM overrides WHERE expires_at IS NOT NULL AND expires_at <= ?",
                (now,),
            ).fetchall()
            self._db.execute(
                "DELETE FROM overrides WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            )
        return [str(r[0]) for r in rows]

    # -- pins ------------------------------------------------------------------------------

    def add_pin(self, cidr: str, shard_id: str, now: float) -> None:
        with self.transaction():
            if self._db.execute("SELECT 1 FROM pins WHERE cidr=?", (cidr,)).fetchone():
                raise AlreadyExistsError(cidr)
            self._db.execute(
                "INSERT INTO pins(cidr, shard_id, created_at) VALUES(?,?,?)", (cidr, shard_id, now)
            )

    def remove_pin(self, cidr: str) -> bool:
        with self.transaction():
            cur = self._db.execute("DELETE FROM pins WHERE cidr=?", (cidr,))
        return cur.rowcount > 0

    def list_pins(self) -> list[tuple[str, str]]:
        rows = self._db.execute("SELECT cidr, shard_id FROM pins ORDER BY cidr").fetchall()
        return [(str(a), str(b)) for a, b in rows]

    def pins_for_shard(self, shard_id: str) -> list[str]:
        rows = self._db.execute("SELECT cidr FROM pins WHERE shard_id=?", (shard_id,)).fetchall()
        return [str(r[0]) for r in rows]

    # -- adapter instances -----------------------------------------------------------------

    def upsert_adapter_instance(
        self, instance: control_plane_pb2.AdapterInstance, now: float
    ) -> None:
        self._layout_generation += 1
        with self.transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO adapter_instances(name, spec, updated_at) VALUES(?,?,?)",
                (instance.name, instance.SerializeToString(), now),
            )

    def delete_adapter_instance(self, name: str) -> bool:
        self._layout_generation += 1
        with self.transaction():
            cur = self._db.execute("DELETE FROM adapter_instances WHERE name=?", (name,))
        return cur.rowcount > 0

    def list_adapter_instances(self) -> list[control_plane_pb2.AdapterInstance]:
        rows = self._db.execute("SELECT spec FROM adapter_instances ORDER BY name").fetchall()
        return [control_plane_pb2.AdapterInstance.FromString(r[0]) for r in rows]

    # -- assignments -----------------------------------------------------------------------

    # -- routing rules -----------------------------------------------------------------------

    def apply_rule_set(self, document: Any, reason: str, now: float) -> RuleSetRecord:
        """Compile and store a rule set as a new version; RuleError (naming the rule and the
        position) before anything is written. Applying the live set again adds no version."""
        rule_set = parse_rule_set(document)
        compile_rule_set(rule_set)
        canonical = canonical_document(rule_set)
        digest = hashlib.sha256(canonical.encode()).digest()
        with self.transaction():
            row = self._db.execute(
                "SELECT version, digest, reason, created_at FROM rule_sets "
                "ORDER BY version DESC LIMIT 1"
            ).fetchone()
            if row is not None and bytes(row[1]) == digest:
                return RuleSetRecord(
                    int(row[0]), json.loads(canonical), str(row[2]), float(row[3]), unchanged=True
                )
            cur = self._db.execute(
                "INSERT INTO rule_sets (document, digest, reason, created_at) VALUES (?,?,?,?)",
                (canonical, digest, reason, now),
            )
            version = int(cur.lastrowid or 0)
            # Versions count up by one (AUTOINCREMENT, deletes only from below), so this keeps
            # the newest rule_set_history_limit, and the set the newest Assignment carries
            # (sets applied while no shard exists publish nothing), which agents read whole.
            # An older Assignment record that carried a dropped set keeps its version and
            # digest; its document reads as empty.
            if version > self.rule_set_history_limit:
                self._db.execute(
                    "DELETE FROM rule_sets WHERE version <= ? AND version != ?",
                    (version - self.rule_set_history_limit, self._carried_rule_set_version()),
                )
        return RuleSetRecord(version, json.loads(canonical), reason, now)

    def _carried_rule_set_version(self) -> int:
        """The rule-set version the newest Assignment carries; 0 when none."""
        row = self._db.execute(
            "SELECT body FROM assignments ORDER BY version DESC LIMIT 1"
        ).fetchone()
        if row is None:
            return 0
        latest = assignment_pb2.Assignment.FromString(row[0])
        return int(latest.routing_rules.version) if latest.HasField("routing_rules") else 0

    def live_rule_set_version(self) -> int:
        """The live (newest) rule set's version; 0 when none was ever applied."""
        row = self._db.execute("SELECT MAX(version) FROM rule_sets").fetchone()
        return int(row[0] or 0)

    def rule_set(self, version: int | None = None) -> RuleSetRecord | None:
        """The live rule set (the newest version), or the given version; None if none."""
        if version is None:
            row = self._db.execute(
                "SELECT version, document, reason, created_at FROM rule_sets "
                "ORDER BY version DESC LIMIT 1"
            ).fetchone()
        else:
            row = self._db.execute(
                "SELECT version, document, reason, created_at FROM rule_sets WHERE version = ?",
                (version,),
            ).fetchone()
        if row is None:
            return None
        return RuleSetRecord(int(row[0]), json.loads(row[1]), str(row[2]), float(row[3]))

    def rule_set_history(self, limit: int = 100) -> list[RuleSetSummary]:
        """Versions newest first, without their documents (SQLite counts the rules: no set of
        a few MB is read into Python for a listing)."""
        rows = self._db.execute(
            "SELECT version, reason, created_at, json_array_length(document, '$.rules') "
            "FROM rule_sets ORDER BY version DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [RuleSetSummary(int(r[0]), str(r[1]), float(r[2]), int(r[3] or 0)) for r in rows]

    # -- rollouts ------------------------------------------------------------------------------

    def put_rollout(
        self,
        rollout: control_plane_pb2.Rollout,
        event: control_plane_pb2.RolloutEvent | None = None,
    ) -> None:
        """Create or update a rollout (its ``events`` field is not stored here) and append
        ``event`` to its history, in one transaction."""
        body = control_plane_pb2.Rollout()
        body.CopyFrom(rollout)
        del body.events[:]
        with self.transaction():
            row = self._db.execute(
                "SELECT seq FROM rollouts WHERE id = ?", (rollout.id,)
            ).fetchone()
            if row is None:
                seq = int(
                    self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM rollouts").fetchone()[0]
                )
                self._db.execute(
                    "INSERT INTO rollouts (id, adapter, seq, body) VALUES (?,?,?,?)",
                    (rollout.id, rollout.spec.adapter, seq, body.SerializeToString()),
                )
                self._prune_rollouts(rollout.spec.adapter)
            else:
                self._db.execute(
                    "UPDATE rollouts SET body = ? WHERE id = ?",
                    (body.SerializeToString(), rollout.id),
                )
            if event is not None:
                self._db.execute(
                    "INSERT INTO rollout_events (rollout_id, body) VALUES (?,?)",
                    (rollout.id, event.SerializeToString()),
                )
                self._prune_events(rollout.id)

    def _prune_events(self, rollout_id: str) -> None:
        """Keep the rollout's first event (its start) and its newest
        ``rollout_event_limit - 1``."""
        self._db.execute(
            "DELETE FROM rollout_events WHERE rollout_id = ?"
            " AND seq > (SELECT MIN(seq) FROM rollout_events WHERE rollout_id = ?)"
            " AND seq < (SELECT seq FROM rollout_events WHERE rollout_id = ?"
            " ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (rollout_id, rollout_id, rollout_id, self.rollout_event_limit - 2),
        )

    def _prune_rollouts(self, adapter: str) -> None:
        """Keep the adapter's newest ``rollout_history_limit`` rollouts and their events."""
        oldest_kept = (
            "SELECT seq FROM rollouts WHERE adapter = ? ORDER BY seq DESC LIMIT 1 OFFSET ?"
        )
        args = (adapter, adapter, self.rollout_history_limit - 1)
        self._db.execute(
            "DELETE FROM rollout_events WHERE rollout_id IN (SELECT id FROM rollouts"
            f" WHERE adapter = ? AND seq < ({oldest_kept}))",
            args,
        )
        self._db.execute(f"DELETE FROM rollouts WHERE adapter = ? AND seq < ({oldest_kept})", args)

    def rollouts(
        self, adapter: str | None = None, *, latest_only: bool = True, events: bool = False
    ) -> list[control_plane_pb2.Rollout]:
        """Rollouts oldest first; ``latest_only``: each adapter's newest one only."""
        where = "WHERE adapter = ?" if adapter is not None else ""
        args: tuple[str, ...] = (adapter,) if adapter is not None else ()
        if latest_only:
            sql = (
                f"SELECT body FROM rollouts WHERE seq IN (SELECT MAX(seq) FROM rollouts "
                f"{where} GROUP BY adapter) ORDER BY seq"
            )
        else:
            sql = f"SELECT body FROM rollouts {where} ORDER BY seq"
        out = [
            control_plane_pb2.Rollout.FromString(r[0])
            for r in self._db.execute(sql, args).fetchall()
        ]
        if events:
            for rollout in out:
                rows = self._db.execute(
                    "SELECT body FROM rollout_events WHERE rollout_id = ? ORDER BY seq",
                    (rollout.id,),
                ).fetchall()
                rollout.events.extend(control_plane_pb2.RolloutEvent.FromString(r[0]) for r in rows)
        return out

    def last_version(self) -> int:
        row = self._db.execute("SELECT MAX(version) FROM assignments").fetchone()
        return int(row[0] or 0)

    def append_assignment(self, assignment: assignment_pb2.Assignment) -> None:
        """Record a published Assignment; its version must exceed every earlier one."""
        with self.transaction():
            last = self.last_version()
            if assignment.version <= last:
                raise StoreError(f"version {assignment.version} is not above {last}")
            body = assignment_pb2.Assignment()
            body.CopyFrom(assignment)
            del body.pins[:]
            # The carried rule set is kept once, in rule_sets: each record keeps its version
            # and digest only (up to 2 MiB per Assignment otherwise, on every publish).
            # (Guarded: touching an absent submessage would make it present, and the record
            # would no longer equal the Assignment served.)
            if body.HasField("routing_rules"):
                body.routing_rules.ClearField("document_json")
            pins = assignment_pb2.Assignment(pins=assignment.pins).SerializeToString()
            digest = hashlib.sha256(pins).digest()
            self._db.execute(
                "INSERT OR IGNORE INTO pin_sets(digest, body) VALUES(?,?)", (digest, pins)
            )
            self._db.execute(
                "INSERT INTO assignments(version, reason, generated_at, body, pins_digest)"
                " VALUES(?,?,?,?,?)",
                (
                    assignment.version,
                    assignment.reason,
                    assignment.generated_at.ToNanoseconds() / 1e9,
                    body.SerializeToString(),
                    digest,
                ),
            )
            # Keep the newest history_limit records; the newest always stays, so the version
            # sequence survives pruning.
            cur = self._db.execute(
                "DELETE FROM assignments WHERE version <= ?",
                (assignment.version - self.history_limit,),
            )
            if cur.rowcount:
                self._db.execute(
                    "DELETE FROM pin_sets WHERE digest NOT IN"
                    " (SELECT pins_digest FROM assignments WHERE pins_digest IS NOT NULL)"
                )

    def _assignment(
        self, body: bytes, digest: bytes | None, pins: bool = True
    ) -> assignment_pb2.Assignment:
        out = assignment_pb2.Assignment.FromString(body)
        if digest is not None and pins:
            row = self._db.execute("SELECT body FROM pin_sets WHERE digest=?", (digest,)).fetchone()
            out.MergeFromString(row[0])
        elif not pins:
            del out.pins[:]
        if not out.HasField("routing_rules"):  # (reading an absent one would add it)
            return out
        carried = out.routing_rules
        if pins and carried.version and not carried.document_json:
            row = self._db.execute(
                "SELECT document FROM rule_sets WHERE version = ?", (carried.version,)
            ).fetchone()
            if row is not None:
                carried.document_json = str(row[0])
        elif not pins:
            # Like the pins: a history page leaves the (large) document out, keeping its
            # version and digest.
            carried.ClearField("document_json")
        return out

    def latest_assignment(self) -> assignment_pb2.Assignment | None:
        row = self._db.execute(
            "SELECT body, pins_digest FROM assignments ORDER BY version DESC LIMIT 1"
        ).fetchone()
        return self._assignment(row[0], row[1]) if row else None

    def history(
        self, limit: int, before_version: int = 0, *, pins: bool = True
    ) -> list[assignment_pb2.Assignment]:
        """Newest first; ``pins=False`` leaves every record's pins out."""
        if before_version:
            rows = self._db.execute(
                "SELECT body, pins_digest FROM assignments WHERE version < ?"
                " ORDER BY version DESC LIMIT ?",
                (before_version, limit),
            ).fetchall()
        else:
            rows = self._db.execute(
                "SELECT body, pins_digest FROM assignments ORDER BY version DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [self._assignment(body, digest, pins) for body, digest in rows]

    # -- nodes -----------------------------------------------------------------------------

    def record_report(
        self, report: control_plane_pb2.LoadReport, now: float, owner: str = ""
    ) -> None:
        """Upsert the node's row; ``owner`` is recorded when the row is created."""
        with self.transaction():
            self._db.execute(
                "INSERT INTO nodes(node_id, applied_version, last_report, apply_error, report,"
                " owner) VALUES(?,?,?,?,?,?) ON CONFLICT(node_id) DO UPDATE SET"
                " applied_version=excluded.applied_version, last_report=excluded.last_report,"
                " apply_error=excluded.apply_error, report=excluded.report",
                (
                    report.node_id,
                    report.applied_version,
                    now,
                    report.apply_error,
                    report.SerializeToString(),
                    owner,
                ),
            )

    def expire_nodes(self, before: float) -> int:
        """Drop the rows of nodes last reported before ``before``; how many went."""
        with self.transaction():
            cursor = self._db.execute("DELETE FROM nodes WHERE last_report < ?", (before,))
        return int(cursor.rowcount)

    def has_node(self, node_id: str) -> bool:
        row = self._db.execute("SELECT 1 FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return row is not None

    def count_nodes(self, owner: str | None = None) -> int:
        """All node rows, or those ``owner`` created."""
        if owner is None:
            return int(self._db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0])
        row = self._db.execute("SELECT COUNT(*) FROM nodes WHERE owner=?", (owner,)).fetchone()
        return int(row[0])

    def list_nodes(self) -> list[tuple[str, int, float, str]]:
        rows = self._db.execute(
            "SELECT node_id, applied_version, last_report, apply_error FROM nodes ORDER BY node_id"
        ).fetchall()
        return [(str(a), int(b), float(c), str(d)) for a, b, c, d in rows]

    # -- audit -----------------------------------------------------------------------------

    def append_audit(self, row: AuditRow) -> int:
        """Store the row (its ``seq`` is ignored) and drop all but the newest ``audit_limit``;
        returns the row's sequence number."""
        with self.transaction():
            cur = self._db.execute(
                "INSERT INTO audit (at, caller, method, outcome, message, before, after)"
                " VALUES (?,?,?,?,?,?,?)",
                (row.at, row.caller, row.method, row.outcome, row.message, row.before, row.after),
            )
            seq = int(cur.lastrowid or 0)
            # Sequence numbers count up by one and rows go only from below.
            self._db.execute("DELETE FROM audit WHERE seq <= ?", (seq - self.audit_limit,))
        return seq

    def audit(self, limit: int, before_seq: int = 0) -> list[AuditRow]:
        """Newest first; ``before_seq``: only rows strictly below it (paging backwards)."""
        where, args = ("WHERE seq < ?", (before_seq, limit)) if before_seq else ("", (limit,))
        rows = self._db.execute(
            "SELECT seq, at, caller, method, outcome, message, before, after FROM audit"
            f" {where} ORDER BY seq DESC LIMIT ?",
            args,
        ).fetchall()
        return [AuditRow(int(r[0]), float(r[1]), *(str(v) for v in r[2:])) for r in rows]

    def audit_count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM audit").fetchone()[0])


def override_message(
    shard_id: str, weight: int, reason: str, created_at: float, expires_at: float | None
) -> assignment_pb2.Override:
    """An override row as its message: the one conversion, for the API and the Assignment."""
    o = assignment_pb2.Override(shard_id=shard_id, weight=weight, reason=reason)
    o.created_at.FromNanoseconds(int(created_at * 1e9))
    if expires_at is not None:
        o.expires_at.FromNanoseconds(int(expires_at * 1e9))
    return o
