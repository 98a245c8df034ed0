"""Routing rules in the control-plane store: compiled on write, versioned, with history; a
bad set is refused naming the rule and the position, and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane.store import Store
from adaptermesh.rules import RuleError, cidr_pins, parse_rule_set

GOLD = {
    "rules": [
        {
            "name": "gold-fin",
            "when": 'request.headers["x-tier"] == "gold" && adapter.startsWith("fin-")',
            "shard": "gold",
        }
    ]
}


def test_apply_versions_and_history(tmp_path: Path) -> None:
    store = Store(tmp_path / "cp.db")
    assert store.rule_set() is None
    first = store.apply_rule_set(GOLD, "gold tier", now=1.0)
    assert first.version == 1
    assert not first.unchanged
    again = store.apply_rule_set(GOLD, "same again", now=2.0)
    assert again.unchanged
    assert again.version == 1
    second = store.apply_rule_set(
        {
            "rules": [
                *GOLD["rules"],
                {"name": "lab", "when": 'inCidr(request.source_ip, "10.8.0.0/16")', "shard": "lab"},
            ]
        },
        "lab pin",
        now=3.0,
    )
    assert second.version == 2
    assert [r.version for r in store.rule_set_history()] == [2, 1]
    assert store.rule_set(1) is not None
    assert store.rule_set(1).document["rules"] == GOLD["rules"]  # type: ignore[union-attr]
    store.close()
    # Durable: a new process sees the same live set.
    reopened = Store(tmp_path / "cp.db")
    live = reopened.rule_set()
    assert live is not None
    assert live.version == 2
    assert live.reason == "lab pin"


def test_bad_rule_refused_with_position_and_state_unchanged(tmp_path: Path) -> None:
    store = Store(tmp_path / "cp.db")
    store.apply_rule_set(GOLD, "gold", now=1.0)
    bad = {
        "rules": [
            *GOLD["rules"],
            {"name": "broken", "when": 'adapter == "a" &&& true', "shard": "x"},
        ]
    }
    with pytest.raises(RuleError) as info:
        store.apply_rule_set(bad, "oops", now=2.0)
    assert info.value.rule == "broken"
    assert (info.value.line, info.value.column) == (1, 18)
    assert [r.version for r in store.rule_set_history()] == [1]


names = st.text("abcdefghij", min_size=1, max_size=6)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(names, st.integers(0, 255), st.sampled_from([8, 16, 24])),
        min_size=1,
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
def test_stored_sets_round_trip_and_pin(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[str, int, int]]
) -> None:
    store = Store(tmp_path_factory.mktemp("cp") / "cp.db")
    doc = {
        "rules": [
            {"name": n, "when": f'inCidr(request.source_ip, "10.{b}.0.0/{ln}")', "shard": f"s-{n}"}
            for n, b, ln in rows
        ]
    }
    record = store.apply_rule_set(doc, "pins", now=1.0)
    live = store.rule_set()
    assert live is not None
    assert live.document == record.document
    assert parse_rule_set(live.document) == parse_rule_set(doc)
    pins = cidr_pins(parse_rule_set(live.document))
    assert {p.shard_id for p in pins} <= {f"s-{n}" for n, _, _ in rows}
    assert pins[0].shard_id == f"s-{rows[0][0]}"


def test_assignments_keep_the_carried_rule_set_once(tmp_path: Path) -> None:
    from adaptermesh.proto import assignment_pb2
    from adaptermesh.rules import routing_rules_message

    store = Store(tmp_path / "cp.db")
    record = store.apply_rule_set(GOLD, "gold tier", now=1.0)
    carried = routing_rules_message(record.version, record.document)
    for version in (1, 2, 3):
        store.append_assignment(assignment_pb2.Assignment(version=version, routing_rules=carried))
    bodies = [bytes(r[0]) for r in store._db.execute("SELECT body FROM assignments")]
    assert all(carried.document_json.encode() not in b for b in bodies)
    latest = store.latest_assignment()
    assert latest is not None
    assert latest.routing_rules == carried  # whole again, digest and all
    store.close()
    reopened = Store(tmp_path / "cp.db")
    assert [a.routing_rules for a in reopened.history(10)] == [carried] * 3
    light = reopened.history(10, pins=False)
    assert all(
        a.routing_rules.digest == carried.digest and not a.routing_rules.document_json
        for a in light
    )


def _numbered(n: int) -> dict[str, object]:
    return {"rules": [{"name": f"r{n}", "when": f'adapter == "a{n}"', "shard": "s"}]}


@settings(max_examples=30, deadline=None)
@given(limit=st.integers(1, 5), applies=st.lists(st.integers(0, 6), max_size=25))
def test_the_store_keeps_the_newest_rule_sets(limit: int, applies: list[int]) -> None:
    """Any sequence of applies (repeats of the live set included): the newest ``limit``
    versions stay, readable by version, the live one always; older ones are gone."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "cp.db", rule_set_history_limit=limit)
        versions: list[tuple[int, int]] = []  # (version, which document)
        for n in applies:
            rec = store.apply_rule_set(_numbered(n), f"apply {n}", now=1.0)
            if not rec.unchanged:
                versions.append((rec.version, n))
        kept = versions[-limit:]
        assert [r.version for r in store.rule_set_history(1000)] == [v for v, _ in reversed(kept)]
        for v, n in kept:
            assert store.rule_set(v).document["rules"] == _numbered(n)["rules"]  # type: ignore[union-attr]
        for v, _ in versions[:-limit]:
            assert store.rule_set(v) is None
        if versions:
            assert store.rule_set().version == versions[-1][0]  # type: ignore[union-attr]
            assert store.live_rule_set_version() == versions[-1][0]
        rows = store._db.execute("SELECT COUNT(*) FROM rule_sets").fetchone()[0]
        assert rows == len(kept)
        store.close()


