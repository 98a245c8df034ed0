"""How big a worker makes itself: sequences, step budget, KV cache, adapter pool, CPU cache.

A worker started without sizing flags on a GPU chooses its sizes from the device and the host
(``choose_sizing``), the way vLLM sizes its KV cache from the GPU's memory; every flag still
overrides its own size, and the sizes a flag does not set are chosen around it. On the CPU the
defaults stay small (a developer box or a CI runner): the sizes ``EngineConfig`` always had.

On a GPU, once the weights are on the device:

* **The budget.** ``total * gpu_memory_fraction`` minus what the device already holds (the
  weights) minus a reserve for activations, sampling buffers and CUDA graphs.
* **Adapter arena.** ``ADAPTER_POOL_SHARE`` of the budget, at least ``MIN_LORA_SLOTS`` and at
  most ``MAX_LORA_SLOTS`` adapters of ``slot_bytes`` (one adapter at ``max_lora_rank`` on every
  target module); the arena never takes more than half the budget, so the KV cache always keeps
  the larger part. Each adapter takes only the parts it targets (``part_bytes``: one index of
  each part's grid), so the arena holds ``max_loras`` adapters on every module, and more of
  those on fewer: the start-up line says how many on each part alone. A ``max_loras`` flag
  sizes the arena for that many adapters on every module.
* **KV cache.** The rest of the budget.
* **Sequences.** ``DEFAULT_MAX_NUM_SEQS`` (256, vLLM's default), fewer when the KV cache
  cannot give every sequence ``MIN_TOKENS_PER_SEQUENCE`` tokens (a sequence that gets less
  than that spends its steps being preempted and recomputed).
* **Step budget.** Twice the sequences, at least 512 tokens: every decode row fits in one step
  with as many prompt tokens again beside it.
* **CPU cache** (both devices): ``CPU_CACHE_SHARE`` of the host memory the process may use
  (the tightest cgroup limit of the process's cgroup and the ones above it, as in a Kubernetes
  pod: worker/cgroups.py), between 256 MiB and
  ``MAX_CPU_CACHE_BYTES``. On the CPU it stays at the old 2 GiB unless the host has less.

Pure: the facts come in as values (``DeviceFacts``, ``HostFacts``, ``ModelFacts``), read by the
engine and ``host_memory_bytes``; tests drive every branch without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from adaptermesh.worker.cgroups import PROC_SELF_CGROUP, limit_dirs, read_limit_file

__all__ = [
    "ADAPTER_POOL_SHARE",
    "ARENA_ALIGN_BYTES",
    "CPU_CACHE_SHARE",
    "CPU_DEFAULTS",
    "DEFAULT_MAX_NUM_SEQS",
    "MAX_ARENA_INDICES",
    "DeviceFacts",
    "HostFacts",
    "ModelFacts",
    "Requested",
    "Sizing",
    "arena_adapters",
    "arena_lengths",
    "arena_size_for",
    "arena_unit",
    "choose_sizing",
    "host_memory_bytes",
]

GIB = 1 << 30
MIB = 1 << 20

DEFAULT_MAX_NUM_SEQS = 256
MIN_TOKENS_PER_SEQUENCE = 512
MIN_STEP_TOKENS = 512
ADAPTER_POOL_SHARE = 0.15
MIN_LORA_SLOTS = 8
MAX_LORA_SLOTS = 4096
# Activations of the largest step, sampling buffers, logits and the captured graphs' pool.
ACTIVATION_RESERVE_BYTES = 1 * GIB
CPU_CACHE_SHARE = 0.25
MIN_CPU_CACHE_BYTES = 256 * MIB
MAX_CPU_CACHE_BYTES = 64 * GIB
# The adapter arena: every part's grid steps by one unit (a multiple of ARENA_ALIGN_BYTES), and
# no grid has more than MAX_ARENA_INDICES indices (the LoRA kernels scan one part's segment
# table per program).
ARENA_ALIGN_BYTES = 256
MAX_ARENA_INDICES = 4096


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def arena_unit(size: int, part_bytes: Mapping[str, int]) -> int:
    """The step of every part's grid in an arena of ``size`` bytes: the smallest part's bytes
    (an adapter on that part alone takes one step), more where the arena would otherwise have
    more than MAX_ARENA_INDICES steps; aligned to ARENA_ALIGN_BYTES."""
    smallest = min(part_bytes.values(), default=ARENA_ALIGN_BYTES)
    return _align(max(smallest, -(-size // MAX_ARENA_INDICES), 1), ARENA_ALIGN_BYTES)


def arena_lengths(size: int, part_bytes: Mapping[str, int]) -> dict[str, int]:
    """Bytes one adapter takes of each part in an arena of ``size`` bytes: its part's bytes
    rounded up to whole steps, so any part starts at any step and an adapter's parts pack
    back to back."""
    unit = arena_unit(size, part_bytes)
    return {p: _align(b, unit) for p, b in part_bytes.items()}


def arena_adapters(
    size: int, part_bytes: Mapping[str, int], parts: Iterable[str] | None = None
) -> int:
    """How many adapters on ``parts`` (default: every part) an arena of ``size`` bytes holds."""
    lengths = arena_lengths(size, part_bytes)
    need = sum(lengths[p] for p in (lengths if parts is None else parts))
    return size // need if need else 0


def arena_size_for(adapters: int, part_bytes: Mapping[str, int]) -> int:
    """The smallest arena, in whole steps, that holds ``adapters`` adapters on every part.
    Raises ValueError when no arena does (more parts in all than MAX_ARENA_INDICES steps)."""
    if 2 * adapters * len(part_bytes) > MAX_ARENA_INDICES:
        raise ValueError(
            f"max_loras: {adapters} adapters on {len(part_bytes)} parts each need more steps "
            f"than an adapter arena's {MAX_ARENA_INDICES} leave room for"
        )
    size = adapters * sum(arena_lengths(0, part_bytes).values())
    # A larger arena may take larger steps (MAX_ARENA_INDICES): grow until they fit.
    while arena_adapters(size, part_bytes) < adapters:
        size = max(
            size + arena_unit(size, part_bytes),
            adapters * sum(arena_lengths(size, part_bytes).values()),
        )
    return size


@dataclass(frozen=True, slots=True)
class CpuDefaults:
    """The sizes a CPU worker gets without flags (small: a developer box or a CI runner)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_loras: int = 8
    kv_cache_bytes: int = 256 * MIB
    cpu_cache_bytes: int = 2 * GIB


