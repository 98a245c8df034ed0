"""Adapter manager: PEFT adapters on disk -> CPU cache (bytes) -> GPU pool (an arena of bytes,
or slots).

Tiers and invariants:

* **Disk.** Adapters live under one adapter root. Names and paths never resolve outside it
  (no ``..``, no absolute paths elsewhere, no symlink escapes).
* **CPU cache.** Validated, packed weights (pinned memory on CUDA), bounded in bytes.
  Pinned adapters are never dropped.
* **GPU slots.** A slot is an adapter's handle in the pool. In an adapter arena
  (``ArenaLoraPool``, bounded in bytes) the adapter also takes, per part it targets, one index
  of that part's grid whose bytes overlap nothing else in use (``ArenaSpace``: first fit;
  evicting through the policy when none is free); a pool of slots (``LoraPool``, INT4 and
  tensor-parallel pools) is bounded in count. A slot with a non-zero reference
  count (in-flight requests), a reserved slot, a pinned adapter or an adapter that a waiting
  request has *claimed* (``claim``/``unclaim``, a per-name count the scheduler keeps) is never
  evicted. The scheduler claims the adapters of waiting requests and starts loads itself
  (``start_load``), in queue order, no more at a time than ``slots_for_loads`` says can get a
  slot: a completed load waits, claimed, for the request it was made for (``scheduler.py``).
* **Eviction.** Each tier has its own policy from ``eviction.py`` (``eviction=`` names it:
  lru, lru-greedy, s3-fifo or w-tinylfu). The manager tells the policy about every request
  (``note_lookup``), every adapter that becomes resident and every removal it did not ask for,
  and asks it for a victim among the keys it may evict. A request always gets its adapter;
  what a policy's admission decides is only how soon a newcomer goes again.

AdaFuse expert sets (``adafuse.py``: a directory with ``adaptermesh_adafuse.json``) resolve by
the same names and path rules. They skip the CPU cache and the LoRA pool: a validated set is
copied to the device once and published in its own table, bounded by ``max_expert_sets``
(LRU, never evicting a pinned set or one that in-flight requests hold).

Loads are two-phase. *prepare* reads and validates the files (in a thread), reserves a free or
evictable slot, copies the weights into it and verifies the copy by checksum; *commit* then
publishes ``name -> slot`` in one assignment on the event loop. An on-demand load that the
scheduler starts (``start_load``) reserves its slot when it starts, before the read, so the slot
the scheduler counted for it cannot be taken meanwhile; a prefetch or an explicit load reserves
after its read. A load that finds no slot waits on an event that every change able to free one
sets (a release to zero, an unclaim to zero, a retired or freed slot, an unload, a failed
prepare), up to ``slot_wait_s``. A failed prepare releases the slot and leaves the published
table untouched. Reloading a name publishes the new slot while the old one stays "retired"
until its last in-flight request releases it.

All bookkeeping runs on the event-loop thread; only file reads and slot copies run in worker
threads, so serving continues while an adapter loads.

Adapter stores (``adapter_stores.py``, the ``stores`` attribute, None unless the worker
configures them): a ``lora_path`` of ``s3://`` or ``hf://`` is fetched into (or found in) a
local cache and loaded from there; with resolvers configured, a name the adapter root does not
hold is looked up in the stores on its first request and, once loaded, stays registered under
its cached path (as an explicit load would). A local ``models--org--name`` directory (a Hugging
Face cache entry) stands for its ``refs/main`` snapshot.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import heapq
import json
import math
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaptermesh.worker.adafuse import CpuExpertSet, ExpertSet, is_expert_set, read_expert_set
from adaptermesh.worker.adapter_merge import (
    DEFAULT_MAX_PARTS,
    MERGE_FIELD,
    MergeSpec,
    MergeSpecError,
    build_merged,
    mergeable_as_cached,
    merged_name,
    part_etag,
    read_part,
)
from adaptermesh.worker.adapter_stores import (
    AdapterStoreError,
    AdapterStores,
    hf_local_snapshot,
    is_store_uri,
)
from adaptermesh.worker.eviction import DEFAULT_POLICY, make_policy
from adaptermesh.worker.lora_groups import FUSED_MODULES, GROUPS, MODULE_TO_GROUP
from adaptermesh.worker.model import (
    ArenaGrid,
    ArenaLayout,
    ArenaLoraPool,
    LoraPool,
    ModelConfig,
)
from adaptermesh.worker.peft_adapter import (
    VOCAB_MODULES,
    AdapterValidationError,
    CpuAdapter,
    TensorEntry,
    entry_sums,
    read_adapter,
    resolve_in_root,
    target_set,
    validate_name,
)
from adaptermesh.worker.saved_modules import unserved_message
from adaptermesh.worker.types import (
    AdapterInfo,
    AdapterNotFoundError,
    AdapterResidency,
    EngineOverloadedError,
)

__all__ = [
    "AdapterManager",
    "AdapterValidationError",
    "ArenaSpace",
    "CpuAdapter",
    "Lease",
    "TensorEntry",
    "read_adapter",
    "resolve_in_root",
    "validate_name",
]

# How long a load that failed because its store could not be reached (status 503) is
# remembered (at most the manager's negative TTL).
UNAVAILABLE_STORE_TTL_S = 5.0


# Integer dtypes by element size: a float tensor viewed as one compares bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Host tensors of one shape and dtype hold the same bits (NaN equals itself, -0 is not
    +0). numpy compares an 80 MB adapter in 16 ms on one core, ``torch.equal`` in 51 ms
    (as int16) to 63 ms (as bf16)."""
    bits = _BITS[a.element_size()]
    return bool(np.array_equal(a.view(bits).numpy(), b.view(bits).numpy()))


def written_ranks(cpu: CpuAdapter, pool: LoraPool) -> dict[str, int]:
    """Per pool group, the rank below which copying ``cpu`` writes every layer and module of
    the group (its smallest matrix rank there); a group it leaves any (layer, module) of is
    absent. ``zero_slot`` then zeroes only what the copy leaves."""
    ranks: dict[str, int] = {}
    seen: dict[str, set[tuple[int, int, bool]]] = {}
    for e in cpu.entries:
        rank = e.shape[1] if e.is_b else e.shape[0]
        ranks[e.group] = min(ranks.get(e.group, rank), rank)
        seen.setdefault(e.group, set()).add((e.layer, e.index, e.is_b))
    out = {}
    for g, r in ranks.items():
        if g in pool.groups and len(seen[g]) == 2 * pool.num_layers * len(GROUPS[g]):
            out[g] = r
    return out


