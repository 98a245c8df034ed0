"""Segment metadata: grouping, fixed-size reuse, invalid slots, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta


def _groups(meta: SegmentMeta) -> dict[int, list[int]]:
    st = meta.seg_start.tolist()
    order = meta.sorted_tokens.tolist()
    return {s: order[st[s] : st[s + 1]] for s in range(meta.num_slots)}


def test_groups_tokens_by_slot_stably() -> None:
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0], dtype=torch.int32)
    meta = build_segment_meta(slots, num_slots=4)
    assert _groups(meta) == {0: [2, 6], 1: [], 2: [0, 3, 4], 3: []}
    assert meta.seg_start.tolist() == [0, 2, 2, 5, 5]
    # base tokens sort last
    assert sorted(meta.sorted_tokens.tolist()[5:]) == [1, 5]
    assert int(meta.invalid) == 0


def test_padding_rows_are_base_and_out_is_reused() -> None:
    meta = build_segment_meta(torch.tensor([1, 1], dtype=torch.int32), 3, max_tokens=6)
    assert meta.token_slots.tolist() == [1, 1, -1, -1, -1, -1]
    ptrs = (meta.sorted_tokens.data_ptr(), meta.seg_start.data_ptr())
    again = build_segment_meta(torch.tensor([0, 2, 2], dtype=torch.int32), 3, 6, out=meta)
    assert again is meta
    assert (meta.sorted_tokens.data_ptr(), meta.seg_start.data_ptr()) == ptrs
    assert _groups(meta) == {0: [0], 1: [], 2: [1, 2]}


def test_unchecked_out_of_range_slots_run_as_base_and_are_counted() -> None:
    slots = torch.tensor([0, 7, -3, 1], dtype=torch.int32)
    meta = build_segment_meta(slots, 2, check_values=False)
    assert int(meta.invalid) == 2
    assert _groups(meta) == {0: [0], 1: [3]}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_slots": torch.tensor([0, 5], dtype=torch.int32)}, "token_slots values"),
        ({"token_slots": torch.tensor([-2], dtype=torch.int32)}, "token_slots values"),
        ({"token_slots": torch.zeros(2, 2, dtype=torch.int32)}, "token_slots must be 1-D"),
        ({"token_slots": torch.zeros(2)}, "token_slots must be int32"),
        ({"num_slots": 0}, "num_slots"),
        ({"max_tokens": 1}, "max_tokens"),
    ],
)
def test_bad_input_names_the_argument(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"token_slots": torch.tensor([0, 1], dtype=torch.int32)}
    args["num_slots"] = 3
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_segment_meta(**args)  # type: ignore[arg-type]


def test_out_with_other_sizes_is_rejected() -> None:
    meta = build_segment_meta(torch.tensor([0], dtype=torch.int32), 2, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        build_segment_meta(torch.tensor([0], dtype=torch.int32), 2, max_tokens=8, out=meta)
    with pytest.raises(ValueError, match="num_slots"):
        build_segment_meta(torch.tensor([0], dtype=torch.int32), 3, max_tokens=4, out=meta)


def _fields(meta: SegmentMeta) -> tuple[list[int], ...]:
    return (
        meta.token_slots.tolist(),
        meta.sorted_tokens.tolist(),
        meta.seg_start.tolist(),
        meta.invalid.tolist(),
    )


@settings(max_examples=25, deadline=None)
@given(
    slots=st.lists(st.integers(-4, 12), min_size=0, max_size=40),
    num_slots=st.integers(1, 9),
    pad=st.integers(0, 20),
    wide=st.booleans(),
)
def test_one_launch_build_matches_torch_ops(slots, num_slots, pad, wide) -> None:  # type: ignore[no-untyped-def]
    """The Triton build (one launch; here under the CPU interpreter) gives exactly the buffers
    of the torch build: order within segments, base tokens last, invalid count, padding."""
    dtype = torch.int64 if wide else torch.int32
    ts = torch.tensor(slots, dtype=dtype)
    cap = max(len(slots) + pad, 1)
    want = build_segment_meta(ts, num_slots, cap, check_values=False, use_triton=False)
    got = build_segment_meta(ts, num_slots, cap, check_values=False, use_triton=True)
    assert _fields(got) == _fields(want)
    # Reuse of the same buffers with a different batch.
    again = build_segment_meta(ts.flip(0), num_slots, cap, out=got, check_values=False,
                               use_triton=True)  # fmt: skip
    ref = build_segment_meta(ts.flip(0), num_slots, cap, check_values=False, use_triton=False)
    assert _fields(again) == _fields(ref)


def test_one_launch_build_large_batch_chunks() -> None:
    """More tokens than one chunk of the kernel (1,024): the running offsets carry over."""
    gen = torch.Generator().manual_seed(3)
    ts = torch.randint(-1, 5, (2500,), generator=gen, dtype=torch.int32)
    want = build_segment_meta(ts, 5, 3000, use_triton=False)
    got = build_segment_meta(ts, 5, 3000, use_triton=True)
    assert _fields(got) == _fields(want)
