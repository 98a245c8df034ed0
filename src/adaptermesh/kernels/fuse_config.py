"""AdaFuse host side: the fused switch's tiling (its config space) and the merge table that
describes every targeted module to one launch. No triton import: the table is built, and the
torch twin runs, without a Triton install. The kernels and launchers are ``fuse_kernels.py``;
the maths, ``fuse_kernels.py``'s module notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from adaptermesh.kernels._validate import check_merge_targets, check_switch_config

__all__ = [
    "DEFAULT_SWITCH_CONFIG",
    "SWITCH_CANDIDATES",
    "MergeTable",
    "MergeTarget",
    "SwitchConfig",
    "SwitchPlan",
    "build_merge_table",
    "switch_plan",
]


# ---------------------------------------------------------------------------------------------
# Config space of the fused switch. Router and gated SGMM tiles: fuse_kernels.py.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SwitchConfig:
    """Tiling of the fused switch. A program owns ``block_n`` contiguous columns of one module
    and walks ``chunks`` chunks of ``block_m`` rows down them, ``num_stages`` chunks in flight
    (asynchronous copies into shared memory); ``num_warps`` per program."""

    block_m: int = 32
    block_n: int = 256
    chunks: int = 16
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_switch_config(self)

    def as_dict(self) -> dict[str, int]:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "chunks": self.chunks,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# Roofline pick for the H200 (the switch is bound by HBM: ~13 GB read and written for the 7B
# shape, ~6.2 ms at the copy rate). 32 x 256 bf16 chunks (512-byte row segments, 16-byte
# vectors); a program walks 512 rows, so the selection's A columns (2 x 16 x 256) are read once
# per 256 KiB of weights and each chunk adds only 2 KiB of B rows. Compiled for sm_90 it takes
# 155 registers and 56 KiB of shared memory: 3 programs an SM, each with 3 chunks (48 KiB) in
# flight, about 2.5x what Little's law asks of an SM at 4.8 TB/s. bench/bench_adafuse.py sweeps
# SWITCH_CANDIDATES on the GPU and records the best.
DEFAULT_SWITCH_CONFIG = SwitchConfig()
SWITCH_CANDIDATES: tuple[SwitchConfig, ...] = (
    DEFAULT_SWITCH_CONFIG,
    SwitchConfig(32, 256, 16, 4, 2),
    SwitchConfig(32, 128, 32, 4, 4),  # 78 registers: 5 programs an SM
    SwitchConfig(16, 256, 32, 4, 4),
    SwitchConfig(16, 512, 32, 4, 4),
    SwitchConfig(32, 512, 16, 8, 3),
    SwitchConfig(64, 128, 16, 4, 3),
    SwitchConfig(64, 256, 8, 8, 3),
    SwitchConfig(64, 256, 1, 8, 1),  # one tile a program, no pipelining
)


@dataclass
class SwitchPlan:
    """Per-config launch description: one row ``(module, first row, first column)`` per
    program, so a program finds its module with one load instead of a search."""

    config: SwitchConfig
    tiles: torch.Tensor  # [P, 3] int32
    num_programs: int
    even_rows: bool  # every module's N is a multiple of block_m
    even_cols: bool  # every module's K is a multiple of block_n


@dataclass
class MergeTarget:
    """One targeted linear layer: ``weight [N, K]`` and its experts."""

    weight: torch.Tensor  # [N, K], updated in place by merges
    lora_a: torch.Tensor  # [E, r, K]
    lora_b: torch.Tensor  # [E, N, r]
    scale: float
    master: torch.Tensor | None = None  # [N, K] pristine copy (exact mode)


@dataclass
class MergeTable:
    """Device-side description of all targets, built once (``build_merge_table``)."""

    targets: list[MergeTarget]
    w_ptrs: torch.Tensor  # [M] int64 addresses of the weights
    src_ptrs: torch.Tensor  # [M] int64: masters in exact mode, else the weights
    a_ptrs: torch.Tensor  # [M] int64
    b_ptrs: torch.Tensor  # [M] int64
    dims: torch.Tensor  # [M, 3] int32: N, K, r
    scales: torch.Tensor  # [M] fp32
    shapes: list[tuple[int, int, int]]  # host copy of dims
    num_experts: int
    r_max: int
    dtype: torch.dtype
    exact: bool
    aligned: bool  # every base address 16-byte aligned and every K a multiple of 8
    # Launch tables, one per SwitchConfig used so far (built on first use).
    plans: dict[SwitchConfig, SwitchPlan] = field(default_factory=dict)
    # Current selection (what the weights hold now), [k] int32 / fp32; -1 = no expert.
    cur_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    cur_gates: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @property
    def device(self) -> torch.device:
        return self.w_ptrs.device

    def backbone_bytes(self) -> int:
        """Bytes one switch must move: read W (or W0) and write W for every target."""
        return sum(2 * t.weight.numel() * t.weight.element_size() for t in self.targets)


def build_merge_table(targets: Sequence[MergeTarget], *, exact: bool = True) -> MergeTable:
    """Validate the targets and build the pointer table. With ``exact`` every target needs a
    ``master`` (a pristine copy of the weight); the caller keeps all tensors alive."""
    shapes = check_merge_targets(targets, exact)
    dtype, device, dims = shapes.dtype, shapes.device, shapes.dims
    srcs = [t.master if (exact and t.master is not None) else t.weight for t in targets]
    bases = [x for t in targets for x in (t.weight, t.lora_a, t.lora_b)] + srcs
    aligned = all(x.data_ptr() % 16 == 0 for x in bases) and all(k % 8 == 0 for _, k, _ in dims)

    def ptrs(xs: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([x.data_ptr() for x in xs], dtype=torch.int64, device=device)

    return MergeTable(
        targets=list(targets),
        w_ptrs=ptrs([t.weight for t in targets]),
        src_ptrs=ptrs(srcs),
        a_ptrs=ptrs([t.lora_a for t in targets]),
        b_ptrs=ptrs([t.lora_b for t in targets]),
        dims=torch.tensor(dims, dtype=torch.int32, device=device),
        scales=torch.tensor([float(t.scale) for t in targets], dtype=torch.float32, device=device),
        shapes=dims,
        num_experts=shapes.num_experts,
        r_max=shapes.r_max,
        dtype=dtype,
        exact=exact,
        aligned=aligned,
        cur_ids=torch.full((1,), -1, dtype=torch.int32, device=device),
        cur_gates=torch.zeros(1, dtype=torch.float32, device=device),
    )


def switch_plan(table: MergeTable, cfg: SwitchConfig) -> SwitchPlan:
    """The launch table of ``cfg`` for ``table``, built on first use and kept in ``table.plans``."""
    plan = table.plans.get(cfg)
    if plan is not None:
        return plan
    span = cfg.block_m * cfg.chunks
    rows: list[torch.Tensor] = []
    for m, (n, k, _r) in enumerate(table.shapes):
        r0 = torch.arange(0, n, span, dtype=torch.int32)
        c0 = torch.arange(0, k, cfg.block_n, dtype=torch.int32)
        grid = torch.stack(torch.meshgrid(r0, c0, indexing="ij"), -1).reshape(-1, 2)
        rows.append(torch.cat([torch.full((grid.shape[0], 1), m, dtype=torch.int32), grid], 1))
    tiles = torch.cat(rows).contiguous()
    if tiles.shape[0] >= 2**31:
        raise ValueError("too many weight tiles for one launch")
    plan = SwitchPlan(
        config=cfg,
        tiles=tiles.to(table.device),
        num_programs=int(tiles.shape[0]),
        even_rows=all(n % cfg.block_m == 0 for n, _, _ in table.shapes),
        even_cols=all(k % cfg.block_n == 0 for _, k, _ in table.shapes),
    )
    table.plans[cfg] = plan
    return plan
