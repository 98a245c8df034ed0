"""What every CPU bench writes beside its figures: when, by which command, on which machine
(with the 1-minute load average, since these boxes are shared), and the JSON file itself."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def source_revision() -> str | None:
    """The commit the bench ran from, ``+changes`` when the tree (results files aside) differed
    from it; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!bench/results",  # other results written since are not the code's state
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changed else "")


def provenance(
    *packages: str, load_start: float | None = None, source: str | None = None
) -> dict[str, Any]:
    """``date``, ``command``, ``source`` (the commit; pass the one read when the run began,
    since commits made while a long run goes on are not what it ran) and ``machine`` (with the
    versions of ``packages``)."""
    machine: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    if load_start is not None:
        machine["loadavg_1m_start"] = round(load_start, 2)
    machine["loadavg_1m"] = round(os.getloadavg()[0], 2)
    machine["python"] = platform.python_version()
    for name in packages:
        machine[name] = importlib.metadata.version(name)
    gpu = _gpu_name()
    if gpu is not None:
        machine["gpu"] = gpu
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "source": source if source is not None else source_revision(),
        "machine": machine,
    }


def _gpu_name() -> str | None:
    """The CUDA device's name where torch is already imported and sees one (a bench that
    never imported torch is not made to)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:  # a broken CUDA install: the figures say so themselves
        return None
    return None


def write_results(path: str | Path, doc: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
