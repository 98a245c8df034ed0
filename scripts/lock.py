#!/usr/bin/env python3
"""Write the dependency locks in requirements/ (``make lock``).

Each environment the project installs has one fully pinned lock with hashes, resolved by
``uv pip compile`` from pyproject.toml's ranges:

| lock                 | installs                          | Python | torch                     |
|----------------------|-----------------------------------|--------|---------------------------|
| dev.lock             | scripts/setup.sh (dev, CI)        | 3.11   | 2.13.0+cpu                |
| agent.lock           | deploy/docker/agent.Dockerfile    | 3.11   | -                         |
| control-plane.lock   | deploy/docker/control-plane...    | 3.11   | -                         |
| bridge.lock          | deploy/docker/bridge.Dockerfile   | 3.11   | -                         |
| worker-cpu.lock      | a CPU worker (values-cpu-demo)    | 3.11   | 2.13.0+cpu                |
| worker-cuda.lock     | deploy/docker/worker.Dockerfile   | 3.12   | 2.11.0 (the index's CUDA) |

dev.lock is resolved first; every other lock is resolved with it as constraints, so a package
any two environments share has one version everywhere, the one the suite ran with. The
CUDA worker differs only where its Python or its torch demands (torch, triton, the CUDA
libraries, and backports that Python 3.12 does not need).

The build tools (pip, setuptools, wheel) are locked too: the package is built with
``--no-build-isolation`` from the locked ones, so no install reaches for an unpinned tool.

``--check`` resolves again into a temporary folder and exits 1 when a lock would change
(the periodic refresh is ``make lock``, then the suite, then one commit).

The CPU build of torch is not on the default index: it is found through pip's ``find-links``
(``PIP_FIND_LINKS``, where this machine keeps the wheel) or ``--find-links DIR``.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK_DIR = REPO / "requirements"

# The releases of torch each environment is locked to: the CPU build that developer and CI
# machines run, and the CUDA build the GPU tests and benchmarks ran with.
TORCH_CPU = "torch==2.13.0+cpu"
TORCH_CUDA = "torch==2.11.0"

# name -> (extra, python, torch pin or None, constrained by dev.lock)
LOCKS: dict[str, tuple[str, str, str | None]] = {
    "dev": ("dev", "3.11", TORCH_CPU),
    "agent": ("agent", "3.11", None),
    "control-plane": ("control-plane", "3.11", None),
    "bridge": ("bridge", "3.11", None),
    "worker-cpu": ("worker", "3.11", TORCH_CPU),
    "worker-cuda": ("worker", "3.12", TORCH_CUDA),
}
BUILD_TOOLS = LOCK_DIR / "build.in"
# Pins of dev.lock that another environment's torch or Python replaces (torch 2.11 on
# Python 3.12 asks for setuptools<82).
_NOT_SHARED = re.compile(r"^(torch|triton|setuptools|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==", re.I)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def uv() -> str:
    """The uv executable at the release dev.lock pins: the dev environment's, else one on
    PATH (the first lock takes any)."""
    dev = LOCK_DIR / "dev.lock"
    wanted = pins(dev).get("uv") if dev.exists() else None
    for candidate in (REPO / ".venv" / "bin" / "uv", shutil.which("uv")):
        if candidate and Path(candidate).exists():
            out = subprocess.run(
                [str(candidate), "--version"], capture_output=True, text=True, check=False
            ).stdout
            if wanted is None or out.split()[1:2] == [wanted]:
                return str(candidate)
    sys.exit(f"lock: uv {wanted} is needed (make setup installs it into .venv)")


def pins(lock: Path) -> dict[str, str]:
    """name (canonical) -> version of every package a lock pins."""
    out: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        m = _PIN.match(line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def _find_links(args: argparse.Namespace) -> list[str]:
    links = list(args.find_links or [])
    env = os.environ.get("PIP_FIND_LINKS", "")
    links += [x for x in env.split() if x]
    return [f"--find-links={x}" for x in dict.fromkeys(links)]


def compile_lock(name: str, out_dir: Path, args: argparse.Namespace) -> Path:
    extra, python, torch = LOCKS[name]
    out = out_dir / f"{name}.lock"
    with tempfile.TemporaryDirectory() as tmp:
        overrides = Path(tmp) / "overrides.txt"
        overrides.write_text(f"{torch}\n" if torch else "")
        cmd = [
            uv(),
            "pip",
            "compile",
            "--quiet",
            "--generate-hashes",
            "--no-header",
            "--python-version",
            python,
            "--python-platform",
            "x86_64-manylinux_2_28",
            "--extra",
            extra,
            "--overrides",
            str(overrides),
            *_find_links(args),
            "-o",
            str(out),
            "pyproject.toml",
            str(BUILD_TOOLS.relative_to(REPO)),
        ]
        if name != "dev":
            shared = Path(tmp) / "dev-pins.txt"
            dev = out_dir / "dev.lock"
            shared.write_text(
                "".join(
                    f"{line.split()[0]}\n"
                    for line in dev.read_text().splitlines()
                    if _PIN.match(line) and not _NOT_SHARED.match(line)
                )
            )
            cmd += ["--constraints", str(shared)]
        # Resolution for another Python needs no interpreter of it: never download one.
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        subprocess.run(cmd, cwd=REPO, check=True, env=env)
    # The constraints file lives in a temporary folder: name it by what it holds (dev.lock's
    # pins), so a lock written again from the same inputs is the same file.
    text = out.read_text().replace(str(overrides), f"scripts/lock.py ({torch})")
    if name != "dev":
        text = text.replace(str(shared), "requirements/dev.lock")
    out.write_text(text)
    header = (
        f"# The {name} environment: adaptermesh[{extra}] on Python {python}, x86-64 Linux"
        + (f", {torch}" if torch else "")
        + ".\n# Written by `make lock` (scripts/lock.py) with uv; do not edit by hand.\n"
    )
    out.write_text(header + out.read_text())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--check", action="store_true", help="exit 1 if a lock would change")
    p.add_argument("--find-links", action="append", help="where the CPU torch wheel lies")
    p.add_argument("--only", choices=sorted(LOCKS), action="append")
    args = p.parse_args()
    names = args.only or list(LOCKS)
    if "dev" in names:
        names = ["dev", *(n for n in names if n != "dev")]
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        if "dev" not in names:
            shutil.copy(LOCK_DIR / "dev.lock", out_dir / "dev.lock")
        written = [compile_lock(name, out_dir, args) for name in names]
        # Every lock resolved before any is replaced: a failure leaves the set as it was.
        changed = []
        for fresh in written:
            current = LOCK_DIR / fresh.name
            if not current.exists() or not filecmp.cmp(fresh, current, shallow=False):
                changed.append(fresh.name)
                if not args.check:
                    shutil.copy(fresh, current)
    for name in changed:
        print(f"{'would change' if args.check else 'wrote'} requirements/{name}")
    if not changed:
        print("locks unchanged")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
