"""Types shared by the worker engine and the HTTP service around it.

The service calls ``Engine.submit(request)`` and iterates the returned async stream of
``TokenEvent``; the last event has ``finish_reason`` set. Cancelling the iteration (or calling
``stream.cancel()``) cancels the request and frees its batch slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from adaptermesh.assignment_rules import MAX_QUOTED

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_VALUE",
    "MAX_LOGPROBS",
    "AdapterInfo",
    "AdapterLoadTimeoutError",
    "AdapterNotFoundError",
    "AdapterResidency",
    "EngineError",
    "EngineOverloadedError",
    "EngineProtocol",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "GrammarProtocol",
    "InvalidRequestError",
    "ParamError",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprob",
    "TokenStream",
    "TopLogprob",
]

FinishReason = Literal["stop", "length", "cancelled", "error"]

# The most alternatives per token a request may ask for (``SamplingParams.logprobs``): OpenAI's
# chat limit, also applied to the legacy completions ``logprobs``. The engine sizes its per-step
# host copy for it.
MAX_LOGPROBS = 20
# The most tokens one request's ``SamplingParams.logit_bias`` may bias (OpenAI's limit), and
# the largest bias magnitude.
MAX_LOGIT_BIAS = 300
MAX_LOGIT_BIAS_VALUE = 100.0


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """The request is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ParamError(ValueError):
    """A request parameter's value refused where it is parsed or compiled: ``param`` is its
    path in the body (``response_format.json_schema``, ``merged_adapters.ids[1]``),
    ``message`` says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class AdapterNotFoundError(EngineError, LookupError):
    """The named adapter does not exist under the adapter root (or failed validation)."""

    def __init__(self, name: str, message: str = "adapter not found") -> None:
        # A client chose the name: the message carries a bounded prefix of a long one.
        shown = (
            name if len(name) <= MAX_QUOTED else f"{name[:MAX_QUOTED]}… ({len(name)} characters)"
        )
        super().__init__(f"{shown}: {message}")
        self.name = name


class AdapterLoadTimeoutError(AdapterNotFoundError):
    """A request waited ``wait_s`` for its adapter's load, which has not finished (its store
    is slow or stalled). The server's problem, not the client's: ``status`` 503, retry later.
    The load itself goes on for the requests that come after."""

    status = 503

    def __init__(self, name: str, wait_s: float) -> None:
        super().__init__(
            name,
            f"its load did not finish within {wait_s:g} s (the adapter store is slow or "
            "stalled); retry later",
        )
        self.wait_s = wait_s


class EngineOverloadedError(EngineError):
    """The engine cannot accept more work now; retry later."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    typical_p: float = 1.0  # locally typical sampling's mass (worker/sampling.py); 1 = off
    # None: no logprobs. k >= 0: the logprob of each sampled token and the k most likely
    # alternatives, all from the raw model distribution (log_softmax of the logits, before
    # logit_bias, penalties, temperature and filters). At most MAX_LOGPROBS.
    logprobs: int | None = None
    # (token id, bias) pairs, ids distinct and in the vocabulary, biases in [-100, 100], at
    # most MAX_LOGIT_BIAS: added to the row's logits on the device before sampling.
    logit_bias: tuple[tuple[int, float], ...] = ()


