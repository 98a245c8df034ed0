"""Shared pytest configuration: marker gating.

- ``gpu`` tests skip without CUDA (CI has none). With ``REQUIRE_GPU=1`` (the GPU scripts in
  ``bench/`` set it) a missing or broken CUDA install fails the run instead, so it cannot
  look green on the GPU machine.
- ``root`` tests need root: CI runs as root, so they run there. Nothing is skipped for a
  missing install step: scripts/setup.sh checks every import the tests need.
- ``--order reverse`` or ``--order shuffle`` (seed ``--order-seed``, printed in the header)
  runs each file's tests in another order, to show that no test leans on what an earlier
  one left behind.
"""

from __future__ import annotations

import os
import random
from itertools import groupby

import pytest
from hypothesis import settings

# CI explores a fixed set of examples, so a run is reproducible; developers' runs explore
# fresh random examples (HYPOTHESIS_PROFILE=dev, the default outside CI).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--order", choices=("file", "reverse", "shuffle"), default="file",
                     help="order of the tests inside each file")
    parser.addoption("--order-seed", type=int, default=None,
                     help="seed of --order shuffle (random when not given)")


def _order_seed(config: pytest.Config) -> int:
    seed = config.getoption("--order-seed")
    if seed is None:
        seed = random.randrange(1 << 32)
        config.option.order_seed = seed
    return int(seed)


def pytest_report_header(config: pytest.Config) -> str | None:
    order = config.getoption("--order")
    if order == "shuffle":
        return f"test order: shuffle, --order-seed {_order_seed(config)}"
    return None if order == "file" else f"test order: {order}"


def _reorder(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--order")
    if order == "file":
        return
    rng = random.Random(_order_seed(config))
    out: list[pytest.Item] = []
    for _, group in groupby(items, key=lambda item: item.nodeid.split("::")[0]):
        tests = list(group)
        if order == "reverse":
            tests.reverse()
        else:
            rng.shuffle(tests)
        out.extend(tests)
    items[:] = out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # torch is a hard dependency; an import failure is a broken install
        raise
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _reorder(config, items)
    has_gpu = _cuda_available()
    if os.environ.get("REQUIRE_GPU") == "1" and not has_gpu:
        raise pytest.UsageError("REQUIRE_GPU=1 but torch sees no CUDA device: the GPU install is broken")
    is_root = os.geteuid() == 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_root = pytest.mark.skip(reason="needs root (eBPF, network namespaces)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "root" in item.keywords and not is_root:
            item.add_marker(skip_root)
