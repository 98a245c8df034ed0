# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""SGMM: segmented gather matrix multiply for a batch that mixes many LoRA adapters.

Maths, for every token ``t`` whose slot ``s = a(t)`` is not -1 and every output slice ``i``
(q/k/v of a fused QKV projection, or gate/up), with ``r = ranks[s]``::

    shrink:  v[i, t, :r]                 = x[t] @ A[i, s, :r, :].T            (fp32 accumulate)
    expand:  out[t, off_i : off_i + N_i] += scales[s] * v[i, t, :r] @ B_i[s, :, :r].T

Design (after Punica's SGMV and vLLM's ``lora_shrink_op``): tokens are grouped by slot once per
batch (``meta.py``); each program owns a BLOCK_M tile of one slot's segment, so a tile shares
one adapter and its product is a real ``tl.dot`` on the tensor cores. Instead of a grid of
``max_tiles x S`` programs that mostly exit, the grid's first axis is the bound
``cdiv(T, BLOCK_M) + min(S, T)`` on the number of non-empty tiles, and each program finds its
(slot, tile) by a prefix sum over the per-slot tile counts (``S`` is small, so that is a few
vector ops on cached data). The grid depends only on ``T``, ``S`` and the pool shape, never on
the token mix: no host synchronisation, and a captured CUDA graph stays valid.

Ranks are read per slot: a rank-8 adapter in a pool with ``R_max = 128`` loads and multiplies
8 rows (one masked 16-wide tile), not 128. ``v`` is fp32; the expand kernel rounds it to the
weight dtype before the tensor-core product, and adds to ``out`` in fp32 with one rounding.
Entries of ``v`` past a token's rank, and rows of base tokens, are left unwritten.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._backend import interpreter_enabled
from adaptermesh.kernels._launch import launch, prepare
from adaptermesh.kernels._validate import (
    SgmmShapes,
    check_expand,
    check_meta,
    check_pair,
    check_shrink,
)
from adaptermesh.kernels._workspace import split_workspace
from adaptermesh.kernels.meta import SegmentMeta

__all__ = [
    "AddLoraPlan",
    "SgmmConfig",
    "add_lora",
    "expand_config",
    "fused_config",
    "pdl_available",
    "plan_add_lora",
    "sgmm_expand",
    "sgmm_shrink",
    "shrink_config",
]


# ---------------------------------------------------------------------------------------------
# Config space: one small table per op, keyed by (token-count bucket, rank bucket), filled from
# the sweep in bench/bench_sgmm.py (`--sweep`) on one H200; the numbers are recorded next to
# each table and in docs/kernels.md. How the shape of the heuristic follows from the roofline:
# - shrink reads x (T*H*2 bytes) and each used adapter's A (R*H*2 bytes). At small T there are
#   only a few (token tile, rank tile) programs, each walking all of H, so the reduction over H
#   is split (split-K): SPLIT_K programs per tile take disjoint ranges of H, and the last one to
#   finish adds the fp32 partials in a fixed order (see _workspace.py). The table's split_k is
#   the most splits; the launcher lowers it when the grid already fills the GPU.
# - expand reads and writes out (2*T*N*2 bytes); B and v are small. BLOCK_N keeps the stores
#   wide, BLOCK_M grows with T so each B tile is reused across more tokens.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SgmmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # shrink only: the most programs that share one tile's reduction over H (1 = no split).
    split_k: int = 1
    # expand only: issue the load of the out tile before the product, so both memory round
    # trips overlap instead of following each other.
    prefetch_out: bool = False
    # expand only: BLOCK_N-wide column blocks each program writes, one after the other.
    n_blocks: int = 1
    # The gathered matrix-vector kernels (CUDA cores) instead of tensor-core tiles. Expand:
    # block_m tokens per program, block_n columns, block_k covering the whole rank. Shrink:
    # block_m tokens, block_n rank rows per program, block_k columns of H per step, no split.
    gemv: bool = False
    # expand only (tiles): block_k covers the whole rank, v is loaded once per program and each
    # column block is one product, so the loop over column blocks has no inner loop and its
    # loads can be pipelined across blocks.
    hoist_v: bool = False
    # Shrink and expand in one launch (_sgmm_fused_kernel): block_m tokens of one slot per
    # program, block_k columns of H per shrink step, n_blocks column blocks of block_n each.
    fused: bool = False


def _pow2_at_least_16(n: int) -> int:
    return max(16, int(triton.next_power_of_2(n)))


# Token-count buckets (upper bounds, inclusive) and rank buckets: ranks up to 32 use the
# "low" row, larger ranks the "high" row. The sweep ran r=16 and r=64.
T_BUCKETS = (16, 64, 256, 1 << 62)


def _t_bucket(num_tokens: int) -> int:
    return next(b for b in T_BUCKETS if num_tokens <= b)


def _r_bucket(r_max: int) -> str:
    return "low" if r_max <= 32 else "high"


# Sweep of 2026-11-29 (bench_sgmm.py --sweep, bench/results/sgmm_h200_run2.json): each op alone,
# graph replay over 16 input sets, S=1, H=4096, bf16; every candidate checked against fp32 torch.
# shrink: (block_m, block_k, split_k, num_warps, num_stages); block_n = min(pow2(R_max), 64).
# Best vs. the unsplit tile, us: T=16 r=16 6.6 (unsplit 16x256: 10.4); T=16 r=64 8.3 (15.9);
# T=64 r=16 6.6 (10.5); T=64 r=64 8.7 (15.8); T=256 r=16 7.5 (32x256: 10.8); T=256 r=64 9.7;
# T=4096 r=16 14.3
# (split 1: 14.4); T=4096 r=64 18.7 (32x256: 20.3). More splits lose: 32 splits of 128 cost
# 11.6-15.8 us at T=16/64, the partial traffic and the serial last-arrival sum grow.
_SHRINK_TABLE: dict[tuple[int, str], tuple[int, int, int, int, int]] = {
    (16, "low"): (16, 256, 8, 4, 3),
    (16, "high"): (16, 256, 8, 4, 3),
    (64, "low"): (16, 256, 8, 4, 3),
    (64, "high"): (16, 128, 8, 4, 3),
    (256, "low"): (16, 128, 8, 4, 3),
    (256, "high"): (16, 128, 4, 4, 3),
    (T_BUCKETS[-1], "low"): (32, 256, 2, 4, 3),
    (T_BUCKETS[-1], "high"): (64, 256, 1, 8, 3),
}

