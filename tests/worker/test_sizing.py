"""The worker's self-sizing (worker/sizing.py): flags override, GPUs get sizes from memory, the
CPU keeps its small defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.sizing import (
    ACTIVATION_RESERVE_BYTES,
    CPU_DEFAULTS,
    DEFAULT_MAX_NUM_SEQS,
    MAX_LORA_SLOTS,
    MIN_LORA_SLOTS,
    DeviceFacts,
    HostFacts,
    ModelFacts,
    Requested,
    choose_sizing,
    host_memory_bytes,
)

GIB = 1 << 30
MIB = 1 << 20

# Llama-2-7B in bf16: 13.5 GB of weights, 512 KiB of KV per token, a rank-64 all-7 slot 320 MiB.
H200 = DeviceFacts("cuda", total_bytes=141 * GIB, used_bytes=14 * GIB)
LLAMA7B_R64 = ModelFacts(kv_bytes_per_token=512 * 1024, slot_bytes=320 * MIB, max_model_len=4096)
HOST = HostFacts(memory_bytes=1024 * GIB)


def test_an_h200_without_flags_runs_256_sequences_with_most_memory_in_kv() -> None:
    sizing = choose_sizing(H200, HOST, LLAMA7B_R64, Requested())
    assert sizing.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert sizing.max_num_batched_tokens == 512
    budget = int(141 * GIB * 0.85) - 14 * GIB - ACTIVATION_RESERVE_BYTES
    assert sizing.kv_cache_bytes is not None
    # The pool takes its share, the KV cache the rest; nothing beyond the budget.
    assert sizing.max_loras * LLAMA7B_R64.slot_bytes + sizing.kv_cache_bytes <= budget
    assert sizing.kv_cache_bytes > budget * 0.8
    assert sizing.max_loras >= 40  # 15% of ~104 GiB in 320 MiB slots
    assert sizing.cpu_cache_bytes == 64 * GIB  # 25% of 1 TiB, capped
    assert "auto" in sizing.describe()


def test_the_cpu_keeps_its_small_defaults() -> None:
    sizing = choose_sizing(DeviceFacts("cpu"), HostFacts(24 * GIB), LLAMA7B_R64, Requested())
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens, sizing.max_loras) == (
        CPU_DEFAULTS.max_num_seqs,
        CPU_DEFAULTS.max_num_batched_tokens,
        CPU_DEFAULTS.max_loras,
    )
    assert sizing.kv_cache_bytes is None
    assert sizing.cpu_cache_bytes == CPU_DEFAULTS.cpu_cache_bytes


def test_a_small_host_gets_a_small_cpu_cache() -> None:
    sizing = choose_sizing(DeviceFacts("cpu"), HostFacts(2 * GIB), LLAMA7B_R64, Requested())
    assert sizing.cpu_cache_bytes == 512 * MIB


def test_a_small_gpu_runs_fewer_sequences() -> None:
    # 24 GiB card, 14 GiB of weights: ~5.4 GiB of KV after the pool -> fewer than 256 x 512 tokens.
    small = DeviceFacts("cuda", total_bytes=24 * GIB, used_bytes=14 * GIB)
    sizing = choose_sizing(small, HOST, LLAMA7B_R64, Requested())
    assert sizing.kv_cache_bytes is not None
    tokens = sizing.kv_cache_bytes // LLAMA7B_R64.kv_bytes_per_token
    assert 1 <= sizing.max_num_seqs < DEFAULT_MAX_NUM_SEQS
    assert sizing.max_num_seqs == max(1, tokens // 512)
    assert sizing.max_loras == MIN_LORA_SLOTS


def test_flags_keep_their_values_and_the_rest_is_chosen_around_them() -> None:
    sizing = choose_sizing(H200, HOST, LLAMA7B_R64, Requested(max_num_seqs=128, max_loras=64))
    assert (sizing.max_num_seqs, sizing.max_loras) == (128, 64)
    assert sizing.origin["max_num_seqs"] == "flag"
    assert sizing.origin["max_loras"] == "flag"
    assert sizing.origin["kv_cache_bytes"].startswith("auto")
    budget = int(141 * GIB * 0.85) - 14 * GIB - ACTIVATION_RESERVE_BYTES
    assert sizing.kv_cache_bytes == budget - 64 * LLAMA7B_R64.slot_bytes


def test_a_kv_flag_leaves_the_pool_the_rest() -> None:
    sizing = choose_sizing(H200, HOST, LLAMA7B_R64, Requested(kv_cache_bytes=40 * GIB))
    assert sizing.kv_cache_bytes == 40 * GIB
    budget = int(141 * GIB * 0.85) - 14 * GIB - ACTIVATION_RESERVE_BYTES
    assert sizing.max_loras == min(MAX_LORA_SLOTS, (budget - 40 * GIB) // LLAMA7B_R64.slot_bytes)


def test_nonsense_model_facts_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        choose_sizing(H200, HOST, ModelFacts(0, 1, 1), Requested())


sizes = st.integers(min_value=1, max_value=1 << 40)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["cuda", "cpu"]),
    total=st.integers(min_value=0, max_value=200 * GIB),
    used=st.integers(min_value=0, max_value=200 * GIB),
    host=st.integers(min_value=1, max_value=4096 * GIB),
    kv_per_token=st.integers(min_value=1, max_value=8 * MIB),
    slot=st.integers(min_value=1, max_value=4 * GIB),
    max_len=st.integers(min_value=1, max_value=1 << 20),
    seqs=st.none() | st.integers(min_value=1, max_value=4096),
    step=st.none() | st.integers(min_value=1, max_value=1 << 16),
    loras=st.none() | st.integers(min_value=1, max_value=4096),
    kv=st.none() | sizes,
    cpu=st.none() | sizes,
    fraction=st.floats(min_value=0.05, max_value=1.0),
)
def test_every_flag_wins_and_every_chosen_size_is_sane(
    kind: str,
    total: int,
    used: int,
    host: int,
    kv_per_token: int,
    slot: int,
    max_len: int,
    seqs: int | None,
    step: int | None,
    loras: int | None,
    kv: int | None,
    cpu: int | None,
    fraction: float,
) -> None:
    requested = Requested(seqs, step, loras, kv, cpu, fraction)
    sizing = choose_sizing(
        DeviceFacts(kind, total, used),
        HostFacts(host),
        ModelFacts(kv_per_token, slot, max_len),
        requested,
    )
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_loras",
        "kv_cache_bytes",
        "cpu_cache_bytes",
    ):
        given_value = getattr(requested, name)
        if given_value is not None:
            assert getattr(sizing, name) == given_value
            assert sizing.origin[name] == "flag"
    assert sizing.max_num_seqs >= 1
    assert sizing.max_num_batched_tokens >= 1
    assert sizing.max_loras >= 1
    assert sizing.cpu_cache_bytes >= 1
    if cpu is None:
        assert sizing.cpu_cache_bytes <= max(host, 256 * MIB)
    if kind == "cuda" and kv is None and loras is None:
        budget = max(0, int(total * fraction) - used - ACTIVATION_RESERVE_BYTES)
        assert sizing.kv_cache_bytes is not None
        # Nothing beyond the budget, unless the pool's floor of slots alone exceeds it.
        if MIN_LORA_SLOTS * slot <= budget // 2:
            assert sizing.max_loras * slot + sizing.kv_cache_bytes <= budget
            assert sizing.max_loras * slot <= budget // 2 or sizing.max_loras == MIN_LORA_SLOTS
    if kind == "cuda" and seqs is None:
        assert sizing.max_num_seqs <= DEFAULT_MAX_NUM_SEQS
        if step is None:
            assert sizing.max_num_batched_tokens >= sizing.max_num_seqs


def test_host_memory_follows_a_cgroup_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert host_memory_bytes(tmp_path) == 1 << 30
    (tmp_path / "memory.max").write_text("max\n")
    physical = host_memory_bytes(tmp_path)
    assert physical > 1 << 30
    assert host_memory_bytes(tmp_path / "absent") == physical


def test_host_memory_takes_the_tightest_limit_above_the_process(tmp_path: Path) -> None:
    """A pod's limit sits on the pod's cgroup; the container's cgroup below it has none."""
    from adaptermesh.worker.cgroups import limit_dirs
    from adaptermesh.worker.sizing import _cgroup_limit

    pod = tmp_path / "kubepods" / "pod1"
    (pod / "ctr").mkdir(parents=True)
    (pod / "memory.max").write_text(f"{2 << 30}\n")
    (pod / "ctr" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert limit_dirs("memory", tmp_path, proc)[:2] == [pod / "ctr", pod]
    assert _cgroup_limit(tmp_path, proc) == 2 << 30
    (pod / "ctr" / "memory.max").write_text(f"{1 << 30}\n")  # tighter below: that one
    assert _cgroup_limit(tmp_path, proc) == 1 << 30
