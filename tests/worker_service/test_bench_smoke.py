"""bench/bench_service.py runs end to end in its CPU smoke mode and writes a coherent report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).parents[2] / "bench" / "bench_service.py"


def test_bench_service_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "service.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--adapters",
            "4",
            "--batch",
            "4",
            "--fractions",
            "0.25",
            "--duration",
            "1",
            "--cal-waves",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["capacity"]["req_s"] > 0
    assert [row["concurrency"] for row in report["http_overhead"]] == [1, 16]
    for row in report["http_overhead"]:
        assert row["direct"]["tpot_p50_s"] > 0
        assert row["http"]["tpot_p50_s"] > 0
    (level,) = report["sweep"]
    assert level["offered"] > 0
    assert level["status_counts"] == {"200": level["offered"]}
    assert level["ttft_s"]["p50"] <= level["ttft_s"]["p99"]
    assert 0 <= level["share_within_slo"] <= 1
    assert report["machine"]["device"] == "cpu"
