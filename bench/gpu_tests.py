"""Run a pytest selection and write its outcome as JSON (the program that ran the tests writes
the file): passed/failed/skipped counts, failing test ids with their messages, the machine.

Usage: python3 bench/gpu_tests.py --out gpu_tests.json [--timeout-s 150] -- -m gpu tests/kernels
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# A minimal ini, so the run needs nothing but the repository and the installed packages.
INI = "[pytest]\nmarkers =\n  gpu: gpu\n  slow: slow\n  root: root\n  e2e: e2e\n"


def versions() -> dict[str, str]:
    out: dict[str, str] = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # a missing package is reported, not fatal
            out[mod] = f"unavailable ({type(e).__name__})"
    try:
        import torch

        out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:
        out["device"] = "unknown"
    return out


def summarise(xml_path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    if not xml_path.exists():
        return {**counts, "failures": failures, "note": "no junit report (run killed?)"}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            counts["failed" if bad[0].tag == "failure" else "errors"] += 1
            failures.append({"test": tid, "kind": bad[0].tag,
                             "message": (bad[0].get("message") or "")[:600]})  # fmt: skip
        elif any(c.tag == "skipped" for c in case):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text(INI)
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(ROOT),
               "-p", "no:cacheprovider", "-q", f"--junitxml={xml}", *args.pytest_args]  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s, text=True,
                                  capture_output=True)  # fmt: skip
            rc: int | str = proc.returncode
            tail = proc.stdout[-3000:]
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            tail = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")[-3000:]
        wall = time.monotonic() - t0
        res = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python3", "bench/gpu_tests.py", *sys.argv[1:]]),
            "pytest_args": args.pytest_args, "versions": versions(), "returncode": rc,
            "wall_s": round(wall, 1), **summarise(xml), "output_tail": tail,
        }  # fmt: skip
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{res['passed']} passed, {res['failed']} failed, {res['errors']} errors, "
          f"{res['skipped']} skipped in {wall:.0f}s (rc {rc})")  # fmt: skip
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
