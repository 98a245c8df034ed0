"""Reading a worker's Prometheus exposition: the series every reader of worker load uses (the
control plane's load sources, the agent's endpoint picker), parsed in one place.

Series read (the names the workers export, vLLM's first so existing gateways work):

* ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
* ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``
* ``adaptermesh_time_to_first_token_seconds`` (histogram; ``vllm:time_to_first_token_seconds``
  as a fallback)
* ``adaptermesh_generation_tokens_total`` (counter; ``vllm:generation_tokens_total`` fallback)
* ``adaptermesh_free_gpu_memory_bytes``, ``adaptermesh_gpu_slots_used``
* ``adaptermesh_adapter_resident{adapter}`` (1 when resident), when the worker exports it
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["RawSample", "adapter_list", "parse_metrics"]

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
    tokens_total: float | None = None
    gpu_free_bytes: float | None = None
    slots_used: float | None = None
    max_lora: float | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    resident_adapters: frozenset[str] = frozenset()
    series: int = 0


def adapter_list(value: str) -> frozenset[str]:
    """The adapter names of a comma-separated label value (vLLM's ``*_lora_adapters``)."""
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def parse_metrics(text: str) -> RawSample:
    """Parse Prometheus text exposition; unknown series are ignored, missing ones stay None."""
    raw = RawSample()
    ttft: dict[str, tuple[float | None, float | None]] = {}
    tokens: dict[str, float] = {}
    resident: set[str] = set()
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
    for base in _TOKENS:
        if base in tokens:
            raw.tokens_total = tokens[base]
            break
    # An adapter with running requests is resident even if the worker does not say so.
    raw.resident_adapters = frozenset(resident) | raw.running_adapters
    return raw
