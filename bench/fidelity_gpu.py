"""Run the model and adapter fidelity suite on a device and record the result.

The suite (tests/worker/test_fidelity.py and test_fidelity_phi_gemma.py) builds tiny random
models with transformers, adapters with peft, and checks one mixed batch through the engine
against transformers + peft per request: the same greedy tokens, logits within tolerance.
With ``--device cuda`` the engine runs the Triton kernels (SGMM add_lora, paged attention,
fused norms / RoPE / activations) in fp32; the reference stays on the CPU in fp32.

This runner starts pytest on those files with ADAPTERMESH_TEST_DEVICE set, reads the JUnit
XML it writes, and writes ``bench/results/fidelity_<device>.json`` itself: the GPU name,
library versions, date, command, pass/fail/skip counts, each failing test with its message,
the largest logit difference seen per test, and the duration.

It needs only the repository, ``PYTHONPATH=src`` (set for the child by this script), and
torch, triton, transformers, peft, pytest and hypothesis; no pytest plugins, since the suite
drives the engine with ``asyncio.run``. The pytest options come from pyproject.toml (markers,
warning filters) minus those of plugins the machine lacks.

    PYTHONPATH=src python3 bench/fidelity_gpu.py --device cuda
    PYTHONPATH=src python3 bench/fidelity_gpu.py --device cpu --examples 2   # writes fidelity_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUITE = ("tests/worker/test_fidelity.py", "tests/worker/test_fidelity_phi_gemma.py")
_LIBS = ("torch", "triton", "transformers", "peft", "pytest", "hypothesis", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def write_ini(path: Path) -> None:
    """pytest.ini holding pyproject's pytest settings that need no missing plugin."""
    opts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]"]
    for key in ("markers", "filterwarnings"):
        lines.append(f"{key} =")
        lines += [f"    {v}" for v in opts.get(key, [])]
    lines.append(f"xfail_strict = {str(opts.get('xfail_strict', True)).lower()}")
    if _has("pytest_timeout") and "timeout" in opts:
        lines.append(f"timeout = {opts['timeout']}")
    path.write_text("\n".join(lines) + "\n")


def device_info(device: str) -> tuple[str, str]:
    """(name for the file, full description) of the device the suite runs on."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {device}: torch sees no CUDA device")
        name = torch.cuda.get_device_name(torch.device(device))
        short = re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_") or "cuda"
        return short, name
    import platform

    return (
        "cpu",
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores)",
    )


def parse_junit(paths: list[Path]) -> dict[str, Any]:
    """Counts, failing cases and per-test durations from the JUnit XML files pytest wrote."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    durations: dict[str, float] = {}
    for path in paths:
        root = ET.parse(path).getroot()
        for case in root.iter("testcase"):
            counts["tests"] += 1
            module = case.get("classname", "").replace(".", "/")
            test_id = f"{module}.py::{case.get('name', '')}"
            durations[test_id] = round(float(case.get("time") or 0.0), 2)
            bad = case.find("failure")
            kind = "failed"
            if bad is None:
                bad = case.find("error")
                kind = "errors"
            if bad is not None:
                counts[kind] += 1
                failures.append(
                    {
                        "test": test_id,
                        "kind": "failure" if kind == "failed" else "error",
                        "message": (bad.get("message") or "").strip()[:2000],
                        "traceback_tail": (bad.text or "").strip()[-4000:],
                    }
                )
                continue
            skip = case.find("skipped")
            if skip is not None:
                counts["skipped"] += 1
                skipped.append({"test": test_id, "reason": (skip.get("message") or "")[:500]})
                continue
            counts["passed"] += 1
    slowest = dict(sorted(durations.items(), key=lambda kv: -kv[1])[:15])
    return {"counts": counts, "failures": failures, "skipped": skipped, "slowest_tests_s": slowest}


def shard(node_ids: list[str], jobs: int) -> list[list[str]]:
    """Split the suite over ``jobs`` pytest processes: the property tests (the longest, one
    node each) first, one per shard, then the rest round-robin from the next shard on."""
    heavy = [n for n in node_ids if "::test_random_" in n]
    rest = [n for n in node_ids if n not in heavy]
    shards: list[list[str]] = [[] for _ in range(jobs)]
    for i, n in enumerate(heavy):
        shards[i % jobs].append(n)
    for i, n in enumerate(rest):
        shards[(len(heavy) + i) % jobs].append(n)
    return [s for s in shards if s]


