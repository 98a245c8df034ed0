"""``EngineConfig``, its validation, and the engine's memory budget.

``plan_budget`` is pure: it turns the config and the model's and device's facts (KV bytes per
token, free and total device memory) into the sizes the engine allocates (KV blocks, the
per-step token budget, step entries, staging and output buffer lengths), so the sizing rules
are testable without building a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import cast

import torch

from adaptermesh.worker.kv_cache import KVCacheSpec, spec_bytes_per_token
from adaptermesh.worker.lora_groups import pool_groups
from adaptermesh.worker.saved_modules import POOL_KINDS
from adaptermesh.worker.sizing import (
    DeviceFacts,
    HostFacts,
    ModelFacts,
    Requested,
    Sizing,
    choose_sizing,
    host_memory_bytes,
)
from adaptermesh.worker.step_layout import staging_length
from adaptermesh.worker.types import MAX_LOGPROBS, InvalidRequestError

__all__ = [
    "DTYPES",
    "LOGPROBS_MODES",
    "SIZING_FIELDS",
    "DeviceMemory",
    "EngineBudget",
    "EngineConfig",
    "device_memory",
    "plan_budget",
    "resolve_dtype",
    "resolve_max_model_len",
    "size_config",
    "validate_config",
]

LOGPROBS_MODES = ("raw", "processed")

# The EngineConfig fields ``auto_size`` may name.
SIZING_FIELDS = frozenset(
    {"max_num_seqs", "max_num_batched_tokens", "max_loras", "kv_cache_bytes", "cpu_cache_bytes"}
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Device memory held back from the KV budget on CUDA: activations and captured graphs.
_ACTIVATION_RESERVE_BYTES = 1 << 30
# KV budget on CPU when the config gives none.
_CPU_KV_BYTES = 256 << 20


@dataclass(slots=True)
class EngineConfig:
    """Limits and sizes. Defaults suit a CPU test box; GPU deployments raise them."""

    max_model_len: int | None = None  # None: min(config max_position_embeddings, 4096)
    max_num_seqs: int = 8  # sequences running at once (decode batch rows)
    # GPU pool slots: adapters at max_lora_rank on every pool module. A float pool on one
    # device is an adapter arena of that many such adapters' bytes (lora_arena_bytes), in which
    # adapters on fewer modules take less and more of them fit.
    max_loras: int = 8
    max_lora_rank: int = 64
    # The adapter arena's bytes (None: max_loras adapters on every module); the sizing sets it
    # from the device's memory when it chooses max_loras.
    lora_arena_bytes: int | None = None
    # GPU slot and CPU cache eviction: "lru", "lru-greedy", "s3-fifo" or "w-tinylfu" (worker.eviction).
    adapter_eviction: str = "w-tinylfu"
    # Adapter weights in the GPU pool: None (the model dtype), "bf16"/"fp16"/"fp32" (must be
    # the model dtype) or "int4" (grouped INT4, about a quarter of the bytes per slot).
    lora_dtype: str | None = None
    # Modules the adapter pool holds LoRA weights for (None: every supported module). A pool
    # for q_proj/v_proj adapters holds only the qkv group: several times the adapters in the
    # same memory. An adapter that targets another module is refused when it loads.
    lora_target_modules: tuple[str, ...] | None = None
    # The pool holds DoRA factors (one per output feature of every pool module, per slot), so
    # use_dora adapters load; every projection then scales its rows by their slot's factor
    # (1 for plain LoRA and base rows). Off: use_dora adapters are refused by name.
    lora_dora: bool = False
    # The pool holds LoRA on embed_tokens and lm_head (a few MB a slot: rank x vocabulary
    # for each), so adapters targeting them load; each step then gathers the adapter rows'
    # embedding factors and adds the head's term to the logits rows. Off: such adapters are
    # refused by name.
    lora_vocab: bool = False
    # Trained module copies (PEFT modules_to_save) the pool holds per slot: any of
    # "embed_tokens", "lm_head" (a vocabulary x hidden table per slot each) and "norms"
    # (every norm of the model, a few vectors per layer). Adapters saving a module of another
    # kind are refused by name; empty: every modules_to_save adapter is (saved_modules.py).
    lora_saved_modules: tuple[str, ...] = ()
    # The most vocabulary rows past the model's an adapter in a pool slot may have (a resized
    # embedding and head, with the adapter's own tokenizer files; extra_vocab.py): per slot,
    # that many rows of the base embedding and head, and vocabulary factors and copies that
    # much wider. 0: adapters with extra vocabulary rows are refused by name.
    lora_extra_vocab: int = 0
    max_num_batched_tokens: int = 512  # token budget per step (decode rows + prompt chunks)
    max_prefill_chunk: int = 256
    max_prefill_seqs: int = 8  # prompt chunks per step
    gpu_memory_fraction: float = 0.85  # of total GPU memory, for weights + pool + KV cache
    # Explicit KV budget in bytes (all of it becomes blocks). None: from gpu_memory_fraction on
    # CUDA (256 MiB on CPU), capped at 4x what max_num_seqs full contexts need.
    kv_cache_bytes: int | None = None
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True  # share full prompt blocks between requests of one adapter
    cpu_cache_bytes: int = 2 << 30  # adapter CPU cache budget
    negative_ttl_s: float = 30.0
    max_waiting: int = 4096
    use_cuda_graphs: bool = True
    # CUDA: each LoRA shrink runs on a side stream beside its base matmul (both read the same
    # input), so its latency hides behind the matmul; the expand follows on the step's stream.
    lora_overlap: bool = True
    # ... for steps of at most this many tokens (batch-1/small decode, where launch latency
    # dominates); larger steps run the terms after each matmul.
    lora_overlap_max_tokens: int = 64
    graph_max_tokens: int = 512  # mixed prefill+decode steps up to this many tokens replay graphs
    # The LoRA kernels pick their tiles by the step's tokens per adapter (one adapter over a
    # batch-64 decode takes the dense tiles, 64 adapters the per-token ones); graphs are keyed
    # by that density class. False (the default until the GPU before/after below is measured:
    # docs/worker-engine.md, "Where a batch-64 step's time goes"): every step takes the worst
    # case's configs (a pool's worth of adapters), one graph per bucket.
    lora_density_configs: bool = False
    # Plan and launch step N+1 while step N runs. None: on CUDA only. True also on CPU, where
    # steps finish at launch but the in-flight token path (device gather, dropped tokens of
    # sequences that stopped) runs the same way; tests use it.
    async_scheduling: bool | None = None
    profile_steps: bool = False  # record host and GPU time per step in Engine.step_profile
    # With profile_steps: append each step's record to this file as one JSON line instead of
    # keeping it in Engine.step_profile (a long run's records stay out of the heap).
    step_profile_path: str | None = None
    adapter_slot_wait_s: float = 10.0
    max_expert_sets: int = 4  # resident AdaFuse expert sets (device memory outside the LoRA pool)
    # A request decoding alone merges its expert selection into the backbone only after the
    # same selection has repeated for this many consecutive tokens (0: never merge).
    adafuse_merge_after: int = 4
    # Which distribution logprobs describe (``SamplingParams.logprobs``): "raw" (log_softmax of
    # the model's logits, vLLM's default) or "processed" (the distribution the sampler draws
    # from: penalties, temperature and top-k/top-p/min-p applied; sampling.processed_logits).
    logprobs_mode: str = "raw"
    # A quantised base (config.json's quantization_config): "auto" keeps its linear weights
    # packed on CUDA (fp8: a gemv for up to 4 rows, torch._scaled_mm beyond; AWQ / GPTQ: the
    # W4A16 Triton GEMM; kernels/quant_linear.py), so the device holds fp8 / 4-bit bytes, and
    # dequantises them on the CPU; "on" packs on every device (the CPU runs the kernels' torch
    # twins); "off" dequantises everywhere (the dense GEMMs at the model dtype).
    quant_kernels: str = "auto"
    # Packed fp8 weights, steps of more than 4 rows: False, the weight-only W8A16 GEMM (the
    # activations keep the model dtype: the dequantised reference's maths); True, e4m3
    # activations (per row, or the checkpoint's static scale) for torch._scaled_mm (W8A8).
    quant_fp8_activations: bool = False
    # Sizes the worker chooses itself from the device and host memory (worker/sizing.py), by
    # field name: any of SIZING_FIELDS. The command line lists every size whose flag was not
    # given; the fields named here are replaced once the weights are on the device.
    auto_size: frozenset[str] = frozenset()
    # A waiting request passed over this many times while its adapter waits for a slot gets
    # the next slot (worker/scheduler.py, aging).
    max_adapter_skips: int = 16
    # Ranks of a tensor-parallel worker (worker/tp_group.py): 1 runs in this process; N > 1
    # starts N-1 more processes (one GPU each on CUDA) and splits heads, MLP columns, the LM
    # head's vocabulary, the KV cache and the adapter pool over them.
    tensor_parallel_size: int = 1
    # How o's and down's LoRA split over the ranks (worker/tp_shard.py): "base-reduce" (B
    # whole on every rank, the delta joins the base all-reduce) or "sharded" (B split too, the
    # rank-sized shrink output all-reduced first).
    tp_lora_scheme: str = "base-reduce"
    # The longest a generation request waits on its adapter's load in flight (a slow or
    # stalled store) before it fails with 503 and Retry-After; the load goes on. None: no bound.
    adapter_load_wait_s: float | None = 30.0


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The model dtype from a name ("bf16", "float32", ...) or a torch dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InvalidRequestError(
                "dtype", f"unknown dtype {dtype!r} (float32, bfloat16, float16)"
            )
        return DTYPES[dtype]
    return dtype


def validate_config(config: EngineConfig) -> None:
    """Refuse settings the engine cannot run with (InvalidRequestError naming the field)."""
    if config.logprobs_mode not in LOGPROBS_MODES:
        raise InvalidRequestError(
            "logprobs_mode",
            f"must be one of {', '.join(LOGPROBS_MODES)}, got {config.logprobs_mode!r}",
        )
    if config.quant_kernels not in ("auto", "on", "off"):
        raise InvalidRequestError(
            "quant_kernels", f"must be one of auto, on, off, got {config.quant_kernels!r}"
        )
    block_size = config.block_size
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size < 8
        or block_size > 256
        or block_size & (block_size - 1)
    ):
        raise InvalidRequestError(
            "block_size", f"must be a power of two in [8, 256], got {block_size!r}"
        )
    arena = config.lora_arena_bytes
    if arena is not None and (not isinstance(arena, int) or isinstance(arena, bool) or arena < 1):
        raise InvalidRequestError(
            "lora_arena_bytes", f"must be a positive number of bytes, got {arena!r}"
        )
    tp = config.tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InvalidRequestError("tensor_parallel_size", f"must be a positive integer, got {tp!r}")
    if config.tp_lora_scheme not in ("base-reduce", "sharded"):
        raise InvalidRequestError(
            "tp_lora_scheme",
            f"must be one of base-reduce, sharded, got {config.tp_lora_scheme!r}",
        )
    if tp > 1 and config.lora_dtype == "int4":
        raise InvalidRequestError(
            "lora_dtype", "int4 adapter pools are not supported with tensor_parallel_size > 1"
        )
    if config.lora_dora:
        _float_pool_on_one_device(config, "lora_dora", "DoRA pools are")
    if config.lora_vocab:
        _float_pool_on_one_device(config, "lora_vocab", "embedding and LM-head LoRA is")
    _check_saved_modules(config)
    _check_extra_vocab(config)
    if not isinstance(config.max_num_seqs, int) or config.max_num_seqs < 1:
        raise InvalidRequestError(
            "max_num_seqs", f"must be a positive integer, got {config.max_num_seqs!r}"
        )
    if not isinstance(config.max_prefill_seqs, int) or config.max_prefill_seqs < 1:
        raise InvalidRequestError(
            "max_prefill_seqs", f"must be a positive integer, got {config.max_prefill_seqs!r}"
        )
    if (
        not isinstance(config.adafuse_merge_after, int)
        or isinstance(config.adafuse_merge_after, bool)
        or config.adafuse_merge_after < 0
    ):
        raise InvalidRequestError(
            "adafuse_merge_after", f"must be an integer >= 0, got {config.adafuse_merge_after!r}"
        )

    try:
        pool_groups(config.lora_target_modules)
    except ValueError as exc:
        raise InvalidRequestError("lora_target_modules", str(exc)) from None
    unknown = sorted(set(config.auto_size) - SIZING_FIELDS)
    if unknown:
        raise InvalidRequestError(
            "auto_size", f"{unknown[0]!r} is not a size (one of {', '.join(sorted(SIZING_FIELDS))})"
        )
    if (
        not isinstance(config.max_adapter_skips, int)
        or isinstance(config.max_adapter_skips, bool)
        or config.max_adapter_skips < 0
    ):
        raise InvalidRequestError(
            "max_adapter_skips", f"must be an integer >= 0, got {config.max_adapter_skips!r}"
        )
    _check_load_wait(config)


def _float_pool_on_one_device(config: EngineConfig, field: str, what: str) -> None:
    """``what`` (a pool feature ``field`` turns on) lives in a float pool on one device:
    refused, naming ``field``, with tensor parallelism or an INT4 pool."""
    if config.tensor_parallel_size > 1:
        raise InvalidRequestError(field, f"{what} not implemented with tensor_parallel_size > 1")
    if config.lora_dtype == "int4":
        raise InvalidRequestError(field, f"{what} not implemented with lora_dtype int4")


def _check_extra_vocab(config: EngineConfig) -> None:
    extra = config.lora_extra_vocab
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
        raise InvalidRequestError("lora_extra_vocab", f"must be an integer >= 0, got {extra!r}")
    if extra:
        _float_pool_on_one_device(config, "lora_extra_vocab", "extra vocabulary rows are")


def _check_saved_modules(config: EngineConfig) -> None:
    saved = config.lora_saved_modules
    if not isinstance(saved, (tuple, list)) or not all(isinstance(k, str) for k in saved):
        raise InvalidRequestError(
            "lora_saved_modules", f"must be a list of module kinds, got {saved!r}"
        )
    unknown = sorted(set(saved) - set(POOL_KINDS))
    if unknown:
        raise InvalidRequestError(
            "lora_saved_modules",
            f"{unknown[0]!r} is not a kind of trained module copy (one of {', '.join(POOL_KINDS)})",
        )
    if saved:
        _float_pool_on_one_device(config, "lora_saved_modules", "trained module copies are")


def _check_load_wait(config: EngineConfig) -> None:
    wait = config.adapter_load_wait_s
    if wait is None:
        return
    if (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not math.isfinite(wait)
        or wait <= 0
    ):
        raise InvalidRequestError(
            "adapter_load_wait_s", f"must be a number of seconds > 0, got {wait!r}"
        )


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """The context length: the config's, else the model's, at most 4096."""
    return int(config.max_model_len or min(max_position_embeddings, 4096))


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the device has when the KV budget is planned (after weights and the LoRA pool)."""

    is_cuda: bool
    free_bytes: int = 0
    total_bytes: int = 0


