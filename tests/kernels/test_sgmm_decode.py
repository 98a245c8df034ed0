"""Decode-shaped SGMM: density-keyed configs, several column blocks per expand program, the
matrix-vector expand, and the prebuilt plan.

CPU (CI): the kernels under TRITON_INTERPRET=1 against the torch twin on fresh random inputs:
ragged segments, odd hidden and output sizes, mixed ranks with rank 0, base tokens, 1-3
slices. ``gpu``: the matrix-vector expand against the tile path on real shapes, and the plan
bit-identical to add_lora.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import MIXES, make_case, tolerance

from adaptermesh.kernels import int4_quant, reference, sgmm_config
from adaptermesh.kernels.meta import build_segment_meta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sgmm():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels import sgmm

    return sgmm


def test_density_picks_configs() -> None:
    # Decode-like: one token per adapter gets 16-row tiles; a dense batch keeps the tall ones.
    assert sgmm_config.expand_config(256, 4096, 16).block_m == 16
    assert sgmm_config.expand_config(256, 4096, 16, active_slots=1).block_m >= 16
    assert sgmm_config.density_bucket(64, None) == "sparse"
    assert sgmm_config.density_bucket(64, 1) == "dense"
    assert sgmm_config.density_bucket(64, 16) == "sparse"
    assert sgmm_config.density_bucket(64, 15) == "mid"
    assert sgmm_config.density_bucket(4096, 64) == "dense"
    # Long single-adapter prefills: tall expand tiles; the shrink's 16-row split tile at r=16
    # and the 64-row tile at r=64 (2026-12-04 sweep).
    assert sgmm_config.expand_config(4096, 4096, 16, active_slots=1).block_m >= 32
    assert sgmm_config.shrink_config(4096, 4096, 64, active_slots=1).block_m >= 32
    # One to four tokens per adapter at T <= 64 and a low rank: the matrix-vector expand with
    # the whole rank in one tile; a high rank or a denser batch keeps the tensor-core tiles.
    for t, a in ((2, 2), (16, 16), (64, 64), (64, None)):
        cfg = sgmm_config.expand_config(t, 4096, 16, active_slots=a)
        assert cfg.gemv, (t, a)
        assert cfg.block_k >= 16, (t, a)
    # One token, low rank: the matrix-vector shrink over H <= 4096, split-K over wider H, and
    # the 16-row expand tile (the batch-1 rows of the 2026-12-03 sweep).
    assert sgmm_config.shrink_config(1, 4096, 16, 1).gemv
    assert not sgmm_config.shrink_config(1, 11008, 16, 1).gemv
    assert sgmm_config.shrink_config(1, 11008, 16, 1).split_k > 1
    # Up to 16 tokens, any density, the same (2026-12-04): gemv over H <= 4096 only.
    for a in (1, 4, 16, None):
        assert sgmm_config.shrink_config(16, 4096, 16, a).gemv, a
        assert not sgmm_config.shrink_config(16, 11008, 16, a).gemv, a
    assert not sgmm_config.shrink_config(17, 4096, 16, 1).gemv
    assert not sgmm_config.expand_config(1, 4096, 16, 1).gemv
    assert not sgmm_config.shrink_config(1, 4096, 64, 1).gemv
    assert sgmm_config.expand_config(64, 4096, 32).block_k >= 32
    # r=64, one token per adapter at T=64: the gemv expand (2026-12-04 sweep), whole rank.
    assert sgmm_config.expand_config(64, 4096, 64).gemv
    assert sgmm_config.expand_config(64, 4096, 64).block_k >= 64
    assert not sgmm_config.expand_config(64, 4096, 64, active_slots=4).gemv
    # Wider ranks than the gemv rows were swept on keep the tiles.
    for r in (65, 128, 256):
        assert not sgmm_config.expand_config(64, 4096, r).gemv, r
        assert sgmm_config.expand_config(64, 4096, r).block_m >= 16, r
    # Long dense batches and 1-4 tokens per adapter at T=256: the hoisted tile, which needs
    # the whole rank in one tile and is dropped above HOIST_MAX_RANK.
    for t, a, r in ((4096, 1, 16), (4096, 64, 64), (256, 64, 16), (256, None, 64)):
        cfg = sgmm_config.expand_config(t, 4096, r, active_slots=a)
        assert cfg.hoist_v, (t, a, r)
        assert cfg.block_k >= r, (t, a, r)
    assert not sgmm_config.expand_config(4096, 4096, 256, active_slots=1).hoist_v
    assert not sgmm_config.expand_config(64, 4096, 16, active_slots=1).gemv
    assert not sgmm_config.expand_config(256, 4096, 16).gemv
    for t in (1, 16, 64, 256, 4096):
        for r in (8, 16, 64, 128, 200):
            for a in (None, 1, 8, 64):
                sgmm_config.shrink_config(t, 4096, r, a)
                e = sgmm_config.expand_config(t, 4096, r, a)
                # a gemv or hoisted tile covers the whole rank
                assert not (e.gemv or e.hoist_v) or e.block_k >= r


def test_default_add_lora_matches_twin_across_densities() -> None:
    """add_lora with no config (table-picked, gemv or tiles) against the twin."""
    sgmm = _sgmm()
    for t, s, mix in ((6, 6, "distinct"), (16, 2, "identical"), (20, 3, "with_base")):
        case = make_case(
            t=t, h=48, s=s, r_max=16, ranks=None, out_sizes=(32, 16), mix=mix,
            dtype=torch.float32, device=DEVICE, seed=t,
        )  # fmt: skip
        meta = build_segment_meta(case.slots, s)
        for active in (None, 1, s):
            got = case.out.clone()
            sgmm.add_lora(
                got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                active_slots=active,
            )  # fmt: skip
            want = case.out.clone()
            reference.add_lora_ref(
                want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta
            )
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
def test_plan_runs_the_same_op_on_fixed_buffers() -> None:
    """A plan made once gives add_lora's result on every call, with new contents each time, for
    the table's picks and for a gemv expand; making it runs nothing."""
    sgmm = _sgmm()
    for expand_cfg in (None, sgmm_config.SgmmConfig(1, 16, 16, n_blocks=2, gemv=True)):
        case = make_case(
            t=7, h=40, s=3, r_max=16, ranks=[16, 5, 0], out_sizes=(24, 8), mix="with_base",
            dtype=torch.float32, device=DEVICE, seed=11,
        )  # fmt: skip
        meta = build_segment_meta(case.slots, 3)
        out = case.out.clone()
        plan = sgmm.plan_add_lora(
            out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            expand_cfg=expand_cfg,
        )  # fmt: skip
        assert torch.equal(out, case.out)  # nothing ran yet
        assert plan.launches == 2  # shrink, expand
        for step in range(2):
            case.x.copy_(torch.randn_like(case.x))  # new contents, same storage
            want = out.clone()
            reference.add_lora_ref(
                want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta
            )
            plan()
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.gpu
def test_gpu_plan_is_bit_identical_to_add_lora() -> None:
    sgmm = _sgmm()
    for t, s in ((1, 1), (64, 64), (512, 8)):
        case = make_case(
            t=t, h=4096, s=s, r_max=16, ranks=None, out_sizes=(4096, 1024), mix="uniform",
            dtype=torch.bfloat16, device="cuda", seed=t,
        )  # fmt: skip
        meta = build_segment_meta(case.slots, s)
        a = case.out.clone()
        b = case.out.clone()
        plan = sgmm.plan_add_lora(
            b, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            check_values=False,
        )  # fmt: skip
        for _ in range(3):
            sgmm.add_lora(
                a, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                check_values=False,
            )  # fmt: skip
            plan()
        assert torch.equal(a, b)


