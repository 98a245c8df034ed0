# Triton kernels take untyped launch arguments; mypy checks the typed launchers below them.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Paged attention: causal (optionally sliding-window, soft-capped) GQA over a paged KV cache.

Maths, for sequence ``s`` with ``L = seq_lens[s]`` keys and ``n = query_start[s+1] -
query_start[s]`` query rows at positions ``p = L - n .. L - 1``, query head ``h`` and its kv
head ``h // G`` (``G = Hq // Hkv``)::

    keys(p)   = { j : max(0, p - W + 1) <= j <= p }           (W = sliding_window, or inf)
    x_j       = scale * q[t, h] . K[s, j, h // G]
    x_j       = c * tanh(x_j / c)                              (c = softcap, when set)
    out[t, h] = sum_j softmax_j(x)_j * V[s, j, h // G]         over j in keys(p)

where key ``j`` of sequence ``s`` lives at ``k_cache[block_tables[s, j // B], j % B]``
(``B = block_size``). Softmax runs online in fp32 (flash-attention style: running max ``m``,
running sum ``l``, unnormalised accumulator), with scores pre-multiplied by ``log2(e)`` so
each exponential is one ``exp2``. Rows of ``out`` that no sequence owns, and the rows of
padding sequences (``L = 0``), are never written. Block-table entries are read only for
blocks that hold a key some query sees, so entries past ``cdiv(L, B)`` and, with a window,
entries of blocks that slid out of every query's window may hold anything.

Two kernels, chosen on the host by ``max_query_len`` (never by device values):

- Decode (``max_query_len == 1``): one program per (sequence, kv head, key partition). It holds
  the ``G`` query heads that share the kv head, so every K/V byte is read once per kv head,
  and walks its partition BLOCK_N keys at a time through the block table. The heads are
  padded to 16 rows (a tensor-core tile needs M >= 16) so ``q . K`` and ``p . V`` are
  ``tl.dot``, MHA (G = 1) included: on an H200 that ran 2-10x faster than broadcast products
  reduced with ``tl.sum``, which remain selectable (``use_dot=False``, see the config notes).
  With ``num_splits > 1`` (split-KV, "flash-decoding") each partition writes its fp32
  ``(m, l, acc)`` to a workspace and a second small kernel merges the partitions:
  ``out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i`` with ``M = max_i m_i``; an
  empty partition has ``m = -inf, l = 0, acc = 0`` and weighs nothing.
- Prefill / mixed (``max_query_len > 1``): one program per (sequence, tile of BLOCK_Q query
  tokens, kv head), rows flattened to BLOCK_M = BLOCK_Q * pow2(G) (token-major, the G heads of
  a token adjacent) so both products are ``tl.dot``. Key tiles run from the first key the
  tile's earliest query can see to its last query's position; tiles every row sees in full
  skip the mask (a compile-time branch), so only the window edge and the causal diagonal pay
  for it. Sequences with n = 1 (decode rows of a chunked-prefill step) are ordinary one-token
  tiles. Programs whose tile starts past n exit at once.

The grid depends only on host integers (``S = block_tables.shape[0]``, ``max_query_len``,
``Hkv``, ``num_splits``) and the split-KV workspace is sized from shapes, so a launch needs
no host synchronisation and a captured CUDA graph replays any batch of the captured shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adaptermesh.kernels._validate import (
    PagedAttentionShapes,
    check_attention_config,
    check_attention_workspace,
    check_paged_attention,
)

__all__ = [
    "PagedAttentionConfig",
    "PagedAttentionShapes",
    "check_paged_attention",
    "decode_config",
    "decode_splits",
    "decode_workspace_numel",
    "paged_attention",
    "prefill_config",
]

_LOG2E = 1.4426950408889634
# Triton's grid axes 1 and 2 hold at most 65535 programs.
_MAX_GRID_YZ = 65535


# ---------------------------------------------------------------------------------------------
# Config space. Not yet swept on a GPU: the sizes follow from budgets on an H200 (132 SMs, 64K
# 32-bit registers and up to 227 KiB shared memory per SM, ~4.8 TB/s HBM), and a first check on
# one H200 (2026-12-02; triton 3.6, bf16, D = 128, block_size 16, CUDA-graph replay; a one-off
# script, not yet a bench/ program with a results JSON) picked between the candidates below.
# A sweep (bench/, as for sgmm.py) should replace these numbers.
# - Decode is bound by reading K/V once. Heads are padded to >= 16 rows and both products are
#   tl.dot: a 64-key tile of K and of V is 16 KiB each at D = 128, double-buffered 64 KiB of
#   shared memory, and the padded rows cost only tensor-core work, which decode has to spare.
#   The broadcast + tl.sum variant (use_dot=False: a [G, BLOCK_N, D] fp32 product in
#   registers) lost at every group size checked, us (K+V GB/s), best block_n of 16/32/64 for
#   it against tl.dot at block_n 32 / 64:
#     G=1  S=64 L=2048: 977 (2199) vs 540 / 494 (4345);  S=8 L=4096 2 splits: 302 vs 153 / 130
#     G=2  S=64 L=2048: 471 vs 147 / 129 (4159);  G=4 S=256 L=1024: 1585 vs 301 / 257 (4181)
#     G=8  S=64 L=2048: 1631 vs 150 / 130 (4132);  G=4 S=1 L=8192 16 splits: 82 vs 22 / 17
#   (device-to-device copy: ~4.3 TB/s), so block_n = 64. D = 256 halves it and doubles the warps.
#   The grid fills the GPU through num_splits (see decode_splits).
# - Prefill: BLOCK_M = 64 rows x BLOCK_N = 64 keys at D = 128 with 4 warps holds a 64x128 fp32
#   accumulator (64 registers a thread), the bf16 q tile (32) and the 64x64 scores (32), under
#   the 255-register limit; K and V tiles are staged through shared memory by the pipeliner
#   (2 stages: 64 KiB). D = 256 halves BLOCK_N and doubles the warps for the same per-thread
#   budget. Checked at G = 4 (Hq 32, Hkv 8), causal, TFLOP/s for S x n = 1 x 4096 / 4 x 1024:
#   64x64, 4 warps, 2 stages 290 / 232; 3 stages 239 / 192; 128x64, 8 warps 281 / 233;
#   128x32 or 64x32, 3 stages 238-248 / 204-209 (dense torch SDPA on the same shapes: 524 /
#   391). The gather through the block table cannot use TMA, so larger tiles gain little.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PagedAttentionConfig:
    block_n: int  # keys per inner step, gathered through the block table
    block_q: int = 1  # prefill only: query tokens per program (rows = block_q * pow2(G))
    use_dot: bool = True  # decode only: tl.dot over >= 16 head rows, else broadcast + tl.sum
    num_warps: int = 4
    num_stages: int = 2


_PREFILL_ROWS = 64


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(n, 1)))


def _block_d(head_dim: int) -> int:
    return max(16, _pow2(head_dim))


def decode_config(group: int, head_dim: int) -> PagedAttentionConfig:
    """The decode kernel's tiles for ``group`` query heads per kv head (see the notes above)."""
    rows, block_d = max(16, _pow2(group)), _block_d(head_dim)
    return PagedAttentionConfig(
        block_n=64 if block_d <= 128 else 32,
        num_warps=4 if rows * block_d <= 16 * 128 else 8,
    )


def prefill_config(group: int, head_dim: int) -> PagedAttentionConfig:
    """The prefill kernel's tiles: about 64 rows (tokens x heads of a group) by 64 keys."""
    block_g, block_d = _pow2(group), _block_d(head_dim)
    return PagedAttentionConfig(
        block_n=64 if block_d <= 128 else 32,
        block_q=max(1, _PREFILL_ROWS // block_g),
        num_warps=4 if block_d <= 128 else 8,
    )


# Split-KV heuristic for decode. Enough (sequence, kv head, partition) programs to give every
# SM at least two (one streams while the other waits on memory), partitions of at least 256
# keys (below that the partial write and the merge cost more than the parallelism gains), and
# at most 16 partitions (the merge reads every partition's D + 2 floats per head). Reasoned,
# not swept; in the H200 check above, G = 4 S = 8 L = 4096 took 47 us (2.9 TB/s) with the 5
# splits chosen here, and S = 1 L = 8192 17 us with 16. Short, few-sequence batches stay far
# from the bandwidth roof: each program's walk is a chain of dependent table -> K -> V loads.
_DECODE_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Key partitions per decode sequence for a batch whose longest context is ``max_seq_len``.

    Host-only arithmetic: a graph captured for a bucket of batch sizes can call it with the
    bucket's size and the model's context limit.
    """
    programs = num_seqs * num_kv_heads
    if programs <= 0 or max_seq_len <= 0:
        return 1
    fill = -(-(_DECODE_PROGRAMS_PER_SM * num_sms) // programs)
    by_length = max_seq_len // _MIN_KEYS_PER_SPLIT
    return max(1, min(fill, by_length, _MAX_SPLITS))


def decode_workspace_numel(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements the split-KV decode needs: (acc[D], m, l) per sequence, head, partition."""
    return num_seqs * num_q_heads * num_splits * (head_dim + 2)


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    # From exp2 of a non-positive argument: never overflows, exact sign, ~1 ulp absolute.
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _log2_scores(raw, qk_scale, cap_out, HAS_SOFTCAP: tl.constexpr):
    """Scores in the exp2 domain: log2(e) * (scale * raw), soft-capped when asked."""
    if HAS_SOFTCAP:
        # qk_scale = scale / softcap, cap_out = softcap * log2(e)
        return cap_out * _tanh(raw * qk_scale)
    else:
        # qk_scale = scale * log2(e)
        return raw * qk_scale


@triton.jit
def _locate_keys(bt_row_ptr, offs_n, mask_n, PAGE: tl.constexpr):
    """(physical block, slot in block) of keys ``offs_n``, int64; masked keys read no entry."""
    blk = tl.load(bt_row_ptr + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
    return blk, (offs_n % PAGE).to(tl.int64)


@triton.jit
def _decode_kernel(
    # pointers
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    query_start_ptr,
    ws_ptr,  # [S, Hq, SPLITS, D + 2] fp32: acc[D], m, l per partition (SPLITS > 1 only)
    # sizes and scalars
    head_dim,
    num_q_heads,
    window,
    qk_scale,
    cap_out,
    # strides
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    # meta-parameters
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_row
    if (seq_len <= 0) | (n_q <= 0):
        return
    # The sequence's first query row; with n_q == 1 (the contract here) its position is L - 1.
    pos = seq_len - n_q
    k_hi = pos + 1
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(pos - window + 1, 0)
    # This partition's key tiles: a contiguous share of the tiles that cover [k_lo, k_hi).
    t_lo = k_lo // BLOCK_N
    t_hi = (k_hi + BLOCK_N - 1) // BLOCK_N
    per_split = (t_hi - t_lo + SPLITS - 1) // SPLITS
    t_begin = t_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, t_hi)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    heads = kvh * GROUP + offs_g
    q_ptrs = q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32 or not USE_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + seq * stride_bts

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= k_lo) & (offs_n < k_hi)
        mask_nd = mask_n[:, None] & mask_d[None, :]
        blk, slot = _locate_keys(bt_row, offs_n, mask_n, PAGE)
        k_rows = blk * stride_kb + slot * stride_kt
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        if USE_DOT:
            if DOT_FP32:
                raw = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                raw = tl.dot(q, tl.trans(k))
        else:
            raw = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        x = _log2_scores(raw, qk_scale, cap_out, HAS_SOFTCAP)
        x = tl.where(mask_n[None, :], x, float("-inf"))
        # Every tile of the range holds a visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(x - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = blk * stride_vb + slot * stride_vt
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        if USE_DOT:
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    mask_gd = mask_g[:, None] & mask_d[None, :]
    if SPLITS == 1:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        # Partials of an empty partition stay (-inf, 0, 0) and weigh nothing in the merge.
        rec = ((seq * num_q_heads + heads) * SPLITS + split) * (head_dim + 2)
        tl.store(ws_ptr + rec[:, None] + offs_d[None, :], acc, mask=mask_gd)
        tl.store(ws_ptr + rec + head_dim, m_i, mask=mask_g)
        tl.store(ws_ptr + rec + head_dim + 1, l_i, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    # pointers
    out_ptr,
    ws_ptr,  # [S, Hq, SPLITS, D + 2] fp32 from _decode_kernel
    seq_lens_ptr,
    query_start_ptr,
    # sizes
    head_dim,
    num_q_heads,
    # strides
    stride_ot,
    stride_oh,
    # meta-parameters
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_row
    if (seq_len <= 0) | (n_q <= 0):
        return  # the decode kernel wrote no partials for it either
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < SPLITS
    mask_d = offs_d < head_dim
    rec = ((seq * num_q_heads + head) * SPLITS + offs_s) * (head_dim + 2)
    m_part = tl.load(ws_ptr + rec + head_dim, mask=mask_s, other=float("-inf"))
    l_part = tl.load(ws_ptr + rec + head_dim + 1, mask=mask_s, other=0.0)
    acc = tl.load(
        ws_ptr + rec[:, None] + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )
    # At least one partition holds the query's own key, so m_max is finite.
    m_max = tl.max(m_part, axis=0)
    w = tl.exp2(m_part - m_max)  # 0 for empty partitions and masked lanes (m = -inf)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_part, axis=0)
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _prefill_tile(
    acc,
    m_i,
    l_i,
    q,
    t,
    pos,
    window,
    k_lo,
    k_hi,
    k_base,
    v_base,
    bt_row,
    offs_d,
    mask_d,
    qk_scale,
    cap_out,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One online-softmax step over key tile ``t``; MASKED=False for tiles every row sees."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n >= k_lo) & (offs_n < k_hi) if MASKED else offs_n >= 0
    mask_nd = mask_n[:, None] & mask_d[None, :]
    blk, slot = _locate_keys(bt_row, offs_n, mask_n, PAGE)
    k_rows = blk * stride_kb + slot * stride_kt
    k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
    if DOT_FP32:
        raw = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        raw = tl.dot(q, tl.trans(k))
    x = _log2_scores(raw, qk_scale, cap_out, HAS_SOFTCAP)
    if MASKED:
        seen = offs_n[None, :] <= pos[:, None]
        if HAS_WINDOW:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
        x = tl.where(seen, x, float("-inf"))
        # A row may see none of a boundary tile's keys (yet); keep its running values finite.
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(x - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = blk * stride_vb + slot * stride_vt
    v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    # pointers
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    query_start_ptr,
    # sizes and scalars
    head_dim,
    window,
    qk_scale,
    cap_out,
    # strides
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    # meta-parameters
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    # Highest query tiles (the most keys) first, so the longest programs do not trail.
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_begin
    q_first = q_tile * BLOCK_Q
    if (seq_len <= 0) | (q_first >= n_q):
        return
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    qi = q_first + offs_m // BLOCK_G  # query index within the sequence
    g = offs_m % BLOCK_G
    mask_m = (qi < n_q) & (g < GROUP)
    pos = seq_len - n_q + qi
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    rows = (q_begin + qi).to(tl.int64)
    heads = kvh * GROUP + g
    q_ptrs = q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Positions of the tile's first and last real query, and the keys any of them sees.
    p_lo = seq_len - n_q + q_first
    p_hi = seq_len - n_q + tl.minimum(q_first + BLOCK_Q, n_q) - 1
    k_hi = p_hi + 1
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(p_lo - window + 1, 0)
    t_lo = k_lo // BLOCK_N
    t_hi = (k_hi + BLOCK_N - 1) // BLOCK_N
    # Tiles [t_full_lo, t_full_hi) are seen in full by every row: each key is <= p_lo (causal)
    # and > p_hi - window (window). Operands of // stay non-negative (C and numpy agree).
    t_full_hi = (p_lo + 1) // BLOCK_N
    t_full_lo = t_lo
    if HAS_WINDOW:
        t_full_lo = (tl.maximum(p_hi - window + 1, 0) + BLOCK_N - 1) // BLOCK_N
    t_full_lo = tl.minimum(tl.maximum(t_full_lo, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(t_full_hi, t_full_lo), t_hi)

    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + seq * stride_bts
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in range(t_lo, t_full_lo):  # window edge
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, t, pos, window, k_lo, k_hi, k_base, v_base, bt_row, offs_d, mask_d,
            qk_scale, cap_out, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_N, PAGE, True, DOT_FP32, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    for t in range(t_full_lo, t_full_hi):  # interior: no mask
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, t, pos, window, k_lo, k_hi, k_base, v_base, bt_row, offs_d, mask_d,
            qk_scale, cap_out, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_N, PAGE, False, DOT_FP32, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    for t in range(t_full_hi, t_hi):  # causal diagonal
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, t, pos, window, k_lo, k_hi, k_base, v_base, bt_row, offs_d, mask_d,
            qk_scale, cap_out, stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_N, PAGE, True, DOT_FP32, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    # Every real row sees its own key; padded rows may have l = 0 and are not stored.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ---------------------------------------------------------------------------------------------
# Launcher (argument checks: _validate.check_paged_attention, check_attention_config and
# check_attention_workspace)
# ---------------------------------------------------------------------------------------------
def _dot_fp32(q: torch.Tensor) -> bool:
    """Whether tl.dot takes fp32 operands at IEEE precision.

    fp32 inputs get fp32 products instead of tf32. CPU tensors reach the kernels only under
    TRITON_INTERPRET=1, whose bf16 tl.dot is wrong; upcasting is exact (fp16 and bf16 embed in
    fp32), so the maths is unchanged.
    """
    return q.dtype == torch.float32 or not q.is_cuda


def _score_scalars(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_out) for _log2_scores."""
    if softcap is None:
        return scale * _LOG2E, 1.0
    return scale / softcap, softcap * _LOG2E


def paged_attention(
    out: torch.Tensor,  # [T, Hq, D], written only for rows that belong to a sequence
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous (a view of a fused qkv is fine)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dtype of q
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dtype of q
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, 0 = padding sequence
    query_start: torch.Tensor,  # [S + 1] int32, non-decreasing
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    num_splits: int = 1,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,  # fp32, >= decode_workspace_numel(...) elements
    config: PagedAttentionConfig | None = None,
) -> None:
    """Causal paged attention of each sequence's last ``n_s`` positions; see the module notes.

    ``max_query_len == 1`` runs the decode kernel (``num_splits`` key partitions a sequence,
    merged by a second launch when > 1); larger values run the prefill kernel, which also
    serves sequences with a single query row, and ignore ``num_splits``. Sequences must own
    at most ``max_query_len`` rows: the grid is sized by it and further rows are not written.
    ``workspace`` holds the split-KV partials (allocated per call from shapes when None).
    """
    shapes = check_paged_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
        scale=scale, max_query_len=max_query_len, sliding_window=sliding_window,
        num_splits=num_splits, softcap=softcap,
    )  # fmt: skip
    if shapes.num_seqs == 0 or shapes.num_tokens == 0:
        return
    qk_scale, cap_out = _score_scalars(float(scale), softcap)
    group, block_g = shapes.group, _pow2(shapes.group)
    common = dict(
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_D=_block_d(shapes.head_dim),
        PAGE=shapes.block_size,
        DOT_FP32=_dot_fp32(q),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    strides = (
        *out.stride()[:2], *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
    )  # fmt: skip
    window = sliding_window or 0
    if max_query_len > 1:
        cfg = config or prefill_config(group, shapes.head_dim)
        check_attention_config(cfg, cfg.block_q * block_g, decode=False)
        q_tiles = int(triton.cdiv(max_query_len, cfg.block_q))
        if q_tiles > _MAX_GRID_YZ or shapes.num_kv_heads > _MAX_GRID_YZ:
            raise ValueError(
                f"max_query_len {max_query_len} needs {q_tiles} query tiles, more than "
                f"{_MAX_GRID_YZ} (or Hkv > {_MAX_GRID_YZ})"
            )
        _prefill_kernel[(shapes.num_seqs, q_tiles, shapes.num_kv_heads)](
            out, q, k_cache, v_cache, block_tables, seq_lens, query_start,
            shapes.head_dim, window, qk_scale, cap_out, *strides,
            BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip
        return

    cfg = config or decode_config(group, shapes.head_dim)
    rows = max(16, block_g) if cfg.use_dot else block_g
    check_attention_config(cfg, rows, decode=True)
    if shapes.num_kv_heads > _MAX_GRID_YZ or num_splits > _MAX_GRID_YZ:
        raise ValueError(f"Hkv and num_splits must be <= {_MAX_GRID_YZ}")
    # With one split the workspace pointer is never dereferenced (the stores compile out).
    ws = _workspace(workspace, shapes, num_splits, q.device) if num_splits > 1 else out
    _decode_kernel[(shapes.num_seqs, shapes.num_kv_heads, num_splits)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start, ws,
        shapes.head_dim, shapes.num_q_heads, window, qk_scale, cap_out, *strides,
        BLOCK_N=cfg.block_n, SPLITS=num_splits, USE_DOT=cfg.use_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **{**common, "BLOCK_G": rows},
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(shapes.num_seqs, shapes.num_q_heads)](
            out, ws, seq_lens, query_start, shapes.head_dim, shapes.num_q_heads,
            out.stride(0), out.stride(1),
            SPLITS=num_splits, BLOCK_S=_pow2(num_splits), BLOCK_D=_block_d(shapes.head_dim),
        )  # fmt: skip


def _workspace(
    buf: torch.Tensor | None, shapes: PagedAttentionShapes, num_splits: int, device: torch.device
) -> torch.Tensor:
    need = decode_workspace_numel(shapes.num_seqs, shapes.num_q_heads, shapes.head_dim, num_splits)
    if buf is None:
        return torch.empty(need, dtype=torch.float32, device=device)
    return check_attention_workspace(buf, need, device)