# expand: (block_m, block_n, num_warps, num_stages, prefetch_out); block_k = min(pow2(R_max), 64).
# Picked per (T, r) by the least summed slowdown over N=4096 and N=14336, us (N=4096 / 14336):
# T=16 r=16 3.0/3.3; T=16 r=64 3.7/4.6; T=64 r=16 3.2/4.2; T=64 r=64 4.2/5.6 (16x128: 4.5/8.4);
# T=256 r=16 5.2/10.1; T=256 r=64 5.8/19.1; T=4096 r=16 27.9/90.4; T=4096 r=64 47.1/149.7
# (the old 64x128 tile: 51.7/166.5). Prefetching out wins by 0-5 %, never loses more than 4 %.
_EXPAND_TABLE: dict[tuple[int, str], tuple[int, int, int, int, bool]] = {
    (16, "low"): (16, 256, 4, 2, True),
    (16, "high"): (16, 128, 4, 2, False),
    (64, "low"): (16, 256, 4, 2, True),
    (64, "high"): (32, 128, 4, 2, True),
    (256, "low"): (64, 128, 4, 2, True),
    (256, "high"): (32, 128, 4, 2, True),
    (T_BUCKETS[-1], "low"): (64, 128, 4, 2, False),
    (T_BUCKETS[-1], "high"): (64, 256, 8, 2, True),
}


# Tokens per active adapter: batches with few tokens per adapter (decode) leave most rows of a
# tall tile empty, so they get their own rows: "sparse" (<= 4 per adapter), "mid" (<= 32),
# else "dense". The host knows the batch's adapters (the scheduler built it); add_lora assumes
# as many as the pool has slots when the caller does not say, the worst case for a CUDA graph
# captured once for any mix.
SPARSE_TOKENS_PER_SLOT = 4
MID_TOKENS_PER_SLOT = 32


def _d_bucket(num_tokens: int, active_slots: int | None) -> str:
    slots = max(1, num_tokens if active_slots is None else min(active_slots, num_tokens))
    if num_tokens <= SPARSE_TOKENS_PER_SLOT * slots:
        return "sparse"
    return "mid" if num_tokens <= MID_TOKENS_PER_SLOT * slots else "dense"


# Rows by (T bucket, density, rank bucket) that override the tables above, from the decode
# sweep of 2026-12-02 (bench/sweep_sgmm_decode.py; bench/results/sgmm_decode_sweep_h200.json):
# each op timed alone on the four module groups of a 7B layer (qkv, o, gate_up, down) in graph
# replay, pool of 128 (256 for S=256), >= 256 MB touched per pass; the pick has the least
# summed time over the groups and shapes of its key. Every T <= 256 shape measured (S = 1..256)
# and T=1024 at 16 tokens per adapter won with 16- or 32-row tiles: at T=1024 S=64 the old
# 64-row rows took 385.9 us summed, these 182.6.
# (block_m, block_k, split_k, num_warps, num_stages, gemv_rows): gemv_rows > 0 picks the
# matrix-vector shrink with that many rank rows per program (block_n), no split.
_SHRINK_ROWS: dict[tuple[int, str, str], tuple[int, int, int, int, int, int]] = {
    (16, "sparse", "low"): (16, 256, 4, 4, 5, 0),
    (16, "sparse", "high"): (16, 256, 8, 4, 3, 0),
    (16, "mid", "low"): (16, 256, 8, 4, 3, 0),
    (16, "mid", "high"): (16, 256, 8, 4, 3, 0),
    (16, "dense", "low"): (16, 256, 8, 4, 3, 0),
    (16, "dense", "high"): (16, 256, 8, 4, 3, 0),
    (64, "sparse", "low"): (32, 256, 4, 4, 3, 0),
    (64, "sparse", "high"): (16, 256, 4, 4, 3, 0),
    (64, "mid", "low"): (16, 256, 4, 4, 5, 0),
    (64, "dense", "low"): (16, 256, 4, 4, 5, 0),
    (256, "sparse", "low"): (16, 256, 4, 4, 3, 0),
    (256, "sparse", "high"): (16, 256, 4, 4, 3, 0),
    (T_BUCKETS[-1], "sparse", "low"): (16, 256, 4, 4, 3, 0),
    (T_BUCKETS[-1], "mid", "low"): (16, 256, 4, 4, 3, 0),
    (T_BUCKETS[-1], "sparse", "high"): (16, 256, 4, 4, 3, 0),
    (T_BUCKETS[-1], "mid", "high"): (16, 256, 4, 4, 3, 0),
    (T_BUCKETS[-1], "dense", "low"): (16, 256, 4, 4, 5, 0),
    (T_BUCKETS[-1], "dense", "high"): (64, 128, 1, 4, 4, 0),
}
# Rows of the sweep of 2026-12-04 on H = N = 4096 (bench/sweep_sgmm_decode.py --groups o,
# bench/results/sgmm_decode_sweep_h200_hoist.json), each op alone in graph replay:
# - T > 256, >= 32 tokens per adapter (dense): shrink r=16 (16,256,4,4,5) 16.2 / 17.3 us at S=1 /
#   64; r=64 (64,128,1,4,4) 20.3 / 27.2. Expand, the hoisted 64x128 tile, 8 column blocks:
#   r=16 30.7 / 31.5, r=64 41.7 / 45.4 (the T-only table's tiles: 40.4 / 42.4, 64.1 / 69.0);
#   with 8 warps (a second sweep, sgmm_decode_sweep_h200_long.json) 28.8 / 31.5 and 36.9 at
#   r=64 S=1. Each op streams at about half the copy bandwidth.
# - T <= 256 at <= 4 tokens per adapter: the hoisted expand tiles, r=16 (16,512,2 blocks) 11.4
#   us, r=64 (16,256,4 blocks) 21.6 (the unhoisted rows 16.1 / 26.4); at T=64 r=64 the gemv
#   expand 18.7 (the previous 16-row row 24.5, the best tile 20.4) with the split-4 shrink
#   15.8 (split 1: 16.9).
# (block_m, block_n, num_warps, num_stages, prefetch_out, n_blocks, gemv, hoist_v). The gemv rows are
# from the matrix-vector sweep of 2026-12-02 (bench/results/sgmm_decode_sweep_h200_gemv.json):
# at one to four tokens per adapter and T <= 64, one token per program with the whole rank in one
# tile won every case against the tensor-core tiles (pick summed over the layer's groups: T=16
# 38.9 us, T=64 56.3 us); at T=64 S=64 the case's best shrink plus best expand took 30.6 us for
# qkv and 35.5 for gate_up, the tables of that day 40.4 and 55.0. At T=256 tiles won 3 of 4.
_EXPAND_ROWS: dict[tuple[int, str, str], tuple[int, int, int, int, bool, int, bool, bool]] = {
    (16, "sparse", "low"): (1, 512, 4, 2, False, 1, True, False),
    (16, "sparse", "high"): (16, 256, 4, 2, True, 1, False, False),
    (16, "mid", "low"): (16, 256, 4, 2, True, 1, False, False),
    (16, "mid", "high"): (16, 256, 4, 2, True, 1, False, False),
    (16, "dense", "low"): (16, 256, 4, 2, True, 1, False, False),
    (16, "dense", "high"): (16, 256, 4, 2, True, 1, False, False),
    (64, "sparse", "low"): (1, 512, 4, 2, False, 1, True, False),
    (64, "sparse", "high"): (1, 256, 4, 3, False, 4, True, False),
    (64, "mid", "low"): (16, 256, 4, 2, True, 2, False, False),
    (64, "mid", "high"): (16, 256, 4, 2, True, 2, False, False),
    (64, "dense", "low"): (16, 256, 4, 2, True, 2, False, False),
    (64, "dense", "high"): (16, 256, 4, 2, True, 2, False, False),
    (256, "sparse", "low"): (16, 512, 8, 3, False, 2, False, True),
    (256, "sparse", "high"): (16, 256, 4, 3, False, 4, False, True),
    (T_BUCKETS[-1], "sparse", "low"): (16, 128, 4, 3, True, 4, False, False),
    (T_BUCKETS[-1], "mid", "low"): (16, 128, 4, 3, True, 4, False, False),
    (T_BUCKETS[-1], "sparse", "high"): (16, 256, 4, 3, True, 4, False, False),
    (T_BUCKETS[-1], "mid", "high"): (16, 256, 4, 3, True, 4, False, False),
    (T_BUCKETS[-1], "dense", "low"): (64, 128, 8, 3, False, 8, False, True),
    (T_BUCKETS[-1], "dense", "high"): (64, 128, 8, 3, False, 8, False, True),
}


