"""The multi-LoRA ops the model runtime calls: the model's one way to the LoRA kernels.

``add_lora(out, x, lora_a, lora_b, scales, ranks, meta)`` adds, for every token t whose slot
s = token_slots[t] is not -1::

    out[t, off_i : off_i + N_i] += scales[s] * (x[t] @ lora_a[i, s, :r].T) @ lora_b[i][s, :, :r].T

with r = ranks[s] and off_i the running sum of the slice widths N_i.

Shapes (the pool layout shared with ``adaptermesh.kernels``):
    out     [T, sum N_i]  x [T, H]
    lora_a  [n_slices, S, R_max, H]
    lora_b  tuple of n_slices tensors [S, N_i, R_max]
    scales  [S] fp32      ranks [S] int32

The op is ``adaptermesh.kernels.dispatch.add_lora``: Triton on CUDA, its torch twin on CPU.
This module reaches the kernels through ``dispatch`` only (with the argument types of ``meta``
and ``int4_weight``); the model calls these functions, not the kernels. The segment metadata
is built once per batch and shared by every layer.

DoRA rows (``apply_dora``) then scale their projection by the slot's per-output factor
``f = m / ||W + scale B A||`` (PEFT's ``DoraLinearLayer.forward`` with its detached norm)::

    out[t] = f[s] * (x[t] @ W.T + scale * B A x[t]) + bias

by a gather of each row's factor row and one elementwise pass; plain LoRA and base rows read
a row of ones there, so they keep their outputs bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaptermesh.kernels import dispatch
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta

__all__ = [
    "LoraBatchMeta",
    "add_lora",
    "add_lora_int4",
    "add_lora_sharded_rows",
    "apply_dora",
    "build_meta",
    "kernels_description",
    "project_with_lora",
]


@dataclass(slots=True)
class LoraBatchMeta:
    """Per-batch routing facts, built once and shared by every layer."""

    token_slots: torch.Tensor  # [T] int32, -1 = base model only
    kernel_meta: SegmentMeta
    any_lora: bool = True
    # At most this many distinct adapters in the batch (the scheduler knows): the kernels
    # pick their tile shapes by tokens per adapter. None: the pool's slot count, the worst
    # case. Any value is correct for any batch; a low one is only faster where it holds.
    active_slots: int | None = None


def kernels_description() -> str:
    return "adaptermesh.kernels"


def build_meta(
    token_slots: torch.Tensor, num_slots: int, active_slots: int | None = None
) -> LoraBatchMeta:
    """Routing facts for one batch. ``token_slots`` must already be on the compute device;
    ``active_slots``: LoraBatchMeta's."""
    # The engine builds slots itself, so the host-side range check (a sync on CUDA) is skipped.
    km = build_segment_meta(
        token_slots,
        num_slots,
        max_tokens=int(token_slots.shape[0]),
        check_values=not token_slots.is_cuda,
    )
    return LoraBatchMeta(token_slots, km, active_slots=active_slots)


def add_lora(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: tuple[torch.Tensor, ...],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: LoraBatchMeta,
) -> None:
    if meta.any_lora:
        dispatch.add_lora(
            out,
            x,
            lora_a,
            lora_b,
            scales,
            ranks,
            meta.kernel_meta,
            active_slots=meta.active_slots,
            check_values=False,
        )


def add_lora_int4(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    qa: Int4Weight,  # [n_slices, S, R_max, H]
    qb: tuple[Int4Weight, ...],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: LoraBatchMeta,
) -> None:
    """``add_lora`` on an INT4 pool (``dispatch.add_lora_int4``): Triton on CUDA, the twin on
    CPU."""
    if meta.any_lora:
        dispatch.add_lora_int4(
            out,
            x,
            qa,
            qb,
            scales,
            ranks,
            meta.kernel_meta,
            active_slots=meta.active_slots,
            check_values=False,
        )