def test_the_rule_set_limit_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rule_set_history_limit"):
        Store(tmp_path / "cp.db", rule_set_history_limit=0)


def test_the_default_keeps_rule_set_history_limit_versions(tmp_path: Path) -> None:
    from adaptermesh.control_plane.store import RULE_SET_HISTORY_LIMIT

    store = Store(tmp_path / "cp.db", synchronous="OFF")
    for n in range(RULE_SET_HISTORY_LIMIT + 5):
        store.apply_rule_set(_numbered(n), "", now=float(n))
    history = store.rule_set_history(1000)
    assert len(history) == RULE_SET_HISTORY_LIMIT
    assert history[0].version == RULE_SET_HISTORY_LIMIT + 5
    assert store.rule_set(5) is None
    assert store.rule_set(6) is not None


def test_the_set_the_newest_assignment_carries_is_kept(tmp_path: Path) -> None:
    """Sets applied while no shard exists publish nothing: the newest Assignment still carries
    an older set, which agents read whole, so pruning keeps it however many come after."""
    from adaptermesh.proto import assignment_pb2
    from adaptermesh.rules.carried import routing_rules_message

    store = Store(tmp_path / "cp.db", rule_set_history_limit=2)
    first = store.apply_rule_set(_numbered(0), "", now=1.0)
    published = assignment_pb2.Assignment(version=1)
    published.routing_rules.CopyFrom(routing_rules_message(first.version, first.document))
    store.append_assignment(published)
    for n in range(1, 6):
        store.apply_rule_set(_numbered(n), "", now=float(n))
    # The newest two, and the carried one.
    assert [r.version for r in store.rule_set_history(1000)] == [6, 5, 1]
    latest = store.latest_assignment()
    assert latest is not None
    assert json.loads(latest.routing_rules.document_json)["rules"] == _numbered(0)["rules"]
    assert store.rule_set(2) is None
