"""The one-launch Triton build of a batch's segment metadata (``meta.build_segment_meta`` on
CUDA tensors; the layout is described in ``meta.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._launch import launch

__all__ = ["build_segments"]


# Triton kernels take untyped launch arguments.
@triton.jit  # type: ignore[untyped-decorator]
def _segment_meta_kernel(  # type: ignore[no-untyped-def]
    slots_in_ptr,  # [T] int32/int64 as given
    slots_out_ptr,  # [T_max] int32: cleaned slots, -1 past T
    sorted_ptr,  # [T_max] int32
    seg_start_ptr,  # [S + 1] int32
    invalid_ptr,  # [1] int32
    T,
    T_MAX,
    S,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    # Pass 1: where this program's tokens start (tokens of lower slots; for the base program,
    # every adapter token).
    before = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for c in range(0, tl.cdiv(T_MAX, BLOCK_T)):
        t = c * BLOCK_T + offs
        raw = tl.load(slots_in_ptr + t, mask=t < T, other=-1)
        ok = (raw >= 0) & (raw < S)
        before += (ok & (raw < pid)).to(tl.int32)
    start = tl.sum(before, 0)
    if pid < S:
        tl.store(seg_start_ptr + pid, start)
    else:
        tl.store(seg_start_ptr + S, start)
    # Pass 2: this program's tokens, in batch order.
    placed = start
    n_bad = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for c in range(0, tl.cdiv(T_MAX, BLOCK_T)):
        t = c * BLOCK_T + offs
        in_batch = t < T
        raw = tl.load(slots_in_ptr + t, mask=in_batch, other=-1)
        ok = (raw >= 0) & (raw < S)
        if pid < S:
            mine = ok & (raw == pid)
        else:
            mine = (~ok) & (t < T_MAX)
            bad = in_batch & ((raw < -1) | (raw >= S))
            n_bad += bad.to(tl.int32)
            tl.store(slots_out_ptr + t, tl.where(ok, raw, -1).to(tl.int32), mask=t < T_MAX)
        m = mine.to(tl.int32)
        pos = placed + tl.cumsum(m, 0) - 1
        tl.store(sorted_ptr + pos, t.to(tl.int32), mask=mine)
        placed += tl.sum(m, 0)
    if pid == S:
        tl.store(invalid_ptr, tl.sum(n_bad, 0))


def build_segments(
    token_slots: torch.Tensor,  # [T] int32/int64 as given (the meta's own buffer when T = 0)
    slots_out: torch.Tensor,  # [T_max] int32
    sorted_tokens: torch.Tensor,  # [T_max] int32
    seg_start: torch.Tensor,  # [S + 1] int32
    invalid: torch.Tensor,  # [1] int32
    num_tokens: int,
    max_tokens: int,
    num_slots: int,
) -> None:
    """Fill a SegmentMeta's buffers in one launch: program ``s`` places slot ``s``'s tokens, one
    more places the base tokens."""
    launch(
        _segment_meta_kernel,
        (num_slots + 1, 1, 1),
        (token_slots, slots_out, sorted_tokens, seg_start, invalid, num_tokens, max_tokens,
         num_slots),
        {"BLOCK_T": min(1024, max(16, int(triton.next_power_of_2(max_tokens))))},
        num_warps=4,
        num_stages=1,
    )  # fmt: skip
