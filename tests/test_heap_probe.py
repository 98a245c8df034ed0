"""bench/heap_probe: the soak's in-process sampler of the control plane's heap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "bench" / "heap_probe"

# Holds 8 MiB of C heap (bytearrays of 64 KiB: below malloc's mmap threshold) for a while,
# then frees it and waits again: the probe must see the heap in use rise and fall.
CHILD = """
import time
held = [bytearray(64 * 1024) for _ in range(128)]
time.sleep(0.6)
del held
time.sleep(0.6)
"""


def test_probe_samples_the_heap_of_the_process_it_is_loaded_into(tmp_path: Path) -> None:
    out = tmp_path / "heap.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(PROBE),
        "HEAP_PROBE_OUT": str(out),
        "HEAP_PROBE_EVERY_S": "0.1",
    }
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=30)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 6
    for row in rows:
        assert row["rss_kib"] > 0
        assert 0 < row["in_use_kib"] <= row["heap_kib"] + row["mmap_kib"]
        assert row["free_held_kib"] >= 0
        assert "sqlite_kib" in row
    assert max(r["in_use_kib"] for r in rows) - rows[-1]["in_use_kib"] >= 6 * 1024


def test_probe_does_nothing_without_an_output(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(PROBE)}
    env.pop("HEAP_PROBE_OUT", None)
    code = "import threading; assert threading.active_count() == 1, threading.enumerate()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
