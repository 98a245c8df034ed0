"""Plain-torch twins of the Triton kernels.

Each ``<op>_ref`` has the same signature and contract as ``<op>`` in ``sgmm.py`` /
``sgmm_int4.py`` / ``fuse_kernels.py`` / ``layer_ops.py`` / ``paged_attention.py``.
Tests use them as the oracle; the worker runs them on CPU. They compute in fp32 and round the
way the kernels round: ``v`` is kept in fp32, cast to the weight dtype before the expand
matmul (the kernel feeds bf16/fp16 operands to the tensor cores), and the sum with ``out`` is
formed in fp32 and rounded once.

Importing this module does not import triton: the twins and their checks (``_validate.py``)
need torch alone, so a CPU worker runs them without a Triton install.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptermesh.kernels._validate import (
    MergeTableView,
    SgmmShapes,
    check_act_mul,
    check_expand,
    check_int4,
    check_meta,
    check_paged_attention,
    check_pair,
    check_rms_norm,
    check_rope_kv_write,
    check_shrink,
)
from adaptermesh.kernels.int4_quant import dequantize_int4
from adaptermesh.kernels.int4_weight import Int4Weight
from adaptermesh.kernels.meta import SegmentMeta

__all__ = [
    "act_mul_ref",
    "add_lora_int4_ref",
    "add_lora_ref",
    "fused_switch_ref",
    "gated_add_lora_ref",
    "paged_attention_ref",
    "rms_norm_ref",
    "rope_kv_write_ref",
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
# INT4 SGMM twin (sgmm_int4.py)
# ---------------------------------------------------------------------------------------------
def _slot_weight(q: Int4Weight, index: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Dequantised ``q[index]`` (leading indices only), rounded to ``dtype``, as fp32."""
    sub = q
    for i in index:
        sub = sub[i]
    return dequantize_int4(sub).to(dtype).float()


def add_lora_int4_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    qa: Int4Weight,
    qb: Sequence[Int4Weight],
    scales: torch.Tensor,
    ranks: torch.Tensor,
    meta: SegmentMeta,
    *,
    check_values: bool = True,
) -> None:
    """The twin of ``add_lora_int4``: dequantise the used slots (rounded to the activation
    dtype, as the kernels feed them), v in fp32 rounded to the activation dtype, the sum with
    ``out`` formed in fp32 and rounded once."""
    shapes = check_int4(out, x, qa, qb, scales, ranks, meta, check_values)
    starts = meta.seg_start.tolist()
    rank_list = ranks.tolist()
    scale_list = scales.tolist()
    dt = x.dtype
    for s in range(shapes.num_slots):
        a, b = starts[s], starts[s + 1]
        r = min(int(rank_list[s]), shapes.r_max)
        if b <= a or r == 0:
            continue
        idx = meta.sorted_tokens[a:b].long()
        xs = x.index_select(0, idx).float()
        for i in range(shapes.n_slices):
            w_a = _slot_weight(qa, (i, s), dt)[:r]
            vi = (xs @ w_a.T).to(dt).float()
            w_b = _slot_weight(qb[i], (s,), dt)[:, :r]
            off, n = shapes.out_offsets[i], shapes.out_sizes[i]
            cols = out[:, off : off + n]
            cols[idx] = (cols[idx].float() + (vi @ w_b.T) * scale_list[s]).to(out.dtype)


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
    table: MergeTableView,
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


