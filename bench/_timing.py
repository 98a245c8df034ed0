"""GPU timing shared by the kernel benches: CUDA-graph replay and copy bandwidth.

Every figure is a median of CUDA-event times, so host jitter between calls never counts.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton


def run_header() -> dict[str, Any]:
    """What a results JSON records about its run: GPU, versions, UTC date and command."""
    return {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }  # fmt: skip


def time_rotating(fns: list[Callable[[], object]], reps: int = 7, passes: int = 3) -> float:
    """Median over reps of the mean µs per call, cycling eagerly through the input sets."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        for _ in range(passes):
            for f in fns:
                f()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (passes * len(fns)))
    return statistics.median(out)


def time_graph(fns: list[Callable[[], object]], reps: int = 7, replays: int = 3) -> float:
    """µs per call when the calls over all input sets are captured in one CUDA graph (warmed up
    on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del g
    return statistics.median(out)


def copy_bandwidth(dtype: torch.dtype = torch.bfloat16, elements: int = 1 << 29) -> float:
    """Device-to-device copy GB/s, bytes read plus written (1 GiB buffers by default)."""
    a = torch.empty(elements, dtype=dtype, device="cuda").normal_()
    b = torch.empty_like(a)
    us = time_rotating([lambda: b.copy_(a)], reps=9, passes=3)
    bw = 2 * a.numel() * a.element_size() / (us * 1e-6) / 1e9
    torch.cuda.empty_cache()
    return bw
