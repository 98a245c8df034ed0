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

The op is ``adaptermesh.kernels.add_lora``: Triton on CUDA, its torch twin on CPU. The segment
metadata is built once per batch and shared by every layer.

DoRA rows (``apply_dora``) then scale their projection by the slot's per-output factor
``f = m / ||W + scale B A||`` (PEFT's ``DoraLinearLayer.forward`` with its detached norm)::

    out[t] = f[s] * (x[t] @ W.T + scale * B A x[t]) + bias

by a gather of each row's factor row and one elementwise pass; plain LoRA and base rows read
a row of ones there, so they keep their outputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptermesh import kernels
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta
from adaptermesh.kernels.sgmm_config import density_bucket, density_slots

__all__ = [
    "LoraBatchMeta",
    "add_lora",
    "add_lora_int4",
    "apply_dora",
    "build_meta",
    "config_slots",
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


def config_slots(num_tokens: int, active_slots: int) -> tuple[str, int | None]:
    """(the batch's density class, the ``active_slots`` to pick kernel configs by) for a
    step of ``num_tokens`` tokens over ``active_slots`` distinct adapters. Every batch of one
    class gets the same configs, so a CUDA graph keyed by the class replays the right ones:
    one adapter over 64 decode rows takes the dense tiles, 64 adapters the per-token ones."""
    density = density_bucket(num_tokens, max(1, active_slots))
    return density, density_slots(num_tokens, density)


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
        kernels.add_lora(
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
    """``add_lora`` on an INT4 pool (``kernels.sgmm_int4``): Triton on CUDA, the twin on CPU."""
    if meta.any_lora:
        kernels.add_lora_int4(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ weight.T (+ bias)`` and the batch's LoRA terms, with LoRA work on ``side``
    beside the base matmul (CUDA only). Returns ``(out, delta)``.

    The shrink reads the same ``x`` as the matmul; it is a few microseconds of mostly launch
    and first-touch latency, so on a stream of its own it hides behind the matmul (one fork
    and one join, which a CUDA graph records as edges). Without ``defer`` the expand then adds
    into ``out`` on the calling stream (``delta`` is None). With ``defer`` the whole term
    (zeroed buffer, shrink, expand) goes into ``delta`` on ``side``, and the caller adds it
    where the output is consumed (``rms_norm(..., extra=delta)``, ``act_mul(..., extra=)``):
    no LoRA launch waits for the matmul. Buffers are allocated on the calling stream before
    the fork, the side stream waits for the caller first, and the caller joins it right after
    the matmul, so nothing is reused while in use.
    """
    from adaptermesh.kernels import sgmm

    main = torch.cuda.current_stream(x.device)
    t = x.shape[0]
    out = torch.empty((t, weight.shape[0]), dtype=x.dtype, device=x.device)
    delta = torch.empty_like(out) if defer else None
    v = torch.empty((lora_a.shape[0], t, lora_a.shape[2]), dtype=torch.float32, device=x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if delta is not None:
            delta.zero_()  # rows of base tokens stay zero
        shrink, expand = sgmm.plan_add_lora(
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
            fused=False,
            pdl=False,
        ).steps()
        shrink()
        if delta is not None:
            expand()
    if bias is None:
        torch.matmul(x, weight.T, out=out)
    else:
        torch.addmm(bias, x, weight.T, out=out)
    main.wait_stream(side)
    if delta is None:
        expand()
    return out, delta


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
