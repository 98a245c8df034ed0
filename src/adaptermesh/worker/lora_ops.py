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

Per-group indices. A row names its adapter by a *handle* (``token_slots``). A pool whose
groups have grids of their own (``GroupRoute``: each handle's index in the group's grid, -1
where the adapter does not target the group) gets one index vector and one segment
metadata per group (``LoraBatchMeta.group``): the kernels take group g's weights, ranks and
scales indexed by the rows' indices in g, and a row whose adapter leaves g is a base row there
(index -1: the kernels skip it). A pool without routes shares one metadata over the handles
between its groups (``group`` returns the batch's own), and a group an adapter leaves reads
rank 0 at its handle.

DoRA rows (``apply_dora``) then scale their projection by the slot's per-output factor
``f = m / ||W + scale B A||`` (PEFT's ``DoraLinearLayer.forward`` with its detached norm)::

    out[t] = f[s] * (x[t] @ W.T + scale * B A x[t]) + bias

by a gather of each row's factor row and one elementwise pass; plain LoRA and base rows read
a row of ones there, so they keep their outputs bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from adaptermesh.kernels import dispatch
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta, build_segment_meta

__all__ = [
    "GroupRoute",
    "LoraBatchMeta",
    "add_lora",
    "add_lora_int4",
    "add_lora_sharded_rows",
    "apply_dora",
    "build_meta",
    "kernels_description",
    "project_with_lora",
]


@dataclass(frozen=True, slots=True)
class GroupRoute:
    """How a batch's adapter handles reach one pool group's grid of indices."""

    index: torch.Tensor  # [H] int32: each handle's index in the group's grid, -1: none there
    size: int  # indices in the grid: the kernels' S for this group's weights


@dataclass(slots=True)
class LoraBatchMeta:
    """Per-batch routing facts, built once and shared by every layer.

    ``token_slots`` are the rows' adapter handles (-1: base model only) and ``kernel_meta``
    their segments; with per-group ``groups`` (a pool with ``GroupRoute``s), each group's own
    meta holds the rows' indices in that group's grid as its ``token_slots`` and the batch's
    ``kernel_meta`` is None: every LoRA call then takes ``group(g)``."""

    token_slots: torch.Tensor  # [T] int32, -1 = base model only
    kernel_meta: SegmentMeta | None
    any_lora: bool = True
    # At most this many distinct adapters in the batch (the scheduler knows): the kernels
    # pick their tile shapes by tokens per adapter. None: the pool's slot count, the worst
    # case. Any value is correct for any batch; a low one is only faster where it holds.
    active_slots: int | None = None
    groups: dict[str, LoraBatchMeta] = field(default_factory=dict)

    def group(self, name: str) -> LoraBatchMeta:
        """The meta the kernels take for pool group (or vocabulary part) ``name``: its own
        where the batch has per-group routes, else the batch's."""
        if not self.groups:
            return self
        got = self.groups.get(name)
        if got is None:
            raise KeyError(
                f"the batch has no LoRA route for {name!r} (routes: {sorted(self.groups)})"
            )
        return got

    def segments(self) -> SegmentMeta:
        if self.kernel_meta is None:
            raise ValueError(
                "a batch with per-group routes has no segments of its own: take meta.group(name)"
            )
        return self.kernel_meta


def kernels_description() -> str:
    return "adaptermesh.kernels"


def _segments(slots: torch.Tensor, num_slots: int) -> SegmentMeta:
    # The engine builds slots itself, so the host-side range check (a sync on CUDA) is skipped.
    return build_segment_meta(
        slots, num_slots, max_tokens=int(slots.shape[0]), check_values=not slots.is_cuda
    )


def build_meta(
    token_slots: torch.Tensor,
    num_slots: int,
    active_slots: int | None = None,
    routes: Mapping[str, GroupRoute] | None = None,
) -> LoraBatchMeta:
    """Routing facts for one batch. ``token_slots`` (the rows' handles in ``[-1, num_slots)``)
    must already be on the compute device; ``active_slots``: LoraBatchMeta's. With ``routes``
    each group gets its rows' indices (a gather through its handle table, -1 for base rows and
    for adapters that leave the group) and their segments: no host work, so a CUDA graph
    captures it and replays it with the tables as they are then."""
    if not routes:
        return LoraBatchMeta(
            token_slots, _segments(token_slots, num_slots), active_slots=active_slots
        )
    handles = token_slots.clamp(min=0)
    base = token_slots < 0
    groups = {}
    for name, route in routes.items():
        index = route.index.index_select(0, handles).masked_fill_(base, -1)
        groups[name] = LoraBatchMeta(index, _segments(index, route.size), active_slots=active_slots)
    return LoraBatchMeta(token_slots, None, active_slots=active_slots, groups=groups)


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
            meta.segments(),
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
            meta.segments(),
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
            meta.segments(),
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
    v = dispatch.sgmm_shrink(x, lora_a, ranks, meta.segments(), check_values=False)
    all_reduce(v)
    part = torch.zeros((out.shape[0], cols[1] - cols[0]), dtype=out.dtype, device=out.device)
    dispatch.sgmm_expand(part, v, lora_b, scales, ranks, meta.segments(), check_values=False)
    out[:, cols[0] : cols[1]] += part


def apply_dora(
    out: torch.Tensor,  # [T, N] projection + bias + LoRA term (the term apart when deferred)
    delta: torch.Tensor | None,  # [T, N] the deferred LoRA term, or None
    bias: torch.Tensor | None,  # [N]
    factors: torch.Tensor,  # [S, N] one layer's DoRA factors of the group's indices
    rows: torch.Tensor,  # [T] int64 each token's index in the group, -1: factor 1 (base rows)
) -> None:
    """In place: ``out = f * (out - bias) + bias`` and ``delta *= f`` with ``f`` each row's
    factor row (all ones for a row at -1). Written as ``out * f + bias * (1 - f)`` so a factor
    of exactly 1 leaves the row's bits as they were. Fixed shapes and no host sync: CUDA graphs
    capture it."""
    f = factors.index_select(0, rows.clamp(min=0))
    f = f.masked_fill((rows < 0).unsqueeze(1), 1.0)
    if bias is None:
        out.mul_(f)
    else:
        out.mul_(f).addcmul_(1.0 - f, bias)
    if delta is not None:
        delta.mul_(f)
