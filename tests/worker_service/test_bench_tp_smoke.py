"""bench/bench_tp.py runs end to end in its CPU smoke mode (gloo, tiny model) and writes every
figure a case reports; an unknown scenario is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "bench_tp.py"


def test_bench_tp_rejects_unknown_scenario(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--only", "nonsense", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown scenario 'nonsense'" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_bench_tp_tiny_two_ranks_with_adapters(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--only", "70b-b64", "--steps", "2",
         "--ctx", "32", "--lora-schemes", "sharded", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "tiny-cpu"
    assert doc["command"].endswith(f"--out {out}")
    (case,) = doc["cases"]
    assert case["world"] == 2
    assert case["adapters"] == 4
    assert case["lora_scheme"] == "sharded"
    assert len(case["ranks"]) == 2
    assert all(r["lora_bytes_read"] > 0 and r["step_ms_median"] > 0 for r in case["ranks"])
    assert case["byte_floor_tok_s"] > 0
    row = doc["targets"]["tp4_70b_b64_64_adapters_tok_s"]
    assert row["value"] == case["tok_s"]
    assert row["byte_floor_tok_s"] == case["byte_floor_tok_s"]
    assert row["lora_scheme"] == "sharded"
