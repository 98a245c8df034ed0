"""SGMM config space: which tile shape, split and kernel variant a batch's shape gets.

One small table per op, keyed by (token-count bucket, rank bucket), with rows by density (tokens
per adapter) that override it, and INT4 rows that override those for the packed kernels. The
launchers (``sgmm.py``, ``sgmm_int4.py``) ask ``shrink_config`` / ``expand_config`` /
``fused_config`` / ``int4_shrink_config`` / ``int4_expand_config``; the kernels they launch are
in ``sgmm_kernels.py`` and ``sgmm_int4_kernels.py``. Every row is a measurement: the sweep it
came from is named next to its table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import triton

__all__ = [
    "FUSED_MAX_HIDDEN",
    "FUSED_MAX_RANK",
    "GEMV_EXPAND_MAX_RANK",
    "HOIST_MAX_RANK",
    "MID_TOKENS_PER_SLOT",
    "SPARSE_TOKENS_PER_SLOT",
    "T_BUCKETS",
    "ExpandTile",
    "FusedTile",
    "Int4ExpandTile",
    "Int4ShrinkTile",
    "SgmmConfig",
    "ShrinkTile",
    "density_bucket",
    "density_slots",
    "expand_config",
    "fused_config",
    "int4_expand_config",
    "int4_shrink_config",
    "pow2_at_least_16",
    "rank_bucket",
    "shrink_config",
    "token_bucket",
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
    # Shrink and expand in one launch (sgmm_kernels.sgmm_fused_kernel): block_m tokens of one
    # slot per program, block_k columns of H per shrink step, n_blocks column blocks of block_n
    # each.
    fused: bool = False


def pow2_at_least_16(n: int) -> int:
    return max(16, int(triton.next_power_of_2(n)))


# One named row type per table layout; the config functions read rows by field name. Fields
# are SgmmConfig's; the defaults are the tables' most common values.
class ShrinkTile(NamedTuple):
    """A shrink row. ``gemv_rows`` > 0 picks the matrix-vector shrink with that many rank rows
    per program (its block_n), no split; else block_n = min(pow2(R_max), 64)."""

    block_m: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    gemv_rows: int = 0


class ExpandTile(NamedTuple):
    """An expand row; block_k follows from the rank (the whole rank for gemv or hoist_v,
    else min(pow2(R_max), 64))."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    prefetch_out: bool = False
    n_blocks: int = 1
    gemv: bool = False
    hoist_v: bool = False


class FusedTile(NamedTuple):
    """A one-launch (fused shrink and expand) row."""

    block_m: int
    block_n: int
    block_k: int
    n_blocks: int
    num_warps: int = 4
    num_stages: int = 3


class Int4ShrinkTile(NamedTuple):
    """An INT4 shrink row; ``block_n`` is the rank rows per program for gemv."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    gemv: bool = False


class Int4ExpandTile(NamedTuple):
    """An INT4 expand row; block_k covers the rank for gemv."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    n_blocks: int = 1
    gemv: bool = False


# Token-count buckets (upper bounds, inclusive) and rank buckets: ranks up to 32 use the
# "low" row, larger ranks the "high" row. The sweep ran r=16 and r=64.
T_BUCKETS = (16, 64, 256, 1 << 62)


def token_bucket(num_tokens: int) -> int:
    return next(b for b in T_BUCKETS if num_tokens <= b)


def rank_bucket(r_max: int) -> str:
    return "low" if r_max <= 32 else "high"


