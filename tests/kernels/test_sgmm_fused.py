"""SGMM in one launch (shrink and expand fused) and the expand as a programmatic dependent
launch (PDL).

CPU (CI): the fused kernel under TRITON_INTERPRET=1 against the torch twin on fresh random
inputs (Hypothesis): ragged H and output sizes, ranks with 0 in a mixed pool, base tokens,
1-3 slices, every config axis. Refusals before any launch. ``gpu``: fused and PDL launches
against the two-launch path on real shapes, in eager, through a plan and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import MIXES, make_case, tolerance

from adaptermesh.kernels import reference, sgmm_config
from adaptermesh.kernels.meta import build_segment_meta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sgmm():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels import sgmm

    return sgmm


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 40),
    h=st.integers(1, 70),
    s=st.integers(1, 5),
    r_max=st.sampled_from([1, 4, 16, 24, 40]),
    n_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
    block_k=st.sampled_from([16, 32]),
    n_blocks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_twin(  # type: ignore[no-untyped-def]
    t, h, s, r_max, n_sizes, mix, block_m, block_n, block_k, n_blocks, seed
) -> None:
    """Any fused config gives the twin's result; base rows and rank-0 slots keep their bits."""
    sgmm = _sgmm()
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, r_max + 1, (s,), generator=gen).tolist()
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_sizes), mix=mix,
        dtype=torch.float32, device=DEVICE, seed=seed,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    cfg = sgmm_config.SgmmConfig(block_m, block_n, block_k, n_blocks=n_blocks, fused=True)
    got = case.out.clone()
    plan = sgmm.plan_add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta, fused_cfg=cfg
    )
    assert plan.launches == 1
    plan()
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    slots = case.slots.long()
    rank_t = torch.where(slots >= 0, case.ranks.long()[slots.clamp(min=0)], 0)
    assert torch.equal(got[rank_t == 0], case.out[rank_t == 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_precision_matches_twin(dtype: torch.dtype) -> None:
    """bf16/fp16: v is rounded to the weight dtype before the expand, as in two launches."""
    sgmm = _sgmm()
    case = make_case(
        t=37, h=96, s=4, r_max=32, ranks=[32, 8, 0, 17], out_sizes=(48, 20, 20), mix="zipf",
        dtype=dtype, device=DEVICE, seed=11,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 4)
    got = case.out.clone()
    sgmm.add_lora(got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                  fused_cfg=sgmm_config.SgmmConfig(16, 32, 32, n_blocks=2, fused=True))  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    rtol, atol = tolerance(dtype, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_fused_refusals_before_launch() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=5, h=32, s=2, r_max=16, ranks=None, out_sizes=(16,), mix="uniform",
        dtype=torch.float32, device=DEVICE, seed=1,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 2)
    args = (case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    out = case.out.clone()
    with pytest.raises(ValueError, match="fused=True"):
        sgmm.add_lora(out, *args, fused_cfg=sgmm_config.SgmmConfig(16, 16, 16), fused=None)
    with pytest.raises(ValueError, match="no gemv or split_k"):
        sgmm.add_lora(
            out, *args, fused_cfg=sgmm_config.SgmmConfig(16, 16, 16, fused=True, split_k=2)
        )
    with pytest.raises(ValueError, match="power of two"):
        sgmm.add_lora(out, *args, fused_cfg=sgmm_config.SgmmConfig(16, 24, 16, fused=True))
    if not sgmm_config.fused_config(5, 32, 16, 16, 2):
        with pytest.raises(ValueError, match="needs fused_cfg"):
            sgmm.add_lora(out, *args, fused=True)
    assert torch.equal(out, case.out)  # nothing ran
    big = make_case(
        t=3, h=16, s=1, r_max=256, ranks=None, out_sizes=(16,), mix="uniform",
        dtype=torch.float32, device=DEVICE, seed=2,
    )  # fmt: skip
    bmeta = build_segment_meta(big.slots, 1)
    with pytest.raises(ValueError, match="R_max must be <= 128"):
        sgmm.add_lora(big.out.clone(), big.x, big.lora_a, big.lora_b, big.scales, big.ranks,
                      bmeta, fused_cfg=sgmm_config.SgmmConfig(16, 16, 16, fused=True))  # fmt: skip
    assert sgmm_config.fused_config(3, 16, 16, 256) is None


def test_plan_steps_needs_two_launches() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=4, h=16, s=1, r_max=16, ranks=None, out_sizes=(16,), mix="uniform",
        dtype=torch.float32, device=DEVICE, seed=3,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 1)
    plan = sgmm.plan_add_lora(case.out.clone(), case.x, case.lora_a, case.lora_b, case.scales,
                              case.ranks, meta,
                              fused_cfg=sgmm_config.SgmmConfig(16, 16, 16, fused=True))  # fmt: skip
    with pytest.raises(ValueError, match="fused=False"):
        plan.steps()
    two = sgmm.plan_add_lora(case.out.clone(), case.x, case.lora_a, case.lora_b, case.scales,
                             case.ranks, meta, fused=False, pdl=False)  # fmt: skip
    assert len(two.steps()) == 2


def test_pdl_off_the_gpu() -> None:
    """No programmatic dependent launch on CPU or under the interpreter."""
    sgmm = _sgmm()
    assert not sgmm.pdl_available(torch.device("cpu"))


# --------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 1, 16), (16, 1, 16), (16, 16, 16), (64, 8, 16), (256, 64, 64), (4096, 1, 16),
              (4096, 64, 64), (300, 7, 32)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s", "r"), GPU_SHAPES)
def test_gpu_fused_and_pdl_match_two_launches(t: int, s: int, r: int) -> None:
    """Fused and PDL launches against the plain two launches, eager, planned and graphed;
    mixed ranks with 0 and base tokens."""
    sgmm = _sgmm()
    ranks = [(r, max(1, r // 2), 0)[i % 3] for i in range(s)] if s > 2 else None
    case = make_case(
        t=t, h=4096, s=s, r_max=r, ranks=ranks, out_sizes=(4096, 1024, 1024), mix="with_base",
        dtype=torch.bfloat16, device="cuda", seed=t * 31 + s + r,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, s)
    args = (case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    plain = case.out.clone()
    sgmm.add_lora(plain, *args, fused=False, pdl=False)
    want = case.out.clone()
    reference.add_lora_ref(want, *args)
    rtol, atol = tolerance(torch.bfloat16, "out")
    torch.testing.assert_close(plain, want, rtol=rtol, atol=atol)
    assert sgmm.pdl_available(case.x.device)
    pdl = case.out.clone()
    sgmm.add_lora(pdl, *args, fused=False, pdl=True)
    assert torch.equal(pdl, plain)  # same kernels, same order of sums
    for cfg in (sgmm_config.SgmmConfig(16, 128, 128, n_blocks=1, fused=True),
                sgmm_config.SgmmConfig(32, 256, 64, n_blocks=4, num_warps=8, fused=True)):  # fmt: skip
        got = case.out.clone()
        sgmm.add_lora(got, *args, fused_cfg=cfg)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # A plan and a CUDA graph of the default path (PDL on) replay to the eager result.
    planned = case.out.clone()
    sgmm.plan_add_lora(planned, *args)()
    graphed = case.out.clone()
    v = torch.empty(3, t, r, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sgmm.add_lora(graphed.clone(), *args, v_buffer=v)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        sgmm.add_lora(graphed, *args, v_buffer=v)
    eager = case.out.clone()
    sgmm.add_lora(eager, *args)
    graphed.copy_(case.out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager)
    assert torch.equal(planned, eager)


def test_fused_config_guards() -> None:
    """The table's one fused row applies only where it measured faster: long batches of low
    rank, H <= 4096, and a grid of at least two programs per SM (qkv and gate_up, not o)."""
    qkv = sgmm_config.fused_config(4096, 4096, 4096, 16, 1, n_slices=3)
    assert qkv is not None
    assert qkv.fused
    assert sgmm_config.fused_config(4096, 4096, 11008, 16, 64, n_slices=2) is not None  # gate_up
    assert sgmm_config.fused_config(4096, 4096, 4096, 16, 1, n_slices=1) is None  # o: 128 programs
    assert sgmm_config.fused_config(4096, 11008, 4096, 16, 1, n_slices=3) is None  # down's long H
    assert sgmm_config.fused_config(256, 4096, 4096, 16, 64, n_slices=3) is None  # decode shapes
    assert sgmm_config.fused_config(4096, 4096, 4096, 64, 1, n_slices=3) is None  # no high-rank row
    assert sgmm_config.fused_config(4096, 4096, 4096, 256, 1, n_slices=3) is None


@pytest.mark.parametrize("pdl", [False, True])
def test_every_constexpr_is_bound(pdl: bool) -> None:
    """A prepared launch binds every kernel argument, constexprs with defaults included (its
    launcher takes them all): each launch passes exactly the kernel's parameters."""
    sgmm = _sgmm()
    case = make_case(
        t=9, h=40, s=3, r_max=16, ranks=[16, 5, 0], out_sizes=(24, 8), mix="with_base",
        dtype=torch.float32, device=DEVICE, seed=5,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 3)
    seen: list[tuple[object, int]] = []

    def record(kernel, grid, args, consts, **kw):  # type: ignore[no-untyped-def]
        seen.append((kernel, len(args) + len(consts)))
        return lambda: None

    configs = [
        dict(shrink_cfg=sgmm_config.SgmmConfig(16, 16, 16, split_k=2),
             expand_cfg=sgmm_config.SgmmConfig(16, 16, 16)),
        dict(shrink_cfg=sgmm_config.SgmmConfig(1, 4, 16, gemv=True),
             expand_cfg=sgmm_config.SgmmConfig(1, 16, 16, gemv=True)),
        dict(fused_cfg=sgmm_config.SgmmConfig(16, 16, 16, fused=True)),
    ]  # fmt: skip
    for cfg in configs:
        sgmm._add_lora(
            case.out.clone(), case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
            None, cfg.get("shrink_cfg"), cfg.get("expand_cfg"), None, True, record,
            cfg.get("fused_cfg"), None, pdl,
        )  # fmt: skip
    assert len(seen) == 5
    for kernel, n in seen:
        assert n == len(kernel.arg_names), (kernel.fn.__name__, n, len(kernel.arg_names))
