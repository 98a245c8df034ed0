"""The fault suite's bookkeeping without a mesh: how probe packets are counted (arrived at the
expected shard, misclassified, lost), when a store stall is over, and the soak's RSS and
descriptor figures. The mesh runs (tests/e2e) can only show the counts staying at zero; these
check that a misrouted packet, a late 503 or a growing process would be counted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from adaptermesh_testkit.faultload import FaultEvent, RequestRecord, UdpProbe, _stall_recovery
from adaptermesh_testkit.soak import ProcessSampler


def _probe(
    sent: list[tuple[str, int, float]], arrivals: dict[str, list[tuple[str, bytes]]]
) -> UdpProbe:
    probe = object.__new__(UdpProbe)
    probe.sent = sent
    probe.receivers = {
        shard: SimpleNamespace(received=list(rows))  # type: ignore[misc]
        for shard, rows in arrivals.items()
    }
    return probe


def test_probe_counts_right_wrong_and_lost() -> None:
    sent = [("a", 0, 1.0), ("a", 1, 2.0), ("b", 0, 2.0), ("b", 1, 3.0), ("a", 2, 9.0)]
    probe = _probe(
        sent,
        {
            "s0": [("a", b"a|0"), ("a", b"a|2")],
            "s1": [("b", b"b|0"), ("a", b"a|1")],  # a|1 went to the wrong shard
        },
    )
    expected = {"a": "s0", "b": "s1"}
    assert probe.summary(expected) == {
        "packets_sent": 5,
        "arrived_at_expected_shard": 3,
        "misclassified": 1,
        "lost": 1,  # b|1
    }
    assert probe.summary(expected, 1.5, 3.0) == {
        "packets_sent": 3,
        "arrived_at_expected_shard": 1,
        "misclassified": 1,
        "lost": 1,
    }


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["s0", "s1", None])),
        max_size=60,
    )
)
def test_probe_counts_add_up(fates: list[tuple[str, str | None]]) -> None:
    """Every packet sent is counted exactly once, as right, misclassified or lost."""
    expected = {"a": "s0", "b": "s1", "c": "s0"}
    sent = [(src, i, float(i)) for i, (src, _) in enumerate(fates)]
    arrivals: dict[str, list[tuple[str, bytes]]] = {"s0": [], "s1": []}
    for i, (src, shard) in enumerate(fates):
        if shard is not None:
            arrivals[shard].append((src, f"{src}|{i}".encode()))
    counts = _probe(sent, arrivals).summary(expected)
    assert counts["packets_sent"] == len(fates)
    assert counts["lost"] == sum(1 for _, shard in fates if shard is None)
    assert counts["misclassified"] == sum(
        1 for src, shard in fates if shard is not None and shard != expected[src]
    )
    assert counts["arrived_at_expected_shard"] + counts["misclassified"] + counts["lost"] == len(
        fates
    )


def _record(started: float, outcome: str) -> RequestRecord:
    r = RequestRecord("10.0.0.1", "remote", started, started=started, ended=started + 1)
    r.outcome = outcome
    return r


def test_stall_is_over_at_the_first_success_no_failure_follows() -> None:
    event = FaultEvent("stall", "store", 0.0, notes={"released_at": 10.0})
    stalled = [
        _record(1.0, "http_503"),
        _record(11.0, "ok"),  # one worker has it
        _record(12.0, "http_503"),  # the other one not yet
        _record(13.0, "ok"),
        _record(14.0, "ok"),
    ]
    _stall_recovery(event, stalled)
    assert event.recovered_at == 13.0
    assert event.allowed_until == 13.0
    assert event.notes["recovered_after_release_s"] == 3.0


def test_stall_never_over_without_a_success_after_the_last_failure() -> None:
    event = FaultEvent("stall", "store", 0.0, notes={"released_at": 10.0})
    _stall_recovery(event, [_record(11.0, "ok"), _record(12.0, "http_503")])
    assert event.recovered_at is None
    assert event.notes["recovered_after_release_s"] is None


def _sampler(rows: list[tuple[float, dict[str, tuple[int, int, int]]]]) -> ProcessSampler:
    sampler = ProcessSampler(dict, 1.0)
    sampler.samples = rows
    return sampler


def test_soak_figures_measure_growth_after_the_baseline_and_follow_a_restarted_pid() -> None:
    rows: list[tuple[float, dict[str, Any]]] = [
        (0.0, {"cp": (1, 900, 10), "w": (5, 100, 7)}),
        (300.0, {"cp": (1, 1000, 12), "w": (6, 200, 9)}),  # w restarted: new pid 6
        (600.0, {"cp": (1, 1060, 20), "w": (6, 204, 9)}),
        (900.0, {"cp": (1, 1040, 12), "w": (6, 202, 9)}),
    ]
    figures = _sampler(rows).figures(300.0)
    cp = figures["cp"]
    assert cp["rss_kib_baseline"] == 1000
    assert cp["rss_kib_max_after"] == 1060
    assert cp["rss_growth"] == 0.06  # over 5 %
    assert (cp["fds_baseline"], cp["fds_max_after"], cp["fds_last"]) == (12, 20, 12)
    w = figures["w"]
    assert w["pid"] == 6
    assert w["samples"] == 3  # the old pid's sample is not its
    assert w["rss_growth"] == 0.02


def test_soak_figures_keep_the_rss_once_a_minute_and_the_last_sample() -> None:
    rows: list[tuple[float, dict[str, Any]]] = [
        (t, {"cp": (1, 1000 + int(t), 10)}) for t in (0.0, 15.0, 59.9, 60.0, 75.0, 130.0, 140.5)
    ]
    cp = _sampler(rows).figures(0.0)["cp"]
    assert cp["rss_kib_per_minute"] == [[0.0, 1000], [60.0, 1060], [130.0, 1130], [140.5, 1140]]
