"""Adapter manager: bad input, path safety, negative cache, hot swap under load, eviction."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from waiting import async_wait_until

from adaptermesh.worker.adapters import AdapterValidationError, resolve_in_root
from adaptermesh.worker.lora_groups import GROUPS
from adaptermesh.worker.types import AdapterNotFoundError
from adaptermesh_testkit.checkpoints import make_adapter

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request, tokens


def _copy_root(tiny: Tiny, dst: Path) -> Path:
    shutil.copytree(tiny.root, dst)
    return dst


async def _good_request_still_works(eng: Any, tiny: Tiny, name: str | None = "alpha") -> None:
    ids = tiny.encode(PROMPTS[0])
    got = tokens(await collect(eng.submit(request("after-bad", ids, name, max_tokens=4))))
    assert got == tiny.ref.greedy(list(ids), name, 4)


def _corrupt(path: Path) -> None:
    st = path / "adapter_model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])


def _drop_tensor(path: Path) -> None:
    st = path / "adapter_model.safetensors"
    t = load_file(str(st))
    t.pop(sorted(t)[0])
    save_file(t, str(st))


def _wrong_rank(path: Path) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = cfg["r"] * 2
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _wrong_shape(path: Path) -> None:
    st = path / "adapter_model.safetensors"
    t = load_file(str(st))
    key = next(k for k in sorted(t) if k.endswith("lora_B.weight"))
    t[key] = t[key][:-1].contiguous()
    save_file(t, str(st))


def _absent_module(path: Path) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "c_attn"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _rank_too_large(path: Path) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = 1024
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _nan(path: Path) -> None:
    st = path / "adapter_model.safetensors"
    t = load_file(str(st))
    key = sorted(t)[-1]
    t[key][0, 0] = float("nan")
    save_file(t, str(st))


def _bad_header(path: Path) -> None:
    st = path / "adapter_model.safetensors"
    data = bytearray(st.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")  # a header longer than the file
    st.write_bytes(bytes(data))


BAD = {
    "corrupt": (_corrupt, "corrupt or truncated"),
    "missing-tensor": (_drop_tensor, "missing tensor"),
    "rank-mismatch": (_wrong_rank, "has shape"),
    "shape-mismatch": (_wrong_shape, "has shape"),
    "absent-module": (_absent_module, "'c_attn' is not a module of the base model"),
    "rank-too-large": (_rank_too_large, "exceeds the engine's max_lora_rank"),
    "nan": (_nan, "holds NaN or Inf"),
    "bad-header": (_bad_header, "corrupt or truncated"),
}


@pytest.mark.parametrize("kind", list(BAD))
async def test_bad_adapter_rejected_and_engine_keeps_serving(
    tiny: Tiny, tmp_path: Path, make_engine: Any, kind: str
) -> None:
    root = _copy_root(tiny, tmp_path / "root")
    mutate, message = BAD[kind]
    bad = root / "bad"
    shutil.copytree(root / "alpha", bad)
    mutate(bad)
    eng = make_engine(root=root)
    # Explicit load: a clear error naming the problem; nothing published.
    with pytest.raises(AdapterValidationError, match=message):
        await eng.load_adapter("bad", "bad")
    assert all(a.name != "bad" for a in eng.list_adapters())
    # On-demand: the stream raises before any token, and the failure is negative-cached.
    with pytest.raises(AdapterNotFoundError, match=message):
        await collect(eng.submit(request("od", tiny.encode("hi"), "bad")))
    with pytest.raises(AdapterNotFoundError, match=message):
        eng.submit(request("od2", tiny.encode("hi"), "bad"))
    await _good_request_still_works(eng, tiny)
    await _good_request_still_works(eng, tiny, None)


async def test_failed_reload_keeps_serving_old_version(
    tiny: Tiny, tmp_path: Path, make_engine: Any
) -> None:
    root = _copy_root(tiny, tmp_path / "root")
    broken = root / "alpha_broken"
    shutil.copytree(root / "alpha", broken)
    _corrupt(broken)
    eng = make_engine(root=root)
    await eng.load_adapter("alpha", "alpha")
    version = eng.adapters.version("alpha")
    with pytest.raises(AdapterValidationError):
        await eng.load_adapter("alpha", "alpha_broken")
    assert eng.adapters.version("alpha") == version
    await _good_request_still_works(eng, tiny, "alpha")


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("esc", "../outside"),
        ("esc", "/etc"),
        ("esc", "link_out"),
        ("../outside", None),
        ("/abs", None),
        ("a/../../b", None),
    ],
)
async def test_paths_outside_root_rejected(
    tiny: Tiny, tmp_path: Path, make_engine: Any, name: str, path: str | None
) -> None:
    root = _copy_root(tiny, tmp_path / "root")
    outside = tmp_path / "outside"
    shutil.copytree(tiny.root / "alpha", outside)
    os.symlink(outside, root / "link_out")
    eng = make_engine(root=root)

    async def attempt() -> None:
        if path is None:
            eng.submit(request("p", tiny.encode("hi"), name))
        else:
            await eng.load_adapter(name, path)

    with pytest.raises(AdapterValidationError) as err:
        await attempt()
    assert err.value.field in ("lora_path", "name")
    await _good_request_still_works(eng, tiny)


def test_resolve_in_root_follows_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "inner").mkdir(parents=True)
    os.symlink(root / "inner", root / "alias")
    assert resolve_in_root(root, "x", "alias") == (root / "inner").resolve()
    assert resolve_in_root(root, "x", str(root / "inner")) == (root / "inner").resolve()


async def test_unknown_adapter_is_negative_cached(
    tiny: Tiny, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = make_engine()
    with pytest.raises(AdapterNotFoundError, match="no adapter with this name"):
        eng.submit(request("u", tiny.encode("hi"), "nope"))

    # From now on no filesystem access at all for this name.
    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("disk touched for a negative-cached name")

    monkeypatch.setattr(Path, "is_file", boom)
    monkeypatch.setattr(Path, "resolve", boom)
    # The speed of a refusal is the benchmark's to measure; the test says no disk is touched.
    for i in range(2000):
        with pytest.raises(AdapterNotFoundError):
            eng.submit(request(f"u{i}", tiny.encode("hi"), "nope"))
    monkeypatch.undo()
    # An explicit unload of an unknown name is a clear error too.
    with pytest.raises(AdapterNotFoundError):
        await eng.unload_adapter("nope")


async def test_on_demand_load_does_not_block_other_requests(
    tiny: Tiny, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptermesh.worker import adapters as adapters_mod

    real = adapters_mod.read_adapter
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_read(*a: Any, **k: Any) -> Any:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(timeout=30)
        return real(*a, **k)

    monkeypatch.setattr(adapters_mod, "read_adapter", slow_read)
    eng = make_engine()
    ids = tiny.encode(PROMPTS[1])
    slow = asyncio.ensure_future(collect(eng.submit(request("slow", ids, "gamma", max_tokens=4))))
    fast = await collect(eng.submit(request("fast", ids, None, max_tokens=4)))
    assert tokens(fast) == tiny.ref.greedy(list(ids), None, 4)
    assert not slow.done()
    gate.set()
    assert tokens(await slow) == tiny.ref.greedy(list(ids), "gamma", 4)


async def test_hot_swap_under_concurrent_load(tiny: Tiny, tmp_path: Path, make_engine: Any) -> None:
    root = _copy_root(tiny, tmp_path / "root")
    make_adapter(root, tiny.model_dir, "alpha_v2", 4, ("q_proj", "v_proj", "down_proj"), seed=77)
    eng = make_engine(root=root, max_num_seqs=8)
    ids = tiny.encode(PROMPTS[2])
    v1 = tiny.ref.greedy(list(ids), "alpha", 6)
    v2 = tokens(await collect(eng.submit(request("v2-direct", ids, "alpha_v2", max_tokens=6))))
    assert v1 != v2
    await eng.load_adapter("alpha", "alpha")
    committed = asyncio.Event()
    results: list[tuple[bool, list[int]]] = []
    failures: list[BaseException] = []

    async def client(i: int) -> None:
        while len(results) < 60:
            after = committed.is_set()
            try:
                got = tokens(
                    await collect(
                        eng.submit(request(f"c{i}-{len(results)}", ids, "alpha", max_tokens=6))
                    )
                )
            except BaseException as e:  # the test counts every failure
                failures.append(e)
                return
            results.append((after, got))

    clients = [asyncio.ensure_future(client(i)) for i in range(6)]
    await async_wait_until(
        lambda: len(results) >= 10,
        timeout=120,
        interval=0.005,
        what="ten answers from the old version",
    )
    await eng.load_adapter("alpha", "alpha_v2")
    committed.set()
    # The new version is visible right after commit.
    assert (
        tokens(await collect(eng.submit(request("right-after", ids, "alpha", max_tokens=6)))) == v2
    )
    await asyncio.gather(*clients)
    assert not failures
    assert all(got in (v1, v2) for _, got in results)
    assert all(got == v2 for after, got in results if after)
    assert any(got == v1 for _, got in results)
    # The old version's slot was retired and freed once its requests drained.
    assert eng.adapters.slots_used() == 2  # alpha (v2) and alpha_v2


async def test_eviction_pressure_counters_add_up(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_loras=2, max_num_seqs=4)
    ids = tiny.encode(PROMPTS[0])
    names = [*ADAPTERS, None]
    expected = {n: tiny.ref.greedy(list(ids), n, 4) for n in names}
    jobs = [names[i % len(names)] for i in range(20)]
    streams = [eng.submit(request(f"e{i}", ids, n, max_tokens=4)) for i, n in enumerate(jobs)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for n, events in zip(jobs, results, strict=True):
        assert tokens(events) == expected[n], n
    st = eng.stats()
    adapter_requests = sum(1 for n in jobs if n is not None)
    c = eng.adapters.counters
    assert st.adapter_hits + st.adapter_misses == adapter_requests
    assert st.adapter_misses >= len(ADAPTERS)  # every adapter was cold once
    # Two adapters on every module's bytes: the four (on fewer modules, but more than two
    # adapters on every module in all) do not fit at once.
    assert st.adapter_evictions >= 1
    assert c.loads - st.adapter_evictions == st.gpu_slots_used < len(ADAPTERS)
    space = eng.adapters.space
    assert space is not None
    assert space.used_bytes() <= space.layout.size
    assert len(st.new_load_latencies) == c.loads
    # A request for an evicted adapter re-loads it from the CPU cache, not the disk.
    resident = {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    evicted = next(n for n in ADAPTERS if n not in resident)
    again = await collect(eng.submit(request("again", ids, evicted, max_tokens=4)))
    assert tokens(again) == expected[evicted]
    assert c.cpu_hits >= 1


async def test_pinned_adapter_is_never_evicted(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_loras=2)
    await eng.load_adapter("alpha", "alpha", pinned=True)
    ids = tiny.encode(PROMPTS[0])
    for n in ["beta", "gamma", "delta", "beta"]:
        await collect(eng.submit(request(f"p-{n}", ids, n, max_tokens=2)))
    info = {a.name: a for a in eng.list_adapters()}
    assert info["alpha"].resident_on_gpu
    assert info["alpha"].pinned
    assert eng.stats().adapter_evictions >= 2


async def test_unload_and_prefetch(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    info = await eng.load_adapter("beta", "beta")
    assert (info.name, info.rank, info.resident_on_gpu) == ("beta", 8, True)
    await eng.unload_adapter("beta")
    assert eng.list_adapters() == []
    await asyncio.gather(*eng.prefetch(["gamma", "delta"]))
    assert {a.name for a in eng.list_adapters()} == {"gamma", "delta"}
    st = eng.stats()
    assert st.adapter_hits == st.adapter_misses == 0  # prefetch is not a request
    ids = tiny.encode(PROMPTS[0])
    await collect(eng.submit(request("pf", ids, "gamma", max_tokens=2)))
    assert eng.stats().adapter_hits == 1


def test_lora_path_that_cannot_be_resolved_is_a_validation_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "loop").symlink_to(root / "loop")
    for path in ("loop/x", "a\x00b"):
        with pytest.raises(AdapterValidationError) as ei:
            resolve_in_root(root, "n", path)
        assert ei.value.field == "lora_path", path


async def test_first_event_reports_the_tier_that_served_the_adapter(
    tiny: Tiny, make_engine: Any
) -> None:
    """The scheduler's AdapterResolution (the tracing span's source): disk when cold, gpu when
    resident, cpu when evicted from the GPU but kept in the CPU cache; on the first event only."""
    eng = make_engine(max_loras=2, max_num_seqs=4)
    ids = tiny.encode(PROMPTS[0])
    names = list(ADAPTERS)
    assert len(names) >= 3

    async def resolve(name: str | None, rid: str) -> Any:
        events = await collect(eng.submit(request(rid, ids, name, max_tokens=3)))
        found = [e.resolution for e in events if e.resolution is not None]
        assert events[0].resolution is (found[0] if found else None)
        assert len(found) <= 1
        return found[0] if found else None

    cold = await resolve(names[0], "cold")
    assert cold.tier == "disk"
    assert cold.load_s > 0
    assert cold.started <= cold.resolved
    assert cold.load_s == pytest.approx(eng.adapters.counters.latencies[-1], abs=1e-3)
    warm = await resolve(names[0], "warm")
    assert (warm.tier, warm.load_s, warm.version) == ("gpu", 0.0, cold.version)
    for i, name in enumerate(names[1:]):
        assert (await resolve(name, f"fill{i}")).tier == "disk"
    resident = {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    evicted = next(n for n in names if n not in resident)
    back = await resolve(evicted, "back")
    assert back.tier == "cpu"
    assert back.load_s > 0
    assert await resolve(None, "base") is None


async def test_host_pool_uploads_take_no_sums_and_check_the_copy(
    tiny: Tiny, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host pool takes no float64 sums at any upload (the files' finiteness was checked when
    they were read; a sum costs more than the copy there): uploads from disk and from the CPU
    cache give the reference tokens. A copy that does not match its source is refused, naming
    gpu_copy, and nothing is published."""
    import adaptermesh.worker.adapters as adapters_module

    calls: list[str] = []
    real_entry_sums = adapters_module.entry_sums

    def counting(cpu: Any, data: Any, dtype: Any) -> Any:
        calls.append(cpu.name)
        return real_entry_sums(cpu, data, dtype)

    monkeypatch.setattr(adapters_module, "entry_sums", counting)
    eng = make_engine(max_loras=2, max_num_seqs=4)
    ids = tiny.encode(PROMPTS[0])
    names = list(ADAPTERS)
    for name in [*names, *names]:  # two slots: every adapter is evicted and comes back
        got = tokens(await collect(eng.submit(request(f"c-{name}", ids, name, max_tokens=3))))
        assert got == tiny.ref.greedy(list(ids), name, 3), name
    assert eng.adapters.counters.cpu_hits >= 2
    assert calls == []

    # A copy that lands wrong (a matrix altered after the copy) is caught by the exact check.
    pool = eng.adapters.pool
    real_set_slot = pool.set_slot

    def corrupting(slot: int, rank: int, scale: float, groups: Any) -> None:
        written = next(
            view
            for group in sorted(groups)
            for index in range(len(GROUPS[group]))
            if (view := pool.slot_view(group, index, 0, slot, rank, False)).any()
        )  # a matrix the adapter has: alter one of its weights
        written[tuple(written.nonzero()[0].tolist())] += 1.0
        real_set_slot(slot, rank, scale, groups)

    monkeypatch.setattr(pool, "set_slot", corrupting)
    resident = {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    evicted = next(n for n in names if n not in resident)
    with pytest.raises(AdapterValidationError, match="gpu_copy"):
        await eng.load_adapter(evicted, evicted)
    monkeypatch.setattr(pool, "set_slot", real_set_slot)
    await _good_request_still_works(eng, tiny, evicted)
