"""Prometheus series of the worker service.

Two families live here, each listed with its type and labels in ``docs/worker-service.md``:

- vLLM's names (``vllm:*``), so gateways and dashboards built for vLLM read this worker
  unchanged. Their labels follow vLLM's (``model_name``; ``running_lora_adapters``,
  ``waiting_lora_adapters`` and ``max_lora`` on ``vllm:lora_requests_info``; ``adapter_name``,
  ``level``, ``pinned`` and ``rank`` on ``vllm:lora_adapter_loaded``).
- The project's ``adaptermesh_*`` series, which the control plane's rebalancer scrapes.

Engine-derived values are read from one ``EngineStats`` snapshot per scrape (and once a
second by the service's poller, which feeds the tokens-per-second window), so every series in
one scrape describes the same instant. ``EngineStats.new_load_latencies`` is drained by each
``stats()`` call, so all calls go through ``ServiceMetrics.poll()``, which records them.

Adapter residency, the series routers score LoRA affinity on (``vllm:lora_requests_info`` lists
only adapters with requests in flight): ``vllm:lora_adapter_loaded`` is 1 for each adapter held
now, once per tier (``level`` ``gpu``: in a GPU slot; ``cpu``: in the host cache), and has no
sample for anything else, so its cardinality is bounded by the slots and the CPU cache's budget
and never by the names clients send. ``vllm:num_gpu_loaded_lora_adapters`` counts the GPU tier,
``vllm:max_gpu_lora_adapters`` is the pool's slots, and ``vllm:lora_adapter_load_seconds`` takes
the same load latencies as ``adaptermesh_adapter_load_latency_seconds``.

Every service owns its registry: two workers in one process (tests) never share series.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adaptermesh.assignment_rules import VERSION_SEPARATOR
from adaptermesh.worker.fair_queue import FairQueue, TenantSnapshot
from adaptermesh.worker.types import AdapterResidency, EngineProtocol, EngineStats

__all__ = [
    "MAX_ADAPTER_LABELS",
    "OTHER_ADAPTER_LABEL",
    "TOKENS_PER_SECOND_WINDOW_S",
    "ServiceMetrics",
]

# Window of the tokens-per-second gauge: long enough to smooth batch-step jitter, short enough
# that the 5 s rebalancer sees a load change within two of its periods.
TOKENS_PER_SECOND_WINDOW_S = 10.0

# Bucket edges (seconds). TTFT spans an H200's few-millisecond prefill up to a minute of
# queueing under overload; TPOT spans ~2 ms decode steps on the GPU to ~1 s steps on CPU.
_TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
# The 1, 2.5, 5 series from 0.5 ms to 10 s.
_ONE_TWO_FIVE = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# From 10 ms, then doubling up to 160 s.
_LATENCY_BUCKETS = (*_ONE_TWO_FIVE[4:], 20.0, 40.0, 80.0, 160.0)
_LOAD_BUCKETS = _ONE_TWO_FIVE


# adaptermesh_adapter_requests_total and adaptermesh_adapter_time_to_first_token_seconds take
# their ``adapter`` label from the request, so a client could mint a series per made-up name.
# A name gets its own label value only when this worker knows the adapter (registered with
# the engine or resident, or a version ``a@v`` of an adapter ``a`` it knows), and only for the
# first MAX_ADAPTER_LABELS such names; every other request counts under OTHER_ADAPTER_LABEL.
MAX_ADAPTER_LABELS = 1024
OTHER_ADAPTER_LABEL = "other"


class ServiceMetrics:
    """All series of one worker service, in one registry."""

    def __init__(
        self,
        engine: EngineProtocol,
        queue: FairQueue,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.model_name = engine.model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        # (monotonic time, cumulative generated tokens) samples for the tokens/s window.
        self._token_samples: deque[tuple[float, int]] = deque()
        self._last_stats: EngineStats | None = None
        # The adapter label values minted so far (at most MAX_ADAPTER_LABELS).
        self._adapter_labels: set[str] = set()

        # The *_created series double the scrape size and no consumer reads them; vLLM turns
        # them off too. The switch is process-wide, which is fine in a worker process.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        r = self.registry
        # Registered first: collection follows registration order, and this collector's poll()
        # moves freshly drained load latencies into the histogram below within the same scrape.
        r.register(_EngineCollector(self))

        # Every series below is made in this registry by these four.
        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: list[str] | None = None
        ) -> Histogram:
            return Histogram(name, doc, labels or (), registry=r, buckets=buckets)

        def model_histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return histogram(name, doc, buckets, ["model_name"]).labels(model_name=self.model_name)

        def counter(name: str, doc: str, labels: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels or (), registry=r)

        def model_counter(name: str, doc: str) -> Counter:
            return counter(name, doc, ["model_name"]).labels(model_name=self.model_name)

        self.ttft = histogram(
            "adaptermesh_time_to_first_token_seconds",
            "Time from the request's arrival to its first generated token, queueing included.",
            _TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "adaptermesh_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per finished request.",
            _TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "adaptermesh_request_latency_seconds",
            "Time from arrival to the last token, per finished generation request.",
            _LATENCY_BUCKETS,
        )
        self.queue_wait = histogram(
            "adaptermesh_queue_wait_seconds",
            "Time a request waited in its tenant queue before the engine admitted it.",
            _TTFT_BUCKETS,
        )
        self.load_latency = histogram(
            "adaptermesh_adapter_load_latency_seconds",
            "Adapter load latency reported by the engine (disk or CPU cache to GPU slot).",
            _LOAD_BUCKETS,
        )
        # vLLM's name for the same observations (the histogram routers read load cost from).
        self.vllm_load_seconds = model_histogram(
            "vllm:lora_adapter_load_seconds",
            "Adapter load time in seconds (disk or CPU cache to a GPU slot).",
            _LOAD_BUCKETS,
        )
        self.requests = counter(
            "adaptermesh_requests",
            "Finished generation requests by outcome (finish reason, or the error that ended them).",
            ["outcome"],
        )
        # Per adapter as served (a version is its own name, "a@v"): what the control plane's
        # rollout controller judges a new version by (docs/rollout.md). Base-model requests
        # are not counted here.
        self.adapter_requests = counter(
            "adaptermesh_adapter_requests",
            "Finished generation requests per adapter (version included) by outcome.",
            ["adapter", "outcome"],
        )
        self.adapter_ttft = histogram(
            "adaptermesh_adapter_time_to_first_token_seconds",
            "Time to first token per adapter (version included), queueing included.",
            _TTFT_BUCKETS,
            ["adapter"],
        )
        self.rejected = counter(
            "adaptermesh_requests_rejected",
            "Generation requests refused before reaching the engine, by reason.",
            ["reason"],
        )
        self.listener_refused = counter(
            "adaptermesh_http_connections_refused",
            "Connections the listener closed or refused before a handler ran, by reason.",
            ["reason"],
        )
        self.prompt_tokens = counter(
            "adaptermesh_prompt_tokens",
            "Prompt tokens of requests admitted into the engine.",
        )
        # WebSocket streaming (``/v1/ws``). Its requests also count in the request series above.
        self.ws_open = Gauge(
            "adaptermesh_websocket_sessions_open",
            "WebSocket sessions open now.",
            registry=r,
        )
        self.ws_sessions = counter(
            "adaptermesh_websocket_sessions",
            "Ended WebSocket sessions by how they closed (client_closed, disconnected, "
            "slow_client, message_too_big, binary_frame, protocol_error, server_shutdown).",
            ["close"],
        )
        self.ws_requests = counter(
            "adaptermesh_websocket_requests",
            "Requests received over WebSocket sessions by outcome (finish reason, cancelled, "
            "disconnected, or the error code that ended them).",
            ["outcome"],
        )
        # vLLM's request-level series, with its names, types and labels, fed by the same
        # observations as the adaptermesh_* ones above.
        self.vllm_ttft = model_histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds (queueing included).",
            _TTFT_BUCKETS,
        )
        self.vllm_tpot = model_histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request, in seconds.",
            _TPOT_BUCKETS,
        )
        self.vllm_e2e = model_histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            _LATENCY_BUCKETS,
        )
        self.vllm_prompt_tokens = model_counter(
            "vllm:prompt_tokens",
            "Prompt tokens of requests admitted into the engine.",
        )
        self.vllm_success = counter(
            "vllm:request_success",
            "Requests that finished with a finish reason (stop or length).",
            ["model_name", "finished_reason"],
        )
        for reason in ("stop", "length"):
            self.vllm_success.labels(model_name=self.model_name, finished_reason=reason)

    # --------------------------------------------------------------------------------- polling
    def poll(self) -> EngineStats:
        """Read the engine's stats once, record drained load latencies and the token sample."""
        stats = self.engine.stats()
        for seconds in stats.new_load_latencies:
            self.load_latency.observe(seconds)
            self.vllm_load_seconds.observe(seconds)
        now = self._clock()
        samples = self._token_samples
        samples.append((now, stats.generated_tokens))
        # Keep one sample at or before the window's start so the rate spans the full window.
        while len(samples) > 2 and samples[1][0] <= now - TOKENS_PER_SECOND_WINDOW_S:
            samples.popleft()
        self._last_stats = stats
        return stats

    def residency(self, stats: EngineStats) -> list[AdapterResidency]:
        """The adapters held per tier, sorted and without repeats. An engine that does not tell
        tiers apart reports its GPU-resident adapters (``list_adapters``) as the GPU tier."""
        held = stats.adapter_residency
        if held is None:
            held = tuple(
                AdapterResidency(info.name, "gpu", info.pinned, info.rank)
                for info in self.engine.list_adapters()
                if info.resident_on_gpu
            )
        return sorted(set(held), key=lambda h: (h.name, h.level, h.pinned, h.rank))

    def tokens_per_second(self) -> float:
        samples = self._token_samples
        if len(samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        if t1 <= t0:
            return 0.0
        return max(0, n1 - n0) / (t1 - t0)

    # --------------------------------------------------------------------------- observations
    def observe_finished(
        self,
        *,
        outcome: str,
        arrived: float,
        first_token: float | None,
        last_token: float | None,
        completion_tokens: int,
        adapter: str | None = None,
    ) -> None:
        self.requests.labels(outcome=outcome).inc()
        if adapter is not None:
            label = self.adapter_label(adapter)
            self.adapter_requests.labels(adapter=label, outcome=outcome).inc()
            if first_token is not None:
                self.adapter_ttft.labels(adapter=label).observe(first_token - arrived)
        if outcome in ("stop", "length"):
            self.vllm_success.labels(model_name=self.model_name, finished_reason=outcome).inc()
        if first_token is None:
            return
        self.ttft.observe(first_token - arrived)
        self.vllm_ttft.observe(first_token - arrived)
        if last_token is not None:
            self.e2e.observe(last_token - arrived)
            self.vllm_e2e.observe(last_token - arrived)
            if completion_tokens > 1:
                tpot = (last_token - first_token) / (completion_tokens - 1)
                self.tpot.observe(tpot)
                self.vllm_tpot.observe(tpot)

    def adapter_label(self, adapter: str) -> str:
        """The ``adapter`` label value of a request for ``adapter``: the name itself for an
        adapter this worker knows (at most MAX_ADAPTER_LABELS names), else "other"."""
        if adapter in self._adapter_labels:
            return adapter
        if len(self._adapter_labels) < MAX_ADAPTER_LABELS and self._knows(adapter):
            self._adapter_labels.add(adapter)
            return adapter
        return OTHER_ADAPTER_LABEL

    def _knows(self, adapter: str) -> bool:
        """The engine holds ``adapter`` (or, for ``a@v``, ``a`` or another version of it).
        Lookups first: only a versioned name the engine does not hold lists its adapters."""
        if self.engine.knows_adapter(adapter):
            return True
        stats = self._last_stats
        resident = (
            {held.name for held in stats.adapter_residency}
            if stats is not None and stats.adapter_residency is not None
            else set()
        )
        if adapter in resident:
            return True
        base, separator, _ = adapter.partition(VERSION_SEPARATOR)
        if not separator:
            return False
        if self.engine.knows_adapter(base):
            return True
        names = resident | {info.name for info in self.engine.list_adapters()}
        return any(name.partition(VERSION_SEPARATOR)[0] == base for name in names)

    def observe_prompt(self, tokens: int) -> None:
        """Count the prompt tokens of a request the engine admitted."""
        self.prompt_tokens.inc(tokens)
        self.vllm_prompt_tokens.inc(tokens)


Labels = tuple[str, ...]
Samples = Iterable[tuple[Labels, float]]


@dataclass(frozen=True, slots=True)
class _Scrape:
    """What one scrape reads: the service, one stats snapshot, the queue's tenants and the
    adapters held per tier."""

    m: ServiceMetrics
    stats: EngineStats
    tenants: list[tuple[str, TenantSnapshot]]
    held: list[AdapterResidency]

    @property
    def model(self) -> Labels:
        return (self.m.model_name,)


@dataclass(frozen=True, slots=True)
class _Series:
    """One scrape-time family: its name, help, type, label names, and the reader that gives its
    samples (label values, value) from a scrape. ``when`` leaves the family out of a scrape it
    does not describe (tensor-parallel ranks on a worker without them)."""

    name: str
    help: str
    kind: Literal["gauge", "counter"]
    labels: Labels
    read: Callable[[_Scrape], Samples]
    when: Callable[[_Scrape], bool] | None = None


def _model_gauge(name: str, help: str, value: Callable[[_Scrape], float]) -> _Series:
    """A gauge with the one ``model_name`` label."""
    return _Series(name, help, "gauge", ("model_name",), lambda s: [(s.model, value(s))])


def _plain(kind: Literal["gauge", "counter"], name: str, help: str, field: str) -> _Series:
    """An unlabelled family whose value is one field of the stats snapshot."""
    return _Series(name, help, kind, (), lambda s: [((), float(getattr(s.stats, field)))])


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _lora_requests_info(s: _Scrape) -> Samples:
    running = ",".join(sorted(set(s.stats.running_adapters)))
    waiting = ",".join(sorted(set(s.stats.waiting_adapters)))
    return [((running, waiting, str(s.stats.max_loras)), time.time())]


# Every scrape-time family, in exposition order.
_SERIES: tuple[_Series, ...] = (
    _model_gauge(
        "vllm:num_requests_waiting",
        "Requests waiting: in the worker's tenant queues plus in the engine's own queue.",
        lambda s: s.m.queue.num_waiting + s.stats.num_waiting,
    ),
    _model_gauge(
        "vllm:num_requests_running",
        "Requests in the engine's running batch.",
        lambda s: s.stats.num_running,
    ),
    _model_gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage as a fraction: 0 is empty, 1 is full.",
        lambda s: s.stats.kv_cache_usage,
    ),
    # vLLM's name before 0.9; older GIE releases and dashboards read this one.
    _model_gauge(
        "vllm:gpu_cache_usage_perc",
        "KV-cache usage as a fraction (vLLM's older name of vllm:kv_cache_usage_perc).",
        lambda s: s.stats.kv_cache_usage,
    ),
    _Series(
        "vllm:lora_requests_info",
        "Adapters of running and waiting requests (comma-separated label values); the "
        "value is the scrape's Unix time.",
        "gauge",
        ("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        _lora_requests_info,
    ),
    _Series(
        "vllm:lora_adapter_loaded",
        "1 for each adapter held now, per tier (level gpu: in a GPU slot; cpu: in the host "
        "cache); adapters not held have no sample.",
        "gauge",
        ("adapter_name", "level", "pinned", "rank"),
        lambda s: [((h.name, h.level, _flag(h.pinned), str(h.rank)), 1.0) for h in s.held],
    ),
    _model_gauge(
        "vllm:num_gpu_loaded_lora_adapters",
        "Adapters held in GPU slots now.",
        lambda s: float(len({h.name for h in s.held if h.level == "gpu"})),
    ),
    _model_gauge(
        "vllm:max_gpu_lora_adapters",
        "Adapter GPU slots in the pool (the most adapters held on the GPU at once).",
        lambda s: float(s.stats.gpu_slots_total),
    ),
    _Series(
        "vllm:generation_tokens",
        "Tokens generated by the engine.",
        "counter",
        ("model_name",),
        lambda s: [(s.model, s.stats.generated_tokens)],
    ),
    _Series(
        "adaptermesh_adapter_resident",
        "1 for each adapter held in a GPU slot (idle or not), 0 for one known but not "
        "resident (on disk or in the CPU cache).",
        "gauge",
        ("adapter", "pinned"),
        lambda s: [
            ((info.name, _flag(info.pinned)), 1.0 if info.resident_on_gpu else 0.0)
            for info in sorted(s.m.engine.list_adapters(), key=lambda a: a.name)
        ],
    ),
    _Series(
        "adaptermesh_queue_depth",
        "Requests waiting in each tenant's queue (tenants idle for 5 minutes are dropped).",
        "gauge",
        ("tenant",),
        lambda s: [((tenant,), snap.waiting) for tenant, snap in s.tenants],
    ),
    _Series(
        "adaptermesh_tenant_requests_running",
        "Requests each tenant has admitted into the engine.",
        "gauge",
        ("tenant",),
        lambda s: [((tenant,), snap.running) for tenant, snap in s.tenants],
    ),
    _Series(
        "adaptermesh_queue_depth_total",
        "Requests waiting in all tenant queues.",
        "gauge",
        (),
        lambda s: [((), s.m.queue.num_waiting)],
    ),
    _Series(
        "adaptermesh_requests_admitted",
        "Requests admitted into the engine and not yet finished (bounded by max_running).",
        "gauge",
        (),
        lambda s: [((), s.m.queue.num_running)],
    ),
    _Series(
        "adaptermesh_generation_tokens_per_second",
        f"Generated tokens per second over the last {TOKENS_PER_SECOND_WINDOW_S:g} s.",
        "gauge",
        (),
        lambda s: [((), s.m.tokens_per_second())],
    ),
    _plain(
        "counter",
        "adaptermesh_generation_tokens",
        "Tokens generated by the engine.",
        "generated_tokens",
    ),
    _plain(
        "counter",
        "adaptermesh_adapter_cache_hits",
        "Adapter lookups served from a GPU slot.",
        "adapter_hits",
    ),
    _plain(
        "counter",
        "adaptermesh_adapter_cache_misses",
        "Adapter lookups that had to load the adapter.",
        "adapter_misses",
    ),
    _plain(
        "counter",
        "adaptermesh_adapter_cache_evictions",
        "Adapters evicted from a GPU slot.",
        "adapter_evictions",
    ),
    _plain(
        "counter",
        "adaptermesh_adapter_loads_started",
        "Adapter loads the scheduler started, in queue order.",
        "adapter_loads_started",
    ),
    _plain(
        "counter",
        "adaptermesh_adapter_evictions_wanted",
        "Evictions of an adapter a waiting request "
        "wanted (only to drain a slot for an aged request).",
        "adapter_evictions_wanted",
    ),
    _plain(
        "counter",
        "adaptermesh_admissions_waited_on_adapter_load",
        "Requests admitted after waiting for their adapter to load.",
        "admissions_waited_on_load",
    ),
    _plain(
        "counter",
        "adaptermesh_scheduler_idle_on_adapter_load",
        "Scheduling passes that could run no "
        "step while a request waited for an adapter load (no step ever waits on a load).",
        "idle_passes_on_adapter_load",
    ),
    _plain(
        "gauge",
        "adaptermesh_gpu_slots_used",
        "Adapter GPU slots holding an adapter.",
        "gpu_slots_used",
    ),
    _plain(
        "gauge", "adaptermesh_gpu_slots_total", "Adapter GPU slots in the pool.", "gpu_slots_total"
    ),
    _plain(
        "gauge",
        "adaptermesh_free_gpu_memory_bytes",
        "Free GPU memory in bytes (0 on CPU).",
        "free_gpu_bytes",
    ),
    _plain(
        "gauge",
        "adaptermesh_kv_cache_usage_ratio",
        "KV-cache usage as a fraction (0..1).",
        "kv_cache_usage",
    ),
    _plain("gauge", "adaptermesh_max_loras", "Adapters the engine can batch at once.", "max_loras"),
    _Series(
        "adaptermesh_tp_rank_up",
        "Tensor-parallel ranks of this worker: 1 while the rank's process runs.",
        "gauge",
        ("rank",),
        lambda s: [((str(r),), 1.0 if up else 0.0) for r, up in enumerate(s.stats.tp_ranks_up)],
        when=lambda s: bool(s.stats.tp_ranks_up),
    ),
)

_FAMILIES: dict[str, type[GaugeMetricFamily] | type[CounterMetricFamily]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
}


class _EngineCollector(Collector):
    """Series computed at scrape time from the engine's stats and the fair queue: each family
    of ``_SERIES`` rendered from one scrape."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable[Metric]:
        # Returning nothing keeps registration from calling collect() (and the engine) early.
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._m
        stats = m.poll()
        scrape = _Scrape(m, stats, sorted(m.queue.snapshot().items()), m.residency(stats))
        for series in _SERIES:
            if series.when is not None and not series.when(scrape):
                continue
            family = _FAMILIES[series.kind](series.name, series.help, labels=list(series.labels))
            for labels, value in series.read(scrape):
                family.add_metric(list(labels), value)
            yield family
