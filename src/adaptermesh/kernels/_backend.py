"""Which backend an op runs with: Triton on CUDA tensors (or under ``TRITON_INTERPRET=1``), the
torch twin otherwise. Kept apart from ``dispatch.py`` so the kernel modules can ask it without
importing the dispatcher that imports them."""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

__all__ = ["Backend", "choose_backend", "dot_fp32", "interpreter_enabled"]


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


def dot_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot runs on fp32 operands with IEEE precision.

    fp32 activations get IEEE fp32 products instead of tf32. Under TRITON_INTERPRET=1 every
    dtype does, because the CPU interpreter of triton 3.9 returns garbage for a bf16 tl.dot;
    the operands are upcast exactly (bf16 and fp16 embed in fp32), so the maths is unchanged.
    """
    return dtype == torch.float32 or interpreter_enabled()
