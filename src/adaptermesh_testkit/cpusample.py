"""CPU time per process, sampled beside a fault scenario: which process was busy when.

:class:`CpuSampler` reads ``utime + stime`` (every thread of the process) from
``/proc/<pid>/stat`` every ``interval_s`` and keeps, per sample, the cores each process used
since the one before (1.0 is one core busy the whole interval). :meth:`CpuSampler.by_phase`
averages them over time windows (a scenario's before, during and after) and keeps each
process's busiest sample."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

__all__ = ["CpuSampler", "PeriodicSampler", "cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of ``pid`` so far; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (IndexError, ValueError):
        return None


class PeriodicSampler:
    """Calls :meth:`sample` at :meth:`start`, every ``interval_s`` from a thread, and once
    more at :meth:`stop`; ``started`` is the monotonic time of :meth:`start`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> Self:
        self.started = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class CpuSampler(PeriodicSampler):
    """Cores used per process (``pids()``: name -> pid) every ``interval_s``."""

    def __init__(
        self,
        pids: Callable[[], Mapping[str, int]],
        interval_s: float = 0.5,
        read: Callable[[int], float | None] = cpu_seconds,
    ) -> None:
        super().__init__(interval_s)
        self.pids = pids
        self.read = read
        # (monotonic time at the end of the interval, name -> cores used over it)
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._last: dict[str, tuple[int, float, float]] = {}  # name -> (pid, cpu s, time)

    def sample(self) -> None:
        now = time.monotonic()
        row: dict[str, float] = {}
        current: dict[str, tuple[int, float, float]] = {}
        for name, pid in self.pids().items():
            used = self.read(pid)
            if used is None:
                continue
            current[name] = (pid, used, now)
            last = self._last.get(name)
            if last is not None and last[0] == pid and now > last[2]:  # not restarted since
                row[name] = max(0.0, (used - last[1]) / (now - last[2]))
        self._last = current
        if row:
            self.samples.append((now, row))

    def by_phase(self, phases: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
        """Per phase (name -> [start, end) in monotonic time): the samples that ended in it,
        and per process the mean and the largest cores used, rounded to 0.01."""
        out: dict[str, Any] = {}
        for phase, (start, end) in phases.items():
            rows = [row for t, row in self.samples if start <= t < end]
            names = sorted({n for row in rows for n in row})
            out[phase] = {
                "samples": len(rows),
                "cores": {
                    name: {
                        "mean": round(sum(r.get(name, 0.0) for r in rows) / len(rows), 2),
                        "max": round(max(r.get(name, 0.0) for r in rows), 2),
                    }
                    for name in names
                },
            }
        return out