def device_memory(device: torch.device, config: EngineConfig) -> DeviceMemory:
    """Measure the device's memory, on CUDA and only when the config gives no KV budget."""
    if device.type != "cuda":
        return DeviceMemory(is_cuda=False)
    if config.kv_cache_bytes is not None:
        return DeviceMemory(is_cuda=True)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return DeviceMemory(is_cuda=True, free_bytes=int(free_bytes), total_bytes=int(total_bytes))


@dataclass(frozen=True, slots=True)
class EngineBudget:
    """Sizes the engine allocates, from ``plan_budget``."""

    max_blocks_per_seq: int  # block-table width: blocks of one max_model_len sequence
    num_kv_blocks: int  # KV cache blocks (block 0 included)
    step_tokens: int  # token budget per step: at least one row per sequence plus one
    max_entries: int  # sequence entries a step's token output holds
    logprob_rows: int  # rows that may ask for logprobs in one step (every sampling entry)
    staging_len: int  # int64 elements of one host staging vector
    output_len: int  # int64 elements of the per-step device-to-host output


def kv_block_count(
    config: EngineConfig, max_blocks_per_seq: int, bytes_per_block: int, memory: DeviceMemory
) -> int:
    """KV blocks the budget holds: ``kv_cache_bytes`` if given (all of it); else, on CUDA,
    ``gpu_memory_fraction`` of the device less what is in use and a reserve for activations
    and graphs (on CPU 256 MiB), capped at 4x what max_num_seqs full contexts need."""
    cap: int | None = 1 + 4 * config.max_num_seqs * max_blocks_per_seq
    if config.kv_cache_bytes is not None:
        budget, cap = config.kv_cache_bytes, None
    elif memory.is_cuda:
        in_use = memory.total_bytes - memory.free_bytes
        budget = (
            int(memory.total_bytes * config.gpu_memory_fraction)
            - in_use
            - _ACTIVATION_RESERVE_BYTES
        )
    else:
        budget = _CPU_KV_BYTES
    num_blocks = max(0, budget) // bytes_per_block
    if cap is not None:
        num_blocks = min(num_blocks, cap)
    return int(num_blocks)


