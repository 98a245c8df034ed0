# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""AdaFuse dynamic adapters: token-level pre-gating, fused merge/switch, gated SGMM.

Maths. ``E`` expert LoRAs per targeted module ``m`` (``A_m[e]: [r, K_m]``, ``B_m[e]: [N_m, r]``,
scale ``c_m``); a router picks, per token, ``k`` experts ``e_1..e_k`` with gates ``g_1..g_k``::

    router:        logits = h @ W_r.T (+ b);  (e, l) = topk(logits, k);  g = softmax(l)
    merged W_m:    W'_m = W_m + c_m * sum_j g_j * B_m[e_j] @ A_m[e_j]
    switch:        W''_m = W'_m - Delta(old selection) + Delta(new selection)
    gated SGMM:    y[t] += c_m * sum_j g[t, j] * (x[t] @ A_m[e_tj].T) @ B_m[e_tj].T

The router runs once, at the first layer, and its decision is reused by every layer. A batch of
one token (decode) merges its selection into the backbone with ONE launch over every targeted
module of every layer (``fused_switch``: a pointer table describes all modules and a launch
table gives each program its module and tile with one load). Larger batches keep the
backbone clean and add the gated low-rank terms per token (``gated_add_lora``).

No drift. In exact mode (default) each module keeps a pristine copy ``W0`` of its weight, and
a switch writes ``W = round(W0 + Delta_new)``: the old selection is removed exactly because
the sum is rebuilt from ``W0``, not subtracted in rounded arithmetic. Switching back to "no
experts" restores ``W0`` bit for bit after any number of switches. The switch reads ``W0`` and
writes ``W`` (the same bytes as an in-place ``W - Delta_old + Delta_new``), at the cost of one
more copy of the targeted weights in memory. Delta mode (``exact=False``) needs no copy and
computes ``round(W - Delta_old + Delta_new)`` in fp32 with one rounding per switch, so the
error is a rounding random walk; docs/kernels.md states its measured bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._backend import Backend, choose_backend, dot_fp32

__all__ = [
    "DEFAULT_SWITCH_CONFIG",
    "SWITCH_CANDIDATES",
    "MergeTable",
    "MergeTarget",
    "SwitchConfig",
    "SwitchPlan",
    "build_merge_table",
    "fused_merge",
    "fused_switch",
    "gated_add_lora",
    "route",
    "switch_launch_args",
]

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FLOAT_DTYPES = tuple(_TL_DTYPES)

# Tile sizes. Router: 16 tokens x all experts (E <= 64) per program. The switch's tiling is a
# SwitchConfig (below), swept on the GPU by bench/bench_adafuse.py.
_ROUTER_BLOCK_T = 16
_ROUTER_BLOCK_H = 128
_GATED_BLOCK_K = 128
_GATED_BLOCK_N = 128


