"""SGMM launchers: the public multi-LoRA ops on Triton (``sgmm_shrink``, ``sgmm_expand``,
``add_lora``, ``plan_add_lora``) and the launch helpers the INT4 launchers share.

Three files, one concern each: ``sgmm_config.py`` picks a batch's tile shapes (the measured
tables), ``sgmm_kernels.py`` holds the ``@triton.jit`` bodies and their maths, and this file
checks the arguments (``_validate.py``), sizes the grids from shapes only and launches. Worker
code calls the ops through ``dispatch.py``, which runs the torch twins (``reference.py``) on
CPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from adaptermesh.kernels._backend import dot_fp32, interpreter_enabled
from adaptermesh.kernels._launch import launch, prepare
from adaptermesh.kernels._validate import (
    SgmmShapes,
    check_config,
    check_expand,
    check_gemv_rank,
    check_hoist_rank,
    check_meta,
    check_pair,
    check_shrink,
    check_v_buffer,
)
from adaptermesh.kernels._workspace import split_workspace
from adaptermesh.kernels.meta import SegmentMeta
from adaptermesh.kernels.sgmm_config import (
    FUSED_MAX_RANK,
    SgmmConfig,
    expand_config,
    fused_config,
    pow2_at_least_16,
    shrink_config,
)
from adaptermesh.kernels.sgmm_kernels import (
    sgmm_expand_kernel,
    sgmm_fused_kernel,
    sgmm_shrink_gemv_kernel,
    sgmm_shrink_kernel,
)

__all__ = [
    "AddLoraPlan",
    "add_lora",
    "pdl_available",
    "plan_add_lora",
    "sgmm_expand",
    "sgmm_shrink",
    "shrink_output",
    "sm_count",
    "split_plan",
    "split_scratch",
    "three_slices",
    "tile_axis",
]


# ---------------------------------------------------------------------------------------------
# Launch helpers, shared with the INT4 launchers (sgmm_int4.py)
# ---------------------------------------------------------------------------------------------
def pdl_available(device: torch.device) -> bool:
    """Whether the expand may be a programmatic dependent launch after its shrink (CUDA,
    compute capability 9.0 and up, not the interpreter; ``ADAPTERMESH_NO_PDL=1`` turns it
    off): its prologue then overlaps the shrink's tail instead of following the launch gap."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    if os.environ.get("ADAPTERMESH_NO_PDL", "") == "1":
        return False
    return _capability(device.index if device.index is not None else -1) >= (9, 0)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    dev = torch.cuda.current_device() if index < 0 else index
    major, minor = torch.cuda.get_device_capability(dev)
    return int(major), int(minor)


def three_slices(
    items: Sequence[Any], sizes: Sequence[int], offsets: Sequence[int]
) -> tuple[list[Any], list[int], list[int]]:
    """Per-slice arguments padded to the kernels' three slots (a padding slice has width 0,
    so its programs exit at once)."""
    pad = 3 - len(items)
    return list(items) + [items[0]] * pad, list(sizes) + [0] * pad, list(offsets) + [0] * pad


