"""Argument checks shared by the Triton launchers and their torch twins.

Every check runs before any launch and raises ``ValueError`` naming the argument. Checks that
read tensor values (slot and rank ranges) cost a host synchronisation on CUDA; they run when
``check_values`` is true and the stream is not being captured into a graph. The kernels clamp
ranks to ``R_max`` and treat out-of-range slots as base tokens (see ``meta.py``), so a skipped
value check can give wrong numbers for the offending tokens but never touches memory outside
the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adaptermesh.kernels.meta import SegmentMeta

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 3


@dataclass(frozen=True)
class SgmmShapes:
    num_tokens: int
    hidden: int
    n_slices: int
    num_slots: int
    r_max: int
    out_sizes: tuple[int, ...]
    out_offsets: tuple[int, ...]

    @property
    def out_total(self) -> int:
        return sum(self.out_sizes)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device} (the device of x)")


def _check_ranks(ranks: object, s: int, r_max: int, ref: torch.Tensor, check_values: bool) -> None:
    ranks = _tensor("ranks", ranks)
    if ranks.shape != (s,):
        raise ValueError(f"ranks must have shape [{s}], got {tuple(ranks.shape)}")
    if ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32, got {ranks.dtype}")
    _same_device("ranks", ranks, ref)
    if check_values and not _capturing(ranks):
        lo, hi = int(ranks.min()), int(ranks.max())
        if lo < 0 or hi > r_max:
            raise ValueError(f"ranks must lie in [0, R_max={r_max}], got min {lo} max {hi}")


def check_shrink(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    ranks: torch.Tensor,  # [S] int32
    check_values: bool,
) -> SgmmShapes:
    x = _tensor("x", x)
    lora_a = _tensor("lora_a", lora_a)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    t, h = x.shape
    if lora_a.dim() != 4:
        raise ValueError(f"lora_a must be 4-D [n_slices, S, R_max, H], got {tuple(lora_a.shape)}")
    n_slices, s, r_max, ha = lora_a.shape
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"lora_a must have 1..{MAX_SLICES} slices, got {n_slices}")
    if ha != h:
        raise ValueError(f"lora_a hidden size {ha} does not match x hidden size {h}")
    if s < 1 or r_max < 1:
        raise ValueError(f"lora_a needs S >= 1 and R_max >= 1, got shape {tuple(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a dtype {lora_a.dtype} does not match x dtype {x.dtype}")
    _same_device("lora_a", lora_a, x)
    _check_ranks(ranks, s, r_max, x, check_values)
    return SgmmShapes(t, h, n_slices, s, r_max, (), ())


def check_expand(
    out: torch.Tensor,  # [T, sum N_i]
    v: torch.Tensor,  # [n_slices, T, R_max] fp32
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    check_values: bool,
) -> SgmmShapes:
    out = _tensor("out", out)
    v = _tensor("v", v)
    if out.dim() != 2:
        raise ValueError(f"out must be 2-D [T, sum N_i], got shape {tuple(out.shape)}")
    if out.dtype not in ACT_DTYPES:
        raise ValueError(f"out must be float16, bfloat16 or float32, got {out.dtype}")
    if isinstance(lora_b, torch.Tensor) or not isinstance(lora_b, Sequence) or not lora_b:
        raise ValueError("lora_b must be a tuple of tensors, one [S, N_i, R_max] per slice")
    n_slices = len(lora_b)
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"lora_b must have 1..{MAX_SLICES} slices, got {n_slices}")
    b0 = _tensor("lora_b[0]", lora_b[0])
    if b0.dim() != 3:
        raise ValueError(f"lora_b[0] must be 3-D [S, N, R_max], got {tuple(b0.shape)}")
    s, _, r_max = b0.shape
    sizes: list[int] = []
    for i, b in enumerate(lora_b):
        name = f"lora_b[{i}]"
        b = _tensor(name, b)
        if b.dim() != 3 or b.shape[0] != s or b.shape[2] != r_max or b.shape[1] < 1:
            raise ValueError(f"{name} must have shape [{s}, N, {r_max}], got {tuple(b.shape)}")
        if b.dtype != out.dtype:
            raise ValueError(f"{name} dtype {b.dtype} does not match out dtype {out.dtype}")
        _same_device(name, b, out)
        sizes.append(int(b.shape[1]))
    t = out.shape[0]
    if out.shape[1] != sum(sizes):
        raise ValueError(f"out has {out.shape[1]} columns, the slices of lora_b need {sum(sizes)}")
    want = (n_slices, t, r_max)
    if tuple(v.shape) != want:
        raise ValueError(f"v must have shape {list(want)}, got {tuple(v.shape)}")
    if v.dtype != torch.float32:
        raise ValueError(f"v must be float32 (sgmm_shrink's output), got {v.dtype}")
    _same_device("v", v, out)
    scales = _tensor("scales", scales)
    if scales.shape != (s,):
        raise ValueError(f"scales must have shape [{s}], got {tuple(scales.shape)}")
    if scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {scales.dtype}")
    _same_device("scales", scales, out)
    _check_ranks(ranks, s, r_max, out, check_values)
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return SgmmShapes(t, 0, n_slices, s, r_max, tuple(sizes), tuple(offsets))


def check_meta(meta: SegmentMeta, shapes: SgmmShapes, ref: torch.Tensor) -> None:
    if not isinstance(meta, SegmentMeta):
        raise ValueError(f"meta must be a SegmentMeta, got {type(meta).__name__}")
    if meta.num_slots != shapes.num_slots:
        raise ValueError(
            f"meta was built for {meta.num_slots} slots, the pool has {shapes.num_slots}"
        )
    if meta.max_tokens != shapes.num_tokens:
        raise ValueError(
            f"meta was built for max_tokens={meta.max_tokens}, the activations have "
            f"{shapes.num_tokens} rows"
        )
    if meta.device != ref.device:
        raise ValueError(f"meta is on {meta.device}, the activations on {ref.device}")


def check_pair(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
) -> None:
    """Cross-checks that add_lora needs beyond the separate shrink and expand checks."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError("out must be a 2-D tensor [T, sum N_i]")
    if isinstance(lora_b, torch.Tensor) or not isinstance(lora_b, Sequence):
        raise ValueError("lora_b must be a tuple of tensors, one [S, N_i, R_max] per slice")
    if not all(isinstance(b, torch.Tensor) and b.dim() == 3 for b in lora_b):
        raise ValueError("lora_b must hold 3-D tensors [S, N_i, R_max]")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x has {x.shape[0]}")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} does not match x dtype {x.dtype}")
    if len(lora_b) != lora_a.shape[0]:
        raise ValueError(f"lora_b has {len(lora_b)} slices, lora_a has {lora_a.shape[0]}")
    for i, b in enumerate(lora_b):
        if b.shape[0] != lora_a.shape[1] or b.shape[2] != lora_a.shape[2]:
            raise ValueError(
                f"lora_b[{i}] shape {tuple(b.shape)} does not match lora_a's "
                f"S={lora_a.shape[1]} and R_max={lora_a.shape[2]}"
            )
