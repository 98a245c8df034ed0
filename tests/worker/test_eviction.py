"""Adapter eviction policies: known traces, Hypothesis properties, and the manager using them."""

from __future__ import annotations

import importlib.util
import itertools
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.cli import _build_engine, build_parser
from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.eviction import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    CountMinSketch,
    EvictionPolicy,
    LruGreedyPolicy,
    LruPolicy,
    S3FifoPolicy,
    WTinyLfuPolicy,
    make_policy,
)

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request


def _all(_: str) -> bool:
    return True


class Cache:
    """A cache of ``capacity`` unit-size keys driven by a policy, as the manager drives it."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.resident: set[str] = set()
        self.evicted: list[str] = []

    def request(self, key: str, allowed: Callable[[str], bool] = _all) -> bool:
        self.policy.access(key)
        if key in self.resident:
            return True
        if len(self.resident) >= self.capacity:
            victim = self.policy.evict(allowed)
            assert victim is not None
            self.resident.remove(victim)
            self.evicted.append(victim)
        self.resident.add(key)
        self.policy.insert(key)
        return False


# ---- known traces ----------------------------------------------------------------------------


def test_lru_evicts_least_recent() -> None:
    c = Cache(LruPolicy(2), 2)
    for k in "aba":
        c.request(k)
    c.request("c")
    assert c.evicted == ["b"]
    assert c.resident == {"a", "c"}


def test_lru_greedy_evicts_lowest_hits_in_window() -> None:
    c = Cache(LruGreedyPolicy(3, window=2), 3)
    for k in ["a", "b", "c", "a", "a", "a", "b", "c"]:  # hits a=4, b=2, c=2; recency a, b, c
        c.request(k)
    c.request("d")
    assert c.evicted == ["b"]  # LRU would take a; the window {a, b} keeps the frequent a
    c2 = Cache(LruGreedyPolicy(3, window=1), 3)  # window 1 is LRU
    for k in ["a", "b", "c", "a", "a", "a", "b", "c", "d"]:
        c2.request(k)
    assert c2.evicted == ["a"]


def test_lru_greedy_uses_hits_per_size() -> None:
    p = LruGreedyPolicy(100, window=8)
    p.insert("big", 50)
    p.insert("small", 10)
    for _ in range(3):
        p.access("big")  # 4 hits / 50 bytes
    p.access("small")  # 2 hits / 10 bytes
    assert p.evict(_all) == "big"


def test_s3fifo_one_hit_wonder_goes_to_ghost_and_returns_to_main() -> None:
    p = S3FifoPolicy(10)  # small queue: 1 entry
    c = Cache(p, 2)
    c.request("x")
    c.request("x")  # x accessed while in the small queue
    c.request("y")
    c.request("z")  # evicts: x moves to main, y (never re-used) is the victim
    assert c.evicted == ["y"]
    assert p.state_size() == 1  # y is a ghost
    c.request("y")  # remembered: enters main; z is in small and is the victim
    assert c.evicted == ["y", "z"]
    assert c.resident == {"x", "y"}


def test_s3fifo_main_gives_second_chances() -> None:
    p = S3FifoPolicy(10)
    for k in "ab":
        p.insert(k)
        p.access(k)
    p.insert("s")
    # Small is over its share: a and b (accessed) move to main with counter 0; s is the victim.
    assert p.evict(_all) == "s"
    p.access("a")
    assert p.evict(_all) == "b"  # small is empty, so main: a's access buys it a pass
    assert p.evict(_all) == "a"


def test_wtinylfu_scan_does_not_flush_frequent_keys() -> None:
    c = Cache(WTinyLfuPolicy(4), 4)
    for _ in range(5):
        for k in "abcd":
            c.request(k)
    hits = [c.request(f"scan{i}") for i in range(40)]
    assert not any(hits)
    assert len(c.resident & set("abcd")) == 3  # the window slot takes the scan; main holds
    lru = Cache(LruPolicy(4), 4)
    for _ in range(5):
        for k in "abcd":
            lru.request(k)
    for i in range(40):
        lru.request(f"scan{i}")
    assert not lru.resident & set("abcd")


def test_wtinylfu_admits_a_newly_popular_key() -> None:
    c = Cache(WTinyLfuPolicy(4), 4)
    for k in "abcd":
        c.request(k)
    for _ in range(6):
        c.policy.access("hot")  # requested while another tier served it
    c.request("hot")  # d (window, one access) ties probation's a and loses: ties keep the incumbent
    assert c.evicted == ["d"]
    c.request("e")  # hot (window) meets a; hot's estimate wins, a goes
    assert c.evicted == ["d", "a"]
    c.request("f")  # e (one access) loses against b
    assert c.evicted == ["d", "a", "e"]
    assert c.resident == {"hot", "b", "c", "f"}


def test_sketch_counts_saturates_and_ages() -> None:
    s = CountMinSketch(8)
    assert s.estimate("k") == 0
    s.increment("k")
    assert s.estimate("k") == 1  # doorkeeper only
    for _ in range(40):
        s.increment("k")
    assert s.estimate("k") == 16  # 15 in the sketch + the doorkeeper
    assert s.estimate("other") <= 1
    for i in range(s.sample):
        s.increment(f"noise{i}")
    assert s.resets >= 1
    assert s.estimate("k") <= 8  # halved, doorkeeper cleared


def test_unknown_policy_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"adapter_eviction: unknown eviction policy 'fifo'"):
        make_policy("fifo", 4)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        make_policy("lru", 0)


# ---- properties --------------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(12)]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["access", "insert", "remove", "evict"]),
        st.sampled_from(KEYS),
        st.frozensets(st.sampled_from(KEYS)),
        st.integers(1, 5),
    ),
    max_size=120,
)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 8))
def test_property_evicts_only_allowed_residents_and_state_is_bounded(
    name: str, ops: list[tuple[str, str, frozenset[str], int]], capacity: int
) -> None:
    p = make_policy(name, capacity)
    resident: set[str] = set()
    for op, key, allowed, size in ops:
        if op == "access":
            p.access(key)
        elif op == "insert":
            p.insert(key, size)
            resident.add(key)
        elif op == "remove":
            p.remove(key)
            resident.discard(key)
        else:
            got = p.evict(allowed.__contains__)
            if resident & allowed:
                assert got in resident & allowed
                resident.remove(got)
            else:
                assert got is None
        assert len(p) == len(resident)
        assert all(k in p for k in resident)
        assert p.state_size() <= p.entries


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=100, deadline=None)
@given(trace=st.lists(st.sampled_from(KEYS), max_size=200), extra=st.integers(0, 4))
def test_property_no_miss_after_first_access_when_everything_fits(
    name: str, trace: list[str], extra: int
) -> None:
    capacity = len(set(trace)) + extra or 1
    c = Cache(make_policy(name, capacity), capacity)
    seen: set[str] = set()
    for key in trace:
        assert c.request(key) == (key in seen)
        seen.add(key)
    assert c.evicted == []


@settings(max_examples=150, deadline=None)
@given(trace=st.lists(st.sampled_from(KEYS), max_size=300), capacity=st.integers(1, 8))
def test_property_lru_matches_a_reference_lru(trace: list[str], capacity: int) -> None:
    c = Cache(LruPolicy(capacity), capacity)
    ref: list[str] = []  # least recent first
    for key in trace:
        want_hit = key in ref
        if want_hit:
            ref.remove(key)
        elif len(ref) >= capacity:
            ref.pop(0)
        ref.append(key)
        assert c.request(key) == want_hit
        assert c.resident == set(ref)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), pinned=st.frozensets(st.sampled_from(KEYS[:4]), max_size=3))
def test_property_pinned_keys_never_leave(name: str, seed: int, pinned: frozenset[str]) -> None:
    rng = random.Random(seed)
    c = Cache(make_policy(name, 4), 4)
    for k in pinned:
        c.request(k)
    for _ in range(200):
        c.request(rng.choice(KEYS), lambda k: k not in pinned)
        assert pinned <= c.resident


def test_default_policy_is_a_known_one() -> None:
    assert DEFAULT_POLICY in POLICY_NAMES
    assert EngineConfig().adapter_eviction == DEFAULT_POLICY


# ---- the manager uses the configured policy -----------------------------------------------------

POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "lru-greedy": LruGreedyPolicy,
    "s3-fifo": S3FifoPolicy,
    "w-tinylfu": WTinyLfuPolicy,
}


ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def uniform_root(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker suite's adapter names, each on every module at the pool's rank: every one
    takes the bytes of one adapter on every module, so ``max_loras`` adapters fit in the
    adapter arena at once and the policies choose among equals."""
    from adaptermesh_testkit.checkpoints import make_adapter

    root = tmp_path_factory.mktemp("uniform_adapters")
    for i, name in enumerate(ADAPTERS):
        make_adapter(root, tiny.model_dir, name, 16, ALL_MODULES, seed=10 + i)
    return root


