"""EngineConfig validation and the memory budget (pure: no model, no device)."""

from __future__ import annotations

import pytest
import torch

from adaptermesh.worker.engine_config import (
    DeviceMemory,
    EngineConfig,
    device_memory,
    kv_block_count,
    plan_budget,
    resolve_dtype,
    resolve_max_model_len,
    validate_config,
)
from adaptermesh.worker.kv_cache import KVCacheSpec, spec_bytes_per_token
from adaptermesh.worker.step_layout import staging_length
from adaptermesh.worker.types import MAX_LOGPROBS, InvalidRequestError

# 2 layers x 2 KV heads x 8 dims, fp32: K and V of one token take 2 * 2 * 2 * 8 * 4 = 256 bytes.
SPEC = KVCacheSpec(2, 2, 8, 16, torch.float32)
CPU = DeviceMemory(is_cuda=False)


def test_spec_bytes_used_by_these_tests() -> None:
    assert spec_bytes_per_token(SPEC) == 256


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("half", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_resolve_dtype(name: str | torch.dtype, dtype: torch.dtype) -> None:
    assert resolve_dtype(name) is dtype


def test_resolve_dtype_refuses_unknown_names() -> None:
    with pytest.raises(InvalidRequestError, match="dtype") as info:
        resolve_dtype("int8")
    assert info.value.field == "dtype"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs_mode", "sampled"),
        ("block_size", 12),
        ("block_size", 4),
        ("block_size", 512),
        ("block_size", True),
        ("block_size", 16.0),
        ("max_num_seqs", 0),
        ("max_num_seqs", 2.5),
        ("max_prefill_seqs", 0),
        ("adafuse_merge_after", -1),
        ("adafuse_merge_after", True),
    ],
)
def test_validate_config_names_the_bad_field(field: str, value: object) -> None:
    config = EngineConfig()
    setattr(config, field, value)
    with pytest.raises(InvalidRequestError) as info:
        validate_config(config)
    assert info.value.field == field


@pytest.mark.parametrize("block_size", [8, 16, 32, 256])
def test_validate_config_accepts_powers_of_two(block_size: int) -> None:
    validate_config(
        EngineConfig(block_size=block_size, adafuse_merge_after=0, logprobs_mode="processed")
    )


def test_max_model_len_defaults_to_the_model_capped_at_4096() -> None:
    assert resolve_max_model_len(EngineConfig(), 2048) == 2048
    assert resolve_max_model_len(EngineConfig(), 32768) == 4096
    assert resolve_max_model_len(EngineConfig(max_model_len=8192), 32768) == 8192


def test_cpu_budget_is_256_mib_capped_at_four_full_contexts() -> None:
    config = EngineConfig(max_num_seqs=2)
    bytes_per_block = 256 * 16
    # 256 MiB holds 65536 blocks, far above the cap of 1 + 4 * rows * blocks per sequence.
    assert kv_block_count(config, 8, bytes_per_block, CPU) == 1 + 4 * 2 * 8
    assert kv_block_count(config, 100_000, bytes_per_block, CPU) == (256 << 20) // bytes_per_block


def test_explicit_kv_bytes_all_become_blocks() -> None:
    config = EngineConfig(max_num_seqs=2, kv_cache_bytes=1000 * 4096 + 17)
    assert kv_block_count(config, 8, 4096, CPU) == 1000  # no cap
    assert kv_block_count(config, 8, 4096, DeviceMemory(is_cuda=True)) == 1000


def test_cuda_budget_takes_the_fraction_less_memory_in_use_and_a_reserve() -> None:
    config = EngineConfig(max_num_seqs=1024, gpu_memory_fraction=0.5)
    total, free = 64 << 30, 40 << 30  # 24 GiB in use
    memory = DeviceMemory(is_cuda=True, free_bytes=free, total_bytes=total)
    expected = (int(total * 0.5) - (total - free) - (1 << 30)) // (1 << 20)
    assert kv_block_count(config, 256, 1 << 20, memory) == expected
    # Over budget: no blocks at all (never negative).
    full = DeviceMemory(is_cuda=True, free_bytes=1 << 30, total_bytes=total)
    assert kv_block_count(config, 256, 1 << 20, full) == 0


def test_plan_budget_sizes() -> None:
    config = EngineConfig(
        max_num_seqs=4, max_prefill_seqs=3, max_num_batched_tokens=64, block_size=16
    )
    budget = plan_budget(config, 100, SPEC, CPU)
    assert budget.max_blocks_per_seq == 7  # ceil(100 / 16)
    assert budget.num_kv_blocks == 1 + 4 * 4 * 7
    assert budget.step_tokens == 64
    assert budget.max_entries == 64  # the token budget exceeds rows + prefill chunks
    assert budget.logprob_rows == 7
    assert budget.staging_len == staging_length(64, 64) == 5 * 64 + 4 * 64 + 1
    assert budget.output_len == 64 + 7 * (2 * MAX_LOGPROBS + 1)


def test_plan_budget_keeps_one_row_per_sequence_plus_one() -> None:
    config = EngineConfig(max_num_seqs=8, max_prefill_seqs=8, max_num_batched_tokens=4)
    budget = plan_budget(config, 64, SPEC, CPU)
    assert budget.step_tokens == 9
    assert budget.max_entries == 16


def test_plan_budget_refuses_a_budget_below_one_sequence() -> None:
    config = EngineConfig(kv_cache_bytes=4 * 256 * 16)  # 4 blocks, block 0 reserved: 48 tokens
    with pytest.raises(
        ValueError, match=r"holds 48 tokens, less than one sequence of max_model_len=64"
    ):
        plan_budget(config, 64, SPEC, CPU)
    assert plan_budget(config, 48, SPEC, CPU).num_kv_blocks == 4


def test_device_memory_on_cpu_measures_nothing() -> None:
    assert device_memory(torch.device("cpu"), EngineConfig()) == CPU
