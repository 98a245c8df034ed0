"""Run a block inside another network namespace, on the calling thread only.

:class:`~adaptermesh.bpf.loader.BpfShardTable` takes ``netns`` to drive an interface that lives
in another namespace: it opens its netlink socket and resolves interface indexes in there.
setns affects only the calling thread, so sockets made inside keep working from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

__all__ = ["CLONE_NEWNET", "enter", "inside"]

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


def enter(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` for good (a thread that lives
    there, such as a pool's worker): nothing is left to undo, so nothing can undo it later."""
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target, ns)
    finally:
        os.close(target)


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the block in network namespace ``ns`` (this thread only).

    The way back is taken only on the thread that came in. A block left suspended (a
    generator dropped mid-block, a context entered and never exited) is closed by the garbage
    collector on whichever thread happens to run it; switching *that* thread's namespace would
    move an unrelated thread out of the one it works in.
    """
    # The Thread object itself (held here, so never reused), not get_ident(): a new thread
    # may get the identifier of one that ended.
    thread = threading.current_thread()
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target, ns)
        try:
            yield
        finally:
            if threading.current_thread() is thread:
                _setns(own, "back")
    finally:
        os.close(own)
        os.close(target)
