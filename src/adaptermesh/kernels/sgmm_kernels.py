# Triton kernels take untyped launch arguments; mypy checks the typed launchers (sgmm.py).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""SGMM kernels: segmented gather matrix multiply for a batch that mixes many LoRA adapters.

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

The ``@triton.jit`` bodies only: the tables that pick their meta-parameters are in
``sgmm_config.py``, the launchers that check arguments and size the grids in ``sgmm.py``. The
helpers below (tile location, slice selection, the shrink and expand prologues ``shrink_tile``
and ``expand_tile``, the split-K store) are public because the INT4 kernels
(``sgmm_int4_kernels.py``) run the same scheme.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "expand_tile",
    "locate_tile",
    "of_slice",
    "sgmm_expand_kernel",
    "sgmm_fused_kernel",
    "sgmm_shrink_gemv_kernel",
    "sgmm_shrink_kernel",
    "shrink_tile",
    "slice_columns",
    "slice_operand",
    "slice_pointer",
    "slice_strides",
    "store_shrink_tile",
    "tile_tokens",
]


# ---------------------------------------------------------------------------------------------
# Shared device helpers: the compact tile axis, the per-slice operands, the split-K store.
# ---------------------------------------------------------------------------------------------
@triton.jit
def locate_tile(
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
def of_slice(pid_i, v0, v1, v2):
    """The integer of slice ``pid_i`` (0, 1 or 2). Through tl.where rather than if/else,
    because Triton may specialise any of the three to a constant (e.g. a stride of 1) and the
    branches must then agree on types."""
    return tl.where(pid_i == 0, v0, tl.where(pid_i == 1, v1, v2))


@triton.jit
def tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M: tl.constexpr):
    """(mask_m, tok): which of the tile's BLOCK_M rows lie in its segment, and their token
    indices (int64; 0 for rows past the segment)."""
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    return mask_m, tok


@triton.jit
def slice_columns(pid_i, N0, N1, N2, OFF1, OFF2):
    """(width, first column in out) of output slice ``pid_i``."""
    return of_slice(pid_i, N0, N1, N2), of_slice(pid_i, 0, OFF1, OFF2)


@triton.jit
def slice_strides(
    pid_i,
    stride_0s,
    stride_0n,
    stride_0r,
    stride_1s,
    stride_1n,
    stride_1r,
    stride_2s,
    stride_2n,
    stride_2r,
):
    """(slot stride as int64, row stride, rank stride) of slice ``pid_i``'s ``[S, N_i, R]``
    operand, from the three slices' own."""
    stride_s = of_slice(pid_i, stride_0s, stride_1s, stride_2s).to(tl.int64)
    stride_n = of_slice(pid_i, stride_0n, stride_1n, stride_2n)
    stride_r = of_slice(pid_i, stride_0r, stride_1r, stride_2r)
    return stride_s, stride_n, stride_r


@triton.jit
def slice_pointer(pid_i, p0, p1, p2):
    """The pointer of slice ``pid_i`` (through if/else: pointers have no tl.where)."""
    if pid_i == 0:
        ptr = p0
    elif pid_i == 1:
        ptr = p1
    else:
        ptr = p2
    return ptr


@triton.jit
def slice_operand(
    pid_i,
    p0,
    p1,
    p2,
    stride_0s,
    stride_0n,
    stride_0r,
    stride_1s,
    stride_1n,
    stride_1r,
    stride_2s,
    stride_2n,
    stride_2r,
):
    """(pointer, slot stride as int64, row stride, rank stride) of slice ``pid_i``'s
    ``[S, N_i, R]`` operand (B), from the three slices' own."""
    stride_s, stride_n, stride_r = slice_strides(
        pid_i, stride_0s, stride_0n, stride_0r, stride_1s, stride_1n, stride_1r, stride_2s,
        stride_2n, stride_2r,
    )  # fmt: skip
    return slice_pointer(pid_i, p0, p1, p2), stride_s, stride_n, stride_r


@triton.jit
def _pdl_exit(PDL: tl.constexpr):
    if PDL:  # every program waits, so the grid ends after the shrink it depends on
        tl.extra.cuda.gdc_wait()


