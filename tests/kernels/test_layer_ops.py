"""Fused decoder-layer ops (layer_ops.py) against their torch twins and plain-torch formulas.

Every check runs the Triton kernel (``backend="triton"``: the interpreter on CPU), the twin in
``reference.py``, and an independent formula written out here: transformers' LlamaRMSNorm,
Hugging Face's ``rotate_half`` RoPE, ``torch.nn.functional`` activations. CPU: fp32 and fp16 on
small ragged shapes. ``gpu``: bf16, Llama-sized shapes, offsets past 2^31, CUDA-graph capture.
"""

from __future__ import annotations

import zlib
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.kernels import dispatch, reference
from adaptermesh.kernels.dispatch import Backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
CPU_DTYPES = (torch.float32, torch.float16)
# Kernel vs twin vs formula, elementwise (rtol, atol) on O(1) outputs: a few fp32 ulps for fp32;
# for fp16/bf16 one ulp of the dtype, where an fp32 result that differs in its last bits (sum
# order, rsqrt, exp) rounds to the neighbouring value.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _ops() -> ModuleType:
    from adaptermesh.kernels import layer_ops

    return layer_ops


def _gen(*key: object) -> torch.Generator:
    """A generator seeded from the case's parameters, the same in every process."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, **kw: Any) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, **kw)


# ------------------------------------------------------------------------------ formulas
def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, line for line."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_formula(
    x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rot: int
) -> torch.Tensor:
    """Hugging Face apply_rotary_pos_emb on the first ``rot`` dims, in fp32, rounded once."""
    half = rot // 2
    c, s = table[positions, :half].float(), table[positions, half:].float()
    cos = torch.cat((c, c), dim=-1).unsqueeze(1)
    sin = torch.cat((s, s), dim=-1).unsqueeze(1)
    xr = x[..., :rot].float()
    out = (xr * cos + rotate_half(xr) * sin).to(x.dtype)
    return torch.cat((out, x[..., rot:]), dim=-1)


def act_formula(act: str, gu: torch.Tensor) -> torch.Tensor:
    inter = gu.shape[1] // 2
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    fns = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "relu": F.relu,
    }
    return (fns[act](g) * u).to(gu.dtype)


def cos_sin_table(max_pos: int, rot: int, dtype: torch.dtype) -> torch.Tensor:
    """Llama's [max_pos, rot] cos | sin table, with an attention factor folded in."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * 1.1).to(device=DEVICE, dtype=dtype)


