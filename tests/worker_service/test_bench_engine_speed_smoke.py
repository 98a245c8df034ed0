"""bench/bench_engine_speed.py and bench_service.py --mix run end to end in their CPU smoke modes
and write a complete report: every section measured, every target row computed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).parents[2] / "bench"
SPEED = BENCH_DIR / "bench_engine_speed.py"
SERVICE = BENCH_DIR / "bench_service.py"
SECTIONS = (
    "batch1",
    "batch64",
    "sampling",
    "prefix",
    "kernels",
    "capacity",
    "step_split",
    "hf_static",
)
TARGET_ROWS = {
    "batch1_backbone_ms_per_token",
    "batch1_lora_r16_all7_vs_backbone",
    "batch64_64_distinct_tok_s",
    "batch64_64_vs_1",
    "sampling_t1_p09_vs_greedy",
    "kv_sequences_2048ctx_40GB",
    "prefix_ttft_cold_over_warm",
}


def test_bench_engine_speed_help() -> None:
    proc = subprocess.run(
        [sys.executable, str(SPEED), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--tiny" in proc.stdout
    assert "--budget-s" in proc.stdout


def test_bench_engine_speed_rejects_unknown_section() -> None:
    proc = subprocess.run(
        [sys.executable, str(SPEED), "--only", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown section" in proc.stderr


@pytest.mark.slow
def test_bench_engine_speed_tiny(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, str(SPEED), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())

    header = report["header"]
    assert header["device"] == "cpu"
    assert header["copy_bandwidth"]["GB_s"] > 0
    assert {"torch", "transformers", "peft"} <= set(header["versions"])
    for name in ("main", "step_split"):
        assert report["engines"][name]["unsupported_config_fields"] == [], name

    for name in SECTIONS:
        section = report[name]
        assert "error" not in section, (name, section.get("error"), section.get("traceback"))
        assert "skipped" not in section, (name, section["skipped"])

    assert report["batch1"]["backbone"]["decode_ms_per_token"] > 0
    assert report["batch64"]["distinct"]["decode_tok_s"] > 0
    assert report["capacity"]["kv_tokens_source"] == "describe()['kv_tokens']"
    assert report["capacity"]["measured"]["peak_running"] > 0
    kernels = report["kernels"]
    for label in ("base", "one_adapter", "distinct"):
        assert kernels[label]["steps_in_window"] > 0, label
        assert kernels[label]["kernel_us_per_step"] > 0, label
        assert 0 < kernels[label]["busy_us_per_step"] <= kernels[label]["kernel_us_per_step"]
        assert kernels[label]["top_kernels"], label
    for label in ("one_adapter_over_base", "distinct_over_base"):
        assert set(kernels[label]) >= {"wall_us_per_step", "by_kind", "kernels_adding_us"}
    split = report["step_split"]
    assert split["profile_steps_supported"]
    for row in split["batches"].values():
        assert row["decode_steps"] > 0, row
        assert row["host_ms_per_step"] is not None, row
    assert report["hf_static"]["batch1"]["decode_ms_per_token"] > 0

    targets = report["targets"]
    assert set(targets) == TARGET_ROWS
    for name, row in targets.items():
        assert {"value", "target", "met"} <= set(row), name
        assert row["value"] is not None, name
        assert isinstance(row["met"], bool), name


@pytest.mark.slow
def test_bench_service_mix_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "mix.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SERVICE),
            "--mix",
            "--device",
            "cpu",
            "--adapters",
            "4",
            "--mix-capacity-s",
            "2",
            "--mix-run-s",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["capacity"]["output_tok_s"] > 0
    load = report["load"]
    assert load["completed"] > 0
    assert load["status_counts"] == {"200": load["requests"]}
    assert load["ttft_ms"]["p50"] <= load["ttft_ms"]["p95"] <= load["ttft_ms"]["p99"]
    assert report["floor"]["bound_output_tok_s"] >= report["floor"]["serial_estimate_output_tok_s"]
    assert set(report["targets"]) == {
        "http_capacity_output_tok_s",
        "http_tpot_p95_at_80pct_ms",
        "http_ttft_p95_at_80pct_ms",
    }
    for row in report["targets"].values():
        assert {"value", "target", "met"} <= set(row)
