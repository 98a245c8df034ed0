"""Threads in network namespaces: ``inside`` comes back only on its own thread, ``enter`` stays.

A block of ``inside`` left suspended (a context entered by a pool thread and never exited, a
generator dropped mid-block) is closed later by the garbage collector, on whatever thread runs
the collection. Switching that thread back to the namespace the block came from moved an
unrelated worker thread out of its namespace: its next bind to a local address failed with
EADDRNOTAVAIL.
"""

from __future__ import annotations

import contextlib
import gc
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest

from adaptermesh.bpf.namespace import enter, inside

pytestmark = [pytest.mark.root]

ADDR = "10.98.0.5"


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"amns{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ADDR}/32", "dev", "lo"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _can_bind() -> bool:
    with socket.socket() as s:
        try:
            s.bind((ADDR, 0))
        except OSError:
            return False
        return True


def _on_thread(fn: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


class _Cycle:
    """Held only by a reference cycle, so only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self
        self.stacks: list[contextlib.ExitStack] = []


def test_a_block_left_suspended_does_not_move_the_thread_that_collects_it(netns: str) -> None:
    holder = _Cycle()

    def park(stacks: list[contextlib.ExitStack] = holder.stacks) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(inside(netns))  # entered on this thread, never exited
        stacks.append(stack)

    _on_thread(park)
    del holder, park
    seen: list[bool] = []

    def work() -> None:
        with inside(netns):
            seen.append(_can_bind())
            gc.collect()  # the parked block is closed here, on this thread
            seen.append(_can_bind())

    _on_thread(work)
    assert seen == [True, True]


def test_inside_comes_back_on_its_own_thread(netns: str) -> None:
    seen: list[bool] = []

    def work() -> None:
        seen.append(_can_bind())
        with inside(netns):
            seen.append(_can_bind())
        seen.append(_can_bind())

    _on_thread(work)
    assert seen == [False, True, False]


def test_enter_stays_and_leaves_nothing_for_the_collector(netns: str) -> None:
    seen: list[bool] = []

    def work() -> None:
        enter(netns)
        seen.append(_can_bind())
        gc.collect()
        seen.append(_can_bind())

    _on_thread(work)
    assert seen == [True, True]
    assert not _can_bind()  # the caller's thread never moved


def test_enter_names_a_namespace_that_does_not_exist() -> None:
    def work() -> None:
        enter(f"amns-missing-{secrets.token_hex(3)}")

    with pytest.raises(FileNotFoundError):
        _on_thread(work)
