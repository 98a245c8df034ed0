"""glibc malloc's figures for the calling process (``mallinfo2``), in KiB: the heap's span, the
bytes in use, the free bytes it holds, and the bytes in mmap'd chunks. Shared by the soak's
heap probe (sitecustomize.py here) and bench/bench_control_plane_memory.py."""

from __future__ import annotations

import ctypes
from typing import Any


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_heap_figures(libc: Any) -> dict[str, int]:
    """``heap_kib`` (bytes every arena took from the system), ``in_use_kib``,
    ``free_held_kib``, ``mmap_kib``; empty where the C library has no ``mallinfo2``."""
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = MallInfo2
    mi = libc.mallinfo2()
    return {
        "heap_kib": mi.arena // 1024,
        "in_use_kib": mi.uordblks // 1024,
        "free_held_kib": mi.fordblks // 1024,
        "mmap_kib": mi.hblkhd // 1024,
    }
