#!/usr/bin/env python3
"""Hold an installed environment to a lock in requirements/.

    lock_env.py check LOCK   exit 1, listing each difference, unless the running Python's
                             environment holds exactly the lock's packages at its versions
    lock_env.py prune LOCK   uninstall what the lock does not name (scripts/setup.sh runs it
                             after installing the lock, so a reused venv loses strays)

The package itself and its test kit (adaptermesh and adaptermesh-testkit, installed editable
from the tree) are not in any lock.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# Installed beside the lock by the tree itself, never by the lock.
_OWN = frozenset({"adaptermesh", "adaptermesh-testkit"})


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(lock: Path) -> dict[str, str]:
    """name (canonical) -> version of every package the lock pins."""
    out: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        m = _PIN.match(line)
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def installed() -> dict[str, str]:
    """name (canonical) -> version of every distribution the running Python sees in its
    environment (not the bcc shim, which is Debian's and carries no metadata)."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            out[canonical(name)] = dist.version
    return out


def differences(lock: Path) -> list[str]:
    want = lock_pins(lock)
    have = installed()
    diffs = []
    for name, version in sorted(want.items()):
        got = have.get(name)
        if got is None:
            diffs.append(f"{name}=={version}: not installed")
        elif got != version:
            diffs.append(f"{name}=={version}: {got} installed")
    for name in sorted(set(have) - set(want) - _OWN):
        diffs.append(f"{name}=={have[name]}: installed, not in {lock.name}")
    return diffs


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("check", "prune"):
        print(__doc__, file=sys.stderr)
        return 2
    verb, lock = argv[0], Path(argv[1])
    if verb == "prune":
        strays = sorted(set(installed()) - set(lock_pins(lock)) - _OWN)
        if strays:
            print(f"[setup] removing packages {lock.name} does not name: {' '.join(strays)}")
            subprocess.run(
                [sys.executable, "-m", "pip", "uninstall", "-q", "-y", *strays], check=True
            )
        return 0
    diffs = differences(lock)
    for line in diffs:
        print(line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
