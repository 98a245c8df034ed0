"""Memory that follows the adapters: per-group indices, the adapter arena and its allocator.

* Per-group indices (``lora_ops.GroupRoute``): a row's adapter handle reaches each pool group
  through that group's own index table; a row whose adapter leaves a group is a base row there.
* Fidelity: one batch mixing adapters on q,v only, on every module and on o only matches
  transformers + peft, in an arena roomy enough for all of them and in one so small that they
  evict each other and reuse each other's bytes.
* The arena (``ArenaLoraPool``, ``ArenaSpace``): byte ranges in use never overlap, first fit
  takes the lowest free index, eviction frees the cheapest index; any sequence of loads leaves
  every resident adapter's matrices exactly as a fresh pool holds them.
* Sizing: a worker started with no sizing flags holds over three times the rank-8 q,v adapters
  (of the Llama-2-7B shape, on an H200's memory) a pool of slots held in the same bytes.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker import lora_ops
from adaptermesh.worker.adapters import AdapterManager, ArenaSpace, same_bits
from adaptermesh.worker.engine_config import EngineConfig, validate_config
from adaptermesh.worker.lora_groups import GROUPS
from adaptermesh.worker.model import (
    ArenaGrid,
    ArenaLayout,
    ArenaLoraPool,
    LoraPool,
    ModelConfig,
    arena_part_bytes,
)
from adaptermesh.worker.sizing import (
    DeviceFacts,
    HostFacts,
    ModelFacts,
    Requested,
    arena_adapters,
    arena_size_for,
    choose_sizing,
)
from adaptermesh.worker.types import EngineOverloadedError, InvalidRequestError
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import collect, request, tokens
from .fidelity_helpers import PROMPT, build_model, match_case, peft_adapter

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- per-group indices ---------------------------------------------------------------------


@st.composite
def routed_batch(draw: st.DrawFn) -> dict[str, Any]:
    handles = draw(st.integers(1, 6))
    groups = {}
    for g in ("g0", "g1"):
        size = draw(st.integers(1, 8))
        # Each handle: an index of the group's grid (distinct handles, distinct indices) or -1.
        free = list(range(size))
        table = []
        for _ in range(handles):
            if free and draw(st.booleans()):
                table.append(free.pop(draw(st.integers(0, len(free) - 1))))
            else:
                table.append(-1)
        groups[g] = (size, table)
    rows = draw(st.lists(st.integers(-1, handles - 1), min_size=1, max_size=12))
    return {"handles": handles, "groups": groups, "rows": rows, "seed": draw(st.integers(0, 99))}


@settings(max_examples=40, deadline=None)
@given(routed_batch())
def test_each_group_reads_its_own_index_of_each_row(case: dict[str, Any]) -> None:
    handles, groups, rows = case["handles"], case["groups"], case["rows"]
    gen = torch.Generator().manual_seed(case["seed"])
    hidden, out_n, r_max = 5, 3, 4
    x = torch.randn(len(rows), hidden, generator=gen, dtype=torch.float64).float()
    routes = {
        g: lora_ops.GroupRoute(torch.tensor(table, dtype=torch.int32), size)
        for g, (size, table) in groups.items()
    }
    meta = lora_ops.build_meta(torch.tensor(rows, dtype=torch.int32), handles, routes=routes)
    assert meta.kernel_meta is None
    for g, (size, table) in groups.items():
        a = torch.randn(1, size, r_max, hidden, generator=gen)
        b = torch.randn(size, out_n, r_max, generator=gen)
        ranks = torch.randint(1, r_max + 1, (size,), generator=gen, dtype=torch.int32)
        scales = torch.rand(size, generator=gen) + 0.5
        gm = meta.group(g)
        want_index = [table[h] if h >= 0 else -1 for h in rows]
        assert gm.token_slots.tolist() == want_index
        out = torch.zeros(len(rows), out_n)
        lora_ops.add_lora(out, x, a, (b,), scales, ranks, gm)
        for t, i in enumerate(want_index):
            if i < 0:  # a base row, or an adapter that leaves the group: untouched
                assert torch.equal(out[t], torch.zeros(out_n))
                continue
            r = int(ranks[i])
            ref = scales[i] * (x[t] @ a[0, i, :r].T) @ b[i, :, :r].T
            torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)


def test_a_batch_with_routes_has_no_segments_of_its_own() -> None:
    route = lora_ops.GroupRoute(torch.tensor([0, -1], dtype=torch.int32), 1)
    meta = lora_ops.build_meta(torch.tensor([1, 0, -1], dtype=torch.int32), 2, routes={"o": route})
    with pytest.raises(ValueError, match="group"):
        meta.segments()
    with pytest.raises(KeyError, match="qkv"):
        meta.group("qkv")
    assert meta.group("o").token_slots.tolist() == [-1, 0, -1]
    plain = lora_ops.build_meta(torch.tensor([1, 0, -1], dtype=torch.int32), 2)
    assert plain.group("qkv") is plain


# --- fidelity ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("arena") / "m", "llama", seed=5, pad_token_id=0)


@pytest.mark.parametrize("max_loras", [4, 1])
def test_mixed_target_sets_in_one_batch_match_peft(
    llama: Path, tmp_path: Path, max_loras: int
) -> None:
    """q,v only, every module, and o only, side by side in one batch with base rows; with
    ``max_loras=1`` the arena holds one adapter on every module, so they take turns in it."""
    root = tmp_path / "adapters"
    peft_adapter(root, llama, "qv", 21, r=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"])
    peft_adapter(root, llama, "all", 22, r=4, lora_alpha=8.0, target_modules=ALL7)
    peft_adapter(root, llama, "o", 23, r=2, lora_alpha=4.0, target_modules=["o_proj"])
    peft_adapter(root, llama, "qv2", 24, r=3, lora_alpha=3.0, target_modules=["q_proj", "v_proj"])
    match_case(
        llama,
        root,
        ["qv", "all", "o", "qv2"],
        [PROMPT, PROMPT[2:9]],
        max_loras=max_loras,
        max_lora_rank=8,
    )


# --- the allocator -------------------------------------------------------------------------


def _brute_free(space: ArenaSpace, part: str) -> list[int]:
    grid = space.layout.grids[part]
    used = space.spans()
    return [
        i
        for i in range(grid.count)
        if all(e <= grid.span(i)[0] or s >= grid.span(i)[1] for s, e, _ in used)
    ]


@st.composite
def arena_ops(draw: st.DrawFn) -> tuple[ArenaLayout, list[tuple[str, int]]]:
    step = draw(st.integers(1, 4))
    lengths = {p: step * draw(st.integers(1, 4)) for p in ("qkv", "o", "gate_up")}
    size = step * draw(st.integers(4, 24))
    grids = {p: ArenaGrid(step, n, (size - n) // step + 1) for p, n in lengths.items() if n <= size}
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(["take", "take", "release"]), st.integers(0, 50)),
            max_size=40,
        )
    )
    return ArenaLayout(size, grids), ops


@settings(max_examples=40, deadline=None)
@given(arena_ops())
def test_first_fit_takes_the_lowest_free_index_and_ranges_never_overlap(
    case: tuple[ArenaLayout, list[tuple[str, int]]],
) -> None:
    layout, ops = case
    space = ArenaSpace(layout)
    parts = sorted(layout.grids)
    handle = 0
    for op, x in ops:
        if op == "take" and parts:
            part = parts[x % len(parts)]
            free = _brute_free(space, part)
            index = space.first_fit(part)
            assert index == (free[0] if free else None)
            if index is not None:
                space.take(handle, part, index)
                handle += 1
                with pytest.raises(RuntimeError, match="in use"):
                    space.take(handle, part, index)  # the same bytes again: refused
        elif space.held:
            owners = sorted(space.held)
            space.release(owners[x % len(owners)])
        spans = space.spans()
        for (_, end, _), (start, _, _) in itertools.pairwise(spans):
            assert end <= start
        assert space.used_bytes() <= layout.size
        # The free gaps are exactly what the ranges in use leave, merged.
        edges = [0, *(x for s, e, _ in spans for x in (s, e)), layout.size]
        want = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
        assert space.gaps() == want
        # The cheapest index for a predicate that allows even-numbered holders: no holder of
        # it is odd, and no index with fewer holders (all even) exists.
        for part in parts:
            got = space.cheapest(part, lambda h: h % 2 == 0)
            holders = [space.holders(part, i) for i in range(layout.grids[part].count)]
            options = [(len(hs), i) for i, hs in enumerate(holders) if all(h % 2 == 0 for h in hs)]
            if not options:
                assert got is None
            else:
                assert got is not None
                assert (len(got[1]), got[0]) == min(options)


# --- sizing --------------------------------------------------------------------------------

LLAMA2_7B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
MIB, GIB = 1 << 20, 1 << 30
# An H200 as torch sees it (143,771 MiB) with the 7B model's 12.6 GiB of bf16 weights and
# the CUDA context loaded.
H200 = DeviceFacts("cuda", total_bytes=143_771 * MIB, used_bytes=int(13.2 * GIB))


def test_no_flags_hold_three_times_the_qv_adapters_of_a_pool_of_slots() -> None:
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    parts = arena_part_bytes(cfg, 8, torch.bfloat16)
    slot = sum(parts.values())
    host = HostFacts(1024 * GIB)
    kv_token = 2 * 32 * 32 * 128 * 2
    slots = choose_sizing(H200, host, ModelFacts(kv_token, slot, 4096), Requested())
    arena = choose_sizing(H200, host, ModelFacts(kv_token, slot, 4096, parts), Requested())
    # The same memory beside the same KV cache...
    assert arena.adapter_arena_bytes == pytest.approx(slots.max_loras * slot, rel=0.01)
    assert arena.kv_cache_bytes == pytest.approx(slots.kv_cache_bytes, rel=0.01)
    # ... holds over three times the rank-8 q,v adapters (one qkv index each), at least the
    # 1,339 that the pool of slots held only when told the target modules.
    qv = arena.adapters_on(["qkv"])
    assert qv >= 3 * slots.max_loras
    assert qv >= 1339
    assert f"qkv {qv}" in arena.describe()
    # Adapters on every module: within the arena's rounding to whole steps of the pool's.
    assert arena.max_loras >= 0.9 * slots.max_loras


async def test_a_worker_without_target_modules_holds_three_times_the_qv_adapters(
    tmp_path: Path, make_engine: Any
) -> None:
    """Four adapters on every module's bytes (the default pool of this suite): twelve q,v
    adapters stay resident together, none evicted, each serving its own tokens."""
    model = make_tiny_model(tmp_path / "model")
    root = tmp_path / "adapters"
    root.mkdir()
    eng = make_engine(model_dir=model, root=root, max_loras=4, max_lora_rank=8)
    fit = eng.pool.arena.fits({"qkv"})
    assert fit >= 3 * 4
    names = [f"qv{i}" for i in range(fit)]
    for i, name in enumerate(names):
        make_adapter(root, model, name, 8, ("q_proj", "v_proj"), seed=40 + i)
    ids = (5, 9, 14, 3)
    outs = {}
    for name in names:
        outs[name] = tokens(await collect(eng.submit(request(name, ids, name, max_tokens=3))))
    assert eng.adapters.counters.evictions == 0
    assert all(eng.adapters.is_resident(n) for n in names)
    assert len(set(map(tuple, outs.values()))) > 1  # distinct adapters, distinct weights
    again = tokens(await collect(eng.submit(request("again", ids, names[0], max_tokens=3))))
    assert again == outs[names[0]]


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_arena_size_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        validate_config(EngineConfig(lora_arena_bytes=bad))  # type: ignore[arg-type]
    assert err.value.field == "lora_arena_bytes"


async def test_an_arena_too_small_for_a_part_is_refused_at_start(make_engine: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        make_engine(lora_arena_bytes=4096)
    assert err.value.field == "lora_arena_bytes"
    assert "gate_up" in str(err.value)


def test_more_adapters_than_an_arena_indexes_are_refused_by_the_sizing() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        arena_size_for(4096, {"qkv": 1 << 20, "o": 1 << 18})
    size = arena_size_for(300, {"qkv": 3 << 20, "o": 1 << 20, "gate_up": 4 << 20})
    assert arena_adapters(size, {"qkv": 3 << 20, "o": 1 << 20, "gate_up": 4 << 20}) >= 300


# --- slot contents after reuse -------------------------------------------------------------

MAX_RANK = 8
PALETTE: dict[str, tuple[int, tuple[str, ...]]] = {
    "all8": (8, tuple(m for ms in GROUPS.values() for m in ms)),
    "qv8": (8, ("q_proj", "v_proj")),
    "qkv2": (2, ("q_proj", "k_proj", "v_proj")),
    "o3": (3, ("o_proj",)),
    "k5up5": (5, ("k_proj", "up_proj")),
    "odown1": (1, ("o_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def palette(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    root = tmp_path_factory.mktemp("arena_reuse")
    model = make_tiny_model(root / "model")
    for seed, (name, (rank, modules)) in enumerate(PALETTE.items(), start=1):
        make_adapter(root / "adapters", model, name, rank, modules, seed=seed)
    return root / "adapters", ModelConfig.from_dir(model)


def _kernel_view(pool: LoraPool, slot: int, group: str) -> list[torch.Tensor]:
    """What the kernels read for the adapter in ``slot`` on ``group``: its rank, scale and, in
    every layer, A[:rank] of each slice and B[:, :rank] (empty where it leaves the group)."""
    index = int(pool.routes[group].index[slot])
    if index < 0:
        return []
    out = []
    for layer in range(pool.num_layers):
        a, bs, ranks = pool.layer_args(group, layer)
        r = int(ranks[index])
        out += [a[:, index, :r].clone(), *(b[index, :, :r].clone() for b in bs)]
        out.append(pool.group_scales(group)[index].reshape(1).clone())
    return out


@settings(max_examples=25, deadline=None)
@given(
    order=st.lists(st.sampled_from(sorted(PALETTE)), min_size=2, max_size=7),
    adapters=st.integers(1, 2),
)
def test_every_resident_adapter_reads_as_a_fresh_pool_holds_it(
    palette: tuple[Path, ModelConfig], order: list[str], adapters: int
) -> None:
    """Loads in ``order`` into an arena of one or two adapters on every module: adapters evict
    each other and new ones are written over bytes others held. After every load, each resident
    adapter's operands (what the kernels read) equal those of a fresh pool holding it alone."""
    root, cfg = palette
    parts = arena_part_bytes(cfg, MAX_RANK, torch.float32)
    size = arena_size_for(adapters, parts)

    def manager(pool: LoraPool) -> AdapterManager:
        return AdapterManager(
            root, cfg, pool, max_rank=MAX_RANK, cpu_cache_bytes=1 << 30, dtype=torch.float32
        )

    async def run() -> None:
        cpu = torch.device("cpu")
        mgr = manager(ArenaLoraPool(cfg, size, MAX_RANK, cpu, torch.float32))
        fresh: dict[str, list[list[torch.Tensor]]] = {}
        for name in order:
            # A resident name stays (a reload would need room for a second copy beside it).
            await asyncio.gather(*mgr.prefetch([name]))
            assert mgr.is_resident(name)
            for resident, pub in mgr.published.items():
                if resident not in fresh:
                    alone = manager(LoraPool(cfg, 1, MAX_RANK, cpu, torch.float32))
                    await alone.load(resident, None)
                    fresh[resident] = [_kernel_view(alone.pool, 0, g) for g in GROUPS]
                got = [_kernel_view(mgr.pool, pub.slot, g) for g in GROUPS]
                for g_got, g_want in zip(got, fresh[resident], strict=True):
                    assert len(g_got) == len(g_want), (order, resident)
                    for x, y in zip(g_got, g_want, strict=True):
                        assert same_bits(x, y), (order, resident)
            space = mgr.space
            assert space is not None
            spans = space.spans()
            for (_, end, _), (start, _, _) in itertools.pairwise(spans):
                assert end <= start

    asyncio.run(run())


async def test_an_arena_whose_bytes_are_all_in_use_refuses_naming_the_arena(
    palette: tuple[Path, ModelConfig],
) -> None:
    root, cfg = palette
    parts = arena_part_bytes(cfg, MAX_RANK, torch.float32)
    pool = ArenaLoraPool(
        cfg, arena_size_for(1, parts), MAX_RANK, torch.device("cpu"), torch.float32
    )
    mgr = AdapterManager(
        root, cfg, pool, max_rank=MAX_RANK, cpu_cache_bytes=1 << 30, dtype=torch.float32,
        slot_wait_s=0.05,
    )  # fmt: skip
    await mgr.load("all8", None)
    lease = mgr.try_acquire("all8")
    assert lease is not None  # in use: never evicted
    with pytest.raises(EngineOverloadedError, match="adapter arena"):
        await mgr.load("qv8", None)
    assert mgr.is_resident("all8")
    assert not mgr.is_resident("qv8")
    mgr.release(lease.slot)
    await mgr.load("qv8", None)  # now all8 may go
    assert mgr.is_resident("qv8")
