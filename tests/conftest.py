"""Shared pytest configuration: marker gating.

- ``gpu`` tests skip without CUDA (CI has none). With ``REQUIRE_GPU=1`` (the GPU scripts in
  ``bench/`` set it) a missing or broken CUDA install fails the run instead, so it cannot
  look green on the GPU machine.
- ``root`` tests need root: CI runs as root, so they run there. Nothing is skipped for a
  missing install step: scripts/setup.sh checks every import the tests need.
- ``--order reverse`` or ``--order shuffle`` runs the tests in another order, to show that no
  test leans on what an earlier one left behind. ``make test`` (so CI) shuffles; the seed is
  printed in the header, and ``TEST_ORDER_SEED=N make test`` (or ``--order-seed N``) repeats
  a run's order. ``TEST_ORDER`` sets the default of ``--order``.

  The order changes inside a directory, never across directories: the files of one
  directory are shuffled, then each file's classes, then each class's tests (so class- and
  module-scoped fixtures are still set up once). Directories keep their collection order:
  the order of parts is part of how the suite is read.
- Without CUDA the whole session runs Triton's interpreter (set below, before any test
  module is imported), so the kernel tests run the real kernels on the CPU.
- ``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): most of
  a serial run waits on servers it started, so two workers on two cores overlap one's waits
  with the other's work. Tests that use the host's shared network and BPF state (``root`` and
  ``e2e`` tests, everything under tests/bpf, which share a session topology) form one group,
  ``host``, that runs on one worker, one test at a time and in the shuffled order, first; the
  other worker takes the rest, and both take what is left. Every worker arranges the tests
  with the controller's seed, so the order is the same everywhere. Each worker's torch runs
  its CPU operators on its share of the CPUs (set below).
"""

from __future__ import annotations

import os
import random
from itertools import groupby

import pytest
import torch
from hypothesis import settings

# Triton decides interpreted-or-compiled when a function is decorated, its own standard
# library (tl.zeros, tl.sum, ...) included, and that happens the first time anything imports
# triton: a test module of another part collected before tests/kernels may import the worker
# (so triton) first. Without CUDA the whole session runs the interpreter, set here, before
# any test module is imported (this file is loaded first whatever paths a run names).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# torch sizes each process's OpenMP pool from the CPUs it can see, so two pytest-xdist workers
# on two cores run four threads that spin while they wait for each other, and every CPU
# operator waits on threads the kernel has descheduled (tests/worker/test_dora.py with
# test_equivalence.py on two workers: 89 s with the default pools, 31 s with one thread each).
# Each worker takes its share of the CPUs; a run in one process keeps torch's default. The
# processes tests start (workers, ranks) choose their own (``--cpu-threads``).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS))

# CI explores a fixed set of examples, so a run is reproducible; developers' runs explore
# fresh random examples (HYPOTHESIS_PROFILE=dev, the default outside CI). No test here checks
# time (the benches do), so CI has no per-example deadline: on a loaded two-core machine an
# example past Hypothesis's 200 ms default would fail a test that checks something else.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


_ORDERS = ("file", "reverse", "shuffle")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--order",
        choices=_ORDERS,
        default=_env_order(),
        help="order of the tests inside each directory (default: $TEST_ORDER or file)",
    )
    parser.addoption(
        "--order-seed",
        type=int,
        default=_env_seed(),
        help="seed of --order shuffle (default: $TEST_ORDER_SEED, else random)",
    )


def _env_order() -> str:
    order = os.environ.get("TEST_ORDER", "file")
    if order not in _ORDERS:
        raise pytest.UsageError(f"TEST_ORDER={order!r}: want one of {', '.join(_ORDERS)}")
    return order


