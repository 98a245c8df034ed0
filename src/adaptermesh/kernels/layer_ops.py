# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Fused elementwise ops of a decoder layer: one launch each where torch needs several.

Maths, per token row ``t`` (``round`` = to the activation dtype, nearest even)::

    rms_norm:       h = round(x + residual)  (stored into residual)   or h = x
                    y = round(w * round(hf * rsqrt(mean(hf^2) + eps)))      hf = float32(h)
                    y = round((1 + w) * hf * rsqrt(mean(hf^2) + eps))       (gemma)
    rope_kv_write:  for every head of q and k, r = rotary_dim, half = r / 2,
                    (c, s) = cos_sin_cache[pos[t], :half], cos_sin_cache[pos[t], half:]
                    x[:half] <- round(x[:half] * c - x[half:r] * s)
                    x[half:r] <- round(x[half:r] * c + x[:half] * s)           (rotate_half)
                    q rotated in place; rotated k and v -> k_cache / v_cache at slot[t]
    act_mul:        y = round(act(gate) * up)      act in silu, gelu, gelu_pytorch_tanh, relu

Design (the fused-norm / fused-rope pattern of Liger-Kernel and vLLM): every op is memory
bound, so each program streams its rows once through registers, keeps the maths in fp32 and
rounds once at each point the torch formula rounds. RMSNorm is one program per row: the row's
sum of squares needs the whole row, and with ``residual`` the new residual stream is written in
the same pass that reads it. RoPE is one program per (token, head tile): q tiles rotate q in
place, k/v tiles rotate k and copy v straight into the paged cache, so the rotated k never
round-trips through memory. act_mul needs no reduction and tiles the row over a second grid
axis. Grids and block sizes depend only on shapes, never on tensor values: the launchers do no
host synchronisation and are safe inside CUDA-graph capture. The torch twins are
``reference.rms_norm_ref`` / ``rope_kv_write_ref`` / ``act_mul_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._validate import (
    ACTIVATIONS,
    check_act_mul,
    check_block,
    check_rms_norm,
    check_rope_kv_write,
)

__all__ = ["act_mul", "rms_norm", "rope_kv_write"]


# ---------------------------------------------------------------------------------------------
# Config space. Not tuned on the GPU by a sweep: the values follow from the memory-bound
# roofline. The reasoning:
# - rms_norm: one program per row holds the whole row in registers when H <= 8192 (the hidden
#   sizes of 7B-70B Llama models are 4096-8192), so the row is read from HBM once; 8192 fp32
#   values over 16 warps is 16 registers per thread. Wider rows loop over 8192-column chunks
#   in two passes (sum of squares, then normalise), the second pass re-reading the row from L2.
#   num_warps grows with the block so each thread keeps 4-16 values, enough for 128-bit loads
#   without spilling.
# - rope_kv_write: a head tile holds up to 2048 elements (16 heads of D=128), 4 warps: one tile
#   covers most of a token's q heads, so a decode step of few tokens still spreads over
#   several programs, and cos/sin are read once per tile.
# - act_mul: 1024-column tiles with 4 warps (8 values per thread, one 128-bit bf16 load each for
#   gate and up); a second grid axis covers I = 11008 / 14336 without a loop.
# One reading of these untuned defaults (one H200, triton 3.6, bf16, CUDA-graph replay,
# Llama-3-8B shapes H=4096, I=14336, 32/8 heads of 128), bytes moved over time: at T=4096
# rms_norm with residual 35 us (3.8 TB/s), rope_kv_write 29 us (3.4 TB/s), act_mul 85 us
# (4.1 TB/s), against about 4.3 TB/s for a device copy; at T=1 each is 1.4-2.1 us, launch
# bound. A sweep may still gain on the decode sizes.
# ---------------------------------------------------------------------------------------------
RMS_MAX_BLOCK = 8192
ROPE_MAX_TILE = 2048
ACT_MAX_BLOCK = 1024


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(n, 1)))


