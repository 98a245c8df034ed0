"""Split-K shrink (several programs share one tile's reduction over H) against the twins.

CPU (CI): the real kernels under TRITON_INTERPRET=1 with explicit small tiles, so tiny shapes
take the split path: odd hidden sizes (2049, 4104), ranks spanning several rank tiles and rank
0 in one batch, base tokens (-1), 1-3 slices, a NaN-poisoned ``v`` whose unpromised entries
must stay NaN, bit-identical repeats, and the arrival counters back at zero after each launch.
``gpu``: the table's configs and forced splits on real shapes, and CUDA-graph replay.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import Case, defined_v_mask, make_case, tolerance

from adaptermesh.kernels import _workspace, reference, sgmm_config
from adaptermesh.kernels.meta import build_segment_meta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sgmm():  # type: ignore[no-untyped-def]
    from adaptermesh.kernels import sgmm

    return sgmm


def _counters_idle() -> bool:
    pairs = list(_workspace._cache.values()) + _workspace._captured
    return all(int(c.abs().sum()) == 0 for c, _p in pairs)


def check_split(case: Case, dtype: torch.dtype, shrink_cfg, expand_cfg=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    sgmm = _sgmm()
    n_slices, s, r_max, _h = case.lora_a.shape
    t = case.x.shape[0]
    meta = build_segment_meta(case.slots, s)
    v = torch.full((n_slices, t, r_max), float("nan"), device=case.x.device)
    sgmm.sgmm_shrink(case.x, case.lora_a, case.ranks, meta, out=v, config=shrink_cfg)
    v_ref = reference.sgmm_shrink_ref(case.x, case.lora_a, case.ranks, meta)
    mask = defined_v_mask(case, n_slices)
    rtol, atol = tolerance(dtype, "v")
    torch.testing.assert_close(v[mask], v_ref[mask], rtol=rtol, atol=atol)
    # Base rows and columns past a token's rank stay unwritten, as documented.
    assert bool(v[~mask].isnan().all())
    assert _counters_idle()
    # Same inputs, same bits: the partials are added in split order, whoever finishes last.
    v2 = torch.full_like(v, float("nan"))
    sgmm.sgmm_shrink(case.x, case.lora_a, case.ranks, meta, out=v2, config=shrink_cfg)
    assert torch.equal(v[mask], v2[mask])
    got = case.out.clone()
    sgmm.add_lora(
        got, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
        shrink_cfg=shrink_cfg, expand_cfg=expand_cfg,
    )  # fmt: skip
    want = case.out.clone()
    reference.add_lora_ref(want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta)
    rtol, atol = tolerance(dtype, "out")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    slots = case.slots.long()
    rank_t = torch.where(slots >= 0, case.ranks.long()[slots.clamp(min=0)], 0)
    assert torch.equal(got[rank_t == 0], case.out[rank_t == 0])
    assert _counters_idle()
    return v


def _cfg(bm: int, bn: int, bk: int, split: int, prefetch: bool = False):  # type: ignore[no-untyped-def]
    return _sgmm().SgmmConfig(bm, bn, bk, num_warps=4, num_stages=2, split_k=split,
                              prefetch_out=prefetch)  # fmt: skip


# --------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize(
    ("h", "block_k", "split", "ranks", "mix"),
    [
        (2049, 128, 4, [32, 5, 0, 17], "with_base"),  # 17 steps in 4 splits of 5, 5, 5, 2
        (4104, 256, 3, [32, 0, 17], "uniform"),  # 17 steps in 3 splits of 6, 6, 5
        (2049, 256, 64, [32, 9], "skewed"),  # more splits asked than steps: 9 of one step
    ],
)
def test_split_matches_twin_odd_hidden(
    h: int, block_k: int, split: int, ranks: list[int], mix: str
) -> None:
    n_slices = len(ranks) - 1
    sizes = (24, 8, 16)[:n_slices]
    case = make_case(
        t=7, h=h, s=len(ranks), r_max=32, ranks=ranks, out_sizes=sizes, mix=mix,
        dtype=torch.bfloat16, device=DEVICE, seed=zlib.crc32(f"{h}{split}{mix}".encode()),
    )  # fmt: skip
    check_split(case, torch.bfloat16, _cfg(16, 16, block_k, split), _cfg(16, 16, 32, 1, True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_split_other_dtypes_and_all_base(dtype: torch.dtype) -> None:
    for mix in ("zipf", "all_base"):
        case = make_case(
            t=5, h=300, s=3, r_max=16, ranks=[16, 3, 9], out_sizes=(16,), mix=mix,
            dtype=dtype, device=DEVICE, seed=zlib.crc32(f"{dtype}{mix}".encode()),
        )  # fmt: skip
        check_split(case, dtype, _cfg(16, 16, 32, 5))


def test_split_plan_shapes_only() -> None:
    sgmm = _sgmm()
    dev = torch.device("cpu")
    cfg = _cfg(16, 16, 128, 16)
    assert sgmm.split_plan(cfg, 4096, 2, dev) == (16, 256)
    assert sgmm.split_plan(cfg, 2049, 2, dev) == (9, 256)  # 17 steps: 9 splits of 2, none empty
    assert sgmm.split_plan(cfg, 100, 2, dev) == (1, 128)  # one step: nothing to split
    # A grid that already has 4 programs per SM (132 SMs off CUDA) is not split further.
    assert sgmm.split_plan(cfg, 4096, 4 * 132, dev)[0] == 1
    assert sgmm.split_plan(cfg, 4096, 100, dev)[0] == 5
    for h in (1, 127, 129, 2049, 4104, 14336):
        for want in (1, 2, 3, 7, 32):
            split, per = sgmm.split_plan(_cfg(16, 16, 64, want), h, 1, dev)
            assert 1 <= split <= want
            assert per % 64 == 0
            assert (split - 1) * per < h <= split * per  # every split has work


def test_table_covers_every_bucket() -> None:
    for t in (1, 16, 17, 64, 65, 256, 257, 4096, 100_000):
        for r in (1, 16, 32, 33, 64, 128):
            s_cfg = sgmm_config.shrink_config(t, 4096, r)
            e_cfg = sgmm_config.expand_config(t, 4096, r)
            tile = min(max(16, 1 << (r - 1).bit_length()), 64)
            if s_cfg.gemv:  # the decode rows: a few rank rows per program, no split
                assert t <= 16
                assert r <= 32
                assert s_cfg.block_n & (s_cfg.block_n - 1) == 0
                assert s_cfg.split_k == 1
            else:
                assert s_cfg.block_n == tile
            whole = e_cfg.gemv or e_cfg.hoist_v  # the whole rank in one tile
            assert e_cfg.block_k == (max(16, 1 << (r - 1).bit_length()) if whole else tile)
            assert e_cfg.split_k == 1


@pytest.mark.parametrize(("field", "value"), [("block_k", 48), ("block_m", 8), ("split_k", 0)])
def test_bad_config_raises(field: str, value: int) -> None:
    sgmm = _sgmm()
    case = make_case(
        t=4, h=32, s=2, r_max=16, ranks=None, out_sizes=(8,), mix="uniform",
        dtype=torch.bfloat16, device=DEVICE, seed=2,
    )  # fmt: skip
    meta = build_segment_meta(case.slots, 2)
    args = {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 2, field: value}
    cfg = sgmm_config.SgmmConfig(
        args["block_m"], args["block_n"], args["block_k"], split_k=args["split_k"]
    )
    with pytest.raises(ValueError, match=f"config.{field}"):
        sgmm.sgmm_shrink(case.x, case.lora_a, case.ranks, meta, config=cfg)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 256])
@pytest.mark.parametrize("h", [2049, 4104])
@pytest.mark.parametrize("ranks", ["16", "64", "mixed"])
def test_gpu_split_real_shapes(t: int, h: int, ranks: str) -> None:
    r_max = 128 if ranks == "mixed" else int(ranks)
    s = 8
    rank_list = [(1, 8, 16, 64, 128, 0, 33, 128)[i] for i in range(s)] if ranks == "mixed" else None
    case = make_case(
        t=t, h=h, s=s, r_max=r_max, ranks=rank_list, out_sizes=(4096, 1024, 1024),
        mix="with_base" if t > 1 else "identical", dtype=torch.bfloat16, device="cuda",
        seed=zlib.crc32(f"{t}{h}{ranks}".encode()),
    )  # fmt: skip
    check_split(case, torch.bfloat16, None)  # the table's choice for this shape
    bn = min(max(16, 1 << (r_max - 1).bit_length()), 64)
    for split in (7, 32):
        check_split(case, torch.bfloat16, sgmm_config.SgmmConfig(16, bn, 128, split_k=split))


@pytest.mark.gpu
def test_gpu_split_graph_replay() -> None:
    """A captured split-K add_lora replays correctly with new metadata, many times."""
    sgmm = _sgmm()
    case = make_case(
        t=16, h=4096, s=4, r_max=64, ranks=[64, 16, 0, 40], out_sizes=(4096,),
        mix="uniform", dtype=torch.bfloat16, device="cuda", seed=99,
    )  # fmt: skip
    cfg = sgmm_config.SgmmConfig(16, 64, 128, split_k=16)
    meta = build_segment_meta(case.slots, 4)
    v = torch.empty(1, 16, 64, device="cuda")
    out = case.out.clone()

    def run() -> None:
        sgmm.add_lora(out, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta,
                      v_buffer=v, shrink_cfg=cfg, check_values=False)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: compiles and creates the workspace the capture reuses
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(20):
        slots = torch.randint(-1, 4, (16,), device="cuda", generator=gen, dtype=torch.int32)
        build_segment_meta(slots, 4, out=meta)
        out.copy_(case.out)
        graph.replay()
        want = case.out.clone()
        reference.add_lora_ref(
            want, case.x, case.lora_a, case.lora_b, case.scales, case.ranks, meta
        )
        rtol, atol = tolerance(torch.bfloat16, "out")
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    torch.cuda.synchronize()
    assert _counters_idle()
