"""Backend choice: Triton on CUDA tensors, the torch twin on CPU, for every op of the package.

The worker's one seam to the kernels: it calls these names (and takes the argument types from
``meta``, ``int4_weight``, ``int4_quant`` and ``fuse_config``), never a launcher, kernel, table
or twin module (an import-linter contract), and never picks a backend itself. ``backend`` forces
one: ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is first
imported), which is how the CPU tests run the real kernels; ``"torch"`` runs the twin anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from adaptermesh.kernels import reference
from adaptermesh.kernels._backend import Backend, choose_backend, interpreter_enabled
from adaptermesh.kernels._validate import (
    check_gated_add_lora,
    check_instance,
    check_route,
    check_selection,
)
from adaptermesh.kernels.fuse_config import MergeTable, SwitchConfig
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta

__all__ = [
    "Backend",
    "act_mul",
    "add_lora",
    "add_lora_int4",
    "add_lora_steps",
    "choose_backend",
    "config_slots",
    "fused_merge",
    "fused_switch",
    "fused_unmerge",
    "gated_add_lora",
    "interpreter_enabled",
    "paged_attention",
    "rms_norm",
    "rope_kv_write",
    "route",
    "sgmm_expand",
    "sgmm_shrink",
]


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
    active_slots: int | None = None,
    check_values: bool = True,
) -> None:
    """In-place ``out += scale * (x @ A.T) @ B.T`` per token's slot; base tokens untouched.
    ``active_slots``: at most this many distinct adapters in the batch (picks the Triton
    kernels' tile shapes; the torch twin ignores it)."""
    if choose_backend(x, backend) == "torch":
        reference.add_lora_ref(
            out, x, lora_a, lora_b, scales, ranks, meta, check_values=check_values
        )
        return
    from adaptermesh.kernels import sgmm

    sgmm.add_lora(
        out,
        x,
        lora_a,
        lora_b,
        scales,
        ranks,
        meta,
        v_buffer=v_buffer,
        active_slots=active_slots,
        check_values=check_values,
    )


def add_lora_int4(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    qa: Int4Weight,  # [n_slices, S, R_max, H]
    qb: Sequence[Int4Weight],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    backend: Backend | None = None,
    v_buffer: torch.Tensor | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
) -> None:
    """``add_lora`` with A and B INT4 (``sgmm_int4.add_lora_int4``)."""
    if choose_backend(x, backend) == "torch":
        reference.add_lora_int4_ref(out, x, qa, qb, scales, ranks, meta, check_values=check_values)
        return
    from adaptermesh.kernels import sgmm_int4

    sgmm_int4.add_lora_int4(
        out,
        x,
        qa,
        qb,
        scales,
        ranks,
        meta,
        v_buffer=v_buffer,
        active_slots=active_slots,
        check_values=check_values,
    )


def add_lora_steps(
    out: torch.Tensor,  # [T, sum N_i]
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor,  # [n_slices, T, R_max] fp32
    active_slots: int | None = None,
    check_values: bool = True,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``add_lora`` as its two launches, ``(shrink, expand)``, checked and bound to these
    tensors, for a caller that runs them on two streams (each launches on the stream current
    when it is called; the expand reads v from ``v_buffer``). Triton only: CUDA tensors, or
    CPU ones under ``TRITON_INTERPRET=1``; see ``sgmm.plan_add_lora``."""
    from adaptermesh.kernels import sgmm

    return sgmm.plan_add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer=v_buffer,
        active_slots=active_slots, check_values=check_values, fused=False, pdl=False,
    ).steps()  # fmt: skip


def config_slots(num_tokens: int, active_slots: int) -> tuple[str, int | None]:
    """(the batch's density class, the ``active_slots`` to pick kernel configs by) for a
    step of ``num_tokens`` tokens over ``active_slots`` distinct adapters. Every batch of one
    class gets the same configs, so a CUDA graph keyed by the class replays the right ones:
    one adapter over 64 decode rows takes the dense tiles, 64 adapters the per-token ones."""
    from adaptermesh.kernels.sgmm_config import density_bucket, density_slots

    density = density_bucket(num_tokens, max(1, active_slots))
    return density, density_slots(num_tokens, density)


# ---------------------------------------------------------------------------------------------
# Decoder-layer elementwise ops (layer_ops.py): one launch each on the Triton backend.
# ---------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    residual: torch.Tensor | None = None,  # [T, H], becomes round(x + residual) in place
    out: torch.Tensor | None = None,  # [T, H]
    gemma: bool = False,
    extra: torch.Tensor | None = None,  # [T, H], added to x before the residual
    backend: Backend | None = None,
) -> torch.Tensor:
    """RMSNorm of x, or of x (+ extra) + residual (stored into residual); see
    ``layer_ops.rms_norm``."""
    if choose_backend(x, backend) == "torch":
        return reference.rms_norm_ref(
            x, weight, eps, residual=residual, out=out, gemma=gemma, extra=extra
        )
    from adaptermesh.kernels import layer_ops

    return layer_ops.rms_norm(x, weight, eps, residual=residual, out=out, gemma=gemma, extra=extra)


def rope_kv_write(
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos | sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, negative = no write
    *,
    rotary_dim: int | None = None,
    backend: Backend | None = None,
) -> None:
    """RoPE on q in place, rotated k and v into the paged caches; see ``layer_ops``."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if choose_backend(q, backend) == "torch":
        reference.rope_kv_write_ref(*args, rotary_dim=rotary_dim)
        return
    from adaptermesh.kernels import layer_ops

    layer_ops.rope_kv_write(*args, rotary_dim=rotary_dim)


def act_mul(
    gu: torch.Tensor,  # [T, 2*I]: gate | up
    *,
    act: str = "silu",
    out: torch.Tensor | None = None,  # [T, I]
    extra: torch.Tensor | None = None,  # [T, 2*I], added to gu first
    backend: Backend | None = None,
) -> torch.Tensor:
    """act(gate) * up as [T, I]; see ``layer_ops.act_mul``."""
    if choose_backend(gu, backend) == "torch":
        return reference.act_mul_ref(gu, act=act, out=out, extra=extra)
    from adaptermesh.kernels import layer_ops

    return layer_ops.act_mul(gu, act=act, out=out, extra=extra)


# ---------------------------------------------------------------------------------------------
# Paged attention (paged_attention.py): decode (split-KV) or prefill kernel, by max_query_len.
# ---------------------------------------------------------------------------------------------
def paged_attention(
    out: torch.Tensor,  # [T, Hq, D], written only for rows that belong to a sequence
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, 0 = padding sequence
    query_start: torch.Tensor,  # [S + 1] int32
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    num_splits: int = 1,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,  # fp32 split-KV scratch, for graphs
    backend: Backend | None = None,
) -> None:
    """Causal paged attention of each sequence's last rows; see ``paged_attention.py``."""
    args = (out, q, k_cache, v_cache, block_tables, seq_lens, query_start)
    if choose_backend(q, backend) == "torch":
        reference.paged_attention_ref(
            *args, scale=scale, max_query_len=max_query_len, sliding_window=sliding_window,
            num_splits=num_splits, softcap=softcap, workspace=workspace,
        )  # fmt: skip
        return
    # A from-import of the function: the package attribute ``paged_attention`` is this op,
    # not the module.
    from adaptermesh.kernels.paged_attention import paged_attention as launch

    launch(
        *args, scale=scale, max_query_len=max_query_len, sliding_window=sliding_window,
        num_splits=num_splits, softcap=softcap, workspace=workspace,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# AdaFuse (fuse_kernels.py): router, fused merge/switch, gated SGMM. Each op checks its
# arguments before it picks a backend, so both backends refuse the same inputs.
# ---------------------------------------------------------------------------------------------
def route(
    h: torch.Tensor,  # [T, H] hidden states at the first layer
    weight: torch.Tensor,  # [E, H] router weight, dtype of h
    bias: torch.Tensor | None,  # [E] or None
    top_k: int,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k pre-gating: ``(expert_ids [T, k] int32, gates [T, k] fp32)``, best first.

    Gates are the softmax of the k selected logits (they sum to 1 per token). Ties between
    equal logits go to the lower expert index.
    """
    check_route(h, weight, bias, top_k)
    if choose_backend(h, backend) == "torch":
        return reference.route_ref(h, weight, bias, top_k)
    from adaptermesh.kernels import fuse_kernels

    return fuse_kernels.route(h, weight, bias, top_k)


def fused_switch(
    table: MergeTable,
    new_ids: torch.Tensor,  # [k] int32, -1 = no expert in that position
    new_gates: torch.Tensor,  # [k] fp32
    *,
    old_ids: torch.Tensor | None = None,  # [k'] int32; default: the table's current selection
    old_gates: torch.Tensor | None = None,  # [k'] fp32
    backend: Backend | None = None,
    config: SwitchConfig | None = None,
) -> None:
    """Replace the merged selection in every targeted module with one launch.

    Exact mode: ``W = round(W0 + Delta_new)`` (the old selection is not needed). Delta mode:
    ``W = round(W - Delta_old + Delta_new)`` with both deltas formed in fp32. ``config``
    overrides the tiling (``DEFAULT_SWITCH_CONFIG``); the result does not depend on it.
    """
    check_instance("table", table, MergeTable)
    check_selection(table, new_ids, new_gates, "new")
    if old_ids is None or old_gates is None:
        # The table's own selection was checked when it was merged.
        old_ids, old_gates = table.cur_ids, table.cur_gates
        check_selection(table, old_ids, old_gates, "old", values=False)
    else:
        check_selection(table, old_ids, old_gates, "old")
    if choose_backend(table.w_ptrs, backend) == "torch":
        reference.fused_switch_ref(table, new_ids, new_gates, old_ids=old_ids, old_gates=old_gates)
    else:
        from adaptermesh.kernels import fuse_kernels

        fuse_kernels.fused_switch(table, new_ids, new_gates, old_ids, old_gates, config)
    table.cur_ids = new_ids.clone()
    table.cur_gates = new_gates.clone()


def fused_merge(
    table: MergeTable,
    ids: torch.Tensor,  # [k] int32
    gates: torch.Tensor,  # [k] fp32
    *,
    backend: Backend | None = None,
    config: SwitchConfig | None = None,
) -> None:
    """``W' = W + sum_j g_j * c * B[e_j] @ A[e_j]`` for every target, one launch.

    Merging onto weights that already hold a selection replaces it (a switch)."""
    fused_switch(table, ids, gates, backend=backend, config=config)


def fused_unmerge(
    table: MergeTable, *, backend: Backend | None = None, config: SwitchConfig | None = None
) -> None:
    """Back to the plain backbone (bit-exact in exact mode)."""
    none_ids = torch.full((1,), -1, dtype=torch.int32, device=table.device)
    none_gates = torch.zeros(1, dtype=torch.float32, device=table.device)
    fused_switch(table, none_ids, none_gates, backend=backend, config=config)


def gated_add_lora(
    out: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [E, r, K]
    lora_b: torch.Tensor,  # [E, N, r]
    expert_ids: torch.Tensor,  # [T, k] int32, -1 = none
    gates: torch.Tensor,  # [T, k] fp32
    scale: float,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """``out[t] += scale * sum_j gates[t, j] * (x[t] @ A[e_tj].T) @ B[e_tj].T``; two launches.

    ``check_values`` compares every id with ``[-1, E)`` and raises ``ValueError``; on CUDA that
    reads the ids back (a host synchronisation). Unlike the SGMM slots, an id past ``E`` is not
    made safe on the device, so only a caller whose ids come from ``route`` over these same
    experts (or are -1) may turn it off.
    """
    check_gated_add_lora(out, x, lora_a, lora_b, expert_ids, gates, check_values)
    if choose_backend(x, backend) == "torch":
        reference.gated_add_lora_ref(out, x, lora_a, lora_b, expert_ids, gates, scale)
        return
    from adaptermesh.kernels import fuse_kernels

    fuse_kernels.gated_add_lora(out, x, lora_a, lora_b, expert_ids, gates, scale)
