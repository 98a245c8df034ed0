"""INT4 adapter weights: A and B packed 4-bit with group-wise scales (no triton here).

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

Quantisation and dequantisation: ``int4_quant.py``; argument checks: ``_validate.py``; kernels:
``sgmm_int4_kernels.py``, launched by ``sgmm_int4.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "SCALE_BITS",
    "SCALE_DTYPE",
    "Int4Weight",
    "packed_shape",
    "scales_shape",
]

DEFAULT_GROUP_SIZE = 64
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


def scales_shape(shape: Sequence[int], group_size: int, group_dim: int) -> tuple[int, ...]:
    rows, k = int(shape[-2]), int(shape[-1])
    if group_dim == -1:
        return (*shape[:-1], -(-k // group_size))
    return (*shape[:-2], -(-rows // group_size), k)


def packed_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return (*shape[:-1], -(-int(shape[-1]) // 2))
