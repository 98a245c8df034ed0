"""Eviction policies for the adapter caches: GPU pool slots and the CPU cache.

The manager (``adapters.AdapterManager``) owns residency; a policy only orders the resident
keys and keeps a little history. The manager tells it what happened and asks it to choose:

* ``access(key)``: one request for ``key``, resident or not (a non-resident access only feeds
  frequency history, for the policies that keep one).
* ``insert(key, size)``: ``key`` became resident with ``size`` units of the capacity (1 per GPU
  slot; bytes in the CPU cache).
* ``remove(key)``: ``key`` left for a reason the policy did not choose (unload, reload, the
  name turned into an expert set). Removal keeps no history.
* ``evict(allowed)``: choose a victim among the resident keys for which ``allowed(key)`` is
  true, forget it (keeping history where the policy does), and return it; ``None`` when no
  resident key is allowed. The manager never allows pinned keys, keys whose slot is in use
  (reference count above zero) or reserved, keys that a waiting request has claimed (the
  scheduler's adapter-aware admission), and the key being reloaded. The caller must then
  evict the returned key; the policy already counts it as gone.

Policies are pure Python, keep O(1) work per access (W-TinyLFU: a few integer hashes), and
bound every piece of non-resident state (ghosts, sketch, doorkeeper) by their construction
arguments. An eviction walks past keys the manager does not allow; those are at most the
pinned, in-use and claimed keys, so it stays O(capacity) in the worst case and O(1) typically.

Admission. W-TinyLFU's admission filter and S3-FIFO's probationary queue can refuse a newcomer
a long stay, but never its first use: a request that needs an adapter is always served. For a
GPU slot, "not admitted" means the newcomer is loaded and serves its requests from the admission
window (W-TinyLFU) or the small FIFO (S3-FIFO), and it is the first victim the next time a
slot is needed unless it was requested again (S3-FIFO) or its estimated frequency beats the
main region's victim (W-TinyLFU). The CPU cache uses the same rule: a newcomer is cached and is
the first to go when the byte budget is exceeded, unless it earns its place as above.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "CountMinSketch",
    "EvictionPolicy",
    "LruGreedyPolicy",
    "LruPolicy",
    "S3FifoPolicy",
    "WTinyLfuPolicy",
    "make_policy",
]

Allowed = Callable[[str], bool]
_V = TypeVar("_V")
_MASK64 = (1 << 64) - 1
_HALVE = bytes(v >> 1 for v in range(256))  # translate table: every counter halved


class EvictionPolicy(ABC):
    """Orders resident keys; see the module docstring for the contract with the manager."""

    name: ClassVar[str]

    def __init__(self, capacity: int, *, entries: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"eviction policy capacity must be at least 1, got {capacity}")
        # ``entries``: how many keys the cache holds when full; sizes history and the sketch.
        # Equal to ``capacity`` when every key has size 1 (GPU slots).
        self.capacity = capacity
        self.entries = max(1, entries if entries is not None else capacity)

    @abstractmethod
    def access(self, key: str) -> None: ...

    @abstractmethod
    def insert(self, key: str, size: int = 1) -> None: ...

    @abstractmethod
    def remove(self, key: str) -> None: ...

    @abstractmethod
    def evict(self, allowed: Allowed) -> str | None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def state_size(self) -> int:
        """Entries held for keys that are not resident (ghosts, history); bounded."""
        return 0


class _RecencyPolicy(EvictionPolicy, Generic[_V]):
    """A policy over one recency order of the resident keys, each with a value of ``_V``."""

    def __init__(self, capacity: int, *, entries: int | None = None) -> None:
        super().__init__(capacity, entries=entries)
        self._order: OrderedDict[str, _V] = OrderedDict()  # least recent first

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class LruPolicy(_RecencyPolicy[None]):
    """Least recently used: the allowed key whose last access or insert is oldest."""

    name = "lru"

    def access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: str, size: int = 1) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def evict(self, allowed: Allowed) -> str | None:
        for key in self._order:
            if allowed(key):
                del self._order[key]
                return key
        return None


class LruGreedyPolicy(_RecencyPolicy[list[int]]):
    """LRU-Greedy: among the ``window`` least recently used allowed keys, evict the one with
    the lowest ``hits / size``, the least recently used of them on a tie.

    Exact definition used here: every resident key carries ``hits``, the number of accesses
    since it last became resident, counting the insert as one (so a key used once has 1).
    ``size`` is what the manager inserted it with (1 per GPU slot, bytes in the CPU cache). The
    window is taken in recency order, oldest first, skipping keys the manager does not allow.
    With ``window=1`` this is exactly LRU. Nothing is remembered about evicted keys.
    """

    name = "lru-greedy"

    def __init__(self, capacity: int, *, entries: int | None = None, window: int = 8) -> None:
        super().__init__(capacity, entries=entries)
        if window < 1:
            raise ValueError(f"lru-greedy window must be at least 1, got {window}")
        self.window = window  # each key's value: [hits, size]

    def access(self, key: str) -> None:
        entry = self._order.get(key)
        if entry is not None:
            entry[0] += 1
            self._order.move_to_end(key)

    def insert(self, key: str, size: int = 1) -> None:
        self._order[key] = [1, max(1, size)]
        self._order.move_to_end(key)

    def evict(self, allowed: Allowed) -> str | None:
        best: str | None = None
        best_score = 0.0
        seen = 0
        for key, (hits, size) in self._order.items():
            if not allowed(key):
                continue
            score = hits / size
            if best is None or score < best_score:
                best, best_score = key, score
            seen += 1
            if seen >= self.window:
                break
        if best is not None:
            del self._order[best]
        return best


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO: a small probationary FIFO, a main FIFO with CLOCK-style second chances, and a
    ghost FIFO of keys recently dropped from the small queue.

    * New keys enter the small queue S, unless the ghost G remembers them: then they enter the
      main queue M. Each resident key has a 2-bit counter (0..3) that every access raises.
    * Eviction takes from S while S holds at least ``small_fraction`` of the capacity (10%),
      else from M. From S: the oldest key moves to M (counter reset to 0) if it was accessed
      since it entered, else it is the victim and its name goes to G. From M: the oldest key
      with a counter above 0 is decremented and moved to the head; the first with 0 is the
      victim (not remembered).
    * Keys the manager does not allow are rotated to the head of their queue, untouched. When
      the preferred queue has no allowed victim the other one is tried.
    * G keeps at most ``ghost_entries`` names (default: ``entries``), oldest dropped first.
    """

    name = "s3-fifo"

    def __init__(
        self,
        capacity: int,
        *,
        entries: int | None = None,
        small_fraction: float = 0.1,
        ghost_entries: int | None = None,
    ) -> None:
        super().__init__(capacity, entries=entries)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"s3-fifo small_fraction must be in (0, 1), got {small_fraction}")
        self.small_cap = max(1, round(capacity * small_fraction))
        self.ghost_cap = max(1, ghost_entries if ghost_entries is not None else self.entries)
        # key -> [freq, size]; OrderedDicts are FIFOs with the oldest first.
        self._small: OrderedDict[str, list[int]] = OrderedDict()
        self._main: OrderedDict[str, list[int]] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._small_weight = 0

    def access(self, key: str) -> None:
        entry = self._small.get(key) or self._main.get(key)
        if entry is not None and entry[0] < 3:
            entry[0] += 1

    def insert(self, key: str, size: int = 1) -> None:
        self.remove(key)
        size = max(1, size)
        if key in self._ghost:  # dropped from S recently and wanted again: straight to main
            del self._ghost[key]
            self._main[key] = [0, size]
        else:
            self._small[key] = [0, size]
            self._small_weight += size

    def remove(self, key: str) -> None:
        entry = self._small.pop(key, None)
        if entry is not None:
            self._small_weight -= entry[1]
        self._main.pop(key, None)

    def _evict_small(self, allowed: Allowed) -> str | None:
        for _ in range(len(self._small)):
            key, entry = self._small.popitem(last=False)
            if not allowed(key):
                self._small[key] = entry  # rotate past it
                continue
            self._small_weight -= entry[1]
            if entry[0] > 0:
                entry[0] = 0
                self._main[key] = entry
                continue
            self._ghost[key] = None
            while len(self._ghost) > self.ghost_cap:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, allowed: Allowed) -> str | None:
        # Each allowed key is passed at most 3 times (its counter reaches 0), the others once
        # per round: 4 rounds always suffice.
        for _ in range(4 * len(self._main)):
            key, entry = self._main.popitem(last=False)
            if allowed(key) and entry[0] == 0:
                return key
            if allowed(key):
                entry[0] -= 1
            self._main[key] = entry
        return None

    def evict(self, allowed: Allowed) -> str | None:
        if self._small_weight >= self.small_cap:
            return self._evict_small(allowed) or self._evict_main(allowed)
        # S below its share: M first; S's allowed keys that were accessed move to M, so M is
        # tried once more after S.
        return self._evict_main(allowed) or self._evict_small(allowed) or self._evict_main(allowed)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def state_size(self) -> int:
        return len(self._ghost)


