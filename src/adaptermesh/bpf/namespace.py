"""Run a block inside another network namespace, on the calling thread only.

:class:`~adaptermesh.bpf.loader.BpfShardTable` takes ``netns`` to drive an interface that lives
in another namespace: it opens its netlink socket and resolves interface indexes in there.
setns affects only the calling thread, so sockets made inside keep working from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

__all__ = ["CLONE_NEWNET", "inside"]

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block in network namespace ``ns`` (this thread only)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(own)
        os.close(target)
