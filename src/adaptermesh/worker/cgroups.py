"""The cgroup directories whose limits bind this process, for CPU threads (cpu_threads.py)
and memory sizing (sizing.py).

A limit may sit on the process's own cgroup or on any cgroup above it (a pod's limit is on the
pod, its container's cgroup below it may have none), so every directory from the process's
cgroup up to the mount is returned: the caller takes the tightest. cgroup v2 (the unified
mount, ``0::<path>`` in ``/proc/self/cgroup``) first, then the v1 controller's own mount
(``cpu``, ``cpu,cpuacct``, ``memory`` ...). Inside a container whose cgroup namespace hides the
host's path, the mount itself is the process's cgroup, and only the directories that exist are
returned. Without a readable ``/proc/self/cgroup`` the mounts' tops are read, as a container
sees its own cgroup there.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CGROUP_ROOT", "PROC_SELF_CGROUP", "limit_dirs", "read_limit_file"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _paths(proc_cgroup: Path, controller: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 path for ``controller`` (None: none)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return "/", "/"
    v2: str | None = None
    v1: str | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(mount: Path, path: str) -> list[Path]:
    rel = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    dirs = [mount.joinpath(*rel[:i]) for i in range(len(rel), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v1_mount(root: Path, controller: str) -> Path | None:
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir())
    except OSError:
        return None
    for name in names:
        if controller in name.split(","):
            return root / name
    return None


def limit_dirs(
    controller: str, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> list[Path]:
    """The directories whose ``controller`` limit files bind this process: its v2 cgroup and
    the ones above it, then its v1 ``controller`` cgroup and the ones above it."""
    v2, v1 = _paths(proc_cgroup, controller)
    dirs: list[Path] = []
    if v2 is not None:
        dirs += _ancestors(root, v2)
    if v1 is not None:
        mount = _v1_mount(root, controller)
        if mount is not None:
            dirs += _ancestors(mount, v1)
    return dirs


def read_limit_file(path: Path) -> str | None:
    """The file's text, stripped; None when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None