def project_with_lora(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [N, H] base projection
    bias: torch.Tensor | None,  # [N]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: tuple[torch.Tensor, ...],  # n_slices x [S, N_i, R_max], sum N_i = N
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: LoraBatchMeta,
    side: torch.cuda.Stream,
    *,
    defer: bool = False,
    matmul: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ weight.T (+ bias)`` and the batch's LoRA terms, with LoRA work on ``side``
    beside the base matmul (CUDA only). Returns ``(out, delta)``.

    The shrink reads the same ``x`` as the matmul; it is a few microseconds of mostly launch
    and first-touch latency, so on a stream of its own it hides behind the matmul (one fork
    and one join, which a CUDA graph records as edges). Without ``defer`` the expand then adds
    into ``out`` on the calling stream (``delta`` is None). With ``defer`` the whole term
    (zeroed buffer, shrink, expand) goes into ``delta`` on ``side``, and the caller adds it
    where the output is consumed (``rms_norm(..., extra=delta)``, ``act_mul(..., extra=)``):
    no LoRA launch waits for the matmul. ``matmul(x, out)``: writes the base product instead
    of ``x @ weight.T`` (a packed quantised weight, kernels/quant_linear.py). Buffers are allocated on the calling stream before
    the fork, the side stream waits for the caller first, and the caller joins it right after
    the matmul, so nothing is reused while in use.
    """
    main = torch.cuda.current_stream(x.device)
    t = x.shape[0]
    out = torch.empty((t, weight.shape[0]), dtype=x.dtype, device=x.device)
    delta = torch.empty_like(out) if defer else None
    v = torch.empty((lora_a.shape[0], t, lora_a.shape[2]), dtype=torch.float32, device=x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if delta is not None:
            delta.zero_()  # rows of base tokens stay zero
        shrink, expand = dispatch.add_lora_steps(
            out if delta is None else delta,
            x,
            lora_a,
            lora_b,
            scales,
            ranks,
            meta.kernel_meta,
            v_buffer=v,
            active_slots=meta.active_slots,
            check_values=False,
        )
        shrink()
        if delta is not None:
            expand()
    if matmul is not None:  # a packed quantised weight (``weight``: its shape only)
        matmul(x, out)
        if bias is not None:
            out += bias
    elif bias is None:
        torch.matmul(x, weight.T, out=out)
    else:
        torch.addmm(bias, x, weight.T, out=out)
    main.wait_stream(side)
    if delta is None:
        expand()
    return out, delta


def add_lora_sharded_rows(
    out: torch.Tensor,  # [T, N] this rank's output; the term goes into columns cols
    x: torch.Tensor,  # [T, H_rank] this rank's input rows of the module
    lora_a: torch.Tensor,  # the pool's A for those input rows
    lora_b: tuple[torch.Tensor, ...],  # the pool's B for the output columns cols
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: LoraBatchMeta,
    cols: tuple[int, int],  # (c0, c1): this rank's output columns
    all_reduce: Callable[[torch.Tensor], None],  # in place, over the tensor-parallel group
) -> None:
    """A row-parallel module's LoRA term with A and B both sharded: the shrink of this rank's
    input columns, an all-reduce of the rank-sized result, then the expand of this rank's B
    share into its output columns (the base all-reduce sums the columns)."""
    v = dispatch.sgmm_shrink(x, lora_a, ranks, meta.kernel_meta, check_values=False)
    all_reduce(v)
    part = torch.zeros((out.shape[0], cols[1] - cols[0]), dtype=out.dtype, device=out.device)
    dispatch.sgmm_expand(part, v, lora_b, scales, ranks, meta.kernel_meta, check_values=False)
    out[:, cols[0] : cols[1]] += part


def apply_dora(
    out: torch.Tensor,  # [T, N] projection + bias + LoRA term (the term apart when deferred)
    delta: torch.Tensor | None,  # [T, N] the deferred LoRA term, or None
    bias: torch.Tensor | None,  # [N]
    factors: torch.Tensor,  # [S + 1, N] one layer's DoRA factors, row S all ones
    rows: torch.Tensor,  # [T] int64 each token's factor row (slot, S for base rows)
) -> None:
    """In place: ``out = f * (out - bias) + bias`` and ``delta *= f`` with ``f`` each row's
    factor row. Written as ``out * f + bias * (1 - f)`` so a factor of exactly 1 leaves the
    row's bits as they were. Fixed shapes and no host sync: CUDA graphs capture it."""
    f = factors.index_select(0, rows)
    if bias is None:
        out.mul_(f)
    else:
        out.mul_(f).addcmul_(1.0 - f, bias)
    if delta is not None:
        delta.mul_(f)
