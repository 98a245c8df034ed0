"""The single-launch add_lora (shrink in registers, then expand) and the density-keyed configs.

CPU (CI): the real fused kernel under TRITON_INTERPRET=1 against the torch twin on fresh random
inputs: ragged segments, odd hidden and output sizes, mixed ranks with rank 0, base tokens,
1-3 slices, several column blocks per program, and configs picked by density. ``gpu``: the
fused kernel against the two-launch path on real shapes, inside a CUDA graph, and the cached
launch path bit-identical to Triton's generic one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import MIXES, make_case, tolerance

from adaptermesh.kernels import build_segment_meta, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sgmm():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels import sgmm

    return sgmm


def _check(case, cfg, dtype=torch.float32) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    s = case.lora_a.shape[1]
    meta = build_segment_meta(case.slots, s)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, fused_cfg=cfg
    )
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    rtol, atol = tolerance(dtype, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # Base tokens' rows are untouched, bit for bit.
    base = case.slots < 0
    assert torch.equal(got[base], case.out[base])


@pytest.mark.parametrize(
    ("t", "h", "out_sizes", "ranks", "mix", "n_blocks"),
    [
        (5, 40, (24,), [16, 3, 0], "distinct", 1),
        (9, 33, (17, 31, 5), [8, 16, 12], "with_base", 2),
        (17, 64, (48, 20), [1, 16, 7, 16], "zipf", 3),
        (3, 16, (16,), [16], "identical", 1),
        (12, 72, (40,), [0, 0], "uniform", 2),
    ],
)
def test_fused_matches_twin(t, h, out_sizes, ranks, mix, n_blocks) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    case = make_case(
        t=t, h=h, s=len(ranks), r_max=16, ranks=ranks, out_sizes=out_sizes, mix=mix,
        dtype=torch.float32, device=DEVICE, seed=t * 31 + h,
    )  # fmt: skip
    _check(case, sgmm.FusedConfig(16, 16, 16, n_blocks, num_warps=4, num_stages=2))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 20),
    h=st.integers(1, 70),
    s=st.integers(1, 5),
    r_max=st.sampled_from([4, 16, 32]),
    n_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    n_blocks=st.integers(1, 3),
    block_k=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_fused_property(t, h, s, r_max, n_sizes, mix, n_blocks, block_k, seed) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_sizes), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=seed,
    )  # fmt: skip
    _check(case, sgmm.FusedConfig(16, 16, block_k, n_blocks, num_warps=4, num_stages=2))


def test_fused_refuses_large_rank_and_bad_config() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=4, h=16, s=2, r_max=80, ranks=None, out_sizes=(16,), mix="distinct",
        dtype=torch.float32, device=DEVICE, seed=1,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 2)
    before = case.out.clone()
    with pytest.raises(ValueError, match="R_max=80"):
        sgmm.add_lora(
            case.out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            fused_cfg=sgmm.FusedConfig(16, 16, 16, 1),
        )  # fmt: skip
    case2 = make_case(
        t=4, h=16, s=2, r_max=16, ranks=None, out_sizes=(16,), mix="distinct",
        dtype=torch.float32, device=DEVICE, seed=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="n_blocks"):
        sgmm.add_lora(
            case2.out, case2.x, case2.lora_a, case2.lora_b, case2.scales, case2.ranks,
            build_segment_meta(case2.slots, 2), fused_cfg=sgmm.FusedConfig(16, 16, 16, 0),
        )  # fmt: skip
    assert torch.equal(case.out, before)


def test_density_picks_configs() -> None:
    sgmm = _sgmm()
    # Decode-like: one token per adapter gets 16-row tiles; a dense batch keeps the tall ones.
    assert sgmm.expand_config(256, 4096, 16).block_m == 16
    assert sgmm.expand_config(256, 4096, 16, active_slots=1).block_m >= 16
    assert sgmm._d_bucket(64, None) == "sparse"
    assert sgmm._d_bucket(64, 1) == "dense"
    assert sgmm._d_bucket(64, 16) == "sparse"
    assert sgmm._d_bucket(64, 15) == "mid"
    assert sgmm._d_bucket(4096, 64) == "dense"
    # Tall tiles stay for long single-adapter prefills.
    assert sgmm.shrink_config(4096, 4096, 16, active_slots=1).block_m >= 32
    assert sgmm.fused_config(16, 128) is None  # rank past the register tile
    for t in (1, 16, 64, 256, 4096):
        for r in (8, 16, 64, 128):
            for a in (None, 1, 8, 64):
                sgmm.shrink_config(t, 4096, r, a)
                sgmm.expand_config(t, 4096, r, a)
                sgmm.fused_config(t, r, a)


def test_default_add_lora_matches_twin_across_densities() -> None:
    """add_lora with no config (table-picked, fused or not) against the twin."""
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
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s", "r", "sizes"), [
    (1, 1, 16, (4096,)), (16, 16, 16, (4096, 1024, 1024)), (64, 64, 16, (11008, 11008)),
    (16, 1, 64, (4096,)), (64, 8, 64, (4096,)),
])  # fmt: skip
def test_gpu_fused_matches_two_launches(t, s, r, sizes) -> None:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    case = make_case(
        t=t, h=4096, s=s, r_max=r, ranks=None, out_sizes=sizes, mix="uniform",
        dtype=torch.bfloat16, device="cuda", seed=7,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    two = case.out.clone()
    sgmm.add_lora(
        two, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, fused_cfg=False
    )
    for cfg in (sgmm.FusedConfig(16, 256, 256, 1), sgmm.FusedConfig(16, 128, 128, 4, 8, 3)):
        one = case.out.clone()
        sgmm.add_lora(
            one, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, fused_cfg=cfg
        )
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(one, two, rtol=rtol, atol=atol)


@pytest.mark.gpu
def test_gpu_cached_launch_is_bit_identical() -> None:
    """The cached launch path gives the same bits as Triton's generic dispatch, eager and
    inside a graph, with new tensors of the same specialisation on every call."""
    from adaptermesh.kernels import _launch

    sgmm = _sgmm()
    results = {}
    for generic in (True, False):
        _launch.clear_cache()
        outs = []
        for seed in range(3):
            case = make_case(
                t=64, h=4096, s=64, r_max=16, ranks=None, out_sizes=(4096,), mix="distinct",
                dtype=torch.bfloat16, device="cuda", seed=seed,
            )  # fmt: skip
            meta = build_segment_meta(case.slots, 64)
            import os

            os.environ["ADAPTERMESH_GENERIC_LAUNCH"] = "1" if generic else "0"
            try:
                for fused in (False, None):
                    o = case.out.clone()
                    sgmm.add_lora(
                        o, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                        fused_cfg=fused, check_values=False,
                    )  # fmt: skip
                    outs.append(o)
            finally:
                os.environ.pop("ADAPTERMESH_GENERIC_LAUNCH", None)
        results[generic] = outs
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


def test_plan_runs_the_same_op_on_fixed_buffers() -> None:
    """A plan made once gives add_lora's result on every call, with new contents each time,
    for the fused and the two-launch path; making it runs nothing."""
    sgmm = _sgmm()
    for fused in (None, False):
        case = make_case(
            t=7, h=40, s=3, r_max=16, ranks=[16, 5, 0], out_sizes=(24, 8), mix="with_base",
            dtype=torch.float32, device=DEVICE, seed=11,
        )  # fmt: skip
        meta = build_segment_meta(case.slots, 3)
        out = case.out.clone()
        plan = sgmm.plan_add_lora(
            out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            fused_cfg=fused,
        )  # fmt: skip
        assert torch.equal(out, case.out)  # nothing ran yet
        assert plan.launches == (2 if fused is False else plan.launches)
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
    cfg = sgmm.SgmmConfig(16, 16, 16, num_warps=4, num_stages=2, n_blocks=n_blocks)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        shrink_cfg=sgmm.shrink_config(9, 24, 16), expand_cfg=cfg,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("block_m", "n_blocks", "mix"), [(1, 1, "distinct"), (2, 2, "with_base"),
                                                          (4, 3, "zipf"), (4, 1, "identical")])
def test_gemv_expand_matches_twin(block_m, n_blocks, mix) -> None:  # type: ignore[no-untyped-def]
    """The matrix-vector expand (a few tokens per program, whole rank per tile) against the
    twin: segments longer than block_m, ragged widths, mixed ranks with rank 0."""
    sgmm = _sgmm()
    case = make_case(
        t=11, h=24, s=4, r_max=24, ranks=[24, 7, 0, 16], out_sizes=(40, 9, 33), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=block_m * 10 + n_blocks,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 4)
    cfg = sgmm.SgmmConfig(block_m, 16, 32, num_warps=4, num_stages=2, n_blocks=n_blocks,
                          gemv=True)  # fmt: skip
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        shrink_cfg=sgmm.shrink_config(11, 24, 24), expand_cfg=cfg,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="block_k >= R_max"):
        sgmm.add_lora(
            got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            expand_cfg=sgmm.SgmmConfig(1, 16, 16, gemv=True),
        )  # fmt: skip


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
                  fused_cfg=False)  # fmt: skip
    for bm, bn, nb in ((1, 256, 1), (4, 512, 2)):
        got = case.out.clone()
        cfg = sgmm.SgmmConfig(bm, bn, max(16, r), n_blocks=nb, gemv=True)
        sgmm.add_lora(got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      shrink_cfg=sgmm.shrink_config(t, 4096, r), expand_cfg=cfg)  # fmt: skip
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(got, tiles, rtol=rtol, atol=atol)
