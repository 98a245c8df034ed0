"""Paged KV cache: device memory in fixed-size blocks, shared by every running sequence.

Layout per layer: ``k[l]`` and ``v[l]`` are ``[num_blocks, block_size, kv_heads, head_dim]``.
A sequence's positions map to blocks through its block table (``paging.BlockManager`` keeps
the tables on the host); position ``p`` of a sequence lives at flat slot
``table[p // block_size] * block_size + p % block_size``. Block 0 is never handed to a
sequence: padding entries of block tables point there.

Why pages: memory is held in proportion to the tokens a sequence really has, so concurrency is
bounded by the tokens held rather than by the longest context a request may reach, and full
blocks of a prompt can be shared by later requests of the same adapter (prefix caching).
Attention reads the blocks in place (``kernels.paged_attention``), so paging costs no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptermesh.worker.paging import kv_bytes_per_token

__all__ = ["KVCacheSpec", "PagedKVCache", "spec_bytes_per_token"]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def spec_bytes_per_token(spec: KVCacheSpec) -> int:
    """Bytes one token occupies across every layer, K and V (``paging.kv_bytes_per_token``)."""
    elem = torch.empty((), dtype=spec.dtype).element_size()
    return kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, elem)


class PagedKVCache:
    """The device tensors of the cache; all bookkeeping lives in ``paging.BlockManager``."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 2:
            raise ValueError(
                "kv_cache: the memory budget does not fit a single KV block; lower max_model_len, "
                "max_num_seqs or the weights' footprint, or raise the budget"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # One allocation per layer and tensor; zeros so that no read of an unwritten slot
        # (there is none by construction) could ever see NaN.
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return spec_bytes_per_token(self.spec) * self.num_blocks * self.block_size

    @property
    def num_tokens(self) -> int:
        """Token capacity of the usable blocks (block 0 excluded)."""
        return (self.num_blocks - 1) * self.block_size
