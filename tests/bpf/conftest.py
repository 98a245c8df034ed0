"""Fixtures for the classifier's kernel tests: one compiled classifier and one namespace
topology per session (bcc takes seconds per compile), torn down even on failure.

Every namespace and device starts with ``amb``; pins live under /sys/fs/bpf/amb-test-<hex>.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptermesh.bpf.loader import BpfShardTable
from adaptermesh_testkit.netns import NodeTopology, delete_namespaces


def _rm_pins(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def topo() -> Iterator[NodeTopology]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    t = NodeTopology(prefix=f"amb{secrets.token_hex(2)}")
    t.create()
    try:
        yield t
    finally:
        t.destroy()


@pytest.fixture(scope="session")
def table(topo: NodeTopology) -> Iterator[BpfShardTable]:
    pin_dir = Path(f"/sys/fs/bpf/amb-test-{secrets.token_hex(4)}")
    tb: BpfShardTable | None = None
    try:
        tb = BpfShardTable(
            topo.node_tenant_if,
            pin_dir=str(pin_dir),
            vxlan_dev=topo.vxlan_dev,
            netns=topo.node_ns,
        )
        tb.attach()
        yield tb
    finally:
        if tb is not None:
            tb.close(detach=True, unpin=True)
        _rm_pins(pin_dir)


@pytest.fixture
def fresh(table: BpfShardTable) -> BpfShardTable:
    """The session table with no sticky flows and no queued events."""
    table.clear_flows()
    table.poll_events(lambda _e: None, 0)
    return table


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    path = Path(f"/sys/fs/bpf/amb-test-{secrets.token_hex(4)}")
    try:
        yield path
    finally:
        _rm_pins(path)


@pytest.fixture
def small_topo() -> Iterator[NodeTopology]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    prefix = f"amb{secrets.token_hex(2)}"
    t = NodeTopology(prefix=prefix, n_shards=2)
    try:
        t.create()
        yield t
    finally:
        t.destroy()
        delete_namespaces(f"{prefix}-")