class CountMinSketch:
    """Frequency estimates with 4-bit counters (saturating at 15), ``depth`` rows, a doorkeeper
    Bloom filter in front, and periodic aging.

    * The first access of a key in a period only sets its doorkeeper bits; later ones increment
      the sketch. ``estimate`` is the minimum over rows plus 1 if the doorkeeper has the key.
    * After ``sample`` recorded accesses, every counter is halved and the doorkeeper is
      cleared, so frequencies describe the recent past.
    * Hashing is deterministic (CRC-32 of the key, multiply-shift per row), so a trace gives
      the same decisions in every process.
    """

    _MULTS = (
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
    )

    def __init__(self, entries: int, *, depth: int = 4, sample_factor: int = 10) -> None:
        if not 1 <= depth <= 4:
            raise ValueError(f"sketch depth must be 1..4, got {depth}")
        # Width: at least 16 counters per cached entry (and 1024), a power of two, so keys
        # far outside the cache rarely share every row with a cached one.
        self.width = 1 << max(10, (16 * entries - 1).bit_length())
        self._shift = 64 - self.width.bit_length() + 1
        self.depth = depth
        self.sample = max(16, sample_factor * entries)
        self.table = bytearray(depth * self.width)
        self.door_bits = 1 << max(10, (8 * self.sample - 1).bit_length())
        self._door_shift = 64 - self.door_bits.bit_length() + 1
        self.door = bytearray(self.door_bits // 8)
        self.additions = 0
        self.resets = 0

    def _hash(self, key: str) -> int:
        b = key.encode()
        return (zlib.crc32(b) << 32 | zlib.crc32(b, 0x5BD1E995)) | 1

    def _door_has_or_set(self, h: int, set_it: bool) -> bool:
        hit = True
        for m in (self._MULTS[4], self._MULTS[5]):
            bit = ((h * m) & _MASK64) >> self._door_shift
            byte, mask = bit >> 3, 1 << (bit & 7)
            if not self.door[byte] & mask:
                hit = False
                if set_it:
                    self.door[byte] |= mask
        return hit

    def increment(self, key: str) -> None:
        h = self._hash(key)
        if self._door_has_or_set(h, set_it=True):
            t, w, s = self.table, self.width, self._shift
            for row in range(self.depth):
                i = row * w + (((h * self._MULTS[row]) & _MASK64) >> s)
                if t[i] < 15:
                    t[i] += 1
        self.additions += 1
        if self.additions >= self.sample:
            self._age()

    def estimate(self, key: str) -> int:
        h = self._hash(key)
        t, w, s = self.table, self.width, self._shift
        low = min(
            t[row * w + (((h * self._MULTS[row]) & _MASK64) >> s)] for row in range(self.depth)
        )
        return low + (1 if self._door_has_or_set(h, set_it=False) else 0)

    def _age(self) -> None:
        self.table = bytearray(self.table.translate(_HALVE))
        self.door = bytearray(len(self.door))
        self.additions //= 2
        self.resets += 1


class WTinyLfuPolicy(EvictionPolicy):
    """W-TinyLFU: an LRU admission window (``window_fraction`` of the capacity, 1%, at least one
    entry's worth) in front of a segmented-LRU main region (probation, and protected with
    ``protected_fraction`` = 80% of the main region), with a count-min sketch of every access.

    * New keys enter the window. While the cache is not full, keys leaving the window join
      probation freely.
    * When room is needed and the window holds at least its share, the window's oldest allowed
      key (the candidate) meets the main region's victim (oldest allowed in probation, else in
      protected): the candidate is admitted to probation only if its estimated frequency is
      strictly higher; the loser is evicted. Otherwise the main victim is evicted (the window's
      candidate when the main region has none).
    * A hit in probation promotes to protected; protected overflow demotes its oldest key to
      probation. Hits elsewhere only refresh recency.
    """

    name = "w-tinylfu"

    def __init__(
        self,
        capacity: int,
        *,
        entries: int | None = None,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
    ) -> None:
        super().__init__(capacity, entries=entries)
        if not 0.0 < window_fraction < 1.0 or not 0.0 < protected_fraction < 1.0:
            raise ValueError("w-tinylfu fractions must be in (0, 1)")
        self.window_cap = max(1, round(capacity * window_fraction))
        self.protected_cap = max(1, round((capacity - self.window_cap) * protected_fraction))
        self.sketch = CountMinSketch(self.entries)
        # key -> size; least recent first.
        self._window: OrderedDict[str, int] = OrderedDict()
        self._probation: OrderedDict[str, int] = OrderedDict()
        self._protected: OrderedDict[str, int] = OrderedDict()
        self._window_weight = 0
        self._protected_weight = 0
        self._weight = 0

    def access(self, key: str) -> None:
        self.sketch.increment(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            size = self._probation.pop(key)
            self._protected[key] = size
            self._protected_weight += size
            while self._protected_weight > self.protected_cap and len(self._protected) > 1:
                old, osize = self._protected.popitem(last=False)
                self._protected_weight -= osize
                self._probation[old] = osize

    def insert(self, key: str, size: int = 1) -> None:
        self.remove(key)
        size = max(1, size)
        self._window[key] = size
        self._window_weight += size
        self._weight += size
        while (
            self._window_weight > self.window_cap
            and len(self._window) > 1
            and self._weight <= self.capacity
        ):
            old, osize = self._window.popitem(last=False)
            self._window_weight -= osize
            self._probation[old] = osize

    def remove(self, key: str) -> None:
        if key in self._window:
            size = self._window.pop(key)
            self._window_weight -= size
        elif key in self._probation:
            size = self._probation.pop(key)
        elif key in self._protected:
            size = self._protected.pop(key)
            self._protected_weight -= size
        else:
            return
        self._weight -= size

    @staticmethod
    def _first_allowed(region: OrderedDict[str, int], allowed: Allowed) -> str | None:
        for key in region:
            if allowed(key):
                return key
        return None

    def evict(self, allowed: Allowed) -> str | None:
        candidate = self._first_allowed(self._window, allowed)
        victim = self._first_allowed(self._probation, allowed) or self._first_allowed(
            self._protected, allowed
        )
        if candidate is not None and (victim is None or self._window_weight >= self.window_cap):
            if victim is not None and self.sketch.estimate(candidate) > self.sketch.estimate(
                victim
            ):
                size = self._window.pop(candidate)
                self._window_weight -= size
                self._probation[candidate] = size
            else:
                victim = candidate
        if victim is not None:
            self.remove(victim)
        return victim

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def state_size(self) -> int:
        return 0  # the sketch and doorkeeper are fixed-size arrays sized at construction


_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LruPolicy, LruGreedyPolicy, S3FifoPolicy, WTinyLfuPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
# The default for both tiers: see docs/worker-engine.md "Adapter eviction" and
# bench/results/eviction_cpu.json for the traces that chose it.
DEFAULT_POLICY = "w-tinylfu"


def make_policy(
    name: str, capacity: int, *, entries: int | None = None, field: str = "adapter_eviction"
) -> EvictionPolicy:
    """The policy called ``name``; an unknown name is a ValueError naming ``field``."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"{field}: unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    return cls(capacity, entries=entries)
