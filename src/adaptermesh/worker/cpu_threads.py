"""How many threads the worker's torch runs its CPU operators on.

torch sizes its intra-op pool from the CPUs it can see (the affinity mask), not from the CPU
time the process may use: a worker in a pod limited to one CPU on a 64-core node starts 64
OpenMP threads, and two workers sharing two cores start four. OpenMP threads spin while they
wait for each other, so when such workers step at the same time each one's threads wait on
threads the kernel has descheduled, and every step slows by an order of magnitude (on the
local mesh, two CPU workers on two cores went from 0.1 s to 1.3-3.4 s a stream, both workers at
full CPU, once both had work at once: docs/faults.md).

``--cpu-threads auto`` (the default) therefore takes the smaller of the affinity mask and the
process's CPU quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, the tightest of the process's cgroup and its ancestors), rounded down,
at least one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaptermesh.worker.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, limit_dirs, read_limit_file

__all__ = [
    "CpuThreads",
    "apply_cpu_threads",
    "cgroup_cpu_quota",
    "choose_cpu_threads",
    "parse_cpu_threads",
]


@dataclass(frozen=True)
class CpuThreads:
    """The threads chosen and why: ``source`` is ``flag``, ``quota`` or ``affinity``."""

    threads: int
    source: str
    affinity: int
    quota: float | None

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return (
            f"{self.threads} CPU threads ({self.source}; affinity {self.affinity} CPUs, "
            f"quota {quota})"
        )


def parse_cpu_threads(text: str) -> int | None:
    """``--cpu-threads``: ``auto`` (None) or a positive thread count."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected auto or a positive integer, got {text[:64]!r}") from None
    if value < 1 or value > 4096:
        raise ValueError(f"expected auto or 1-4096 threads, got {text.strip()[:64]}")
    return value


def _v2_quota(directory: Path) -> float | None:
    text = read_limit_file(directory / "cpu.max")
    if not text:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    quota_text = read_limit_file(directory / "cpu.cfs_quota_us")
    period_text = read_limit_file(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """The CPUs this process's cgroups allow it (the tightest limit of its cgroup and its
    ancestors, v2 ``cpu.max`` or v1 CFS quota), or None without a limit."""
    found = [
        q
        for d in limit_dirs("cpu", root, proc_cgroup)
        if (q := _v2_quota(d) or _v1_quota(d)) is not None
    ]
    return min(found) if found else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_cpu_threads(
    flag: int | None,
    *,
    affinity: Callable[[], int] = _affinity,
    quota: Callable[[], float | None] = cgroup_cpu_quota,
) -> CpuThreads:
    """The thread count for ``--cpu-threads`` (``flag``; None is ``auto``)."""
    cpus = max(1, affinity())
    limit = quota()
    if flag is not None:
        return CpuThreads(flag, "flag", cpus, limit)
    if limit is not None and math.floor(limit) < cpus:
        return CpuThreads(max(1, math.floor(limit)), "quota", cpus, limit)
    return CpuThreads(cpus, "affinity", cpus, limit)


def apply_cpu_threads(chosen: CpuThreads) -> None:
    """Size torch's intra-op pool (and MKL's and OpenMP's, which it sets with it)."""
    import torch

    torch.set_num_threads(chosen.threads)
