"""Backoff, applier, load tracker and the assignment cache, without gRPC."""

from __future__ import annotations

import random
from ipaddress import ip_address

import pytest

from adaptermesh.agent.applier import Applier
from adaptermesh.agent.load import LoadTracker
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.agent.ports import FlowEvent, ShardStats
from adaptermesh.agent.state import AssignmentStore
from adaptermesh.backoff import Backoff
from adaptermesh.clock import FakeClock

from .fakes import FakeDatapath, FakeXds, make_assignment


def test_backoff_grows_exponentially_to_the_cap_with_jitter_and_resets():
    b = Backoff(initial=0.1, maximum=2.0, multiplier=2.0, jitter=0.5, rng=random.Random(7))
    delays = [b.next() for _ in range(10)]
    ceilings = [min(2.0, 0.1 * 2**i) for i in range(10)]
    for d, c in zip(delays, ceilings, strict=True):
        assert c * 0.5 <= d <= c
    assert max(delays) <= 2.0
    assert delays[-1] >= 1.0  # capped, not collapsed
    b.reset()
    assert b.next() <= 0.1


def test_backoff_rejects_bad_parameters():
    with pytest.raises(ValueError, match="initial"):
        Backoff(initial=0)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=2)


def _applier(tmp_path=None):
    dp, xds, m = FakeDatapath(), FakeXds(), AgentMetrics()
    store = AssignmentStore(tmp_path / "a.pb" if tmp_path else None)
    return Applier(dp, xds, m, store), dp, xds, m


def test_apply_is_stamped_with_the_injected_clock():
    clock = FakeClock(start=1_234.5)
    dp, xds, m = FakeDatapath(), FakeXds(), AgentMetrics()
    applier = Applier(dp, xds, m, AssignmentStore(None), clock=clock)
    assert applier.apply(make_assignment(1)).ok
    assert _metric(m, "adaptermesh_agent_last_apply_timestamp_seconds") == 1_234.5
    clock.step(10)
    assert applier.apply(make_assignment(2)).ok
    assert _metric(m, "adaptermesh_agent_last_apply_timestamp_seconds") == 1_244.5