def _env_seed() -> int | None:
    text = os.environ.get("TEST_ORDER_SEED", "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"TEST_ORDER_SEED={text!r}: want a whole number") from None


def _order_seed(config: pytest.Config) -> int:
    seed = config.getoption("--order-seed")
    workerinput = getattr(config, "workerinput", None)
    if seed is None and workerinput is not None:
        seed = workerinput.get("order_seed")  # the controller's, so every worker agrees
        config.option.order_seed = seed
    if seed is None:
        seed = random.randrange(1 << 32)
        config.option.order_seed = seed
    return int(seed)


def pytest_report_header(config: pytest.Config) -> str | None:
    order = config.getoption("--order")
    if order == "shuffle":
        seed = _order_seed(config)
        return f"test order: shuffle, seed {seed} (repeat: TEST_ORDER_SEED={seed} or --order-seed {seed})"
    return None if order == "file" else f"test order: {order}"


def _levels(item: pytest.Item) -> tuple[str, ...]:
    """The groups an item sits in, outermost first: its directory, its file, its class."""
    path, _, rest = item.nodeid.partition("::")
    directory, _, _ = path.rpartition("/")
    parts = rest.split("::")
    return (directory, path, *("::".join(parts[: i + 1]) for i in range(len(parts) - 1)))


def _arrange(
    items: list[pytest.Item], depth: int, order: str, rng: random.Random
) -> list[pytest.Item]:
    # Items that share a group at ``depth`` stay together; the groups (and the items that
    # sit directly at this depth) are reordered, then each group inside.
    blocks: list[list[pytest.Item]] = []
    for key, group in groupby(items, key=lambda item: _group_key(item, depth)):
        tests = list(group)
        if key is None:
            blocks.extend([t] for t in tests)
        else:
            blocks.append(_arrange(tests, depth + 1, order, rng))
    if depth > 0:  # directories (depth 0) keep their order
        if order == "reverse":
            blocks.reverse()
        else:
            rng.shuffle(blocks)
    return [t for block in blocks for t in block]


def _group_key(item: pytest.Item, depth: int) -> str | None:
    levels = _levels(item)
    return levels[depth] if depth < len(levels) else None


def _reorder(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--order")
    if order == "file":
        return
    items[:] = _arrange(items, 0, order, random.Random(_order_seed(config)))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # torch is a hard dependency; an import failure is a broken install
        raise
    return bool(torch.cuda.is_available())


class _XdistSeed:
    """Hands the controller's order seed to each xdist worker (registered when xdist is)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_configure_node(self, node: object) -> None:
        node.workerinput["order_seed"] = _order_seed(self.config)  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_XdistSeed(config), "adaptermesh-xdist-seed")


# Tests that share the host's network namespaces, interfaces, BPF pins and the bpf tests'
# session topology: one xdist group, one worker, one at a time.
_HOST_GROUP = "host"


def _uses_the_host(item: pytest.Item) -> bool:
    return "root" in item.keywords or "e2e" in item.keywords or item.nodeid.startswith("tests/bpf/")


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each item is collected, before any plugin's pytest_collection_modifyitems
    # (xdist's worker reads the xdist_group marks in its own).
    if getattr(item.config.option, "loadgroup", False) and _uses_the_host(item):
        item.add_marker(pytest.mark.xdist_group(_HOST_GROUP))


def _group_host_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    # An xdist worker of a --dist loadgroup run (its own "dist" option reads "no").
    if not getattr(config.option, "loadgroup", False):
        return
    # The group is the longest chain of work: it starts first, the rest fills the other worker.
    host = [item for item in items if _uses_the_host(item)]
    chosen = set(map(id, host))
    items[:] = host + [item for item in items if id(item) not in chosen]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _reorder(config, items)
    _group_host_tests(config, items)
    has_gpu = _cuda_available()
    if os.environ.get("REQUIRE_GPU") == "1" and not has_gpu:
        raise pytest.UsageError(
            "REQUIRE_GPU=1 but torch sees no CUDA device: the GPU install is broken"
        )
    is_root = os.geteuid() == 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_root = pytest.mark.skip(reason="needs root (eBPF, network namespaces)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "root" in item.keywords and not is_root:
            item.add_marker(skip_root)