CPU_DEFAULTS = CpuDefaults()


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """The device as the engine sees it once the weights are loaded."""

    kind: str  # "cuda" or "cpu"
    total_bytes: int = 0  # device memory (cuda)
    used_bytes: int = 0  # already taken: the weights, the CUDA context, other processes


@dataclass(frozen=True, slots=True)
class HostFacts:
    memory_bytes: int  # what this process may use: physical memory, or the cgroup's limit


@dataclass(frozen=True, slots=True)
class ModelFacts:
    kv_bytes_per_token: int  # every layer's K and V for one token
    slot_bytes: int  # one adapter pool slot at max_lora_rank on every target module
    max_model_len: int
    # Bytes one adapter takes of each pool part it targets (an adapter arena's grid strides);
    # empty for a pool of slots, where every adapter takes slot_bytes.
    part_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Requested:
    """The sizing flags as given; None: choose it."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_loras: int | None = None
    kv_cache_bytes: int | None = None
    cpu_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.85


@dataclass(frozen=True, slots=True)
class Sizing:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    # None: no explicit budget; the engine sizes the cache as before (256 MiB on the CPU,
    # capped at what max_num_seqs full contexts need).
    kv_cache_bytes: int | None
    cpu_cache_bytes: int
    # Each size's origin: "flag" or "auto (<why>)", for the start-up log line.
    origin: dict[str, str] = field(default_factory=dict)
    # The adapter arena: max_loras adapters on every module, or more on fewer (part_bytes).
    adapter_arena_bytes: int = 0
    part_bytes: Mapping[str, int] = field(default_factory=dict)

    def adapters_on(self, parts: list[str]) -> int:
        """How many adapters on exactly ``parts`` the arena holds."""
        return arena_adapters(self.adapter_arena_bytes, self.part_bytes, parts)

    def arena_description(self) -> str:
        """The arena and what it holds: on every module, and on each part alone."""
        if not self.part_bytes:
            return f"{self.max_loras} slots"
        alone = ", ".join(f"{p} {self.adapters_on([p])}" for p in self.part_bytes)
        return (
            f"{self.adapter_arena_bytes / GIB:.1f} GiB: {self.max_loras} adapters on every "
            f"module, or on one part alone: {alone}"
        )

    def describe(self) -> str:
        kv = (
            "from the budget"
            if self.kv_cache_bytes is None
            else f"{self.kv_cache_bytes / GIB:.1f} GiB"
        )
        parts = [
            f"max_num_seqs={self.max_num_seqs} [{self.origin.get('max_num_seqs', '')}]",
            f"max_num_batched_tokens={self.max_num_batched_tokens} [{self.origin.get('max_num_batched_tokens', '')}]",
            f"max_loras={self.max_loras} [{self.origin.get('max_loras', '')}]",
            f"adapter_arena={self.arena_description()}",
            f"kv_cache={kv} [{self.origin.get('kv_cache_bytes', '')}]",
            f"cpu_cache={self.cpu_cache_bytes / GIB:.1f} GiB [{self.origin.get('cpu_cache_bytes', '')}]",
        ]
        return ", ".join(parts)


def _cpu_cache(requested: Requested, host: HostFacts, device_kind: str) -> tuple[int, str]:
    if requested.cpu_cache_bytes is not None:
        return requested.cpu_cache_bytes, "flag"
    share = int(host.memory_bytes * CPU_CACHE_SHARE)
    if device_kind != "cuda":
        chosen = max(MIN_CPU_CACHE_BYTES, min(CPU_DEFAULTS.cpu_cache_bytes, share))
        return (
            chosen,
            f"auto ({CPU_CACHE_SHARE:.0%} of {host.memory_bytes / GIB:.1f} GiB host, at most 2 GiB)",
        )
    chosen = max(MIN_CPU_CACHE_BYTES, min(MAX_CPU_CACHE_BYTES, share))
    return chosen, f"auto ({CPU_CACHE_SHARE:.0%} of {host.memory_bytes / GIB:.1f} GiB host)"


def choose_sizing(
    device: DeviceFacts, host: HostFacts, model: ModelFacts, requested: Requested
) -> Sizing:
    """The worker's sizes: each flag as given, the rest chosen (module docstring)."""
    if model.kv_bytes_per_token <= 0 or model.slot_bytes <= 0 or model.max_model_len <= 0:
        raise ValueError("model facts must be positive")
    origin: dict[str, str] = {}
    cpu_cache, origin["cpu_cache_bytes"] = _cpu_cache(requested, host, device.kind)

    if device.kind != "cuda":
        seqs = (
            requested.max_num_seqs
            if requested.max_num_seqs is not None
            else CPU_DEFAULTS.max_num_seqs
        )
        step = (
            requested.max_num_batched_tokens
            if requested.max_num_batched_tokens is not None
            else CPU_DEFAULTS.max_num_batched_tokens
        )
        loras = requested.max_loras if requested.max_loras is not None else CPU_DEFAULTS.max_loras
        for name, value in (
            ("max_num_seqs", requested.max_num_seqs),
            ("max_num_batched_tokens", requested.max_num_batched_tokens),
            ("max_loras", requested.max_loras),
        ):
            origin[name] = "flag" if value is not None else "cpu default"
        origin["kv_cache_bytes"] = "flag" if requested.kv_cache_bytes is not None else "cpu default"
        return Sizing(
            seqs,
            step,
            loras,
            requested.kv_cache_bytes,
            cpu_cache,
            origin,
            _arena_for(loras, model),
            dict(model.part_bytes),
        )

    budget = (
        int(device.total_bytes * requested.gpu_memory_fraction)
        - device.used_bytes
        - ACTIVATION_RESERVE_BYTES
    )
    budget = max(0, budget)

    if requested.max_loras is not None:
        loras = requested.max_loras
        arena = _arena_for(loras, model)
        origin["max_loras"] = "flag"
    else:
        if requested.kv_cache_bytes is not None:
            pool_room = max(0, budget - requested.kv_cache_bytes)
            why = "the budget beside the KV flag"
        else:
            pool_room = min(int(budget * ADAPTER_POOL_SHARE), budget // 2)
            why = f"{ADAPTER_POOL_SHARE:.0%} of {budget / GIB:.1f} GiB"
        if model.part_bytes:
            # An arena takes the room itself: what adapters on fewer parts fit is not rounded
            # down to whole adapters on every module.
            arena = max(_arena_for(MIN_LORA_SLOTS, model), pool_room)
            loras = arena_adapters(arena, model.part_bytes)
        else:
            loras = max(MIN_LORA_SLOTS, min(MAX_LORA_SLOTS, pool_room // model.slot_bytes))
            arena = loras * model.slot_bytes
        origin["max_loras"] = f"auto ({why}, {model.slot_bytes / MIB:.0f} MiB on every module)"

    if requested.kv_cache_bytes is not None:
        kv_bytes: int | None = requested.kv_cache_bytes
        origin["kv_cache_bytes"] = "flag"
    else:
        kv_bytes = max(0, budget - arena)
        origin["kv_cache_bytes"] = "auto (the budget left beside the adapter pool)"
    kv_tokens = (kv_bytes if kv_bytes is not None else 0) // model.kv_bytes_per_token

    if requested.max_num_seqs is not None:
        seqs = requested.max_num_seqs
        origin["max_num_seqs"] = "flag"
    else:
        per_seq = min(model.max_model_len, MIN_TOKENS_PER_SEQUENCE)
        seqs = max(1, min(DEFAULT_MAX_NUM_SEQS, kv_tokens // per_seq))
        origin["max_num_seqs"] = (
            "auto (default)"
            if seqs == DEFAULT_MAX_NUM_SEQS
            else f"auto ({kv_tokens} KV tokens hold {per_seq} for each)"
        )

    if requested.max_num_batched_tokens is not None:
        step = requested.max_num_batched_tokens
        origin["max_num_batched_tokens"] = "flag"
    else:
        step = max(MIN_STEP_TOKENS, 2 * seqs)
        origin["max_num_batched_tokens"] = "auto (2 x sequences, at least 512)"
    return Sizing(seqs, step, loras, kv_bytes, cpu_cache, origin, arena, dict(model.part_bytes))


def _arena_for(adapters: int, model: ModelFacts) -> int:
    """Bytes of ``adapters`` adapters on every module: an arena's, or a pool of slots'."""
    if model.part_bytes:
        return arena_size_for(adapters, model.part_bytes)
    return adapters * model.slot_bytes


def _cgroup_limit(root: Path, proc_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """The tightest memory limit of this process's cgroups (cgroup.limit_dirs: its own and the
    ones above it; v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or None."""
    found = [
        int(text)
        for d in limit_dirs("memory", root, proc_cgroup)
        for name in ("memory.max", "memory.limit_in_bytes")
        if (text := read_limit_file(d / name)) is not None and text.isdigit()
    ]
    return min(found) if found else None


def host_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may use: physical memory, or less where a cgroup limit is set
    (a Kubernetes pod's ``resources.limits.memory``; cgroup v2, else v1)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit(cgroup_root)
    return physical if limit is None else min(physical, limit)
