"""Which backend an op runs with: Triton on CUDA tensors (or under ``TRITON_INTERPRET=1``), the
torch twin otherwise. Kept apart from ``dispatch.py`` so the kernel modules can ask it without
importing the dispatcher that imports them."""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

__all__ = ["Backend", "choose_backend", "interpreter_enabled"]


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