class ArenaSpace:
    """Which byte ranges of the adapter arena are in use, and by which handle.

    Every part an adapter targets takes one index of that part's grid (``ArenaGrid``): the
    range ``[i * step, i * step + length)``. The grids overlap, so an index is free only when
    its range overlaps no range in use, of any part. ``first_fit`` finds the lowest such index;
    ``cheapest`` the index whose holders are fewest, among those whose holders all satisfy a
    predicate (those the manager may evict). Ranges in use never overlap (``take`` refuses an
    overlap), so they stay sorted by start and by end alike; the free gaps between them are
    kept too, so first fit in a full arena looks at its few gaps, not at every range."""

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # (start, end, handle), sorted
        self._gap_starts: list[int] = [0] if layout.size else []
        self._gaps: list[tuple[int, int]] = [(0, layout.size)] if layout.size else []
        self.held: dict[int, dict[str, int]] = {}  # handle -> part -> index

    def span(self, part: str, index: int) -> tuple[int, int]:
        return self.layout.grids[part].span(index)

    def spans(self) -> list[tuple[int, int, int]]:
        return list(self._spans)

    def used_bytes(self) -> int:
        return sum(e - s for s, e, _ in self._spans)

    def _grid(self, part: str | ArenaGrid) -> ArenaGrid:
        return part if isinstance(part, ArenaGrid) else self.layout.grids[part]

    def window(self, parts: Iterable[str]) -> ArenaGrid:
        """A grid of windows that hold one adapter's ``parts`` back to back."""
        step = next(iter(self.layout.grids.values())).step
        length = self.layout.adapter_bytes(parts)
        return ArenaGrid(step, length, max(0, (self.layout.size - length) // step + 1))

    def first_fit(self, part: str | ArenaGrid) -> int | None:
        """The lowest index of ``part``'s grid (or of ``grid``) whose bytes overlap nothing in
        use."""
        grid = self._grid(part)
        for start, end in self._gaps:
            at = -(-start // grid.step) * grid.step
            if at + grid.length <= end:
                index = at // grid.step
                return index if index < grid.count else None
        return None

    def holders(self, part: str | ArenaGrid, index: int) -> set[int]:
        """The handles whose ranges overlap ``index`` of ``part``."""
        start, end = self._grid(part).span(index)
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = set()
        while k < len(self._spans) and self._spans[k][0] < end:
            _s, e, handle = self._spans[k]
            if e > start:
                out.add(handle)
            k += 1
        return out

    def cheapest(
        self,
        part: str | ArenaGrid,
        ok: Callable[[int], bool],
        near: Iterable[tuple[int, int]] | None = None,
    ) -> tuple[int, set[int]] | None:
        """(index, its holders) of ``part`` with the fewest holders, all of them ``ok``, the
        lowest index on a tie; only indices overlapping a range of ``near`` when given. None
        when every index has a holder that is not ``ok``."""
        grid = self._grid(part)
        if near is None:
            candidates: Iterable[int] = range(grid.count)
        else:
            found: set[int] = set()
            for start, end in near:  # indices i with i * step < end and i * step + length > start
                first = max(0, (start - grid.length) // grid.step + 1)
                last = min(grid.count, -(-end // grid.step))
                found.update(range(first, last))
            candidates = sorted(found)
        verdict: dict[int, bool] = {}
        best: tuple[int, set[int]] | None = None
        for index in candidates:
            held = self.holders(part, index)
            if not all(verdict.setdefault(h, ok(h)) for h in held):
                continue
            if best is None or len(held) < len(best[1]):
                best = (index, held)
                if not held:
                    break
        return best

    def take(self, handle: int, part: str, index: int) -> None:
        start, end = self.span(part, index)
        if self.layout.grids[part].count <= index or self.holders(part, index):
            raise RuntimeError(f"arena bytes [{start}, {end}) of {part}[{index}] are in use")
        k = bisect.bisect_left(self._starts, start)
        self._starts.insert(k, start)
        self._spans.insert(k, (start, end, handle))
        self.held.setdefault(handle, {})[part] = index
        g = bisect.bisect_right(self._gap_starts, start) - 1
        gap_start, gap_end = self._gaps[g]
        if not gap_start <= start < end <= gap_end:
            raise RuntimeError(f"arena bytes [{start}, {end}) are not inside one free gap")
        pieces = [(a, b) for a, b in ((gap_start, start), (end, gap_end)) if b > a]
        self._gaps[g : g + 1] = pieces
        self._gap_starts[g : g + 1] = [a for a, _ in pieces]

    def release(self, handle: int) -> dict[str, int]:
        """Free every range ``handle`` holds; returns its placement."""
        placement = self.held.pop(handle, {})
        for part, index in placement.items():
            start, end = self.span(part, index)
            k = bisect.bisect_left(self._starts, start)
            assert self._spans[k][2] == handle
            del self._starts[k]
            del self._spans[k]
            self._free(start, end)
        return placement

    def _free(self, start: int, end: int) -> None:
        """Return ``[start, end)`` to the gaps, merged with the gaps it touches."""
        g = bisect.bisect_left(self._gap_starts, start)
        if g > 0 and self._gaps[g - 1][1] == start:
            g -= 1
            start = self._gaps[g][0]
            del self._gaps[g]
            del self._gap_starts[g]
        if g < len(self._gaps) and self._gaps[g][0] == end:
            end = self._gaps[g][1]
            del self._gaps[g]
            del self._gap_starts[g]
        self._gaps.insert(g, (start, end))
        self._gap_starts.insert(g, start)

    def gaps(self) -> list[tuple[int, int]]:
        return list(self._gaps)

    def ranges(self, handle: int) -> list[tuple[int, int]]:
        return [self.span(p, i) for p, i in self.held.get(handle, {}).items()]


@dataclass(slots=True)
class _Slot:
    name: str | None = None  # published owner, None when free or retired
    version: int = 0
    refcount: int = 0
    last_used: float = 0.0
    reserved: bool = False  # a prepare is writing into it
    pinned: bool = False
    retired: bool = False  # replaced or unloaded; frees itself when refcount drops to 0
    rank: int = 0


@dataclass(slots=True)
class _Published:
    slot: int
    version: int
    path: Path
    rank: int
    # Where the load that published it read the adapter from ("cpu" cache or "disk"), and
    # its seconds end to end: what a request that waited for it reports (AdapterResolution).
    source: str = "disk"
    load_s: float = 0.0


@dataclass(slots=True)
class _Registration:
    path: Path
    pinned: bool = False


@dataclass(slots=True)
class _PublishedSet:
    expert_set: ExpertSet
    path: Path
    load_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Lease:
    """What a request holds while it runs: a LoRA pool slot, or an expert set (slot -1)."""

    slot: int
    version: int
    expert_set: ExpertSet | None = None
    # The published load's source tier and seconds (see _Published).
    source: str = "disk"
    load_s: float = 0.0


class _SlotTicket:
    """A load counted in ``AdapterManager.awaiting_slot`` until it reserves a slot, needs none,
    or ends; ``settle`` uncounts it once."""

    __slots__ = ("_manager",)

    def __init__(self, manager: AdapterManager) -> None:
        self._manager: AdapterManager | None = manager
        manager.awaiting_slot += 1

    def settle(self) -> None:
        if self._manager is not None:
            self._manager.awaiting_slot -= 1
            self._manager = None


ExpertSetBuilder = Callable[[CpuExpertSet, int], ExpertSet]


@dataclass(slots=True)
class ManagerCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    cpu_hits: int = 0
    loads: int = 0
    failed_loads: int = 0
    expert_set_loads: int = 0
    expert_set_evictions: int = 0
    # LoRA and expert-set loads started (on demand, prefetch or explicit); ``loads`` counts the
    # LoRA ones that committed.
    loads_started: int = 0
    # Evictions of an adapter that some waiting request wanted (``want``): 0 unless an aged
    # request took the slot of an adapter that only requests queued behind it wanted.
    evictions_wanted: int = 0
    # Merged adapters built for requests' ``merged_adapters`` (each key once).
    merges: int = 0
    latencies: list[float] = field(default_factory=list)
    # Seconds per phase of the latest LoRA load: read (disk or CPU cache), reserve, upload
    # (copy + verify), commit; benches report them next to the end-to-end figure.
    last_phases: dict[str, float] = field(default_factory=dict)


class AdapterManager:
    def __init__(
        self,
        root: Path,
        cfg: ModelConfig,
        pool: LoraPool,
        *,
        max_rank: int,
        cpu_cache_bytes: int,
        dtype: torch.dtype,
        negative_ttl_s: float = 30.0,
        negative_max_entries: int = 10_000,
        slot_wait_s: float = 10.0,
        on_change: Callable[[], None] | None = None,
        build_expert_set: ExpertSetBuilder | None = None,
        max_expert_sets: int = 4,
        eviction: str = DEFAULT_POLICY,
        cpu_cache_entries: int = 4096,
        stores: AdapterStores | None = None,
    ) -> None:
        self.root = root
        self.stores = stores
        self.cfg = cfg
        self.pool = pool
        self.max_rank = max_rank
        self.cpu_cache_bytes = cpu_cache_bytes
        self.dtype = dtype
        self.negative_ttl_s = negative_ttl_s
        self.negative_max_entries = negative_max_entries
        self.slot_wait_s = slot_wait_s
        self.on_change = on_change or (lambda: None)
        self.slots = [_Slot() for _ in range(pool.num_slots)]
        # Slots freed since they were last looked at, lowest first; checked when taken (an
        # arena has thousands of handles: no scan of every slot per load).
        self._free_heap = list(range(pool.num_slots))
        self.published: dict[str, _Published] = {}
        self.expert_sets: dict[str, _PublishedSet] = {}
        self.build_expert_set = build_expert_set
        self.max_expert_sets = max_expert_sets
        self.registered: dict[str, _Registration] = {}
        self.cpu_cache: OrderedDict[str, CpuAdapter] = OrderedDict()
        self.cpu_bytes = 0
        # Names that are absent or failed validation -> (expiry, error), so a flood of requests
        # for them is answered from memory without touching the disk.
        self.negative: OrderedDict[str, tuple[float, AdapterNotFoundError]] = OrderedDict()
        self.inflight: dict[str, asyncio.Task[int]] = {}
        # Waiting requests per adapter name: all of them (``wanted``), and those whose claim
        # protects the name's slot from eviction (``claims``); the scheduler keeps both.
        self.wanted: dict[str, int] = {}
        self.claims: dict[str, int] = {}
        # Loads in flight that have not reserved a slot yet (each will take one).
        self.awaiting_slot = 0
        self._slot_event: asyncio.Event | None = None
        self.counters = ManagerCounters()
        # An adapter arena (``ArenaLoraPool``): the byte ranges each adapter's parts take. A
        # pool of slots has none: an adapter takes one slot, whatever it targets.
        layout = pool.arena
        self.space = ArenaSpace(layout) if layout is not None else None
        # Parts the last committed adapter took: ``slots_for_loads`` counts room in adapters
        # of that shape (every part of the pool until the first commit).
        self._typical_parts = frozenset(layout.grids) if layout is not None else frozenset()
        # One policy per tier: GPU slots count one per adapter, the arena its bytes; the CPU
        # cache counts bytes (``cpu_cache_entries`` sizes its history, about how many adapters
        # fit the budget).
        self.eviction = eviction
        self.gpu_policy = (
            make_policy(eviction, max(1, layout.size), entries=pool.num_slots)
            if layout is not None
            else make_policy(eviction, pool.num_slots)
        )
        self.cpu_policy = make_policy(eviction, max(1, cpu_cache_bytes), entries=cpu_cache_entries)
        self._versions: dict[str, int] = {}
        self._pin = pool.device.type == "cuda"
        self._upload_stream: torch.cuda.Stream | None = None
        if pool.device.type == "cuda":
            self._upload_stream = torch.cuda.Stream(device=pool.device)  # type: ignore[no-untyped-call]
        # A host pool's copy and check run on one thread of their own with one intra-op
        # thread: torch's OpenMP team in a second thread competes with the engine's (and the
        # loop's) for the same cores. 80 MB from the CPU cache took 61 ms with two such threads
        # and 35 ms with one, on two cores. Started at the first upload.
        self._host_upload: concurrent.futures.ThreadPoolExecutor | None = None
        # Per-request merges (``merged``): at most ``max_merge_parts`` parts; the built ones,
        # oldest first (at most ``max_merged`` registered; an older one that nothing holds goes
        # with its directory), and the builds in flight.
        self.max_merge_parts = DEFAULT_MAX_PARTS
        self.max_merged = 256
        self.merge_dir: Path | None = None
        self.merged_built: OrderedDict[str, Path] = OrderedDict()
        self._merging: dict[str, asyncio.Task[Path]] = {}
        self.last_merge_phases: dict[str, float] = {}

    # ---- lookups used by submit() and the scheduler -------------------------------------------

    async def locate(self, name: str) -> str | None:
        """Where a request for ``name`` would find it, without loading it: ``"resident"``
        (listed), ``"root"`` (a PEFT directory or an expert set under the adapter root),
        ``"store"`` (a resolver store holds it; fetched into the cache, as its first request
        would), None: nowhere. A store that fails raises (that is not "absent")."""
        validate_name(name)
        if name in self.published or name in self.expert_sets or name in self.registered:
            return "resident"
        path = resolve_in_root(self.root, name)
        if (path / "adapter_config.json").is_file() or is_expert_set(path):
            return "root"
        if self.stores is None or not self.stores.resolvers:
            return None
        try:
            found = await self.stores.resolve(name)
        except AdapterStoreError:
            raise
        except AdapterNotFoundError:
            return None
        return "store" if found is not None else None

    def check_request(self, name: str) -> None:
        """Fast admission check: raises AdapterNotFoundError for invalid or absent names."""
        validate_name(name)
        if (
            name in self.published
            or name in self.expert_sets
            or name in self.inflight
            or name in self.registered
        ):
            return
        self._raise_if_negative(name)
        path = resolve_in_root(self.root, name)
        if not (path / "adapter_config.json").is_file() and not is_expert_set(path):
            if self.stores is not None and self.stores.resolvers:
                return  # its load looks it up in the resolver stores
            reason = (
                f"the directory {name} under the adapter root has no adapter_config.json"
                if path.is_dir()
                else "no adapter with this name under the adapter root"
            )
            err = AdapterNotFoundError(name, reason)
            self._remember_failure(name, err)
            raise err

    def _raise_if_negative(self, name: str) -> None:
        neg = self.negative.get(name)
        if neg is not None:
            if neg[0] > time.monotonic():
                raise neg[1]
            del self.negative[name]

    def _remember_failure(self, name: str, err: AdapterNotFoundError) -> None:
        ttl = self.negative_ttl_s
        if getattr(err, "status", None) == 503:
            # A store that could not be reached may be back soon: remembered briefly, so that
            # a flood is answered from memory but the adapter loads soon after it recovers.
            ttl = min(ttl, UNAVAILABLE_STORE_TTL_S)
        self.negative[name] = (time.monotonic() + ttl, err)
        self.negative.move_to_end(name)
        while len(self.negative) > self.negative_max_entries:
            self.negative.popitem(last=False)

    def note_lookup(self, name: str) -> bool:
        """Count one request's first lookup as a hit (resident on GPU) or a miss, and tell the
        GPU eviction policy about the request."""
        if name in self.expert_sets:
            self.counters.hits += 1
            return True
        self.gpu_policy.access(name)
        if name in self.published:
            self.counters.hits += 1
            return True
        self.counters.misses += 1
        return False

    def residency(self, name: str) -> str:
        """``"resident"`` (a lease is available now), ``"loading"`` or ``"absent"``. Raises the
        error of a failed load (negative cache) for an absent name."""
        if name in self.published or name in self.expert_sets:
            return "resident"
        if name in self.inflight:
            return "loading"
        self._raise_if_negative(name)
        return "absent"

    def is_resident(self, name: str) -> bool:
        return name in self.published or name in self.expert_sets

    def want(self, name: str) -> None:
        """A waiting request needs ``name`` (counted; protects nothing by itself)."""
        self.wanted[name] = self.wanted.get(name, 0) + 1

    def unwant(self, name: str) -> None:
        left = self.wanted[name] - 1
        if left:
            self.wanted[name] = left
        else:
            del self.wanted[name]

    def claim(self, name: str) -> None:
        """Protect ``name``'s slot (once resident) from eviction for one waiting request."""
        self.claims[name] = self.claims.get(name, 0) + 1

    def unclaim(self, name: str) -> None:
        left = self.claims[name] - 1
        if left:
            self.claims[name] = left
        else:
            del self.claims[name]
            self._slots_changed()

    def _evictable(self, name: str, exclude: str | None = None) -> bool:
        pub = self.published.get(name)
        if pub is None or name == exclude or name in self.claims:
            return False
        s = self.slots[pub.slot]
        return s.refcount == 0 and not s.pinned and not s.reserved

    def slots_for_loads(self) -> int:
        """Slots a newly started load could get: free ones plus those holding an adapter no
        request uses or claims, less one for each load in flight that has not reserved yet.

        In an arena: how many adapters shaped like the last one committed (same parts) fit in
        the bytes that are free or held by such evictable adapters, at most the free and
        evictable handles, less the loads still to reserve. The shape is an estimate: a load
        whose adapter needs more finds no room when it starts and reserves after its read."""
        movable = [self.published[n].slot for n in self.published if self._evictable(n)]
        if self.space is None:
            free = sum(1 for s in self.slots if s.name is None and not s.reserved and not s.retired)
            return free + len(movable) - self.awaiting_slot
        free = len(self.slots) - len(self.space.held)  # every handle in use holds bytes
        return min(free + len(movable), self._room_in_adapters(set(movable))) - self.awaiting_slot

    def _room_in_adapters(self, movable: set[int]) -> int:
        """Adapters on ``_typical_parts`` that fit, packed back to back, in the runs of the
        arena's bytes between ranges of handles not in ``movable``."""
        space = self.space
        assert space is not None
        layout = space.layout
        runs: list[tuple[int, int]] = []
        start = 0
        for s, e, handle in space.spans():
            if handle not in movable:
                if s > start:
                    runs.append((start, s))
                start = max(start, e)
        if start < layout.size:
            runs.append((start, layout.size))
        parts = self._typical_parts
        if not parts:
            return len(self.slots)
        step = next(iter(layout.grids.values())).step
        need = layout.adapter_bytes(parts)
        # Each run's whole steps (every part starts at a step and is whole steps long), packed
        # with such adapters back to back.
        return sum(max(0, e // step - -(-s // step)) * step // need for s, e in runs)

    def drain_candidate(self, held: set[str]) -> str | None:
        """The resident adapter to drain for an aged request's load: not pinned, not in
        ``held``, fewest references, then fewest waiting requests, then the least recently
        used. None when every resident adapter is pinned or held."""
        best: tuple[int, int, float, str] | None = None
        for name, pub in self.published.items():
            s = self.slots[pub.slot]
            if name in held or s.pinned or s.reserved:
                continue
            key = (s.refcount, self.wanted.get(name, 0), s.last_used, name)
            if best is None or key < best:
                best = key
        return None if best is None else best[3]

    def start_load(self, name: str) -> None:
        """Start an on-demand load of ``name`` (the scheduler decides when, after
        ``slots_for_loads``). Its slot is reserved now, evicting if needed, so that what the
        scheduler counted as given to this load cannot be taken meanwhile; a load that finds
        none reserves one after its read, as a prefetch does. In an arena the reservation is
        for the parts the adapter's config names (``_start_parts``); one whose files name
        others gives it back and reserves again after the read."""
        if name in self.inflight:
            return
        slot = None
        if self._needs_slot(name):
            parts = self._start_parts(name) if self.space is not None else frozenset()
            if parts is not None:
                slot = self._pick_slot(exclude=name, parts=parts)
        if slot is not None:
            self.slots[slot].reserved = True
        self._start_load(name, reserved=slot)

    def _parts_of(self, cpu: CpuAdapter) -> frozenset[str]:
        """The pool parts ``cpu`` takes: the groups it targets, and its vocabulary parts."""
        return cpu.groups | (cpu.vocab if self.pool.vocab else frozenset())

    def _start_parts(self, name: str) -> frozenset[str] | None:
        """The parts a load of ``name`` will take, before its read: from the CPU cache, else
        from the adapter_config.json its load will read (a small file: target_modules resolved
        as the read resolves them). None when that cannot tell (not under the adapter root, a
        config the read will refuse, parts the pool lacks): the load reserves after its read."""
        assert self.space is not None
        reg = self.registered.get(name)
        try:
            path = reg.path if reg is not None else resolve_in_root(self.root, name)
        except (AdapterNotFoundError, OSError):
            return None
        cpu = self.cpu_cache.get(name)
        if cpu is not None and cpu.path == path:
            return self._parts_of(cpu)
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            targets = target_set(name, config, self.cfg, vocab=bool(self.pool.vocab))
        except (OSError, ValueError, TypeError, AttributeError, AdapterNotFoundError):
            return None
        parts = frozenset(
            VOCAB_MODULES[m][0] if layer < 0 else MODULE_TO_GROUP[sub][0]
            for layer, m in targets
            for sub in FUSED_MODULES.get(m, (m,))
        )
        return parts if parts <= set(self.space.layout.grids) else None

    def _needs_slot(self, name: str) -> bool:
        """Whether loading ``name`` takes a pool slot (an expert set does not). A name whose
        path does not resolve is left to the load, which reports the error."""
        reg = self.registered.get(name)
        try:
            return not is_expert_set(
                reg.path if reg is not None else resolve_in_root(self.root, name)
            )
        except (AdapterValidationError, OSError):
            return True

    def try_acquire(self, name: str, *, load: bool = True) -> Lease | None:
        """A lease with a reference taken, or None while the adapter is loading.

        Starts an on-demand load when the adapter is not resident (unless ``load`` is False).
        Raises the load's error once when it failed.
        """
        pub = self.published.get(name)
        if pub is not None:
            s = self.slots[pub.slot]
            s.refcount += 1
            s.last_used = time.monotonic()
            return Lease(pub.slot, pub.version, None, pub.source, pub.load_s)
        ps = self.expert_sets.get(name)
        if ps is not None:
            es = ps.expert_set
            es.refcount += 1
            es.last_used = time.monotonic()
            return Lease(-1, es.version, es, "disk", ps.load_s)
        self._raise_if_negative(name)
        if load and name not in self.inflight:
            self._start_load(name)
        return None

    def release(self, slot: int) -> None:
        s = self.slots[slot]
        if s.refcount <= 0:
            raise RuntimeError(f"adapter slot {slot} released more often than acquired")
        s.refcount -= 1
        if s.refcount == 0:
            if s.retired:
                self._free_slot(slot)
            self._slots_changed()
            self.on_change()

    def release_expert_set(self, es: ExpertSet) -> None:
        if es.refcount <= 0:
            raise RuntimeError(f"expert set {es.name} released more often than acquired")
        es.refcount -= 1
        if es.refcount == 0:
            self._slots_changed()  # a load may be waiting for an evictable set
            self.on_change()

    # ---- loading ------------------------------------------------------------------------------

    def _start_load(
        self, name: str, path: Path | None = None, pinned: bool = False, reserved: int | None = None
    ) -> asyncio.Task[int]:
        task = asyncio.get_running_loop().create_task(self._load(name, path, pinned, reserved))
        self.inflight[name] = task
        self.counters.loads_started += 1

        def done(t: asyncio.Task[int]) -> None:
            if self.inflight.get(name) is t:
                del self.inflight[name]
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if isinstance(exc, AdapterNotFoundError):
                    self._remember_failure(name, exc)
                elif not isinstance(exc, EngineOverloadedError):
                    self._remember_failure(name, AdapterNotFoundError(name, f"load failed: {exc}"))
            self.on_change()

        task.add_done_callback(done)
        return task

    async def _load(
        self, name: str, path: Path | None, pinned: bool, reserved: int | None = None
    ) -> int:
        """prepare (read, validate, copy, verify) then commit. Returns the published slot.
        ``reserved``: a slot reserved for this load when it started (else it reserves one)."""
        ticket = _SlotTicket(self) if reserved is None else None
        held = [reserved]  # the reservation this load still holds (it may give it back)
        try:
            return await self._prepare_and_commit(name, path, pinned, ticket, held)
        except BaseException:
            slot = held[0]
            if slot is not None and self.slots[slot].reserved:  # failed before its upload
                self._free_slot(slot)
            raise
        finally:
            if ticket is not None:
                ticket.settle()  # failed or cancelled before it reserved a slot

    async def _prepare_and_commit(
        self,
        name: str,
        path: Path | None,
        pinned: bool,
        ticket: _SlotTicket | None,
        held: list[int | None],
    ) -> int:
        t0 = time.perf_counter()
        reserved = held[0]
        reg = self.registered.get(name)
        resolved_from_store = False
        if path is None:
            if reg is not None:
                path = reg.path
            else:
                path = resolve_in_root(self.root, name)
                if (
                    self.stores is not None
                    and self.stores.resolvers
                    and not (path / "adapter_config.json").is_file()
                    and not is_expert_set(path)
                ):
                    path = await self.stores.resolve(name) or path
                    resolved_from_store = True
        pinned = pinned or (reg.pinned if reg is not None else False)
        if is_expert_set(path):  # an expert set takes no pool slot
            if ticket is not None:
                ticket.settle()
            if reserved is not None:
                held[0] = None
                self._free_slot(reserved)
            return await self._load_expert_set(name, path, pinned, t0)
        cpu, source = await self._read_cpu(name, path)
        outside = cpu.groups - self.pool.groups
        if outside:
            modules = sorted(m for m in cpu.targets if MODULE_TO_GROUP[m][0] in outside)
            raise AdapterValidationError(
                name,
                "target_modules",
                f"{', '.join(modules)} outside the worker's LoRA target modules "
                f"(its adapter pool holds {', '.join(sorted(self.pool.groups))})",
            )
        if cpu.vocab and not self.pool.vocab:
            modules = [m for m, (part, _) in VOCAB_MODULES.items() if part in cpu.vocab]
            raise AdapterValidationError(
                name,
                "target_modules",
                f"{', '.join(modules)} is not served by this worker: its adapter pool holds no "
                "embedding or LM-head LoRA (start it with --lora-vocab; not available with "
                "int4 pools or tensor parallelism)",
            )
        if cpu.magnitudes and not self.pool.dora:
            raise AdapterValidationError(
                name,
                "use_dora",
                "True is not served by this worker: its adapter pool holds no DoRA factors "
                "(start it with --lora-dora; not available with int4 pools or tensor parallelism)",
            )
        unserved = unserved_message(cpu.saved, self.pool.saved)
        if unserved is not None:
            raise AdapterValidationError(name, "modules_to_save", unserved)
        cpu.pinned = pinned
        t_read = time.perf_counter()
        parts = self._parts_of(cpu)
        if (
            reserved is not None
            and self.space is not None
            and frozenset(self.space.held.get(reserved, {})) != parts
        ):
            # Reserved for the parts its config named; the files hold others.
            held[0] = None
            self._free_slot(reserved)
            reserved = None
        slot = (
            reserved
            if reserved is not None
            else await self._reserve_slot(exclude=name, ticket=ticket, parts=parts)
        )
        held[0] = slot
        t_reserve = time.perf_counter()
        try:
            await self._upload(slot, cpu)
        except BaseException:
            self._free_slot(slot)
            raise
        t_upload = time.perf_counter()
        # ---- commit: one synchronous block on the event loop, nothing can interleave ----
        self._cache_cpu(cpu)
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        old = self.published.get(name)
        self.expert_sets.pop(name, None)  # the name may have been an expert set before
        self.slots[slot] = _Slot(
            name=name, version=version, last_used=time.monotonic(), pinned=pinned, rank=cpu.rank
        )
        self.published[name] = _Published(
            slot, version, path, cpu.rank, source, time.perf_counter() - t0
        )
        if old is not None:
            self._retire(old.slot)
        if name in self.gpu_policy:
            self.gpu_policy.access(name)  # a reload keeps the name's standing
        else:
            self.gpu_policy.insert(name, self._policy_size(slot))
        if self.space is not None:
            self._typical_parts = parts
        self.negative.pop(name, None)
        if resolved_from_store and name not in self.registered:
            self.registered[name] = _Registration(path)  # later loads read the cached copy
        self.counters.loads += 1
        t_end = time.perf_counter()
        self.counters.latencies.append(t_end - t0)
        self.counters.last_phases = {
            "read": t_read - t0,
            "reserve": t_reserve - t_read,
            "upload_verify": t_upload - t_reserve,
            "commit": t_end - t_upload,
        }
        self.on_change()
        return slot

    async def _load_expert_set(self, name: str, path: Path, pinned: bool, t0: float) -> int:
        """prepare (read, validate, copy to the device) then commit; returns -1 (no pool slot)."""
        builder = self.build_expert_set
        if builder is None:
            raise AdapterValidationError(
                name, "adaptermesh_adafuse.json", "this engine does not serve AdaFuse expert sets"
            )
        cpu = await asyncio.to_thread(
            read_expert_set, name, path, self.root, self.cfg, self.max_rank, self.dtype
        )
        cpu.pinned = pinned
        await self._make_room_for_set(exclude=name)
        version = self._versions.get(name, 0) + 1
        es = await asyncio.to_thread(self._build_set, builder, cpu, version)
        # ---- commit ----
        self._versions[name] = version
        es.last_used = time.monotonic()
        self.expert_sets[name] = _PublishedSet(es, path, time.perf_counter() - t0)
        old = self.published.pop(name, None)  # the name may have been a LoRA adapter before
        if old is not None:
            self.gpu_policy.remove(name)
            self._retire(old.slot)
        self.negative.pop(name, None)
        self.counters.expert_set_loads += 1
        self.counters.latencies.append(time.perf_counter() - t0)
        self.on_change()
        return -1

    async def _read_cpu(self, name: str, path: Path) -> tuple[CpuAdapter, str]:
        """The validated adapter and where it came from: the CPU cache or the disk."""
        cpu = self.cpu_cache.get(name)
        self.cpu_policy.access(name)
        if cpu is not None and cpu.path == path:
            self.counters.cpu_hits += 1
            return cpu, "cpu"
        cpu = await asyncio.to_thread(
            read_adapter,
            name,
            path,
            self.cfg,
            self.max_rank,
            self.dtype,
            self._pin,
            per_module=True,
            extra_vocab=self.pool.extra.capacity if self.pool.extra is not None else 0,
        )
        return cpu, "disk"

    async def _upload(self, slot: int, cpu: CpuAdapter) -> None:
        """Copy ``cpu`` into the reserved ``slot`` and verify it (in a thread)."""
        if self.pool.device.type == "cuda":
            await asyncio.to_thread(self._write_and_verify, slot, cpu)
            return
        if self._host_upload is None:
            self._host_upload = concurrent.futures.ThreadPoolExecutor(
                1,
                thread_name_prefix="adapter-upload",
                initializer=torch.set_num_threads,
                initargs=(1,),
            )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._host_upload, self._write_and_verify, slot, cpu)

    def _build_set(self, builder: ExpertSetBuilder, cpu: CpuExpertSet, version: int) -> ExpertSet:
        if self._upload_stream is not None:
            with torch.cuda.stream(self._upload_stream):
                es = builder(cpu, version)
            self._upload_stream.synchronize()
            return es
        return builder(cpu, version)

    async def _make_room_for_set(self, exclude: str) -> None:
        deadline = time.monotonic() + self.slot_wait_s
        while sum(1 for n in self.expert_sets if n != exclude) >= self.max_expert_sets:
            victims = [
                (ps.expert_set.last_used, n)
                for n, ps in self.expert_sets.items()
                if n != exclude and ps.expert_set.refcount == 0 and not ps.expert_set.pinned
            ]
            if victims:
                del self.expert_sets[min(victims)[1]]
                self.counters.expert_set_evictions += 1
                continue
            if time.monotonic() > deadline:
                raise EngineOverloadedError(
                    "expert sets: every resident set is pinned or in use; retry later"
                )
            await self._wait_slots_changed(deadline)

    def _write_and_verify(self, slot: int, cpu: CpuAdapter) -> None:
        """Copy ``cpu`` into ``slot`` and verify it, with one host synchronisation.

        The data section goes to the device in one copy; each matrix is then placed into the
        slot by device copies. Verification compares float64 sums (and checks finiteness) of
        the source and the slot on the device, and reads back three numbers. The source's sums
        are kept on ``cpu`` after its first upload, so an upload from the CPU cache reads the
        source once (the copy) rather than twice more. On a host pool (the CPU engine) the
        copied matrices are compared bit for bit with their sources instead, and no sums are
        taken: a float64 reduction costs more there than the copy itself (0.49 s for an 80 MB
        7B adapter), and the files' finiteness was checked when they were read.
        """
        if self._exact_host_check:
            # Finiteness was checked when the files were read (read_adapter, for a host pool).
            self._write_slot_host(slot, cpu)
            return
        cached = cpu.sums.get(self.dtype)
        stream = (
            torch.cuda.stream(self._upload_stream)
            if self._upload_stream is not None
            else contextlib.nullcontext()
        )
        with stream:
            got, want = self._write_slot(slot, cpu, cached is None)
            nums = torch.cat([got.reshape(1), *([] if want is None else [want])]).tolist()
        slot_sum = nums[0]
        if cached is None:
            cached = (nums[1], nums[2])
            if math.isfinite(cached[0]):
                cpu.sums[self.dtype] = cached
        src_sum, src_abs = cached
        self._check_finite(cpu, src_sum)
        if abs(slot_sum - src_sum) > 1e-7 * (1.0 + src_abs):
            raise AdapterValidationError(
                cpu.name, "gpu_copy", f"slot {slot} checksum {slot_sum} != {src_sum}"
            )

    def _check_finite(self, cpu: CpuAdapter, src_sum: float) -> None:
        if not math.isfinite(src_sum):
            bad = cpu.first_non_finite(cpu.data, self.dtype)
            raise AdapterValidationError(
                cpu.name, "adapter_model.safetensors", f"tensor {bad} holds NaN or Inf"
            )

    @property
    def _exact_host_check(self) -> bool:
        # A plain pool in host memory: exact comparison after the copy (INT4 pools quantise,
        # so they keep the sums of their staged full-precision copy).
        return self.pool.device.type != "cuda" and type(self.pool) in (LoraPool, ArenaLoraPool)

    def _place(self, slot: int, cpu: CpuAdapter, data: torch.Tensor) -> list[torch.Tensor]:
        """Zero ``slot``, copy every matrix of ``cpu`` (over ``data``) into it, publish its
        ranks and scale; returns the slot's views, in ``cpu.entries`` order."""
        pool = self.pool
        pool.zero_slot(slot, written_ranks(cpu, pool))
        if cpu.vocab_bases and not cpu.vocab_checked:
            self._check_vocab_bases(cpu, data)
        # Each matrix at its own rank (rank_pattern); the slot's higher ranks stay zero.
        dst = [self._slot_view(slot, e) for e in cpu.entries]
        src = [cpu.view(e, data) for e in cpu.entries]
        torch._foreach_copy_(dst, src)  # one call for every matrix, not a Python loop of copies
        pool.set_slot(slot, cpu.rank, cpu.scale, cpu.groups)
        if pool.vocab:
            pool.set_vocab(slot, cpu.rank, cpu.vocab)
        if pool.saved is not None:  # trained module copies (none: the slot holds none)
            pool.saved.write(slot, cpu.saved, data)
        if pool.extra is not None:  # extra vocabulary rows (none: the model's vocabulary)
            pool.extra.write(slot, cpu.extra_rows, data, cpu.vocab_size or self.cfg.vocab_size)
        if pool.dora:
            # DoRA's column norms, once per load from the slot just written (plain LoRA: ones).
            pool.set_dora(
                slot,
                cpu.scale,
                [(m.group, m.index, m.layer, cpu.magnitude(m, data)) for m in cpu.magnitudes],
            )
        return dst

    def _slot_view(self, slot: int, e: TensorEntry) -> torch.Tensor:
        rank = e.shape[1] if e.is_b else e.shape[0]
        if e.layer < 0:  # embed_tokens / lm_head, as wide as the adapter's vocabulary
            rows = e.shape[1] if e.group == "embed" and not e.is_b else e.shape[0]
            return self.pool.vocab_view(e.group, slot, rank, e.is_b, rows)
        return self.pool.slot_view(e.group, e.index, e.layer, slot, rank, e.is_b)

    def _check_vocab_bases(self, cpu: CpuAdapter, data: torch.Tensor) -> None:
        """The base weights PEFT saved beside a vocabulary LoRA must be the model's (PEFT
        would load them into the model for every adapter; a trained copy for the adapter's
        rows only is a ``modules_to_save``)."""
        base_of = self.pool.base_vocab
        if base_of is None:
            raise AdapterValidationError(
                cpu.name, "target_modules", "this worker cannot check saved embedding weights"
            )
        for e in cpu.vocab_bases:
            base = base_of(e.group)
            saved = cpu.view(e, data).to(device=base.device, dtype=base.dtype)
            if not torch.equal(saved, base):
                raise AdapterValidationError(
                    cpu.name,
                    "adapter_model.safetensors",
                    f"{e.key} differs from the base model's weight (PEFT would load it into "
                    "the model for every adapter); a trained copy of the module for this "
                    "adapter alone is saved through modules_to_save",
                )
        cpu.vocab_checked = True

    def _write_slot(
        self, slot: int, cpu: CpuAdapter, source_sums: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pool = self.pool
        data = (
            cpu.data.to(pool.device, non_blocking=True) if pool.device.type == "cuda" else cpu.data
        )
        self._place(slot, cpu, data)
        return pool.slot_sum(slot), entry_sums(cpu, data, pool.dtype) if source_sums else None

    def _write_slot_host(self, slot: int, cpu: CpuAdapter) -> None:
        """The host pool's write: each copied matrix must hold its source's bits (cast to the
        pool's dtype)."""
        self._place(slot, cpu, cpu.data)
        # Read back through fresh views of the slot, not the ones written through.
        pairs = [(e.key, self._slot_view(slot, e), cpu.view(e)) for e in cpu.entries]
        saved = self.pool.saved
        if saved is not None:
            pairs += [(e.key, saved.placed(e, slot), e.view(cpu.data)) for e in cpu.saved]
        extra = self.pool.extra
        if extra is not None:
            pairs += [(e.key, extra.view(e, slot), e.view(cpu.data)) for e in cpu.extra_rows]
        for key, placed, source in pairs:
            if source.dtype != placed.dtype:
                source = source.to(placed.dtype)
            if not same_bits(placed, source):
                raise AdapterValidationError(
                    cpu.name, "gpu_copy", f"slot {slot}: {key} differs from its source"
                )

    def _slots_changed(self) -> None:
        """Wake the loads waiting for a slot (or an expert-set place): one may be free now."""
        event, self._slot_event = self._slot_event, None
        if event is not None:
            event.set()

    async def _wait_slots_changed(self, deadline: float) -> None:
        if self._slot_event is None:
            self._slot_event = asyncio.Event()
        event = self._slot_event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))

    async def _reserve_slot(
        self,
        exclude: str,
        ticket: _SlotTicket | None = None,
        parts: frozenset[str] = frozenset(),
    ) -> int:
        deadline = time.monotonic() + self.slot_wait_s
        while True:
            slot = self._pick_slot(exclude, parts)
            if slot is not None:
                self.slots[slot].reserved = True
                if ticket is not None:
                    ticket.settle()
                return slot
            if time.monotonic() > deadline:
                raise EngineOverloadedError(
                    "adapter slots: every GPU slot is pinned or in use; retry later"
                    if self.space is None
                    else "adapter arena: every GPU byte range it could take holds an adapter "
                    "that is pinned or in use; retry later"
                )
            await self._wait_slots_changed(deadline)

    def _pick_slot(self, exclude: str, parts: frozenset[str] = frozenset()) -> int | None:
        """A free slot for a load of ``exclude`` (the name being (re)loaded keeps serving its
        current version meanwhile), evicting through the policy if needed; None when none can
        be had. In an arena the slot is a handle, and each of ``parts`` gets an index of its
        grid whose bytes overlap nothing in use (``_place_parts``): placed in the pool, not
        yet published."""
        slot = self._free_handle()
        if slot is None:
            name = self.gpu_policy.evict(lambda n: self._evictable(n, exclude))
            if name is None:
                return None
            slot = self._evict(name)
        if self.space is None:
            return slot
        evictions = self.counters.evictions
        placement = self._place_parts(slot, parts, exclude)
        if placement is None:
            if self.counters.evictions != evictions:
                # Room was made but not enough for this adapter: another load waiting for a
                # slot, or a request the scheduler could start a load for, may fit in it now.
                self._slots_changed()
                self.on_change()
            return None
        self.pool.place(slot, placement)
        return slot

    def _place_parts(self, slot: int, parts: frozenset[str], exclude: str) -> dict[str, int] | None:
        """An index of each part's grid for ``slot``, taken in the arena: the parts back to
        back in the lowest free window that holds them all; else each in the lowest free index
        of its grid (holes left by other shapes); else, evicting, a window freed for them all.
        The policy chooses the first victim among the adapters whose eviction can free such a
        window (every adapter overlapping it may be evicted); the other adapters overlapping
        the cheapest window next to it go too, in the policy's order, and the search starts
        over. None (with whatever was evicted gone) when every window overlaps an adapter in
        use, pinned, claimed, reserved or retired."""
        space = self.space
        assert space is not None
        grids = space.layout.grids
        order = sorted(parts, key=lambda p: (-grids[p].length, p))  # longest parts first
        if not order:
            return {}
        window = space.window(order)
        while True:
            at = space.first_fit(window)
            if at is not None:
                start = window.span(at)[0]
                placement = {}
                for part in order:
                    index = start // grids[part].step
                    space.take(slot, part, index)
                    placement[part] = index
                    start += grids[part].length
                return placement
            placement = {}
            for part in order if len(order) > 1 else ():  # one part: its window is its grid
                hole = space.first_fit(part)
                if hole is None:
                    break
                space.take(slot, part, hole)
                placement[part] = hole
            else:
                if placement:
                    return placement
            space.release(slot)
            if not self._evict_for(window, exclude):
                return None

    def _evict_for(self, window: ArenaGrid, exclude: str) -> bool:
        """Evict the adapters overlapping one index of ``window`` that may all go, the first
        of them chosen by the policy among those that help; False (nothing evicted) when no
        index of ``window`` can be freed."""
        space = self.space
        assert space is not None

        def ok(handle: int) -> bool:
            name = self.slots[handle].name
            return name is not None and self._evictable(name, exclude)

        def helps(name: str) -> bool:
            if not self._evictable(name, exclude):
                return False
            near = space.ranges(self.published[name].slot)
            return space.cheapest(window, ok, near) is not None

        # No window is free, so one all of whose holders may go has one at least, and each of
        # them helps: none helps exactly when every window holds one that must stay.
        name = self.gpu_policy.evict(helps)
        if name is None:
            return False
        near = space.ranges(self.published[name].slot)
        self._evict(name)
        best = space.cheapest(window, ok, near)
        rest: set[str | None] = set() if best is None else {self.slots[h].name for h in best[1]}
        while rest:
            victim = self.gpu_policy.evict(rest.__contains__)
            if victim is None:
                break
            rest.discard(victim)
            self._evict(victim)
        return True

    def _free_handle(self) -> int | None:
        """The lowest free slot (left free: the caller reserves it)."""
        heap = self._free_heap
        while heap:
            s = self.slots[heap[0]]
            if s.name is None and not s.reserved and not s.retired:
                return heap[0]
            heapq.heappop(heap)  # taken since it was freed; pushed again when freed again
        return None

    def _evict(self, name: str) -> int:
        """Evict resident ``name`` (the policy counts it gone already); returns its slot."""
        victim = self.published.pop(name).slot
        self._release_slot(victim)
        self.counters.evictions += 1
        if name in self.wanted:
            self.counters.evictions_wanted += 1
        return victim

    def _policy_size(self, slot: int) -> int:
        """What ``slot``'s adapter counts for in the GPU policy: 1, or its bytes in an arena."""
        if self.space is None:
            return 1
        return max(1, self.space.layout.adapter_bytes(self.space.held.get(slot, {})))

    def _release_slot(self, slot: int) -> None:
        self.slots[slot] = _Slot()
        self.pool.clear(slot)
        if self.space is not None:
            self.space.release(slot)
        heapq.heappush(self._free_heap, slot)

    def _retire(self, slot: int) -> None:
        s = self.slots[slot]
        s.name = None
        s.retired = True
        s.pinned = False
        if s.refcount == 0:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self._release_slot(slot)
        self._slots_changed()

    def _cache_cpu(self, cpu: CpuAdapter) -> None:
        prev = self.cpu_cache.pop(cpu.name, None)
        if prev is not None:
            self.cpu_bytes -= prev.nbytes
        self.cpu_cache[cpu.name] = cpu
        self.cpu_bytes += cpu.nbytes
        if prev is not cpu or cpu.name not in self.cpu_policy:
            self.cpu_policy.insert(cpu.name, cpu.nbytes)  # new, or re-read files (a new size)

        def evictable(key: str) -> bool:
            entry = self.cpu_cache.get(key)
            return entry is not None and not entry.pinned and key != cpu.name

        while self.cpu_bytes > self.cpu_cache_bytes:
            key = self.cpu_policy.evict(evictable)
            if key is None:
                break
            self.cpu_bytes -= self.cpu_cache.pop(key).nbytes
        if self.cpu_bytes > self.cpu_cache_bytes and not cpu.pinned:
            # Larger than the whole budget: serve it from the GPU copy only.
            del self.cpu_cache[cpu.name]
            self.cpu_bytes -= cpu.nbytes
            self.cpu_policy.remove(cpu.name)

    def _drop_cpu(self, name: str) -> None:
        entry = self.cpu_cache.pop(name, None)
        if entry is not None:
            self.cpu_bytes -= entry.nbytes
        self.cpu_policy.remove(name)

    # ---- per-request merges -------------------------------------------------------------------

    async def _part_path(self, name: str) -> Path:
        """Where part ``name`` of a merge lies (what its own load would read)."""
        self.check_request(name)  # 404 for an unknown name, 400 for a bad one
        reg = self.registered.get(name)
        pub = self.published.get(name)
        path: Path | None
        if name in self.expert_sets:
            path = self.expert_sets[name].path
        else:
            path = reg.path if reg is not None else pub.path if pub is not None else None
        if path is None:
            path = resolve_in_root(self.root, name)
            if (
                self.stores is not None
                and self.stores.resolvers
                and not (path / "adapter_config.json").is_file()
                and not is_expert_set(path)
            ):
                found = await self.stores.resolve(name)
                if found is None:
                    raise AdapterNotFoundError(name, "no adapter with this name here or in a store")
                path = found
        if is_expert_set(path):
            raise AdapterValidationError(
                name, MERGE_FIELD, "an AdaFuse expert set cannot be a part of a merge"
            )
        return path

    async def merged(self, spec: MergeSpec, base_model: str = "") -> str:
        """The name of the adapter that merges ``spec``'s parts, built (once per key: the
        parts' paths and file versions, the weights, the method and its options) as a PEFT
        directory and registered, so that its requests load, cache, evict and report it as
        any other adapter. Raises MergeSpecError (400 naming the sub-field),
        AdapterNotFoundError for an unknown part (404) and the part's AdapterValidationError
        for one that cannot be merged; nothing changes then."""
        if len(spec.ids) > self.max_merge_parts:
            raise MergeSpecError(
                f"{MERGE_FIELD}.ids",
                f"names {len(spec.ids)} adapters; at most {self.max_merge_parts} may be merged",
            )
        parts = []
        for part in spec.ids:
            path = await self._part_path(part)
            parts.append((part, path, part_etag(path)))
        name = merged_name(spec, parts)
        if name in self.registered and name in self.merged_built:
            self.merged_built.move_to_end(name)
            return name
        task = self._merging.get(name)
        if task is None:
            if self.merge_dir is None:
                self.merge_dir = Path(tempfile.mkdtemp(prefix="adaptermesh-merged-"))
            out = self.merge_dir / name
            # Parts in the CPU cache with B as stored (one scale: nothing folded) are merged
            # from there, not read again.
            cached = {}
            for part, path, _ in parts:
                cpu = self.cpu_cache.get(part)
                if cpu is not None and cpu.path == path and mergeable_as_cached(cpu):
                    cached[part] = cpu
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._build_merge, spec, parts, out, base_model, cached)
            )
            self._merging[name] = task
            task.add_done_callback(lambda t: self._merging.pop(name, None))
        path = await asyncio.shield(task)
        if name not in self.registered:
            self.registered[name] = _Registration(path)
            self.merged_built[name] = path
            self._trim_merged(keep=name)
        return name

    def _build_merge(
        self,
        spec: MergeSpec,
        parts: list[tuple[str, Path, str]],
        out: Path,
        base_model: str,
        cached: dict[str, CpuAdapter],
    ) -> Path:
        """Runs in a thread: ``cached`` holds the parts found in the CPU cache (their data
        never changes), the others are read from their directories."""
        if (out / "adapter_config.json").is_file():  # built before: the key names its content
            return out
        t0 = time.perf_counter()
        cpus = [cached.get(n) or read_part(n, p, self.cfg, self.max_rank) for n, p, _ in parts]
        t1 = time.perf_counter()
        dtype = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else torch.float32
        # On a GPU worker the maths runs on the pool's device (the parts' data go there once).
        phases = build_merged(spec, cpus, out, self.cfg, base_model, dtype, self.pool.device)
        self.last_merge_phases = {"read_parts": t1 - t0, **phases}
        self.counters.merges += 1
        return out

    def _trim_merged(self, keep: str) -> None:
        for old in list(self.merged_built):
            if len(self.merged_built) <= self.max_merged:
                return
            held = old == keep or old in self.published or old in self.inflight
            if held or old in self.wanted or old in self.claims:
                continue
            path = self.merged_built.pop(old)
            self.registered.pop(old, None)
            self._drop_cpu(old)
            shutil.rmtree(path, ignore_errors=True)

    # ---- admin API ----------------------------------------------------------------------------

    async def load(
        self, name: str, path: str | None = None, *, pinned: bool = False
    ) -> AdapterInfo:
        """Explicit (re)load: two-phase; on failure nothing that is serving changes."""
        validate_name(name)
        resolved = await self._resolve_path(name, path)
        pending = self.inflight.get(name)
        if pending is not None:
            # Let a concurrent on-demand load finish first so versions commit in order.
            await asyncio.gather(pending, return_exceptions=True)
        self.negative.pop(name, None)
        self._drop_cpu(name)  # a reload always re-reads the files
        task = self._start_load(name, resolved, pinned)
        try:
            await task
        except AdapterNotFoundError:
            # Explicit loads report to their caller; they do not poison on-demand resolution.
            self.negative.pop(name, None)
            raise
        self.registered[name] = _Registration(resolved, pinned)
        return self.info(name)

    async def _resolve_path(self, name: str, path: str | None) -> Path:
        """The local directory of an explicit load: under the adapter root, or fetched from
        (found in) a store for an ``s3://`` or ``hf://`` path."""
        if path is not None and is_store_uri(path):
            if self.stores is None:
                raise AdapterValidationError(
                    name,
                    "lora_path",
                    f"{path.split('://')[0]}:// paths need adapter stores, "
                    "which this worker does not configure",
                )
            return await self.stores.local_path(name, path)
        resolved = resolve_in_root(self.root, name, path)
        snapshot = hf_local_snapshot(resolved)
        if snapshot is not resolved:
            resolved = resolve_in_root(self.root, name, str(snapshot))
        return resolved

    async def unload(self, name: str) -> None:
        validate_name(name)
        pending = self.inflight.get(name)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        pub = self.published.pop(name, None)
        reg = self.registered.pop(name, None)
        # In-flight requests keep the set object alive; it goes when the last one ends.
        ps = self.expert_sets.pop(name, None)
        if pub is None and reg is None and ps is None:
            raise AdapterNotFoundError(name, "not loaded")
        if pub is not None:
            self.gpu_policy.remove(name)
            self._retire(pub.slot)
        self._drop_cpu(name)
        self.on_change()

    def prefetch(self, names: Iterable[str]) -> list[asyncio.Task[int]]:
        """Start loading adapters that are not resident yet; does not touch hit/miss counters."""
        tasks = []
        for name in names:
            validate_name(name)
            if name in self.published or name in self.expert_sets:
                continue
            task = self.inflight.get(name) or self._start_load(name)
            tasks.append(task)
        return tasks

    def store_load(self, name: str) -> asyncio.Task[int] | None:
        """The load in flight for ``name``, started here when only an adapter store holds it
        (not under the adapter root, resolvers configured); None when it is resident, or
        absent and local (the scheduler loads it when a slot is free). Raises the error of a
        recent failed load (negative cache) and AdapterNotFoundError for a bad name."""
        if name in self.published or name in self.expert_sets:
            return None
        task = self.inflight.get(name)
        if task is not None:
            return task
        self.check_request(name)
        if name in self.registered or self.stores is None or not self.stores.resolvers:
            return None
        path = resolve_in_root(self.root, name)
        if (path / "adapter_config.json").is_file() or is_expert_set(path):
            return None
        return self._start_load(name)

    def info(self, name: str) -> AdapterInfo:
        pub = self.published.get(name)
        reg = self.registered.get(name)
        if pub is not None:
            return AdapterInfo(name, str(pub.path), pub.rank, True, self.slots[pub.slot].pinned)
        ps = self.expert_sets.get(name)
        if ps is not None:
            return AdapterInfo(name, str(ps.path), ps.expert_set.rank, True, ps.expert_set.pinned)
        cpu = self.cpu_cache.get(name)
        if reg is not None:
            return AdapterInfo(name, str(reg.path), cpu.rank if cpu else 0, False, reg.pinned)
        raise AdapterNotFoundError(name, "not loaded")

    def list(self) -> list[AdapterInfo]:
        names = sorted(set(self.published) | set(self.expert_sets) | set(self.registered))
        return [self.info(n) for n in names]

    def local_path(self, name: str) -> Path | None:
        """The local directory a request for ``name`` reads now (published, registered, or a
        PEFT adapter under the root); None when there is none (a bad name, or only a store
        holds it)."""
        pub, reg = self.published.get(name), self.registered.get(name)
        if pub is not None or reg is not None:
            return pub.path if pub is not None else reg.path if reg is not None else None
        try:
            validate_name(name)
            path = resolve_in_root(self.root, name)
        except AdapterNotFoundError:
            return None
        return path if (path / "adapter_config.json").is_file() else None

    def vocab_of(self, name: str) -> int | None:
        """The vocabulary of adapter ``name`` as last read (its slot's, else its CPU cache
        entry's); None when it has not been read."""
        pub = self.published.get(name)
        if pub is not None and self.pool.extra is not None:
            return self.pool.extra.vocab[pub.slot]
        cpu = self.cpu_cache.get(name)
        return cpu.vocab_size or self.cfg.vocab_size if cpu is not None else None

    def version(self, name: str) -> int | None:
        pub = self.published.get(name)
        if pub is not None:
            return pub.version
        ps = self.expert_sets.get(name)
        return ps.expert_set.version if ps else None

    def slots_used(self) -> int:
        return sum(1 for s in self.slots if s.name is not None or s.retired or s.reserved)

    def held_by_tier(self) -> tuple[AdapterResidency, ...]:
        """Every adapter held now, once per tier: published GPU slots and expert sets
        (``gpu``), the CPU cache (``cpu``). Only held names appear, so the answer is bounded by
        the slots, the expert sets and the CPU cache's budget, whatever names clients ask for."""
        gpu = [
            AdapterResidency(name, "gpu", self.slots[pub.slot].pinned, pub.rank)
            for name, pub in self.published.items()
        ]
        sets = [
            AdapterResidency(name, "gpu", ps.expert_set.pinned, ps.expert_set.rank)
            for name, ps in self.expert_sets.items()
        ]
        cpu = [
            AdapterResidency(name, "cpu", entry.pinned, entry.rank)
            for name, entry in self.cpu_cache.items()
        ]
        return (*gpu, *sets, *cpu)
