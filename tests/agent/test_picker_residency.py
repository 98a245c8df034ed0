"""The endpoint picker scores LoRA affinity on residency: for equal load, a worker holding the
adapter on its GPU beats one holding it in its CPU cache, which beats one that does not hold it,
whether the picker is handed the tiers directly or reads them from the workers' /metrics."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.agent.picker import (
    CPU_SCORE,
    FREE_SLOT_SCORE,
    GPU_SCORE,
    RUNNING_SCORE,
    EndpointBook,
    EndpointLoad,
    decide,
    score,
)
from adaptermesh.worker_scrape import parse_metrics

ADAPTER = "sql"
OTHERS = ("chat", "code", "math", "summ")
TIER_RANK = {"gpu": 2, "cpu": 1, "none": 0}

# One worker's residency: the requested adapter's tier, other adapters per tier, its slots.
worker_residency = st.fixed_dictionaries(
    {
        "tier": st.sampled_from(("gpu", "cpu", "none")),
        "gpu_others": st.sets(st.sampled_from(OTHERS), max_size=3),
        "cpu_others": st.sets(st.sampled_from(OTHERS), max_size=4),
        "slots": st.integers(min_value=1, max_value=6),
        "rank": st.sampled_from((4, 8, 16, 64)),
    }
)


def exposition(residency: dict) -> str:
    """What one of our workers' /metrics says about this residency, with equal load."""
    held = [(name, "gpu") for name in sorted(residency["gpu_others"])]
    held += [(name, "cpu") for name in sorted(residency["cpu_others"])]
    if residency["tier"] == "gpu":
        held += [(ADAPTER, "gpu"), (ADAPTER, "cpu")]  # a GPU holder also keeps its CPU copy
    elif residency["tier"] == "cpu":
        held.append((ADAPTER, "cpu"))
    gpu = {name for name, level in held if level == "gpu"}
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="base"} 2.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{model_name="base"} 0.25',
        "# TYPE vllm:lora_adapter_loaded gauge",
    ]
    lines += [
        f'vllm:lora_adapter_loaded{{adapter_name="{name}",level="{level}",pinned="false",'
        f'rank="{residency["rank"]}"}} 1.0'
        for name, level in held
    ]
    lines += [
        "# TYPE vllm:num_gpu_loaded_lora_adapters gauge",
        f'vllm:num_gpu_loaded_lora_adapters{{model_name="base"}} {len(gpu)}',
        "# TYPE vllm:max_gpu_lora_adapters gauge",
        f'vllm:max_gpu_lora_adapters{{model_name="base"}} {residency["slots"]}',
    ]
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(workers=st.lists(worker_residency, min_size=1, max_size=8), rotation=st.integers(0, 50))
def test_scraped_residency_ranks_gpu_over_cpu_over_none(workers: list[dict], rotation: int) -> None:
    book = EndpointBook()
    book.set_endpoints("pool", [("10.0.0.1", 8000 + i) for i in range(len(workers))])
    for i, residency in enumerate(workers):
        book.observe("10.0.0.1", 8000 + i, parse_metrics(exposition(residency)))
    candidates = book.candidates("pool")
    tier_of = {c.key: workers[i]["tier"] for i, c in enumerate(candidates)}
    best = max(TIER_RANK[w["tier"]] for w in workers)
    decision = decide(ADAPTER, "base", candidates, rotation=rotation, fallbacks=len(workers))
    # The pick holds the adapter in the best tier any worker offers, and the whole ranking
    # never puts a worker before one that holds the adapter in a better tier.
    assert TIER_RANK[tier_of[decision.endpoints[0]]] == best
    ranks = [TIER_RANK[tier_of[key]] for key in decision.endpoints]
    assert ranks == sorted(ranks, reverse=True)


@settings(max_examples=300, deadline=None)
@given(
    gpu=st.booleans(),
    cpu=st.booleans(),
    running=st.booleans(),
    others=st.sets(st.sampled_from(OTHERS), max_size=4),
    max_lora=st.none() | st.integers(0, 8),
    waiting=st.none() | st.floats(0, 50),
    kv=st.none() | st.floats(0, 1),
    pending=st.integers(0, 5),
)
def test_residency_score_orders_the_tiers(
    gpu: bool,
    cpu: bool,
    running: bool,
    others: set[str],
    max_lora: int | None,
    waiting: float | None,
    kv: float | None,
    pending: int,
) -> None:
    def load(**kw: object) -> EndpointLoad:
        return EndpointLoad(
            "10.0.0.1",
            8000,
            max_lora=max_lora,
            waiting=waiting,
            kv_cache_usage=kv,
            pending=pending,
            **kw,
        )  # type: ignore[arg-type]

    resident = frozenset(others | ({ADAPTER} if gpu else set()))
    cached = frozenset(others | ({ADAPTER} if cpu else set()))
    here = load(
        resident=resident,
        cpu_cached=cached,
        running_adapters=frozenset({ADAPTER}) if running and gpu else frozenset(),
    )
    not_held = load(resident=frozenset(others), cpu_cached=frozenset(others))
    in_cpu = load(resident=frozenset(others), cpu_cached=cached | {ADAPTER})
    on_gpu = load(resident=resident | {ADAPTER}, cpu_cached=cached)
    assert score(on_gpu, ADAPTER) > score(in_cpu, ADAPTER) > score(not_held, ADAPTER)
    if gpu:
        assert score(here, ADAPTER) >= score(on_gpu, ADAPTER)
    elif cpu:
        assert score(here, ADAPTER) == score(in_cpu, ADAPTER)
    assert RUNNING_SCORE > GPU_SCORE > CPU_SCORE > FREE_SLOT_SCORE > 0


def test_the_scrape_reads_both_tiers_and_the_slots() -> None:
    raw = parse_metrics(
        exposition(
            {"tier": "gpu", "gpu_others": {"chat"}, "cpu_others": {"code"}, "slots": 4, "rank": 8}
        )
    )
    assert raw.resident_adapters == {ADAPTER, "chat"}
    assert raw.cpu_adapters == {ADAPTER, "code"}
    assert raw.gpu_loaded_adapters == 2
    assert raw.max_gpu_adapters == 4
    # Without vllm:lora_requests_info, the slots stand in for max_lora.
    assert raw.max_lora == 4
    pinned = parse_metrics(
        "# TYPE vllm:lora_adapter_loaded gauge\n"
        'vllm:lora_adapter_loaded{adapter_name="a",level="gpu",pinned="true",rank="4"} 1.0\n'
        'vllm:lora_adapter_loaded{adapter_name="b",level="cpu",pinned="true",rank="4"} 1.0\n'
        'vllm:lora_adapter_loaded{adapter_name="c",level="gpu",pinned="false",rank="4"} 0.0\n'
    )
    assert pinned.resident_adapters == {"a"}
    assert pinned.pinned_adapters == {"a"}
    assert pinned.cpu_adapters == {"b"}


def test_a_cpu_holder_beats_a_worker_never_scraped() -> None:
    book = EndpointBook()
    book.set_endpoints("pool", [("10.0.0.1", 1), ("10.0.0.1", 2)])
    book.observe(
        "10.0.0.1",
        2,
        parse_metrics(
            exposition(
                {"tier": "cpu", "gpu_others": set(), "cpu_others": set(), "slots": 1, "rank": 4}
            )
        ),
    )
    cpu_holder = book.candidates("pool")[1]
    assert cpu_holder.cpu_cached == {ADAPTER}
    assert decide(ADAPTER, "base", book.candidates("pool")).endpoints == (cpu_holder.key,)
