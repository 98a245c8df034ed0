"""Load input for the policy: worker metrics, scraped directly or read from Prometheus.

Both sources return one ``WorkerObservation`` per worker endpoint. A worker whose last good
reading is older than ``stale_after`` (three intervals by default) is *unknown*: the policy
holds its weight and never reads the silence as an idle worker. Missing series are tolerated:
each contributes nothing, and a worker with no series at all is unknown.

The series read are parsed by ``adaptermesh.worker_scrape.parse_metrics`` (listed there).
Both also hand over each adapter's TTFT histogram over the interval
(``WorkerObservation.adapter_ttft``) for the per adapter-class capacity fits: bucket deltas
between two scrapes, or ``increase`` over the PromQL window.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import httpx

from adaptermesh.control_plane.http_client import KeptClient, plain_http_client_options
from adaptermesh.control_plane.policy import WorkerObservation, endpoint_key
from adaptermesh.control_plane.tables import keep_only
from adaptermesh.worker_scrape import (
    MAX_ADAPTER_HISTOGRAMS,
    RawSample,
    adapter_list,
    interval_deltas,
    interval_quantile,
    le_bound,
    parse_metrics,
)

__all__ = [
    "TAIL_QUANTILE",
    "LoadSource",
    "PrometheusSource",
    "RawSample",
    "ScrapeSource",
    "Target",
    "parse_metrics",
]

# The tail the policy reads: p95 of time to first token and of time per output token.
TAIL_QUANTILE = 0.95


@dataclass(frozen=True, slots=True)
class Target:
    shard_id: str
    address: str
    port: int

    @property
    def key(self) -> str:
        return endpoint_key(self.address, self.port)


@dataclass(slots=True)
class _WorkerHistory:
    sample: RawSample | None = None
    at: float | None = None  # monotonic time of the last good scrape
    observation: WorkerObservation | None = None


def _reuse(new: frozenset[str], old: frozenset[str] | None) -> frozenset[str]:
    """The previous tick's set when it is equal: the policy's column layout interns adapter
    sets by object, so an unchanged set costs it one identity check instead of a hash."""
    return old if old is not None and old == new else new


def _observe(target: Target, prev: _WorkerHistory, raw: RawSample, now: float) -> WorkerObservation:
    """Turn two consecutive scrapes into rates over the interval between them."""
    latency: float | None = None
    ttft_p95: float | None = None
    tpot_p95: float | None = None
    tokens_per_s = 0.0
    first_tokens = 0.0
    adapter_ttft: dict[str, tuple[tuple[float, float], ...]] = {}
    before = prev.sample
    last = prev.observation
    if before is not None and prev.at is not None and now > prev.at:
        dt = now - prev.at
        restarted = False
        if (
            raw.ttft_sum is not None
            and raw.ttft_count is not None
            and before.ttft_sum is not None
            and before.ttft_count is not None
        ):
            dn = raw.ttft_count - before.ttft_count
            ds = raw.ttft_sum - before.ttft_sum
            # A counter reset (worker restart) gives a negative delta: skip the interval.
            restarted = dn < 0
            if dn > 0 and ds >= 0:
                latency = ds / dn
                first_tokens = dn
        if not restarted:
            # Per adapter class fits (capacity_history.py): a series absent last time was
            # born in the interval, so all its counts are new (unless the last scrape was at
            # the cap, which may have left it out).
            born_ok = len(before.adapter_ttft) < MAX_ADAPTER_HISTOGRAMS
            for name, buckets in raw.adapter_ttft.items():
                old = before.adapter_ttft.get(name)
                if old is None and not born_ok:
                    continue
                delta = interval_deltas(buckets, old)
                if delta is not None:
                    adapter_ttft[name] = delta
        ttft_p95 = interval_quantile(TAIL_QUANTILE, raw.ttft_buckets, before.ttft_buckets)
        tpot_p95 = interval_quantile(TAIL_QUANTILE, raw.tpot_buckets, before.tpot_buckets)
        if raw.tokens_total is not None and before.tokens_total is not None:
            dt_tokens = raw.tokens_total - before.tokens_total
            if dt_tokens >= 0:
                tokens_per_s = dt_tokens / dt
    return WorkerObservation(
        address=target.address,
        port=target.port,
        known=raw.series > 0,
        waiting=raw.waiting or 0.0,
        running=raw.running or 0.0,
        kv_cache_usage=min(1.0, max(0.0, raw.kv_cache_usage or 0.0)),
        latency_s=latency,
        ttft_p95_s=ttft_p95,
        tpot_p95_s=tpot_p95,
        tokens_per_s=tokens_per_s,
        gpu_free_bytes=raw.gpu_free_bytes,
        resident_adapters=_reuse(raw.resident_adapters, last.resident_adapters if last else None),
        requested_adapters=_reuse(
            raw.running_adapters | raw.waiting_adapters,
            last.requested_adapters if last else None,
        ),
        age_s=0.0,
        first_tokens=first_tokens,
        adapter_ttft=adapter_ttft,
    )


class LoadSource(Protocol):
    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        """One observation per target key (``address:port``); ``now`` is monotonic seconds."""
        ...


def _stale(target: Target, last: WorkerObservation | None, age: float) -> WorkerObservation:
    base = last or WorkerObservation(address=target.address, port=target.port, known=False)
    return replace(base, known=False, age_s=age)


@dataclass
class ScrapeSource:
    """Scrape every worker's ``/metrics`` concurrently, each with its own timeout."""

    interval_s: float = 5.0
    timeout_s: float = 2.0
    stale_intervals: float = 3.0
    path: str = "/metrics"
    max_concurrency: int = 64
    # A client to use instead of the source's own (tests pass a mocked transport). Without
    # one the source keeps its own across rounds (``aclose`` closes it).
    client: httpx.AsyncClient | None = None
    _history: dict[str, _WorkerHistory] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    _kept: KeptClient = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._kept = KeptClient(**plain_http_client_options(self.max_concurrency))

    def _client(self) -> httpx.AsyncClient:
        return self.client or self._kept.get()

    async def aclose(self) -> None:
        await self._kept.aclose()

    @property
    def stale_after_s(self) -> float:
        return self.stale_intervals * self.interval_s

    async def _fetch(self, client: httpx.AsyncClient, target: Target) -> str:
        url = f"http://{_host(target.address)}:{target.port}{self.path}"
        resp = await client.get(url, timeout=self.timeout_s)
        resp.raise_for_status()
        return resp.text

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        client = self._client()
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(t: Target) -> tuple[Target, str | BaseException]:
            async with limit:
                try:
                    return t, await asyncio.wait_for(self._fetch(client, t), self.timeout_s)
                except Exception as exc:  # each failure only makes that worker older
                    return t, exc

        results = await asyncio.gather(*(one(t) for t in targets))
        out: dict[str, WorkerObservation] = {}
        for target, result in results:
            hist = self._history.setdefault(target.key, _WorkerHistory())
            raw: RawSample | None = None
            if isinstance(result, str):
                try:
                    raw = parse_metrics(result)
                except Exception as exc:  # malformed exposition: treat like a failed scrape
                    result = exc
            if raw is not None and raw.series > 0:
                obs = _observe(target, hist, raw, now)
                hist.sample, hist.at, hist.observation = raw, now, obs
                self.errors.pop(target.key, None)
                out[target.key] = obs
                continue
            self.errors[target.key] = (
                repr(result) if isinstance(result, BaseException) else "no known series"
            )
            age = now - hist.at if hist.at is not None else math.inf
            down = isinstance(result, httpx.ConnectError | ConnectionRefusedError)
            if hist.observation is not None and age <= self.stale_after_s:
                # A missed scrape inside the staleness window keeps the last reading.
                out[target.key] = replace(hist.observation, age_s=age, down=down)
            else:
                out[target.key] = replace(_stale(target, hist.observation, age), down=down)
        # Workers no longer listed leave with their history and their last error (which
        # the rebalancer would otherwise count as a failed scrape on every step).
        wanted = {t.key for t in targets}
        keep_only(self._history, wanted)
        keep_only(self.errors, wanted)
        return out