@pytest.mark.parametrize(
    ("name", "survivor"),
    [("lru", "beta"), ("lru-greedy", "alpha"), ("s3-fifo", "alpha"), ("w-tinylfu", "alpha")],
)
async def test_manager_evicts_by_the_configured_policy(
    tiny: Tiny, make_engine: Any, uniform_root: Path, name: str, survivor: str
) -> None:
    eng = make_engine(max_loras=2, adapter_eviction=name, root=uniform_root)
    assert isinstance(eng.adapters.gpu_policy, POLICY_CLASSES[name])
    assert isinstance(eng.adapters.cpu_policy, POLICY_CLASSES[name])
    ids = tiny.encode(PROMPTS[0])
    for i, n in enumerate(["alpha", "alpha", "alpha", "beta", "gamma"]):
        await collect(eng.submit(request(f"r{i}", ids, n, max_tokens=1)))
    resident = {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    # LRU drops alpha (least recent); the frequency-aware policies keep it and drop beta.
    assert resident == {survivor, "gamma"}
    assert set(eng.adapters.published) == {
        n for n in ("alpha", "beta", "gamma") if n in eng.adapters.gpu_policy
    }


@pytest.mark.parametrize("name", POLICY_NAMES)
async def test_manager_keeps_pinned_and_in_use_adapters(
    tiny: Tiny, make_engine: Any, uniform_root: Path, name: str
) -> None:
    eng = make_engine(max_loras=3, adapter_eviction=name, root=uniform_root)
    await eng.load_adapter("alpha", "alpha", pinned=True)
    await eng.load_adapter("beta", "beta")
    mgr = eng.adapters
    lease = mgr.try_acquire("beta")  # an in-flight request holds beta's slot
    assert lease is not None
    ids = tiny.encode(PROMPTS[0])
    for i, n in enumerate(["gamma", "delta", "gamma", "delta", "gamma"] * 2):
        await collect(eng.submit(request(f"p{i}", ids, n, max_tokens=1)))
    resident = {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    assert {"alpha", "beta"} <= resident
    assert eng.stats().adapter_evictions >= 1
    mgr.release(lease.slot)
    await collect(eng.submit(request("after", ids, "delta", max_tokens=1)))
    await collect(eng.submit(request("after2", ids, "gamma", max_tokens=1)))
    assert "alpha" in {a.name for a in eng.list_adapters() if a.resident_on_gpu}
    # Unload leaves neither tier's policy holding the name.
    await eng.unload_adapter("beta")
    assert "beta" not in mgr.gpu_policy
    assert "beta" not in mgr.cpu_policy


async def test_cpu_cache_evicts_by_policy_within_budget(tiny: Tiny, make_engine: Any) -> None:
    probe = make_engine()
    await probe.load_adapter("gamma", "gamma")
    per = probe.adapters.cpu_cache["gamma"].nbytes
    eng = make_engine(max_loras=1, cpu_cache_bytes=2 * per, adapter_eviction="lru")
    ids = tiny.encode(PROMPTS[0])
    for i, n in enumerate(["alpha", "beta", "gamma", "delta"]):
        await collect(eng.submit(request(f"c{i}", ids, n, max_tokens=1)))
    mgr = eng.adapters
    assert mgr.cpu_bytes <= 2 * per
    assert set(mgr.cpu_cache) == {
        n for n in ("alpha", "beta", "gamma", "delta") if n in mgr.cpu_policy
    }
    assert "delta" in mgr.cpu_cache  # the newest stays


async def test_unknown_policy_in_config_is_refused(tiny: Tiny) -> None:
    with pytest.raises(ValueError, match="adapter_eviction: unknown eviction policy 'mru'"):
        Engine(
            tiny.model_dir,
            tiny.root,
            config=EngineConfig(adapter_eviction="mru"),
            model_name="tiny",
        )


async def test_cli_flag_maps_into_the_engine(
    tiny: Tiny, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", str(tiny.model_dir), "--adapter-root", str(tiny.root), "--device", "cpu"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--adapter-eviction", "random"])
    assert "--adapter-eviction" in capsys.readouterr().err
    eng = _build_engine(
        build_parser().parse_args([*base, "--adapter-eviction", "s3-fifo", "--max-loras", "2"])
    )
    try:
        assert isinstance(eng, Engine)
        assert eng.adapters.eviction == "s3-fifo"
        assert isinstance(eng.adapters.gpu_policy, S3FifoPolicy)
    finally:
        await eng.shutdown()
    default = build_parser().parse_args(base)
    assert default.adapter_eviction is None  # EngineConfig's default applies


# ---- the benchmark's calibrated bursty-scan trace -------------------------------------------------

BENCH = Path(__file__).parents[2] / "bench" / "bench_eviction.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_eviction", BENCH)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bursts(trace: list[str], hot: set[str]) -> list[list[str]]:
    return [list(g) for is_hot, g in itertools.groupby(trace, key=hot.__contains__) if not is_hot]


