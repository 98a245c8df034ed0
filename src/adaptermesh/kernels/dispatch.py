"""Backend choice: Triton on CUDA tensors, the torch twin on CPU.

The worker calls these names everywhere and never picks a backend itself. ``backend`` forces
one: ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is first
imported), which is how the CPU tests run the real kernels; ``"torch"`` runs the twin anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from adaptermesh.kernels import reference
from adaptermesh.kernels.meta import SegmentMeta

Backend = Literal["triton", "torch"]

__all__ = ["Backend", "add_lora", "choose_backend", "sgmm_expand", "sgmm_shrink"]


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_backend(t: torch.Tensor, backend: Backend | None) -> Backend:
    """The backend an op on tensor ``t`` runs with."""
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "torch":
        return "torch"
    if t.is_cuda:
        return "triton"
    if backend == "triton":
        if not interpreter_enabled():
            raise ValueError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 before triton is imported"
            )
        return "triton"
    return "torch"


def sgmm_shrink(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """v: [n_slices, T, R_max] float32; see ``sgmm.sgmm_shrink``."""
    if choose_backend(x, backend) == "torch":
        return reference.sgmm_shrink_ref(x, lora_a, ranks, meta, check_values=check_values)
    from adaptermesh.kernels import sgmm

    return sgmm.sgmm_shrink(x, lora_a, ranks, meta, check_values=check_values)


def sgmm_expand(
    out: torch.Tensor,  # [T, sum N_i]
    v: torch.Tensor,  # [n_slices, T, R_max] fp32
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """In-place ``out += scale * v @ B.T`` per slice; see ``sgmm.sgmm_expand``."""
    if choose_backend(out, backend) == "torch":
        reference.sgmm_expand_ref(out, v, lora_b, scales, ranks, meta, check_values=check_values)
        return
    from adaptermesh.kernels import sgmm

    sgmm.sgmm_expand(out, v, lora_b, scales, ranks, meta, check_values=check_values)


def add_lora(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    backend: Backend | None = None,
    v_buffer: torch.Tensor | None = None,
    check_values: bool = True,
) -> None:
    """In-place ``out += scale * (x @ A.T) @ B.T`` per token's slot; base tokens untouched."""
    if choose_backend(x, backend) == "torch":
        reference.add_lora_ref(
            out, x, lora_a, lora_b, scales, ranks, meta, check_values=check_values
        )
        return
    from adaptermesh.kernels import sgmm

    sgmm.add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer=v_buffer, check_values=check_values
    )