@pytest.mark.parametrize("n_blocks", [2, 3])
def test_expand_column_blocks_per_program(n_blocks) -> None:  # type: ignore[no-untyped-def]
    """An expand program writing several column blocks covers every column once, on odd
    widths where the last program's blocks run past the slice."""
    sgmm = _sgmm()
    case = make_case(
        t=9, h=24, s=3, r_max=16, ranks=[16, 9, 0], out_sizes=(50, 17, 33), mix="with_base",
        dtype=torch.float32, device=DEVICE, seed=n_blocks,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 3)
    cfg = sgmm_config.SgmmConfig(16, 16, 16, num_warps=4, num_stages=2, n_blocks=n_blocks)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        shrink_cfg=sgmm_config.shrink_config(9, 24, 16), expand_cfg=cfg,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("block_m", "n_blocks", "mix"),
    [(1, 1, "distinct"), (2, 2, "with_base"), (4, 3, "zipf"), (4, 1, "identical")],
)
def test_gemv_expand_matches_twin(block_m, n_blocks, mix) -> None:  # type: ignore[no-untyped-def]
    """The matrix-vector expand (a few tokens per program, whole rank per tile) against the
    twin: segments longer than block_m, ragged widths, mixed ranks with rank 0."""
    sgmm = _sgmm()
    case = make_case(
        t=11, h=24, s=4, r_max=24, ranks=[24, 7, 0, 16], out_sizes=(40, 9, 33), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=block_m * 10 + n_blocks,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 4)
    cfg = sgmm_config.SgmmConfig(block_m, 16, 32, num_warps=4, num_stages=2, n_blocks=n_blocks,
                          gemv=True)  # fmt: skip
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        shrink_cfg=sgmm_config.shrink_config(11, 24, 24), expand_cfg=cfg,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="block_k >= R_max"):
        sgmm.add_lora(
            got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            expand_cfg=sgmm_config.SgmmConfig(1, 16, 16, gemv=True),
        )  # fmt: skip


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 20),
    h=st.integers(1, 50),
    s=st.integers(1, 5),
    r_max=st.sampled_from([1, 4, 16, 24]),
    n_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    gemv=st.booleans(),
    block_m=st.sampled_from([1, 2, 4, 16]),
    n_blocks=st.integers(1, 3),
    prefetch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_expand_configs_property(  # type: ignore[no-untyped-def]
    t, h, s, r_max, n_sizes, mix, gemv, block_m, n_blocks, prefetch, seed
) -> None:
    """Any valid expand config, tiles or gemv, gives the twin's result; base rows keep their
    bits."""
    sgmm = _sgmm()
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_sizes), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=seed,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    bm = block_m if gemv else 16
    cfg = sgmm_config.SgmmConfig(bm, 16, 32 if gemv else 16, num_warps=4, num_stages=2,
                          prefetch_out=prefetch, n_blocks=n_blocks, gemv=gemv)  # fmt: skip
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, expand_cfg=cfg
    )
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = case.slots < 0
    assert torch.equal(got[base], case.out[base])


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 20),
    h=st.integers(1, 70),
    s=st.integers(1, 5),
    r_max=st.sampled_from([1, 4, 16, 24]),
    n_sizes=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    block_m=st.sampled_from([1, 2, 4]),
    block_n=st.sampled_from([1, 2, 4, 16]),
    block_k=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_gemv_shrink_property(  # type: ignore[no-untyped-def]
    t, h, s, r_max, n_sizes, mix, block_m, block_n, block_k, seed
) -> None:
    """The matrix-vector shrink (a few tokens and rank rows per program, the whole of H walked
    once, no split) against the twin: ragged H, ranks with 0, base tokens, 1-3 slices."""
    sgmm = _sgmm()
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_sizes), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=seed,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    cfg = sgmm_config.SgmmConfig(block_m, block_n, block_k, num_warps=4, num_stages=2, gemv=True)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, shrink_cfg=cfg
    )
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = case.slots < 0
    assert torch.equal(got[base], case.out[base])


