"""Slot-based KV cache: one fixed row of ``max_model_len`` positions per running sequence.

Layout per layer: ``k[L][num_slots + 1, max_len, kv_heads, head_dim]`` (same for v). The extra
last row is a scratch row: idle decode rows write there so that a CUDA-graph decode step can
always run over every row without touching a sequence that is mid-prefill.

Why slots rather than pages: decode attention then reads the cache in place (row i of the
decode batch is cache row i), with no gather and fixed shapes for CUDA graphs. The cost is
that each sequence reserves ``max_model_len`` positions; the number of rows comes from a byte
budget (a GPU memory fraction on CUDA), so operators trade concurrency for context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCache", "KVCacheSpec", "kv_bytes_per_slot", "slots_for_budget"]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype


def kv_bytes_per_slot(spec: KVCacheSpec) -> int:
    elem = torch.empty((), dtype=spec.dtype).element_size()
    return 2 * spec.num_layers * spec.max_len * spec.num_kv_heads * spec.head_dim * elem


def slots_for_budget(spec: KVCacheSpec, budget_bytes: int, max_slots: int) -> int:
    """How many sequence rows fit in ``budget_bytes`` (one row is kept back as scratch)."""
    per = kv_bytes_per_slot(spec)
    fit = budget_bytes // per - 1
    return int(max(0, min(max_slots, fit)))


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(
                "kv_cache: the memory budget does not fit a single sequence of "
                f"max_model_len={spec.max_len}; lower max_model_len or raise the budget"
            )
        self.spec = spec
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        shape = (num_slots + 1, spec.max_len, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))
        self.lengths = [0] * num_slots  # tokens stored per slot (host-side bookkeeping)

    @property
    def nbytes(self) -> int:
        return kv_bytes_per_slot(self.spec) * (self.num_slots + 1)

    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"kv_cache: slot {slot} freed twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    def usage(self) -> float:
        """Fraction of cache positions holding live tokens."""
        return sum(self.lengths) / float(self.num_slots * self.spec.max_len)