# ---------------------------------------------------------------------------------------------
# Decoder-layer elementwise twins (layer_ops.py): residual add + RMSNorm, RoPE + paged KV write,
# gated activation. Their argument checks (_validate.py) are shared with the Triton launchers.
# ---------------------------------------------------------------------------------------------
def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], dtype of x
    eps: float,
    *,
    residual: torch.Tensor | None = None,  # [T, H], updated in place to x + residual
    out: torch.Tensor | None = None,  # [T, H]
    gemma: bool = False,
    extra: torch.Tensor | None = None,  # [T, H], added to x first; needs residual
) -> torch.Tensor:
    """y = weight * round(xf * rsqrt(mean(xf^2) + eps)), xf = float32 rows of x (or of h).

    The order of transformers' LlamaRMSNorm: normalise in fp32, round to the dtype, multiply by
    the weight with one rounding. ``gemma``: y = round((1 + weight) * normalised) in fp32.
    With ``residual``: h = round(x + residual) is stored into ``residual`` (the new residual
    stream) and normalised instead of x. ``extra`` (a term computed beside x, such as a LoRA
    delta): h = round(round(x + extra) + residual). Returns y (``out`` when given).
    """
    check_rms_norm(x, weight, eps, residual, out, extra)
    h = x if extra is None else torch.add(x, extra)
    if residual is not None:
        h = torch.add(h, residual)
        residual.copy_(h)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    # Gemma scales in fp32 and rounds once; Llama rounds, then multiplies in the dtype.
    y = ((1.0 + weight.float()) * normed).to(x.dtype) if gemma else weight * normed.to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def rope_kv_write_ref(
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], read only
    v: torch.Tensor,  # [T, Hkv, D], read only
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, rotary_dim]: cos | sin, fp32 or the dtype of q
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 flat slots, negative = no write
    *,
    rotary_dim: int | None = None,
) -> None:
    """RoPE (rotate_half) on q in place; rotated k and v into the paged caches at each slot.

    With r = rotary_dim, half = r // 2, c/s = the cos/sin halves of ``cos_sin_cache[pos]``:
    ``x[:half] <- x[:half]*c - x[half:r]*s``, ``x[half:r] <- x[half:r]*c + x[:half]*s``,
    dimensions past r unchanged. Each output is formed in fp32 from the dtype inputs and
    rounded once, as the kernel does (torch's per-op bf16 rounding can differ by one ulp; the
    kernel may contract a product and sum into one fma, which rarely moves the rounding by one
    ulp of the dtype). Slot s writes ``cache[s // block_size, s % block_size]``; slots outside
    [0, num_blocks * block_size) are not written and positions are clamped to the table, so no
    input addresses memory outside the tensors. k itself is not modified.
    """
    rot = check_rope_kv_write(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim
    )
    half = rot // 2
    pos = positions.clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.index_select(0, pos).float().unsqueeze(1)  # [T, 1, rot]
    cos, sin = cs[..., :half], cs[..., half:]

    def rotated(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:rot].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    k_new = rotated(k)
    if rot < k.shape[2]:
        k_new = torch.cat((k_new, k[..., rot:]), dim=-1)
    q[..., :rot] = rotated(q)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    keep = ((slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)).nonzero().squeeze(1)
    slots = slot_mapping.index_select(0, keep)
    where = (slots // block_size, slots % block_size)
    k_cache.index_put_(where, k_new.index_select(0, keep))
    v_cache.index_put_(where, v.index_select(0, keep))


def _activation_ref(act: str, g: torch.Tensor) -> torch.Tensor:
    fn = torch.nn.functional
    if act == "silu":
        return fn.silu(g)
    if act == "gelu":
        return fn.gelu(g)
    if act == "gelu_pytorch_tanh":
        return fn.gelu(g, approximate="tanh")
    return fn.relu(g)


def act_mul_ref(
    gu: torch.Tensor,  # [T, 2*I]: gate | up
    *,
    act: str = "silu",
    out: torch.Tensor | None = None,  # [T, I]
    extra: torch.Tensor | None = None,  # [T, 2*I]: of round(gu + extra)
) -> torch.Tensor:
    """act(gate) * up as [T, I] in gu's dtype: fp32 activation and product, rounded once.

    ``act``: silu, gelu (erf), gelu_pytorch_tanh (tanh approximation) or relu. The kernel's
    fp32 formulas agree with torch's fp32 functions to a few fp32 ulps.
    """
    inter = check_act_mul(gu, act, out, extra)
    if extra is not None:
        gu = torch.add(gu, extra)
    y = (_activation_ref(act, gu[:, :inter].float()) * gu[:, inter:].float()).to(gu.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ---------------------------------------------------------------------------------------------
# Paged attention twin (paged_attention.py)
# ---------------------------------------------------------------------------------------------
def paged_attention_ref(
    out: torch.Tensor,  # [T, Hq, D], written only for rows that belong to a sequence
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, 0 = padding sequence
    query_start: torch.Tensor,  # [S + 1] int32, non-decreasing
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    num_splits: int = 1,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    """Causal paged attention in fp32, one masked softmax per sequence; see paged_attention.py.

    ``num_splits`` and ``workspace`` only shape the kernel's schedule and are ignored here.
    The metadata is read on the host, so its values are checked too: a sequence may own at
    most ``max_query_len`` rows (the kernel's grid is sized by it) and no more rows than keys.
    """
    shapes = check_paged_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
        scale=scale, max_query_len=max_query_len, sliding_window=sliding_window,
        num_splits=num_splits, softcap=softcap,
    )  # fmt: skip
    lens = seq_lens.tolist()
    starts = query_start.tolist()
    bs, hkv, d = shapes.block_size, shapes.num_kv_heads, shapes.head_dim
    for s, seq_len in enumerate(lens):
        row, n = starts[s], starts[s + 1] - starts[s]
        if n < 0 or row < 0 or starts[s + 1] > shapes.num_tokens:
            raise ValueError(
                f"query_start must be non-decreasing within [0, T={shapes.num_tokens}], "
                f"got {starts[s]}, {starts[s + 1]} at sequence {s}"
            )
        if seq_len <= 0 or n == 0:
            continue
        if n > max_query_len:
            raise ValueError(f"sequence {s} owns {n} query rows, more than max_query_len")
        if n > seq_len or seq_len > shapes.max_blocks * bs:
            raise ValueError(
                f"seq_lens[{s}] = {seq_len} must be >= its {n} query rows and fit its "
                f"{shapes.max_blocks} blocks of {bs}"
            )
        # Keys from the first one any of the sequence's queries sees: blocks wholly before it
        # are not read, as in the kernel.
        first = 0 if sliding_window is None else max(0, seq_len - n - sliding_window + 1)
        b0 = first // bs
        blocks = block_tables[s, b0 : -(-seq_len // bs)].long()
        keys = slice(first - b0 * bs, seq_len - b0 * bs)
        k = k_cache.index_select(0, blocks).flatten(0, 1)[keys].float()  # [Lk, Hkv, D]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[keys].float()
        qs = q[row : row + n].float().view(n, hkv, -1, d)  # [n, Hkv, G, D]
        x = torch.einsum("nhgd,khd->hgnk", qs, k) * scale
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        key = torch.arange(first, seq_len, device=q.device)[None, :]
        seen = key <= pos
        if sliding_window is not None:
            seen &= key > pos - sliding_window
        p = torch.softmax(x.masked_fill(~seen, float("-inf")), dim=-1)
        o = torch.einsum("hgnk,khd->nhgd", p, v).reshape(n, -1, d)
        out[row : row + n] = o.to(out.dtype)
