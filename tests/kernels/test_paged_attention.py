"""Paged attention kernels against their torch twin and an independent dense reference.

CPU (CI): the real Triton kernels under TRITON_INTERPRET=1 on tiny shapes, fp32 and fp16 (the
interpreter's bf16 tl.dot is wrong). Every case is built from fresh random K/V written into
shuffled physical blocks; free slots, unused blocks and the block every padding table entry
points at hold NaN, so a read the kernel should not make shows up in its output. ``out`` starts
as NaN: rows no sequence owns must stay NaN and every owned row must be written and finite.
The dense reference gathers nothing from the cache: it keeps each sequence's K/V as generated
and runs ``scaled_dot_product_attention`` (or an explicit softmax, with a softcap) in fp64.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.kernels import dispatch, reference
from adaptermesh.kernels.paged_attention import (
    PagedAttentionConfig,
    decode_config,
    decode_splits,
    decode_workspace_numel,
    prefill_config,
)
from adaptermesh.kernels.paged_attention import paged_attention as launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")
# (rtol, atol): outputs are convex combinations of N(0, 1) values, so O(1); fp16 outputs are
# rounded once (1 ulp at |x| < 2 is <= 2^-10).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 2e-2)}
# Small tiles so that short test sequences still span several key tiles and query tiles.
SMALL_DECODE_BCAST = PagedAttentionConfig(block_n=16, use_dot=False)
SMALL_DECODE_DOT = PagedAttentionConfig(block_n=16, use_dot=True)


def small_prefill(group: int) -> PagedAttentionConfig:
    """16 rows a program (the least tl.dot takes) and 16 keys a tile."""
    return PagedAttentionConfig(block_n=16, block_q=max(1, 16 // triton_pow2(group)))


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D], possibly a strided view
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, [L, Hkv, D] as generated (dense)
    values: list[torch.Tensor]
    lens: list[int]
    starts: list[int]
    window: int | None

    @property
    def owned(self) -> torch.Tensor:
        """[T] bool: rows a real (non-padding) sequence owns."""
        mask = torch.zeros(self.q.shape[0], dtype=torch.bool)
        for s, length in enumerate(self.lens):
            if length > 0:
                mask[self.starts[s] : self.starts[s + 1]] = True
        return mask


def make_case(
    lens: list[int],
    n_q: list[int],
    *,
    hkv: int,
    group: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    window: int | None = None,
    fused_q: bool = False,
    lead_rows: int = 2,
    tail_rows: int = 3,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * group
    starts = [lead_rows]
    for n in n_q:
        starts.append(starts[-1] + n)
    t = starts[-1] + tail_rows
    if fused_q:  # q as the first slice of a fused [T, (Hq + 2 Hkv) * D] projection
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
        q = qkv[:, : hq * d].view(t, hq, d)
    else:
        q = torch.randn(t, hq, d, generator=gen).to(DEVICE, dtype)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3  # block 0 (padding entries) and two never used
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, hkv, d), NAN, dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, hkv, d), NAN, dtype=dtype)
    max_blocks = max([*blocks_per_seq, 1]) + 1
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for s, length in enumerate(lens):
        k = torch.randn(length, hkv, d, generator=gen).to(dtype)
        v = torch.randn(length, hkv, d, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        for b in range(blocks_per_seq[s]):
            phys = physical.pop()
            tables[s, b] = phys
            chunk = slice(b * block_size, min(length, (b + 1) * block_size))
            n_rows = chunk.stop - chunk.start
            k_cache[phys, :n_rows] = k[chunk]
            v_cache[phys, :n_rows] = v[chunk]
        if window is not None and length > 0:
            # Blocks that slid out of every query's window may be freed: point them at block 0.
            first = max(0, length - n_q[s] - window + 1)
            tables[s, : first // block_size] = 0
    return Case(
        q,
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        keys,
        values,
        list(lens),
        starts,
        window,
    )


def dense_reference(case: Case, scale: float, softcap: float | None) -> torch.Tensor:
    """[T, Hq, D] fp64 from the dense per-sequence K/V; NaN where no sequence owns the row."""
    t, hq, d = case.q.shape
    want = torch.full((t, hq, d), NAN, dtype=torch.float64)
    q = case.q.detach().cpu().double()
    for s, length in enumerate(case.lens):
        row, end = case.starts[s], case.starts[s + 1]
        n = end - row
        if length == 0 or n == 0:
            continue
        group = hq // case.keys[s].shape[1]
        k = case.keys[s].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = case.values[s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[row:end].transpose(0, 1)  # [Hq, n, D]
        pos = torch.arange(length - n, length)[:, None]
        j = torch.arange(length)[None, :]
        seen = j <= pos
        if case.window is not None:
            seen &= j > pos - case.window
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=seen, scale=scale)
        else:
            x = softcap * torch.tanh(qs @ k.transpose(1, 2) * scale / softcap)
            o = torch.softmax(x.masked_fill(~seen, -math.inf), dim=-1) @ v
        want[row:end] = o.transpose(0, 1)
    return want


def run(
    case: Case,
    *,
    max_query_len: int,
    scale: float,
    softcap: float | None = None,
    num_splits: int = 1,
    config: PagedAttentionConfig | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel's output into a NaN-poisoned [T, Hq, D] tensor."""
    out = torch.full(case.q.shape, NAN, dtype=case.q.dtype, device=DEVICE)
    args = (out, case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    if config is None:  # the default tiles, through the dispatcher
        dispatch.paged_attention(
            *args, case.query_start, scale=scale, max_query_len=max_query_len,
            sliding_window=case.window, num_splits=num_splits, softcap=softcap,
            workspace=workspace, backend="triton",
        )  # fmt: skip
    else:
        launch(
            *args, case.query_start, scale=scale, max_query_len=max_query_len,
            sliding_window=case.window, num_splits=num_splits, softcap=softcap,
            workspace=workspace, config=config,
        )  # fmt: skip
    return out


def check(
    case: Case,
    got: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    softcap: float | None = None,
) -> None:
    """got == twin == dense on owned rows; unowned rows untouched (NaN) in got and twin."""
    dtype = case.q.dtype
    twin = torch.full(case.q.shape, NAN, dtype=dtype, device=DEVICE)
    reference.paged_attention_ref(
        twin,
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start,
        scale=scale,
        max_query_len=max_query_len,
        sliding_window=case.window,
        softcap=softcap,
    )
    dense = dense_reference(case, scale, softcap)
    got, twin = got.cpu(), twin.cpu()
    owned = case.owned
    assert bool(torch.isnan(got[~owned]).all()), "kernel wrote a row no sequence owns"
    assert bool(torch.isnan(twin[~owned]).all()), "twin wrote a row no sequence owns"
    assert bool(torch.isfinite(got[owned]).all()), "an owned row is unwritten or not finite"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got[owned], twin[owned], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[owned].double(), dense[owned], rtol=rtol, atol=atol)
    torch.testing.assert_close(twin[owned].double(), dense[owned], rtol=rtol, atol=atol)


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


