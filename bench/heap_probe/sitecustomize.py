"""The control plane's heap, sampled from inside its process during a soak.

``bench/bench_faults.py --soak --heap-probe`` puts this directory on the control plane's
``PYTHONPATH``; Python imports ``sitecustomize`` at start-up, and with ``HEAP_PROBE_OUT`` set
this starts a daemon thread that appends one JSON line every ``HEAP_PROBE_EVERY_S`` seconds
(15 by default): VmRSS, glibc's ``mallinfo2`` (bytes the heaps span, bytes in use, free bytes
held inside them, bytes in mmap'd chunks), SQLite's own allocations
(``sqlite3_memory_used``) and the thread count. Without ``HEAP_PROBE_OUT`` it does nothing.
It reads only: nothing in the process is changed.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

from heap_figures import malloc_heap_figures  # this directory is on PYTHONPATH


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _start() -> None:
    out = os.environ.get("HEAP_PROBE_OUT")
    if not out:
        return
    every = float(os.environ.get("HEAP_PROBE_EVERY_S", "15"))
    libc = ctypes.CDLL("libc.so.6")
    try:
        sqlite = ctypes.CDLL("libsqlite3.so.0")
        sqlite.sqlite3_memory_used.restype = ctypes.c_int64
    except OSError:
        sqlite = None
    t0 = time.monotonic()

    def sample() -> dict[str, float]:
        rec: dict[str, float] = {
            "t_s": round(time.monotonic() - t0, 1),
            "rss_kib": _rss_kib(),
            **malloc_heap_figures(libc),
            "threads": threading.active_count(),
        }
        if sqlite is not None:
            rec["sqlite_kib"] = sqlite.sqlite3_memory_used() // 1024
        return rec

    def loop() -> None:
        while True:
            time.sleep(every)
            with open(out, "a") as f:
                f.write(json.dumps(sample()) + "\n")

    threading.Thread(target=loop, daemon=True, name="heap-probe").start()


_start()
