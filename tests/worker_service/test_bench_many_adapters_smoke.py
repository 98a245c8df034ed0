"""bench/bench_many_adapters.py runs end to end on CPU: one ``adaptermesh worker`` process per
row, adapters registered over HTTP, and a results file with the table's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).parents[2] / "bench" / "bench_many_adapters.py"


def test_bench_many_adapters_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "many_adapters.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--rows",
            "r512_128",
            "--warmup-row",
            "--step-profile",
            # A ramp long enough for the closed loop to reach its steady state on a loaded
            # two-core machine, so both halves of the window count tokens.
            "--ramp-s",
            "3",
            # Four seconds a warm-up level: on a loaded two-core machine a one-request loop
            # still finishes requests inside its measured half.
            "--warmup-s",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("date", "command", "machine", "model", "adapter_sets", "workload"):
        assert key in report
    assert report["device"] == "cpu"
    assert report["skipped"] == []
    # base8 runs first even when --rows leaves it out: the ratios are to it.
    assert [row["row"] for row in report["table"]] == ["base8", "r512_128"]
    base8, many = report["table"]
    assert base8["ratio_vs_base8"] == 1.0
    assert many["adapters"] > many["gpu_slots"]
    for row in report["table"]:
        assert row["error"] is None
        for figure in (
            "capacity_output_tok_s",
            "ratio_vs_base8",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "tpot_p95_ms",
        ):
            assert row[figure] is not None, (row["row"], figure, proc.stdout[-2000:])
            assert row[figure] > 0, (row["row"], figure)
        assert row["ttft_p50_ms"] <= row["ttft_p95_ms"]
        for counter in (
            "adapter_loads",
            "evictions",
            "cache_misses",
            "evictions_wanted",
            "scheduler_idle_on_adapter_load",
        ):
            assert row[counter] is not None, (row["row"], counter)
            assert row[counter] >= 0, (row["row"], counter)
    # More adapters than slots: the measured phases load and evict.
    assert many["adapter_loads"] > 0
    assert many["evictions"] > 0
    # The warm-up row ran closed loops only, at each level, before the table; it is no row.
    warm = report["warmup_row"]
    assert warm["row"] == "base8"
    assert warm.get("error") is None, warm.get("error")
    assert [w["concurrency"] for w in warm["warmup_levels"]] == [16, 4, 1]
    # Every level's loop sent requests and none failed (answered, or cut at the level's end: a
    # one-request loop of a long prompt on a loaded machine may finish none in its 4 s); the
    # full loop streamed tokens in its measured half.
    for w in warm["warmup_levels"]:
        codes = w["status_counts"]
        assert sum(codes.values()) > 0, w
        assert set(codes) <= {"200", "cut"}, w
    assert warm["warmup_levels"][0]["output_tok_s"] > 0
    assert "capacity" not in warm
    for row in report["table"]:
        # Both halves of the capacity window counted tokens.
        first, second = report["rows"][row["row"]]["capacity"]["output_tok_s_halves"]
        assert first > 0
        assert second > 0
        assert row["capacity_second_over_first_half"] == second / first
    # Each row's worker profiled its steps; the capacity window's summary came back.
    for name in ("base8", "r512_128"):
        prof = report["rows"][name]["step_profile"]["capacity"]
        assert prof["steps"] > 0, name
        assert prof["gpu_busy_share"] == 0  # no GPU: steps finish at launch, no events
        assert prof["steps_per_s"] > 0, name
        assert prof["adapters_per_step_max"] >= 1, name
        assert 0 <= prof["prefill_token_share"] <= 1, name
        assert (
            sum(b["steps"] for b in prof["decode_by_adapters"].values())
            == (prof["decode_only"]["steps"])
        )
    assert "step_profile" not in warm
    detail = report["rows"]["r512_128"]
    # max_loras: adapters on every module (the arena holds more of these q,v ones).
    assert detail["worker_reported"]["max_loras"] == many["gpu_slots"]
    assert detail["worker_reported"]["gpu_slots_total"] >= many["gpu_slots"]
    assert "arena" in detail["worker_reported"]["lora_pool"]
    assert "--max-loras 8" in detail["worker_command"]
    assert detail["worker_exit"] == 0
    assert detail["load"]["status_counts"].get("200", 0) > 0
