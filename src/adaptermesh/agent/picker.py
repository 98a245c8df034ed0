"""Endpoint picking for adapter-by-body routing: the request's model -> an adapter and a worker.

Pure parts (no I/O, no clock): :func:`model_of` reads the OpenAI ``model`` field from a
request body, :func:`score` rates one worker for one adapter, and :func:`decide` turns the
model, the candidate workers and an optional subset hint into a :class:`Decision`.
:class:`EndpointBook` is the thread-safe state those functions read: each shard's serving
workers (from the applied Assignment) and each worker's last scraped load.

Scoring follows what a Gateway API Inference Extension picker weighs (LoRA affinity, queue
depth, KV-cache use), from the series the workers export (``docs/worker-service.md``):

- residency (weight 3): 1 when the adapter has running requests on the worker
  (``vllm:lora_requests_info``), 0.9 when it is held in a GPU slot there (the Assignment's
  adapters, ``vllm:lora_adapter_loaded{level="gpu"}`` or ``adaptermesh_adapter_resident``),
  0.6 when it is held in the worker's CPU cache (``vllm:lora_adapter_loaded{level="cpu"}``: one
  host-to-GPU copy away, no disk read), 0.3 when the worker does not hold it but has a free
  adapter slot (``max_lora``, else ``vllm:max_gpu_lora_adapters``, above its GPU-resident
  count), else 0. A base-model request scores 1 everywhere. So with equal queues and KV caches
  a GPU holder beats a CPU holder, which beats a worker that must read the adapter from disk.
  The weights make a GPU holder with a queue of 3 and half its KV cache beat an idle worker
  that would have to load the adapter; a holder about 20 deep with a full KV cache no longer
  does. A CPU holder with an empty queue and half its KV cache also beats the idle worker.
- queue (weight 1): ``1 / (1 + waiting + picked since the last scrape)``, so a burst between two
  scrapes spreads instead of piling onto the worker that looked idlest.
- KV cache (weight 1): ``1 - vllm:kv_cache_usage_perc``.

A worker never scraped yet scores 0.5 on queue and KV, so a fresh worker is neither shunned
nor flooded. Ties go round robin.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
from adaptermesh.worker_scrape import RawSample

__all__ = [
    "Decision",
    "EndpointBook",
    "EndpointLoad",
    "decide",
    "endpoint_key",
    "model_of",
    "score",
]

RESIDENCY_WEIGHT = 3.0
# Residency scores by where the worker holds the adapter (see the module's docstring).
RUNNING_SCORE = 1.0
GPU_SCORE = 0.9
CPU_SCORE = 0.6
FREE_SLOT_SCORE = 0.3
QUEUE_WEIGHT = 1.0
KV_WEIGHT = 1.0
_UNKNOWN = 0.5


def endpoint_key(address: str, port: int) -> str:
    """``ip:port`` as the endpoint-picker protocol writes it (IPv6 in brackets)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address}:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def model_of(body: bytes) -> str | None:
    """The top-level string ``model`` of a JSON object body; None when there is none."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    model = data.get("model")
    return model if isinstance(model, str) and model else None


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One worker as the picker sees it."""

    address: str
    port: int
    resident: frozenset[str] = frozenset()
    running_adapters: frozenset[str] = frozenset()
    # Adapters in the worker's CPU cache (one may also be resident on the GPU).
    cpu_cached: frozenset[str] = frozenset()
    max_lora: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    # Picks made since the last scrape (not yet visible in ``waiting``).
    pending: int = 0
    # ``ip:port``; computed when empty. The book passes it in: parsing the address for every
    # candidate of every request cost about 0.1 ms of the processor's time per request.
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", endpoint_key(self.address, self.port))


def score(load: EndpointLoad, adapter: str | None) -> float:
    """How good ``load`` is for a request of ``adapter`` (None: the base model); higher wins."""
    if adapter is None or adapter in load.running_adapters:
        residency = RUNNING_SCORE
    elif adapter in load.resident:
        residency = GPU_SCORE
    elif adapter in load.cpu_cached:
        residency = CPU_SCORE
    elif load.max_lora is not None and load.max_lora > len(load.resident):
        residency = FREE_SLOT_SCORE
    else:
        residency = 0.0
    if load.waiting is None:
        queue = _UNKNOWN / (1.0 + load.pending)
    else:
        queue = 1.0 / (1.0 + max(load.waiting, 0.0) + load.pending)
    kv = _UNKNOWN if load.kv_cache_usage is None else 1.0 - min(max(load.kv_cache_usage, 0.0), 1.0)
    return RESIDENCY_WEIGHT * residency + QUEUE_WEIGHT * queue + KV_WEIGHT * kv


@dataclass(frozen=True, slots=True)
class Decision:
    """What the processor tells Envoy.

    ``adapter`` goes in the adapter header (None: remove it: the base model, or no model);
    ``endpoints`` are best first (empty: no pick); ``status`` is an HTTP status to answer
    instead of forwarding (503: nothing eligible), or None to forward.
    """

    model: str | None
    adapter: str | None
    endpoints: tuple[str, ...] = ()
    status: int | None = None
    reason: str = ""


