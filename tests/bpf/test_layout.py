"""The Python mirrors of classifier.h agree with the structs bcc compiled."""

from __future__ import annotations

import ctypes

import pytest

from adaptermesh.bpf import loader
from adaptermesh.bpf.loader import BpfShardTable

pytestmark = pytest.mark.root


@pytest.mark.parametrize(
    ("map_name", "part", "mirror"),
    [
        ("am_pins", "Key", loader.AmLpmKey),
        ("am_flows", "Leaf", loader.AmFlow),
        ("am_shards", "Leaf", loader.AmShard),
        ("am_ctl", "Leaf", loader.AmCtl),
        ("am_stats", "sLeaf", loader.AmStats),
    ],
)
def test_mirror_sizes_match(
    table: BpfShardTable, map_name: str, part: str, mirror: type[ctypes.Structure]
) -> None:
    compiled = getattr(table._bpf[map_name.encode()], part)
    assert ctypes.sizeof(compiled) == ctypes.sizeof(mirror)


def test_event_and_table_sizes(table: BpfShardTable) -> None:
    # struct am_event is not a map value, so bcc has no ctypes twin: 8 + 16 + 4 + 4 + 8.
    assert ctypes.sizeof(loader.AmEvent) == 40
    maglev_leaf = table._bpf[b"am_maglev"].Leaf
    assert ctypes.sizeof(maglev_leaf) == 2 * table.maglev_size
