"""Quantise to and dequantise from INT4 (the format: ``int4_weight.py``); no triton here.

The scale of a group is ``c * absmax / 7`` with the clip ratio ``c`` in ``CLIP_RATIOS`` that gives
the group the least squared error, rounded to ``SCALE_BITS`` significant bits; q is rounded
against that scale and clamped to [-8, 7].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptermesh.kernels._validate import check_group
from adaptermesh.kernels.int4_weight import (
    DEFAULT_GROUP_SIZE,
    SCALE_BITS,
    SCALE_DTYPE,
    Int4Weight,
)

__all__ = ["CLIP_RATIOS", "dequantize_int4", "quantize_int4", "quantize_lora", "unpack_int4"]

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


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
    check_group(group_size, group_dim)
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