def decide(
    model: str | None,
    base_model: str | None,
    candidates: Sequence[EndpointLoad],
    *,
    subset: Sequence[str] | None = None,
    must_pick: bool = False,
    rotation: int = 0,
    fallbacks: int = 0,
) -> Decision:
    """Pick for one request.

    ``model`` equal to ``base_model`` (or absent) is a base-model request: no adapter header.
    ``subset`` (the GIE subset hint) limits the candidates to those ``ip:port`` keys; when it is
    given and none is eligible the answer is 503, as the protocol requires. ``must_pick`` (a
    GIE gateway: it has no route without a destination) also answers 503 when there is no
    candidate; otherwise an empty pick lets Envoy's own routing choose (fail-open).
    ``rotation`` breaks ties round robin; ``fallbacks`` extra endpoints follow the best one.
    """
    adapter = None if model is None or model == base_model else model
    pool = list(candidates)
    if subset is not None:
        allowed = set(subset)
        pool = [c for c in pool if c.key in allowed]
        if not pool:
            return Decision(model, adapter, status=503, reason="no eligible endpoint in subset")
    if not pool:
        if must_pick:
            return Decision(model, adapter, status=503, reason="no ready endpoint")
        return Decision(model, adapter, reason="no endpoint known")
    n = len(pool)
    ranked = sorted(range(n), key=lambda i: (-score(pool[i], adapter), (i - rotation) % n))
    chosen = tuple(pool[i].key for i in ranked[: 1 + max(fallbacks, 0)])
    return Decision(model, adapter, chosen, reason="picked")


@dataclass(slots=True)
class _Worker:
    address: str
    port: int
    assigned: frozenset[str]
    sample: RawSample | None = None
    pending: int = 0
    key: str = ""


@dataclass
class EndpointBook:
    """Each shard's serving workers and their last load. Thread-safe.

    ``set_assignment`` replaces the workers (draining ones are not candidates) and keeps the
    load of workers that stay; ``observe`` records a scrape and clears the pending picks.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _shards: dict[str, list[str]] = field(default_factory=dict)
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _rotation: int = 0

    def set_assignment(self, assignment: assignment_pb2.Assignment) -> None:
        shards: dict[str, list[str]] = {}
        workers: dict[str, _Worker] = {}
        with self._lock:
            for shard in assignment.shards:
                if shard.state == assignment_pb2.SHARD_STATE_DRAINING:
                    continue
                keys = shards.setdefault(shard.id, [])
                for ep in shard.endpoints:
                    if ep.draining:
                        continue
                    key = endpoint_key(ep.address, ep.port)
                    old = self._workers.get(key)
                    worker = workers.get(key) or _Worker(
                        ep.address,
                        ep.port,
                        frozenset(),
                        old.sample if old else None,
                        old.pending if old else 0,
                        key,
                    )
                    worker.assigned = worker.assigned | frozenset(ep.adapters)
                    workers[key] = worker
                    if key not in keys:
                        keys.append(key)
            self._shards, self._workers = shards, workers

    def set_endpoints(self, shard_id: str, endpoints: Iterable[tuple[str, int]]) -> None:
        """Add or replace one shard's workers without an Assignment (a static pool)."""
        with self._lock:
            keys = []
            for address, port in endpoints:
                key = endpoint_key(address, port)
                self._workers.setdefault(key, _Worker(address, port, frozenset(), key=key))
                keys.append(key)
            self._shards[shard_id] = keys

    def targets(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(w.address, w.port) for w in self._workers.values()]

    def observe(self, address: str, port: int, sample: RawSample | None) -> None:
        """A scrape of one worker; None forgets its load (unreachable: scored as unknown)."""
        with self._lock:
            worker = self._workers.get(endpoint_key(address, port))
            if worker is not None:
                worker.sample, worker.pending = sample, 0

    def candidates(self, shard_id: str | None) -> list[EndpointLoad]:
        """The shard's workers (every shard's when ``shard_id`` is None), in a stable order."""
        with self._lock:
            if shard_id is None:
                keys = list(dict.fromkeys(k for ks in self._shards.values() for k in ks))
            else:
                keys = list(self._shards.get(shard_id, ()))
            return [_load(self._workers[k]) for k in keys if k in self._workers]

    def note_pick(self, key: str) -> int:
        """Count a pick against ``key`` until the next scrape; returns the next rotation."""
        with self._lock:
            worker = self._workers.get(key)
            if worker is not None:
                worker.pending += 1
            self._rotation += 1
            return self._rotation

    @property
    def rotation(self) -> int:
        return self._rotation

    def loads(self) -> Mapping[str, EndpointLoad]:
        with self._lock:
            return {k: _load(w) for k, w in self._workers.items()}


def _load(worker: _Worker) -> EndpointLoad:
    s = worker.sample
    if s is None:
        return EndpointLoad(
            worker.address, worker.port, worker.assigned, pending=worker.pending, key=worker.key
        )
    return EndpointLoad(
        worker.address,
        worker.port,
        resident=worker.assigned | s.resident_adapters,
        running_adapters=s.running_adapters,
        cpu_cached=s.cpu_adapters,
        max_lora=s.max_lora,
        waiting=s.waiting,
        kv_cache_usage=s.kv_cache_usage,
        pending=worker.pending,
        key=worker.key,
    )