@triton.jit
def expand_tile(
    pid_m,
    pid_n,
    pid_i,
    seg_start_ptr,
    ranks_ptr,
    S,
    R_MAX,
    N0,
    N1,
    N2,
    OFF1,
    OFF2,
    N_BLOCKS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """The prologue every expand kernel runs (bf16, INT4, fused): the output slice of
    ``pid_i`` (width, first column), this program's first column, its (slot, tile) and the
    slot's rank. Returns ``(live, n_size, col_off, n_first, slot, row_begin, seg_end, rank)``;
    a program past its slice's width, without a tile, or on a rank-0 slot is not live and the
    kernel returns at once. With ``PDL`` such a program has waited for the shrink first, so the
    grid still ends after the launch it depends on."""
    n_size, col_off = slice_columns(pid_i, N0, N1, N2, OFF1, OFF2)
    n_first = pid_n * N_BLOCKS * BLOCK_N
    if n_first >= n_size:
        _pdl_exit(PDL)
        return False, n_size, col_off, n_first, 0, 0, 0, 0
    has_tile, slot, row_begin, seg_end = locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        _pdl_exit(PDL)
        return False, n_size, col_off, n_first, slot, row_begin, seg_end, 0
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank == 0:
        _pdl_exit(PDL)
        return False, n_size, col_off, n_first, slot, row_begin, seg_end, rank
    return True, n_size, col_off, n_first, slot, row_begin, seg_end, rank


@triton.jit
def shrink_tile(
    seg_start_ptr,
    ranks_ptr,
    S,
    R_MAX,
    SPLIT_K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr,
):
    """The prologue every shrink kernel runs (bf16 tiles and gemv, INT4): with
    ``LAUNCH_DEPS`` it lets the dependent expand start; then this program's token tile, rank
    block, split and slice (grid axis 1 holds rank blocks x ``SPLIT_K`` splits), its (slot,
    tile), the slot's rank and the program's first rank row. Returns ``(live, pid_m, pid_n,
    pid_k, pid_i, slot, row_begin, seg_end, rank, n_start)``; a program without a tile or past
    its slot's rank is not live and the kernel returns at once. Every split of a tile takes
    the same exits, so a tile's split-K counter is touched by all of its splits or by none."""
    if LAUNCH_DEPS:  # the expand (a programmatic dependent launch) may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_nk = tl.program_id(1)
    pid_i = tl.program_id(2).to(tl.int64)
    pid_n = pid_nk // SPLIT_K
    pid_k = pid_nk % SPLIT_K
    has_tile, slot, row_begin, seg_end = locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        return False, pid_m, pid_n, pid_k, pid_i, slot, row_begin, seg_end, 0, 0
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    n_start = pid_n * BLOCK_N
    if n_start >= rank:  # no work past the slot's real rank
        return False, pid_m, pid_n, pid_k, pid_i, slot, row_begin, seg_end, rank, n_start
    return True, pid_m, pid_n, pid_k, pid_i, slot, row_begin, seg_end, rank, n_start


@triton.jit
def store_shrink_tile(
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


@triton.jit
def sgmm_shrink_kernel(
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
    live, pid_m, pid_n, pid_k, pid_i, slot, row_begin, seg_end, rank, n_start = shrink_tile(
        seg_start_ptr, ranks_ptr, S, R_MAX, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_S, LAUNCH_DEPS
    )
    if not live:
        return
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
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
    store_shrink_tile(
        acc, v_ptrs, part_ptr, count_ptr, tok, offs_n, mask_mn, pid_i, pid_k, pid_n, pid_m,
        T, R_MAX, GRID_M, N_TILES_N, SPLIT_K, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def sgmm_shrink_gemv_kernel(
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
    live, _, _, _, pid_i, slot, row_begin, seg_end, rank, n_start = shrink_tile(
        seg_start_ptr, ranks_ptr, S, R_MAX, 1, BLOCK_M, BLOCK_N, BLOCK_S, LAUNCH_DEPS
    )
    if not live:
        return
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
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
def sgmm_expand_kernel(
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
    GEMV: tl.constexpr = False,
):
    """Tiles: each program adds ``v @ B.T`` for a BLOCK_M tile of one slot's tokens to
    N_BLOCKS column blocks, one tensor-core product per step of the rank (with HOIST_V, v is
    loaded once and each column block is one product).

    GEMV, a gathered matrix-vector product (a few tokens per program: decode at about one
    token per adapter): each program loads a [BLOCK_N, rank] tile of its slot's B once
    (BLOCK_K >= R_MAX, the whole rank) and, for each of its at most BLOCK_M tokens, reduces
    it against the token's v row on the CUDA cores. No tensor-core tile, so no 16-row padding
    of a segment that holds one token; DOT_FP32, PREFETCH_OUT and HOIST_V do not apply."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_i = tl.program_id(2)
    # Per-slice B matrix and strides (at most three slices).
    b_ptr, stride_bs, stride_bn, stride_br = slice_operand(
        pid_i, b0_ptr, b1_ptr, b2_ptr, stride_b0s, stride_b0n, stride_b0r, stride_b1s,
        stride_b1n, stride_b1r, stride_b2s, stride_b2n, stride_b2r,
    )  # fmt: skip
    live, n_size, col_off, n_first, slot, row_begin, seg_end, rank = expand_tile(
        pid_m, pid_n, pid_i, seg_start_ptr, ranks_ptr, S, R_MAX, N0, N1, N2, OFF1, OFF2,
        N_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_S, PDL,
    )  # fmt: skip
    if not live:
        return
    if GEMV:
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
                b_base + offs_n[:, None] * stride_bn,
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
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
        return
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
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
        tl.store(o_ptrs, (o.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def sgmm_fused_kernel(
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
    b_ptr, stride_bs, stride_bn, stride_br = slice_operand(
        pid_i, b0_ptr, b1_ptr, b2_ptr, stride_b0s, stride_b0n, stride_b0r, stride_b1s,
        stride_b1n, stride_b1r, stride_b2s, stride_b2n, stride_b2r,
    )  # fmt: skip
    live, n_size, col_off, n_first, slot, row_begin, seg_end, rank = expand_tile(
        pid_m, pid_g, pid_i, seg_start_ptr, ranks_ptr, S, R_MAX, N0, N1, N2, OFF1, OFF2,
        N_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_S, False,
    )  # fmt: skip
    if not live:
        return
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
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
