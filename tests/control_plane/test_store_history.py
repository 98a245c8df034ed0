"""History storage: each distinct pin list once, older rows still readable, pruning."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from adaptermesh.control_plane.store import MIGRATIONS, Store
from adaptermesh.proto import assignment_pb2


def _assignment(version: int, pins: int, weight: int = 10_000) -> assignment_pb2.Assignment:
    a = assignment_pb2.Assignment(version=version, reason=f"v{version}")
    a.shards.add(id="s0", index=0, weight=weight, state=assignment_pb2.SHARD_STATE_ACTIVE)
    for i in range(pins):
        a.pins.add(cidr=f"10.{i // 256}.{i % 256}.0/24", shard_id="s0")
    return a


def test_rows_written_before_pin_sets_still_read_back(tmp_path: Path) -> None:
    path = tmp_path / "cp.sqlite3"
    db = sqlite3.connect(path)
    for version, statements in enumerate(MIGRATIONS[:2]):
        for statement in statements:
            db.execute(statement)
        db.execute(f"PRAGMA user_version={version + 1}")
    old = _assignment(1, 3)
    db.execute(
        "INSERT INTO assignments(version, reason, generated_at, body) VALUES(?,?,?,?)",
        (1, old.reason, 0.0, old.SerializeToString()),
    )
    db.commit()
    db.close()
    store = Store(path, synchronous="NORMAL")
    assert store.latest_assignment() == old
    assert not store.history(5, pins=False)[0].pins
    store.append_assignment(_assignment(2, 3))
    assert [len(a.pins) for a in store.history(5)] == [3, 3]


def test_each_pin_list_is_stored_once_and_pruned_with_its_last_version(tmp_path: Path) -> None:
    store = Store(tmp_path / "cp.sqlite3", synchronous="NORMAL", history_limit=3)
    for v in range(1, 6):
        store.append_assignment(_assignment(v, 1000))  # weights move, pins do not
    count = "SELECT COUNT(*) FROM pin_sets"
    assert store._db.execute(count).fetchone()[0] == 1
    store.append_assignment(_assignment(6, 999))
    for v in range(7, 10):
        store.append_assignment(_assignment(v, 999))
    # Versions 7..9 remain; the 1,000-pin list went with the last version that used it.
    assert [a.version for a in store.history(10)] == [9, 8, 7]
    assert store._db.execute(count).fetchone()[0] == 1
    assert len(store.latest_assignment().pins) == 999  # type: ignore[union-attr]