BS = 8  # block size of most cases; lengths 1, BS, BS + 1, 2 BS, ... cover the page edges
DECODE_LENS = [1, BS, 0, BS + 1, 2 * BS, 37]  # 0: a padding sequence


# --------------------------------------------------------------------------------- decode
# (group, d, dtype, num_splits, window, softcap, config)
DECODE_CASES = [
    (1, 64, torch.float32, 1, None, None, SMALL_DECODE_BCAST),
    (1, 80, torch.float16, 2, None, None, SMALL_DECODE_BCAST),
    (2, 64, torch.float16, 3, 11, None, SMALL_DECODE_BCAST),
    (4, 80, torch.float32, 3, None, 5.0, SMALL_DECODE_DOT),
    (8, 64, torch.float16, 1, 9, 3.0, SMALL_DECODE_DOT),
    (8, 64, torch.float32, 2, None, None, SMALL_DECODE_BCAST),
    (2, 80, torch.float32, 2, 5, 2.0, None),  # the default tiles, through dispatch
    (4, 64, torch.float16, 3, None, None, None),
]


@pytest.mark.parametrize(
    ("group", "d", "dtype", "splits", "window", "softcap", "config"), DECODE_CASES
)
def test_decode_matches_twin_and_dense(
    group: int,
    d: int,
    dtype: torch.dtype,
    splits: int,
    window: int | None,
    softcap: float | None,
    config: PagedAttentionConfig | None,
) -> None:
    n_q = [1 if n else 0 for n in DECODE_LENS]
    n_q[2] = 1  # the padding sequence owns a row, which must stay untouched
    case = make_case(
        DECODE_LENS, n_q, hkv=2, group=group, d=d, block_size=BS, dtype=dtype,
        seed=_seed("decode", group, d, dtype, splits, window, softcap), window=window,
    )  # fmt: skip
    scale = d**-0.5
    got = run(case, max_query_len=1, scale=scale, softcap=softcap, num_splits=splits, config=config)
    check(case, got, max_query_len=1, scale=scale, softcap=softcap)


