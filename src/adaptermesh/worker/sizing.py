"""How big a worker makes itself: sequences, step budget, KV cache, adapter pool, CPU cache.

A worker started without sizing flags on a GPU chooses its sizes from the device and the host
(``choose_sizing``), the way vLLM sizes its KV cache from the GPU's memory; every flag still
overrides its own size, and the sizes a flag does not set are chosen around it. On the CPU the
defaults stay small (a developer box or a CI runner): the sizes ``EngineConfig`` always had.

On a GPU, once the weights are on the device:

* **The budget.** ``total * gpu_memory_fraction`` minus what the device already holds (the
  weights) minus a reserve for activations, sampling buffers and CUDA graphs.
* **Adapter pool.** ``ADAPTER_POOL_SHARE`` of the budget in slots of ``slot_bytes`` (one slot
  holds one adapter at ``max_lora_rank`` on every target module), at least ``MIN_LORA_SLOTS``
  and at most ``MAX_LORA_SLOTS``; the pool never takes more than half the budget, so the KV
  cache always keeps the larger part.
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
from dataclasses import dataclass, field
from pathlib import Path

from adaptermesh.worker.cgroups import PROC_SELF_CGROUP, limit_dirs, read_limit_file

__all__ = [
    "ADAPTER_POOL_SHARE",
    "CPU_CACHE_SHARE",
    "CPU_DEFAULTS",
    "DEFAULT_MAX_NUM_SEQS",
    "DeviceFacts",
    "HostFacts",
    "ModelFacts",
    "Requested",
    "Sizing",
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
        return Sizing(seqs, step, loras, requested.kv_cache_bytes, cpu_cache, origin)

    budget = (
        int(device.total_bytes * requested.gpu_memory_fraction)
        - device.used_bytes
        - ACTIVATION_RESERVE_BYTES
    )
    budget = max(0, budget)

    if requested.max_loras is not None:
        loras = requested.max_loras
        origin["max_loras"] = "flag"
    else:
        if requested.kv_cache_bytes is not None:
            pool_room = max(0, budget - requested.kv_cache_bytes)
            why = "the budget beside the KV flag"
        else:
            pool_room = min(int(budget * ADAPTER_POOL_SHARE), budget // 2)
            why = f"{ADAPTER_POOL_SHARE:.0%} of {budget / GIB:.1f} GiB"
        fit = pool_room // model.slot_bytes
        loras = max(MIN_LORA_SLOTS, min(MAX_LORA_SLOTS, fit))
        origin["max_loras"] = f"auto ({why}, {model.slot_bytes / MIB:.0f} MiB a slot)"

    if requested.kv_cache_bytes is not None:
        kv_bytes: int | None = requested.kv_cache_bytes
        origin["kv_cache_bytes"] = "flag"
    else:
        kv_bytes = max(0, budget - loras * model.slot_bytes)
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
    return Sizing(seqs, step, loras, kv_bytes, cpu_cache, origin)


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