# One token (batch-1 decode), ranks up to 32: rows from the decode sweep of 2026-12-03
# (bench/results/sgmm_decode_sweep_h200_fused.json, T=1 S=1 r=16, graph replay, pool of 128):
# the best shrink was the matrix-vector kernel (two rank rows per program, 1,024 columns of H per
# step) where H = 4096 (qkv 8.9, o 8.0, gate_up 9.4 us with the best expand) and the split-K tile
# for the MLP's down input, H = 11008 (11.6 us); the best expand was the 16-row tensor-core tile
# for all four. The T <= 16 sparse rows above took 10.9 / 9.5 / 11.2 / 13.2 us for the same
# cases: 44.8 against 37.9 us per 7B layer.
_ONE_TOKEN_NARROW_H = 4096
# The same shrink rows up to 16 tokens, any density: in the sweeps of 2026-12-03 and -04
# (sgmm_decode_sweep_h200_fused.json, sgmm_decode_sweep_h200_hoist.json) the matrix-vector
# shrink won every T=16 case where H = 4096 (T=16 S=1: qkv 7.0 / o 5.5 / gate_up 6.2 us
# against the split tile's 7.3 / 6.7 / 7.0; S=16: 8.4 / 7.7 / 7.9 against 9.1 / 7.8 / 8.8) and
# the split tile kept the MLP's down input (H = 11008: 9.4 against the gemv's > 10).
_GEMV_SHRINK_MAX_TOKENS = 16
HOIST_MAX_RANK = 128
# A gemv expand program holds a [block_n, pow2(rank)] fp32 tile: the rows (swept up to r=64)
# apply up to this rank; wider ranks take the T bucket's tile row.
GEMV_EXPAND_MAX_RANK = 64
_ONE_TOKEN_SHRINK: dict[bool, tuple[int, int, int, int, int, int]] = {
    False: (1, 1024, 1, 4, 2, 2),  # H <= 4096
    True: (16, 256, 8, 4, 3, 0),  # wider H
}
_ONE_TOKEN_EXPAND: tuple[int, int, int, int, bool, int, bool, bool] = (
    16, 256, 4, 2, True, 1, False, False
)


def shrink_config(
    num_tokens: int,
    hidden: int,
    r_max: int,
    active_slots: int | None = None,
) -> SgmmConfig:
    """The shrink config for a batch: its density row, else the T bucket's tile row."""
    tb, rb = _t_bucket(num_tokens), _r_bucket(r_max)
    row = _SHRINK_ROWS.get((tb, _d_bucket(num_tokens, active_slots), rb))
    if num_tokens <= _GEMV_SHRINK_MAX_TOKENS and rb == "low":
        row = _ONE_TOKEN_SHRINK[hidden > _ONE_TOKEN_NARROW_H]
    if row is None:
        row = (*_SHRINK_TABLE[(tb, rb)], 0)
    bm, bk, split, warps, stages, gemv_rows = row
    if gemv_rows:
        return SgmmConfig(bm, gemv_rows, bk, num_warps=warps, num_stages=stages, gemv=True)
    bn = min(_pow2_at_least_16(r_max), 64)
    return SgmmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, split_k=split)


def expand_config(
    num_tokens: int,
    n_max: int,
    r_max: int,
    active_slots: int | None = None,
) -> SgmmConfig:
    """The expand config for a batch: its density row, else the T bucket's tile row (also
    where a gemv row's rank would pass GEMV_EXPAND_MAX_RANK)."""
    tb, rb = _t_bucket(num_tokens), _r_bucket(r_max)
    row = _EXPAND_ROWS.get((tb, _d_bucket(num_tokens, active_slots), rb))
    if num_tokens == 1 and rb == "low":
        row = _ONE_TOKEN_EXPAND
    if row is None or (row[6] and r_max > GEMV_EXPAND_MAX_RANK):
        row = (*_EXPAND_TABLE[(tb, rb)], 1, False, False)
    bm, bn, warps, stages, prefetch, nb, gemv, hoist = row
    # The hoisted tile keeps the whole rank in registers: up to HOIST_MAX_RANK.
    hoist = hoist and r_max <= HOIST_MAX_RANK
    # A gemv program (or a hoisted tile) holds the whole rank in one tile; a tensor-core tile
    # walks it in steps.
    whole = gemv or hoist
    bk = _pow2_at_least_16(r_max) if whole else min(_pow2_at_least_16(r_max), 64)
    return SgmmConfig(
        bm, bn, bk, num_warps=warps, num_stages=stages, prefetch_out=prefetch, n_blocks=nb,
        gemv=gemv, hoist_v=hoist,
    )  # fmt: skip


# One launch (shrink and expand fused) where it measured faster than the two launches' best,
# per (T bucket, density, rank bucket): (block_m, block_n, block_k, n_blocks, num_warps,
# num_stages); a missing key keeps the two launches. Ranks above FUSED_MAX_RANK never fuse
# (v lives in registers). From the sweep of 2026-12-03 (bench/sweep_sgmm_decode.py, fused
# candidates beside the best shrink + expand timed together with PDL, graph replay, pool of
# 128, bench/results/sgmm_decode_sweep_h200_fused_pdl.json): at T=4096, r=16, S=1 and 64, the
# 32-row tile with 4,096 columns per program took qkv 108.0 / 112.6 us (two launches 119.1 /
# 121.7) and gate_up 149.6 / 161.0 (188.2 / 188.9), but o 73.8 / 76.1 (49.1 / 51.0) and down
# 124.7 / 128.2 (67.9 / 70.1): each program walks all of H for its tile, so a grid of one
# program per tile (o) leaves the GPU half idle and a long H (down, 11008) costs more than
# the second launch saves. Hence the two guards in fused_config. Every T <= 256 shape lost.
FUSED_MAX_RANK = 128
FUSED_MAX_HIDDEN = 4096
_FUSED_MIN_PROGRAMS_PER_SM = 2
_FUSED_ROWS: dict[tuple[int, str, str], tuple[int, int, int, int, int, int]] = {
    (T_BUCKETS[-1], "dense", "low"): (32, 128, 64, 32, 4, 3),
}