def plan_budget(
    config: EngineConfig, max_model_len: int, kv_spec: KVCacheSpec, memory: DeviceMemory
) -> EngineBudget:
    """The engine's sizes for this config, model (``kv_spec``) and device. Raises ValueError
    when the KV budget cannot hold one sequence of ``max_model_len`` tokens."""
    block_size = config.block_size
    bytes_per_block = spec_bytes_per_token(kv_spec) * block_size
    max_blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = kv_block_count(config, max_blocks_per_seq, bytes_per_block, memory)
    if num_blocks - 1 < max_blocks_per_seq:
        raise ValueError(
            f"kv_cache: the memory budget holds {max(0, num_blocks - 1) * block_size} tokens, less than one "
            f"sequence of max_model_len={max_model_len}; lower max_model_len or raise the budget"
        )
    rows = config.max_num_seqs
    step_tokens = max(config.max_num_batched_tokens, rows + 1)
    max_entries = max(rows + config.max_prefill_seqs, step_tokens)
    # Per step, one copy to the host: the sampled ids [S], then for logprob steps the values
    # [R, k + 1] (fp64 bits: the sampled token's, then the top k) and the top ids [R, k] of
    # the R <= rows + max_prefill_seqs asking rows (at most that many entries sample).
    logprob_rows = rows + config.max_prefill_seqs
    return EngineBudget(
        max_blocks_per_seq=max_blocks_per_seq,
        num_kv_blocks=num_blocks,
        step_tokens=step_tokens,
        max_entries=max_entries,
        logprob_rows=logprob_rows,
        staging_len=staging_length(step_tokens, max_entries),
        output_len=max_entries + logprob_rows * (2 * MAX_LOGPROBS + 1),
    )


