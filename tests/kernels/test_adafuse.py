"""AdaFuse: router top-k, the fused merge/switch against its torch twin, drift, gated SGMM.

CPU (CI): the real kernels under TRITON_INTERPRET=1 (fp32 dots there). The switch runs on
ragged module shapes (rows and columns not multiples of the tile), odd and 16-byte-aligned
row lengths, mixed ranks per module, top-k 1..3 with absent experts (-1), every launch-time
specialisation (even / ragged tiles, aligned / unaligned rows, uniform / mixed ranks), and in
both modes; exact mode is bit-identical to the backbone after any switches and an unmerge.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import tolerance

from adaptermesh.kernels import dispatch, fuse_config, fuse_kernels, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF = torch.bfloat16
# Switches the drift test runs: 1,000 on the GPU; fewer in the CPU interpreter.
SWITCHES = 1000 if torch.cuda.is_available() else 60
SCALE = 0.5
# Small tilings so that test shapes span several programs, ragged at both edges.
SMALL_CONFIGS = (
    fuse_config.SwitchConfig(16, 16, 2, 4, 2),
    fuse_config.SwitchConfig(32, 32, 1, 4, 1),
    fuse_config.SwitchConfig(16, 64, 3, 4, 3),
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _targets(
    shapes: Sequence[tuple[int, int]],
    experts: int,
    ranks: int | Sequence[int],
    seed: int,
    exact: bool,
) -> list[fuse_config.MergeTarget]:
    """One MergeTarget per (N, K), with ``experts`` random experts of its rank."""
    g = _gen(seed)
    rank_list = [ranks] * len(shapes) if isinstance(ranks, int) else list(ranks)
    out = []
    for (n, k), r in zip(shapes, rank_list, strict=True):
        w = torch.randn(n, k, generator=g).to(DEVICE, BF)
        a = (torch.randn(experts, r, k, generator=g) / k**0.5).to(DEVICE, BF)
        b = (torch.randn(experts, n, r, generator=g) / r**0.5).to(DEVICE, BF)
        out.append(fuse_config.MergeTarget(w, a, b, SCALE, master=w.clone() if exact else None))
    return out


def _delta(t: fuse_config.MergeTarget, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    return reference._selection_delta_ref(t.lora_a, t.lora_b, ids, gates)


def _ulp_bound(t: fuse_config.MergeTarget, w0: torch.Tensor) -> torch.Tensor:
    """Per-element upper bound on the bf16 ulp of any merged weight: gates sum to 1, so
    |W0 + c * sum g B A| <= |W0| + c * max_e |B_e A_e|; ulp(y) <= |y| * 2^-7."""
    per_expert = torch.stack(
        [b.float() @ a.float() for a, b in zip(t.lora_a, t.lora_b, strict=True)]
    )
    mag = w0.float().abs() + t.scale * per_expert.abs().amax(0)
    return mag.clamp(min=2**-126) * 2**-7


def _selection(experts: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(experts, generator=g)[:k].to(torch.int32)
    gates = torch.softmax(torch.randn(k, generator=g), 0)
    return ids.to(DEVICE), gates.to(DEVICE)


def _assert_twin(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = tolerance(BF, "out")
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- router
@pytest.mark.parametrize(("t", "h", "e", "k"), [(37, 70, 8, 2), (5, 33, 6, 1), (16, 64, 16, 4)])
def test_router_topk_matches_twin(t: int, h: int, e: int, k: int) -> None:
    g = _gen(t * h + e)
    hs = torch.randn(t, h, generator=g).to(DEVICE, BF)
    w = torch.randn(e, h, generator=g).to(DEVICE, BF)
    b = torch.randn(e, generator=g).to(DEVICE, BF)
    ids, gates = dispatch.route(hs, w, b, k, backend="triton")
    ids_ref, gates_ref = reference.route_ref(hs, w, b, k)
    # Compare only where the k-th and (k+1)-th logits are not a near tie.
    logits = hs.float() @ w.float().T + b.float()
    srt = logits.sort(dim=-1, descending=True).values
    clear = (srt[:, k - 1] - srt[:, k]).abs() > 1e-3 if k < e else torch.ones(t, dtype=torch.bool)
    assert int(clear.sum()) >= t // 2
    assert torch.equal(ids[clear], ids_ref[clear])
    torch.testing.assert_close(gates[clear], gates_ref[clear], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gates.sum(-1), torch.ones(t, device=DEVICE), rtol=1e-5, atol=1e-5)


def test_router_bad_input() -> None:
    hs = torch.randn(3, 8, dtype=BF)
    with pytest.raises(ValueError, match="top_k"):
        dispatch.route(hs, torch.randn(4, 8, dtype=BF), None, 5)
    with pytest.raises(ValueError, match="weight must be"):
        dispatch.route(hs, torch.randn(4, 9, dtype=BF), None, 2)
    with pytest.raises(ValueError, match="bias must be"):
        dispatch.route(hs, torch.randn(4, 8, dtype=BF), torch.zeros(3, dtype=BF), 2)


# --------------------------------------------------------------------------- merge / switch
SHAPES = [(24, 40), (40, 24), (33, 17), (24, 40)]


@pytest.mark.parametrize("exact", [True, False])
def test_fused_merge_matches_twin_and_unmerge(exact: bool) -> None:
    tg = _targets(SHAPES, experts=4, ranks=8, seed=1, exact=exact)
    w0 = [t.weight.clone() for t in tg]
    table = fuse_config.build_merge_table(tg, exact=exact)
    ids, gates = _selection(4, 2, _gen(2))
    dispatch.fused_merge(table, ids, gates, backend="triton")
    for t, w in zip(tg, w0, strict=True):
        _assert_twin(t.weight, w.float() + SCALE * _delta(t, ids, gates))
    dispatch.fused_unmerge(table, backend="triton")
    for t, w in zip(tg, w0, strict=True):
        if exact:
            assert torch.equal(t.weight, w)  # bit-exact restore
        else:  # one rounding on merge, one on unmerge
            assert bool(((t.weight.float() - w.float()).abs() <= 2 * _ulp_bound(t, w)).all())


# Ragged shapes (rows and columns off the tile), odd row lengths (unaligned) and 16-byte rows.
RAGGED = [(37, 53), (16, 40), (70, 24), (5, 130), (33, 17)]


@pytest.mark.parametrize(
    "config", SMALL_CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.chunks}"
)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_switch_ragged_mixed_ranks_exact(config: fuse_config.SwitchConfig, top_k: int) -> None:
    """Two switches, each equal to round(W0 + c * Delta) as the twin computes it, then an
    unmerge restores W0 bit for bit. Ranks differ per module (masked rank columns)."""
    tg = _targets(RAGGED, experts=5, ranks=[3, 16, 8, 20, 1], seed=10 + top_k, exact=True)
    w0 = [t.weight.clone() for t in tg]
    table = fuse_config.build_merge_table(tg, exact=True)
    g = _gen(20 + top_k)
    for _ in range(2):
        ids, gates = _selection(5, top_k, g)
        dispatch.fused_switch(table, ids, gates, backend="triton", config=config)
        for t, w in zip(tg, w0, strict=True):
            _assert_twin(t.weight, w.float() + SCALE * _delta(t, ids, gates))
    dispatch.fused_unmerge(table, backend="triton", config=config)
    assert all(torch.equal(t.weight, w) for t, w in zip(tg, w0, strict=True))


@pytest.mark.parametrize("exact", [True, False])
def test_switch_even_aligned_uniform_rank(exact: bool) -> None:
    """Every module a multiple of the tile, 16-byte rows, one rank (the 7B-like launch: no
    weight masks, vector hints on): twin on merge, absent experts (-1) skipped."""
    cfg = fuse_config.SwitchConfig(16, 16, 2, 4, 2)
    tg = _targets([(32, 48), (16, 16), (48, 32)], experts=4, ranks=16, seed=30, exact=exact)
    w0 = [t.weight.clone() for t in tg]
    table = fuse_config.build_merge_table(tg, exact=exact)
    assert table.aligned
    _, meta = fuse_kernels.switch_launch_args(table, 2, 2, cfg)
    assert [meta[f] for f in ("EVEN_M", "EVEN_N", "EVEN_R", "ALIGNED")] == [True] * 4
    ids = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    gates = torch.tensor([0.7, 0.3], device=DEVICE)
    dispatch.fused_switch(table, ids, gates, backend="triton", config=cfg)
    for t, w in zip(tg, w0, strict=True):
        _assert_twin(t.weight, w.float() + SCALE * _delta(t, ids, gates))
    prev = [t.weight.float() for t in tg]
    ids2, gates2 = _selection(4, 2, _gen(31))
    dispatch.fused_switch(table, ids2, gates2, backend="triton", config=cfg)
    for t, w, p in zip(tg, w0, prev, strict=True):
        base = w.float() if exact else p - SCALE * _delta(t, ids, gates)
        _assert_twin(t.weight, base + SCALE * _delta(t, ids2, gates2))


def test_delta_mode_ragged_matches_twin() -> None:
    """Delta mode on ragged tiles and mixed ranks: W = round(W + c * (D_new - D_old))."""
    cfg = SMALL_CONFIGS[0]
    tg = _targets(RAGGED[:3], experts=4, ranks=[5, 16, 9], seed=40, exact=False)
    table = fuse_config.build_merge_table(tg, exact=False)
    ids, gates = _selection(4, 2, _gen(41))
    dispatch.fused_switch(table, ids, gates, backend="triton", config=cfg)
    prev = [t.weight.float() for t in tg]
    ids2, gates2 = _selection(4, 3, _gen(42))
    dispatch.fused_switch(table, ids2, gates2, backend="triton", config=cfg)
    for t, p in zip(tg, prev, strict=True):
        _assert_twin(t.weight, p + SCALE * (_delta(t, ids2, gates2) - _delta(t, ids, gates)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=3),
    rank_seed=st.integers(0, 2**16),
    experts=st.integers(2, 5),
    top_k=st.integers(1, 3),
    absent=st.booleans(),
    config=st.sampled_from(SMALL_CONFIGS),
    exact=st.booleans(),
)
def test_switch_property(  # type: ignore[no-untyped-def]
    shapes, rank_seed, experts, top_k, absent, config, exact
) -> None:
    """Any shapes, ranks, selections and tiling: the switch equals its twin, and an unmerge
    restores the backbone (bit for bit in exact mode, within two roundings in delta mode)."""
    g = _gen(rank_seed)
    ranks = torch.randint(1, 21, (len(shapes),), generator=g).tolist()
    tg = _targets(shapes, experts, ranks, seed=rank_seed, exact=exact)
    w0 = [t.weight.clone() for t in tg]
    table = fuse_config.build_merge_table(tg, exact=exact)
    ids, gates = _selection(experts, min(top_k, experts), g)
    if absent:
        ids[0] = -1
    dispatch.fused_switch(table, ids, gates, backend="triton", config=config)
    for t, w in zip(tg, w0, strict=True):
        _assert_twin(t.weight, w.float() + SCALE * _delta(t, ids, gates))
    dispatch.fused_unmerge(table, backend="triton", config=config)
    for t, w in zip(tg, w0, strict=True):
        if exact:
            assert torch.equal(t.weight, w)
        else:
            assert bool(((t.weight.float() - w.float()).abs() <= 2 * _ulp_bound(t, w)).all())


@pytest.mark.parametrize(
    "config",
    [fuse_config.DEFAULT_SWITCH_CONFIG, *fuse_config.SWITCH_CANDIDATES[1:3], *SMALL_CONFIGS],
)
def test_switch_plan_covers_every_element_once(config: fuse_config.SwitchConfig) -> None:
    """The launch table (host only): every weight element belongs to exactly one program."""
    tg = _targets([(37, 53), (300, 17), (64, 512)], experts=2, ranks=4, seed=50, exact=False)
    table = fuse_config.build_merge_table(tg, exact=False)
    plan, _ = fuse_kernels.switch_launch_args(table, 1, 1, config)
    seen = [torch.zeros(n, k, dtype=torch.int32) for n, k, _ in table.shapes]
    span = config.block_m * config.chunks
    for mod, row0, col0 in plan.tiles.cpu().tolist():
        seen[mod][row0 : row0 + span, col0 : col0 + config.block_n] += 1
    assert all(bool((s == 1).all()) for s in seen)
    assert plan.num_programs == plan.tiles.shape[0]
    assert fuse_kernels.switch_launch_args(table, 1, 1, config)[0] is plan  # built once per config


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False])
def test_random_switches_do_not_drift(exact: bool) -> None:
    """SWITCHES random top-2 switches with one launch each, then back to the backbone.

    Exact mode: bit-identical to the original. Delta mode: every element within
    (SWITCHES + 1) ulps of the largest merged magnitude (one rounding per switch, each at most
    one ulp even when rounding toward zero); the measured figure is in docs/kernels.md."""
    tg = _targets(SHAPES[:3], experts=8, ranks=16, seed=3, exact=exact)
    w0 = [t.weight.clone() for t in tg]
    table = fuse_config.build_merge_table(tg, exact=exact)
    g = _gen(4)
    for i in range(SWITCHES):
        ids, gates = _selection(8, 2, g)
        dispatch.fused_switch(table, ids, gates, backend="triton")
        if i % 20 == 0 and exact:  # the merged state is always round(W0 + delta)
            for t, w in zip(tg, w0, strict=True):
                _assert_twin(t.weight, w.float() + SCALE * _delta(t, ids, gates))
    dispatch.fused_unmerge(table, backend="triton")
    worst = 0.0
    for t, w in zip(tg, w0, strict=True):
        drift = ((t.weight.float() - w.float()).abs() / _ulp_bound(t, w)).max().item()
        worst = max(worst, drift)
        if exact:
            assert torch.equal(t.weight, w)
    if not exact:
        assert worst <= SWITCHES + 1, worst
    if os.environ.get("ADAPTERMESH_DRIFT_REPORT"):
        print(f"DRIFT exact={exact} switches={SWITCHES} worst_ulp={worst:.1f}")


def test_switch_bad_input() -> None:
    tg = _targets(SHAPES[:1], experts=4, ranks=8, seed=5, exact=True)
    table = fuse_config.build_merge_table(tg)
    good_g = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="new_ids must lie"):
        dispatch.fused_switch(table, torch.tensor([4], dtype=torch.int32, device=DEVICE), good_g)
    with pytest.raises(ValueError, match="new_ids must be"):
        dispatch.fused_switch(table, torch.tensor([1], device=DEVICE), good_g)
    with pytest.raises(ValueError, match="new_gates"):
        dispatch.fused_switch(
            table, torch.tensor([1], dtype=torch.int32, device=DEVICE), good_g.double()
        )
    bad = fuse_config.MergeTarget(tg[0].weight, tg[0].lora_a, tg[0].lora_b, 1.0, master=None)
    with pytest.raises(ValueError, match="master"):
        fuse_config.build_merge_table([bad], exact=True)
    wrong_b = fuse_config.MergeTarget(tg[0].weight, tg[0].lora_a, tg[0].lora_b[:, :5], 1.0)
    with pytest.raises(ValueError, match="lora_b"):
        fuse_config.build_merge_table([wrong_b], exact=False)
    with pytest.raises(ValueError, match="power of two"):
        fuse_config.SwitchConfig(24, 256)
    with pytest.raises(ValueError, match="bad switch config"):
        fuse_config.SwitchConfig(32, 256, chunks=0)


# --------------------------------------------------------------------------- gated SGMM + module
def test_gated_add_lora_matches_twin() -> None:
    g = _gen(9)
    t, k, n, e, r = 11, 40, 36, 5, 8
    x = torch.randn(t, k, generator=g).to(DEVICE, BF)
    a = (torch.randn(e, r, k, generator=g) / k**0.5).to(DEVICE, BF)
    b = (torch.randn(e, n, r, generator=g) / r**0.5).to(DEVICE, BF)
    ids = torch.randint(-1, e, (t, 2), generator=g, dtype=torch.int32).to(DEVICE)
    gates = torch.rand(t, 2, generator=g).to(DEVICE)
    out = torch.randn(t, n, generator=g).to(DEVICE, BF)
    got, want = out.clone(), out.clone()
    dispatch.gated_add_lora(got, x, a, b, ids, gates, 1.5, backend="triton")
    reference.gated_add_lora_ref(want, x, a, b, ids, gates, 1.5)
    rtol, atol = tolerance(BF, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="expert_ids must lie"):
        dispatch.gated_add_lora(got, x, a, b, ids + 10, gates, 1.5, backend="triton")


@torch.no_grad()
def test_merged_and_gated_paths_agree() -> None:
    """Batch-1 decode on merged weights and the gated SGMM path on the backbone compute the
    same layer: x @ (W0 + c * sum g B A).T, up to bf16 rounding of W' vs of the low-rank terms."""
    (t,) = _targets([(24, 32)], experts=4, ranks=8, seed=12, exact=True)
    w0 = t.weight.clone()
    table = fuse_config.build_merge_table([t])
    g = _gen(13)
    x = torch.randn(1, 32, generator=g).to(DEVICE, BF)
    rw = torch.randn(4, 32, generator=g).to(DEVICE, BF)
    ids, gates = dispatch.route(x, rw, None, 2, backend="triton")
    dispatch.fused_switch(table, ids[0].contiguous(), gates[0].contiguous(), backend="triton")
    merged = x @ t.weight.T
    dispatch.fused_unmerge(table, backend="triton")
    assert torch.equal(t.weight, w0)
    gated = x @ t.weight.T
    dispatch.gated_add_lora(gated, x, t.lora_a, t.lora_b, ids, gates, SCALE, backend="triton")
    want = x.float() @ (w0.float() + SCALE * _delta(t, ids[0], gates[0])).T
    for got in (merged, gated):
        rel = float((got.float() - want).norm() / want.norm())
        assert rel < 2e-2, rel
