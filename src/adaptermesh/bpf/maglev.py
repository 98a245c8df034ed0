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

Two implementations give identical tables: a small C routine compiled once per machine with
the system C compiler (a full 100-shard, 65,537-slot build takes a few milliseconds), and a
pure-Python one that serves as the reference and the fallback where no compiler exists.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

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


def _permutation(key: str, size: int) -> tuple[int, int]:
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
    nxt = [0] * len(live)
    filled = 0
    r = 0
    while True:
        r += 1
        for i, w in enumerate(weights):
            if (r * w) // w_max == ((r - 1) * w) // w_max:
                continue
            offset, skip = perms[i]
            j = nxt[i]
            c = (offset + j * skip) % size
            while table[c] != NO_SHARD:
                j += 1
                c = (offset + j * skip) % size
            table[c] = values[i]
            nxt[i] = j + 1
            filled += 1
            if filled == size:
                return table


# ---- native builder -------------------------------------------------------------------------

_native_lock = threading.Lock()
_native_fn: Any = None
_native_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptermesh"


def _load_native() -> Any:
    """Compile (once per source version) and load maglev_fill.c; None without a compiler."""
    global _native_fn, _native_tried
    with _native_lock:
        if _native_tried:
            return _native_fn
        _native_tried = True
        if os.environ.get("ADAPTERMESH_MAGLEV_PURE") == "1":
            return None
        src = resources.files("adaptermesh.bpf").joinpath("maglev_fill.c").read_bytes()
        tag = hashlib.sha256(src).hexdigest()[:16]
        out = _cache_dir() / f"maglev_fill-{tag}.so"
        if not out.exists():
            cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
            if cc is None:
                return None
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                c_path = Path(tmp) / "maglev_fill.c"
                c_path.write_bytes(src)
                so_tmp = Path(tmp) / "maglev_fill.so"
                proc = subprocess.run(
                    [cc, "-O2", "-shared", "-fPIC", "-o", str(so_tmp), str(c_path)],
                    capture_output=True,
                    check=False,
                )
                if proc.returncode != 0:
                    return None
                os.replace(so_tmp, out)  # atomic: concurrent builders never see half a file
        lib = ctypes.CDLL(str(out))
        fn = lib.am_maglev_fill
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_uint32,  # size
            ctypes.c_uint32,  # n backends
            ctypes.POINTER(ctypes.c_uint64),  # offsets[n]
            ctypes.POINTER(ctypes.c_uint64),  # skips[n]
            ctypes.POINTER(ctypes.c_uint64),  # weights[n]
            ctypes.POINTER(ctypes.c_uint16),  # values[n]
            ctypes.POINTER(ctypes.c_uint64),  # scratch[n]
            ctypes.POINTER(ctypes.c_uint16),  # table[size] (out)
        ]
        _native_fn = fn
        return fn


def native_available() -> bool:
    return _load_native() is not None


def build_table(backends: Sequence[Backend], size: int = DEFAULT_SIZE) -> array[int]:
    """Build the weighted Maglev table: ``size`` uint16 slots holding backend values.

    Backends with weight 0 get no slots; with no weighted backend every slot is NO_SHARD.
    """
    fn = _load_native()
    if fn is None:
        return build_table_py(backends, size)
    live = _prepare(backends, size)
    table = array("H", [NO_SHARD]) * size
    n = len(live)
    if n == 0:
        return table
    perms = [_permutation(b.key, size) for b in live]
    u64n = ctypes.c_uint64 * n
    offsets = u64n(*(p[0] for p in perms))
    skips = u64n(*(p[1] for p in perms))
    weights = u64n(*(b.weight for b in live))
    values = (ctypes.c_uint16 * n)(*(b.value for b in live))
    scratch = u64n()
    addr, _ = table.buffer_info()
    rc = fn(size, n, offsets, skips, weights, values, scratch,
            ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint16)))
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
