"""INT4 SGMM launchers: ``sgmm_shrink_int4``, ``sgmm_expand_int4`` and ``add_lora_int4`` on
Triton, A and B packed 4-bit (``int4_weight.Int4Weight``).

Like ``sgmm.py`` for bf16: the configs come from ``sgmm_config.py`` (INT4 rows, else the bf16
tables), the kernels from ``sgmm_int4_kernels.py``, the checks from ``_validate.py``. The torch
twin is ``reference.add_lora_int4_ref``; ``dispatch.add_lora_int4`` picks one of the two.
The INT4 format is ``int4_weight.py``, its quantisation ``int4_quant.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import triton

from adaptermesh.kernels._backend import dot_fp32
from adaptermesh.kernels._launch import launch
from adaptermesh.kernels._validate import (
    SgmmShapes,
    check_config,
    check_expand_int4,
    check_gemv_rank,
    check_int4,
    check_int4_config,
    check_int4_groups,
    check_shrink_int4,
)
from adaptermesh.kernels.int4_weight import (
    Int4Weight,
)
from adaptermesh.kernels.meta import SegmentMeta
from adaptermesh.kernels.sgmm import (
    pdl_available,
    shrink_output,
    split_plan,
    split_scratch,
    three_slices,
    tile_axis,
)
from adaptermesh.kernels.sgmm_config import SgmmConfig, int4_expand_config, int4_shrink_config
from adaptermesh.kernels.sgmm_int4_kernels import expand_int4_kernel, shrink_int4_kernel

__all__ = ["add_lora_int4", "sgmm_expand_int4", "sgmm_shrink_int4"]


def _scale_blocks(q: Int4Weight, cfg: SgmmConfig) -> bool:
    """Whether a kernel step or block holds whole scale groups (``dequant_step`` in
    ``sgmm_int4_kernels.py``): the group a power of two no wider than the step along K (groups
    along K) or than the block of rows (groups along the rows)."""
    g = q.group_size
    return g & (g - 1) == 0 and g <= (cfg.block_k if q.group_dim == -1 else cfg.block_n)


def _int4_tile(cfg: SgmmConfig) -> SgmmConfig:
    """A config as the INT4 kernels run it: tiles have no hoisted variant, and a tile step of
    BLOCK_K reduction elements is BLOCK_K / 2 bytes, so BLOCK_K is at least 32 (tl.dot's
    least depth of 16 on each half); the matrix-vector kernels take the config as it is."""
    if cfg.gemv:
        return cfg
    return replace(cfg, block_k=max(cfg.block_k, 32), hoist_v=False)


def _launch_shrink_int4(
    x: torch.Tensor,
    qa: Int4Weight,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v: torch.Tensor,
    shapes: SgmmShapes,
    config: SgmmConfig | None,
    active_slots: int | None,
    launch_deps: bool = False,
) -> None:
    check_int4_config(config)
    cfg = config or int4_shrink_config(shapes.num_tokens, shapes.hidden, shapes.r_max, active_slots)
    check_config(cfg)
    cfg = _int4_tile(cfg)
    grid_m = tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m)
    n_tiles_n = int(triton.cdiv(shapes.r_max, cfg.block_n))
    if cfg.gemv:  # one program walks the whole of H: no split, no partials
        split, k_per_split = 1, int(triton.cdiv(shapes.hidden, cfg.block_k)) * cfg.block_k
    else:
        split, k_per_split = split_plan(
            cfg, shapes.hidden, grid_m * n_tiles_n * shapes.n_slices, x.device
        )
    counters, partials = split_scratch(split, shapes, grid_m, n_tiles_n, x.device, ranks, v)
    launch(
        shrink_int4_kernel,
        (grid_m, n_tiles_n * split, shapes.n_slices),
        (
            x, qa.packed, qa.scales, v, ranks, meta.sorted_tokens, meta.seg_start, partials,
            counters, shapes.hidden, shapes.num_slots, shapes.r_max, shapes.num_tokens, grid_m,
            n_tiles_n, split, k_per_split, x.stride(0), x.stride(1), *qa.packed.stride(),
            *qa.scales.stride(), *v.stride(),
        ),
        {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
            "GROUP": qa.group_size,
            "GROUP_ALONG_K": qa.group_dim == -1,
            "DOT_FP32": dot_fp32(x.dtype),
            "SCALE_BLOCKS": _scale_blocks(qa, cfg),
            "GEMV": cfg.gemv,
            "LAUNCH_DEPS": launch_deps,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_expand_int4(
    out: torch.Tensor,
    v: torch.Tensor,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,
    config: SgmmConfig | None,
    active_slots: int | None,
    pdl: bool = False,
) -> None:
    check_int4_groups(qb)
    n = shapes.n_slices
    bs, sizes, offs = three_slices(qb, shapes.out_sizes, shapes.out_offsets)
    n_max = max(shapes.out_sizes)
    check_int4_config(config)
    cfg = config or int4_expand_config(shapes.num_tokens, n_max, shapes.r_max, active_slots)
    check_config(cfg)
    check_gemv_rank(cfg, shapes.r_max)
    cfg = _int4_tile(cfg)
    grid = (
        tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        n,
    )
    strides: list[Any] = []
    for b in bs:
        strides += b.packed.stride()
    for b in bs:
        strides += b.scales.stride()
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
        "GROUP": qb[0].group_size,
        "GROUP_ALONG_K": qb[0].group_dim == -1,
        "DOT_FP32": dot_fp32(out.dtype),
        "SCALE_BLOCKS": _scale_blocks(qb[0], cfg),
        "GEMV": cfg.gemv,
        "PDL": pdl,
    }
    launch(
        expand_int4_kernel,
        grid,
        (
            out, v, bs[0].packed, bs[1].packed, bs[2].packed, bs[0].scales, bs[1].scales,
            bs[2].scales, scales, ranks, meta.sorted_tokens, meta.seg_start, shapes.num_slots,
            shapes.r_max, sizes[0], sizes[1], sizes[2], offs[1], offs[2], cfg.n_blocks,
            out.stride(0), out.stride(1), *v.stride(), *strides,
        ),
        consts,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip


def sgmm_shrink_int4(
    x: torch.Tensor,
    qa: Int4Weight,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    out: torch.Tensor | None = None,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """``v[i, t, :r] = x[t] @ dequant(qa)[i, a(t), :r].T`` (fp32), like ``sgmm_shrink``."""
    shapes = check_shrink_int4(x, qa, ranks, meta, check_values)
    v = shrink_output(out, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    _launch_shrink_int4(x, qa, ranks, meta, v, shapes, config, None)
    return v


def add_lora_int4(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    x: torch.Tensor,  # [T, H]
    qa: Int4Weight,  # [n_slices, S, R_max, H]
    qb: Sequence[Int4Weight],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32 (the adapters' LoRA scaling)
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
) -> None:
    """``out += scale * (x @ A.T) @ B.T`` per token's slot, A and B INT4 (two launches).

    Triton only (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); ``dispatch``'s
    ``add_lora_int4`` runs the torch twin on CPU. Configs: ``int4_shrink_config`` /
    ``int4_expand_config`` (INT4 rows, else the bf16 tables); a tile's BLOCK_K is at least 32, a
    hoisted expand tile runs unhoisted.
    """
    check_int4_config(shrink_cfg)
    check_int4_config(expand_cfg)
    shapes = check_int4(out, x, qa, qb, scales, ranks, meta, check_values)
    if active_slots is None:
        active_slots = shapes.num_slots
    v = shrink_output(v_buffer, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    pdl = pdl_available(x.device)
    _launch_shrink_int4(x, qa, ranks, meta, v, shapes, shrink_cfg, active_slots, pdl)
    _launch_expand_int4(out, v, qb, scales, ranks, meta, shapes, expand_cfg, active_slots, pdl)


def sgmm_expand_int4(
    out: torch.Tensor,
    v: torch.Tensor,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> None:
    """``out[t, off_i:off_i+N_i] += scales[s] * v[i, t, :r] @ dequant(qb[i])[s, :, :r].T``."""
    shapes = check_expand_int4(out, v, qb, scales, ranks, meta, check_values)
    _launch_expand_int4(out, v, qb, scales, ranks, meta, shapes, config, None)
