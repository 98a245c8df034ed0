"""The multi-LoRA op the model runtime calls, bound to ``adaptermesh.kernels`` when present.

``add_lora(out, x, lora_a, lora_b, scales, ranks, meta)`` adds, for every token t whose slot
s = token_slots[t] is not -1::

    out[t, off_i : off_i + N_i] += scales[s] * (x[t] @ lora_a[i, s, :r].T) @ lora_b[i][s, :, :r].T

with r = ranks[s] and off_i the running sum of the slice widths N_i.

Shapes (the pool layout shared with ``adaptermesh.kernels``):
    out     [T, sum N_i]  x [T, H]
    lora_a  [n_slices, S, R_max, H]
    lora_b  tuple of n_slices tensors [S, N_i, R_max]
    scales  [S] fp32      ranks [S] int32

When the kernels package provides ``add_lora`` and ``meta.build_segment_meta`` they are used
(Triton on CUDA, their torch twin on CPU). Otherwise a plain torch implementation here serves:
per-slot gather on CPU, and on CUDA a batched gather-bmm that is slower but capture-safe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KERNELS_AVAILABLE", "LoraBatchMeta", "add_lora", "build_meta", "kernels_description"]

_kernel_add_lora: Callable[..., None] | None = None
_kernel_build_meta: Callable[..., Any] | None = None
try:  # the kernels package lands independently; the worker serves either way
    _kernels = importlib.import_module("adaptermesh.kernels")
    _kernels_meta = importlib.import_module("adaptermesh.kernels.meta")
    _kernel_add_lora = getattr(_kernels, "add_lora", None)
    _kernel_build_meta = getattr(_kernels_meta, "build_segment_meta", None)
except Exception:  # ImportError, or a half-written package while it is being built
    _kernel_add_lora = None
    _kernel_build_meta = None

KERNELS_AVAILABLE = _kernel_add_lora is not None and _kernel_build_meta is not None


@dataclass(slots=True)
class LoraBatchMeta:
    """Per-batch routing facts, built once and shared by every layer."""

    token_slots: torch.Tensor  # [T] int32, -1 = base model only
    kernel_meta: Any  # what adaptermesh.kernels.meta.build_segment_meta returned, or None
    slots_present: tuple[int, ...] | None  # distinct slots (CPU fallback only; None on CUDA)
    any_lora: bool


def kernels_description() -> str:
    return "adaptermesh.kernels" if KERNELS_AVAILABLE else "torch-fallback"


def build_meta(token_slots: torch.Tensor, num_slots: int, *, use_kernels: bool = True) -> LoraBatchMeta:
    """Routing facts for one batch. ``token_slots`` must already be on the compute device."""
    if use_kernels and KERNELS_AVAILABLE and _kernel_build_meta is not None:
        # The engine builds slots itself, so the host-side range check (a sync on CUDA) is skipped.
        km = _kernel_build_meta(
            token_slots, num_slots, max_tokens=int(token_slots.shape[0]), check_values=not token_slots.is_cuda
        )
        return LoraBatchMeta(token_slots, km, None, True)
    if token_slots.is_cuda:
        # No host sync: graph capture must see only device work.
        return LoraBatchMeta(token_slots, None, None, True)
    present = tuple(sorted({int(s) for s in token_slots.tolist() if s >= 0}))
    return LoraBatchMeta(token_slots, None, present, bool(present))


def add_lora(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: tuple[torch.Tensor, ...],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: LoraBatchMeta,
) -> None:
    if not meta.any_lora:
        return
    if meta.kernel_meta is not None and _kernel_add_lora is not None:
        _kernel_add_lora(out, x, lora_a, lora_b, scales, ranks, meta.kernel_meta, check_values=False)
        return
    if meta.slots_present is not None:
        _add_lora_per_slot(out, x, lora_a, lora_b, scales, meta)
    else:
        _add_lora_gather(out, x, lora_a, lora_b, scales, meta)


def _add_lora_per_slot(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    meta: LoraBatchMeta,
) -> None:
    # Ranks above an adapter's own rank hold zeros in the pool, so using R_max is exact; it
    # avoids reading ranks back to the host.
    assert meta.slots_present is not None
    for s in meta.slots_present:
        rows = (meta.token_slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, rows)
        scale = scales[s].to(x.dtype)
        off = 0
        for i, b in enumerate(lora_b):
            n = b.shape[1]
            h = xs @ lora_a[i, s].T  # [t, R]
            delta = (h @ b[s].T) * scale  # [t, N_i]
            out[:, off : off + n].index_add_(0, rows, delta)
            off += n


def _add_lora_gather(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    meta: LoraBatchMeta,
) -> None:
    slots = meta.token_slots.long()
    valid = (slots >= 0).to(x.dtype).unsqueeze(1)  # [T, 1]
    idx = slots.clamp_min(0)
    scale = scales.index_select(0, idx).to(x.dtype).unsqueeze(1) * valid  # [T, 1]
    off = 0
    for i, b in enumerate(lora_b):
        n = b.shape[1]
        a_t = lora_a[i].index_select(0, idx)  # [T, R, H]
        h = torch.bmm(a_t, x.unsqueeze(2))  # [T, R, 1]
        b_t = b.index_select(0, idx)  # [T, N, R]
        delta = torch.bmm(b_t, h).squeeze(2) * scale  # [T, N]
        out[:, off : off + n] += delta
        off += n