def test_decode_splits_agree_and_empty_partitions() -> None:
    """1, 2, 3 and 8 partitions give the same result; 8 partitions of a 1- or 9-key sequence
    are mostly empty. A sequence with keys but no query row writes nothing."""
    lens = [1, BS + 1, 40, 5]
    case = make_case(
        lens, [1, 1, 1, 0], hkv=1, group=2, d=64, block_size=BS, dtype=torch.float32,
        seed=_seed("splits"),
    )  # fmt: skip
    outs = [
        run(case, max_query_len=1, scale=0.2, num_splits=n, config=SMALL_DECODE_BCAST)
        for n in (1, 2, 3, 8)
    ]
    check(case, outs[0], max_query_len=1, scale=0.2)
    owned = case.owned
    for o in outs[1:]:
        assert bool(torch.isnan(o[~owned]).all())
        torch.testing.assert_close(o[owned], outs[0][owned], rtol=1e-6, atol=1e-6)


def test_decode_workspace_preallocated() -> None:
    case = make_case(
        [20, 3], [1, 1], hkv=1, group=1, d=64, block_size=16, dtype=torch.float32,
        seed=_seed("workspace"),
    )  # fmt: skip
    need = decode_workspace_numel(2, 1, 64, 2)
    ws = torch.full((need + 7,), NAN, dtype=torch.float32, device=DEVICE)
    got = run(case, max_query_len=1, scale=0.125, num_splits=2, workspace=ws)
    check(case, got, max_query_len=1, scale=0.125)
    with pytest.raises(ValueError, match="workspace"):
        run(case, max_query_len=1, scale=0.125, num_splits=2, workspace=ws[: need - 1])
    with pytest.raises(ValueError, match="workspace"):
        run(case, max_query_len=1, scale=0.125, num_splits=2, workspace=ws.double())


# -------------------------------------------------------------------------------- prefill
# (lens, n_q, group, d, dtype, block_size, window, softcap, config)
PREFILL_CASES = [
    # mixed step: decode rows (n = 1), whole prompts, a chunk, a padding sequence
    ([1, 17, 0, 24, 33], [1, 17, 3, 9, 1], 1, 64, torch.float32, 8, None, None, "small"),
    ([16, 9, 40], [16, 1, 21], 2, 80, torch.float16, 8, None, None, "small"),
    ([30, 8, 19], [30, 1, 6], 4, 64, torch.float32, 16, 7, None, "small"),
    ([25, 1, 34], [12, 1, 34], 8, 64, torch.float16, 8, 10, 4.0, "small"),
    ([9, 21], [9, 2], 2, 80, torch.float32, 8, None, 1.5, "small"),
    ([33, 2, 17], [33, 1, 5], 1, 80, torch.float16, 16, 12, None, None),  # default tiles
    ([18, 26], [18, 4], 4, 64, torch.float32, 8, None, None, None),
]


@pytest.mark.parametrize(
    ("lens", "n_q", "group", "d", "dtype", "block_size", "window", "softcap", "config"),
    PREFILL_CASES,
)
def test_prefill_matches_twin_and_dense(
    lens: list[int],
    n_q: list[int],
    group: int,
    d: int,
    dtype: torch.dtype,
    block_size: int,
    window: int | None,
    softcap: float | None,
    config: str | None,
) -> None:
    case = make_case(
        lens, n_q, hkv=2 if group < 8 else 1, group=group, d=d, block_size=block_size,
        dtype=dtype, seed=_seed("prefill", lens, n_q, group, d, dtype, window), window=window,
    )  # fmt: skip
    mql = max(n_q)
    cfg = small_prefill(group) if config == "small" else None
    scale = 1.3 * d**-0.5
    got = run(case, max_query_len=mql, scale=scale, softcap=softcap, config=cfg)
    check(case, got, max_query_len=mql, scale=scale, softcap=softcap)


