"""The xDS side of the agent over the real snapshot cache (no Envoy, no server)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from adaptermesh.agent.backends import NODE_KEY, MeshXds
from adaptermesh.mesh.cache import SnapshotCache
from adaptermesh.mesh.metrics import XdsMetrics
from adaptermesh.mesh.snapshot import LISTENER_TYPE

from .fakes import make_assignment


def _cache() -> SnapshotCache:
    return SnapshotCache(metrics=XdsMetrics(registry=CollectorRegistry()))


def _listeners(cache: SnapshotCache, key: str) -> list[str]:
    snap = cache.get_snapshot(key)
    assert snap is not None
    return sorted(snap.resources[LISTENER_TYPE])


def test_one_snapshot_per_shard_and_a_shared_vip_is_fine():
    xds = MeshXds(_cache(), None, "shard")
    a = make_assignment(1, {"a": 5000, "b": 5000})
    for shard in a.shards:  # every shard's Envoy listens on the same VIP, on its own node
        shard.service_address, shard.service_port = "10.0.0.100", 8080
    xds.publish(a)
    assert xds.cache.keys() == ["shard-a", "shard-b"]
    assert _listeners(xds.cache, "shard-a") == ["shard-a"]
    assert _listeners(xds.cache, "shard-b") == ["shard-b"]


def test_node_group_gets_every_shard():
    xds = MeshXds(_cache(), None, "node")
    xds.publish(make_assignment(1, {"a": 3000, "b": 3000, "c": 4000}))
    assert _listeners(xds.cache, NODE_KEY) == ["shard-a", "shard-b", "shard-c"]


def test_a_removed_shard_gets_an_empty_snapshot():
    xds = MeshXds(_cache(), None, "shard")
    xds.publish(make_assignment(1, {"a": 5000, "b": 5000}))
    xds.publish(make_assignment(2, {"a": 10_000}))
    assert _listeners(xds.cache, "shard-a") == ["shard-a"]
    assert xds.cache.get_snapshot("shard-b").resources[LISTENER_TYPE] == {}


def test_refused_assignment_leaves_every_key_on_its_last_good_snapshot():
    xds = MeshXds(_cache(), None, "shard")
    xds.publish(make_assignment(1, {"a": 5000, "b": 5000}))
    bad = make_assignment(2, {"a": 5000, "b": 5000})
    bad.shards[1].endpoints[0].port = 0  # only shard b is broken
    with pytest.raises(ValueError, match=r"shard-b: .*endpoints\[0\]\.port"):
        xds.publish(bad)
    assert xds.cache.get_snapshot("shard-a").version == "1"
    assert xds.cache.get_snapshot("shard-b").version == "1"


def test_unknown_group_is_refused():
    with pytest.raises(ValueError, match="xds_group"):
        MeshXds(_cache(), None, "cluster")


def test_table_datapath_over_the_classifier_fake_reports_what_traffic_did():
    """The agent's view of ``adaptermesh.bpf``'s FakeShardTable: stats, events, counters."""
    from adaptermesh.agent.backends import TableDatapath
    from adaptermesh.agent.load import LoadTracker
    from adaptermesh.bpf.table import FakeShardTable

    table = FakeShardTable(maglev_size=251)
    dp = TableDatapath(table)
    dp.apply(make_assignment(1, {"a": 5000, "b": 5000}, pins={"10.9.0.0/24": "b"}))
    for i in range(40):
        table.classify(f"10.8.0.{i}", size=100)
    for i in range(5):
        table.classify(f"10.9.0.{i}", size=100)
        table.classify(f"10.9.0.{i}", size=100)  # second packet: sticky, no new event
    tracker = LoadTracker()
    tracker.update(dp.read_stats(), now=0.0)
    events = []
    assert dp.poll_events(events.append, 0) == 45
    for e in events:
        tracker.on_event(e, now=0.5)
    assert {e.reason for e in events} == {"maglev", "pin"}
    assert all(e.shard == 1 for e in events if str(e.source).startswith("10.9.0."))
    stats = dp.read_stats()
    assert stats[0].packets + stats[1].packets == 50
    assert stats[1].packets >= 10  # the pinned tenant's ten packets at least
    rates = tracker.update(stats, now=1.0)
    assert rates[0].active_flows + rates[1].active_flows == 45
    assert rates[0].active_flows > 5  # Maglev spread the unpinned ones over both shards
    assert dp.read_counters().ringbuf_failed == 0
    # Every classifier counter reaches the agent, and /metrics exports each pass reason.
    from adaptermesh.agent.metrics import AgentMetrics
    from adaptermesh.bpf.table import DatapathCounters

    table._counters = DatapathCounters(link_local=3, vlan=2)
    counters = dataclasses.asdict(dp.read_counters())  # what the agent's load reporter reads
    assert counters["link_local"] == 3
    metrics = AgentMetrics()
    metrics.bind_rates(dict, lambda: counters)
    passed = metrics.registry.get_sample_value
    assert (
        passed("adaptermesh_agent_classifier_passed_packets_total", {"reason": "link_local"}) == 3
    )
    assert passed("adaptermesh_agent_classifier_passed_packets_total", {"reason": "vlan"}) == 2
    # A bad assignment is refused by the classifier's own validation, naming the field.
    with pytest.raises(ValueError, match=r"pins\[0\]\.cidr"):
        dp.apply(make_assignment(2, pins={"10.9.0.1/24": "a"}))


def test_table_datapath_reads_the_tables_sticky_flows() -> None:
    """Through the agent's wrapper, lookup_flow answers from the table's flow entries: the
    shard each source's packets took; none for a source that never sent."""
    from adaptermesh.agent.backends import TableDatapath
    from adaptermesh.bpf.table import FakeShardTable, FlowLookup

    table = FakeShardTable(maglev_size=251)
    dp = TableDatapath(table)
    assert isinstance(dp, FlowLookup)
    dp.apply(make_assignment(1, {"a": 5000, "b": 5000}, pins={"10.9.0.0/24": "b"}))
    took = {f"10.8.0.{i}": table.classify(f"10.8.0.{i}") for i in range(20)}
    took["10.9.0.1"] = table.classify("10.9.0.1")
    assert {s: dp.lookup_flow(s) for s in took} == took
    assert took["10.9.0.1"] == 1
    assert dp.lookup_flow("10.7.0.1") is None