def _window_histograms(
    per: Mapping[str, Mapping[float, float]],
) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per adapter, its buckets' increase over the query window (ascending, +Inf last), for
    the adapters with a request in it."""
    out: dict[str, tuple[tuple[float, float], ...]] = {}
    for adapter, by_le in per.items():
        if math.inf in by_le and by_le[math.inf] > 0:
            out[adapter] = tuple(sorted(by_le.items()))
    return out


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@dataclass
class PrometheusSource:
    """Read the same series from a Prometheus HTTP API (``/api/v1/query``) with PromQL.

    Workers are matched by the ``instance`` label (``address:port``), the default for
    Prometheus' own scrape configs. Rates use ``window`` (a PromQL duration).
    """

    base_url: str
    interval_s: float = 5.0
    timeout_s: float = 3.0
    stale_intervals: float = 3.0
    window: str = "1m"
    instance_label: str = "instance"
    headers: Mapping[str, str] = field(default_factory=dict)
    # As ScrapeSource.client; without one the source keeps its own (Prometheus may be
    # reached over TLS, so this one verifies certificates).
    client: httpx.AsyncClient | None = None
    _last: dict[str, tuple[float, WorkerObservation]] = field(default_factory=dict)
    _kept: KeptClient = field(default_factory=lambda: KeptClient(trust_env=False), repr=False)

    def _client(self) -> httpx.AsyncClient:
        return self.client or self._kept.get()

    async def aclose(self) -> None:
        await self._kept.aclose()

    def queries(self) -> dict[str, str]:
        lbl, w = self.instance_label, self.window
        return {
            "waiting": f"sum by ({lbl}) (vllm:num_requests_waiting)",
            "running": f"sum by ({lbl}) (vllm:num_requests_running)",
            "kv": f"max by ({lbl}) (vllm:kv_cache_usage_perc)",
            "ttft": f"sum by ({lbl}) (rate(adaptermesh_time_to_first_token_seconds_sum[{w}]))"
            f" / sum by ({lbl}) (rate(adaptermesh_time_to_first_token_seconds_count[{w}]))",
            "ttft_p95": f"histogram_quantile({TAIL_QUANTILE}, sum by ({lbl}, le)"
            f" (rate(adaptermesh_time_to_first_token_seconds_bucket[{w}])))",
            "tpot_p95": f"histogram_quantile({TAIL_QUANTILE}, sum by ({lbl}, le)"
            f" (rate(adaptermesh_time_per_output_token_seconds_bucket[{w}])))",
            "tokens": f"sum by ({lbl}) (rate(adaptermesh_generation_tokens_total[{w}]))",
            "free": f"sum by ({lbl}) (adaptermesh_free_gpu_memory_bytes)",
            "lora": "vllm:lora_requests_info",
            "first_tokens": f"sum by ({lbl}) "
            f"(increase(adaptermesh_time_to_first_token_seconds_count[{w}]))",
            "adapter_ttft": f"sum by ({lbl}, adapter, le) "
            f"(increase(adaptermesh_adapter_time_to_first_token_seconds_bucket[{w}]))",
        }

    async def _query(self, client: httpx.AsyncClient, promql: str) -> list[dict[str, object]]:
        resp = await client.get(
            self.base_url.rstrip("/") + "/api/v1/query",
            params={"query": promql},
            headers=dict(self.headers),
            timeout=self.timeout_s,
        )
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query failed: {body.get('error', body)}")
        result = body.get("data", {}).get("result", [])
        return list(result) if isinstance(result, list) else []

    async def collect(self, targets: Sequence[Target], now: float) -> dict[str, WorkerObservation]:
        client = self._client()
        names = list(self.queries())
        answers = await asyncio.gather(
            *(self._query(client, q) for q in self.queries().values()),
            return_exceptions=True,
        )
        per: dict[str, dict[str, float]] = {}
        lora: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        buckets: dict[str, dict[str, dict[float, float]]] = {}  # instance -> adapter -> le
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                continue
            for item in answer:
                metric = item.get("metric")
                value = item.get("value")
                if not isinstance(metric, dict) or not isinstance(value, list) or len(value) != 2:
                    continue
                inst = str(metric.get(self.instance_label, ""))
                try:
                    val = float(value[1])
                except (TypeError, ValueError):
                    continue
                if name == "adapter_ttft":
                    adapter = str(metric.get("adapter", ""))
                    le = le_bound(str(metric.get("le", "")))
                    per_inst = buckets.setdefault(inst, {})
                    if (
                        adapter
                        and le is not None
                        and math.isfinite(val)
                        and val >= 0
                        and (adapter in per_inst or len(per_inst) < MAX_ADAPTER_HISTOGRAMS)
                    ):
                        per_inst.setdefault(adapter, {})[le] = val
                elif name == "lora":
                    lora[inst] = (
                        adapter_list(str(metric.get("running_lora_adapters", ""))),
                        adapter_list(str(metric.get("waiting_lora_adapters", ""))),
                    )
                elif math.isfinite(val):
                    per.setdefault(inst, {})[name] = val
        out: dict[str, WorkerObservation] = {}
        for t in targets:
            vals = per.get(t.key)
            if vals:
                running_a, waiting_a = lora.get(t.key, (frozenset(), frozenset()))
                prior = self._last.get(t.key)
                before = prior[1] if prior else None
                obs = WorkerObservation(
                    address=t.address,
                    port=t.port,
                    known=True,
                    waiting=vals.get("waiting", 0.0),
                    running=vals.get("running", 0.0),
                    kv_cache_usage=min(1.0, max(0.0, vals.get("kv", 0.0))),
                    latency_s=vals.get("ttft"),
                    ttft_p95_s=vals.get("ttft_p95"),
                    tpot_p95_s=vals.get("tpot_p95"),
                    tokens_per_s=vals.get("tokens", 0.0),
                    gpu_free_bytes=vals.get("free"),
                    resident_adapters=_reuse(
                        running_a, before.resident_adapters if before else None
                    ),
                    requested_adapters=_reuse(
                        running_a | waiting_a, before.requested_adapters if before else None
                    ),
                    first_tokens=max(0.0, vals.get("first_tokens", 0.0)),
                    adapter_ttft=_window_histograms(buckets.get(t.key, {})),
                )
                self._last[t.key] = (now, obs)
                out[t.key] = obs
                continue
            last = self._last.get(t.key)
            age = now - last[0] if last else math.inf
            if last and age <= self.stale_intervals * self.interval_s:
                out[t.key] = replace(last[1], age_s=age)
            else:
                out[t.key] = _stale(t, last[1] if last else None, age)
        keep_only(self._last, out)  # a worker no longer listed goes
        return out
