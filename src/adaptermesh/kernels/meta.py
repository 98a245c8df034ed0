"""Segment metadata for a batch of tokens that use many adapters.

Every layer of one forward pass groups the same tokens by the same adapter slots, so the
grouping is computed once per batch and shared by all SGMM launches of that pass.

Layout (all int32, fixed size so that a CUDA graph captured once can replay with new contents):

- ``token_slots[T_max]``: each token's pool slot, -1 for the base model only. Rows past the
  batch's real token count are -1.
- ``sorted_tokens[T_max]``: token indices ordered by slot (stable), base tokens last.
- ``seg_start[S + 1]``: slot ``s`` owns ``sorted_tokens[seg_start[s]:seg_start[s + 1]]``;
  ``seg_start[S]`` is the number of adapter tokens. Empty segments have equal bounds.
- ``invalid[1]``: how many tokens named a slot outside ``[-1, S)``. Such tokens are treated as
  base tokens so no kernel reads outside the pool; the count lets a caller that skipped the
  host-side check (``check_values=False``) find the error later without a synchronisation.

On CUDA the build is one Triton launch (``meta_kernel.py``): program ``s`` counts the
tokens of lower slots, which is where slot ``s``'s segment starts, then writes its own tokens
there in batch order; one more program places the base tokens after all adapter tokens,
writes the cleaned slots and counts the invalid ones. Elsewhere it is a handful of torch ops
(``where``, a stable ``sort``, ``scatter_add``, ``cumsum``). Both give the same buffers, with
no host synchronisation, so either can run inside stream capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SegmentMeta", "build_segment_meta"]


@dataclass
class SegmentMeta:
    """Device buffers describing how one batch's tokens map onto adapter slots."""

    token_slots: torch.Tensor  # [T_max] int32, -1 = base
    sorted_tokens: torch.Tensor  # [T_max] int32
    seg_start: torch.Tensor  # [S + 1] int32
    invalid: torch.Tensor  # [1] int32
    num_slots: int
    max_tokens: int
    # Scratch reused by rebuilds so a graph-captured rebuild allocates nothing.
    _sort_keys: torch.Tensor  # [T_max] int64
    _sort_idx: torch.Tensor  # [T_max] int64
    _sorted_keys: torch.Tensor  # [T_max] int64
    _counts: torch.Tensor  # [S + 1] int32

    @property
    def device(self) -> torch.device:
        return self.token_slots.device

    @classmethod
    def empty(cls, num_slots: int, max_tokens: int, device: torch.device | str) -> SegmentMeta:
        """Allocate buffers for up to ``max_tokens`` tokens and ``num_slots`` slots."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        dev = torch.device(device)
        i32 = torch.int32
        return cls(
            token_slots=torch.full((max_tokens,), -1, dtype=i32, device=dev),
            sorted_tokens=torch.zeros(max_tokens, dtype=i32, device=dev),
            seg_start=torch.zeros(num_slots + 1, dtype=i32, device=dev),
            invalid=torch.zeros(1, dtype=i32, device=dev),
            num_slots=num_slots,
            max_tokens=max_tokens,
            _sort_keys=torch.zeros(max_tokens, dtype=torch.int64, device=dev),
            _sort_idx=torch.zeros(max_tokens, dtype=torch.int64, device=dev),
            _sorted_keys=torch.zeros(max_tokens, dtype=torch.int64, device=dev),
            _counts=torch.zeros(num_slots + 1, dtype=i32, device=dev),
        )

    def segment_lengths(self) -> torch.Tensor:
        """[S] int32 tokens per slot (a device op; no host sync)."""
        return self.seg_start[1:] - self.seg_start[:-1]


def _build_triton(out: SegmentMeta, token_slots: torch.Tensor, t: int) -> None:
    # Imported here: this module (and the torch twins that read SegmentMeta) need no triton.
    from adaptermesh.kernels.meta_kernel import build_segments

    src = token_slots if t > 0 else out.token_slots
    build_segments(src, out.token_slots, out.sorted_tokens, out.seg_start, out.invalid, t,
                   out.max_tokens, out.num_slots)  # fmt: skip


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def build_segment_meta(
    token_slots: torch.Tensor,  # [T] int32, -1 = base
    num_slots: int,
    max_tokens: int | None = None,
    out: SegmentMeta | None = None,
    *,
    check_values: bool = True,
    use_triton: bool | None = None,
) -> SegmentMeta:
    """Group a batch's tokens by adapter slot.

    ``max_tokens`` (default ``T``) fixes the buffer sizes; tokens past ``T`` are base tokens.
    With ``out`` the buffers of an earlier build are overwritten in place (same ``num_slots``
    and ``max_tokens``), which is what CUDA-graph replay needs.

    ``check_values`` compares every slot with ``[-1, num_slots)`` and raises ``ValueError``.
    On a CUDA tensor that reads the values back (one host synchronisation), so the hot path may
    turn it off; it is skipped during stream capture. Either way out-of-range slots never
    reach a kernel: they count in ``meta.invalid`` and run as base tokens.

    ``use_triton`` picks the one-launch Triton build (default: on CUDA tensors) or the torch
    ops; the result is the same.
    """
    if not isinstance(token_slots, torch.Tensor):
        raise ValueError("token_slots must be a torch.Tensor")
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 (or int64), got {token_slots.dtype}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
    t = token_slots.shape[0]
    cap = t if max_tokens is None else max_tokens
    if not isinstance(cap, int) or cap < max(t, 1):
        raise ValueError(f"max_tokens must be an int >= len(token_slots)={t}, got {max_tokens!r}")
    dev = token_slots.device
    if out is None:
        out = SegmentMeta.empty(num_slots, cap, dev)
    else:
        if out.num_slots != num_slots:
            raise ValueError(f"out has num_slots={out.num_slots}, expected {num_slots}")
        if out.max_tokens != cap:
            raise ValueError(f"out has max_tokens={out.max_tokens}, expected {cap}")
        if out.device != dev:
            raise ValueError(f"out is on {out.device}, token_slots on {dev}")
    if check_values and t > 0 and not _capturing(dev):
        lo = int(token_slots.min())
        hi = int(token_slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"token_slots values must lie in [-1, {num_slots}), got min {lo} max {hi}"
            )

    if use_triton is None:
        use_triton = dev.type == "cuda"
    if use_triton:
        _build_triton(out, token_slots, t)
        return out
    slots = out.token_slots
    slots.fill_(-1)
    if t > 0:
        slots[:t].copy_(token_slots)
    bad = (slots < -1) | (slots >= num_slots)
    out.invalid.copy_(bad.sum().reshape(1).to(torch.int32))
    # Out-of-range slots run as base tokens: memory-safe, and counted above.
    slots.masked_fill_(bad, -1)
    # Sort key: base tokens (-1) go last, as slot S.
    keys = out._sort_keys
    keys.copy_(slots)
    keys.masked_fill_(slots < 0, num_slots)
    torch.sort(keys, stable=True, out=(out._sorted_keys, out._sort_idx))
    out.sorted_tokens.copy_(out._sort_idx)
    counts = out._counts
    counts.zero_()
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    out.seg_start[1:].copy_(torch.cumsum(counts[:num_slots], 0))
    return out
