# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""SGMM with INT4 adapter weights: A and B packed 4-bit with group-wise scales.

Format (``Int4Weight``), for a weight ``w[..., rows, K]`` whose last dim ``K`` is the
reduction dim of its SGMM op (H for A ``[n_slices, S, R_max, H]``, R_max for B
``[S, N_i, R_max]``):

- ``packed[..., rows, ceil(K/2)]`` uint8: two signed 4-bit values per byte, element ``2j`` in
  the low nibble and ``2j + 1`` in the high one, two's complement (-8..7), so a zero byte is two
  zeros. An odd ``K`` pads the last high nibble with 0.
- ``scales`` bfloat16, symmetric (no zero point; LoRA factors are zero-mean), one per group of
  ``group_size`` consecutive elements along ``group_dim``: ``-1`` groups along K (scales
  ``[..., rows, ceil(K/G)]``), ``-2`` along rows (scales ``[..., ceil(rows/G), K]``).
  bf16 rather than fp16: trained B entries reach 1e-5, where fp16 scales turn subnormal. A
  scale keeps 5 significant bits (``SCALE_BITS``), so ``q * scale`` is exact in bf16 (and fp16
  in its normal range): the kernels' dequantisation never rounds, and the 3 % coarser scale
  grid costs nothing measurable against the 4-bit steps.
- value = ``q * scale``. The scale of a group is ``c * absmax / 7`` with the clip ratio ``c``
  in ``CLIP_RATIOS`` that gives the group the least squared error; q is rounded against the
  bf16-rounded scale and clamped to [-8, 7].

Groups: A along H (one scale per rank row per G inputs of the reduction); B along N (one scale
per rank column per G output rows): each rank component of an adapter has its own magnitude,
and both choices give every group the values of one component. ``quantize_lora`` applies them;
``quantize_int4`` takes any group dim, and the kernels read either.