# Sweep of 2026-11-29 (bench_sgmm.py --sweep, bench/results/sgmm_h200_run2.json): each op alone,
# graph replay over 16 input sets, S=1, H=4096, bf16; every candidate checked against fp32 torch.
# shrink rows: block_n = min(pow2(R_max), 64).
# Best vs. the unsplit tile, us: T=16 r=16 6.6 (unsplit 16x256: 10.4); T=16 r=64 8.3 (15.9);
# T=64 r=16 6.6 (10.5); T=64 r=64 8.7 (15.8); T=256 r=16 7.5 (32x256: 10.8); T=256 r=64 9.7;
# T=4096 r=16 14.3
# (split 1: 14.4); T=4096 r=64 18.7 (32x256: 20.3). More splits lose: 32 splits of 128 cost
# 11.6-15.8 us at T=16/64, the partial traffic and the serial last-arrival sum grow.
_SHRINK_TABLE: dict[tuple[int, str], ShrinkTile] = {
    (16, "low"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (16, "high"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (64, "low"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (64, "high"): ShrinkTile(block_m=16, block_k=128, split_k=8),
    (256, "low"): ShrinkTile(block_m=16, block_k=128, split_k=8),
    (256, "high"): ShrinkTile(block_m=16, block_k=128, split_k=4),
    (T_BUCKETS[-1], "low"): ShrinkTile(block_m=32, block_k=256, split_k=2),
    (T_BUCKETS[-1], "high"): ShrinkTile(block_m=64, block_k=256, split_k=1, num_warps=8),
}

# expand rows: block_k = min(pow2(R_max), 64).
# Picked per (T, r) by the least summed slowdown over N=4096 and N=14336, us (N=4096 / 14336):
# T=16 r=16 3.0/3.3; T=16 r=64 3.7/4.6; T=64 r=16 3.2/4.2; T=64 r=64 4.2/5.6 (16x128: 4.5/8.4);
# T=256 r=16 5.2/10.1; T=256 r=64 5.8/19.1; T=4096 r=16 27.9/90.4; T=4096 r=64 47.1/149.7
# (the old 64x128 tile: 51.7/166.5). Prefetching out wins by 0-5 %, never loses more than 4 %.
_EXPAND_TABLE: dict[tuple[int, str], ExpandTile] = {
    (16, "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (16, "high"): ExpandTile(block_m=16, block_n=128),
    (64, "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (64, "high"): ExpandTile(block_m=32, block_n=128, prefetch_out=True),
    (256, "low"): ExpandTile(block_m=64, block_n=128, prefetch_out=True),
    (256, "high"): ExpandTile(block_m=32, block_n=128, prefetch_out=True),
    (T_BUCKETS[-1], "low"): ExpandTile(block_m=64, block_n=128),
    (T_BUCKETS[-1], "high"): ExpandTile(block_m=64, block_n=256, num_warps=8, prefetch_out=True),
}


# Tokens per active adapter: batches with few tokens per adapter (decode) leave most rows of a
# tall tile empty, so they get their own rows: "sparse" (<= 4 per adapter), "mid" (<= 32),
# else "dense". The host knows the batch's adapters (the scheduler built it); add_lora assumes
# as many as the pool has slots when the caller does not say, the worst case for a CUDA graph
# captured once for any mix.
SPARSE_TOKENS_PER_SLOT = 4
MID_TOKENS_PER_SLOT = 32


def density_bucket(num_tokens: int, active_slots: int | None) -> str:
    slots = max(1, num_tokens if active_slots is None else min(active_slots, num_tokens))
    if num_tokens <= SPARSE_TOKENS_PER_SLOT * slots:
        return "sparse"
    return "mid" if num_tokens <= MID_TOKENS_PER_SLOT * slots else "dense"


def density_slots(num_tokens: int, density: str) -> int | None:
    """The most distinct adapters a batch of ``num_tokens`` can hold and still be of
    ``density``: the ``active_slots`` to pick configs with for every batch of that density
    (a CUDA graph captured once per density replays its configs for any such batch). None
    for "sparse", which any number of adapters is."""
    if density == "dense":
        return max(1, (num_tokens - 1) // MID_TOKENS_PER_SLOT)
    if density == "mid":
        return max(1, (num_tokens - 1) // SPARSE_TOKENS_PER_SLOT)
    if density != "sparse":
        raise ValueError(f"density must be sparse, mid or dense, got {density!r}")
    return None


# Rows by (T bucket, density, rank bucket) that override the tables above, from the decode
# sweep of 2026-12-02 (bench/sweep_sgmm_decode.py; bench/results/sgmm_decode_sweep_h200.json):
# each op timed alone on the four module groups of a 7B layer (qkv, o, gate_up, down) in graph
# replay, pool of 128 (256 for S=256), >= 256 MB touched per pass; the pick has the least
# summed time over the groups and shapes of its key. Every T <= 256 shape measured (S = 1..256)
# and T=1024 at 16 tokens per adapter won with 16- or 32-row tiles: at T=1024 S=64 the old
# 64-row rows took 385.9 us summed, these 182.6.
_SHRINK_ROWS: dict[tuple[int, str, str], ShrinkTile] = {
    (16, "sparse", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4, num_stages=5),
    (16, "sparse", "high"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (16, "mid", "low"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (16, "mid", "high"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (16, "dense", "low"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (16, "dense", "high"): ShrinkTile(block_m=16, block_k=256, split_k=8),
    (64, "sparse", "low"): ShrinkTile(block_m=32, block_k=256, split_k=4),
    (64, "sparse", "high"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (64, "mid", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4, num_stages=5),
    (64, "dense", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4, num_stages=5),
    (256, "sparse", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (256, "sparse", "high"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (T_BUCKETS[-1], "sparse", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (T_BUCKETS[-1], "mid", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (T_BUCKETS[-1], "sparse", "high"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (T_BUCKETS[-1], "mid", "high"): ShrinkTile(block_m=16, block_k=256, split_k=4),
    (T_BUCKETS[-1], "dense", "low"): ShrinkTile(block_m=16, block_k=256, split_k=4, num_stages=5),
    (T_BUCKETS[-1], "dense", "high"): ShrinkTile(block_m=64, block_k=128, split_k=1, num_stages=4),
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
# The gemv rows are from the matrix-vector sweep of 2026-12-02 (bench/results/sgmm_decode_sweep_h200_gemv.json):
# at one to four tokens per adapter and T <= 64, one token per program with the whole rank in one
# tile won every case against the tensor-core tiles (pick summed over the layer's groups: T=16
# 38.9 us, T=64 56.3 us); at T=64 S=64 the case's best shrink plus best expand took 30.6 us for
# qkv and 35.5 for gate_up, the tables of that day 40.4 and 55.0. At T=256 tiles won 3 of 4.
_EXPAND_ROWS: dict[tuple[int, str, str], ExpandTile] = {
    (16, "sparse", "low"): ExpandTile(block_m=1, block_n=512, gemv=True),
    (16, "sparse", "high"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (16, "mid", "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (16, "mid", "high"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (16, "dense", "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (16, "dense", "high"): ExpandTile(block_m=16, block_n=256, prefetch_out=True),
    (64, "sparse", "low"): ExpandTile(block_m=1, block_n=512, gemv=True),
    (64, "sparse", "high"): ExpandTile(block_m=1, block_n=256, num_stages=3, n_blocks=4, gemv=True),
    (64, "mid", "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True, n_blocks=2),
    (64, "mid", "high"): ExpandTile(block_m=16, block_n=256, prefetch_out=True, n_blocks=2),
    (64, "dense", "low"): ExpandTile(block_m=16, block_n=256, prefetch_out=True, n_blocks=2),
    (64, "dense", "high"): ExpandTile(block_m=16, block_n=256, prefetch_out=True, n_blocks=2),
    (256, "sparse", "low"): ExpandTile(
        block_m=16, block_n=512, num_warps=8, num_stages=3, n_blocks=2, hoist_v=True
    ),
    (256, "sparse", "high"): ExpandTile(
        block_m=16, block_n=256, num_stages=3, n_blocks=4, hoist_v=True
    ),
    (T_BUCKETS[-1], "sparse", "low"): ExpandTile(
        block_m=16, block_n=128, num_stages=3, prefetch_out=True, n_blocks=4
    ),
    (T_BUCKETS[-1], "mid", "low"): ExpandTile(
        block_m=16, block_n=128, num_stages=3, prefetch_out=True, n_blocks=4
    ),
    (T_BUCKETS[-1], "sparse", "high"): ExpandTile(
        block_m=16, block_n=256, num_stages=3, prefetch_out=True, n_blocks=4
    ),
    (T_BUCKETS[-1], "mid", "high"): ExpandTile(
        block_m=16, block_n=256, num_stages=3, prefetch_out=True, n_blocks=4
    ),
    (T_BUCKETS[-1], "dense", "low"): ExpandTile(
        block_m=64, block_n=128, num_warps=8, num_stages=3, n_blocks=8, hoist_v=True
    ),
    (T_BUCKETS[-1], "dense", "high"): ExpandTile(
        block_m=64, block_n=128, num_warps=8, num_stages=3, n_blocks=8, hoist_v=True
    ),
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
_ONE_TOKEN_SHRINK: dict[bool, ShrinkTile] = {
    False: ShrinkTile(block_m=1, block_k=1024, split_k=1, num_stages=2, gemv_rows=2),  # H <= 4096
    True: ShrinkTile(block_m=16, block_k=256, split_k=8),  # wider H
}
_ONE_TOKEN_EXPAND = ExpandTile(block_m=16, block_n=256, prefetch_out=True)


def shrink_config(
    num_tokens: int,
    hidden: int,
    r_max: int,
    active_slots: int | None = None,
) -> SgmmConfig:
    """The shrink config for a batch: its density row, else the T bucket's tile row."""
    token_key, rank_key = token_bucket(num_tokens), rank_bucket(r_max)
    row = _SHRINK_ROWS.get((token_key, density_bucket(num_tokens, active_slots), rank_key))
    if num_tokens <= _GEMV_SHRINK_MAX_TOKENS and rank_key == "low":
        row = _ONE_TOKEN_SHRINK[hidden > _ONE_TOKEN_NARROW_H]
    if row is None:
        row = _SHRINK_TABLE[(token_key, rank_key)]
    if row.gemv_rows:
        return SgmmConfig(
            row.block_m, row.gemv_rows, row.block_k, num_warps=row.num_warps,
            num_stages=row.num_stages, gemv=True,
        )  # fmt: skip
    return SgmmConfig(
        row.block_m, min(pow2_at_least_16(r_max), 64), row.block_k, num_warps=row.num_warps,
        num_stages=row.num_stages, split_k=row.split_k,
    )  # fmt: skip


def expand_config(
    num_tokens: int,
    n_max: int,
    r_max: int,
    active_slots: int | None = None,
) -> SgmmConfig:
    """The expand config for a batch: its density row, else the T bucket's tile row (also
    where a gemv row's rank would pass GEMV_EXPAND_MAX_RANK)."""
    token_key, rank_key = token_bucket(num_tokens), rank_bucket(r_max)
    row = _EXPAND_ROWS.get((token_key, density_bucket(num_tokens, active_slots), rank_key))
    if num_tokens == 1 and rank_key == "low":
        row = _ONE_TOKEN_EXPAND
    if row is None or (row.gemv and r_max > GEMV_EXPAND_MAX_RANK):
        row = _EXPAND_TABLE[(token_key, rank_key)]
    # The hoisted tile keeps the whole rank in registers: up to HOIST_MAX_RANK.
    hoist = row.hoist_v and r_max <= HOIST_MAX_RANK
    # A gemv program (or a hoisted tile) holds the whole rank in one tile; a tensor-core tile
    # walks it in steps.
    whole = row.gemv or hoist
    bk = pow2_at_least_16(r_max) if whole else min(pow2_at_least_16(r_max), 64)
    return SgmmConfig(
        row.block_m, row.block_n, bk, num_warps=row.num_warps, num_stages=row.num_stages,
        prefetch_out=row.prefetch_out, n_blocks=row.n_blocks, gemv=row.gemv, hoist_v=hoist,
    )  # fmt: skip


# One launch (shrink and expand fused) where it measured faster than the two launches' best,
# per (T bucket, density, rank bucket); a missing key keeps the two launches. Ranks above FUSED_MAX_RANK never fuse
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
_FUSED_ROWS: dict[tuple[int, str, str], FusedTile] = {
    (T_BUCKETS[-1], "dense", "low"): FusedTile(block_m=32, block_n=128, block_k=64, n_blocks=32),
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
        (token_bucket(num_tokens), density_bucket(num_tokens, active_slots), rank_bucket(r_max))
    )
    if row is None:
        return None
    programs = (
        int(triton.cdiv(num_tokens, row.block_m))  # the non-empty tiles at least
        * int(triton.cdiv(n_max, row.block_n * row.n_blocks))
        * n_slices
    )
    if programs < _FUSED_MIN_PROGRAMS_PER_SM * sm_count:
        return None
    return SgmmConfig(
        row.block_m, row.block_n, row.block_k, num_warps=row.num_warps,
        num_stages=row.num_stages, n_blocks=row.n_blocks, fused=True,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# INT4 (sgmm_int4.py)
# ---------------------------------------------------------------------------------------------
# INT4 rows by (T bucket, density, rank bucket) that override the bf16 tables, from the INT4
# sweep of 2026-12-04 with the kernels' final scale loads (bench/sweep_sgmm_int4.py,
# bench/results/sgmm_int4_sweep_h200_scales.json; H = N = 4096, pool of 128, graph replay,
# each op alone, us): r=16 T=64 S=8 shrink gemv 10.8 (the best split tile 13.6), expand
# 16-row tile 7.3; S=64 shrink 10.4, expand gemv 7.7 (tiles > 10.1); r=16 T=256 S=64 shrink gemv
# 15.0 (tile 19.7), expand gemv 15.6 (tile 17.3); r=64 T=64 S=64 shrink 22.8, expand gemv
# 17.6; r=64 T=256 S=64 shrink 16x16 split tile 41.0, expand 16x256 tile 30.2. T <= 16 keeps
# the bf16 rows (7.6 / 10.7 us at S = 1 / 16, the best pairs 8.5 / 10.6).
_INT4_SHRINK_ROWS: dict[tuple[int, str, str], Int4ShrinkTile] = {
    (64, "mid", "low"): Int4ShrinkTile(block_m=1, block_n=2, block_k=1024, gemv=True),
    (64, "sparse", "low"): Int4ShrinkTile(block_m=1, block_n=2, block_k=1024, gemv=True),
    (64, "sparse", "high"): Int4ShrinkTile(block_m=1, block_n=2, block_k=1024, gemv=True),
    (256, "sparse", "low"): Int4ShrinkTile(block_m=2, block_n=4, block_k=512, gemv=True),
    (256, "sparse", "high"): Int4ShrinkTile(
        block_m=16, block_n=16, block_k=512, split_k=4, num_stages=3
    ),
}
_INT4_EXPAND_ROWS: dict[tuple[int, str, str], Int4ExpandTile] = {
    (64, "mid", "low"): Int4ExpandTile(block_m=16, block_n=256),
    (64, "sparse", "low"): Int4ExpandTile(block_m=2, block_n=512, gemv=True),
    (64, "sparse", "high"): Int4ExpandTile(
        block_m=1, block_n=256, num_stages=3, n_blocks=4, gemv=True
    ),
    (256, "sparse", "low"): Int4ExpandTile(block_m=2, block_n=512, gemv=True),
    (256, "sparse", "high"): Int4ExpandTile(block_m=16, block_n=256),
}


def _int4_key(num_tokens: int, r_max: int, active_slots: int | None) -> tuple[int, str, str]:
    return (token_bucket(num_tokens), density_bucket(num_tokens, active_slots), rank_bucket(r_max))


def int4_shrink_config(
    num_tokens: int, hidden: int, r_max: int, active_slots: int | None = None
) -> SgmmConfig:
    """The INT4 shrink config for a batch: an INT4 row, else the bf16 tables'."""
    row = _INT4_SHRINK_ROWS.get(_int4_key(num_tokens, r_max, active_slots))
    if row is None:
        return shrink_config(num_tokens, hidden, r_max, active_slots)
    return SgmmConfig(
        row.block_m, row.block_n, row.block_k, num_warps=row.num_warps,
        num_stages=row.num_stages, split_k=row.split_k, gemv=row.gemv,
    )  # fmt: skip


def int4_expand_config(
    num_tokens: int, n_max: int, r_max: int, active_slots: int | None = None
) -> SgmmConfig:
    """The INT4 expand config for a batch: an INT4 row, else the bf16 tables'."""
    row = _INT4_EXPAND_ROWS.get(_int4_key(num_tokens, r_max, active_slots))
    if row is None or (row.gemv and r_max > GEMV_EXPAND_MAX_RANK):
        return expand_config(num_tokens, n_max, r_max, active_slots)
    bk = pow2_at_least_16(r_max) if row.gemv else min(pow2_at_least_16(r_max), 64)
    return SgmmConfig(
        row.block_m, row.block_n, bk, num_warps=row.num_warps, num_stages=row.num_stages,
        n_blocks=row.n_blocks, gemv=row.gemv,
    )  # fmt: skip
