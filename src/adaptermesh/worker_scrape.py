"""Reading a worker's Prometheus exposition: the series every reader of worker load uses (the
control plane's load sources, the agent's endpoint picker), parsed in one place.

Series read (the names the workers export, vLLM's first so existing gateways work):

* ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
* ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``
* ``adaptermesh_time_to_first_token_seconds`` (histogram; ``vllm:time_to_first_token_seconds``
  as a fallback)
* ``adaptermesh_time_per_output_token_seconds`` (histogram; ``vllm:time_per_output_token_seconds``
  as a fallback): the buckets of both histograms are kept for interval percentiles
* ``adaptermesh_generation_tokens_total`` (counter; ``vllm:generation_tokens_total`` fallback)
* ``adaptermesh_free_gpu_memory_bytes``, ``adaptermesh_gpu_slots_used``
* ``adaptermesh_adapter_resident{adapter, pinned}`` (1 when resident; ``pinned="true"`` when
  it is kept in its slot), when the worker exports it
* ``vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`` (1 per adapter held, per
  tier): ``level="gpu"`` adds to the resident (and pinned) adapters as above, ``level="cpu"``
  names the adapters in the worker's CPU cache; ``vllm:num_gpu_loaded_lora_adapters`` and
  ``vllm:max_gpu_lora_adapters`` (the GPU slots; ``max_lora`` when ``vllm:lora_requests_info``
  is absent)
* ``adaptermesh_adapter_time_to_first_token_seconds{adapter}`` (histogram per served adapter):
  its buckets, for the first ``MAX_ADAPTER_HISTOGRAMS`` adapters in the exposition
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "MAX_ADAPTER_HISTOGRAMS",
    "RawSample",
    "adapter_list",
    "interval_deltas",
    "interval_quantile",
    "le_bound",
    "parse_metrics",
]

# Per-adapter TTFT histograms kept per scrape: a worker exports one for every adapter it has
# served since it started, and a reader keeps the last scrape's buckets of each.
MAX_ADAPTER_HISTOGRAMS = 256
_ADAPTER_TTFT = "adaptermesh_adapter_time_to_first_token_seconds"

# First name found wins: the worker's own (docs/worker-service.md), then older or vLLM names.
_TTFT = (
    "adaptermesh_time_to_first_token_seconds",
    "adaptermesh_ttft_seconds",
    "vllm:time_to_first_token_seconds",
)
_TOKENS = (
    "adaptermesh_generation_tokens_total",
    "adaptermesh_generated_tokens_total",
    "vllm:generation_tokens_total",
)
_TPOT = (
    "adaptermesh_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds",
)
_FREE = ("adaptermesh_free_gpu_memory_bytes", "adaptermesh_gpu_free_bytes")
_SLOTS = ("adaptermesh_gpu_slots_used", "adaptermesh_adapter_gpu_slots_used")


@dataclass(slots=True)
class RawSample:
    """What one scrape of one worker said; counters are cumulative."""

    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    # Cumulative histogram buckets (upper bound, cumulative count), ascending, +Inf last.
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    tpot_buckets: tuple[tuple[float, float], ...] = ()
    tokens_total: float | None = None
    gpu_free_bytes: float | None = None
    slots_used: float | None = None
    max_lora: float | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    resident_adapters: frozenset[str] = frozenset()
    # Resident adapters the worker holds pinned (never evicted).
    pinned_adapters: frozenset[str] = frozenset()
    # Adapters in the worker's CPU cache (``vllm:lora_adapter_loaded{level="cpu"}``); an adapter
    # may be in both tiers.
    cpu_adapters: frozenset[str] = frozenset()
    gpu_loaded_adapters: float | None = None
    max_gpu_adapters: float | None = None
    # Per served adapter, its cumulative TTFT buckets (as ``ttft_buckets``).
    adapter_ttft: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    series: int = 0


def adapter_list(value: str) -> frozenset[str]:
    """The adapter names of a comma-separated label value (vLLM's ``*_lora_adapters``)."""
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


_HISTOGRAMS = frozenset(_TTFT + _TPOT)


def le_bound(text: str) -> float | None:
    """A histogram bucket's ``le`` label as a number (``+Inf`` included); None if it is not one."""
    try:
        v = float(text)
    except ValueError:
        return None
    return None if math.isnan(v) else v


def interval_quantile(
    q: float,
    now: tuple[tuple[float, float], ...],
    before: tuple[tuple[float, float], ...],
) -> float | None:
    """The ``q`` quantile of the observations made between two scrapes of one histogram,
    interpolated linearly inside its bucket as Prometheus' ``histogram_quantile`` does.

    None when nothing was observed in between, or the bucket bounds changed, or a counter went
    backwards (a worker restart). A quantile in the +Inf bucket is the largest finite bound.
    """
    if (
        not now
        or len(now) != len(before)
        or any(a[0] != b[0] for a, b in zip(now, before, strict=True))
    ):
        return None
    deltas = [(le, c - b) for (le, c), (_, b) in zip(now, before, strict=True)]
    if any(d < 0 for _, d in deltas):
        return None
    total = deltas[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in deltas:
        if c >= rank:
            if math.isinf(le):
                return prev_le if prev_le > 0 else None
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return None


def interval_deltas(
    now: tuple[tuple[float, float], ...], before: tuple[tuple[float, float], ...] | None
) -> tuple[tuple[float, float], ...] | None:
    """The buckets of the observations made between two scrapes of one histogram (cumulative
    in ``le``, as ``now``). ``before`` None: the series was born in between, so all of ``now``.
    None when nothing was observed, the bounds changed or a count went backwards."""
    if not now:
        return None
    if before is None:
        deltas = now
    else:
        if len(now) != len(before) or any(a[0] != b[0] for a, b in zip(now, before, strict=True)):
            return None
        deltas = tuple((le, c - b) for (le, c), (_, b) in zip(now, before, strict=True))
    if any(not d >= 0 for _, d in deltas) or not deltas[-1][1] > 0:
        return None
    return deltas


def parse_metrics(text: str) -> RawSample:
    """Parse Prometheus text exposition; unknown series are ignored, missing ones stay None."""
    raw = RawSample()
    ttft: dict[str, tuple[float | None, float | None]] = {}
    tokens: dict[str, float] = {}
    resident: set[str] = set()
    pinned: set[str] = set()
    cpu: set[str] = set()
    buckets: dict[str, dict[float, float]] = {}
    per_adapter: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, value = s.name, _finite(float(s.value))
            if value is None:
                continue
            raw.series += 1
            if name == "vllm:num_requests_waiting":
                raw.waiting = (raw.waiting or 0.0) + value
            elif name == "vllm:num_requests_running":
                raw.running = (raw.running or 0.0) + value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                raw.kv_cache_usage = max(raw.kv_cache_usage or 0.0, value)
            elif name == "vllm:lora_requests_info":
                raw.running_adapters |= adapter_list(s.labels.get("running_lora_adapters", ""))
                raw.waiting_adapters |= adapter_list(s.labels.get("waiting_lora_adapters", ""))
                if s.labels.get("max_lora", "").isdigit():
                    raw.max_lora = float(s.labels["max_lora"])
            elif name in _FREE:
                # Both names may be present during a rename: take one, never the sum.
                raw.gpu_free_bytes = max(raw.gpu_free_bytes or 0.0, value)
            elif name in _SLOTS:
                raw.slots_used = value
            elif name == "adaptermesh_adapter_resident":
                if value > 0 and s.labels.get("adapter"):
                    resident.add(s.labels["adapter"])
                    if s.labels.get("pinned") == "true":
                        pinned.add(s.labels["adapter"])
            elif name == "vllm:lora_adapter_loaded":
                adapter, level = s.labels.get("adapter_name"), s.labels.get("level")
                if value > 0 and adapter:
                    if level == "gpu":
                        resident.add(adapter)
                        if s.labels.get("pinned") == "true":
                            pinned.add(adapter)
                    elif level == "cpu":
                        cpu.add(adapter)
            elif name == "vllm:num_gpu_loaded_lora_adapters":
                raw.gpu_loaded_adapters = (raw.gpu_loaded_adapters or 0.0) + value
            elif name == "vllm:max_gpu_lora_adapters":
                raw.max_gpu_adapters = (raw.max_gpu_adapters or 0.0) + value
            elif name == _ADAPTER_TTFT + "_bucket":
                adapter, le = s.labels.get("adapter"), le_bound(s.labels.get("le", ""))
                if (
                    adapter
                    and le is not None
                    and (adapter in per_adapter or len(per_adapter) < MAX_ADAPTER_HISTOGRAMS)
                ):
                    per = per_adapter.setdefault(adapter, {})
                    per[le] = per.get(le, 0.0) + value
            elif name.endswith("_bucket") and name[: -len("_bucket")] in _HISTOGRAMS:
                le = le_bound(s.labels.get("le", ""))
                if le is not None:
                    per = buckets.setdefault(name[: -len("_bucket")], {})
                    per[le] = per.get(le, 0.0) + value
            else:
                for base in _TTFT:
                    if name == base + "_sum":
                        ttft[base] = (value, ttft.get(base, (None, None))[1])
                    elif name == base + "_count":
                        ttft[base] = (ttft.get(base, (None, None))[0], value)
                for base in _TOKENS:
                    # The parser strips "_total" from the family but keeps it on the sample.
                    if name in (base, base.removesuffix("_total")):
                        tokens[base] = tokens.get(base, 0.0) + value
    for base in _TTFT:
        if base in ttft and None not in ttft[base]:
            raw.ttft_sum, raw.ttft_count = ttft[base]
            break
    for names, attr in ((_TTFT, "ttft_buckets"), (_TPOT, "tpot_buckets")):
        for base in names:
            if base in buckets:
                setattr(raw, attr, tuple(sorted(buckets[base].items())))
                break
    for base in _TOKENS:
        if base in tokens:
            raw.tokens_total = tokens[base]
            break
    # An adapter with running requests is resident even if the worker does not say so.
    raw.resident_adapters = frozenset(resident) | raw.running_adapters
    raw.pinned_adapters = frozenset(pinned)
    raw.cpu_adapters = frozenset(cpu)
    if raw.max_lora is None:
        raw.max_lora = raw.max_gpu_adapters
    raw.adapter_ttft = {
        a: tuple(sorted(b.items())) for a, b in per_adapter.items() if math.inf in b
    }
    return raw
