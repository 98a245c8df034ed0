"""The one-launch add_lora (``sgmm._sgmm_fused_kernel``): shrink partials, a grid barrier,
expand, in one launch.

CPU (CI): the kernel under TRITON_INTERPRET=1, where its two phases run as two launches,
against the torch twin on fresh random inputs: ragged segments, odd hidden and output sizes,
mixed ranks with rank 0, base tokens, 1-3 slices, every config knob. ``gpu``: the real
one-launch kernel (barrier included) against the twin on 7B decode shapes, inside a CUDA graph
replayed with new inputs, with the barrier counters back at 0 and its spin flag never raised.
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


def _run_case(case, s, cfg, active=None):  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    meta = build_segment_meta(case.slots, s)
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        fused_cfg=cfg, active_slots=active,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    return got, want


def test_decode_batches_take_the_one_launch_path() -> None:
    sgmm = _sgmm()
    for t, a in ((1, 1), (1, None), (16, 16), (64, None), (64, 64)):
        assert sgmm.fused_config(t, 16, a) is not None, (t, a)
    # Dense batches, long prompts and high ranks keep the pair.
    assert sgmm.fused_config(64, 16, 1) is None
    assert sgmm.fused_config(4096, 16, 64) is None
    assert sgmm.fused_config(1, 64, 1) is None


def test_plan_launches_once_per_phase() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=3, h=40, s=4, r_max=16, ranks=None, out_sizes=(24, 8), mix="distinct",
        dtype=torch.float32, device=DEVICE, seed=7,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 4)
    got = case.out.clone()
    plan = sgmm.plan_add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        fused_cfg=sgmm.FusedConfig(block_m=1, block_k=16, k_chunk=32, block_n=16),
    )  # fmt: skip
    # One launch on a GPU; the interpreter cannot wait at a barrier, so two there.
    assert plan.launches == (2 if DEVICE == "cpu" else 1)
    plan()
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_fused_config_is_refused_before_any_launch() -> None:
    sgmm = _sgmm()
    case = make_case(
        t=2, h=32, s=2, r_max=16, ranks=None, out_sizes=(16,), mix="distinct",
        dtype=torch.float32, device=DEVICE, seed=1,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 2)
    before = case.out.clone()
    for cfg, field in (
        (sgmm.FusedConfig(block_k=24), "block_k"),
        (sgmm.FusedConfig(block_k=32, k_chunk=48), "k_chunk"),
        (sgmm.FusedConfig(block_n=0), "block_n"),
    ):
        with pytest.raises(ValueError, match=field):
            sgmm.add_lora(
                case.out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                fused_cfg=cfg,
            )  # fmt: skip
        assert torch.equal(case.out, before)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 12),
    h=st.integers(1, 100),
    s=st.integers(1, 6),
    r_max=st.sampled_from([1, 4, 8, 16, 24, 32]),
    n_out=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    mix=st.sampled_from(MIXES),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    block_m=st.sampled_from([1, 2, 4]),
    block_k=st.sampled_from([16, 32]),
    chunks_per_item=st.integers(1, 3),
    block_n=st.sampled_from([16, 32, 64]),
    rank_draw=st.data(),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_twin(  # type: ignore[no-untyped-def]
    t, h, s, r_max, n_out, mix, dtype, block_m, block_k, chunks_per_item, block_n, rank_draw, seed
) -> None:
    ranks = rank_draw.draw(st.lists(st.integers(0, r_max), min_size=s, max_size=s))
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=ranks, out_sizes=tuple(n_out), mix=mix,
        dtype=dtype, device=DEVICE, seed=seed,
    )  # fmt: skip
    cfg = _sgmm().FusedConfig(
        block_m=block_m, block_k=block_k, k_chunk=block_k * chunks_per_item, block_n=block_n
    )
    got, want = _run_case(case, s, cfg)
    rtol, atol = tolerance(dtype, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_default_rows_match_twin(dtype: torch.dtype) -> None:
    """The table's own rows (block sizes as served) on a decode mix with base tokens."""
    sgmm = _sgmm()
    for t, s, mix in ((1, 3, "distinct"), (7, 16, "with_base")):
        cfg = sgmm.fused_config(t, 16, None)
        assert cfg is not None
        case = make_case(
            t=t, h=144, s=s, r_max=16, ranks=[16, 8, 0, 16, 3, 16, 16, 11, 16, 16, 5, 16, 16, 16,
                                              16, 2][:s],
            out_sizes=(136, 40, 40), mix=mix, dtype=dtype, device=DEVICE, seed=t,
        )  # fmt: skip
        got, want = _run_case(case, s, cfg)
        rtol, atol = tolerance(dtype, "out")
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "s"), [(1, 1), (4, 4), (16, 16), (16, 1), (64, 64), (64, 8)])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
def test_gpu_fused_one_launch_in_a_graph(t: int, s: int, group: str) -> None:
    """The real one-launch kernel, barrier and all, on 7B shapes, captured in a graph and
    replayed on fresh inputs; the barrier's counters are 0 after and its flag never set."""
    sgmm = _sgmm()
    h, sizes = {
        "qkv": (4096, (4096, 4096, 4096)),
        "o": (4096, (4096,)),
        "gate_up": (4096, (11008, 11008)),
        "down": (11008, (4096,)),
    }[group]
    cfg = sgmm.FusedConfig()
    pool = 32
    cases = [
        make_case(
            t=t, h=h, s=pool, r_max=16, ranks=None, out_sizes=sizes, mix="distinct",
            dtype=torch.bfloat16, device="cuda", seed=seed,
        )
        for seed in range(3)
    ]
    live = cases[0]
    x, out = live.x.clone(), live.out.clone()
    slots = live.slots[:t].remainder(s).clone()
    meta = build_segment_meta(slots, pool)
    args = (x, live.lora_a, live.lora_b, live.scales, live.ranks, meta)
    sgmm.add_lora(out, *args, fused_cfg=cfg)  # warm-up (compiles; creates the workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmm.add_lora(out, *args, fused_cfg=cfg)
    for case in cases[1:]:
        x.copy_(case.x)
        out.copy_(case.out)
        graph.replay()
        torch.cuda.synchronize()
        want = case.out.clone()
        reference.add_lora_ref(want, case.x, live.lora_a, live.lora_b, live.scales, live.ranks,
                               meta)  # fmt: skip
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    counters, _ = sgmm.fused_workspace(
        x.device, -(-h // cfg.k_chunk), len(sizes), t, 16
    )
    assert counters[:3].tolist() == [0, 0, 0]
