# Triton kernels take untyped launch arguments; mypy checks the typed launchers (quant_linear.py).
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Base-model GEMMs over quantised weights (the formats: ``quant_linear.py``).

``w4a16_kernel``: activations [M, K] times a 4-bit weight held as GPTQ-order words (eight
inputs per int32 along K, [ceil(K / 8), N]) with uint8 zero points and scales per (group, n).
Each step loads a [BLOCK_K, BLOCK_N] tile of words (every word serves eight rows of the tile),
shifts out the nibbles, forms ``(q - z) * s`` in fp32, rounds it to the activation dtype (what
a bf16 weight would be) and feeds one ``tl.dot`` on the tensor cores. Scales and zero points:
one row per step when the groups align with the steps (no g_idx, GROUP a multiple of BLOCK_K),
else a per-element gather through ``g_idx`` or ``k // GROUP`` (GPTQ act-order). SPLIT_K > 1
adds each K range's partial product into an fp32 buffer (decode, where M is one tile and N
alone gives too few programs to read the weights at bandwidth).

``fp8_gemv_kernel``: a few rows of activations times an e4m3 weight [N, K] with one fp32
scale per output, on the CUDA cores: each program reads BLOCK_N weight rows once per
activation row (the rows of one program share them through L1/L2) and reduces in fp32; the
scale multiplies the sum. Weight-only: the activations are not quantised.

``w8a16_kernel``: the same e4m3 weight on the tensor cores for more rows: each weight tile is
converted to the activation dtype in registers (exact: e4m3 embeds in bf16 / fp16) for one
``tl.dot``; the per-output scale multiplies the fp32 sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_gemv_kernel", "w4a16_kernel", "w8a16_kernel"]


@triton.jit
def _gemm_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile of a split-K GEMM (grid: M tiles, N tiles, splits):
    ``(offs_m, offs_n, mask_m, mask_n, k_lo, k_hi)``, its rows, columns and K range."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    return offs_m, offs_n, mask_m, mask_n, k_lo, k_hi


@triton.jit
def _x_step(x_ptr, offs_m, mask_m, k0, k_hi, stride_xm, stride_xk, BLOCK_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] activation tile of the step at ``k0`` (0 past ``k_hi``), with
    the step's reduction indices and their mask."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_hi
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return x, offs_k, mask_k


@triton.jit
def _store_tile(
    out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, SPLIT_K: tl.constexpr
):
    """The fp32 tile ``acc`` into out: stored in out's dtype, or with SPLIT_K > 1 added into
    the fp32 partial buffer."""
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)


@triton.jit
def w4a16_kernel(
    x_ptr,
    qw_ptr,
    z_ptr,
    s_ptr,
    g_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,  # reduction elements per split, a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    GROUP: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n, k_lo, k_hi = _gemm_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x, offs_k, mask_k = _x_step(x_ptr, offs_m, mask_m, k0, k_hi, stride_xm, stride_xk, BLOCK_K)
        wk_mask = mask_k[:, None] & mask_n[None, :]
        words = tl.load(
            qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=wk_mask,
            other=0,
        )
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 15
        if SCALE_ROW:
            g = k0 // GROUP
            z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0)
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
            w = (q.to(tl.float32) - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]
        else:
            gk = tl.load(g_ptr + offs_k, mask=mask_k, other=0) if HAS_GIDX else offs_k // GROUP
            z = tl.load(
                z_ptr + gk[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                mask=wk_mask,
                other=0,
            )
            s = tl.load(
                s_ptr + gk[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                mask=wk_mask,
                other=0.0,
            )
            w = (q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
        w = w.to(x.dtype)  # the weight as a bf16 / fp16 checkpoint would hold it
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    _store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, SPLIT_K)


@triton.jit
def fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=mask_k, other=0.0)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(
        out_ptr + m * stride_om + offs_n * stride_on,
        (acc * s).to(out_ptr.dtype.element_ty),
        mask=mask_n,
    )


@triton.jit
def w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Activations [M, K] times an e4m3 weight [N, K] with one fp32 scale per output, on the
    tensor cores: each [BLOCK_K, BLOCK_N] weight tile is converted in registers to the
    activation dtype (e4m3 embeds exactly in bf16 / fp16) for one ``tl.dot``, and the scale
    multiplies the fp32 sum. Weight-only: the activations keep their dtype."""
    offs_m, offs_n, mask_m, mask_n, k_lo, k_hi = _gemm_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x, offs_k, mask_k = _x_step(x_ptr, offs_m, mask_m, k0, k_hi, stride_xm, stride_xk, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * s[None, :]
    _store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, SPLIT_K)