class GrammarProtocol(Protocol):
    """A grammar compiled for the engine's vocabulary (worker/grammar.py)."""

    def matcher(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # None or the base model's name: base only. Otherwise an adapter name.
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Absolute deadline in time.monotonic() seconds; None: no deadline.
    deadline: float | None = None
    # Constrained decoding: a compiled grammar (worker/grammar.py CompiledGrammar) whose
    # ``matcher()`` starts the sequence's grammar position; None: unconstrained.
    grammar: GrammarProtocol | None = None


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str  # the token's text on its own (special tokens spelt out)
    token_bytes: bytes  # the token's exact bytes (may be part of a multi-byte character)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's logprob and its ``top`` alternatives, most likely first."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    text_offset: int  # where the token's text starts in the request's output text
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class AdapterResolution:
    """How a request's adapter was found: the tier that served it (``gpu``: resident at the
    first lookup; ``cpu``: loaded from the CPU cache; ``disk``: read from the adapter root),
    the seconds of the load it waited for (0 for a hit), and the monotonic times of the first
    lookup and of the lease. Host clock readings only: taking it never synchronises a device."""

    tier: str
    started: float
    resolved: float
    load_s: float = 0.0
    version: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int | None
    text: str  # the detokenised increment (may be "" while a multi-byte char is incomplete)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Requests with ``logprobs``: the tokens whose text this event releases, in output order.
    # Usually the event's own token; tokens whose text is held back (a possible stop string)
    # come with the event that releases the text, and tokens a stop string cuts never come.
    logprobs: tuple[TokenLogprob, ...] = ()
    # Set on a sequence's first event when it named an adapter (tracing's resolution span).
    resolution: AdapterResolution | None = None


class TokenStream(Protocol):
    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...
    def cancel(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    resident_on_gpu: bool
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """One adapter held in one tier: ``level`` is ``"gpu"`` (in a GPU slot, or a GPU expert
    set) or ``"cpu"`` (in the host cache, one copy to a slot away). An adapter in both tiers
    has one entry for each."""

    name: str
    level: Literal["gpu", "cpu"]
    pinned: bool
    rank: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A point-in-time snapshot the service turns into Prometheus series."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float  # 0..1
    gpu_slots_used: int
    gpu_slots_total: int
    adapter_hits: int  # cumulative
    adapter_misses: int  # cumulative
    adapter_evictions: int  # cumulative
    free_gpu_bytes: int  # 0 on CPU
    generated_tokens: int  # cumulative
    # Adapter load latencies (seconds) observed since the previous call; drained by the caller.
    new_load_latencies: tuple[float, ...] = ()
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # Adapter scheduling (worker/scheduler.py), cumulative: loads started, evictions of an
    # adapter a waiting request wanted (aging's drain only), admissions that waited for a load,
    # and scheduling passes where nothing could run while a request waited for a load.
    adapter_loads_started: int = 0
    adapter_evictions_wanted: int = 0
    admissions_waited_on_load: int = 0
    idle_passes_on_adapter_load: int = 0
    # Adapters held per tier now (GPU slots and the CPU cache); None when the engine does not
    # tell tiers apart (the service then reports its GPU-resident adapters from list_adapters).
    adapter_residency: tuple[AdapterResidency, ...] | None = None
    # Tensor parallelism: whether each rank's process is alive, rank 0 first (() without).
    tp_ranks_up: tuple[bool, ...] = ()


class EngineProtocol(Protocol):
    model_name: str
    max_model_len: int
    # Whether adapter slots live in GPU memory (False on a CPU worker: AdapterInfo's
    # resident_on_gpu then means "in a slot of the host pool").
    on_gpu: bool

    def submit(self, request: GenerationRequest) -> TokenStream: ...
    def tokenize(self, text: str) -> list[int]: ...
    def detokenize(self, token_ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int] | None:
        """Token ids for a chat, or None when the tokenizer has no chat template."""
        ...

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterInfo: ...
    async def unload_adapter(self, name: str) -> None: ...
    def list_adapters(self) -> list[AdapterInfo]: ...
    def knows_adapter(self, name: str) -> bool:
        """Whether ``name`` is one of :meth:`list_adapters`' names, without building the list
        (called per request)."""
        ...

    async def locate_adapter(self, name: str) -> str | None:
        """Where a request for ``name`` would find it, without loading it: "resident",
        "root" (under the adapter root), "store" (a resolver store holds it), None: nowhere."""
        ...

    def stats(self) -> EngineStats: ...
    async def shutdown(self) -> None: ...
