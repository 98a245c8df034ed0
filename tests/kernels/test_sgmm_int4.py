"""INT4 SGMM: the packed format, and the Triton kernels against their torch twin.

CPU (CI): the real kernels under TRITON_INTERPRET=1 on small shapes; ragged segments, odd T/H/N
and ranks, mixed and zero ranks, base tokens, 1-3 slices, both scale layouts.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import MIXES, Case, make_case, tolerance

from adaptermesh.kernels import int4_quant, reference, sgmm_config
from adaptermesh.kernels.meta import build_segment_meta
from adaptermesh.kernels.sgmm_config import SgmmConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _q():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels import sgmm_int4

    return sgmm_int4


def _quantize(case: Case, group: int, b_dim: int, a_dim: int = -1):  # type: ignore[no-untyped-def]
    qa = int4_quant.quantize_int4(case.lora_a, group, group_dim=a_dim)
    qb = tuple(int4_quant.quantize_int4(b, group, group_dim=b_dim) for b in case.lora_b)
    return qa, qb


# Small tiles keep the interpreter quick; test_default_configs_match_twin runs the tables'.
SHRINK = SgmmConfig(16, 16, 64, split_k=2)
EXPAND = SgmmConfig(16, 32, 32)


def check_int4_case(
    case: Case, dtype: torch.dtype, group: int = 16, b_dim: int = -2, *, parts: bool = False,
    default_configs: bool = False, norm: bool = True, a_dim: int = -1,
    shrink_cfg: SgmmConfig = SHRINK, expand_cfg: SgmmConfig = EXPAND,
) -> None:  # fmt: skip
    q = _q()
    qa, qb = _quantize(case, group, b_dim, a_dim)
    meta = build_segment_meta(case.slots, case.lora_a.shape[1])
    got = case.out.clone()
    cfgs = {} if default_configs else {"shrink_cfg": shrink_cfg, "expand_cfg": expand_cfg}
    q.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta, **cfgs)
    want = case.out.clone()
    reference.add_lora_int4_ref(want, case.x, qa, qb, case.scales, case.ranks, meta)
    rtol, atol = tolerance(dtype, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    rel = float((got.double() - want.double()).norm()) / max(float(want.double().norm()), 1e-30)
    assert not norm or rel <= tolerance(dtype, "norm")[0], rel
    # Base tokens and rank-0 slots are untouched bit for bit.
    slots = case.slots.long()
    rank_t = torch.where(slots >= 0, case.ranks.long()[slots.clamp(min=0)], 0)
    untouched = rank_t == 0
    assert torch.equal(got[untouched], case.out[untouched])
    if not parts:
        return
    # The shrink alone: v poisoned with NaN, every promised entry written.
    v = torch.full((qa.shape[0], case.x.shape[0], qa.shape[2]), float("nan"), device=case.x.device)
    q.sgmm_shrink_int4(case.x, qa, case.ranks, meta, out=v, config=SHRINK)
    deq_a = int4_quant.dequantize_int4(qa).to(dtype)
    v_ref = reference.sgmm_shrink_ref(case.x, deq_a, case.ranks, meta)
    cols = torch.arange(qa.shape[2], device=slots.device)
    mask = (cols[None, :] < rank_t[:, None]).unsqueeze(0).expand(qa.shape[0], -1, -1)
    torch.testing.assert_close(v[mask], v_ref[mask], rtol=1e-4, atol=1e-4)
    # The expand alone from that v matches the twin's expand of the dequantised B.
    got2 = case.out.clone()
    q.sgmm_expand_int4(got2, torch.nan_to_num(v), qb, case.scales, case.ranks, meta, config=EXPAND)
    want2 = case.out.clone()
    deq_b = tuple(int4_quant.dequantize_int4(b).to(dtype) for b in qb)
    reference.sgmm_expand_ref(want2, v_ref, deq_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got2, want2, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- format
@pytest.mark.parametrize("group_dim", [-1, -2])
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 16, 64), (7, 1), (2, 130)])
def test_round_trip_error_bound(shape: tuple[int, ...], group_dim: int) -> None:
    """Every element is within half a step (its group's scale) of the input, or clipped by at
    most the clip ratio's share of the group's absmax; zeros stay zeros."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, group_dim)).encode()))
    w = torch.randn(*shape, generator=gen) * 0.02
    w[..., 0, :] = 0.0  # a zero row
    qw = int4_quant.quantize_int4(w, 16, group_dim=group_dim)
    assert qw.packed.dtype == torch.uint8
    assert qw.packed.shape[-1] == math.ceil(shape[-1] / 2)
    back = int4_quant.dequantize_int4(qw)
    assert back.shape == w.shape
    assert torch.equal(back[..., 0, :], torch.zeros_like(back[..., 0, :]))
    s = qw.scales.float()
    if group_dim == -1:
        step = s.repeat_interleave(16, dim=-1)[..., : shape[-1]]
    else:
        step = s.repeat_interleave(16, dim=-2)[..., : shape[-2], :]
    err = (back - w).abs()
    # Inside the grid: half a step (plus fp32 noise); clipped: at most the clipped share.
    inside = w.abs() <= 7 * step
    assert bool((err[inside] <= 0.5 * step[inside] * (1 + 1e-5) + 1e-12).all())
    assert bool((err <= 0.25 * w.abs() + 0.5 * step + 1e-12).all())
    rel = float((back - w).norm() / w.norm())
    assert rel < 0.12, rel


def test_packing_layout() -> None:
    """Low nibble = even element, two's complement, so a zero byte is two zeros."""
    w = torch.tensor([[1.0, -2.0, 7.0, -8.0, 3.0]])
    # One group; absmax 8 -> scale 8/7 at c=1 (or a clipped one).
    qw = int4_quant.quantize_int4(w, 6)
    vals = int4_quant.unpack_int4(qw.packed, 5)
    assert vals.shape == (1, 5)
    b = int(qw.packed[0, 0])
    assert ((b & 15) ^ 8) - 8 == int(vals[0, 0])
    assert ((b >> 4) ^ 8) - 8 == int(vals[0, 1])
    assert int(qw.packed[0, 2]) >> 4 == 0  # the odd tail's pad nibble
    zero = int4_quant.quantize_int4(torch.zeros(3, 8), 4)
    assert int(zero.packed.abs().sum()) == 0
    assert float(zero.scales.float().abs().sum()) == 0.0


def test_memory_ratio() -> None:
    """Bytes of a rank-16 pool slot against bf16 at group 64: >= 3.5x."""
    a = torch.randn(3, 1, 16, 4096, dtype=torch.bfloat16)
    b = torch.randn(1, 4096, 16, dtype=torch.bfloat16)
    qa, (qb,) = int4_quant.quantize_lora(a, (b,), 64)
    bf16 = (a.numel() + b.numel()) * 2
    assert bf16 / (qa.nbytes + qb.nbytes) >= 3.5


def test_bad_inputs_raise() -> None:
    q = _q()
    with pytest.raises(ValueError, match="group_size"):
        int4_quant.quantize_int4(torch.zeros(2, 4), 3)
    with pytest.raises(ValueError, match="group_dim"):
        int4_quant.quantize_int4(torch.zeros(2, 4), 2, group_dim=0)
    case = make_case(
        t=5, h=16, s=2, r_max=8, ranks=[8, 4], out_sizes=(8,), mix="uniform",
        dtype=torch.bfloat16, device=DEVICE, seed=1,
    )  # fmt: skip
    qa, qb = _quantize(case, 8, -2)
    meta = build_segment_meta(case.slots, 2)
    args = (case.out, case.x, qa, qb, case.scales, case.ranks, meta)
    for impl in (reference.add_lora_int4_ref, q.add_lora_int4):
        with pytest.raises(ValueError, match="Int4Weight"):
            impl(case.out, case.x, case.lora_a, qb, case.scales, case.ranks, meta)
        with pytest.raises(ValueError, match="columns"):
            impl(case.out[:, :4], *args[1:])
        with pytest.raises(ValueError, match="ranks must lie"):
            impl(*args[:5], torch.tensor([9, 1], dtype=torch.int32), meta)


# --------------------------------------------------------------------------- kernel vs twin
_MIX_CASES = [(m, torch.bfloat16) for m in MIXES] + [
    ("with_base", torch.float16),
    ("zipf", torch.float32),
]


@pytest.mark.parametrize(("mix", "dtype"), _MIX_CASES)
def test_mixes_match_twin(dtype: torch.dtype, mix: str) -> None:
    case = make_case(
        t=19, h=67, s=4, r_max=16, ranks=[16, 1, 8, 5], out_sizes=(24, 9, 9),
        mix=mix, dtype=dtype, device=DEVICE, seed=zlib.crc32(f"int4{mix}{dtype}".encode()),
    )  # fmt: skip
    check_int4_case(case, dtype, parts=mix in ("with_base", "zipf"))


def test_default_configs_match_twin() -> None:
    """The bf16 tables' tiles (BLOCK_K raised to 32 where smaller), split-K included."""
    case = make_case(
        t=12, h=300, s=3, r_max=16, ranks=[16, 5, 0], out_sizes=(40, 8, 8),
        mix="with_base", dtype=torch.bfloat16, device=DEVICE, seed=99,
    )  # fmt: skip
    check_int4_case(case, torch.bfloat16, 64, default_configs=True)


@pytest.mark.parametrize(("n_slices", "r_max", "group", "b_dim"),
                         [(1, 1, 2, -2), (2, 33, 16, -1), (3, 64, 32, -2)])  # fmt: skip
def test_slices_ranks_groups_match_twin(n_slices: int, r_max: int, group: int, b_dim: int) -> None:
    sizes = (41, 16, 23)[:n_slices]
    ranks = [r_max, max(1, r_max // 2), 0]
    case = make_case(
        t=21, h=45, s=3, r_max=r_max, ranks=ranks, out_sizes=sizes,
        mix="with_base", dtype=torch.bfloat16, device=DEVICE, seed=7 + n_slices,
    )  # fmt: skip
    check_int4_case(case, torch.bfloat16, group, b_dim, parts=True)


def test_split_k_shrink_matches_twin() -> None:
    """A config with split-K (several programs per tile's reduction over H)."""
    q = _q()
    case = make_case(
        t=9, h=200, s=3, r_max=16, ranks=[16, 3, 9], out_sizes=(16,),
        mix="with_base", dtype=torch.bfloat16, device=DEVICE, seed=21,
    )  # fmt: skip
    qa, qb = _quantize(case, 32, -2)
    meta = build_segment_meta(case.slots, 3)
    got = case.out.clone()
    cfg = SgmmConfig(16, 16, 32, split_k=4)
    q.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta, shrink_cfg=cfg)
    want = case.out.clone()
    reference.add_lora_int4_ref(want, case.x, qa, qb, case.scales, case.ranks, meta)
    rtol, atol = tolerance(torch.bfloat16, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_error_against_bf16_pool() -> None:
    """The INT4 result against the bf16 pool it came from: the LoRA term's relative error."""
    case = make_case(
        t=32, h=256, s=4, r_max=16, ranks=[16, 8, 16, 4], out_sizes=(128,),
        mix="uniform", dtype=torch.float32, device="cpu", seed=5,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 4)
    qa, qb = int4_quant.quantize_lora(case.lora_a, case.lora_b, 64)
    got = case.out.clone()
    reference.add_lora_int4_ref(got, case.x, qa, qb, case.scales, case.ranks, meta)
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    delta = want - case.out
    rel = float((got - want).norm() / delta.norm())
    # Gaussian factors, 4 bits with a clip search: ~8 % per factor, ~11 % on the product.
    assert rel < 0.15, rel


@settings(max_examples=16, deadline=None)
@given(
    t=st.integers(1, 24),
    h=st.integers(1, 90),
    s=st.integers(1, 5),
    r_max=st.integers(1, 40),
    n=st.integers(1, 40),
    n_slices=st.integers(1, 3),
    mix=st.sampled_from(MIXES),
    group=st.sampled_from([2, 6, 8, 32]),
    a_dim=st.sampled_from([-1, -2]),
    b_dim=st.sampled_from([-1, -2]),
    gemv=st.booleans(),
    shrink=st.sampled_from([(1, 2, 16), (2, 4, 32), (4, 1, 64), (1, 16, 16)]),
    expand=st.sampled_from([(1, 16), (2, 32), (4, 64), (1, 8)]),
    n_blocks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_twin(
    t: int, h: int, s: int, r_max: int, n: int, n_slices: int, mix: str, group: int,
    a_dim: int, b_dim: int, gemv: bool, shrink: tuple[int, int, int], expand: tuple[int, int],
    n_blocks: int, seed: int,
) -> None:  # fmt: skip
    """Both kernel families (tiles with split-K, or the matrix-vector kernels) on ragged, odd
    and mixed-rank inputs (rank 0 and base tokens included), every scale layout of A and B
    and power-of-two or not group sizes, odd H (a padded last nibble)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    sizes = tuple(max(1, n - 3 * i) for i in range(n_slices))
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=sizes, mix=mix,
        dtype=torch.bfloat16, device=DEVICE, seed=seed,
    )  # fmt: skip
    if gemv:
        bk = max(16, 1 << (r_max - 1).bit_length())
        sc = SgmmConfig(shrink[0], shrink[1], shrink[2], gemv=True)
        ec = SgmmConfig(expand[0], expand[1], bk, n_blocks=n_blocks, gemv=True)
    else:
        sc, ec = SHRINK, SgmmConfig(16, 32, 32, n_blocks=n_blocks)
    # Tiny outputs make the norm bound noisy; the elementwise bound still holds.
    check_int4_case(case, torch.bfloat16, group, b_dim, norm=False, a_dim=a_dim,
                    shrink_cfg=sc, expand_cfg=ec)  # fmt: skip


def test_int4_takes_the_gemv_rows() -> None:
    """The tables' decode rows pick the matrix-vector kernels for INT4 as for bf16, and the
    INT4 result with no config (gemv shrink and expand) matches the twin."""

    for t, a in ((2, 2), (16, 16), (64, 64), (64, None)):
        assert sgmm_config.expand_config(t, 4096, 16, a).gemv
    assert sgmm_config.shrink_config(1, 4096, 16, 1).gemv
    case = make_case(
        t=5, h=70, s=5, r_max=16, ranks=[16, 3, 0, 9, 16], out_sizes=(33, 8), mix="distinct",
        dtype=torch.bfloat16, device=DEVICE, seed=31,
    )  # fmt: skip
    check_int4_case(case, torch.bfloat16, 16, -2, default_configs=True, norm=False)


def test_int4_rows_pick_gemv_at_decode_batches() -> None:
    """The INT4 rows: matrix-vector kernels at 1-32 tokens per adapter for T in 17..256 (where
    the bf16 rows keep tiles), the bf16 tables elsewhere; the picked configs match the twin."""

    for t, a, r in ((64, 8, 16), (64, 64, 16), (64, 64, 64), (256, 64, 16)):
        assert sgmm_config.int4_shrink_config(t, 4096, r, a).gemv, (t, a, r)
        assert not sgmm_config.shrink_config(t, 4096, r, a).gemv, (t, a, r)
    assert sgmm_config.int4_expand_config(64, 4096, 64, 64).gemv
    assert sgmm_config.int4_expand_config(64, 4096, 64, 64).block_k >= 64
    assert not sgmm_config.int4_expand_config(256, 4096, 64, 64).gemv
    assert not sgmm_config.int4_shrink_config(256, 4096, 64, 64).gemv
    assert not sgmm_config.int4_expand_config(64, 4096, 128, 64).gemv  # past GEMV_EXPAND_MAX_RANK
    assert sgmm_config.int4_shrink_config(256, 4096, 64, 64).split_k > 1
    assert sgmm_config.int4_shrink_config(4096, 4096, 16, 1) == sgmm_config.shrink_config(
        4096, 4096, 16, 1
    )
    assert sgmm_config.int4_expand_config(16, 4096, 16, 1) == sgmm_config.expand_config(
        16, 4096, 16, 1
    )
    case = make_case(
        t=40, h=72, s=20, r_max=16, ranks=None, out_sizes=(24,), mix="distinct",
        dtype=torch.bfloat16, device=DEVICE, seed=41,
    )  # fmt: skip
    assert sgmm_config.int4_shrink_config(40, 72, 16, 20).gemv
    check_int4_case(case, torch.bfloat16, 8, -2, default_configs=True, norm=False)


@pytest.mark.parametrize(("group", "block_k", "a_dim", "b_dim"),
                         [(6, 32, -1, -2), (16, 32, -2, -1), (64, 32, -1, -2), (64, 256, -1, -1),
                          (2, 16, -2, -2), (4, 16, -2, -1)])  # fmt: skip
def test_scale_layouts(group: int, block_k: int, a_dim: int, b_dim: int) -> None:
    """The scale paths of every INT4 kernel, for A and B each grouped along its reduction dim
    or along its rows: one load per group when the group is a power of two no wider than the
    step (along K) or the block of rows, else a gather along K or a row per weight row (a
    wider or non-power-of-two group); H = 203, rank 24 and N = 19 / 40 leave partial last
    groups, H odd a padded last nibble."""
    q = _q()
    case = make_case(
        t=7, h=203, s=3, r_max=24, ranks=[24, 7, 0], out_sizes=(19, 40), mix="with_base",
        dtype=torch.bfloat16, device=DEVICE, seed=group * 31 + block_k,
    )  # fmt: skip
    qa, qb = _quantize(case, group, b_dim, a_dim)
    meta = build_segment_meta(case.slots, 3)
    want = case.out.clone()
    reference.add_lora_int4_ref(want, case.x, qa, qb, case.scales, case.ranks, meta)
    rtol, atol = tolerance(torch.bfloat16, "out")
    # The matrix-vector kernels, then the tiles (whose scale paths follow the same rule: one
    # load per group where a power-of-two group fits a step or a block of rows).
    for sc, ec in (
        (SgmmConfig(2, 4, block_k, gemv=True), SgmmConfig(2, 16, 32, n_blocks=2, gemv=True)),
        (SgmmConfig(16, 16, max(32, block_k), split_k=2), SgmmConfig(16, 16, 32, n_blocks=2)),
        (SgmmConfig(16, 32, 64), SgmmConfig(16, 64, 32)),
    ):
        got = case.out.clone()
        q.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta,
                        shrink_cfg=sc, expand_cfg=ec)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_int4_refuses_fused_and_short_gemv_configs() -> None:
    case = make_case(
        t=4, h=32, s=2, r_max=32, ranks=None, out_sizes=(32,), mix="distinct",
        dtype=torch.float32, device=DEVICE, seed=3,
    )  # fmt: skip
    q = _q()
    qa, qb = int4_quant.quantize_lora(case.lora_a, case.lora_b, 16)
    meta = build_segment_meta(case.slots, 2)
    before = case.out.clone()
    with pytest.raises(ValueError, match="fused"):
        q.add_lora_int4(
            case.out, case.x, qa, qb, case.scales, case.ranks, meta,
            expand_cfg=sgmm_config.SgmmConfig(16, 16, 16, fused=True),
        )  # fmt: skip
    with pytest.raises(ValueError, match="block_k >= R_max=32"):
        q.add_lora_int4(
            case.out, case.x, qa, qb, case.scales, case.ranks, meta,
            expand_cfg=sgmm_config.SgmmConfig(1, 16, 16, gemv=True),
        )  # fmt: skip
    assert torch.equal(case.out, before)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s", "r"), [(1, 1, 16), (16, 16, 16), (64, 64, 64), (256, 64, 16)])
def test_gpu_int4_decode_rows_match_twin(t: int, s: int, r: int) -> None:
    """The table's rows for decode batches (gemv where the bf16 path takes it) on the 7B
    shapes, against the twin on the same packed pool."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    q = _q()
    case = make_case(
        t=t, h=4096, s=s, r_max=r, ranks=None, out_sizes=(4096, 11008), mix="uniform",
        dtype=torch.bfloat16, device="cuda", seed=t + r,
    )  # fmt: skip
    qa, qb = int4_quant.quantize_lora(case.lora_a, case.lora_b, 64)
    meta = build_segment_meta(case.slots, s)
    for active in (None, s):
        got = case.out.clone()
        q.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta, active_slots=active)
        want = case.out.clone()
        reference.add_lora_int4_ref(want, case.x, qa, qb, case.scales, case.ranks, meta)
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    assert sgmm_config.expand_config(t, 11008, r, s).gemv == ((t, s) in ((16, 16), (64, 64)))
