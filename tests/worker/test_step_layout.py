"""Step layout and staging: buckets, layouts, the staging vector and the block-table mirror
(host arrays only, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaptermesh.worker.step_layout import (
    BlockTableMirror,
    StepBuffers,
    bucket_for,
    decode_buckets,
    fill_staging,
    mixed_buckets,
    plan_layout,
    split_staging,
    staging_length,
)
from adaptermesh.worker.step_plan import BlockTableUpdate, SamplingRow, ScheduledStep, StepRow
from adaptermesh.worker.types import SamplingParams

BLOCK = 16
_ids = iter(range(1, 1 << 30))


def make_row(
    tokens: list[int],
    *,
    start: int = 0,
    count: int | None = None,
    row: int = 0,
    source_entry: int = -1,
    lora_slot: int = -1,
    samples: bool = True,
) -> StepRow:
    """A step row over ``tokens`` (the sequence's known tokens) from ``start``: a decode row
    (``count`` 1, its input from ``source_entry`` when >= 0) or a prompt chunk."""
    count = len(tokens) - start if count is None else count
    seq_id = next(_ids)
    return StepRow(
        seq_id=seq_id,
        start=start,
        count=count,
        token_ids=() if source_entry >= 0 else tuple(tokens[start : start + count]),
        source_entry=source_entry,
        table_row=row,
        lora_slot=lora_slot,
        sampler=SamplingRow(seq_id, f"r{seq_id}", SamplingParams(), 0, 1) if samples else None,
    )


def decode_row(context: int, **kw: int) -> StepRow:
    """A decode row at position ``context`` (its input the token there, on the host)."""
    return make_row(list(range(context + 1)), start=context, count=1, **kw)


def step(decode: list[StepRow], prefill: list[StepRow] = ()) -> ScheduledStep:  # type: ignore[assignment]
    return ScheduledStep(1, tuple(decode), tuple(prefill))


def layout_of(
    plan: ScheduledStep,
    *,
    graphable: bool = True,
    solo: object = None,
    max_num_seqs: int = 8,
    max_prefill_seqs: int = 2,
    decode_sizes: list[int] | None = None,
    mixed_sizes: list[int] | None = None,
    lora: bool = False,
    lora_density: bool = True,
):  # type: ignore[no-untyped-def]
    slots = {row.lora_slot for row in plan.rows if row.lora_slot >= 0}
    return plan_layout(
        plan,
        graphable=graphable,
        lora=lora,
        active_slots=len(slots),
        lora_density=lora_density,
        lora_side=False,
        random_mode=False,
        solo=solo,  # type: ignore[arg-type]
        decode_sizes=decode_sizes or decode_buckets(max_num_seqs),
        mixed_sizes=mixed_sizes or mixed_buckets(64),
        max_num_seqs=max_num_seqs,
        max_prefill_seqs=max_prefill_seqs,
    )


def test_decode_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert decode_buckets(300)[-6:] == [128, 160, 192, 224, 256, 300]
    assert decode_buckets(400)[-4:] == [256, 320, 384, 400]


def test_mixed_buckets() -> None:
    assert mixed_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert mixed_buckets(100) == [16, 32, 64, 100]
    assert mixed_buckets(8) == []


def test_bucket_for() -> None:
    assert bucket_for(3, [1, 2, 4, 8]) == 4
    assert bucket_for(8, [1, 2, 4, 8]) == 8
    assert bucket_for(9, [1, 2, 4, 8]) is None


def test_split_staging_names_the_same_elements_on_host_and_device() -> None:
    tokens, entries = 5, 3
    size = staging_length(tokens, entries)
    assert size == 5 * tokens + 4 * entries + 1
    host = np.arange(size, dtype=np.int64)
    device = torch.arange(size, dtype=torch.int64)
    host_views, device_views = (
        split_staging(host, tokens, entries),
        split_staging(device, tokens, entries),
    )
    for name in (
        "ids",
        "source_entries",
        "positions",
        "slot_mapping",
        "lora_slots",
        "seq_lens",
        "logits_rows",
        "table_rows",
        "query_start",
    ):
        assert getattr(host_views, name).tolist() == getattr(device_views, name).tolist(), name
    assert host_views.ids.tolist() == [0, 1, 2, 3, 4]
    assert host_views.lora_slots.tolist() == [20, 21, 22, 23, 24]
    assert host_views.seq_lens.tolist() == [25, 26, 27]
    assert host_views.query_start.tolist() == [34, 35, 36, 37]  # entries + 1, ending the vector
    buffers = StepBuffers(tokens, entries, torch.device("cpu"))
    assert buffers.size == size
    buffers.views.query_start.fill_(7)
    assert buffers.device_buffer[-(entries + 1) :].tolist() == [7] * (entries + 1)


def test_decode_only_plans_take_a_decode_bucket() -> None:
    rows = [decode_row(3, row=i) for i in range(3)]
    layout = layout_of(step(rows))
    assert (layout.num_tokens, layout.num_entries, layout.num_decode) == (4, 4, 4)
    assert layout.entries == [*(r.sampler for r in rows), None]
    assert layout.graph_key == ("d", 4, False, False, None, False, False, None)
    assert layout.lora_active_slots is None


def test_mixed_plans_take_a_token_bucket_with_fixed_regions() -> None:
    decode = decode_row(3, row=0)
    whole = make_row(list(range(10)), row=1)
    # The partial chunk does not reach its last token: it samples nothing.
    partial = make_row(list(range(30)), count=8, row=2, samples=False)
    plan = step([decode], [whole, partial])  # 19 tokens
    layout = layout_of(plan, max_num_seqs=4, max_prefill_seqs=3)
    assert (layout.num_tokens, layout.num_entries, layout.num_decode, layout.max_prefill_len) == (
        32,
        7,
        4,
        32,
    )
    assert layout.entries == [decode.sampler, None, None, None, whole.sampler, None, None]
    assert layout.graph_key == ("m", 32, False, False, False, False, None)


def _decode_rows(n: int, adapters: int) -> ScheduledStep:
    return step([decode_row(3, row=i, lora_slot=i % adapters) for i in range(n)])


def test_lora_graphs_are_keyed_by_the_batchs_density() -> None:
    """One adapter over 64 decode rows, two, and 64: three density classes, three graphs,
    each with the kernels' slot bound of its class (dispatch.config_slots)."""
    cases = {1: ("dense", 1), 2: ("mid", 15), 16: ("sparse", None), 64: ("sparse", None)}
    keys = {}
    for adapters, (cls, slots) in cases.items():
        layout = layout_of(_decode_rows(64, adapters), max_num_seqs=64, lora=True)
        assert layout.num_tokens == 64
        assert layout.graph_key[-1] == cls, adapters
        assert layout.lora_active_slots == slots, adapters
        keys[adapters] = layout.graph_key
    assert keys[16] == keys[64]  # one sparse graph serves both
    assert len(set(keys.values())) == 3
    # The same plans without density configs share one graph with the worst case's configs.
    plain = {
        layout_of(_decode_rows(64, a), max_num_seqs=64, lora=True, lora_density=False).graph_key
        for a in cases
    }
    assert len(plain) == 1
    assert (
        layout_of(
            _decode_rows(64, 1), max_num_seqs=64, lora=True, lora_density=False
        ).lora_active_slots
        is None
    )


def test_eager_lora_steps_pick_configs_by_their_own_adapters() -> None:
    layout = layout_of(_decode_rows(5, 3), lora=True, graphable=False)
    assert layout.graph_key is None
    assert layout.lora_active_slots == 3


def test_eager_layout_has_the_plans_own_shape() -> None:
    decode = decode_row(3, row=0)
    chunk = make_row(list(range(10)), row=1)
    plan = step([decode], [chunk])
    for layout in (
        layout_of(plan, graphable=False),
        layout_of(plan, solo=object()),  # a solo expert set never runs mixed graphs
        layout_of(plan, max_prefill_seqs=0),
        layout_of(plan, mixed_sizes=[8]),
    ):
        assert (
            layout.num_tokens,
            layout.num_entries,
            layout.num_decode,
            layout.max_prefill_len,
        ) == (11, 2, 1, 10)
        assert layout.entries == [decode.sampler, chunk.sampler]
        assert layout.graph_key is None


def test_fill_staging_decode_and_prefill_rows() -> None:
    table = np.zeros((4, 4), dtype=np.int32)
    table[0] = [5, 6, 0, 0]
    table[1] = [7, 8, 9, 0]
    # Row 0 decodes position 17 (its second block), its input still on the device (entry 2).
    decode = make_row(list(range(18)), start=17, count=1, row=0, source_entry=2, lora_slot=2)
    # Row 1 prefills positions 14..19 of a 40-token prompt (crossing into block 8).
    chunk = make_row(list(range(100, 140)), start=14, count=6, row=1, samples=False)
    plan = step([decode], [chunk])
    layout = layout_of(plan, graphable=False)
    stage = np.full(staging_length(layout.num_tokens, layout.num_entries), 123, dtype=np.int64)
    ranges = fill_staging(stage, layout, plan, table, BLOCK, pad_row=3)
    assert ranges == [(0, 1), (1, 6)]
    views = split_staging(stage, layout.num_tokens, layout.num_entries)
    assert views.ids.tolist() == [0, *range(114, 120)]
    assert views.source_entries.tolist() == [2, -1, -1, -1, -1, -1, -1]
    assert views.positions.tolist() == [17, *range(14, 20)]
    assert views.slot_mapping.tolist() == [
        6 * BLOCK + 1,
        *(7 * BLOCK + p for p in (14, 15)),
        *(8 * BLOCK + p - BLOCK for p in range(16, 20)),
    ]
    assert views.lora_slots.tolist() == [2, -1, -1, -1, -1, -1, -1]
    assert views.seq_lens.tolist() == [18, 20]
    assert views.logits_rows.tolist() == [0, 6]
    assert views.table_rows.tolist() == [0, 1]
    assert views.query_start.tolist() == [0, 1, 7]


def test_fill_staging_pads_graph_regions() -> None:
    table = np.zeros((3, 2), dtype=np.int32)
    table[0] = [4, 0]
    row = make_row([1, 2, 3, 9], start=3, count=1, row=0)
    plan = step([row])
    layout = layout_of(plan, decode_sizes=[4])
    stage = np.zeros(staging_length(layout.num_tokens, layout.num_entries), dtype=np.int64)
    fill_staging(stage, layout, plan, table, BLOCK, pad_row=2)
    views = split_staging(stage, layout.num_tokens, layout.num_entries)
    assert views.ids.tolist() == [9, 0, 0, 0]  # the token is on the host: no device gather
    assert views.slot_mapping.tolist() == [4 * BLOCK + 3, -1, -1, -1]
    assert views.source_entries.tolist() == [-1] * 4
    assert views.table_rows.tolist() == [0, 2, 2, 2]  # padding entries read the all-zero row
    assert views.query_start.tolist() == [0, 1, 1, 1, 1]


def test_block_table_mirror_writes_each_update_once() -> None:
    mirror = BlockTableMirror(
        rows=2, max_blocks_per_seq=3, block_size=BLOCK, device=torch.device("cpu")
    )
    assert mirror.pad_row == 2
    mirror.apply([BlockTableUpdate(1, 0, (5, 9))])
    assert mirror.table[1].tolist() == [5, 9, 0]
    assert mirror.dirty
    staging = torch.zeros_like(mirror.device_table)
    mirror.upload(staging)
    assert not mirror.dirty
    assert mirror.device_table[1].tolist() == [5, 9, 0]
    mirror.apply([])
    assert not mirror.dirty
    mirror.apply([BlockTableUpdate(1, 2, (11,))])
    assert mirror.table[1].tolist() == [5, 9, 11]
    assert mirror.table[2].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="row 2"):
        mirror.apply([BlockTableUpdate(2, 0, (1,))])  # the padding row stays all zeros