def _rms_warps(block: int) -> int:
    if block <= 1024:
        return 4
    return 8 if block <= 4096 else 16


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _scale_row(normed, w, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """The weighted output of one normalised fp32 chunk, rounded as the torch formula does."""
    if GEMMA:
        return ((1.0 + w.to(tl.float32)) * normed).to(dtype)
    return (w.to(tl.float32) * normed.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _residual_chunk(
    x_row,
    r_row,
    e_row,
    cols,
    mask,
    dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
):
    """Columns ``cols`` of the row the norm reads, as fp32: x, plus extra (rounded), plus the
    residual (rounded), which is stored back into the residual row."""
    h = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_EXTRA:
        e = tl.load(e_row + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + e.to(tl.float32)).to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(r_row + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(r_row + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,
    w_ptr,
    res_ptr,  # the residual stream (read, then overwritten with h); unused without residual
    out_ptr,
    extra_ptr,  # a term added to x first (HAS_EXTRA, which implies HAS_RESIDUAL)
    # sizes
    H,
    eps,
    # strides
    stride_xt,
    stride_rt,
    stride_ot,
    stride_et,
    # meta-parameters
    BLOCK_H: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # H <= BLOCK_H: the row stays in registers
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xt
    r_row = res_ptr + row * stride_rt
    e_row = extra_ptr + row * stride_et
    o_row = out_ptr + row * stride_ot
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    if SINGLE_PASS:
        mask = offs < H
        hf = _residual_chunk(x_row, r_row, e_row, offs, mask, dtype, HAS_RESIDUAL, HAS_EXTRA)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(o_row + offs, _scale_row(hf * rstd, w, GEMMA, dtype), mask=mask)
    else:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + offs
            mask = cols < H
            hf = _residual_chunk(x_row, r_row, e_row, cols, mask, dtype, HAS_RESIDUAL, HAS_EXTRA)
            acc += hf * hf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        if HAS_RESIDUAL:
            # The second pass reads h back from the residual row: make this program's stores
            # visible to all of its threads first.
            tl.debug_barrier()
            src = r_row
        else:
            src = x_row
        for start in range(0, H, BLOCK_H):
            cols = start + offs
            mask = cols < H
            hf = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(o_row + cols, _scale_row(hf * rstd, w, GEMMA, dtype), mask=mask)


@triton.jit
def _rotate_tile(ptrs, mask, cos, sin, HALF, dtype: tl.constexpr):
    """Both rotated halves of a [heads, half] tile at ``ptrs`` (first half), rounded once."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    return o1, o2


@triton.jit
def _rope_kv_write_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,  # [max_pos, 2 * HALF]: cos | sin
    kc_ptr,
    vc_ptr,
    slot_ptr,
    # sizes
    HQ,
    HKV,
    D,
    HALF,
    MAX_POS,
    NUM_SLOTS,  # num_blocks * block_size
    CACHE_BLOCK,  # block_size of the paged cache
    NQ_TILES,  # q head tiles come first on the grid's second axis, then k/v tiles
    # strides
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    # meta-parameters
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL: tl.constexpr,  # rotary_dim < D: dimensions past it pass through
):
    tok = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok)
    pos = tl.minimum(tl.maximum(pos, 0), MAX_POS - 1)
    offs_f = tl.arange(0, BLOCK_HALF)
    mask_f = offs_f < HALF
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + offs_f, mask=mask_f, other=0.0).to(tl.float32)[None, :]
    if tile < NQ_TILES:
        heads = tile * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        mask = (heads < HQ)[:, None] & mask_f[None, :]
        ptrs = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_f[None, :]
        o1, o2 = _rotate_tile(ptrs, mask, cos, sin, HALF, dtype)
        tl.store(ptrs, o1, mask=mask)
        tl.store(ptrs + HALF, o2, mask=mask)
    else:
        slot = tl.load(slot_ptr + tok)
        if (slot >= 0) & (slot < NUM_SLOTS):
            blk = slot // CACHE_BLOCK
            off = slot % CACHE_BLOCK
            heads = (tile - NQ_TILES) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)
            mask_h = heads < HKV
            mask = mask_h[:, None] & mask_f[None, :]
            k_rows = k_ptr + tok * stride_kt + heads[:, None] * stride_kh
            kc_rows = kc_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch
            o1, o2 = _rotate_tile(k_rows + offs_f[None, :], mask, cos, sin, HALF, dtype)
            tl.store(kc_rows + offs_f[None, :], o1, mask=mask)
            tl.store(kc_rows + HALF + offs_f[None, :], o2, mask=mask)
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = mask_h[:, None] & (offs_d < D)[None, :]
            if PARTIAL:
                mask_p = mask_d & (offs_d >= 2 * HALF)[None, :]
                kp = tl.load(k_rows + offs_d[None, :], mask=mask_p, other=0.0)
                tl.store(kc_rows + offs_d[None, :], kp, mask=mask_p)
            vt = tl.load(
                v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                mask=mask_d,
                other=0.0,
            )
            vc_rows = vc_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch
            tl.store(vc_rows + offs_d[None, :], vt, mask=mask_d)


# Activation codes of _act_mul_kernel, in the order of _validate.ACTIVATIONS.
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_TANH_2C = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)


@triton.jit
def _act_mul_kernel(
    # pointers
    gu_ptr,
    out_ptr,
    extra_ptr,  # [T, 2*I] added to gu first (HAS_EXTRA)
    # sizes
    INTER,
    # strides
    stride_gt,
    stride_ot,
    stride_et,
    # meta-parameters
    BLOCK_I: tl.constexpr,
    ACT: tl.constexpr,  # index into _validate.ACTIVATIONS
    HAS_EXTRA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < INTER
    g_row = gu_ptr + row * stride_gt
    g = tl.load(g_row + cols, mask=mask, other=0.0)
    u = tl.load(g_row + INTER + cols, mask=mask, other=0.0)
    if HAS_EXTRA:  # round(gu + extra) in gu's dtype, as if the sum had been stored
        dtype = out_ptr.dtype.element_ty
        e_row = extra_ptr + row * stride_et
        g = (g.to(tl.float32) + tl.load(e_row + cols, mask=mask, other=0.0).to(tl.float32)).to(
            dtype
        )
        u = (
            u.to(tl.float32) + tl.load(e_row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        ).to(dtype)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if ACT == 0:  # silu
        a = g * tl.sigmoid(g)
    elif ACT == 1:  # gelu, erf form
        a = 0.5 * g * (1.0 + tl.erf(g * _SQRT_HALF))
    elif ACT == 2:  # gelu, tanh form: 0.5 * (1 + tanh(z)) == sigmoid(2 z)
        a = g * tl.sigmoid((g + 0.044715 * g * g * g) * _TANH_2C)
    else:  # relu; a NaN gate stays NaN, as in torch
        a = tl.where(g < 0.0, 0.0, g)
    tl.store(out_ptr + row * stride_ot + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32, last dim contiguous, any row stride
    weight: torch.Tensor,  # [H], dtype of x
    eps: float,
    *,
    residual: torch.Tensor | None = None,  # [T, H], updated in place to round(x + residual)
    out: torch.Tensor | None = None,  # [T, H], may be x itself; must not alias residual
    gemma: bool = False,
    block_h: int | None = None,  # columns per step; None picks min(pow2(H), RMS_MAX_BLOCK)
    extra: torch.Tensor | None = None,  # [T, H], added to x first (h = round(round(x + extra)
    # + residual)); needs residual. The engine passes a LoRA delta computed beside the matmul.
) -> torch.Tensor:
    """RMSNorm of x (or of round(x + residual), stored into residual); one launch.

    Returns ``y`` ([T, H], x's dtype; ``out`` when given). See the module docstring and
    ``reference.rms_norm_ref`` for the rounding points.
    """
    t, h = check_rms_norm(x, weight, eps, residual, out, extra)
    block = check_block("block_h", block_h, min(_pow2(h), RMS_MAX_BLOCK))
    y = torch.empty((t, h), dtype=x.dtype, device=x.device) if out is None else out
    if t == 0:
        return y
    res = x if residual is None else residual
    ext = x if extra is None else extra
    _rms_norm_kernel[(t,)](
        x,
        weight,
        res,
        y,
        ext,
        h,
        float(eps),
        x.stride(0),
        res.stride(0),
        y.stride(0),
        ext.stride(0),
        BLOCK_H=block,
        SINGLE_PASS=h <= block,
        HAS_RESIDUAL=residual is not None,
        GEMMA=bool(gemma),
        HAS_EXTRA=extra is not None,
        num_warps=_rms_warps(block),
    )
    return y


def rope_kv_write(
    q: torch.Tensor,  # [T, Hq, D], rotated in place; a strided view of the fused qkv output
    k: torch.Tensor,  # [T, Hkv, D], read only
    v: torch.Tensor,  # [T, Hkv, D], read only
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos | sin, fp32 or q's dtype
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dtype of q
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dtype of q
    slot_mapping: torch.Tensor,  # [T] int64 flat slot block * block_size + offset, <0 = skip
    *,
    rotary_dim: int | None = None,  # even, <= D; None = D
    heads_per_tile: int | None = None,  # None picks from ROPE_MAX_TILE
) -> None:
    """RoPE on q (in place) and k, rotated k and v into the paged caches; one launch.

    Slots outside ``[0, num_blocks * block_size)`` are not written; positions are clamped to
    ``[0, max_pos)``. See ``reference.rope_kv_write_ref`` for the rounding.
    """
    rot = check_rope_kv_write(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim
    )
    t, hq, d = q.shape
    hkv = k.shape[1]
    block_d = _pow2(d)
    cap = max(1, ROPE_MAX_TILE // block_d)
    cap = check_block("heads_per_tile", heads_per_tile, cap)
    block_hq = min(_pow2(hq), cap)
    block_hkv = min(_pow2(hkv), cap)
    nq_tiles = int(triton.cdiv(hq, block_hq))
    nkv_tiles = int(triton.cdiv(hkv, block_hkv))
    if t == 0:
        return
    num_blocks, cache_block = k_cache.shape[0], k_cache.shape[1]
    _rope_kv_write_kernel[(t, nq_tiles + nkv_tiles)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        hq,
        hkv,
        d,
        rot // 2,
        cos_sin_cache.shape[0],
        num_blocks * cache_block,
        cache_block,
        nq_tiles,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=_pow2(rot // 2),
        BLOCK_D=block_d,
        PARTIAL=rot < d,
        num_warps=4,
    )


def act_mul(
    gu: torch.Tensor,  # [T, 2*I]: gate | up, last dim contiguous, any row stride
    *,
    act: str = "silu",
    out: torch.Tensor | None = None,  # [T, I], dtype of gu
    block_i: int | None = None,  # columns per program; None picks min(pow2(I), ACT_MAX_BLOCK)
    extra: torch.Tensor | None = None,  # [T, 2*I], added to gu first (rounded to its dtype)
) -> torch.Tensor:
    """act(gate) * up, [T, I] in gu's dtype, fp32 inside and rounded once; one launch.
    ``extra`` (the engine's LoRA delta of the gate/up matmul): of round(gu + extra)."""
    inter = check_act_mul(gu, act, out, extra)
    t = gu.shape[0]
    block = check_block("block_i", block_i, min(_pow2(inter), ACT_MAX_BLOCK))
    y = torch.empty((t, inter), dtype=gu.dtype, device=gu.device) if out is None else out
    if t == 0:
        return y
    ext = gu if extra is None else extra
    _act_mul_kernel[(t, triton.cdiv(inter, block))](
        gu,
        y,
        ext,
        inter,
        gu.stride(0),
        y.stride(0),
        ext.stride(0),
        BLOCK_I=block,
        ACT=_ACT_CODE[act],
        HAS_EXTRA=extra is not None,
        num_warps=4,
    )
    return y