@pytest.mark.parametrize("max_query_len", [1, 7])
def test_strided_q_from_fused_qkv(max_query_len: int) -> None:
    n_q = [1, max_query_len, 1] if max_query_len > 1 else [1, 1, 1]
    case = make_case(
        [12, 19, 8], n_q, hkv=2, group=2, d=80, block_size=8, dtype=torch.float16,
        seed=_seed("fused", max_query_len), fused_q=True,
    )  # fmt: skip
    assert not case.q.is_contiguous()
    cfg = small_prefill(2) if max_query_len > 1 else SMALL_DECODE_BCAST
    got = run(case, max_query_len=max_query_len, scale=0.1, num_splits=2, config=cfg)
    check(case, got, max_query_len=max_query_len, scale=0.1)


def test_default_backend_on_cpu_is_the_twin() -> None:
    case = make_case(
        [10, 3], [4, 1], hkv=1, group=2, d=64, block_size=8, dtype=torch.float32,
        seed=_seed("cpu"),
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start)
    got = torch.full(case.q.shape, NAN, device=DEVICE)
    dispatch.paged_attention(got, *args, scale=0.3, max_query_len=4)
    want = torch.full(case.q.shape, NAN, device=DEVICE)
    if DEVICE == "cpu":
        reference.paged_attention_ref(want, *args, scale=0.3, max_query_len=4)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    check(case, got, max_query_len=4, scale=0.3)


def test_nothing_to_do() -> None:
    """No sequences, or only padding ones: no launch, nothing written."""
    case = make_case(
        [0, 0], [2, 1], hkv=1, group=1, d=64, block_size=8, dtype=torch.float32, seed=1
    )
    for mql in (1, 2):
        got = run(case, max_query_len=mql, scale=0.5, num_splits=2)
        assert bool(torch.isnan(got).all())
    empty = torch.zeros(0, 1, 64, device=DEVICE)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    dispatch.paged_attention(
        empty, empty, case.k_cache, case.v_cache, tables,
        torch.zeros(0, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        scale=1.0, max_query_len=1, backend="triton",
    )  # fmt: skip


# ------------------------------------------------------------------------ property test
@dataclass
class Drawn:
    lens: list[int]
    n_q: list[int]
    decode: bool
    group: int
    block_size: int
    window: int | None
    softcap: float | None
    splits: int
    block_n: int
    use_dot: bool
    seed: int


@st.composite
def attention_cases(draw: st.DrawFn) -> Drawn:
    num_seqs = draw(st.integers(1, 3))
    decode = draw(st.booleans())
    lens = draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs))
    if decode:
        n_q = [1 if n else draw(st.integers(0, 1)) for n in lens]
    else:
        n_q = [draw(st.integers(1, n)) if n else draw(st.integers(0, 2)) for n in lens]
    return Drawn(
        lens=lens,
        n_q=n_q,
        decode=decode,
        group=draw(st.sampled_from([1, 2, 4, 8])),
        block_size=draw(st.sampled_from([8, 16, 32])),
        window=draw(st.none() | st.integers(1, 24)),
        softcap=draw(st.none() | st.floats(0.5, 8.0)),
        splits=draw(st.integers(1, 3)),
        block_n=draw(st.sampled_from([16, 32])),
        use_dot=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=15, deadline=None)
@given(attention_cases())
def test_property_kernel_twin_dense(c: Drawn) -> None:
    case = make_case(
        c.lens, c.n_q, hkv=1, group=c.group, d=64, block_size=c.block_size,
        dtype=torch.float32, seed=c.seed, window=c.window,
    )  # fmt: skip
    mql = 1 if c.decode else max([*c.n_q, 1])
    if mql == 1:
        cfg = PagedAttentionConfig(block_n=c.block_n, use_dot=c.use_dot)
    else:
        cfg = PagedAttentionConfig(block_n=c.block_n, block_q=max(1, 16 // triton_pow2(c.group)))
    got = run(
        case, max_query_len=mql, scale=0.125, softcap=c.softcap, num_splits=c.splits, config=cfg
    )
    check(case, got, max_query_len=mql, scale=0.125, softcap=c.softcap)


# ------------------------------------------------------------------------ host helpers
@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 512), st.integers(1, 64), st.integers(0, 1 << 17), st.sampled_from([1, 78, 132])
)
def test_decode_splits_heuristic(seqs: int, kv_heads: int, max_len: int, sms: int) -> None:
    n = decode_splits(seqs, kv_heads, max_len, num_sms=sms)
    assert 1 <= n <= 16
    if n > 1:
        assert max_len // n >= 256  # partitions of at least 256 keys
        # no more splits than it takes to reach two programs per SM
        assert seqs * kv_heads * (n - 1) < 2 * sms