def test_gemv_shrink_plan_and_int4() -> None:
    """A plan with a gemv shrink is one launch per op; the INT4 path runs the same gemv
    shrink config (its own matrix-vector path) against its twin."""
    sgmm = _sgmm()
    from adaptermesh.kernels import sgmm_int4

    case = make_case(
        t=6, h=40, s=3, r_max=16, ranks=[16, 5, 0], out_sizes=(24,), mix="with_base",
        dtype=torch.float32, device=DEVICE, seed=2,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 3)
    cfg = sgmm_config.SgmmConfig(1, 4, 16, gemv=True)
    out = case.out.clone()
    plan = sgmm.plan_add_lora(
        out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, shrink_cfg=cfg
    )
    assert plan.launches == 2
    plan()
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    qa, qb = int4_quant.quantize_lora(case.lora_a, case.lora_b, 8)
    got = case.out.clone()
    sgmm_int4.add_lora_int4(got, case.x, qa, qb, case.scales, case.ranks, meta, shrink_cfg=cfg)
    want = case.out.clone()
    reference.add_lora_int4_ref(want, case.x, qa, qb, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s", "r"), [(1, 1, 16), (64, 64, 16), (256, 64, 64), (64, 16, 32)])
def test_gpu_gemv_expand_matches_tiles(t, s, r) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    case = make_case(
        t=t, h=4096, s=s, r_max=r, ranks=None, out_sizes=(4096, 11008), mix="uniform",
        dtype=torch.bfloat16, device="cuda", seed=t + r,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    tiles = case.out.clone()
    sgmm.add_lora(tiles, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                  expand_cfg=sgmm_config.SgmmConfig(16, 256, min(64, max(16, r))))  # fmt: skip
    for bm, bn, nb in ((1, 256, 1), (4, 512, 2)):
        got = case.out.clone()
        cfg = sgmm_config.SgmmConfig(bm, bn, max(16, r), n_blocks=nb, gemv=True)
        sgmm.add_lora(got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      shrink_cfg=sgmm_config.shrink_config(t, 4096, r), expand_cfg=cfg)  # fmt: skip
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(got, tiles, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s", "r"), [(1, 1, 16), (64, 64, 16), (16, 16, 64), (256, 64, 16)])
def test_gpu_gemv_shrink_matches_tiles(t, s, r) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    case = make_case(
        t=t, h=4096, s=s, r_max=r, ranks=None, out_sizes=(4096, 1024, 1024), mix="uniform",
        dtype=torch.bfloat16, device="cuda", seed=t + 3 * r,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    tiles = case.out.clone()
    ec = sgmm_config.SgmmConfig(16, 256, min(64, max(16, r)))
    sgmm.add_lora(tiles, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                  shrink_cfg=sgmm_config.SgmmConfig(16, min(64, max(16, r)), 256, split_k=4),
                  expand_cfg=ec)  # fmt: skip
    for bm, bn, bk in ((1, 4, 512), (2, 2, 1024), (1, 16, 256)):
        got = case.out.clone()
        sgmm.add_lora(got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      shrink_cfg=sgmm_config.SgmmConfig(bm, bn, bk, num_stages=2, gemv=True),
                      expand_cfg=ec)  # fmt: skip
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(got, tiles, rtol=rtol, atol=atol)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 40),
    h=st.integers(1, 40),
    s=st.integers(1, 5),
    r_max=st.sampled_from([1, 4, 16, 24, 40]),
    n_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    block_m=st.sampled_from([16, 32]),
    n_blocks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_expand_hoisted_v_property(  # type: ignore[no-untyped-def]
    t, h, s, r_max, n_sizes, mix, block_m, n_blocks, seed
) -> None:
    """The tile expand with v loaded once per program (block_k covering the rank) gives the
    twin's result; base rows keep their bits."""
    sgmm = _sgmm()
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_sizes), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=seed,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    bk = max(16, 1 << (r_max - 1).bit_length())
    cfg = sgmm_config.SgmmConfig(block_m, 16, bk, n_blocks=n_blocks, hoist_v=True)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, expand_cfg=cfg
    )
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = case.slots < 0
    assert torch.equal(got[base], case.out[base])


def test_expand_hoisted_v_refusals() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=6, h=20, s=2, r_max=40, ranks=None, out_sizes=(24,), mix="uniform",
        dtype=torch.float32, device=DEVICE, seed=9,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 2)
    out = case.out.clone()
    with pytest.raises(ValueError, match=r"hoist_v needs config\.block_k >= R_max=40"):
        sgmm.add_lora(out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      expand_cfg=sgmm_config.SgmmConfig(16, 16, 32, hoist_v=True))  # fmt: skip
    with pytest.raises(ValueError, match="tile-expand option"):
        sgmm.add_lora(out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      expand_cfg=sgmm_config.SgmmConfig(1, 16, 64, gemv=True, hoist_v=True))  # fmt: skip
    assert torch.equal(out, case.out)


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 8192), active=st.integers(1, 8192))
def test_density_slots_bound_their_class(tokens: int, active: int) -> None:
    """The slot bound a density class is configured by lies in that class, and bounds every
    batch of the class: a graph keyed by the class may replay any of them."""
    from adaptermesh.kernels.sgmm_config import density_bucket, density_slots

    active = min(active, tokens)
    cls = density_bucket(tokens, active)
    bound = density_slots(tokens, cls)
    assert density_bucket(tokens, bound) == cls
    if bound is not None:
        assert active <= bound
        assert density_bucket(tokens, bound + 1) != cls  # the largest such count


def test_density_slots_refuses_an_unknown_class() -> None:
    from adaptermesh.kernels.sgmm_config import density_slots

    with pytest.raises(ValueError, match="density"):
        density_slots(64, "thick")
