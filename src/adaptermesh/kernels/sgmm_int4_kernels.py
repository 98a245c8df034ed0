# Triton kernels take untyped launch arguments; mypy checks the typed launchers (sgmm_int4.py).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""SGMM kernels with INT4 adapter weights (the format: ``int4_weight.py``).

The bf16 SGMM's segment and tile scheme (``sgmm_kernels.locate_tile``, a grid from shapes
only, split-K shrink with the same workspace and ``store_shrink_tile``), with the packed
weights dequantised in registers. Tiles: a step of BLOCK_K reduction elements is BLOCK_K/2
bytes per row, split into nibbles, scaled and interleaved back into the [BLOCK_K, BLOCK_N]
weight tile, so the activations are one contiguous tile and the step is one ``tl.dot``.
Matrix-vector kernels (the tables' gemv rows, decode at a few tokens per adapter): the low
nibbles multiply the even reduction elements, the high nibbles the odd ones, on the CUDA cores,
no interleave. The dequantised weight is rounded to the activation dtype before the product, as
bf16 weights are fed; the torch twin (``reference.add_lora_int4_ref``) rounds the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from adaptermesh.kernels.sgmm_kernels import (
    expand_tile,
    shrink_tile,
    slice_pointer,
    slice_strides,
    store_shrink_tile,
    tile_tokens,
)

__all__ = ["dequant_step", "expand_int4_kernel", "shrink_int4_kernel"]


@triton.jit
def _nibbles(b):
    """uint8 tile -> (low, high) signed nibbles as fp32 tiles."""
    b32 = b.to(tl.int32)
    lo = ((b32 & 15) ^ 8) - 8
    hi = ((b32 >> 4) ^ 8) - 8
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def dequant_step(
    q_ptr,  # packed bytes of one slot (and slice): [rows, ceil(K/2)]
    s_ptr,  # its scales
    r0,  # first row of the block, a multiple of BLOCK_R
    r_size,  # rows in range
    k0,  # first reduction element of the step, a multiple of BLOCK_K
    k_end,  # reduction elements in range
    stride_qr,
    stride_qk,  # per byte
    stride_sr,
    stride_sk,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ALONG_K: tl.constexpr,
    SCALE_BLOCKS: tl.constexpr,
):
    """One step of a packed weight: rows [r0, r0 + BLOCK_R) x reduction elements [k0, k0 +
    BLOCK_K), as (even, odd) [BLOCK_R, BLOCK_K // 2] fp32 tiles ``q * scale`` (the low nibbles
    are the even elements, the high ones the odd), 0 out of range.

    Scales: SCALE_BLOCKS means the groups align with the block (GROUP a power of two no wider
    than a step along K, or than the block of rows): one load per group, repeated over its
    elements. Otherwise a per-element gather along K, or one contiguous row of scales per
    weight row split into its even and odd elements."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask_r = offs_r < r_size
    even = k0 + 2 * tl.arange(0, HALF)
    w_mask = mask_r[:, None] & (even < k_end)[None, :]
    b = tl.load(q_ptr + offs_r[:, None] * stride_qr + (even // 2)[None, :] * stride_qk,
                mask=w_mask, other=0)  # fmt: skip
    if GROUP_ALONG_K:
        if SCALE_BLOCKS:
            NG: tl.constexpr = BLOCK_K // GROUP
            g = k0 // GROUP + tl.arange(0, NG)
            sg = tl.load(s_ptr + offs_r[:, None] * stride_sr + g[None, :] * stride_sk,
                         mask=mask_r[:, None] & (g * GROUP < k_end)[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            sc = tl.reshape(tl.broadcast_to(sg[:, :, None], (BLOCK_R, NG, GROUP // 2)),
                            (BLOCK_R, HALF))  # fmt: skip
        else:
            sc = tl.load(s_ptr + offs_r[:, None] * stride_sr + (even // GROUP)[None, :] * stride_sk,
                         mask=w_mask, other=0.0).to(tl.float32)  # fmt: skip
        sc_o = sc  # the pair shares a group (GROUP is even)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        if SCALE_BLOCKS:
            NGR: tl.constexpr = BLOCK_R // GROUP
            g = r0 // GROUP + tl.arange(0, NGR)
            sg = tl.load(s_ptr + g[:, None] * stride_sr + kk[None, :] * stride_sk,
                         mask=(g * GROUP < r_size)[:, None] & (kk < k_end)[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            s_row = tl.reshape(tl.broadcast_to(sg[:, None, :], (NGR, GROUP, BLOCK_K)),
                               (BLOCK_R, BLOCK_K))  # fmt: skip
        else:
            s_row = tl.load(s_ptr + (offs_r // GROUP)[:, None] * stride_sr + kk[None, :] * stride_sk,
                            mask=mask_r[:, None] & (kk < k_end)[None, :],
                            other=0.0).to(tl.float32)  # fmt: skip
        sc, sc_o = tl.split(tl.reshape(s_row, (BLOCK_R, HALF, 2)))
    lo, hi = _nibbles(b)
    return lo * sc, hi * sc_o


@triton.jit
def shrink_int4_kernel(
    x_ptr,
    qa_ptr,  # uint8 [n_slices, S, R_max, ceil(H/2)]
    sa_ptr,  # bf16 scales
    v_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    part_ptr,
    count_ptr,
    H,
    S,
    R_MAX,
    T,
    GRID_M,
    N_TILES_N,
    SPLIT_K,
    K_PER_SPLIT,  # a multiple of BLOCK_K (even)
    stride_xt,
    stride_xh,
    stride_qi,
    stride_qs,
    stride_qr,
    stride_qh,  # per byte
    stride_si,
    stride_ss,
    stride_sr,
    stride_sh,
    stride_vi,
    stride_vt,
    stride_vr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rank rows per program
    BLOCK_K: tl.constexpr,  # reduction elements per step (BLOCK_K // 2 bytes)
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ALONG_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SCALE_BLOCKS: tl.constexpr,  # see dequant_step
    GEMV: tl.constexpr,  # the matrix-vector product (CUDA cores, SPLIT_K = 1) instead of tiles
    LAUNCH_DEPS: tl.constexpr = False,
):
    """Tiles: each step's dequantised [BLOCK_N, BLOCK_K] slice of A is interleaved back from
    its nibbles (column 2j the low, 2j+1 the high), so x is one contiguous tile and the step is
    one product; split-K as in the bf16 shrink. GEMV (a few tokens per program, decode): x is
    split into its even and odd columns against the low and high nibbles on the CUDA cores,
    no tile padding of a one-token segment. The dequantised weight is rounded to the
    activation dtype before the product, as bf16 weights are fed."""
    live, pid_m, pid_n, pid_k, pid_i, slot, row_begin, seg_end, rank, n_start = shrink_tile(
        seg_start_ptr, ranks_ptr, S, R_MAX, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_S, LAUNCH_DEPS
    )
    if not live:
        return
    HALF: tl.constexpr = BLOCK_K // 2
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < rank
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(H, k_begin + K_PER_SPLIT)
    offs_kk = tl.arange(0, BLOCK_K)
    q_slot = qa_ptr + pid_i * stride_qi + slot.to(tl.int64) * stride_qs
    s_slot = sa_ptr + pid_i * stride_si + slot.to(tl.int64) * stride_ss
    x_base = x_ptr + tok[:, None] * stride_xt
    if GEMV:
        acc = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_kk
        xt = tl.load(x_base + kk[None, :] * stride_xh, mask=mask_m[:, None] & (kk < k_end)[None, :],
                     other=0.0)  # fmt: skip
        we, wo = dequant_step(
            q_slot, s_slot, n_start, rank, k0, k_end, stride_qr, stride_qh, stride_sr,
            stride_sh, BLOCK_N, BLOCK_K, GROUP, GROUP_ALONG_K, SCALE_BLOCKS,
        )  # fmt: skip
        we = we.to(x_ptr.dtype.element_ty)
        wo = wo.to(x_ptr.dtype.element_ty)
        if GEMV:
            xe, xo = tl.split(tl.reshape(xt.to(tl.float32), (BLOCK_M, HALF, 2)))
            acc += (xe[:, None, :] * we.to(tl.float32)[None, :, :]
                    + xo[:, None, :] * wo.to(tl.float32)[None, :, :])  # fmt: skip
        else:
            w = tl.trans(tl.interleave(we, wo))  # [BLOCK_K, BLOCK_N]
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, w)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    v_ptrs = v_ptr + pid_i * stride_vi + tok[:, None] * stride_vt + offs_n[None, :] * stride_vr
    if GEMV:
        tl.store(v_ptrs, tl.sum(acc, axis=2), mask=mask_mn)
    else:
        store_shrink_tile(
            acc, v_ptrs, part_ptr, count_ptr, tok, offs_n, mask_mn, pid_i, pid_k, pid_n, pid_m,
            T, R_MAX, GRID_M, N_TILES_N, SPLIT_K, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def expand_int4_kernel(
    out_ptr,
    v_ptr,
    q0_ptr,
    q1_ptr,
    q2_ptr,
    s0_ptr,
    s1_ptr,
    s2_ptr,
    scales_ptr,
    ranks_ptr,
    sorted_ptr,
    seg_start_ptr,
    S,
    R_MAX,
    N0,
    N1,
    N2,
    OFF1,
    OFF2,
    N_BLOCKS,
    stride_ot,
    stride_on,
    stride_vi,
    stride_vt,
    stride_vr,
    stride_q0s,
    stride_q0n,
    stride_q0r,
    stride_q1s,
    stride_q1n,
    stride_q1r,
    stride_q2s,
    stride_q2n,
    stride_q2r,
    stride_s0s,
    stride_s0n,
    stride_s0r,
    stride_s1s,
    stride_s1n,
    stride_s1r,
    stride_s2s,
    stride_s2n,
    stride_s2r,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # rank elements per step (GEMV: >= R_MAX, the whole rank)
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_ALONG_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SCALE_BLOCKS: tl.constexpr,  # see dequant_step
    GEMV: tl.constexpr,  # the matrix-vector product (CUDA cores) instead of tiles
    PDL: tl.constexpr = False,
):
    """Tiles: each step's dequantised [BLOCK_N, BLOCK_K] slice of B is interleaved back, so v
    is one contiguous tile and the step is one product. GEMV (a few tokens per program,
    decode): each program dequantises a [BLOCK_N, rank] tile of B once per column block and
    reduces it against each of its tokens' v rows on the CUDA cores."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_i = tl.program_id(2)
    # Per-slice packed B, its scales and their strides (at most three slices).
    stride_qs, stride_qn, stride_qr = slice_strides(
        pid_i, stride_q0s, stride_q0n, stride_q0r, stride_q1s, stride_q1n, stride_q1r,
        stride_q2s, stride_q2n, stride_q2r,
    )  # fmt: skip
    stride_ss, stride_sn, stride_sr = slice_strides(
        pid_i, stride_s0s, stride_s0n, stride_s0r, stride_s1s, stride_s1n, stride_s1r,
        stride_s2s, stride_s2n, stride_s2r,
    )  # fmt: skip
    q_ptr = slice_pointer(pid_i, q0_ptr, q1_ptr, q2_ptr)
    s_ptr = slice_pointer(pid_i, s0_ptr, s1_ptr, s2_ptr)
    live, n_size, col_off, n_first, slot, row_begin, seg_end, rank = expand_tile(
        pid_m, pid_n, pid_i, seg_start_ptr, ranks_ptr, S, R_MAX, N0, N1, N2, OFF1, OFF2,
        N_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_S, PDL,
    )  # fmt: skip
    if not live:
        return
    HALF: tl.constexpr = BLOCK_K // 2
    mask_m, tok = tile_tokens(sorted_ptr, row_begin, seg_end, BLOCK_M)
    offs_kk = tl.arange(0, BLOCK_K)
    even = 2 * tl.arange(0, HALF)
    v_base = v_ptr + pid_i.to(tl.int64) * stride_vi
    scale = tl.load(scales_ptr + slot)
    q_slot = q_ptr + slot.to(tl.int64) * stride_qs
    s_slot = s_ptr + slot.to(tl.int64) * stride_ss
    if PDL:  # the prologue above overlapped the shrink; v is read only after it finished
        tl.extra.cuda.gdc_wait()
    for jn in range(0, N_BLOCKS):
        n0 = n_first + jn * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_size
        if GEMV:
            we, wo = dequant_step(
                q_slot, s_slot, n0, n_size, 0, rank, stride_qn, stride_qr, stride_sn,
                stride_sr, BLOCK_N, BLOCK_K, GROUP, GROUP_ALONG_K, SCALE_BLOCKS,
            )  # fmt: skip
            we = we.to(out_ptr.dtype.element_ty).to(tl.float32)
            wo = wo.to(out_ptr.dtype.element_ty).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                row = row_begin + m
                if row < seg_end:
                    t = tl.load(sorted_ptr + row).to(tl.int64)
                    # v rounded to the activation dtype, as the tiles feed it.
                    ve = tl.load(v_base + t * stride_vt + even * stride_vr, mask=even < rank,
                                 other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
                    vo = tl.load(v_base + t * stride_vt + (even + 1) * stride_vr,
                                 mask=(even + 1) < rank,
                                 other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
                    acc = tl.sum(we * ve[None, :] + wo * vo[None, :], axis=1)
                    o_ptrs = out_ptr + t * stride_ot + (col_off + offs_n) * stride_on
                    o = tl.load(o_ptrs, mask=mask_n, other=0.0)
                    tl.store(o_ptrs, (o.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty),
                             mask=mask_n)  # fmt: skip
        else:
            o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :] * stride_on
            o_mask = mask_m[:, None] & mask_n[None, :]
            o = tl.load(o_ptrs, mask=o_mask, other=0.0)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, rank, BLOCK_K):
                kk = k0 + offs_kk
                vt = tl.load(v_base + tok[:, None] * stride_vt + kk[None, :] * stride_vr,
                             mask=mask_m[:, None] & (kk < rank)[None, :], other=0.0)  # fmt: skip
                we, wo = dequant_step(
                    q_slot, s_slot, n0, n_size, k0, rank, stride_qn, stride_qr, stride_sn,
                    stride_sr, BLOCK_N, BLOCK_K, GROUP, GROUP_ALONG_K, SCALE_BLOCKS,
                )  # fmt: skip
                w = tl.trans(tl.interleave(we.to(out_ptr.dtype.element_ty),
                                           wo.to(out_ptr.dtype.element_ty)))  # fmt: skip
                # v rounded to the activation dtype, as the bf16 expand feeds it.
                vt = vt.to(out_ptr.dtype.element_ty)
                if DOT_FP32:
                    acc2 += tl.dot(vt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc2 += tl.dot(vt, w)
            tl.store(
                o_ptrs,
                (o.to(tl.float32) + acc2 * scale).to(out_ptr.dtype.element_ty),
                mask=o_mask,
            )
