"""Backend choice: Triton on CUDA tensors, the torch twin on CPU.

The worker calls these names everywhere and never picks a backend itself. ``backend`` forces
one: ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (set before triton is first
imported), which is how the CPU tests run the real kernels; ``"torch"`` runs the twin anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptermesh.kernels import reference
from adaptermesh.kernels._backend import Backend, choose_backend, interpreter_enabled
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta

__all__ = [
    "Backend",
    "act_mul",
    "add_lora",
    "add_lora_int4",
    "choose_backend",
    "interpreter_enabled",
    "paged_attention",
    "rms_norm",
    "rope_kv_write",
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
    check_values: bool = True,
) -> None:
    """``add_lora`` with A and B INT4 (``sgmm_int4.add_lora_int4``)."""
    if choose_backend(x, backend) == "torch":
        reference.add_lora_int4_ref(out, x, qa, qb, scales, ranks, meta, check_values=check_values)
        return
    from adaptermesh.kernels import sgmm_int4

    sgmm_int4.add_lora_int4(
        out, x, qa, qb, scales, ranks, meta, v_buffer=v_buffer, check_values=check_values
    )


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