Kernels: the bf16 SGMM's segment and tile scheme (``sgmm._locate_tile``, a grid from shapes
only, split-K shrink with the same workspace) and its config tables, with the packed weights
dequantised in registers. Tiles: a step of BLOCK_K reduction elements is BLOCK_K/2 bytes per
row, split into nibbles, scaled and interleaved back into the [BLOCK_K, BLOCK_N] weight tile, so
the activations are one contiguous tile and the step is one ``tl.dot``. Matrix-vector kernels
(the tables' gemv rows, decode at a few tokens per adapter): the low nibbles multiply the even
reduction elements, the high nibbles the odd ones, on the CUDA cores, no interleave. The
dequantised weight is rounded to the activation dtype before the product, as bf16 weights are
fed; the torch twin (``add_lora_int4_ref``) rounds the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._backend import Backend, choose_backend
from adaptermesh.kernels._launch import launch
from adaptermesh.kernels._validate import ACT_DTYPES, MAX_SLICES, SgmmShapes, check_meta
from adaptermesh.kernels._workspace import split_workspace
from adaptermesh.kernels.meta import SegmentMeta
from adaptermesh.kernels.sgmm import (
    GEMV_EXPAND_MAX_RANK,
    SgmmConfig,
    _check_config,
    _d_bucket,
    _dot_fp32,
    _locate_tile,
    _of_slice,
    _pow2_at_least_16,
    _r_bucket,
    _split_plan,
    _store_shrink_tile,
    _t_bucket,
    _three_slices,
    _tile_axis,
    _v_buffer,
    expand_config,
    pdl_available,
    shrink_config,
)

__all__ = [
    "CLIP_RATIOS",
    "DEFAULT_GROUP_SIZE",
    "Int4Weight",
    "add_lora_int4",
    "add_lora_int4_ref",
    "dequantize_int4",
    "int4_expand_config",
    "int4_shrink_config",
    "quantize_int4",
    "quantize_lora",
    "sgmm_expand_int4",
    "sgmm_shrink_int4",
]

DEFAULT_GROUP_SIZE = 64
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
SCALE_DTYPE = torch.bfloat16
SCALE_BITS = 5


@dataclass(frozen=True)
class Int4Weight:
    """A packed 4-bit tensor of logical shape ``[..., rows, size]`` (see the module doc)."""

    packed: torch.Tensor  # uint8 [..., rows, ceil(size/2)]
    scales: torch.Tensor  # bf16, groups along group_dim
    size: int  # K, the unpacked last dim
    group_size: int
    group_dim: int  # -1 (along K) or -2 (along rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.size)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, index: int) -> Int4Weight:
        """The weight of one leading index (a layer of a pool, a slice of A)."""
        return Int4Weight(self.packed[index], self.scales[index], self.size, self.group_size,
                          self.group_dim)  # fmt: skip


def _check_group(group_size: int, group_dim: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even int >= 2, got {group_size!r}")
    if group_dim not in (-1, -2):
        raise ValueError(f"group_dim must be -1 (along the last dim) or -2, got {group_dim!r}")


def scales_shape(shape: Sequence[int], group_size: int, group_dim: int) -> tuple[int, ...]:
    rows, k = int(shape[-2]), int(shape[-1])
    if group_dim == -1:
        return (*shape[:-1], -(-k // group_size))
    return (*shape[:-2], -(-rows // group_size), k)


def packed_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return (*shape[:-1], -(-int(shape[-1]) // 2))


def _round_scale(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with SCALE_BITS significant bits, so that q * scale (|q| <= 8, three
    significant bits) is exact in bf16: dequantising never rounds, on any backend."""
    m, e = torch.frexp(s)
    m = torch.round(m * (1 << SCALE_BITS)) / (1 << SCALE_BITS)
    return torch.ldexp(m, e).to(SCALE_DTYPE)


def _quantize_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g [..., n_groups, G] fp32 -> (q int8 same shape, scales [..., n_groups] bf16)."""
    absmax = g.abs().amax(dim=-1)
    best_q = torch.zeros_like(g, dtype=torch.int8)
    best_s = torch.zeros_like(absmax, dtype=SCALE_DTYPE)
    best_err = torch.full_like(absmax, float("inf"))
    for c in CLIP_RATIOS:
        s = _round_scale(absmax * (c / 7.0))
        s32 = s.float()
        safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
        q = torch.round(g / safe[..., None]).clamp_(-8, 7)
        q = torch.where(s32[..., None] > 0, q, torch.zeros_like(q))
        err = (q * s32[..., None] - g).square().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_q = torch.where(better[..., None], q.to(torch.int8), best_q)
    return best_q, best_s


def quantize_int4(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, *, group_dim: int = -1
) -> Int4Weight:
    """Pack ``w[..., rows, K]`` (any float dtype, any device) as INT4 with group-wise scales."""
    if not isinstance(w, torch.Tensor) or w.dim() < 2 or not w.is_floating_point():
        raise ValueError("w must be a floating-point tensor of at least 2 dims [..., rows, K]")
    _check_group(group_size, group_dim)
    k = int(w.shape[-1])
    w32 = w.float()
    if group_dim == -2:
        w32 = w32.transpose(-1, -2)  # [..., K, rows]: groups along the new last dim
    n = int(w32.shape[-1])
    n_groups = -(-n // group_size)
    pad = n_groups * group_size - n
    if pad:
        w32 = torch.nn.functional.pad(w32, (0, pad))
    q, s = _quantize_groups(w32.reshape(*w32.shape[:-1], n_groups, group_size))
    q = q.reshape(*w32.shape[:-1], n_groups * group_size)[..., :n]
    if group_dim == -2:
        q = q.transpose(-1, -2)  # back to [..., rows, K]
        s = s.transpose(-1, -2)  # [..., n_groups(rows), K]
    if k % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    q = q.to(torch.int16)
    packed = ((q[..., 0::2] & 15) | ((q[..., 1::2] & 15) << 4)).to(torch.uint8)
    return Int4Weight(packed.contiguous(), s.contiguous(), k, group_size, group_dim)


def unpack_int4(packed: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [..., ceil(size/2)] -> int8 [..., size] (signed nibbles)."""
    b = packed.to(torch.int16)
    lo = ((b & 15) ^ 8) - 8
    hi = ((b >> 4) ^ 8) - 8
    q = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return q[..., :size].to(torch.int8)


def dequantize_int4(q: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float tensor ``q`` stands for: ``q * scale``, computed in fp32, then cast."""
    vals = unpack_int4(q.packed, q.size).float()
    s = q.scales.float()
    if q.group_dim == -1:
        s = s.repeat_interleave(q.group_size, dim=-1)[..., : q.size]
    else:
        s = s.repeat_interleave(q.group_size, dim=-2)[..., : vals.shape[-2], :]
    return (vals * s).to(dtype)


def quantize_lora(
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    group_size: int = DEFAULT_GROUP_SIZE,
) -> tuple[Int4Weight, tuple[Int4Weight, ...]]:
    """A pool in the recommended layout: A grouped along H, B along N."""
    qa = quantize_int4(lora_a, group_size, group_dim=-1)
    return qa, tuple(quantize_int4(b, group_size, group_dim=-2) for b in lora_b)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def _check_int4(name: str, q: object, dim: int, ref: torch.Tensor) -> Int4Weight:
    if not isinstance(q, Int4Weight):
        raise ValueError(f"{name} must be an Int4Weight (quantize_int4), got {type(q).__name__}")
    if q.packed.dtype != torch.uint8 or q.packed.dim() != dim:
        raise ValueError(f"{name}.packed must be a {dim}-D uint8 tensor, got {q.packed.dtype} "
                         f"{tuple(q.packed.shape)}")  # fmt: skip
    _check_group(q.group_size, q.group_dim)
    if q.packed.shape[-1] != -(-q.size // 2):
        raise ValueError(f"{name}.packed has {q.packed.shape[-1]} bytes per row, size {q.size}")
    want = scales_shape(q.shape, q.group_size, q.group_dim)
    if tuple(q.scales.shape) != want or q.scales.dtype != SCALE_DTYPE:
        raise ValueError(f"{name}.scales must be bfloat16 of shape {list(want)}, got "
                         f"{q.scales.dtype} {tuple(q.scales.shape)}")  # fmt: skip
    for t in (q.packed, q.scales):
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")
    return q


def _check_ranks(ranks: object, s: int, r_max: int, ref: torch.Tensor, check_values: bool) -> None:
    if not isinstance(ranks, torch.Tensor) or ranks.shape != (s,) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be an int32 tensor of shape [{s}]")
    if ranks.device != ref.device:
        raise ValueError(f"ranks is on {ranks.device}, expected {ref.device}")
    capturing = ranks.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        lo, hi = int(ranks.min()), int(ranks.max())
        if lo < 0 or hi > r_max:
            raise ValueError(f"ranks must lie in [0, R_max={r_max}], got min {lo} max {hi}")


def check_int4(
    out: torch.Tensor,
    x: torch.Tensor,
    qa: Int4Weight,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    check_values: bool,
) -> SgmmShapes:
    """Every argument check of add_lora_int4, before any launch."""
    for name, t in (("x", x), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in ACT_DTYPES:
            raise ValueError(f"{name} must be a 2-D float16/bfloat16/float32 tensor")
    if out.dtype != x.dtype or out.shape[0] != x.shape[0] or out.device != x.device:
        raise ValueError("out must have x's dtype, device and row count")
    qa = _check_int4("qa", qa, 4, x)
    n_slices, s, r_max, h = qa.shape
    if h != x.shape[1]:
        raise ValueError(f"qa hidden size {h} does not match x hidden size {x.shape[1]}")
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"qa must have 1..{MAX_SLICES} slices, got {n_slices}")
    if isinstance(qb, Int4Weight) or not isinstance(qb, Sequence) or len(qb) != n_slices:
        raise ValueError(f"qb must be a tuple of {n_slices} Int4Weight, one [S, N_i, R_max] each")
    sizes = []
    for i, b in enumerate(qb):
        b = _check_int4(f"qb[{i}]", b, 3, x)
        if b.shape[0] != s or b.size != r_max or b.shape[1] < 1:
            raise ValueError(f"qb[{i}] must have shape [{s}, N, {r_max}], got {list(b.shape)}")
        sizes.append(int(b.shape[1]))
    if out.shape[1] != sum(sizes):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of qb need {sum(sizes)}")
    if not isinstance(scales, torch.Tensor) or scales.shape != (s,) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be a float32 tensor of shape [{s}]")
    if scales.device != x.device:
        raise ValueError(f"scales is on {scales.device}, expected {x.device}")
    _check_ranks(ranks, s, r_max, x, check_values)
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    shapes = SgmmShapes(int(x.shape[0]), h, n_slices, s, r_max, tuple(sizes), tuple(offsets))
    check_meta(meta, shapes, x)
    return shapes


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _nibbles(b):
    """uint8 tile -> (low, high) signed nibbles as fp32 tiles."""
    b32 = b.to(tl.int32)
    lo = ((b32 & 15) ^ 8) - 8
    hi = ((b32 >> 4) ^ 8) - 8
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _dequant_step(
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
def _shrink_int4_kernel(
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
    SCALE_BLOCKS: tl.constexpr,  # see _dequant_step
    GEMV: tl.constexpr,  # the matrix-vector product (CUDA cores, SPLIT_K = 1) instead of tiles
    LAUNCH_DEPS: tl.constexpr = False,
):
    """Tiles: each step's dequantised [BLOCK_N, BLOCK_K] slice of A is interleaved back from
    its nibbles (column 2j the low, 2j+1 the high), so x is one contiguous tile and the step is
    one product; split-K as in the bf16 shrink. GEMV (a few tokens per program, decode): x is
    split into its even and odd columns against the low and high nibbles on the CUDA cores,
    no tile padding of a one-token segment. The dequantised weight is rounded to the
    activation dtype before the product, as bf16 weights are fed."""
    if LAUNCH_DEPS:  # the expand (a programmatic dependent launch) may start its prologue
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_nk = tl.program_id(1)
    pid_i = tl.program_id(2).to(tl.int64)
    pid_n = pid_nk // SPLIT_K
    pid_k = pid_nk % SPLIT_K
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    n_start = pid_n * BLOCK_N
    if n_start >= rank:
        return
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
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
        we, wo = _dequant_step(
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
        _store_shrink_tile(
            acc, v_ptrs, part_ptr, count_ptr, tok, offs_n, mask_mn, pid_i, pid_k, pid_n, pid_m,
            T, R_MAX, GRID_M, N_TILES_N, SPLIT_K, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _expand_int4_kernel(
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
    SCALE_BLOCKS: tl.constexpr,  # see _dequant_step
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
    n_size = _of_slice(pid_i, N0, N1, N2)
    col_off = _of_slice(pid_i, 0, OFF1, OFF2)
    stride_qs = _of_slice(pid_i, stride_q0s, stride_q1s, stride_q2s).to(tl.int64)
    stride_qn = _of_slice(pid_i, stride_q0n, stride_q1n, stride_q2n)
    stride_qr = _of_slice(pid_i, stride_q0r, stride_q1r, stride_q2r)
    stride_ss = _of_slice(pid_i, stride_s0s, stride_s1s, stride_s2s).to(tl.int64)
    stride_sn = _of_slice(pid_i, stride_s0n, stride_s1n, stride_s2n)
    stride_sr = _of_slice(pid_i, stride_s0r, stride_s1r, stride_s2r)
    if pid_i == 0:
        q_ptr = q0_ptr
        s_ptr = s0_ptr
    elif pid_i == 1:
        q_ptr = q1_ptr
        s_ptr = s1_ptr
    else:
        q_ptr = q2_ptr
        s_ptr = s2_ptr
    n_first = pid_n * N_BLOCKS * BLOCK_N
    if n_first >= n_size:
        if PDL:  # every program waits, so this grid ends after the shrink it depends on
            tl.extra.cuda.gdc_wait()
        return
    has_tile, slot, row_begin, seg_end = _locate_tile(pid_m, seg_start_ptr, S, BLOCK_M, BLOCK_S)
    if not has_tile:
        if PDL:  # every program waits, so this grid ends after the shrink it depends on
            tl.extra.cuda.gdc_wait()
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank == 0:
        if PDL:  # every program waits, so this grid ends after the shrink it depends on
            tl.extra.cuda.gdc_wait()
        return
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m = row_begin + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_end
    tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
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
            we, wo = _dequant_step(
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
                we, wo = _dequant_step(
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
                o_ptrs, (o.to(tl.float32) + acc2 * scale).to(out_ptr.dtype.element_ty),
                mask=o_mask,
            )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
# INT4 rows by (T bucket, density, rank bucket) that override the bf16 tables, from the INT4
# sweep of 2026-12-04 with the kernels' final scale loads (bench/sweep_sgmm_int4.py,
# bench/results/sgmm_int4_sweep_h200_scales.json; H = N = 4096, pool of 128, graph replay,
# each op alone, us): r=16 T=64 S=8 shrink gemv 10.8 (the best split tile 13.6), expand
# 16-row tile 7.3; S=64 shrink 10.4, expand gemv 7.7 (tiles > 10.1); r=16 T=256 S=64 shrink gemv
# 15.0 (tile 19.7), expand gemv 15.6 (tile 17.3); r=64 T=64 S=64 shrink 22.8, expand gemv
# 17.6; r=64 T=256 S=64 shrink 16x16 split tile 41.0, expand 16x256 tile 30.2. T <= 16 keeps
# the bf16 rows (7.6 / 10.7 us at S = 1 / 16, the best pairs 8.5 / 10.6).
# shrink: (block_m, block_n (rank rows for gemv), block_k, split_k, warps, stages, gemv).
_INT4_SHRINK_ROWS: dict[tuple[int, str, str], tuple[int, int, int, int, int, int, bool]] = {
    (64, "mid", "low"): (1, 2, 1024, 1, 4, 2, True),
    (64, "sparse", "low"): (1, 2, 1024, 1, 4, 2, True),
    (64, "sparse", "high"): (1, 2, 1024, 1, 4, 2, True),
    (256, "sparse", "low"): (2, 4, 512, 1, 4, 2, True),
    (256, "sparse", "high"): (16, 16, 512, 4, 4, 3, False),
}
# expand: (block_m, block_n, warps, stages, n_blocks, gemv); block_k covers the rank for gemv.
_INT4_EXPAND_ROWS: dict[tuple[int, str, str], tuple[int, int, int, int, int, bool]] = {
    (64, "mid", "low"): (16, 256, 4, 2, 1, False),
    (64, "sparse", "low"): (2, 512, 4, 2, 1, True),
    (64, "sparse", "high"): (1, 256, 4, 3, 4, True),
    (256, "sparse", "low"): (2, 512, 4, 2, 1, True),
    (256, "sparse", "high"): (16, 256, 4, 2, 1, False),
}


def _int4_key(num_tokens: int, r_max: int, active_slots: int | None) -> tuple[int, str, str]:
    return (_t_bucket(num_tokens), _d_bucket(num_tokens, active_slots), _r_bucket(r_max))


def int4_shrink_config(
    num_tokens: int, hidden: int, r_max: int, active_slots: int | None = None
) -> SgmmConfig:
    """The INT4 shrink config for a batch: an INT4 row, else the bf16 tables'."""
    row = _INT4_SHRINK_ROWS.get(_int4_key(num_tokens, r_max, active_slots))
    if row is None:
        return shrink_config(num_tokens, hidden, r_max, active_slots)
    bm, bn, bk, split, warps, stages, gemv = row
    return SgmmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, split_k=split, gemv=gemv)


def int4_expand_config(
    num_tokens: int, n_max: int, r_max: int, active_slots: int | None = None
) -> SgmmConfig:
    """The INT4 expand config for a batch: an INT4 row, else the bf16 tables'."""
    row = _INT4_EXPAND_ROWS.get(_int4_key(num_tokens, r_max, active_slots))
    if row is None or (row[5] and r_max > GEMV_EXPAND_MAX_RANK):
        return expand_config(num_tokens, n_max, r_max, active_slots)
    bm, bn, warps, stages, nb, gemv = row
    bk = _pow2_at_least_16(r_max) if gemv else min(_pow2_at_least_16(r_max), 64)
    return SgmmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, n_blocks=nb, gemv=gemv)


def _scale_blocks(q: Int4Weight, cfg: SgmmConfig) -> bool:
    """Whether a kernel step or block holds whole scale groups (``_dequant_step``): the group
    a power of two no wider than the step along K (groups along K) or than the block of rows
    (groups along the rows)."""
    g = q.group_size
    return g & (g - 1) == 0 and g <= (cfg.block_k if q.group_dim == -1 else cfg.block_n)


def _check_int4_config(cfg: SgmmConfig | None) -> None:
    if cfg is not None and cfg.fused:
        raise ValueError("the INT4 kernels have no fused variant: config.fused must be False")


def _int4_tile(cfg: SgmmConfig) -> SgmmConfig:
    """A config as the INT4 kernels run it: tiles have no hoisted variant, and a tile step of
    BLOCK_K reduction elements is BLOCK_K / 2 bytes, so BLOCK_K is at least 32 (tl.dot's
    least depth of 16 on each half); the matrix-vector kernels take the config as it is."""
    if cfg.gemv:
        return cfg
    return replace(cfg, block_k=max(cfg.block_k, 32), hoist_v=False)


def _launch_shrink_int4(
    x: torch.Tensor,
    qa: Int4Weight,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v: torch.Tensor,
    shapes: SgmmShapes,
    config: SgmmConfig | None,
    active_slots: int | None,
    launch_deps: bool = False,
) -> None:
    _check_int4_config(config)
    cfg = config or int4_shrink_config(
        shapes.num_tokens, shapes.hidden, shapes.r_max, active_slots
    )
    _check_config(cfg)
    cfg = _int4_tile(cfg)
    grid_m = _tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m)
    n_tiles_n = int(triton.cdiv(shapes.r_max, cfg.block_n))
    if cfg.gemv:  # one program walks the whole of H: no split, no partials
        split, k_per_split = 1, int(triton.cdiv(shapes.hidden, cfg.block_k)) * cfg.block_k
    else:
        split, k_per_split = _split_plan(
            cfg, shapes.hidden, grid_m * n_tiles_n * shapes.n_slices, x.device
        )
    if split > 1:
        counters, partials = split_workspace(
            x.device,
            grid_m * n_tiles_n * shapes.n_slices,
            split * shapes.n_slices * shapes.num_tokens * shapes.r_max,
        )
    else:
        counters, partials = ranks, v
    launch(
        _shrink_int4_kernel,
        (grid_m, n_tiles_n * split, shapes.n_slices),
        (
            x, qa.packed, qa.scales, v, ranks, meta.sorted_tokens, meta.seg_start, partials,
            counters, shapes.hidden, shapes.num_slots, shapes.r_max, shapes.num_tokens, grid_m,
            n_tiles_n, split, k_per_split, x.stride(0), x.stride(1), *qa.packed.stride(),
            *qa.scales.stride(), *v.stride(),
        ),
        {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
            "GROUP": qa.group_size,
            "GROUP_ALONG_K": qa.group_dim == -1,
            "DOT_FP32": _dot_fp32(x.dtype),
            "SCALE_BLOCKS": _scale_blocks(qa, cfg),
            "GEMV": cfg.gemv,
            "LAUNCH_DEPS": launch_deps,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_expand_int4(
    out: torch.Tensor,
    v: torch.Tensor,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,
    config: SgmmConfig | None,
    active_slots: int | None,
    pdl: bool = False,
) -> None:
    if len({(b.group_size, b.group_dim) for b in qb}) != 1:
        raise ValueError("every slice of qb must use the same group_size and group_dim")
    n = shapes.n_slices
    bs, sizes, offs = _three_slices(qb, shapes.out_sizes, shapes.out_offsets)
    n_max = max(shapes.out_sizes)
    _check_int4_config(config)
    cfg = config or int4_expand_config(shapes.num_tokens, n_max, shapes.r_max, active_slots)
    _check_config(cfg)
    if cfg.gemv and cfg.block_k < shapes.r_max:
        raise ValueError(f"a gemv expand needs config.block_k >= R_max={shapes.r_max}")
    cfg = _int4_tile(cfg)
    grid = (
        _tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        n,
    )
    strides: list[Any] = []
    for b in bs:
        strides += b.packed.stride()
    for b in bs:
        strides += b.scales.stride()
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
        "GROUP": qb[0].group_size,
        "GROUP_ALONG_K": qb[0].group_dim == -1,
        "DOT_FP32": _dot_fp32(out.dtype),
        "SCALE_BLOCKS": _scale_blocks(qb[0], cfg),
        "GEMV": cfg.gemv,
        "PDL": pdl,
    }
    launch(
        _expand_int4_kernel,
        grid,
        (
            out, v, bs[0].packed, bs[1].packed, bs[2].packed, bs[0].scales, bs[1].scales,
            bs[2].scales, scales, ranks, meta.sorted_tokens, meta.seg_start, shapes.num_slots,
            shapes.r_max, sizes[0], sizes[1], sizes[2], offs[1], offs[2], cfg.n_blocks,
            out.stride(0), out.stride(1), *v.stride(), *strides,
        ),
        consts,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip


def sgmm_shrink_int4(
    x: torch.Tensor,
    qa: Int4Weight,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    out: torch.Tensor | None = None,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """``v[i, t, :r] = x[t] @ dequant(qa)[i, a(t), :r].T`` (fp32), like ``sgmm_shrink``."""
    qa = _check_int4("qa", qa, 4, x)
    n_slices, s, r_max, h = qa.shape
    if x.dim() != 2 or x.shape[1] != h or x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be a 2-D float tensor with {h} columns")
    _check_ranks(ranks, s, r_max, x, check_values)
    shapes = SgmmShapes(int(x.shape[0]), h, n_slices, s, r_max, (), ())
    check_meta(meta, shapes, x)
    v = _v_buffer(out, n_slices, shapes.num_tokens, r_max, x.device)
    _launch_shrink_int4(x, qa, ranks, meta, v, shapes, config, None)
    return v


def add_lora_int4(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    x: torch.Tensor,  # [T, H]
    qa: Int4Weight,  # [n_slices, S, R_max, H]
    qb: Sequence[Int4Weight],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32 (the adapters' LoRA scaling)
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
    backend: Backend | None = None,
) -> None:
    """``out += scale * (x @ A.T) @ B.T`` per token's slot, A and B INT4 (two launches).

    Triton on CUDA tensors (or with ``backend="triton"`` under ``TRITON_INTERPRET=1``), the
    torch twin on CPU. Configs: ``int4_shrink_config`` / ``int4_expand_config`` (INT4 rows,
    else the bf16 tables); a tile's BLOCK_K is at least 32, a hoisted expand tile runs unhoisted.
    """
    _check_int4_config(shrink_cfg)
    _check_int4_config(expand_cfg)
    if choose_backend(x, backend) == "torch":
        add_lora_int4_ref(out, x, qa, qb, scales, ranks, meta, check_values=check_values)
        return
    shapes = check_int4(out, x, qa, qb, scales, ranks, meta, check_values)
    if active_slots is None:
        active_slots = shapes.num_slots
    v = _v_buffer(v_buffer, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    pdl = pdl_available(x.device)
    _launch_shrink_int4(x, qa, ranks, meta, v, shapes, shrink_cfg, active_slots, pdl)
    _launch_expand_int4(out, v, qb, scales, ranks, meta, shapes, expand_cfg, active_slots, pdl)


def sgmm_expand_int4(
    out: torch.Tensor,
    v: torch.Tensor,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> None:
    """``out[t, off_i:off_i+N_i] += scales[s] * v[i, t, :r] @ dequant(qb[i])[s, :, :r].T``."""
    if isinstance(qb, Int4Weight) or not qb or not isinstance(qb[0], Int4Weight):
        raise ValueError("qb must be a tuple of Int4Weight")
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.dtype not in ACT_DTYPES:
        raise ValueError("out must be a 2-D float16/bfloat16/float32 tensor")
    s, _, r_max = qb[0].shape
    for i, b in enumerate(qb):
        _check_int4(f"qb[{i}]", b, 3, out)
        if b.shape[0] != s or b.size != r_max:
            raise ValueError(f"qb[{i}] must have shape [{s}, N, {r_max}], got {list(b.shape)}")
    widths = tuple(int(b.shape[1]) for b in qb)
    if out.shape[1] != sum(widths):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of qb need {sum(widths)}")
    if not isinstance(scales, torch.Tensor) or scales.shape != (s,) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be a float32 tensor of shape [{s}]")
    _check_ranks(ranks, s, r_max, out, check_values)
    offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
    shapes = SgmmShapes(int(out.shape[0]), 0, len(qb), s, r_max, widths, offsets)
    check_meta(meta, shapes, out)
    if tuple(v.shape) != (shapes.n_slices, shapes.num_tokens, r_max) or v.dtype != torch.float32:
        raise ValueError(f"v must be float32 of shape {[shapes.n_slices, shapes.num_tokens, r_max]}")
    _launch_expand_int4(out, v, qb, scales, ranks, meta, shapes, config, None)


# ---------------------------------------------------------------------------------------------
# Torch twin
# ---------------------------------------------------------------------------------------------
def _slot_weight(q: Int4Weight, index: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Dequantised ``q[index]`` (leading indices only), rounded to ``dtype``, as fp32."""
    sub = q
    for i in index:
        sub = sub[i]
    return dequantize_int4(sub).to(dtype).float()


def add_lora_int4_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    qa: Int4Weight,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    check_values: bool = True,
) -> None:
    """The twin of ``add_lora_int4``: dequantise the used slots (rounded to the activation
    dtype, as the kernels feed them), v in fp32 rounded to the activation dtype, the sum with
    ``out`` formed in fp32 and rounded once."""
    shapes = check_int4(out, x, qa, qb, scales, ranks, meta, check_values)
    starts = meta.seg_start.tolist()
    rank_list = ranks.tolist()
    scale_list = scales.tolist()
    dt = x.dtype
    for s in range(shapes.num_slots):
        a, b = starts[s], starts[s + 1]
        r = min(int(rank_list[s]), shapes.r_max)
        if b <= a or r == 0:
            continue
        idx = meta.sorted_tokens[a:b].long()
        xs = x.index_select(0, idx).float()
        for i in range(shapes.n_slices):
            w_a = _slot_weight(qa, (i, s), dt)[:r]
            vi = (xs @ w_a.T).to(dt).float()
            w_b = _slot_weight(qb[i], (s,), dt)[:, :r]
            off, n = shapes.out_offsets[i], shapes.out_sizes[i]
            cols = out[:, off : off + n]
            cols[idx] = (cols[idx].float() + (vi @ w_b.T) * scale_list[s]).to(out.dtype)