def _check_float(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


# ---------------------------------------------------------------------------------------------
# Router: logits = h @ W.T + b, top-k, softmax over the k selected logits.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _router_kernel(
    # pointers
    h_ptr,
    w_ptr,
    b_ptr,
    ids_ptr,
    gates_ptr,
    # sizes
    T,
    H,
    E,
    # strides
    stride_ht,
    stride_hh,
    stride_we,
    stride_wh,
    # meta-parameters
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_H)):
        hh = k * BLOCK_H + offs_h
        mask_h = hh < H
        ht = tl.load(
            h_ptr + offs_t[:, None].to(tl.int64) * stride_ht + hh[None, :] * stride_hh,
            mask=mask_t[:, None] & mask_h[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_ptr + offs_e[None, :] * stride_we + hh[:, None] * stride_wh,
            mask=mask_e[None, :] & mask_h[:, None],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(ht.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(ht, wt)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    logits = tl.where(mask_e[None, :], acc, float("-inf"))
    offs_j = tl.arange(0, BLOCK_TOPK)
    sel_val = tl.full((BLOCK_T, BLOCK_TOPK), float("-inf"), dtype=tl.float32)
    sel_idx = tl.zeros((BLOCK_T, BLOCK_TOPK), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(logits, 1)
        # Lowest index among equal maxima, so ties resolve deterministically.
        idx = tl.min(tl.where(logits == best[:, None], offs_e[None, :], BLOCK_E), 1)
        sel_val = tl.where(offs_j[None, :] == j, best[:, None], sel_val)
        sel_idx = tl.where(offs_j[None, :] == j, idx[:, None], sel_idx)
        logits = tl.where(offs_e[None, :] == idx[:, None], float("-inf"), logits)
    top = tl.max(sel_val, 1)
    ex = tl.where(offs_j[None, :] < TOP_K, tl.exp(sel_val - top[:, None]), 0.0)
    gates = ex / tl.sum(ex, 1)[:, None]
    out_off = offs_t[:, None] * TOP_K + offs_j[None, :]
    out_mask = mask_t[:, None] & (offs_j[None, :] < TOP_K)
    tl.store(ids_ptr + out_off, sel_idx, mask=out_mask)
    tl.store(gates_ptr + out_off, gates, mask=out_mask)


def _check_route(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int):
    h = _check_float("h", h)
    weight = _check_float("weight", weight)
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [T, H], got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must be [E, {h.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != h.dtype or weight.device != h.device:
        raise ValueError(f"weight must be {h.dtype} on {h.device}")
    e = weight.shape[0]
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")
    if bias is not None:
        bias = _check_float("bias", bias)
        if bias.shape != (e,) or bias.device != h.device:
            raise ValueError(f"bias must be [{e}] on {h.device}, got {tuple(bias.shape)}")


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
    _check_route(h, weight, bias, top_k)
    if choose_backend(h, backend) == "torch":
        from adaptermesh.kernels.reference import route_ref

        return route_ref(h, weight, bias, top_k)
    t, hidden = h.shape
    e = weight.shape[0]
    if e > 64:
        raise ValueError(f"the Triton router supports up to 64 experts, got E={e}")
    ids = torch.empty(t, top_k, dtype=torch.int32, device=h.device)
    gates = torch.empty(t, top_k, dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(t, _ROUTER_BLOCK_T),)
    _router_kernel[grid](
        h,
        weight,
        bias if bias is not None else weight,
        ids,
        gates,
        t,
        hidden,
        e,
        h.stride(0),
        h.stride(1),
        weight.stride(0),
        weight.stride(1),
        TOP_K=top_k,
        HAS_BIAS=bias is not None,
        BLOCK_T=_ROUTER_BLOCK_T,
        BLOCK_E=max(16, triton.next_power_of_2(e)),
        BLOCK_H=_ROUTER_BLOCK_H,
        BLOCK_TOPK=max(2, triton.next_power_of_2(top_k)),
        DOT_FP32=dot_fp32(h.dtype),
    )
    return ids, gates


# ---------------------------------------------------------------------------------------------
# Fused merge / switch over every targeted module of every layer.
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
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.chunks < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad switch config {self}")

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
    if not targets:
        raise ValueError("targets must name at least one module")
    t0 = targets[0]
    dtype, device = t0.weight.dtype, t0.weight.device
    num_experts = t0.lora_a.shape[0] if t0.lora_a.dim() == 3 else -1
    dims: list[tuple[int, int, int]] = []
    r_max = 1
    for i, t in enumerate(targets):
        w, a, b = t.weight, t.lora_a, t.lora_b
        name = f"targets[{i}]"
        for what, x in (("weight", w), ("lora_a", a), ("lora_b", b)):
            _check_float(f"{name}.{what}", x)
            if x.dtype != dtype or x.device != device:
                raise ValueError(f"{name}.{what} must be {dtype} on {device}")
            if not x.is_contiguous():
                raise ValueError(f"{name}.{what} must be contiguous")
        if w.dim() != 2:
            raise ValueError(f"{name}.weight must be 2-D [N, K], got {tuple(w.shape)}")
        n, k = w.shape
        if a.dim() != 3 or a.shape[0] != num_experts or a.shape[2] != k:
            raise ValueError(f"{name}.lora_a must be [{num_experts}, r, {k}], got {tuple(a.shape)}")
        r = a.shape[1]
        if b.shape != (num_experts, n, r):
            raise ValueError(
                f"{name}.lora_b must be [{num_experts}, {n}, {r}], got {tuple(b.shape)}"
            )
        if r < 1 or r > 128:
            raise ValueError(f"{name} rank must be in [1, 128], got {r}")
        if exact:
            if t.master is None or t.master.shape != w.shape or t.master.dtype != dtype:
                raise ValueError(f"{name}.master must be a {dtype} copy of the weight (exact mode)")
            if t.master.device != device or not t.master.is_contiguous():
                raise ValueError(f"{name}.master must be contiguous on {device}")
        if max(w.numel(), a.numel(), b.numel()) >= 2**31:
            raise ValueError(f"{name}: tensors of 2^31 elements or more are not supported")
        r_max = max(r_max, r)
        dims.append((n, k, r))
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
        num_experts=num_experts,
        r_max=r_max,
        dtype=dtype,
        exact=exact,
        aligned=aligned,
        cur_ids=torch.full((1,), -1, dtype=torch.int32, device=device),
        cur_gates=torch.zeros(1, dtype=torch.float32, device=device),
    )


def _switch_plan(table: MergeTable, cfg: SwitchConfig) -> SwitchPlan:
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


@triton.jit
def _load_a(a_base, e, ok, K, R, offs_r, offs_n, EVEN_N: tl.constexpr):
    """A[e][:R, offs_n] as a [BLOCK_R, BLOCK_N] tile; zeros where ``ok`` is false (an absent
    expert reads no rows, so the mask stays constant along the contiguous columns)."""
    ptrs = a_base + e * R * K + offs_r[:, None] * K + offs_n[None, :]
    mask = offs_r[:, None] < tl.where(ok, R, 0)
    if not EVEN_N:
        mask = mask & (offs_n[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")


@triton.jit
def _gated_term(
    acc,
    b_base,
    e,
    ok,
    g,
    at,
    N,
    R,
    offs_m,
    offs_r,
    EVEN_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """acc += g * B_e[offs_m, :R] @ A_e[:R, cols] for one expert (``at`` already loaded)."""
    ptrs = b_base + e * N * R + offs_m[:, None] * R + offs_r[None, :]
    mask = offs_m[:, None] < tl.where(ok, N, 0)
    if not EVEN_R:
        mask = mask & (offs_r[None, :] < R)
    bt = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    if DOT_FP32:
        acc += g * tl.dot(bt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    else:
        acc += g * tl.dot(bt, at)
    return acc


@triton.jit
def _expert(ids_ptr, gates_ptr, j, NEG: tl.constexpr):
    """(id clamped to a valid expert, present?, gate or 0; negated for the old selection)."""
    e = tl.load(ids_ptr + j)
    ok = e >= 0
    g = tl.load(gates_ptr + j)
    if NEG:
        g = -g
    return tl.maximum(e, 0), ok, tl.where(ok, g, 0.0)


@triton.jit
def _fused_switch_kernel(
    # pointers: the program table, the per-module tables, then the two selections
    tiles_ptr,
    w_ptrs,
    src_ptrs,
    a_ptrs,
    b_ptrs,
    dims_ptr,
    scales_ptr,
    new_ids_ptr,
    new_gates_ptr,
    old_ids_ptr,
    old_gates_ptr,
    # meta-parameters
    DTYPE: tl.constexpr,
    NEW_K: tl.constexpr,
    OLD_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNKS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_R: tl.constexpr,
    ALIGNED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One program: columns [col0, col0 + BLOCK_N) x rows [row0, row0 + CHUNKS * BLOCK_M) of one
    module, walked down in chunks of BLOCK_M rows. W = round(src + scale * (Delta_new -
    Delta_old)), src = W0 (exact) or W (delta).

    The first two new experts' A columns are loaded once per program; each chunk reads only
    its B rows (BLOCK_R values a row) besides the weights. All offsets are int32
    (build_merge_table refuses tensors of 2^31 elements or more). With ALIGNED every base
    address is 16-byte aligned and every K a multiple of 8, so weight rows move in 16-byte
    vectors."""
    pid = tl.program_id(0)
    mod = tl.load(tiles_ptr + pid * 3)
    row0 = tl.load(tiles_ptr + pid * 3 + 1)
    col0 = tl.load(tiles_ptr + pid * 3 + 2)
    N = tl.load(dims_ptr + mod * 3)
    K = tl.load(dims_ptr + mod * 3 + 1)
    if EVEN_R:  # noqa: SIM108 (a constexpr branch)
        R = BLOCK_R
    else:
        R = tl.load(dims_ptr + mod * 3 + 2)
    scale = tl.load(scales_ptr + mod)
    w_base = tl.load(w_ptrs + mod).to(tl.pointer_type(DTYPE))
    src_base = tl.load(src_ptrs + mod).to(tl.pointer_type(DTYPE))
    a_base = tl.load(a_ptrs + mod).to(tl.pointer_type(DTYPE))
    b_base = tl.load(b_ptrs + mod).to(tl.pointer_type(DTYPE))
    offs_n = col0 + tl.arange(0, BLOCK_N)
    if ALIGNED:
        K = tl.multiple_of(K, 8)
        w_base = tl.multiple_of(w_base, 16)
        src_base = tl.multiple_of(src_base, 16)
        a_base = tl.multiple_of(a_base, 16)
        b_base = tl.multiple_of(b_base, 16)
        offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_M)

    # The selection's A columns for this program's band, loaded once for all its chunks.
    e0, ok0, g0 = _expert(new_ids_ptr, new_gates_ptr, 0, False)
    a0 = _load_a(a_base, e0, ok0, K, R, offs_r, offs_n, EVEN_N)
    if NEW_K > 1:
        e1, ok1, g1 = _expert(new_ids_ptr, new_gates_ptr, 1, False)
        a1 = _load_a(a_base, e1, ok1, K, R, offs_r, offs_n, EVEN_N)

    n_chunks = tl.minimum(CHUNKS, tl.cdiv(N - row0, BLOCK_M))
    for c in tl.range(0, n_chunks, num_stages=NUM_STAGES):
        offs_m = row0 + c * BLOCK_M + offs_c
        w_off = offs_m[:, None] * K + offs_n[None, :]
        # The streamed weights: read once, not kept in L2.
        if EVEN_M and EVEN_N:
            src = tl.load(src_base + w_off, eviction_policy="evict_first")
        else:
            wmask = (offs_m[:, None] < N) & (offs_n[None, :] < K)
            src = tl.load(src_base + w_off, mask=wmask, other=0.0, eviction_policy="evict_first")
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _gated_term(acc, b_base, e0, ok0, g0, a0, N, R, offs_m, offs_r,
                          EVEN_R, DOT_FP32)  # fmt: skip
        if NEW_K > 1:
            acc = _gated_term(acc, b_base, e1, ok1, g1, a1, N, R, offs_m, offs_r,
                              EVEN_R, DOT_FP32)  # fmt: skip
        for j in tl.static_range(2, NEW_K):  # k > 2: A re-read per chunk (cache hits)
            e, ok, g = _expert(new_ids_ptr, new_gates_ptr, j, False)
            at = _load_a(a_base, e, ok, K, R, offs_r, offs_n, EVEN_N)
            acc = _gated_term(acc, b_base, e, ok, g, at, N, R, offs_m, offs_r,
                              EVEN_R, DOT_FP32)  # fmt: skip
        # Delta mode: the old selection enters the same accumulator with negated gates (one
        # fp32 tile of registers, not two).
        for j in tl.static_range(OLD_K):
            e, ok, g = _expert(old_ids_ptr, old_gates_ptr, j, True)
            at = _load_a(a_base, e, ok, K, R, offs_r, offs_n, EVEN_N)
            acc = _gated_term(acc, b_base, e, ok, g, at, N, R, offs_m, offs_r,
                              EVEN_R, DOT_FP32)  # fmt: skip
        out = (src.to(tl.float32) + scale * acc).to(DTYPE)
        if EVEN_M and EVEN_N:
            tl.store(w_base + w_off, out, eviction_policy="evict_first")
        else:
            tl.store(w_base + w_off, out, mask=wmask, eviction_policy="evict_first")


def _check_selection(
    table: MergeTable, ids: torch.Tensor, gates: torch.Tensor, what: str, *, values: bool = True
) -> None:
    if not isinstance(ids, torch.Tensor) or not isinstance(gates, torch.Tensor):
        raise ValueError(f"{what} ids and gates must be tensors")
    if ids.dim() != 1 or ids.dtype != torch.int32 or ids.numel() < 1:
        raise ValueError(
            f"{what}_ids must be a non-empty 1-D int32 tensor [k], got {ids.dtype} {tuple(ids.shape)}"
        )
    if gates.shape != ids.shape or gates.dtype != torch.float32:
        raise ValueError(f"{what}_gates must be float32 of shape {tuple(ids.shape)}")
    if ids.device != table.device or gates.device != table.device:
        raise ValueError(f"{what} ids and gates must be on {table.device}")
    if not ids.is_contiguous() or not gates.is_contiguous():
        raise ValueError(f"{what} ids and gates must be contiguous")
    if values and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one read-back
        if lo < -1 or hi >= table.num_experts:
            raise ValueError(
                f"{what}_ids must lie in [-1, {table.num_experts}), got min {lo} max {hi}"
            )


def switch_launch_args(
    table: MergeTable, k_new: int, k_old: int, config: SwitchConfig | None = None
) -> tuple[SwitchPlan, dict[str, object]]:
    """The plan and the meta-parameters one ``fused_switch`` launch uses (bench and tests)."""
    cfg = config or DEFAULT_SWITCH_CONFIG
    plan = _switch_plan(table, cfg)
    block_r = max(16, triton.next_power_of_2(table.r_max))
    meta: dict[str, object] = {
        "DTYPE": _TL_DTYPES[table.dtype],
        "NEW_K": k_new,
        "OLD_K": 0 if table.exact else k_old,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_R": block_r,
        "CHUNKS": cfg.chunks,
        "NUM_STAGES": cfg.num_stages,
        "EVEN_M": plan.even_rows,
        "EVEN_N": plan.even_cols,
        "EVEN_R": all(r == block_r for _, _, r in table.shapes),
        "ALIGNED": table.aligned,
        "DOT_FP32": dot_fp32(table.dtype),
        "num_warps": cfg.num_warps,
    }
    return plan, meta


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
    if not isinstance(table, MergeTable):
        raise ValueError(f"table must be a MergeTable, got {type(table).__name__}")
    _check_selection(table, new_ids, new_gates, "new")
    if old_ids is None or old_gates is None:
        # The table's own selection was checked when it was merged.
        old_ids, old_gates = table.cur_ids, table.cur_gates
        _check_selection(table, old_ids, old_gates, "old", values=False)
    else:
        _check_selection(table, old_ids, old_gates, "old")
    if choose_backend(table.w_ptrs, backend) == "torch":
        from adaptermesh.kernels.reference import fused_switch_ref

        fused_switch_ref(table, new_ids, new_gates, old_ids=old_ids, old_gates=old_gates)
    else:
        plan, meta = switch_launch_args(table, new_ids.numel(), old_ids.numel(), config)
        _fused_switch_kernel[(plan.num_programs,)](
            plan.tiles,
            table.w_ptrs,
            table.src_ptrs,
            table.a_ptrs,
            table.b_ptrs,
            table.dims,
            table.scales,
            new_ids,
            new_gates,
            old_ids,
            old_gates,
            **meta,
        )
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


# ---------------------------------------------------------------------------------------------
# Gated SGMM: per-token experts for batches of more than one token.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _gated_shrink_kernel(
    # pointers
    x_ptr,
    a_ptr,
    ids_ptr,
    gates_ptr,
    v_ptr,
    # sizes
    K,
    R,
    # strides
    stride_xt,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + t * TOP_K + j)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    v_ptrs = v_ptr + (t * TOP_K + j) * BLOCK_R + offs_r
    if e < 0:  # no expert in this position: a zero row keeps the expand branch-free
        tl.store(v_ptrs, tl.zeros((BLOCK_R,), dtype=tl.float32))
        return
    g = tl.load(gates_ptr + t * TOP_K + j)
    offs_k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + e.to(tl.int64) * R * K + offs_r[:, None] * K
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k * BLOCK_K + offs_k
        mask_k = kk < K
        xv = tl.load(x_ptr + t * stride_xt + kk, mask=mask_k, other=0.0).to(tl.float32)
        at = tl.load(a_row + kk[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(at.to(tl.float32) * xv[None, :], 1)
    tl.store(v_ptrs, g * acc)


@triton.jit
def _gated_expand_kernel(
    # pointers
    out_ptr,
    v_ptr,
    b_ptr,
    ids_ptr,
    # sizes
    N,
    R,
    scale,
    # strides
    stride_ot,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        if e >= 0:
            vv = tl.load(v_ptr + (t * TOP_K + j) * BLOCK_R + offs_r)
            # v rounded to the weight dtype, as in the SGMM expand.
            bt = tl.load(
                b_ptr + e.to(tl.int64) * N * R + offs_n[:, None].to(tl.int64) * R + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )
            vq = vv.to(bt.dtype).to(tl.float32)
            acc += tl.sum(bt.to(tl.float32) * vq[None, :], 1)
    o_ptrs = out_ptr + t * stride_ot + offs_n
    o = tl.load(o_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (o + scale * acc).to(out_ptr.dtype.element_ty), mask=mask_n)


def _check_gated(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    expert_ids: torch.Tensor,
    gates: torch.Tensor,
    check_values: bool,
) -> None:
    for name, ten in (("out", out), ("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        _check_float(name, ten)
        if ten.dtype != x.dtype or ten.device != x.device:
            raise ValueError(
                f"{name} must be {x.dtype} on {x.device}, got {ten.dtype} on {ten.device}"
            )
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"x [T, K] and out [T, N] must agree on T, got {tuple(x.shape)} and {tuple(out.shape)}"
        )
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out need unit stride along their last dimension")
    t, k = x.shape
    n = out.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[2] != k or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be a contiguous [E, r, {k}], got {tuple(lora_a.shape)}")
    e, r, _ = lora_a.shape
    if lora_b.shape != (e, n, r) or not lora_b.is_contiguous():
        raise ValueError(f"lora_b must be a contiguous [{e}, {n}, {r}], got {tuple(lora_b.shape)}")
    if r > 128:
        raise ValueError(f"rank must be <= 128, got {r}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or expert_ids.dtype != torch.int32:
        raise ValueError(
            f"expert_ids must be int32 [{t}, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    if gates.shape != expert_ids.shape or gates.dtype != torch.float32:
        raise ValueError(f"gates must be float32 of shape {tuple(expert_ids.shape)}")
    if expert_ids.device != x.device or gates.device != x.device:
        raise ValueError(f"expert_ids and gates must be on {x.device}")
    if not expert_ids.is_contiguous() or not gates.is_contiguous():
        raise ValueError("expert_ids and gates must be contiguous")
    if (
        check_values
        and expert_ids.numel()
        and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < -1 or hi >= e:
            raise ValueError(f"expert_ids must lie in [-1, {e}), got min {lo} max {hi}")


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
    _check_gated(out, x, lora_a, lora_b, expert_ids, gates, check_values)
    if choose_backend(x, backend) == "torch":
        from adaptermesh.kernels.reference import gated_add_lora_ref

        gated_add_lora_ref(out, x, lora_a, lora_b, expert_ids, gates, scale)
        return
    t, k = x.shape
    n = out.shape[1]
    _, r, _ = lora_a.shape
    top_k = expert_ids.shape[1]
    if t == 0:
        return
    block_r = max(16, triton.next_power_of_2(r))
    v = torch.empty(t, top_k, block_r, dtype=torch.float32, device=x.device)
    _gated_shrink_kernel[(t, top_k)](
        x, lora_a, expert_ids, gates, v, k, r, x.stride(0),
        TOP_K=top_k, BLOCK_R=block_r, BLOCK_K=_GATED_BLOCK_K,
    )  # fmt: skip
    _gated_expand_kernel[(t, triton.cdiv(n, _GATED_BLOCK_N))](
        out, v, lora_b, expert_ids, n, r, float(scale), out.stride(0),
        TOP_K=top_k, BLOCK_R=block_r, BLOCK_N=_GATED_BLOCK_N,
    )  # fmt: skip