# ------------------------------------------------------------------------------ rms_norm
def check_rms_norm(
    t: int,
    h: int,
    dtype: torch.dtype,
    *,
    gemma: bool = False,
    block_h: int | None = None,
    row_pad: int = 3,
    seed: object = 0,
) -> None:
    """Plain and residual forms: kernel vs twin vs the formula; the residual stream exactly."""
    gen = _gen("rms", t, h, dtype, gemma, block_h, row_pad, seed)
    x = _randn(gen, t, h + row_pad, dtype=dtype)[:, row_pad:]  # strided rows, offset start
    w = (_randn(gen, h, dtype=torch.float32) * 0.5 + 1.0).to(dtype)
    res0 = _randn(gen, t, h, dtype=dtype)
    formula = gemma_rms_norm if gemma else llama_rms_norm

    def kernel(**kw: Any) -> torch.Tensor:
        if block_h is None:
            return dispatch.rms_norm(x, w, EPS, gemma=gemma, backend="triton", **kw)
        out: torch.Tensor = _ops().rms_norm(x, w, EPS, gemma=gemma, block_h=block_h, **kw)
        return out

    got = kernel()
    twin = reference.rms_norm_ref(x, w, EPS, gemma=gemma)
    assert got.dtype == dtype
    assert got.shape == (t, h)
    assert torch.equal(twin, formula(x, w, EPS))
    _close(got, twin, dtype)

    res_k, res_t = res0.clone(), res0.clone()
    got = kernel(residual=res_k)
    twin = reference.rms_norm_ref(x, w, EPS, residual=res_t, gemma=gemma)
    h_new = x + res0  # torch's own add, rounded once to the dtype
    assert torch.equal(res_k, h_new)
    assert torch.equal(res_t, h_new)
    assert torch.equal(twin, formula(h_new, w, EPS))
    _close(got, twin, dtype)

    # A term computed beside x (the engine's LoRA delta), strided: round(round(x + e) + r).
    ext = _randn(gen, t, h + 1, dtype=dtype)[:, 1:]
    res_k, res_t = res0.clone(), res0.clone()
    got = kernel(residual=res_k, extra=ext)
    twin = reference.rms_norm_ref(x, w, EPS, residual=res_t, gemma=gemma, extra=ext)
    h_new = (x + ext) + res0
    assert torch.equal(res_k, h_new)
    assert torch.equal(res_t, h_new)
    assert torch.equal(twin, formula(h_new, w, EPS))
    _close(got, twin, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("h", [1, 7, 65, 200])
def test_rms_norm_matches_twin_and_llama_formula(dtype: torch.dtype, h: int) -> None:
    for t in (1, 3, 17):
        check_rms_norm(t, h, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("h", "block_h"), [(7, 16), (65, 16), (200, 64)])
def test_rms_norm_chunked_rows(dtype: torch.dtype, h: int, block_h: int) -> None:
    """Rows wider than the block take the two-pass loop (ragged last chunk)."""
    for t in (1, 3):
        check_rms_norm(t, h, dtype, block_h=block_h)
        check_rms_norm(t, h, dtype, block_h=block_h, gemma=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_gemma(dtype: torch.dtype) -> None:
    for t, h in ((1, 1), (3, 65), (17, 7)):
        check_rms_norm(t, h, dtype, gemma=True)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rms_norm_out_argument(impl: Backend) -> None:
    gen = _gen("rms-out", impl)
    x = _randn(gen, 5, 33, dtype=torch.float32)
    w = _randn(gen, 33, dtype=torch.float32)
    res = _randn(gen, 5, 33, dtype=torch.float32)
    want_h = x + res
    want = llama_rms_norm(want_h, w, EPS)
    # out with its own row stride
    out = torch.full((5, 40), float("nan"), device=DEVICE)[:, 3:36]
    got = dispatch.rms_norm(x, w, EPS, residual=res, out=out, backend=impl)
    assert got is out
    _close(out, want, torch.float32)
    assert torch.equal(res, want_h)
    # out may be x itself: the row is read before it is overwritten
    x2 = x.clone()
    got = dispatch.rms_norm(x2, w, EPS, out=x2, backend=impl)
    assert got is x2
    _close(x2, llama_rms_norm(x, w, EPS), torch.float32)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 9),
    h=st.integers(1, 300),
    dtype=st.sampled_from(CPU_DTYPES),
    gemma=st.booleans(),
    block_h=st.sampled_from([None, 16, 64]),
    row_pad=st.integers(0, 3),
    seed=st.integers(0, 1 << 16),
)
def test_rms_norm_property(
    t: int,
    h: int,
    dtype: torch.dtype,
    gemma: bool,
    block_h: int | None,
    row_pad: int,
    seed: int,
) -> None:
    check_rms_norm(t, h, dtype, gemma=gemma, block_h=block_h, row_pad=row_pad, seed=seed)