def test_bursty_scan_is_deterministic_per_seed(bench: ModuleType) -> None:
    a = bench.trace_bursty_scan(5000, 3)
    assert a == bench.trace_bursty_scan(5000, 3)
    assert a != bench.trace_bursty_scan(5000, 4)
    assert len(a) == 5000
    assert bench.bursty_scan_hot_set(3) == bench.bursty_scan_hot_set(3)


def test_bursty_scan_has_the_stated_shape(bench: ModuleType) -> None:
    tr = bench.trace_bursty_scan(20_000, 5)
    hot = set(bench.bursty_scan_hot_set(5))
    counts = Counter(tr)
    # A stable hot set of 60 adapters that fits the 64 slots; each is requested far more
    # often than any cold adapter.
    assert bench.BURSTY_SCAN_HOT == len(hot) < 64
    assert hot <= set(tr)
    assert min(counts[k] for k in hot) > 20 * max(n for k, n in counts.items() if k not in hot)
    # Hot requests, in order, are whole rounds: every chunk of 60 is the hot set once.
    hot_seq = [k for k in tr if k in hot]
    for i in range(0, len(hot_seq) - 60, 60):
        assert set(hot_seq[i : i + 60]) == hot
    # Bursts: runs of exactly 8 distinct cold adapters (the last one may be cut by the end).
    bursts = _bursts(tr, hot)
    assert all(len(b) == bench.BURSTY_SCAN_BURST == len(set(b)) for b in bursts[:-1])
    # Burst share: 8 / (mean gap + 8) = 7.4% at the calibrated gap, within sampling noise.
    share = bench.burst_share(tr, 5)
    assert share == pytest.approx(sum(len(b) for b in bursts) / len(tr))
    want = bench.BURSTY_SCAN_BURST / (bench.BURSTY_SCAN_MEAN_GAP + bench.BURSTY_SCAN_BURST)
    assert abs(share - want) < 0.015