def read_diffs(path: Path) -> dict[str, Any]:
    """Largest |engine - reference| logit difference, overall and per test (from the suite's log)."""
    per_test: dict[str, float] = {}
    requests = 0
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            requests += 1
            per_test[rec["test"]] = max(
                per_test.get(rec["test"], 0.0), float(rec["max_abs_logit_diff"])
            )
    return {
        "compared_requests": requests,
        "max_abs_logit_diff": max(per_test.values(), default=None),
        "per_test_max_abs_logit_diff": dict(sorted(per_test.items())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N (default cuda)")
    ap.add_argument(
        "--examples",
        type=int,
        default=6,
        help="Hypothesis examples per property test (default 6: the suite took 112.5 s on one H200)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default bench/results/fidelity_<device>.json)",
    )
    ap.add_argument(
        "--timeout-s", type=int, default=600, help="kill pytest after this many seconds"
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="pytest processes sharing the device (default: 1 on cpu, up to 4 on cuda)",
    )
    ap.add_argument(
        "-k", dest="keyword", default=None, help="pytest -k expression (a subset of the suite)"
    )
    args = ap.parse_args()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.examples < 1:
        ap.error("--examples must be at least 1")

    short, described = device_info(args.device)
    jobs = args.jobs or (min(4, max(1, (os.cpu_count() or 2) // 4)) if args.device != "cpu" else 1)
    out = args.out or REPO / "bench" / "results" / f"fidelity_{short}.json"
    with tempfile.TemporaryDirectory(prefix="fidelity_") as tmp_s:
        tmp = Path(tmp_s)
        ini, diffs = tmp / "pytest.ini", tmp / "diffs.jsonl"
        write_ini(ini)
        base = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(REPO)]
        base += ["-p", "no:cacheprovider", "-q"]
        select = [*SUITE, *(["-k", args.keyword] if args.keyword else [])]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p
            ),
            "ADAPTERMESH_TEST_DEVICE": args.device,
            "ADAPTERMESH_FIDELITY_EXAMPLES": str(args.examples),
            "ADAPTERMESH_FIDELITY_DIFF_LOG": str(diffs),
            "HYPOTHESIS_PROFILE": "ci",  # derandomized: the same examples on every run
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            # The processes share the host's cores instead of each taking all of them.
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs)),
        }
        t0 = time.monotonic()
        if jobs > 1:
            listed = subprocess.run(
                [*base, "--collect-only", *select], cwd=REPO, env=env, check=False,
                capture_output=True, text=True,
            )  # fmt: skip
            node_ids = [ln for ln in listed.stdout.splitlines() if "::" in ln]
            if listed.returncode != 0 or not node_ids:
                print(listed.stdout[-4000:], listed.stderr[-4000:], sep="\n")
                raise SystemExit(f"collecting the suite failed (exit {listed.returncode})")
            groups = shard(node_ids, jobs)
        else:
            groups = [select]
        xmls = [tmp / f"junit_{i}.xml" for i in range(len(groups))]
        cmds = [[*base, "-rfE", f"--junitxml={x}", *g] for x, g in zip(xmls, groups, strict=True)]
        logs = [open(tmp / f"pytest_{i}.log", "w+") for i in range(len(cmds))]  # noqa: SIM115
        procs = [
            subprocess.Popen(c, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
            for c, f in zip(cmds, logs, strict=True)
        ]
        timed_out = False
        rcs: list[int] = []
        for proc in procs:
            left = max(1.0, args.timeout_s - (time.monotonic() - t0))
            try:
                rcs.append(proc.wait(timeout=left))
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                rcs.append(124)
        duration = time.monotonic() - t0
        for i, f in enumerate(logs):
            f.seek(0)
            tail = f.read()[-3000:]
            f.close()
            print(f"--- shard {i} (exit {rcs[i]}) ---\n{tail}")
        rc = 0 if all(r == 0 for r in rcs) else next(r for r in rcs if r != 0)
        result = parse_junit([x for x in xmls if x.exists()])
        diff = read_diffs(diffs)
        pytest_command = shlex.join(
            ["python3", *base[1:], "-rfE", "--junitxml=$TMP/junit.xml", *select]
        )
        pytest_command = pytest_command.replace(str(tmp), "$TMP")

    record = {
        "what": "fidelity suite (tests/worker/test_fidelity*.py): engine vs transformers + peft, token for token, "
        "logits within tolerance, on tiny random models and adapters",
        "device": args.device,
        "device_name": described,
        "dtype": "float32 (engine and reference; IEEE fp32 products in the Triton kernels)",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python3", "bench/fidelity_gpu.py", *sys.argv[1:]]),
        "pytest_command": pytest_command,
        "pytest_processes": len(groups),
        "hypothesis_examples_per_property": args.examples,
        "versions": {lib: _version(lib) for lib in _LIBS} | {"python": sys.version.split()[0]},
        "pytest_exit_codes": rcs,
        "timed_out": timed_out,
        "duration_s": round(duration, 1),
        **result["counts"],
        "failures": result["failures"],
        "skipped_tests": result["skipped"],
        "slowest_tests_s": result["slowest_tests_s"],
        **diff,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    c = result["counts"]
    print(
        f"fidelity on {described}: {c.get('passed')} passed, {c.get('failed')} failed, {c.get('errors')} errors, "
        f"{c.get('skipped')} skipped in {duration:.1f}s; max |logit diff| {diff['max_abs_logit_diff']}; wrote {out}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