def tile_axis(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on non-empty (slot, BLOCK_M) tiles: fixed by shapes, not by the token mix."""
    return int(triton.cdiv(num_tokens, block_m)) + min(num_slots, num_tokens)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200; used as such off CUDA)."""
    if device.type != "cuda":
        return 132
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


# The split-K shrink stops adding splits once the grid holds this many programs per SM: past
# that, the GPU is full anyway and every extra split only costs another partial write and read.
_MAX_PROGRAMS_PER_SM = 4


def split_plan(
    cfg: SgmmConfig, hidden: int, base_programs: int, device: torch.device
) -> tuple[int, int]:
    """(splits, H elements per split) from shapes only, so a captured graph stays valid.

    At most ``cfg.split_k`` splits, no more than the BLOCK_K steps over H, and fewer when the
    unsplit grid already has ``_MAX_PROGRAMS_PER_SM`` programs per SM. No split is left empty.
    """
    k_steps = int(triton.cdiv(hidden, cfg.block_k))
    budget = max(1, (_MAX_PROGRAMS_PER_SM * sm_count(device)) // max(base_programs, 1))
    split = max(1, min(cfg.split_k, k_steps, budget))
    steps_per_split = int(triton.cdiv(k_steps, split))
    split = int(triton.cdiv(k_steps, steps_per_split))
    return split, steps_per_split * cfg.block_k


def split_scratch(
    split: int,
    shapes: SgmmShapes,
    grid_m: int,
    n_tiles_n: int,
    device: torch.device,
    ranks: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(arrival counters, fp32 partials) for a shrink of ``split`` splits (``_workspace.py``).
    With one split, ``ranks`` and ``v`` stand in: never read, the split-K branch is compiled
    out for SPLIT_K == 1."""
    if split > 1:
        return split_workspace(
            device,
            grid_m * n_tiles_n * shapes.n_slices,
            split * shapes.n_slices * shapes.num_tokens * shapes.r_max,
        )
    return ranks, v


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------
def sgmm_shrink(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H], dtype of x
    ranks: torch.Tensor,  # [S] int32, each <= R_max
    meta: SegmentMeta,
    *,
    out: torch.Tensor | None = None,  # [n_slices, T, R_max] fp32, reused when given
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Return ``v: [n_slices, T, R_max]`` float32 with ``v[i, t, :r] = x[t] @ A[i, a(t), :r].T``.

    One launch for all slices and slots. Rows of base tokens and columns past a token's rank
    are left unwritten (``torch.empty`` contents unless ``out`` is given).
    """
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    v = shrink_output(out, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    _launch_shrink(x, lora_a, ranks, meta, v, shapes, config)
    return v


def _launch_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v: torch.Tensor,
    shapes: SgmmShapes,  # from check_shrink
    config: SgmmConfig | None,
    run: Any = launch,
    launch_deps: bool = False,  # the expand after it is a programmatic dependent launch
) -> Any:
    cfg = config or shrink_config(shapes.num_tokens, shapes.hidden, shapes.r_max)
    # Every constexpr is passed, defaults included: a prepared launch binds all of them.
    deps = {"LAUNCH_DEPS": launch_deps}
    check_config(cfg)
    grid_m = tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m)
    n_tiles_n = int(triton.cdiv(shapes.r_max, cfg.block_n))
    if cfg.gemv:
        return run(
            sgmm_shrink_gemv_kernel,
            (grid_m, n_tiles_n, shapes.n_slices),
            (
                x, lora_a, v, ranks, meta.sorted_tokens, meta.seg_start, shapes.hidden,
                shapes.num_slots, shapes.r_max, x.stride(0), x.stride(1), *lora_a.stride(),
                *v.stride(),
            ),
            {
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k,
                "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
                **deps,
            },
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    split, k_per_split = split_plan(
        cfg, shapes.hidden, grid_m * n_tiles_n * shapes.n_slices, x.device
    )
    counters, partials = split_scratch(split, shapes, grid_m, n_tiles_n, x.device, ranks, v)
    grid = (grid_m, n_tiles_n * split, shapes.n_slices)
    return run(
        sgmm_shrink_kernel,
        grid,
        (
            x,
            lora_a,
            v,
            ranks,
            meta.sorted_tokens,
            meta.seg_start,
            partials,
            counters,
            shapes.hidden,
            shapes.num_slots,
            shapes.r_max,
            shapes.num_tokens,
            grid_m,
            n_tiles_n,
            split,
            k_per_split,
            x.stride(0),
            x.stride(1),
            lora_a.stride(0),
            lora_a.stride(1),
            lora_a.stride(2),
            lora_a.stride(3),
            v.stride(0),
            v.stride(1),
            v.stride(2),
        ),
        {
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
            "DOT_FP32": dot_fp32(x.dtype),
            **deps,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def sgmm_expand(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    v: torch.Tensor,  # [n_slices, T, R_max] fp32 (sgmm_shrink's output)
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max], dtype of out
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    config: SgmmConfig | None = None,
    check_values: bool = True,
) -> None:
    """``out[t, off_i:off_i+N_i] += scales[s] * v[i, t, :r] @ B_i[s, :, :r].T``; one launch."""
    shapes = check_expand(out, v, lora_b, scales, ranks, check_values)
    check_meta(meta, shapes, out)
    _launch_expand(out, v, lora_b, scales, ranks, meta, shapes, config)


def _launch_expand(
    out: torch.Tensor,
    v: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,  # from check_expand
    config: SgmmConfig | None,
    run: Any = launch,
    pdl: bool = False,  # launched as a programmatic dependent of the shrink before it
) -> Any:
    bs, sizes, offs = three_slices(lora_b, shapes.out_sizes, shapes.out_offsets)
    n_max = max(shapes.out_sizes)
    cfg = config or expand_config(shapes.num_tokens, n_max, shapes.r_max)
    check_config(cfg)
    check_gemv_rank(cfg, shapes.r_max)
    grid = (
        tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        shapes.n_slices,
    )
    args = (
        out,
        v,
        bs[0],
        bs[1],
        bs[2],
        scales,
        ranks,
        meta.sorted_tokens,
        meta.seg_start,
        shapes.num_slots,
        shapes.r_max,
        sizes[0],
        sizes[1],
        sizes[2],
        offs[1],
        offs[2],
        cfg.n_blocks,
        out.stride(0),
        out.stride(1),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *bs[0].stride(),
        *bs[1].stride(),
        *bs[2].stride(),
    )
    check_hoist_rank(cfg, shapes.r_max)
    # Every constexpr is passed, PDL too: a prepared launch binds them all. The tile-only
    # ones are fixed for a gemv config, so its variants compile once.
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
        "DOT_FP32": dot_fp32(out.dtype) and not cfg.gemv,
        "PREFETCH_OUT": cfg.prefetch_out and not cfg.gemv,
        "PDL": pdl,
        "HOIST_V": cfg.hoist_v and not cfg.gemv,
        "GEMV": cfg.gemv,
    }
    if pdl:
        return run(sgmm_expand_kernel, grid, args, consts, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, launch_pdl=True)  # fmt: skip
    return run(
        sgmm_expand_kernel, grid, args, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )


def _launch_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    shapes: SgmmShapes,  # from check_shrink
    expand_shapes: SgmmShapes,  # from check_expand
    cfg: SgmmConfig,
    run: Any = launch,
) -> Any:
    bs, sizes, offs = three_slices(lora_b, expand_shapes.out_sizes, expand_shapes.out_offsets)
    n_max = max(expand_shapes.out_sizes)
    grid = (
        tile_axis(shapes.num_tokens, shapes.num_slots, cfg.block_m),
        int(triton.cdiv(n_max, cfg.block_n * cfg.n_blocks)),
        shapes.n_slices,
    )
    args = (
        out, x, lora_a, bs[0], bs[1], bs[2], scales, ranks, meta.sorted_tokens, meta.seg_start,
        shapes.hidden, shapes.num_slots, shapes.r_max, sizes[0], sizes[1], sizes[2], offs[1],
        offs[2], cfg.n_blocks, x.stride(0), x.stride(1), *lora_a.stride(), out.stride(0),
        out.stride(1), *bs[0].stride(), *bs[1].stride(), *bs[2].stride(),
    )  # fmt: skip
    consts: dict[str, object] = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_R": pow2_at_least_16(shapes.r_max),
        "BLOCK_S": triton.next_power_of_2(shapes.num_slots),
        "DOT_FP32": dot_fp32(x.dtype),
    }
    return run(sgmm_fused_kernel, grid, args, consts, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages)  # fmt: skip


def add_lora(
    out: torch.Tensor,  # [T, sum N_i], updated in place
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [n_slices, S, R_max, H]
    lora_b: Sequence[torch.Tensor],  # n_slices x [S, N_i, R_max]
    scales: torch.Tensor,  # [S] fp32
    ranks: torch.Tensor,  # [S] int32
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,  # [n_slices, T, R_max] fp32 scratch, for graphs
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> None:
    """``out += scale * (x @ A.T) @ B.T`` per token's slot: two launches (shrink, expand), or
    one fused launch where the config table measured that faster.

    ``active_slots`` is how many distinct adapters the batch uses at most (the scheduler
    knows); it picks the tile shapes. Left out, it is the pool's slot count: the worst case,
    which suits a CUDA graph captured once for any mix. ``fused``: None lets the table decide
    (only when no shrink/expand config is given), False always runs two launches, True needs
    ``fused_cfg`` or a table row. ``pdl``: None launches the expand as a programmatic
    dependent of the shrink where the GPU supports it (``pdl_available``).
    """
    _add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer, shrink_cfg, expand_cfg,
        active_slots, check_values, launch, fused_cfg, fused, pdl,
    )  # fmt: skip


class AddLoraPlan:
    """``add_lora`` on fixed tensors, checked and bound once: each call only launches.

    For eager callers that run the same op on the same buffers many times (a serving loop
    outside CUDA graphs): the checks, the config choice, the kernels' argument lists and their
    compiled kernels are all settled when the plan is made, so a call costs one or two driver
    launches. The tensors' contents may change between calls, their storage must not. A plan
    uses the split-K scratch of the stream it was made on; run it on that stream.
    """

    def __init__(self, launches: list[Callable[[], None]]) -> None:
        self._launches = launches
        self.launches = len(launches)

    def __call__(self) -> None:
        for f in self._launches:
            f()

    def steps(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """The shrink and the expand launches apart, for a caller that runs them on two
        streams (each launches on the stream current when it is called). Such a plan is made
        with ``fused=False`` and ``pdl=False``."""
        if len(self._launches) != 2:
            raise ValueError("a fused plan has one launch: make it with fused=False for steps()")
        shrink, expand = self._launches
        return shrink, expand


def plan_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    v_buffer: torch.Tensor | None = None,
    shrink_cfg: SgmmConfig | None = None,
    expand_cfg: SgmmConfig | None = None,
    active_slots: int | None = None,
    check_values: bool = True,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> AddLoraPlan:
    """An ``AddLoraPlan`` for these tensors (same arguments as ``add_lora``); nothing runs."""
    launches: list[Callable[[], None]] = _add_lora(
        out, x, lora_a, lora_b, scales, ranks, meta, v_buffer, shrink_cfg, expand_cfg,
        active_slots, check_values, prepare, fused_cfg, fused, pdl,
    )  # fmt: skip
    return AddLoraPlan(launches)


def _add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    v_buffer: torch.Tensor | None,
    shrink_cfg: SgmmConfig | None,
    expand_cfg: SgmmConfig | None,
    active_slots: int | None,
    check_values: bool,
    run: Any,
    fused_cfg: SgmmConfig | None = None,
    fused: bool | None = None,
    pdl: bool | None = None,
) -> list[Any]:
    # Every check runs before the first launch, so a bad lora_b cannot leave a half-done op.
    shapes = check_shrink(x, lora_a, ranks, check_values)
    check_meta(meta, shapes, x)
    check_pair(out, x, lora_a, lora_b)
    if active_slots is None:
        active_slots = shapes.num_slots
    v = shrink_output(v_buffer, shapes.n_slices, shapes.num_tokens, shapes.r_max, x.device)
    expand_shapes = check_expand(out, v, lora_b, scales, ranks, False)
    if fused_cfg is None and fused is not False and shrink_cfg is None and expand_cfg is None:
        fused_cfg = fused_config(
            shapes.num_tokens, shapes.hidden, max(expand_shapes.out_sizes), shapes.r_max,
            active_slots, n_slices=shapes.n_slices, sm_count=sm_count(x.device),
        )  # fmt: skip
    if fused and fused_cfg is None:
        raise ValueError("fused=True needs fused_cfg here: the config table has no row for it")
    if fused_cfg is not None and fused is not False:
        if not fused_cfg.fused:
            raise ValueError("fused_cfg must be a config with fused=True")
        if shapes.r_max > FUSED_MAX_RANK:
            raise ValueError(f"a fused launch holds the rank in registers: R_max must be <= "
                             f"{FUSED_MAX_RANK}, got {shapes.r_max}")  # fmt: skip
        check_config(fused_cfg)
        fused_launch = _launch_fused(
            out, x, lora_a, lora_b, scales, ranks, meta, shapes, expand_shapes, fused_cfg, run
        )
        return [fused_launch]
    if pdl is None:
        pdl = pdl_available(x.device)
    if shrink_cfg is None:
        shrink_cfg = shrink_config(shapes.num_tokens, shapes.hidden, shapes.r_max, active_slots)
    if expand_cfg is None:
        expand_cfg = expand_config(
            shapes.num_tokens, max(expand_shapes.out_sizes), shapes.r_max, active_slots
        )
    check_config(shrink_cfg)
    check_config(expand_cfg)
    check_gemv_rank(expand_cfg, shapes.r_max)
    check_hoist_rank(expand_cfg, shapes.r_max)
    # Launch straight away: sgmm_shrink / sgmm_expand would repeat the checks above, and this
    # runs for every targeted module of every layer.
    return [
        _launch_shrink(x, lora_a, ranks, meta, v, shapes, shrink_cfg, run, launch_deps=pdl),
        _launch_expand(
            out, v, lora_b, scales, ranks, meta, expand_shapes, expand_cfg, run, pdl=pdl
        ),
    ]


def shrink_output(
    buf: torch.Tensor | None, n_slices: int, num_tokens: int, r_max: int, device: torch.device
) -> torch.Tensor:
    """The shrink's output v ``[n_slices, T, R_max]`` fp32: ``buf`` when given (checked), else a
    new tensor."""
    shape = (n_slices, num_tokens, r_max)
    if buf is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return check_v_buffer(buf, shape, device)