def size_config(
    config: EngineConfig,
    *,
    device: torch.device,
    kv_bytes_per_token: int,
    slot_bytes: int,
    max_model_len: int,
    part_bytes: Mapping[str, int] | None = None,
) -> tuple[EngineConfig, Sizing | None]:
    """``config`` with the sizes ``auto_size`` names chosen from the device and host memory
    (``sizing.choose_sizing``), and that choice; unchanged with None when it names none.
    ``part_bytes``: an adapter arena's bytes per part of one adapter (None: a pool of slots);
    the chosen arena goes into ``lora_arena_bytes``.

    Called once the weights are on the device, so what they take counts as used."""
    if not config.auto_size:
        return config, None
    auto = config.auto_size
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        facts = DeviceFacts("cuda", int(total_bytes), int(total_bytes) - int(free_bytes))
    else:
        facts = DeviceFacts(device.type)

    def given(name: str) -> int | None:
        return None if name in auto else cast("int | None", getattr(config, name))

    requested = Requested(
        max_num_seqs=given("max_num_seqs"),
        max_num_batched_tokens=given("max_num_batched_tokens"),
        max_loras=given("max_loras"),
        kv_cache_bytes=given("kv_cache_bytes"),
        cpu_cache_bytes=given("cpu_cache_bytes"),
        gpu_memory_fraction=config.gpu_memory_fraction,
    )
    sizing = choose_sizing(
        facts,
        HostFacts(host_memory_bytes()),
        ModelFacts(kv_bytes_per_token, slot_bytes, max_model_len, dict(part_bytes or {})),
        requested,
    )
    sized = replace(
        config,
        max_num_seqs=sizing.max_num_seqs,
        max_num_batched_tokens=sizing.max_num_batched_tokens,
        max_loras=sizing.max_loras,
        lora_arena_bytes=sizing.adapter_arena_bytes if part_bytes else config.lora_arena_bytes,
        kv_cache_bytes=sizing.kv_cache_bytes,
        cpu_cache_bytes=sizing.cpu_cache_bytes,
    )
    validate_config(sized)
    return sized, sizing