def fused_config(
    num_tokens: int,
    hidden: int,
    n_max: int,
    r_max: int,
    active_slots: int | None = None,
    *,
    n_slices: int = 1,
    sm_count: int = 132,
) -> SgmmConfig | None:
    """The one-launch config for a batch, or None where two launches are faster: a table row,
    H at most FUSED_MAX_HIDDEN, and a grid of at least two programs per SM."""
    if r_max > FUSED_MAX_RANK or hidden > FUSED_MAX_HIDDEN:
        return None
    row = _FUSED_ROWS.get(
        (_t_bucket(num_tokens), _d_bucket(num_tokens, active_slots), _r_bucket(r_max))
    )
    if row is None:
        return None
    bm, bn, bk, nb, warps, stages = row
    programs = (
        int(triton.cdiv(num_tokens, bm))  # the non-empty tiles at least
        * int(triton.cdiv(n_max, bn * nb))
        * n_slices
    )
    if programs < _FUSED_MIN_PROGRAMS_PER_SM * sm_count:
        return None
    return SgmmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, n_blocks=nb, fused=True)


def pdl_available(device: torch.device) -> bool:
    """Whether the expand may be a programmatic dependent launch after its shrink (CUDA,
    compute capability 9.0 and up, not the interpreter; ``ADAPTERMESH_NO_PDL=1`` turns it
    off): its prologue then overlaps the shrink's tail instead of following the launch gap."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    if os.environ.get("ADAPTERMESH_NO_PDL", "") == "1":
        return False
    return _capability(device.index if device.index is not None else -1) >= (9, 0)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    dev = torch.cuda.current_device() if index < 0 else index
    major, minor = torch.cuda.get_device_capability(dev)
    return int(major), int(minor)


# ---------------------------------------------------------------------------------------------
# Shared device helper: map a program of the compact tile axis to (slot, first row, end row).
# ---------------------------------------------------------------------------------------------
@triton.jit
def _locate_tile(
    pid_m,
    seg_start_ptr,
    S,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    offs_s = tl.arange(0, BLOCK_S)
    in_range = offs_s < S
    starts = tl.load(seg_start_ptr + offs_s, mask=in_range, other=0)
    ends = tl.load(seg_start_ptr + 1 + offs_s, mask=in_range, other=0)
    n_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(n_tiles, 0)  # inclusive prefix sum of tiles per slot
    total = tl.sum(n_tiles, 0)
    # Slot owning tile pid_m: the number of slots whose tiles all come before it.
    slot = tl.sum((cum <= pid_m).to(tl.int32), 0)
    slot = tl.minimum(slot, S - 1)
    is_slot = offs_s == slot
    first_tile = tl.sum(tl.where(is_slot, cum - n_tiles, 0), 0)
    seg_begin = tl.sum(tl.where(is_slot, starts, 0), 0)
    seg_end = tl.sum(tl.where(is_slot, ends, 0), 0)
    row_begin = seg_begin + (pid_m - first_tile) * BLOCK_M
    return pid_m < total, slot, row_begin, seg_end


@triton.jit
def _of_slice(pid_i, v0, v1, v2):
    """The integer of slice ``pid_i`` (0, 1 or 2). Through tl.where rather than if/else,
    because Triton may specialise any of the three to a constant (e.g. a stride of 1) and the
    branches must then agree on types."""
    return tl.where(pid_i == 0, v0, tl.where(pid_i == 1, v1, v2))


@triton.jit
def _store_shrink_tile(
    acc,
    v_ptrs,
    part_ptr,
    count_ptr,
    tok,
    offs_n,
    mask_mn,
    pid_i,
    pid_k,
    pid_n,
    pid_m,
    T,
    R_MAX,
    GRID_M,
    N_TILES_N,
    SPLIT_K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write one shrink tile's fp32 result to v; with split-K, through the partials.

    Partials are laid out like v (contiguous), one [n_slices, T, R_max] block per split. Each
    split stores its partial, then arrives on the tile's counter; the last to arrive adds the
    partials in split order (deterministic, the same whichever split finishes last), its own
    from registers, stores v and resets the counter for the next launch (and graph replay).
    """
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=mask_mn)
    else:
        stride_pk = tl.num_programs(2).to(tl.int64) * T * R_MAX
        p_ptrs = part_ptr + pid_i * T * R_MAX + tok[:, None] * R_MAX + offs_n[None, :]
        tl.store(p_ptrs + pid_k * stride_pk, acc, mask=mask_mn)
        # All threads' partial stores happen before the (single-thread, release) arrival.
        tl.debug_barrier()
        count = count_ptr + (pid_i * N_TILES_N + pid_n) * GRID_M + pid_m
        arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # ".cg" reads from L2, where the other SMs' stores are visible, not from a stale
            # L1 line.
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in range(0, SPLIT_K):
                other = tl.load(
                    p_ptrs + j * stride_pk, mask=mask_mn, other=0.0, cache_modifier=".cg"
                )
                total += tl.where(j == pid_k, acc, other)
            tl.store(v_ptrs, total, mask=mask_mn)
            tl.atomic_xchg(count, 0)


def _three_slices(
    items: Sequence[Any], sizes: Sequence[int], offsets: Sequence[int]
) -> tuple[list[Any], list[int], list[int]]:
    """Per-slice arguments padded to the kernels' three slots (a padding slice has width 0,
    so its programs exit at once)."""
    pad = 3 - len(items)
    return list(items) + [items[0]] * pad, list(sizes) + [0] * pad, list(offsets) + [0] * pad


