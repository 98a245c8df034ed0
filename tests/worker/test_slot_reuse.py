"""A slot that held one adapter and then takes another holds exactly the new one.

The upload zeroes only what the copy will not write (``written_ranks``: ranks above the
adapter's own in a group it covers whole; every group it leaves a layer or module of), and the
host pool checks each copied matrix bit for bit (``same_bits``). Any sequence of adapters of
different ranks and modules through one slot must leave it equal to a fresh pool's slot with
the last adapter alone: nothing of an earlier one stays behind.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptermesh.worker.adapters import AdapterManager, same_bits, written_ranks
from adaptermesh.worker.model import LoraPool, ModelConfig
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

MAX_RANK = 8
# name -> (rank, target modules): whole groups at the pool's rank and below it, groups left
# partly (k_proj alone of qkv, up_proj alone of gate_up), and every module.
PALETTE: dict[str, tuple[int, tuple[str, ...]]] = {
    "full8": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "full3": (3, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qv8": (8, ("q_proj", "v_proj")),
    "qkv2": (2, ("q_proj", "k_proj", "v_proj")),
    "k5up5": (5, ("k_proj", "up_proj")),
    "odown1": (1, ("o_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    root = tmp_path_factory.mktemp("slot_reuse")
    model = make_tiny_model(root / "model")
    adapters = root / "adapters"
    for seed, (name, (rank, modules)) in enumerate(PALETTE.items(), start=1):
        make_adapter(adapters, model, name, rank, modules, seed=seed)
    cfg = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    return model, adapters, cfg


def _manager(adapters: Path, cfg: ModelConfig, dtype: torch.dtype) -> AdapterManager:
    pool = LoraPool(cfg, 1, MAX_RANK, torch.device("cpu"), dtype)
    return AdapterManager(
        adapters, cfg, pool, max_rank=MAX_RANK, cpu_cache_bytes=1 << 30, dtype=dtype
    )


def _slot(pool: LoraPool) -> list[torch.Tensor]:
    return [pool.a[g].clone() for g in sorted(pool.a)] + [
        b.clone() for g in sorted(pool.b) for b in pool.b[g]
    ]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    order=st.lists(st.sampled_from(sorted(PALETTE)), min_size=2, max_size=6),
    bf16=st.booleans(),
    from_cache=st.booleans(),
)
def test_a_reused_slot_holds_only_its_last_adapter(
    files: tuple[Path, Path, ModelConfig], order: list[str], bf16: bool, from_cache: bool
) -> None:
    _, adapters, cfg = files
    dtype = torch.bfloat16 if bf16 else torch.float32

    async def run() -> None:
        reused = _manager(adapters, cfg, dtype)
        # One slot: a reload of the adapter it holds would need a second (two-phase swap).
        names = [n for k, n in enumerate(order) if k == 0 or n != order[k - 1]]
        for name in names:
            if from_cache:
                await asyncio.gather(*reused.prefetch([name]))  # the CPU cache after the first
            else:
                await reused.load(name, None)
            assert reused.is_resident(name)
            fresh = _manager(adapters, cfg, dtype)
            await fresh.load(name, None)
            for got, want in zip(_slot(reused.pool), _slot(fresh.pool), strict=True):
                assert same_bits(got, want), (order, name)

    asyncio.run(run())


def test_written_ranks_names_only_groups_covered_whole(
    files: tuple[Path, Path, ModelConfig],
) -> None:
    _, adapters, cfg = files

    async def run() -> dict[str, dict[str, int]]:
        out = {}
        for name in PALETTE:
            mgr = _manager(adapters, cfg, torch.float32)
            await mgr.load(name, None)
            cpu = mgr.cpu_cache.get(name)
            assert cpu is not None, "the CPU tier keeps what it uploaded"
            out[name] = written_ranks(cpu, mgr.pool)
        return out

    got = asyncio.run(run())
    assert got["full8"] == {"qkv": 8, "o": 8, "gate_up": 8, "down": 8}
    assert got["full3"] == {"qkv": 3, "o": 3, "gate_up": 3, "down": 3}
    assert got["qv8"] == {}  # k_proj of qkv is left: the group is zeroed whole
    assert got["qkv2"] == {"qkv": 2}
    assert got["k5up5"] == {}
    assert got["odown1"] == {"o": 1, "down": 1}


def test_same_bits_is_bitwise() -> None:
    a = torch.tensor([1.0, -0.0, math.nan, 3.5], dtype=torch.bfloat16)
    assert same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([1.0, 0.0, math.nan, 3.5], dtype=torch.bfloat16))
    assert not same_bits(a, torch.tensor([1.0, -0.0, math.nan, 3.25], dtype=torch.bfloat16))
    wide = torch.randn(6, 10, dtype=torch.float64)
    assert same_bits(wide[:, :4], wide.clone()[:, :4])  # strided views
    assert not same_bits(wide, wide + 1e-12)


def test_a_copy_that_misplaces_a_matrix_is_refused(
    files: tuple[Path, Path, ModelConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host check still catches a copy that lands wrong: the slot it reserved is freed and
    nothing is published."""
    _, adapters, cfg = files
    mgr = _manager(adapters, cfg, torch.float32)
    place = mgr._place

    def misplace(slot: int, cpu: object, data: torch.Tensor) -> list[torch.Tensor]:
        dst = place(slot, cpu, data)  # type: ignore[arg-type]
        dst[3].add_(1.0)  # one matrix off after the copy
        return dst

    monkeypatch.setattr(mgr, "_place", misplace)
    with pytest.raises(AdapterValidationError, match="differs from its source"):
        asyncio.run(mgr.load("qv8", None))
    assert not mgr.is_resident("qv8")


def test_a_cast_that_overflows_is_refused_naming_the_tensor(
    tmp_path: Path, files: tuple[Path, Path, ModelConfig]
) -> None:
    """A float32 adapter holding 1e6 in a float16 pool would copy as Inf: the host pool takes no
    sums at upload, so the read refuses it, naming the tensor, and nothing is published."""
    model, _, cfg = files
    make_adapter(tmp_path, model, "big", 2, ("q_proj",), seed=9, scale_b=1e6)
    mgr = _manager(tmp_path, cfg, torch.float16)
    with pytest.raises(AdapterValidationError, match="NaN or Inf"):
        asyncio.run(mgr.load("big", None))
    assert not mgr.is_resident("big")
