"""Plain-torch twins of the Triton kernels.

Each ``<op>_ref`` has the same signature and contract as ``<op>`` in ``sgmm.py`` / ``fuse.py``.
Tests use them as the oracle; the worker runs them on CPU. They compute in fp32 and round the
way the kernels round: ``v`` is kept in fp32, cast to the weight dtype before the expand
matmul (the kernel feeds bf16/fp16 operands to the tensor cores), and the sum with ``out`` is
formed in fp32 and rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from adaptermesh.kernels._validate import (
    SgmmShapes,
    check_expand,
    check_meta,
    check_pair,
    check_shrink,
)
from adaptermesh.kernels.meta import SegmentMeta

if TYPE_CHECKING:
    from adaptermesh.kernels.fuse import MergeTable

__all__ = [
    "add_lora_ref",
    "fused_switch_ref",
    "gated_add_lora_ref",
    "route_ref",
    "sgmm_expand_ref",
    "sgmm_shrink_ref",
]


def _slot_groups(meta: SegmentMeta) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every non-empty segment, read from the metadata."""
    starts = meta.seg_start.tolist()
    order = meta.sorted_tokens
    groups = []
    for s in range(meta.num_slots):
        a, b = starts[s], starts[s + 1]
        if b > a:
            groups.append((s, order[a:b].long()))
    return groups


def _shrink_into(
    v: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    rank_list: list[int],
    groups: list[tuple[int, torch.Tensor]],
) -> None:
    r_max = v.shape[2]
    for s, idx in groups:
        r = min(int(rank_list[s]), r_max)
        if r == 0:
            continue
        xs = x.index_select(0, idx).float()
        for i in range(v.shape[0]):
            v[i, idx, :r] = xs @ lora_a[i, s, :r].float().T


def _expand_from(
    out: torch.Tensor,
    v: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    rank_list: list[int],
    groups: list[tuple[int, torch.Tensor]],
    shapes: SgmmShapes,
) -> None:
    scale_list = scales.tolist()
    wdtype = lora_b[0].dtype
    for s, idx in groups:
        r = min(int(rank_list[s]), shapes.r_max)
        if r == 0:
            continue
        for i, b in enumerate(lora_b):
            off, n = shapes.out_offsets[i], shapes.out_sizes[i]
            vi = v[i].index_select(0, idx)[:, :r].to(wdtype).float()
            delta = (vi @ b[s, :, :r].float().T) * scale_list[s]
            cols = out[:, off : off + n]
            cols[idx] = (cols[idx].float() + delta).to(out.dtype)


def _new_v(shapes: SgmmShapes, device: torch.device) -> torch.Tensor:
    return torch.zeros(
        shapes.n_slices, shapes.num_tokens, shapes.r_max, dtype=torch.float32, device=device
    )


def sgmm_shrink_ref(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """v[i, t, :r] = x[t] @ lora_a[i, slot(t), :r].T with r = ranks[slot(t)]; fp32.

    Returns ``v: [n_slices, T, R_max]`` float32. Entries past a token's rank and the rows of
    base tokens are unspecified (the Triton kernel leaves them unwritten); this twin zeroes
    them.
    """
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    v = _new_v(shapes, x.device)
    _shrink_into(v, x, lora_a, ranks.tolist(), _slot_groups(meta))
    return v


def sgmm_expand_ref(
    out: torch.Tensor,  # [T, sum N_i]
    v: torch.Tensor,  # [n_slices, T, R_max] fp32
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    check_values: bool = True,
) -> None:
    """out[t, off_i:off_i+N_i] += scales[s] * v[i, t, :r] @ lora_b[i][s, :, :r].T, in place."""
    shapes = check_expand(out, v, lora_b, scales, ranks, check_values)
    check_meta(meta, shapes, out)
    _expand_from(out, v, lora_b, scales, ranks.tolist(), _slot_groups(meta), shapes)


def add_lora_ref(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    check_values: bool = True,
) -> None:
    """out += scale * (x @ A.T) @ B.T per token's slot; base tokens untouched."""
    # Every check runs before any write, and the metadata and ranks are read once for both
    # halves: the worker calls this for every targeted module of every layer on CPU.
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    v = _new_v(shapes, x.device)
    check_pair(out, x, lora_a, lora_b)
    eshapes = check_expand(out, v, lora_b, scales, ranks, False)
    rank_list = ranks.tolist()
    groups = _slot_groups(meta)
    _shrink_into(v, x, lora_a, rank_list, groups)
    _expand_from(out, v, lora_b, scales, rank_list, groups, eshapes)


# ---------------------------------------------------------------------------------------------
# AdaFuse twins
# ---------------------------------------------------------------------------------------------
def route_ref(
    h: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [E, H]
    bias: torch.Tensor | None,  # [E]
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int32, gates [T, k] fp32): top-k of fp32 logits, softmax over them."""
    logits = h.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    vals, ids = torch.topk(logits, top_k, dim=-1, sorted=True)
    return ids.to(torch.int32), torch.softmax(vals, dim=-1)


def _selection_delta_ref(
    lora_a: torch.Tensor, lora_b: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    n, k = lora_b.shape[1], lora_a.shape[2]
    delta = torch.zeros(n, k, dtype=torch.float32, device=lora_a.device)
    for e, g in zip(ids.tolist(), gates.tolist(), strict=True):
        if e >= 0:
            delta += g * (lora_b[e].float() @ lora_a[e].float())
    return delta


def fused_switch_ref(
    table: MergeTable,
    new_ids: torch.Tensor,  # [k] int32
    new_gates: torch.Tensor,  # [k] fp32
    *,
    old_ids: torch.Tensor,
    old_gates: torch.Tensor,
) -> None:
    """Exact mode: W = round(W0 + c*D_new). Delta mode: W = round(W + c*(D_new - D_old))."""
    for t in table.targets:
        delta = _selection_delta_ref(t.lora_a, t.lora_b, new_ids, new_gates)
        if table.exact:
            assert t.master is not None
            src = t.master
        else:
            delta -= _selection_delta_ref(t.lora_a, t.lora_b, old_ids, old_gates)
            src = t.weight
        t.weight.copy_((src.float() + t.scale * delta).to(t.weight.dtype))


def gated_add_lora_ref(
    out: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [E, r, K]
    lora_b: torch.Tensor,  # [E, N, r]
    expert_ids: torch.Tensor,  # [T, k] int32
    gates: torch.Tensor,  # [T, k] fp32
    scale: float,
) -> None:
    """out[t] += scale * sum_j g[t, j] * round_w(g-scaled x[t] @ A[e].T) @ B[e].T."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    xf = x.float()
    for j in range(expert_ids.shape[1]):
        ids = expert_ids[:, j].long()
        for e in torch.unique(ids).tolist():
            if e < 0:
                continue
            rows = (ids == e).nonzero().flatten()
            v = (xf[rows] @ lora_a[e].float().T) * gates[rows, j : j + 1]
            acc[rows] += v.to(lora_b.dtype).float() @ lora_b[e].float().T
    out.copy_((out.float() + scale * acc).to(out.dtype))
