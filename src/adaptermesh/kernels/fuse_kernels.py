# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""AdaFuse kernels and their launchers: token-level pre-gating, fused merge/switch, gated SGMM.

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
The launchers run on CUDA tensors (or under TRITON_INTERPRET=1) and run no argument checks:
the ops of ``dispatch.py`` check (``_validate.py``), pick this module or the torch twin
(``reference.py``) and keep the table's current selection. The tiling and the merge table are
``fuse_config.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._backend import dot_fp32
from adaptermesh.kernels._validate import check_router_experts
from adaptermesh.kernels.fuse_config import (
    DEFAULT_SWITCH_CONFIG,
    MergeTable,
    SwitchConfig,
    SwitchPlan,
    switch_plan,
)

__all__ = ["fused_switch", "gated_add_lora", "route", "switch_launch_args"]

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# Tile sizes. Router: 16 tokens x all experts (E <= 64) per program. The switch's tiling is a
# SwitchConfig (fuse_config.py), swept on the GPU by bench/bench_adafuse.py.
_ROUTER_BLOCK_T = 16
_ROUTER_BLOCK_H = 128
_GATED_BLOCK_K = 128
_GATED_BLOCK_N = 128


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


def route(
    h: torch.Tensor,  # [T, H] hidden states at the first layer
    weight: torch.Tensor,  # [E, H] router weight, dtype of h
    bias: torch.Tensor | None,  # [E] or None
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router launch: ``(expert_ids [T, k] int32, gates [T, k] fp32)``; see
    ``dispatch.route``."""
    t, hidden = h.shape
    e = weight.shape[0]
    check_router_experts(e)
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


def switch_launch_args(
    table: MergeTable, k_new: int, k_old: int, config: SwitchConfig | None = None
) -> tuple[SwitchPlan, dict[str, object]]:
    """The plan and the meta-parameters one ``fused_switch`` launch uses (bench and tests)."""
    cfg = config or DEFAULT_SWITCH_CONFIG
    plan = switch_plan(table, cfg)
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
    old_ids: torch.Tensor,  # [k'] int32
    old_gates: torch.Tensor,  # [k'] fp32
    config: SwitchConfig | None = None,
) -> None:
    """The switch launch (one over every target); see ``dispatch.fused_switch``."""
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


def gated_add_lora(
    out: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [E, r, K]
    lora_b: torch.Tensor,  # [E, N, r]
    expert_ids: torch.Tensor,  # [T, k] int32, -1 = none
    gates: torch.Tensor,  # [T, k] fp32
    scale: float,
) -> None:
    """The gated SGMM launches (shrink, expand); see ``dispatch.gated_add_lora``."""
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