@triton.jit
def _sgmm_shrink_kernel(
    # pointers
    x_ptr,
    a_ptr,
    v_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    part_ptr,  # [SPLIT_K, n_slices, T, R_max] fp32 partial sums (split-K only)
    count_ptr,  # [grid_m * n_rank_tiles * n_slices] int32 arrivals per tile, 0 when idle
    # sizes
    H,
    S,
    R_MAX,
    T,
    GRID_M,
    N_TILES_N,
    SPLIT_K,  # programs sharing one tile's reduction over H (1 = no split)
    K_PER_SPLIT,  # H range per split, a multiple of BLOCK_K
    # strides
    stride_xt,
    stride_xh,
    stride_ai,
    stride_as,
    stride_ar,
    stride_ah,
    stride_vi,
    stride_vt,
    stride_vr,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr = False,
):
    if LAUNCH_DEPS:  # the expand (a programmatic dependent launch) may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_nk = tl.program_id(1)
    pid_i = tl.program_id(2).to(tl.int64)
    pid_n = pid_nk // SPLIT_K
    pid_k = pid_nk % SPLIT_K
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    # Every split of a tile takes the same exits, so a tile's counter is touched by all of its
    # splits or by none.
    if not has_tile:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    n_start = pid_n * BLOCK_N
    if n_start >= rank:  # no work past the slot's real rank
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < rank
    k_begin = pid_k * K_PER_SPLIT
    k_len = tl.minimum(H - k_begin, K_PER_SPLIT)  # > 0: the launcher leaves no split empty
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + (k_begin + offs_k)[None, :] * stride_xh
    a_ptrs = (
        a_ptr
        + pid_i * stride_ai
        + slot.to(tl.int64) * stride_as
        + offs_n[None, :] * stride_ar
        + (k_begin + offs_k)[:, None] * stride_ah
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_left = k_len - k * BLOCK_K
        xt = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        at = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
        x_ptrs += BLOCK_K * stride_xh
        a_ptrs += BLOCK_K * stride_ah
    mask_mn = mask_m[:, None] & mask_n[None, :]
    v_ptrs = v_ptr + pid_i * stride_vi + tok[:, None] * stride_vt + offs_n[None, :] * stride_vr
    _store_shrink_tile(
        acc, v_ptrs, part_ptr, count_ptr, tok, offs_n, mask_mn, pid_i, pid_k, pid_n, pid_m,
        T, R_MAX, GRID_M, N_TILES_N, SPLIT_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _sgmm_shrink_gemv_kernel(
    # pointers
    x_ptr,
    a_ptr,
    v_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    # sizes
    H,
    S,
    R_MAX,
    # strides
    stride_xt,
    stride_xh,
    stride_ai,
    stride_as,
    stride_ar,
    stride_ah,
    stride_vi,
    stride_vt,
    stride_vr,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tokens per program (a few: the one-token-per-adapter path)
    BLOCK_N: tl.constexpr,  # rank rows per program
    BLOCK_K: tl.constexpr,  # H columns per step
    BLOCK_S: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr = False,
):
    """Shrink as a gathered matrix-vector product: each program owns BLOCK_N rank rows of its
    slot's A and walks the whole of H once, reducing against its tokens' x on the CUDA cores.
    With many programs per slot (one per few rank rows) a decode step fills the GPU without
    split-K, so there are no partials, counters or second pass."""
    if LAUNCH_DEPS:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_i = tl.program_id(2).to(tl.int64)
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    n_start = pid_n * BLOCK_N
    if n_start >= rank:
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + tok[:, None] * stride_xt
    a_base = a_ptr + pid_i * stride_ai + slot.to(tl.int64) * stride_as + offs_n[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        kk = k * BLOCK_K + offs_k
        mask_k = kk < H
        xt = tl.load(x_base + kk[None, :] * stride_xh, mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        at = tl.load(a_base + kk[None, :] * stride_ah, mask=mask_n[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.sum(xt[:, None, :] * at[None, :, :], axis=2)
    v_ptrs = v_ptr + pid_i * stride_vi + tok[:, None] * stride_vt + offs_n[None, :] * stride_vr
    tl.store(v_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sgmm_expand_kernel(
    # pointers
    out_ptr,
    v_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    scales_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    # sizes
    S,
    R_MAX,
    N0,
    N1,
    N2,
    OFF1,
    OFF2,
    N_BLOCKS,  # column blocks per program
    # strides
    stride_ot,
    stride_on,
    stride_vi,
    stride_vt,
    stride_vr,
    stride_b0s,
    stride_b0n,
    stride_b0r,
    stride_b1s,
    stride_b1n,
    stride_b1r,
    stride_b2s,
    stride_b2n,
    stride_b2r,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH_OUT: tl.constexpr,
    PDL: tl.constexpr = False,
    HOIST_V: tl.constexpr = False,  # BLOCK_K >= R_MAX: v loaded once, one product per block
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_i = tl.program_id(2)
    # Per-slice B matrix, width, column offset and strides (at most three slices).
    n_size = _of_slice(pid_i, N0, N1, N2)
    col_off = _of_slice(pid_i, 0, OFF1, OFF2)
    stride_bs = _of_slice(pid_i, stride_b0s, stride_b1s, stride_b2s).to(tl.int64)
    stride_bn = _of_slice(pid_i, stride_b0n, stride_b1n, stride_b2n)
    stride_br = _of_slice(pid_i, stride_b0r, stride_b1r, stride_b2r)
    if pid_i == 0:
        b_ptr = b0_ptr
    elif pid_i == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    n_first = pid_n * N_BLOCKS * BLOCK_N
    if n_first >= n_size:
        if PDL:  # every program waits, so this grid ends after the shrink it depends on
            tl.extra.cuda.gdc_wait()
        return
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        if PDL:
            tl.extra.cuda.gdc_wait()
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank == 0:
        if PDL:
            tl.extra.cuda.gdc_wait()
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    v_ptrs = v_ptr + pid_i.to(tl.int64) * stride_vi + tok[:, None] * stride_vt
    scale = tl.load(scales_ptr + slot)
    if PDL:  # the prologue above overlapped the shrink; v is read only after it finished
        tl.extra.cuda.gdc_wait()
    if HOIST_V:
        mask_k = offs_k < rank
        vh = tl.load(v_ptrs + offs_k[None, :] * stride_vr, mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0).to(b_ptr.dtype.element_ty)  # fmt: skip
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_k[:, None] * stride_br
        for j in range(0, N_BLOCKS):
            offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_size
            o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :] * stride_on
            o_mask = mask_m[:, None] & mask_n[None, :]
            o = tl.load(o_ptrs, mask=o_mask, other=0.0)
            bt = tl.load(b_rows + offs_n[None, :] * stride_bn, mask=mask_k[:, None] & mask_n[None, :],
                         other=0.0)  # fmt: skip
            if DOT_FP32:
                d = tl.dot(vh.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(vh, bt)
            tl.store(
                o_ptrs, (o.to(tl.float32) + d * scale).to(out_ptr.dtype.element_ty), mask=o_mask
            )
        return
    # N_BLOCKS column blocks per program: a program streams a longer run of B and out, so
    # fewer programs each keep more loads in flight (decode: one token per adapter).
    for j in range(0, N_BLOCKS):
        offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_size
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
        o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :] * stride_on
        o_mask = mask_m[:, None] & mask_n[None, :]
        if PREFETCH_OUT:
            o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The loop runs to the slot's rank, not R_MAX.
        for k in range(0, tl.cdiv(rank, BLOCK_K)):
            kk = k * BLOCK_K + offs_k
            mask_k = kk < rank
            vt = tl.load(v_ptrs + kk[None, :] * stride_vr, mask=mask_m[:, None] & mask_k[None, :])
            bt = tl.load(b_ptrs + kk[:, None] * stride_br, mask=mask_k[:, None] & mask_n[None, :])
            vt = vt.to(bt.dtype)
            if DOT_FP32:
                acc += tl.dot(vt.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(vt, bt)
        if not PREFETCH_OUT:
            o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(
            o_ptrs, (o.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=o_mask
        )


@triton.jit
def _sgmm_expand_gemv_kernel(
    # pointers
    out_ptr,
    v_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    scales_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    # sizes
    S,
    R_MAX,
    N0,
    N1,
    N2,
    OFF1,
    OFF2,
    N_BLOCKS,
    # strides
    stride_ot,
    stride_on,
    stride_vi,
    stride_vt,
    stride_vr,
    stride_b0s,
    stride_b0n,
    stride_b0r,
    stride_b1s,
    stride_b1n,
    stride_b1r,
    stride_b2s,
    stride_b2n,
    stride_b2r,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tokens per program (a few: this is the one-token-per-adapter path)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= R_MAX: the whole rank in one tile
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Expand as a gathered matrix-vector product: each program loads a [BLOCK_N, rank] tile
    of its slot's B once and, for each of its (at most BLOCK_M) tokens, reduces it against the
    token's v row on the CUDA cores. No tensor-core tile, so no 16-row padding of a segment
    that holds one token."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_i = tl.program_id(2)
    # Per-slice B matrix, width, column offset and strides (at most three slices).
    n_size = _of_slice(pid_i, N0, N1, N2)
    col_off = _of_slice(pid_i, 0, OFF1, OFF2)
    stride_bs = _of_slice(pid_i, stride_b0s, stride_b1s, stride_b2s).to(tl.int64)
    stride_bn = _of_slice(pid_i, stride_b0n, stride_b1n, stride_b2n)
    stride_br = _of_slice(pid_i, stride_b0r, stride_b1r, stride_b2r)
    if pid_i == 0:
        b_ptr = b0_ptr
    elif pid_i == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    n_first = pid_n * N_BLOCKS * BLOCK_N
    if n_first >= n_size:
        if PDL:  # every program waits, so this grid ends after the shrink it depends on
            tl.extra.cuda.gdc_wait()
        return
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        if PDL:
            tl.extra.cuda.gdc_wait()
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank == 0:
        if PDL:
            tl.extra.cuda.gdc_wait()
        return
    scale = tl.load(scales_ptr + slot)
    offs_r = tl.arange(0, BLOCK_K)
    mask_r = offs_r < rank
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[None, :] * stride_br
    v_base = v_ptr + pid_i.to(tl.int64) * stride_vi + offs_r * stride_vr
    if PDL:
        tl.extra.cuda.gdc_wait()
    for j in range(0, N_BLOCKS):
        offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_size
        bt = tl.load(
            b_base + offs_n[:, None] * stride_bn, mask=mask_n[:, None] & mask_r[None, :], other=0.0
        )
        btf = bt.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = row_begin + m
            if row < seg_end:
                t = tl.load(sorted_ptr + row).to(tl.int64)
                vv = tl.load(v_base + t * stride_vt, mask=mask_r, other=0.0)
                # Rounded to the weight dtype first, as the tensor-core path does.
                vv = vv.to(bt.dtype).to(tl.float32)
                acc = tl.sum(btf * vv[None, :], axis=1)
                o_ptrs = out_ptr + t * stride_ot + (col_off + offs_n) * stride_on
                o = tl.load(o_ptrs, mask=mask_n, other=0.0)
                tl.store(
                    o_ptrs, (o.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty),
                    mask=mask_n,
                )  # fmt: skip


@triton.jit
def _sgmm_fused_kernel(
    # pointers
    out_ptr,
    x_ptr,
    a_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    scales_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    # sizes
    H,
    S,
    R_MAX,
    N0,
    N1,
    N2,
    OFF1,
    OFF2,
    N_BLOCKS,  # BLOCK_N-wide column blocks per program
    # strides
    stride_xt,
    stride_xh,
    stride_ai,
    stride_as,
    stride_ar,
    stride_ah,
    stride_ot,
    stride_on,
    stride_b0s,
    stride_b0n,
    stride_b0r,
    stride_b1s,
    stride_b1n,
    stride_b1r,
    stride_b2s,
    stride_b2n,
    stride_b2r,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # H columns per shrink step
    BLOCK_R: tl.constexpr,  # >= R_MAX: the whole rank in one tile
    BLOCK_S: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Shrink and expand in one launch: a program computes its tile's ``v`` (BLOCK_M tokens of
    one slot, the whole rank) over all of H, keeps it in registers, and adds ``v @ B.T`` to
    its N_BLOCKS column blocks of out. ``v`` never goes to memory and there is no second
    launch; with several column groups per tile (grid axis 1) each recomputes the tile's
    ``v`` from x and A, which the groups read at about the same time (L2)."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_i = tl.program_id(2)
    n_size = _of_slice(pid_i, N0, N1, N2)
    col_off = _of_slice(pid_i, 0, OFF1, OFF2)
    stride_bs = _of_slice(pid_i, stride_b0s, stride_b1s, stride_b2s).to(tl.int64)
    stride_bn = _of_slice(pid_i, stride_b0n, stride_b1n, stride_b2n)
    stride_br = _of_slice(pid_i, stride_b0r, stride_b1r, stride_b2r)
    if pid_i == 0:
        b_ptr = b0_ptr
    elif pid_i == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    n_first = pid_g * N_BLOCKS * BLOCK_N
    if n_first >= n_size:
        return
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank == 0:
        return
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
    a_ptrs = (
        a_ptr
        + pid_i.to(tl.int64) * stride_ai
        + slot.to(tl.int64) * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ah
    )
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        k_left = H - k * BLOCK_K
        xt = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        at = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & mask_r[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
        x_ptrs += BLOCK_K * stride_xh
        a_ptrs += BLOCK_K * stride_ah
    # Rounded to the weight dtype, as the two-launch expand does with the v it reads back.
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    v = acc.to(b_ptr.dtype.element_ty)
    scale = tl.load(scales_ptr + slot)
    for j in range(0, N_BLOCKS):
        offs_n = n_first + j * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_size
        o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :] * stride_on
        o_mask = mask_m[:, None] & mask_n[None, :]
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * stride_bn, mask=mask_r[:, None] & mask_n[None, :],
                     other=0.0)  # fmt: skip
        if DOT_FP32:
            d = tl.dot(v.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(v, bt)
        tl.store(o_ptrs, (o.to(tl.float32) + d * scale).to(out_ptr.dtype.element_ty), mask=o_mask)


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot runs on fp32 operands with IEEE precision.

    fp32 activations get IEEE fp32 products instead of tf32. Under TRITON_INTERPRET=1 every
    dtype does, because the CPU interpreter of triton 3.9 returns garbage for a bf16 tl.dot;
    the operands are upcast exactly (bf16 and fp16 embed in fp32), so the maths is unchanged.
    """
    return dtype == torch.float32 or interpreter_enabled()


def _tile_axis(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on non-empty (slot, BLOCK_M) tiles: fixed by shapes, not by the token mix."""
    return int(triton.cdiv(num_tokens, block_m)) + min(num_slots, num_tokens)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200; used as such off CUDA)."""
    if device.type != "cuda":
        return 132
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# The split-K shrink stops adding splits once the grid holds this many programs per SM: past
# that, the GPU is full anyway and every extra split only costs another partial write and read.
_MAX_PROGRAMS_PER_SM = 4


def _split_plan(
    cfg: SgmmConfig, hidden: int, base_programs: int, device: torch.device
) -> tuple[int, int]:
    """(splits, H elements per split) from shapes only, so a captured graph stays valid.

    At most ``cfg.split_k`` splits, no more than the BLOCK_K steps over H, and fewer when the
    unsplit grid already has ``_MAX_PROGRAMS_PER_SM`` programs per SM. No split is left empty.
    """
    k_steps = int(triton.cdiv(hidden, cfg.block_k))
    budget = max(1, (_MAX_PROGRAMS_PER_SM * _sm_count(device)) // max(base_programs, 1))
    split = max(1, min(cfg.split_k, k_steps, budget))
    steps_per_split = int(triton.cdiv(k_steps, split))
    split = int(triton.cdiv(k_steps, steps_per_split))
    return split, steps_per_split * cfg.block_k


def _check_config(cfg: SgmmConfig) -> None:
    for name in ("block_m", "block_n", "block_k"):
        val = getattr(cfg, name)
        # A matrix-vector program may hold a single token (block_m) and, in the shrink, a
        # single rank row or output column (block_n); tensor-core tiles need 16.
        least = 1 if cfg.gemv and name in ("block_m", "block_n") else 16
        if val < least or val & (val - 1):
            raise ValueError(f"config.{name} must be a power of two >= {least}, got {val}")
    if cfg.split_k < 1:
        raise ValueError(f"config.split_k must be >= 1, got {cfg.split_k}")
    if cfg.n_blocks < 1:
        raise ValueError(f"config.n_blocks must be >= 1, got {cfg.n_blocks}")
    if cfg.fused and (cfg.gemv or cfg.split_k != 1):
        raise ValueError("a fused config has no gemv or split_k variant")
    if cfg.hoist_v and (cfg.gemv or cfg.fused):
        raise ValueError("config.hoist_v is a tile-expand option (not gemv or fused)")


def sgmm_shrink(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H], dtype of x
    ranks: torch.Tensor,  # [S] int32, each <= R_max
    meta: SegmentMeta,
    *,
    out: torch.Tensor | None = None,  # [n_slices, T, R_max] fp32, reused when given
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Return ``v: [n_slices, T, R_max]`` float32 with ``v[i, t, :r] = x[t] @ A[i, a(t), :r].T``.

    One launch for all slices and slots. Rows of base tokens and columns past a token's rank
    are left unwritten (``torch.empty`` contents unless ``out`` is given).
    """
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    v = _v_buffer(out, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    _launch_shrink(x, lora_a, ranks, meta, v, shapes, config)
    return v


def _launch_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v: torch.Tensor,
    shapes: SgmmShapes,  # from check_shrink
    config: SgmmConfig | None,
    run: Any = launch,
    launch_deps: bool = False,  # the expand after it is a programmatic dependent launch
) -> Any:
    cfg = config or shrink_config(shapes.num_tokens, shapes.hidden, shapes.r_max)
    # Every constexpr is passed, defaults included: a prepared launch binds all of them.
    deps = {"LAUNCH_DEPS": launch_deps}
    _check_config(cfg)
    grid_m = _tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m)
    n_tiles_n = int(triton.cdiv(shapes.r_max, cfg.block_n))
    if cfg.gemv:
        return run(
            _sgmm_shrink_gemv_kernel,
            (grid_m, n_tiles_n, shapes.n_slices),
            (
                x, lora_a, v, ranks, meta.sorted_tokens, meta.seg_start, shapes.hidden,
                shapes.num_slots, shapes.r_max, x.stride(0), x.stride(1), *lora_a.stride(),
                *v.stride(),
            ),
            {
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k,
                "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
                **deps,
            },
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    split, k_per_split = _split_plan(
        cfg, shapes.hidden, grid_m * n_tiles_n * shapes.n_slices, x.device
    )
    if split > 1:
        counters, partials = split_workspace(
            x.device,
            grid_m * n_tiles_n * shapes.n_slices,
            split * shapes.n_slices * shapes.num_tokens * shapes.r_max,
        )
    else:  # never read: the split-K branch is compiled out for SPLIT_K == 1
        counters, partials = ranks, v
    grid = (grid_m, n_tiles_n * split, shapes.n_slices)
    return run(
        _sgmm_shrink_kernel,
        grid,
        (
            x,
            lora_a,
            v,
            ranks,
            meta.sorted_tokens,
            meta.seg_start,
            partials,
            counters,
            shapes.hidden,
            shapes.num_slots,
            shapes.r_max,
            shapes.num_tokens,
            grid_m,
            n_tiles_n,
            split,
            k_per_split,
            x.stride(0),
            x.stride(1),
            lora_a.stride(0),
            lora_a.stride(1),
            lora_a.stride(2),
            lora_a.stride(3),
            v.stride(0),
            v.stride(1),
            v.stride(2),
        ),
        {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
            "DOT_FP32": _dot_fp32(x.dtype),
            **deps,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def sgmm_expand(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    v: torch.Tensor,  # [n_slices, T, R_max] fp32 (sgmm_shrink's output)
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max], dtype of out
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> None:
    """``out[t, off_i:off_i+N_i] += scales[s] * v[i, t, :r] @ B_i[s, :, :r].T``; one launch."""
    shapes = check_expand(out, v, lora_b, scales, ranks, check_values)
    check_meta(meta, shapes, out)
    _launch_expand(out, v, lora_b, scales, ranks, meta, shapes, config)


def _launch_expand(
    out: torch.Tensor,
    v: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,  # from check_expand
    config: SgmmConfig | None,
    run: Any = launch,
    pdl: bool = False,  # launched as a programmatic dependent of the shrink before it
) -> Any:
    bs, sizes, offs = _three_slices(lora_b, shapes.out_sizes, shapes.out_offsets)
    n_max = max(shapes.out_sizes)
    cfg = config or expand_config(shapes.num_tokens, n_max, shapes.r_max)
    _check_config(cfg)
    if cfg.gemv and cfg.block_k < shapes.r_max:
        raise ValueError(f"a gemv expand needs config.block_k >= R_max={shapes.r_max}")
    grid = (
        _tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        shapes.n_slices,
    )
    args = (
        out,
        v,
        bs[0],
        bs[1],
        bs[2],
        scales,
        ranks,
        meta.sorted_tokens,
        meta.seg_start,
        shapes.num_slots,
        shapes.r_max,
        sizes[0],
        sizes[1],
        sizes[2],
        offs[1],
        offs[2],
        cfg.n_blocks,
        out.stride(0),
        out.stride(1),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *bs[0].stride(),
        *bs[1].stride(),
        *bs[2].stride(),
    )
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
    }
    if cfg.hoist_v and cfg.block_k < shapes.r_max:
        raise ValueError(f"config.hoist_v needs config.block_k >= R_max={shapes.r_max}")
    if cfg.gemv:
        kernel = _sgmm_expand_gemv_kernel
    else:
        kernel = _sgmm_expand_kernel
        consts |= {"DOT_FP32": _dot_fp32(out.dtype), "PREFETCH_OUT": cfg.prefetch_out}
    consts["PDL"] = pdl  # passed either way: a prepared launch binds every constexpr
    if not cfg.gemv:
        consts["HOIST_V"] = cfg.hoist_v
    if pdl:
        return run(kernel, grid, args, consts, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, launch_pdl=True)  # fmt: skip
    return run(kernel, grid, args, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,  # from check_shrink
    expand_shapes: SgmmShapes,  # from check_expand
    cfg: SgmmConfig,
    run: Any = launch,
) -> Any:
    bs, sizes, offs = _three_slices(lora_b, expand_shapes.out_sizes, expand_shapes.out_offsets)
    n_max = max(expand_shapes.out_sizes)
    grid = (
        _tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        shapes.n_slices,
    )
    args = (
        out, x, lora_a, bs[0], bs[1], bs[2], scales, ranks, meta.sorted_tokens, meta.seg_start,
        shapes.hidden, shapes.num_slots, shapes.r_max, sizes[0], sizes[1], sizes[2], offs[1],
        offs[2], cfg.n_blocks, x.stride(0), x.stride(1), *lora_a.stride(), out.stride(0),
        out.stride(1), *bs[0].stride(), *bs[1].stride(), *bs[2].stride(),
    )  # fmt: skip
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_R": _pow2_at_least_16(shapes.r_max),
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
        "DOT_FP32": _dot_fp32(x.dtype),
    }
    return run(_sgmm_fused_kernel, grid, args, consts, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages)  # fmt: skip


def add_lora(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,  # [n_slices, T, R_max] fp32 scratch, for graphs
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> None:
    """``out += scale * (x @ A.T) @ B.T`` per token's slot: two launches (shrink, expand), or
    one fused launch where the config table measured that faster.

    ``active_slots`` is how many distinct adapters the batch uses at most (the scheduler
    knows); it picks the tile shapes. Left out, it is the pool's slot count: the worst case,
    which suits a CUDA graph captured once for any mix. ``fused``: None lets the table decide
    (only when no shrink/expand config is given), False always runs two launches, True needs
    ``fused_cfg`` or a table row. ``pdl``: None launches the expand as a programmatic
    dependent of the shrink where the GPU supports it (``pdl_available``).
    """
    _add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer, shrink_cfg, expand_cfg,
        active_slots, check_values, launch, fused_cfg, fused, pdl,
    )  # fmt: skip


class AddLoraPlan:
    """``add_lora`` on fixed tensors, checked and bound once: each call only launches.

    For eager callers that run the same op on the same buffers many times (a serving loop
    outside CUDA graphs): the checks, the config choice, the kernels' argument lists and their
    compiled kernels are all settled when the plan is made, so a call costs one or two driver
    launches. The tensors' contents may change between calls, their storage must not. A plan
    uses the split-K scratch of the stream it was made on; run it on that stream.
    """

    def __init__(self, launches: list[Callable[[], None]]) -> None:
        self._launches = launches
        self.launches = len(launches)

    def __call__(self) -> None:
        for f in self._launches:
            f()

    def steps(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """The shrink and the expand launches apart, for a caller that runs them on two
        streams (each launches on the stream current when it is called). Such a plan is made
        with ``fused=False`` and ``pdl=False``."""
        if len(self._launches) != 2:
            raise ValueError("a fused plan has one launch: make it with fused=False for steps()")
        shrink, expand = self._launches
        return shrink, expand


def plan_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> AddLoraPlan:
    """An ``AddLoraPlan`` for these tensors (same arguments as ``add_lora``); nothing runs."""
    launches: list[Callable[[], None]] = _add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer, shrink_cfg, expand_cfg,
        active_slots, check_values, prepare, fused_cfg, fused, pdl,
    )  # fmt: skip
    return AddLoraPlan(launches)


def _add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v_buffer: torch.Tensor | None,
    shrink_cfg: SgmmConfig | None,
    expand_cfg: SgmmConfig | None,
    active_slots: int | None,
    check_values: bool,
    run: Any,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> list[Any]:
    # Every check runs before the first launch, so a bad lora_b cannot leave a half-done op.
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    check_pair(out, x, lora_a, lora_b)
    if active_slots is None:
        active_slots = shapes.num_slots
    v = _v_buffer(v_buffer, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    expand_shapes = check_expand(out, v, lora_b, scales, ranks, False)
    if fused_cfg is None and fused is not False and shrink_cfg is None and expand_cfg is None:
        fused_cfg = fused_config(
            shapes.num_tokens, shapes.hidden, max(expand_shapes.out_sizes), shapes.r_max,
            active_slots, n_slices=shapes.n_slices, sm_count=_sm_count(x.device),
        )  # fmt: skip
    if fused and fused_cfg is None:
        raise ValueError("fused=True needs fused_cfg here: the config table has no row for it")
    if fused_cfg is not None and fused is not False:
        if not fused_cfg.fused:
            raise ValueError("fused_cfg must be a config with fused=True")
        if shapes.r_max > FUSED_MAX_RANK:
            raise ValueError(f"a fused launch holds the rank in registers: R_max must be <= "
                             f"{FUSED_MAX_RANK}, got {shapes.r_max}")  # fmt: skip
        _check_config(fused_cfg)
        fused_launch = _launch_fused(
            out, x, lora_a, lora_b, scales, ranks, meta, shapes, expand_shapes, fused_cfg, run
        )
        return [fused_launch]
    if pdl is None:
        pdl = pdl_available(x.device)
    if shrink_cfg is None:
        shrink_cfg = shrink_config(shapes.num_tokens, shapes.hidden, shapes.r_max, active_slots)
    if expand_cfg is None:
        expand_cfg = expand_config(
            shapes.num_tokens, max(expand_shapes.out_sizes), shapes.r_max, active_slots
        )
    _check_config(shrink_cfg)
    _check_config(expand_cfg)
    if expand_cfg.gemv and expand_cfg.block_k < shapes.r_max:
        raise ValueError(f"a gemv expand needs config.block_k >= R_max={shapes.r_max}")
    if expand_cfg.hoist_v and expand_cfg.block_k < shapes.r_max:
        raise ValueError(f"config.hoist_v needs config.block_k >= R_max={shapes.r_max}")
    # Launch straight away: sgmm_shrink / sgmm_expand would repeat the checks above, and this
    # runs for every targeted module of every layer.
    return [
        _launch_shrink(x, lora_a, ranks, meta, v, shapes, shrink_cfg, run, launch_deps=pdl),
        _launch_expand(
            out, v, lora_b, scales, ranks, meta, expand_shapes, expand_cfg, run, pdl=pdl
        ),
    ]


def _v_buffer(
    buf: torch.Tensor | None, n_slices: int, num_tokens: int, r_max: int, device: torch.device
) -> torch.Tensor:
    shape = (n_slices, num_tokens, r_max)
    if buf is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != shape:
        raise ValueError(f"v buffer must be a float32 tensor of shape {list(shape)}")
    if buf.dtype != torch.float32 or buf.device != device:
        raise ValueError(f"v buffer must be float32 on {device}")
    return buf