# ------------------------------------------------------------------------------ rope_kv_write
def check_rope(
    t: int,
    hq: int,
    hkv: int,
    d: int,
    rot: int,
    dtype: torch.dtype,
    *,
    table_dtype: torch.dtype | None = None,
    num_blocks: int = 5,
    block_size: int = 4,
    n_skip: int = 1,
    transposed_cache: bool = False,
    heads_per_tile: int | None = None,
    seed: object = 0,
) -> None:
    """q in place, k/v read only, addressed cache slots written, every other slot untouched."""
    gen = _gen("rope", t, hq, hkv, d, rot, dtype, table_dtype, n_skip, heads_per_tile, seed)
    max_pos = 64
    width = (hq + 2 * hkv) * d
    qkv = _randn(gen, t, width, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    table = cos_sin_table(max_pos, rot, table_dtype or dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEVICE)
    n_slots = num_blocks * block_size
    slots = torch.randperm(max(n_slots, t), generator=gen)[:t]
    slots = torch.where(slots < n_slots, slots, -1)  # more tokens than slots: extra rows pad
    skip = torch.randperm(t, generator=gen)[: min(n_skip, t)]
    slots[skip] = -torch.randint(1, 5, (len(skip),), generator=gen)
    slots = slots.to(DEVICE)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (
            (num_blocks, hkv, block_size, d)
            if transposed_cache
            else (num_blocks, block_size, hkv, d)
        )
        kc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        vc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        if transposed_cache:  # [blocks, heads, slots, D] storage seen as [blocks, slots, heads, D]
            return kc.transpose(1, 2), vc.transpose(1, 2)
        return kc, vc

    before = qkv.clone()
    q0, k0, v0 = (z.clone() for z in (q, k, v))
    kc, vc = caches()
    if heads_per_tile is None:
        dispatch.rope_kv_write(
            q, k, v, positions, table, kc, vc, slots, rotary_dim=rot, backend="triton"
        )
    else:
        _ops().rope_kv_write(
            q, k, v, positions, table, kc, vc, slots, rotary_dim=rot, heads_per_tile=heads_per_tile
        )

    # Twin on a copy of the fused tensor.
    qkv_t = before.clone()
    q_t = qkv_t[:, : hq * d].view(t, hq, d)
    kc_t, vc_t = caches()
    reference.rope_kv_write_ref(q_t, k0, v0, positions, table, kc_t, vc_t, slots, rotary_dim=rot)
    _close(qkv, qkv_t, dtype)
    _close(kc, kc_t, dtype, equal_nan=True)
    _close(vc, vc_t, dtype, equal_nan=True)

    # Formula: q rotated in place; k and v untouched in the fused tensor.
    _close(q, rope_formula(q0, positions, table, rot), dtype)
    assert torch.equal(qkv[:, hq * d :], before[:, hq * d :])
    valid = slots >= 0
    blk, off = slots[valid] // block_size, slots[valid] % block_size
    _close(kc[blk, off], rope_formula(k0, positions, table, rot)[valid], dtype)
    assert torch.equal(vc[blk, off], v0[valid])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    written[blk, off] = True
    for cache in (kc, vc, kc_t, vc_t):
        assert bool(cache[~written].isnan().all())
        assert not bool(cache[written].isnan().any())


ROPE_CASES = [
    # (hq, hkv, d, rotary_dim)
    (4, 2, 8, 8),  # GQA
    (3, 3, 16, 6),  # partial rotary
    (6, 1, 10, 10),  # MQA, head_dim not a power of two
    (2, 1, 12, 4),  # partial, GQA
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d", "rot"), ROPE_CASES)
def test_rope_kv_write_matches_twin_and_rotate_half(
    dtype: torch.dtype, hq: int, hkv: int, d: int, rot: int
) -> None:
    for t in (1, 3, 17):
        # fp32 table for fp16 activations, a dtype table otherwise
        table_dtype = torch.float32 if t == 3 else dtype
        check_rope(t, hq, hkv, d, rot, dtype, table_dtype=table_dtype, n_skip=1 + t // 5)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_kv_write_strided_cache_and_small_tiles(dtype: torch.dtype) -> None:
    """A cache whose head and slot strides are swapped, and heads split over several tiles."""
    check_rope(3, 5, 3, 8, 8, dtype, transposed_cache=True, heads_per_tile=2)
    check_rope(17, 4, 2, 12, 6, dtype, heads_per_tile=1, n_skip=4)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rope_kv_write_out_of_range_slots_and_positions(impl: Backend) -> None:
    """Slots past the cache are not written; positions are clamped to the table."""
    gen = _gen("rope-range", impl)
    t, h, d, nb, bs = 4, 2, 4, 2, 2
    q = _randn(gen, t, h, d, dtype=torch.float32)
    k = _randn(gen, t, h, d, dtype=torch.float32)
    v = _randn(gen, t, h, d, dtype=torch.float32)
    table = cos_sin_table(8, d, torch.float32)
    positions = torch.tensor([-3, 0, 7, 100], device=DEVICE)
    slots = torch.tensor([0, nb * bs, 3, 1 << 40], device=DEVICE)
    kc = torch.full((nb, bs, h, d), float("nan"), device=DEVICE)
    vc = kc.clone()
    q0 = q.clone()
    dispatch.rope_kv_write(q, k, v, positions, table, kc, vc, slots, backend=impl)
    clamped = positions.clamp(0, 7)
    _close(q, rope_formula(q0, clamped, table, d), torch.float32)
    assert not bool(kc[0, 0].isnan().any())
    assert not bool(kc[1, 1].isnan().any())
    assert bool(kc[0, 1].isnan().all())
    assert bool(kc[1, 0].isnan().all())
    _close(kc[1, 1], rope_formula(k, clamped, table, d)[2], torch.float32)
    assert torch.equal(vc[0, 0], v[0])


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 6),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.integers(2, 20),
    rot_frac=st.floats(0.0, 1.0),
    dtype=st.sampled_from(CPU_DTYPES),
    fp32_table=st.booleans(),
    num_blocks=st.integers(1, 3),
    block_size=st.integers(1, 4),
    n_skip=st.integers(0, 3),
    heads_per_tile=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 1 << 16),
)
def test_rope_kv_write_property(
    t: int,
    hkv: int,
    group: int,
    d: int,
    rot_frac: float,
    dtype: torch.dtype,
    fp32_table: bool,
    num_blocks: int,
    block_size: int,
    n_skip: int,
    heads_per_tile: int | None,
    seed: int,
) -> None:
    rot = 2 * max(1, round(rot_frac * (d // 2)))
    check_rope(
        t, hkv * group, hkv, d, rot, dtype,
        table_dtype=torch.float32 if fp32_table else dtype, num_blocks=num_blocks,
        block_size=block_size, n_skip=n_skip, heads_per_tile=heads_per_tile, seed=seed,
    )  # fmt: skip


# ------------------------------------------------------------------------------ act_mul
def check_act_mul(
    t: int,
    inter: int,
    act: str,
    dtype: torch.dtype,
    *,
    block_i: int | None = None,
    row_pad: int = 3,
    seed: object = 0,
) -> None:
    gen = _gen("act", t, inter, act, dtype, block_i, row_pad, seed)
    gu = (_randn(gen, t, 2 * inter + row_pad, dtype=torch.float32) * 2).to(dtype)[:, : 2 * inter]
    if block_i is None:
        got = dispatch.act_mul(gu, act=act, backend="triton")
    else:
        got = _ops().act_mul(gu, act=act, block_i=block_i)
    twin = reference.act_mul_ref(gu, act=act)
    assert got.dtype == dtype
    assert got.shape == (t, inter)
    assert torch.equal(twin, act_formula(act, gu))
    _close(got, twin, dtype)

    # With a term computed beside gu (the engine's LoRA delta), strided: of round(gu + e).
    ext = _randn(gen, t, 2 * inter + 1, dtype=dtype)[:, 1:]
    if block_i is None:
        got = dispatch.act_mul(gu, act=act, extra=ext, backend="triton")
    else:
        got = _ops().act_mul(gu, act=act, block_i=block_i, extra=ext)
    twin = reference.act_mul_ref(gu, act=act, extra=ext)
    assert torch.equal(twin, act_formula(act, gu + ext))
    _close(got, twin, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_act_mul_matches_twin_and_torch(dtype: torch.dtype, act: str) -> None:
    for t, inter in ((1, 1), (3, 7), (17, 65), (3, 200)):
        check_act_mul(t, inter, act, dtype)
    check_act_mul(3, 200, act, dtype, block_i=64)  # a ragged last column tile


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_act_mul_out_argument(impl: Backend) -> None:
    gen = _gen("act-out", impl)
    gu = _randn(gen, 4, 2 * 21, dtype=torch.float16)
    out = torch.full((4, 30), float("nan"), dtype=torch.float16, device=DEVICE)[:, 5:26]
    got = dispatch.act_mul(gu, act="silu", out=out, backend=impl)
    assert got is out
    _close(out, act_formula("silu", gu), torch.float16)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 6),
    inter=st.integers(1, 300),
    act=st.sampled_from(ACTS),
    dtype=st.sampled_from(CPU_DTYPES),
    block_i=st.sampled_from([None, 16, 64]),
    row_pad=st.integers(0, 3),
    seed=st.integers(0, 1 << 16),
)
def test_act_mul_property(
    t: int, inter: int, act: str, dtype: torch.dtype, block_i: int | None, row_pad: int, seed: int
) -> None:
    check_act_mul(t, inter, act, dtype, block_i=block_i, row_pad=row_pad, seed=seed)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (lambda: torch.randn(4, 21, device=DEVICE), "extra must have shape"),
        (
            lambda: torch.randn(4, 42, dtype=torch.float16, device=DEVICE),
            "extra must be torch.float32",
        ),
        (lambda: torch.randn(4, 84, device=DEVICE)[:, ::2], "extra must have a contiguous"),
        (lambda: torch.randn(42, device=DEVICE), "extra must be 2-D"),
    ],
)
def test_act_mul_bad_extra_raises(impl: Backend, extra: Any, match: str) -> None:
    gu = torch.randn(4, 42, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        dispatch.act_mul(gu, act="silu", extra=extra(), backend=impl)


# ------------------------------------------------------------------------------ bad inputs
def _rms_args() -> dict[str, Any]:
    x = torch.randn(3, 8, device=DEVICE)
    return {"x": x, "weight": torch.randn(8, device=DEVICE), "eps": EPS, "residual": None}


def _rope_args() -> dict[str, Any]:
    qkv = torch.randn(3, (4 + 2 * 2) * 8, device=DEVICE)
    return {
        "q": qkv[:, :32].view(3, 4, 8),
        "k": qkv[:, 32:48].view(3, 2, 8),
        "v": qkv[:, 48:].view(3, 2, 8),
        "positions": torch.zeros(3, dtype=torch.int64, device=DEVICE),
        "cos_sin_cache": torch.randn(16, 8, device=DEVICE),
        "k_cache": torch.zeros(2, 4, 2, 8, device=DEVICE),
        "v_cache": torch.zeros(2, 4, 2, 8, device=DEVICE),
        "slot_mapping": torch.arange(3, device=DEVICE),
    }


RMS_BAD = [
    ("x", lambda: torch.randn(3, 8, 1, device=DEVICE), "x must be 2-D"),
    ("x", lambda: torch.randn(3, 16, device=DEVICE)[:, ::2], "x must have a contiguous last"),
    ("x", lambda: torch.ones(3, 8, dtype=torch.int32, device=DEVICE), "x must be float16"),
    ("weight", lambda: torch.randn(9, device=DEVICE), "weight must have shape"),
    (
        "weight",
        lambda: torch.randn(8, dtype=torch.float16, device=DEVICE),
        "weight must be torch.float32",
    ),
    ("eps", lambda: -1.0, "eps must be"),
    ("residual", lambda: torch.randn(3, 9, device=DEVICE), "residual must have shape"),
    (
        "residual",
        lambda: torch.randn(3, 8, dtype=torch.float64, device=DEVICE),
        "residual must be torch.float32",
    ),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(("field", "value", "match"), RMS_BAD)
def test_rms_norm_bad_input_raises(impl: Backend, field: str, value: Any, match: str) -> None:
    args = _rms_args()
    args[field] = value()
    with pytest.raises(ValueError, match=match):
        dispatch.rms_norm(
            args["x"], args["weight"], args["eps"], residual=args["residual"], backend=impl
        )


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rms_norm_out_aliasing_residual_raises(impl: Backend) -> None:
    args = _rms_args()
    res = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="out must not alias residual"):
        dispatch.rms_norm(args["x"], args["weight"], EPS, residual=res, out=res, backend=impl)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(
    ("extra", "with_residual", "match"),
    [
        (lambda: torch.randn(3, 8, device=DEVICE), False, "extra needs residual"),
        (lambda: torch.randn(3, 9, device=DEVICE), True, "extra must have shape"),
        (
            lambda: torch.randn(3, 8, dtype=torch.float16, device=DEVICE),
            True,
            "extra must be torch.float32",
        ),
        (lambda: torch.randn(3, 16, device=DEVICE)[:, ::2], True, "extra must have a contiguous"),
    ],
)
def test_rms_norm_bad_extra_raises_and_leaves_residual(
    impl: Backend, extra: Any, with_residual: bool, match: str
) -> None:
    args = _rms_args()
    res = torch.randn(3, 8, device=DEVICE)
    before = res.clone()
    with pytest.raises(ValueError, match=match):
        dispatch.rms_norm(
            args["x"],
            args["weight"],
            EPS,
            residual=res if with_residual else None,
            extra=extra(),
            backend=impl,
        )
    assert torch.equal(res, before)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rms_norm_extra_aliasing_residual_raises(impl: Backend) -> None:
    args = _rms_args()
    res = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="extra must not alias residual"):
        dispatch.rms_norm(args["x"], args["weight"], EPS, residual=res, extra=res, backend=impl)


