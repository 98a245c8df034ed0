"""``--cpu-threads``: torch's CPU threads from the affinity mask and the cgroup CPU quota."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.worker.cli import build_parser
from adaptermesh.worker.cpu_threads import (
    CpuThreads,
    apply_cpu_threads,
    cgroup_cpu_quota,
    choose_cpu_threads,
    parse_cpu_threads,
)

BASE = ["--model", "m", "--adapter-root", "a"]


def _v2_tree(tmp_path: Path, path: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 mount at ``tmp_path/cg`` with ``cpu.max`` files (relative dir -> text) and
    a /proc/self/cgroup naming ``path``."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / path.strip("/")).mkdir(parents=True, exist_ok=True)
    for rel, text in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root, proc = _v2_tree(
        tmp_path,
        "/kubepods/burstable/pod1/ctr",
        {
            "kubepods/burstable/pod1": "250000 100000",  # the pod: 2.5 CPUs
            "kubepods/burstable/pod1/ctr": "max 100000",  # the container: no own limit
            "kubepods": "800000 100000",
        },
    )
    assert cgroup_cpu_quota(root, proc) == 2.5


def test_v2_no_limit_anywhere_is_none(tmp_path: Path) -> None:
    root, proc = _v2_tree(tmp_path, "/a/b", {"a": "max 100000", "a/b": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None


def test_v2_inside_a_cgroup_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    # A container sees its own cgroup as "/" and its limit at the mount's top.
    root, proc = _v2_tree(tmp_path, "/", {".": "150000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.5


def test_v1_cfs_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    pod = root / "cpu,cpuacct" / "kubepods" / "pod9"
    pod.mkdir(parents=True)
    (pod / "cpu.cfs_quota_us").write_text("300000\n")
    (pod / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/kubepods/pod9\n4:cpu,cpuacct:/kubepods/pod9\n1:name=systemd:/\n")
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_v1_unlimited_and_unreadable_are_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpu:/\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(root, tmp_path / "absent") is None
    (root / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_this_machine_reads_without_error() -> None:
    quota = cgroup_cpu_quota()
    assert quota is None or quota > 0


@pytest.mark.parametrize(
    ("flag", "affinity", "quota", "want"),
    [
        (None, 64, 2.0, CpuThreads(2, "quota", 64, 2.0)),
        (None, 64, 2.5, CpuThreads(2, "quota", 64, 2.5)),  # rounded down: no throttling
        (None, 8, 0.5, CpuThreads(1, "quota", 8, 0.5)),  # at least one
        (None, 4, 16.0, CpuThreads(4, "affinity", 4, 16.0)),
        (None, 2, None, CpuThreads(2, "affinity", 2, None)),
        (3, 64, 2.0, CpuThreads(3, "flag", 64, 2.0)),  # the flag wins
    ],
)
def test_choose(flag: int | None, affinity: int, quota: float | None, want: CpuThreads) -> None:
    assert choose_cpu_threads(flag, affinity=lambda: affinity, quota=lambda: quota) == want


@given(
    flag=st.none() | st.integers(1, 4096),
    affinity=st.integers(0, 1024),
    quota=st.none() | st.floats(0.01, 4096, allow_nan=False),
)
def test_choose_property(flag: int | None, affinity: int, quota: float | None) -> None:
    got = choose_cpu_threads(flag, affinity=lambda: affinity, quota=lambda: quota)
    assert got.threads >= 1
    if flag is not None:
        assert got.threads == flag
        return
    assert got.threads <= max(1, affinity)
    if quota is not None:
        assert got.threads <= max(1, math.floor(quota))
    assert got.describe().startswith(f"{got.threads} CPU threads ({got.source};")


@given(st.text(max_size=40))
def test_parse_cpu_threads_accepts_auto_and_counts_only(text: str) -> None:
    try:
        value = parse_cpu_threads(text)
    except ValueError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert len(message) < 200  # a bounded quote of the input
        return
    if value is None:
        assert text.strip().lower() == "auto"
    else:
        assert 1 <= value <= 4096
        assert int(text) == value


def test_the_flag_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(BASE).cpu_threads is None
    assert parser.parse_args([*BASE, "--cpu-threads", "auto"]).cpu_threads is None
    assert parser.parse_args([*BASE, "--cpu-threads", "3"]).cpu_threads == 3
    for bad in ("0", "-2", "two", "x" * 10_000, "9" * 4_000):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*BASE, "--cpu-threads", bad])
        assert exc.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "argument --cpu-threads:" in last
        assert len(last) < 200


def test_apply_sets_torch_threads() -> None:
    before = torch.get_num_threads()
    try:
        apply_cpu_threads(CpuThreads(1, "flag", 8, None))
        assert torch.get_num_threads() == 1
        apply_cpu_threads(CpuThreads(2, "flag", 8, None))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
