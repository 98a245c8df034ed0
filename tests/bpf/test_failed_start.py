"""A classifier start that fails leaves none of its own pinned maps behind, and never removes
the pins an earlier run left for a restart to resume from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adaptermesh.bpf.loader import MAP_NAMES, BpfShardTable

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (eBPF)"),
]

NO_IFACE = "amnoiface0"


def _pins(pin_dir: Path) -> set[str]:
    return {p.name for p in pin_dir.iterdir()} if pin_dir.exists() else set()


def test_failed_attach_removes_the_pins_it_created(pin_dir: Path) -> None:
    table = BpfShardTable(NO_IFACE, pin_dir=str(pin_dir), maglev_size=251)
    assert _pins(pin_dir) == set(MAP_NAMES)  # bcc pinned every map at load
    with pytest.raises(ValueError, match=f"no interface '{NO_IFACE}'"):
        table.attach()
    table.discard()
    assert not pin_dir.exists()


def test_failed_attach_keeps_an_earlier_runs_pins(pin_dir: Path) -> None:
    earlier = BpfShardTable("lo", pin_dir=str(pin_dir), maglev_size=251)
    earlier.close(detach=False)  # a stopped agent: its pins stay for the next start
    before = {name: (pin_dir / name).stat().st_ino for name in MAP_NAMES}
    table = BpfShardTable(NO_IFACE, pin_dir=str(pin_dir), maglev_size=251)
    with pytest.raises(ValueError):
        table.attach()
    table.discard()
    assert {name: (pin_dir / name).stat().st_ino for name in MAP_NAMES} == before
    # and the next start resumes from them
    again = BpfShardTable("lo", pin_dir=str(pin_dir), maglev_size=251)
    again.close(unpin=True)


def test_a_load_that_fails_leaves_no_pins(pin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: BpfShardTable) -> None:
        raise RuntimeError("pinned map unreadable")

    monkeypatch.setattr(BpfShardTable, "_load_shadow", broken)
    with pytest.raises(RuntimeError, match="unreadable"):
        BpfShardTable("lo", pin_dir=str(pin_dir), maglev_size=251)
    assert not pin_dir.exists()
