"""Durable per-request state of the MQTT bridge, in SQLite.

One row per idempotency key, moving ``accepted -> done`` (with the reply payload) and then
``published``. WAL mode with ``synchronous=FULL``: a call returns only after its transaction is
on disk, so the bridge acknowledges a request to the broker (QoS 1 PUBACK) only once a
``kill -9`` can no longer lose it, and an answer is stored before it is published, so it is
published unchanged however often the bridge restarts.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes version ``i`` to
``i + 1``. Add a migration, never edit a released one.

One connection, shared by the MQTT network thread and the asyncio workers under a lock.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptermesh.bridge.protocol import Request

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "Row", "Store"]

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 0 -> 1
    (
        """CREATE TABLE requests (
            id TEXT PRIMARY KEY,
            digest TEXT NOT NULL,
            reply_to TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            body TEXT NOT NULL,
            correlation TEXT,
            correlation_data BLOB,
            state TEXT NOT NULL CHECK (state IN ('accepted', 'done')),
            answer BLOB,
            published INTEGER NOT NULL DEFAULT 0,
            accepted_at REAL NOT NULL,
            done_at REAL,
            published_at REAL)""",
        "CREATE INDEX requests_pending ON requests (state, published)",
        "CREATE INDEX requests_done_at ON requests (done_at)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

ACCEPTED = "accepted"
DONE = "done"


@dataclass(frozen=True)
class Row:
    request: Request
    digest: str
    state: str
    answer: bytes | None
    published: bool


class Store:
    def __init__(self, path: Path, synchronous: str = "FULL") -> None:
        if synchronous not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous: {synchronous!r} is not NORMAL, FULL or EXTRA")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path}: schema version {version} is newer than this bridge's "
                    f"{SCHEMA_VERSION}"
                )
            for i in range(version, SCHEMA_VERSION):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for statement in MIGRATIONS[i]:
                        self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={i + 1}")
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes (each one transaction, durable when the call returns) --

    def accept(self, req: Request, now: float) -> Row:
        """Insert ``req`` unless its id is known; the row for its id either way."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR IGNORE INTO requests (id, digest, reply_to, endpoint, body,"
                    " correlation, correlation_data, state, accepted_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        req.id,
                        req.digest,
                        req.reply_to,
                        req.endpoint,
                        json.dumps(req.body, ensure_ascii=True),
                        None if req.correlation is None else json.dumps(req.correlation),
                        req.correlation_data,
                        ACCEPTED,
                        now,
                    ),
                )
                row = self._get(req.id)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        assert row is not None
        return row

    def complete(self, req_id: str, answer: bytes, now: float) -> bool:
        """Record the answer; False when the id is unknown or already done (the first answer
        stays: it may have been published)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE requests SET state = ?, answer = ?, done_at = ? WHERE id = ? AND state = ?",
                (DONE, answer, now, req_id, ACCEPTED),
            )
            return cur.rowcount == 1

    def mark_published(self, req_id: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE requests SET published = 1, published_at = ? WHERE id = ? AND state = ?",
                (now, req_id, DONE),
            )

    def prune(self, before: float) -> int:
        """Forget published answers done before ``before``; a redelivery of one of those ids
        is then a new request. Returns how many rows went."""
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM requests WHERE state = ? AND published = 1 AND done_at < ?",
                (DONE, before),
            )
            return cur.rowcount

    # -- reads --

    def get(self, req_id: str) -> Row | None:
        with self._lock:
            return self._get(req_id)

    def unfinished(self) -> list[Row]:
        """Accepted requests without an answer, oldest first (to run again after a restart)."""
        return self._select("state = ? ORDER BY accepted_at, id", (ACCEPTED,))

    def unpublished(self) -> list[Row]:
        """Answers stored but not confirmed published, oldest first."""
        return self._select("state = ? AND published = 0 ORDER BY done_at, id", (DONE,))

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT state, published, count(*) FROM requests GROUP BY state, published"
            ).fetchall()
        out = {"accepted": 0, "done_unpublished": 0, "published": 0}
        for state, published, n in rows:
            key = (
                "accepted"
                if state == ACCEPTED
                else "published"
                if published
                else "done_unpublished"
            )
            out[key] += int(n)
        return out

    _COLUMNS = (
        "id, digest, reply_to, endpoint, body, correlation, correlation_data, state, answer,"
        " published"
    )

    def _get(self, req_id: str) -> Row | None:
        found = self._db.execute(
            f"SELECT {self._COLUMNS} FROM requests WHERE id = ?", (req_id,)
        ).fetchone()
        return None if found is None else _row(found)

    def _select(self, where: str, args: tuple[Any, ...]) -> list[Row]:
        with self._lock:
            found = self._db.execute(
                f"SELECT {self._COLUMNS} FROM requests WHERE {where}", args
            ).fetchall()
        return [_row(r) for r in found]


def _row(r: tuple[Any, ...]) -> Row:
    req_id, digest, reply_to, endpoint, body, correlation, cdata, state, answer, published = r
    req = Request(
        id=req_id,
        reply_to=reply_to,
        endpoint=endpoint,
        body=json.loads(body),
        correlation=None if correlation is None else json.loads(correlation),
        correlation_data=None if cdata is None else bytes(cdata),
    )
    return Row(req, digest, state, None if answer is None else bytes(answer), bool(published))