def _metric(m: AgentMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return m.registry.get_sample_value(name, labels or {})


def test_apply_updates_both_sinks_and_metrics():
    applier, dp, xds, m = _applier()
    result = applier.apply(make_assignment(3))
    assert result.ok
    assert not result.skipped
    assert dp.applied == [3]
    assert xds.published == [3]
    assert applier.applied_version == 3
    assert _metric(m, "adaptermesh_agent_applied_version") == 3
    assert _metric(m, "adaptermesh_agent_applies_total", {"result": "ok"}) == 1
    assert _metric(m, "adaptermesh_agent_shard_weight", {"shard": "a"}) == 5000


def test_older_or_equal_versions_are_skipped():
    applier, dp, xds, _ = _applier()
    applier.apply(make_assignment(5))
    assert applier.apply(make_assignment(5)).skipped
    assert applier.apply(make_assignment(4)).skipped
    assert dp.applied == [5]
    assert xds.published == [5]


def test_bad_assignment_keeps_the_last_good_one_and_names_the_field():
    applier, dp, xds, m = _applier()
    applier.apply(make_assignment(1))
    bad = make_assignment(2, {"a": 5000, "b": 4000})
    result = applier.apply(bad)
    assert not result.ok
    assert "shards.weight" in result.error
    assert "version 2" in result.error
    assert applier.applied_version == 1
    assert dp.current.version == 1
    assert xds.current.version == 1
    assert _metric(m, "adaptermesh_agent_apply_error") == 1
    # The refused version is not retried when the stream replays it...
    assert applier.apply(bad).skipped
    # ...and the next good one clears the error.
    assert applier.apply(make_assignment(3)).ok
    assert applier.last_error == ""
    assert _metric(m, "adaptermesh_agent_apply_error") == 0


def test_xds_refusal_rolls_the_datapath_back():
    applier, dp, xds, _ = _applier()
    applier.apply(make_assignment(1, {"a": 10_000}))
    xds.reject_versions.add(2)
    result = applier.apply(make_assignment(2, {"a": 3000, "b": 7000}))
    assert not result.ok
    assert result.error.startswith("version 2: xds: listeners[0]")
    # The maps took version 2, then got version 1 back: both sinks agree on 1.
    assert dp.applied == [1, 2, 1]
    assert dp.current.version == 1
    assert xds.current.version == 1
    assert applier.applied_version == 1


def test_datapath_error_leaves_xds_untouched():
    applier, dp, xds, _ = _applier()
    applier.apply(make_assignment(1))
    dp.fail_next = True
    result = applier.apply(make_assignment(2))
    assert not result.ok
    assert "EPERM" in result.error
    assert xds.published == [1]


def test_cache_survives_a_restart_and_reconcile_applies_it(tmp_path):
    applier, _, _, _ = _applier(tmp_path)
    applier.apply(make_assignment(9, pins={"10.1.0.0/16": "b"}))
    restarted, dp, xds, _ = _applier(tmp_path)
    result = restarted.reconcile()
    assert result is not None
    assert result.ok
    assert restarted.applied_version == 9
    assert dp.current.pins[0].cidr == "10.1.0.0/16"
    assert xds.published == [9]


def test_corrupt_cache_is_ignored(tmp_path):
    (tmp_path / "a.pb").write_bytes(b"\xff\xff not a proto")
    applier, dp, _, _ = _applier(tmp_path)
    assert applier.reconcile() is None
    assert dp.applied == []


def test_load_tracker_rates_and_active_flows():
    t = LoadTracker(active_window_s=10)
    assert t.update({0: ShardStats(100, 10_000, 5)}, now=0.0)[0].packets_per_s == 0
    for i in range(4):
        t.on_event(FlowEvent(0, ip_address(f"10.0.0.{i}"), 0, "maglev", 1), now=1.0)
    t.on_event(FlowEvent(0, ip_address("10.0.0.9"), 1, "pin", 1), now=1.0)
    t.on_event(FlowEvent(0, ip_address("10.0.0.0"), 1, "repick", 2), now=1.5)  # moved to shard 1
    rates = t.update({0: ShardStats(300, 30_000, 9), 1: ShardStats(50, 500, 2)}, now=2.0)
    assert rates[0].packets_per_s == pytest.approx(100.0)
    assert rates[0].bytes_per_s == pytest.approx(10_000.0)
    assert rates[0].new_flows_per_s == pytest.approx(2.0)
    assert rates[0].active_flows == 3
    assert rates[1].active_flows == 2
    assert t.events_by_reason() == {"maglev": 4, "pin": 1, "repick": 1}
    # Counters that went backwards (maps recreated) give zero, not a negative rate.
    assert t.update({0: ShardStats(10, 10, 0)}, now=3.0)[0].packets_per_s == 0
    # Flows expire from the active count after the window.
    assert t.active_flows(now=20.0) == {}


def test_load_tracker_bounds_its_memory():
    t = LoadTracker(active_window_s=100, max_sources=10)
    for i in range(50):
        t.on_event(FlowEvent(0, ip_address(f"10.0.{i}.1"), 0, "maglev", 1), now=float(i))
    assert sum(t.active_flows(now=50.0).values()) == 10
    assert t.events_total == 50


def test_the_token_file_is_read_again_when_the_kubelet_rotates_it(tmp_path):
    import os

    from adaptermesh.agent.watch import BearerFile, auth_metadata

    path = tmp_path / "token"
    path.write_text("first-token\n")
    token = BearerFile(path, "first-token")
    assert auth_metadata(token) == (("authorization", "Bearer first-token"),)
    # The kubelet writes the new token beside the old one and swaps it in.
    (tmp_path / "token.new").write_text("second-token\n")
    os.replace(tmp_path / "token.new", path)
    assert auth_metadata(token) == (("authorization", "Bearer second-token"),)
    # An empty or vanished file keeps the last token (the next swap brings a new one).
    (tmp_path / "token.new").write_text("")
    os.replace(tmp_path / "token.new", path)
    assert auth_metadata(token) == (("authorization", "Bearer second-token"),)
    path.unlink()
    assert auth_metadata(token) == (("authorization", "Bearer second-token"),)
    assert auth_metadata("static") == (("authorization", "Bearer static"),)
    assert auth_metadata(None) == ()