def test_bursty_scan_lru_lands_near_the_calibration_with_room_above_090(
    bench: ModuleType,
) -> None:
    # A short trace on a seed that neither the calibration nor the bench uses.
    tr = bench.trace_bursty_scan(20_000, 29)
    lru = bench.simulate("lru", tr, 64, 256)["hits"] / len(tr)
    assert abs(lru - bench.BURSTY_SCAN_TARGET_LRU) < 0.06
    assert bench.belady_hits(tr, 64) / len(tr) >= 0.90
    # The knob moves LRU the stated way: rarer bursts, more hits.
    rarer = bench.trace_bursty_scan(20_000, 29, 2 * bench.BURSTY_SCAN_MEAN_GAP)
    assert bench.simulate("lru", rarer, 64, 256)["hits"] / len(rarer) > lru + 0.05


def test_bursty_scan_refuses_a_bad_shape(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="hot_order"):
        bench.trace_bursty_scan(100, 1, hot_order="zipf")
    with pytest.raises(ValueError, match="mean_gap"):
        bench.trace_bursty_scan(100, 1, 0)
    with pytest.raises(ValueError, match="burst"):
        bench.trace_bursty_scan(100, 1, burst=0)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    mean_gap=st.floats(1, 300),
    hot_order=st.sampled_from(["rotation", "independent"]),
)
def test_property_bursty_scan_is_hot_requests_and_whole_bursts(
    bench: ModuleType, seed: int, mean_gap: float, hot_order: str
) -> None:
    tr = bench.trace_bursty_scan(3000, seed, mean_gap, hot_order=hot_order)
    hot = set(bench.bursty_scan_hot_set(seed))
    assert len(tr) == 3000
    assert tr[0] in hot  # every burst follows at least one hot request
    bursts = _bursts(tr, hot)
    assert bursts, "3,000 requests hold at least one burst"
    assert all(len(b) == bench.BURSTY_SCAN_BURST == len(set(b)) for b in bursts[:-1])
    assert 0 < len(bursts[-1]) <= bench.BURSTY_SCAN_BURST