def test_decode_splits_examples() -> None:
    assert decode_splits(1, 8, 32768) == 16  # one long request: as many splits as allowed
    assert decode_splits(32, 8, 4096) == 2
    assert decode_splits(64, 8, 4096) == 1  # 512 programs already fill 132 SMs
    assert decode_splits(4, 8, 300) == 1  # too short to split
    assert decode_splits(0, 8, 4096) == 1


def test_default_configs_are_valid() -> None:
    for group in (1, 2, 3, 4, 8, 16):
        for d in (64, 80, 96, 128, 256):
            dc = decode_config(group, d)
            assert dc.block_n >= 16
            pc = prefill_config(group, d)
            assert pc.block_q * triton_pow2(group) >= 16


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument() -> None:
    case = make_case([9], [1], hkv=2, group=2, d=64, block_size=8, dtype=torch.float32, seed=3)
    q, kc, vc = case.q, case.k_cache, case.v_cache
    bt, sl, qs = case.block_tables, case.seq_lens, case.query_start
    out = torch.empty_like(q)

    def call(**over: object) -> None:
        a: dict[str, object] = dict(
            out=out, q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=sl,
            query_start=qs, scale=0.1, max_query_len=1,
        )  # fmt: skip
        a.update(over)
        launch(**a)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="q must be 3-D"):
        call(q=q[0])
    with pytest.raises(ValueError, match="out must have"):
        call(out=out[:, :2])
    with pytest.raises(ValueError, match="out dtype"):
        call(out=out.half())
    with pytest.raises(ValueError, match="multiple of"):
        call(q=q[:, :3].contiguous(), out=out[:, :3].contiguous())
    with pytest.raises(ValueError, match="k_cache head dim"):
        call(k_cache=kc[..., :32], v_cache=vc[..., :32])
    with pytest.raises(ValueError, match="v_cache must have"):
        call(v_cache=vc[:-1])
    with pytest.raises(ValueError, match="q must have a contiguous last dim"):
        call(q=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(block_tables=bt.long())
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        call(seq_lens=sl.long())
    with pytest.raises(ValueError, match="query_start must have shape"):
        call(query_start=qs[:1])
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        call(k_cache=kc[:, :6], v_cache=vc[:, :6])
    with pytest.raises(ValueError, match="max_query_len"):
        call(max_query_len=0)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match="scale"):
        call(scale=float("nan"))
    with pytest.raises(ValueError, match=r"config\.block_n"):
        call(config=PagedAttentionConfig(block_n=24))
    with pytest.raises(ValueError, match=r"tl\.dot needs"):
        call(max_query_len=2, config=PagedAttentionConfig(block_n=16, block_q=2))


def test_twin_rejects_inconsistent_metadata() -> None:
    case = make_case(
        [9, 4], [3, 1], hkv=1, group=1, d=64, block_size=8, dtype=torch.float32, seed=4
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="more than max_query_len"):
        reference.paged_attention_ref(out, *args, case.query_start, scale=1.0, max_query_len=2)
    bad = case.query_start.clone()
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="non-decreasing"):
        reference.paged_attention_ref(out, *args, bad, scale=1.0, max_query_len=3)


# --------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("group", "d"), [(1, 128), (4, 128), (8, 64), (2, 80), (8, 256)])
def test_gpu_bf16(group: int, d: int) -> None:
    lens = [1, 16, 17, 300, 0, 1000, 77]
    for window in (None, 64):
        for mql, n_q in ((1, [1, 1, 1, 1, 1, 1, 1]), (96, [1, 16, 5, 96, 1, 1, 77])):
            case = make_case(
                lens, n_q, hkv=2, group=group, d=d, block_size=16, dtype=torch.bfloat16,
                seed=_seed("gpu", group, d, window, mql), window=window,
            )  # fmt: skip
            for splits in (1, 4) if mql == 1 else (1,):
                got = run(case, max_query_len=mql, scale=d**-0.5, num_splits=splits)
                check(case, got, max_query_len=mql, scale=d**-0.5)
