"""Scratch buffers for the split-K shrink: per-split fp32 partial sums and per-tile counters.

The split-K shrink (``sgmm.py``) runs ``split`` programs over disjoint ranges of H for one
(token tile, rank tile, slice); each writes its fp32 partial sum here and bumps the tile's
arrival counter, and the last to arrive adds the partials in split order, writes ``v`` and
sets the counter back to 0. So the counters are zero between launches and the buffers need no
memset per call: one launch per op, no host synchronisation.

Why a cache and not a per-call allocation: a per-call ``torch.zeros`` would be a second launch.
Why buffers are never freed: a captured CUDA graph keeps the raw addresses it was captured with,
so a buffer a graph may use must outlive the graph. The cache is keyed by exact size, so a
worker holds one pair per (device, stream, shape) it actually uses; the partials are only
needed for small token counts (a few MB at most).

Concurrency contract: launches that share a pair must not run at the same time. Eager calls on
different streams get different pairs. A capture reuses the pair that the warm-up call (run
eagerly before capture, as torch recommends) created for the same shape, so a graph must not be
replayed while eager calls of the same shape run on another stream. Without a warm-up the
capture gets its own zeroed pair (the zeroing is then part of the graph).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["split_workspace"]

_lock = threading.Lock()
# (device type, index, stream, n_counters, n_partial) -> (counters int32, partials fp32).
_cache: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
# Pairs allocated during stream capture: kept alive for the graphs that hold their addresses.
_captured: list[tuple[torch.Tensor, torch.Tensor]] = []


def _new_pair(device: torch.device, n_counters: int, n_partial: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(n_counters, dtype=torch.int32, device=device),
        torch.empty(n_partial, dtype=torch.float32, device=device),
    )


def split_workspace(
    device: torch.device, n_counters: int, n_partial: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters [>= n_counters] int32, zero when idle; partials [>= n_partial] fp32)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0
    with _lock:
        if capturing:
            for (dtype_, index, _s, nc, npart), pair in _cache.items():
                if (dtype_, index, nc, npart) == (device.type, device.index, n_counters, n_partial):
                    return pair
            counters, partials = _new_pair(device, n_counters, n_partial)
            _captured.append((counters, partials))
            return counters, partials
        key = (device.type, device.index, stream, n_counters, n_partial)
        hit = _cache.get(key)
        if hit is None:
            counters, partials = _new_pair(device, n_counters, n_partial)
            hit = (counters, partials)
            _cache[key] = hit
        return hit
