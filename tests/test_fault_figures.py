"""The fault suite's bookkeeping without a mesh: how probe packets are counted (arrived at the
expected shard, misclassified, lost), when a store stall is over, and the soak's RSS and
descriptor figures, and each local-mesh worker's share of the CPUs. The mesh runs (tests/e2e) can only show the counts staying at zero; these
check that a misrouted packet, a late 503 or a growing process would be counted."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh_testkit.cpusample import CpuSampler, cpu_seconds
from adaptermesh_testkit.faultload import FaultEvent, RequestRecord, UdpProbe, _stall_recovery
from adaptermesh_testkit.localmesh import LocalMesh, MeshConfig
from adaptermesh_testkit.soak import ProcessSampler, rss_by_mapping


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


def _smaps_entry(lo: int, size_kib: int, path: str, rss_kib: int) -> str:
    hi = lo + size_kib * 1024
    return (
        f"{lo:012x}-{hi:012x} rw-p 00000000 00:00 0          {path}\n"
        f"Size:           {size_kib} kB\nKernelPageSize:        4 kB\nRss:            {rss_kib} kB\n"
        f"Pss:            {rss_kib} kB\nVmFlags: rd wr mr mw me ac sd\n"
    )


def test_rss_by_mapping_sorts_heap_arenas_small_anon_and_files() -> None:
    text = "".join(
        [
            _smaps_entry(0x400000, 4096, "/usr/bin/python3.11", 3000),
            _smaps_entry(0x1000000, 20000, "[heap]", 15000),
            _smaps_entry(0x7F0000000000, 65536, "", 9000),  # a 64 MiB anonymous block
            _smaps_entry(0x7F1000000000, 1024, "", 700),  # Python arenas
            _smaps_entry(0x7F2000000000, 8192, "[stack]", 40),
        ]
    )
    assert rss_by_mapping(text) == {
        "heap": 15000,
        "anon_large": 9000,
        "anon_small": 740,
        "file": 3000,
    }


@given(
    st.lists(
        st.tuples(
            st.integers(1, 200_000),
            st.sampled_from(["", "[heap]", "[stack]", "/lib/x.so", "[anon:x]", "[vdso]"]),
            st.integers(0, 100_000),
        ),
        max_size=30,
    )
)
def test_rss_by_mapping_counts_every_mapping_once(entries: list[tuple[int, str, int]]) -> None:
    text = "".join(
        _smaps_entry(0x10000000 + i * (1 << 32), size, path, rss)
        for i, (size, path, rss) in enumerate(entries)
    )
    kinds = rss_by_mapping(text)
    assert sum(kinds.values()) == sum(rss for _, _, rss in entries)
    assert kinds["heap"] == sum(rss for _, path, rss in entries if path == "[heap]")


def test_soak_figures_say_what_holds_the_rss_at_the_baseline_and_the_end() -> None:
    rows: list[tuple[float, dict[str, Any]]] = [
        (0.0, {"cp": (1, 900, 10)}),
        (300.0, {"cp": (1, 1000, 12)}),
        (600.0, {"cp": (1, 1100, 12)}),
    ]
    sampler = _sampler(rows)
    sampler.mappings = [
        {"cp": {"heap": 1, "anon_large": 0, "anon_small": 0, "file": 0}},
        {"cp": {"heap": 2, "anon_large": 0, "anon_small": 0, "file": 0}},
        {"cp": {"heap": 3, "anon_large": 5, "anon_small": 0, "file": 0}},
    ]
    held = sampler.figures(300.0)["cp"]["rss_kib_by_mapping"]
    assert held["baseline"]["heap"] == 2
    assert held["last"] == {"heap": 3, "anon_large": 5, "anon_small": 0, "file": 0}


@pytest.mark.parametrize(
    ("cpus", "shards", "per_shard", "extra", "want"),
    [
        (2, 1, 2, (), ["--cpu-threads", "1"]),  # the fault mesh on this box
        (8, 1, 2, (), ["--cpu-threads", "4"]),
        (8, 3, 2, (), ["--cpu-threads", "1"]),  # 8 // 6
        (2, 3, 2, (), ["--cpu-threads", "1"]),  # fewer cores than workers: still one each
        (2, 1, 2, ("--cpu-threads", "5"), []),  # the config's own flag wins
    ],
)
def test_local_mesh_gives_each_worker_its_share_of_the_cpus(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpus: int,
    shards: int,
    per_shard: int,
    extra: tuple[str, ...],
    want: list[str],
) -> None:
    monkeypatch.setattr(
        "adaptermesh_testkit.localmesh.os.sched_getaffinity", lambda _pid: set(range(cpus))
    )
    mesh = LocalMesh(
        MeshConfig(
            prefix="amt0",
            shards=shards,
            workers_per_shard=per_shard,
            workdir=tmp_path,
            worker_args=extra,
        )
    )
    assert mesh._cpu_threads_args() == want


def test_cpu_sampler_cores_per_process_and_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    used = {"worker": 10.0, "agent": 5.0}
    pids = {"worker": 11, "agent": 12}
    monkeypatch.setattr("adaptermesh_testkit.cpusample.time.monotonic", lambda: clock[0])
    sampler = CpuSampler(lambda: dict(pids), read=lambda pid: used[_name(pids, pid)])
    sampler.sample()  # the baseline: no row
    assert sampler.samples == []
    for step in range(4):
        clock[0] += 0.5
        used["worker"] += 0.5 if step < 2 else 0.05  # one core busy, then a tenth
        used["agent"] += 0.1
        sampler.sample()
    pids["worker"] = 21  # restarted: its first sample after has no interval to count
    used["worker"] = 0.2
    clock[0] += 0.5
    sampler.sample()
    assert "worker" not in sampler.samples[-1][1]
    phases = sampler.by_phase({"busy": (100.0, 101.01), "idle": (101.01, 103.0)})
    assert phases["busy"]["samples"] == 2
    assert phases["busy"]["cores"]["worker"] == {"mean": 1.0, "max": 1.0}
    assert phases["busy"]["cores"]["agent"] == {"mean": 0.2, "max": 0.2}
    assert phases["idle"]["samples"] == 3
    assert phases["idle"]["cores"]["worker"] == {"mean": 0.07, "max": 0.1}


def _name(pids: dict[str, int], pid: int) -> str:
    return next(n for n, p in pids.items() if p == pid)


def test_cpu_seconds_of_a_busy_process_grows() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    after = cpu_seconds(os.getpid())
    assert after is not None
    assert after - before >= 0.1
    assert cpu_seconds(2**22 + 7) is None  # above pid_max: no such process
