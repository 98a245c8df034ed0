"""Weighted Maglev table builder: pure and deterministic.

A table has ``size`` slots (a prime, 65,537 by default); the classifier hashes a packet's
source address with :func:`source_hash` and takes ``table[hash % size]`` as the shard for a
new flow. The builder follows Maglev (Eisenbud et al., NSDI 2016): every backend walks its own
permutation of the slots, ``(offset + j * skip) % size``, and claims the first free slot on its
turn. Weights set how often a backend gets a turn: in round ``r`` backend ``i`` claims
``(r * w_i) // w_max - ((r - 1) * w_i) // w_max`` slots (0 or 1), so after any number of rounds
each backend holds its share within about one slot: with ``c_i = R w_i / w_max - f_i + d_i``
(``f_i`` in [0, 1), ``d_i`` in {0, 1} for the partial last round), ``|c_i - M w_i / W| <= 1 +
n w_i / W``, so the total error is at most ``2n`` slots. Offsets and skips come from a hash of the
backend's *key* (the shard id), never from its position in the input, and backends are visited
in key order, so equal inputs give equal tables on every node.

The round rule gives backend ``i`` its ``k``-th turn in round ``ceil(k * w_max / w_i)``, so the
builders do not loop over rounds: a min-heap keyed by ``(round, position in key order)`` hands
out the turns in exactly the round rule's order, at O(log n) per slot whatever the weight skew.
The tables are the same as a round-by-round walk gives (a test keeps that walk as the oracle).

Two implementations give identical tables: a small C routine, compiled into the package as the
``_maglev_native`` extension when the package is built (a full 100-shard, 65,537-slot build
takes about a millisecond), and a pure-Python one that serves as the reference for tests
(``ADAPTERMESH_MAGLEV_PURE=1`` selects it). Nothing is compiled at run time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import heapq
import os
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_SIZE",
    "NO_SHARD",
    "Backend",
    "build_table",
    "build_table_py",
    "is_prime",
    "native_available",
    "source_hash",
    "table_shares",
]

DEFAULT_SIZE = 65537
# Must stay in sync with AM_NO_SHARD in classifier.h.
NO_SHARD = 0xFFFF


@dataclass(frozen=True, slots=True)
class Backend:
    """One shard in the table: ``value`` is written into its slots (the shard index)."""

    key: str
    value: int
    weight: int


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def source_hash(addr16: bytes) -> int:
    """The classifier's hash of a 16-byte source address (IPv4 as ``::ffff:a.b.c.d``).

    Must stay in sync with ``am_hash()`` in classifier.bpf.c.
    """
    if len(addr16) != 16:
        raise ValueError(f"source address must be 16 bytes, got {len(addr16)}")
    h = 0x9747B28C
    for i in range(4):
        h = _fmix32(h ^ int.from_bytes(addr16[4 * i : 4 * i + 4], "little"))
    return h


@functools.lru_cache(maxsize=4096)
def _permutation(key: str, size: int) -> tuple[int, int]:
    # Cached by shard id: the same shards come back every 5 s, and BLAKE2b of 100 keys is a
    # visible part of a millisecond-scale build.
    digest = hashlib.blake2b(key.encode(), digest_size=16, person=b"am-maglev").digest()
    offset = int.from_bytes(digest[:8], "little") % size
    skip = int.from_bytes(digest[8:], "little") % (size - 1) + 1
    return offset, skip


def _prepare(backends: Sequence[Backend], size: int) -> list[Backend]:
    if not is_prime(size):
        raise ValueError(f"size: {size} is not prime")
    keys = [b.key for b in backends]
    if len(set(keys)) != len(keys):
        raise ValueError("backends: duplicate key")
    for b in backends:
        if b.weight < 0:
            raise ValueError(f"backends[{b.key}].weight: negative")
        if not 0 <= b.value < NO_SHARD:
            raise ValueError(f"backends[{b.key}].value: {b.value} out of range")
    return sorted((b for b in backends if b.weight > 0), key=lambda b: b.key)


def build_table_py(backends: Sequence[Backend], size: int = DEFAULT_SIZE) -> array[int]:
    """The reference builder (pure Python). Returns ``size`` uint16 slots."""
    live = _prepare(backends, size)
    table = array("H", [NO_SHARD]) * size
    if not live:
        return table
    perms = [_permutation(b.key, size) for b in live]
    weights = [b.weight for b in live]
    values = [b.value for b in live]
    w_max = max(weights)
    slot = [offset for offset, _ in perms]
    skips = [skip for _, skip in perms]
    turns = [1] * len(live)
    # (round of the next turn, position in key order): the round rule's order of turns.
    heap = [(-(-w_max // w), i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    filled = 0
    while True:
        _, i = heap[0]
        c, skip = slot[i], skips[i]
        while table[c] != NO_SHARD:
            c += skip
            if c >= size:
                c -= size
        table[c] = values[i]
        c += skip
        slot[i] = c - size if c >= size else c
        filled += 1
        if filled == size:
            return table
        turns[i] += 1
        heapq.heapreplace(heap, (-(-turns[i] * w_max // weights[i]), i))


# ---- native builder -------------------------------------------------------------------------

_native_lock = threading.Lock()
_native_fn: Any = None
_native_tried = False


def _load_native() -> Any:
    """The C fill from the extension module built with the package (``_maglev_native.c``).

    A package built without it fails here with ImportError: the pure-Python builder is the
    reference for tests and ``ADAPTERMESH_MAGLEV_PURE=1``, never a silent fallback."""
    global _native_fn, _native_tried
    with _native_lock:
        if _native_tried:
            return _native_fn
        _native_tried = True
        if os.environ.get("ADAPTERMESH_MAGLEV_PURE") == "1":
            return None
        from adaptermesh.bpf import _maglev_native  # type: ignore[attr-defined]

        out = _maglev_native.__file__
        lib = ctypes.CDLL(str(out))
        fn = lib.am_maglev_fill
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_uint32,  # size
            ctypes.c_uint32,  # n backends
            ctypes.c_void_p,  # const uint64 offsets[n]
            ctypes.c_void_p,  # const uint64 skips[n]
            ctypes.c_void_p,  # const uint64 weights[n]
            ctypes.c_void_p,  # const uint16 values[n]
            ctypes.c_uint64,  # calendar rounds (a power of two > w_max / w_min + 1)
            ctypes.c_void_p,  # uint64 scratch (layout in maglev_fill.c)
            ctypes.c_void_p,  # uint16 table[size] (out)
        ]
        _native_fn = fn
        return fn


def native_available() -> bool:
    return _load_native() is not None


_U64 = npt.NDArray[np.uint64]
# The C fill's scratch (mostly its calendar of rounds) is capped at 32 MiB. Shards with weights
# in 1..10,000 need at most 16,384 rounds x 4 words (256 shards): 512 KiB.
_MAX_SCRATCH_WORDS = 1 << 22


@functools.lru_cache(maxsize=64)
def _perm_arrays(keys: tuple[str, ...], size: int) -> tuple[_U64, _U64]:
    """Offsets and skips of a sorted key set, as the C routine takes them (read-only arrays).

    Cached by the key set: the shard set rarely changes between assignments, weights do.
    """
    perms = [_permutation(k, size) for k in keys]
    offsets = np.fromiter((p[0] for p in perms), dtype=np.uint64, count=len(perms))
    skips = np.fromiter((p[1] for p in perms), dtype=np.uint64, count=len(perms))
    offsets.flags.writeable = False
    skips.flags.writeable = False
    return offsets, skips


def build_table(backends: Sequence[Backend], size: int = DEFAULT_SIZE) -> array[int]:
    """Build the weighted Maglev table: ``size`` uint16 slots holding backend values.

    Backends with weight 0 get no slots; with no weighted backend every slot is NO_SHARD.
    """
    fn = _load_native()
    if fn is None:
        return build_table_py(backends, size)
    live = _prepare(backends, size)
    n = len(live)
    if n == 0:
        return array("H", [NO_SHARD]) * size
    offsets, skips = _perm_arrays(tuple(b.key for b in live), size)
    w_max = max(b.weight for b in live)
    w_min = min(b.weight for b in live)
    cal_rounds = 1 << (w_max // w_min + 1).bit_length()
    scratch_words = 4 * n + (size + 63) // 64 + cal_rounds * ((n + 63) // 64)
    if w_max >= 1 << 32 or scratch_words > _MAX_SCRATCH_WORDS:
        # Weights this skewed would need a huge calendar; the Python builder has no limit.
        return build_table_py(backends, size)
    weights = np.fromiter((b.weight for b in live), dtype=np.uint64, count=n)
    values = np.fromiter((b.value for b in live), dtype=np.uint16, count=n)
    scratch = np.empty(scratch_words, dtype=np.uint64)
    table = array("H", bytes(2 * size))  # every slot is written by the fill
    addr, _ = table.buffer_info()
    rc = fn(
        size,
        n,
        offsets.ctypes.data,
        skips.ctypes.data,
        weights.ctypes.data,
        values.ctypes.data,
        cal_rounds,
        scratch.ctypes.data,
        addr,
    )
    if rc != 0:
        raise RuntimeError(f"maglev fill failed ({rc})")
    return table


def table_shares(table: Sequence[int]) -> dict[int, int]:
    """Slots per value (NO_SHARD excluded)."""
    counts: dict[int, int] = {}
    for v in table:
        if v != NO_SHARD:
            counts[v] = counts.get(v, 0) + 1
    return counts