ROPE_BAD = [
    ("q", lambda: torch.randn(3, 4, 16, device=DEVICE)[:, :, ::2], "q must have a contiguous last"),
    ("k", lambda: torch.randn(3, 2, 6, device=DEVICE), "k must be"),
    (
        "v",
        lambda: torch.randn(3, 2, 8, dtype=torch.float16, device=DEVICE),
        "v must be torch.float32",
    ),
    (
        "positions",
        lambda: torch.zeros(3, dtype=torch.int32, device=DEVICE),
        "positions must be int64",
    ),
    (
        "slot_mapping",
        lambda: torch.zeros(4, dtype=torch.int64, device=DEVICE),
        "slot_mapping must have shape",
    ),
    ("cos_sin_cache", lambda: torch.randn(16, 6, device=DEVICE), "cos_sin_cache must be"),
    (
        "cos_sin_cache",
        lambda: torch.randn(16, 8, dtype=torch.float64, device=DEVICE),
        "cos_sin_cache must be",
    ),
    ("k_cache", lambda: torch.zeros(2, 4, 3, 8, device=DEVICE), "k_cache must be"),
    ("v_cache", lambda: torch.zeros(2, 5, 2, 8, device=DEVICE), "v_cache must have shape"),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(("field", "value", "match"), ROPE_BAD)
def test_rope_kv_write_bad_input_raises(impl: Backend, field: str, value: Any, match: str) -> None:
    args = _rope_args()
    args[field] = value()
    q0 = args["q"].clone()
    with pytest.raises(ValueError, match=match):
        dispatch.rope_kv_write(*args.values(), backend=impl)
    assert torch.equal(args["q"], q0) or field == "q"


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rotary_dim", [3, 0, 10, True])
def test_rope_kv_write_bad_rotary_dim_raises(impl: Backend, rotary_dim: Any) -> None:
    with pytest.raises(ValueError, match="rotary_dim"):
        dispatch.rope_kv_write(*_rope_args().values(), rotary_dim=rotary_dim, backend=impl)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_act_mul_bad_input_raises(impl: Backend) -> None:
    gu = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="act must be one of"):
        dispatch.act_mul(gu, act="swish", backend=impl)
    with pytest.raises(ValueError, match="gu must be"):
        dispatch.act_mul(torch.randn(3, 7, device=DEVICE), backend=impl)
    with pytest.raises(ValueError, match="out must have shape"):
        dispatch.act_mul(gu, out=torch.empty(3, 3, device=DEVICE), backend=impl)


def test_package_exports_and_cpu_default_is_twin() -> None:
    assert dispatch.rms_norm is dispatch.rms_norm
    assert dispatch.rope_kv_write is dispatch.rope_kv_write
    assert dispatch.act_mul is dispatch.act_mul
    if DEVICE == "cpu":
        gen = _gen("default")
        x = _randn(gen, 3, 8, dtype=torch.float32)
        w = _randn(gen, 8, dtype=torch.float32)
        assert torch.equal(dispatch.rms_norm(x, w, EPS), reference.rms_norm_ref(x, w, EPS))
        gu = _randn(gen, 3, 8, dtype=torch.float32)
        assert torch.equal(dispatch.act_mul(gu), reference.act_mul_ref(gu))


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("h", [4096, 5120, 8192, 16384])
def test_gpu_rms_norm_bf16(h: int) -> None:
    for t in (1, 7, 300):
        check_rms_norm(t, h, torch.bfloat16, row_pad=0)
        check_rms_norm(t, h, torch.bfloat16, row_pad=8, gemma=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rot"),
    [(32, 8, 128, 128), (32, 32, 128, 64), (28, 4, 128, 128), (8, 1, 256, 256)],
)
def test_gpu_rope_kv_write_bf16(hq: int, hkv: int, d: int, rot: int) -> None:
    for t in (1, 33, 512):
        for table_dtype in (torch.float32, torch.bfloat16):
            check_rope(t, hq, hkv, d, rot, torch.bfloat16, table_dtype=table_dtype,
                       num_blocks=64, block_size=16, n_skip=1 + t // 8)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [11008, 14336])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_act_mul_bf16(inter: int, act: str) -> None:
    for t in (1, 7, 300):
        check_act_mul(t, inter, act, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_offsets_past_2_31() -> None:
    """Element offsets past 2^31 in activations and in the cache (int64 address arithmetic)."""
    dt = torch.bfloat16
    # act_mul: [T, 2*I] with T * 2I > 2^31; check the last rows.
    t, inter = 75_000, 14336
    gu = torch.randn(t, 2 * inter, device="cuda", dtype=dt)
    got = dispatch.act_mul(gu)
    _close(got[-4:], reference.act_mul_ref(gu[-4:]), dt)
    x = gu.view(-1, 8192)  # [262500, 8192]: rms_norm rows past 2^31 elements
    del got
    y = dispatch.rms_norm(x, torch.ones(8192, device="cuda", dtype=dt), EPS)
    _close(
        y[-4:], reference.rms_norm_ref(x[-4:], torch.ones(8192, device="cuda", dtype=dt), EPS), dt
    )
    del gu, x, y
    # rope_kv_write: slots at the end of a cache of more than 2^31 elements.
    nb, bs, hkv, d = 140_000, 16, 8, 128
    kc = torch.zeros(nb, bs, hkv, d, device="cuda", dtype=dt)
    vc = torch.zeros_like(kc)
    q = torch.randn(2, 8, d, device="cuda", dtype=dt)
    k = torch.randn(2, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(2, hkv, d, device="cuda", dtype=dt)
    table = cos_sin_table(16, d, torch.float32)
    pos = torch.tensor([3, 9], device="cuda")
    slots = torch.tensor([nb * bs - 1, nb * bs - 17], device="cuda")
    dispatch.rope_kv_write(q, k, v, pos, table, kc, vc, slots)
    _close(kc[nb - 1, bs - 1], rope_formula(k, pos, table, d)[0], dt)
    assert torch.equal(vc[nb - 2, bs - 1], v[1])


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay() -> None:
    """All three launchers capture into one CUDA graph (no host sync) and replay on new data."""
    dt, t, hidden, inter, hq, hkv, d = torch.bfloat16, 8, 512, 1376, 8, 2, 64
    gen = _gen("graph")
    x = _randn(gen, t, hidden, dtype=dt)
    res = _randn(gen, t, hidden, dtype=dt)
    w = _randn(gen, hidden, dtype=dt)
    qkv = _randn(gen, t, (hq + 2 * hkv) * d, dtype=dt)
    gu = _randn(gen, t, 2 * inter, dtype=dt)
    table = cos_sin_table(128, d, torch.float32)
    pos = torch.arange(t, device="cuda")
    slots = torch.arange(t, device="cuda") * 3 - 2
    kc = torch.zeros(4, 16, hkv, d, device="cuda", dtype=dt)
    vc = torch.zeros_like(kc)
    y_out = torch.empty_like(x)
    a_out = torch.empty(t, inter, device="cuda", dtype=dt)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)

    def step() -> None:
        dispatch.rms_norm(x, w, EPS, residual=res, out=y_out)
        dispatch.rope_kv_write(q, k, v, pos, table, kc, vc, slots)
        dispatch.act_mul(gu, act="gelu_pytorch_tanh", out=a_out)

    inputs0 = [z.clone() for z in (x, res, qkv, gu)]
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fresh = [_randn(gen, *z.shape, dtype=dt) for z in inputs0]
    for buf, new in zip((x, res, qkv, gu), fresh, strict=True):
        buf.copy_(new)
    kc.zero_()
    vc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    res_t, qkv_t, kc_t, vc_t = (
        fresh[1].clone(),
        fresh[2].clone(),
        torch.zeros_like(kc),
        torch.zeros_like(vc),
    )
    y_t = reference.rms_norm_ref(fresh[0], w, EPS, residual=res_t)
    q_t = qkv_t[:, : hq * d].view(t, hq, d)
    reference.rope_kv_write_ref(q_t, k.clone(), v.clone(), pos, table, kc_t, vc_t, slots)
    a_t = reference.act_mul_ref(fresh[3], act="gelu_pytorch_tanh")
    assert torch.equal(res, res_t)
    _close(y_out, y_t, dt)
    _close(qkv, qkv_t, dt)
    _close(kc, kc_t, dt)
    _close(vc, vc_t, dt)
    _close(a_out, a_t, dt)
