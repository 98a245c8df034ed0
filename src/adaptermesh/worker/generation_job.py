"""One validated generation request (``GenerationJob``) and the progress of each of its choices
(``ChoiceProgress``) as the engine's events come in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from adaptermesh.worker.types import AdapterResolution, SamplingParams, TokenEvent

__all__ = [
    "ChoiceEvent",
    "ChoiceProgress",
    "GenerationJob",
    "GenerationKind",
    "record_event",
    "request_outcome",
]

# Which OpenAI endpoint a request came through: /v1/completions or /v1/chat/completions.
GenerationKind = Literal["completion", "chat"]


@dataclass(slots=True)
class GenerationJob:
    """One validated generation request on its way through queue and engine."""

    kind: GenerationKind
    model: str
    adapter: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    tenant: str
    arrived: float
    deadline: float
    request_id: str
    # Choices: n engine sequences of one prompt, answered together.
    n: int = 1
    # best_of: this many engine sequences, of which the n with the highest cumulative logprob
    # are answered (0: n sequences, all answered). Never streamed.
    best_of: int = 0
    # The sampling asks the engine for logprobs only to rank best_of's candidates: the answer
    # carries none.
    ranking_logprobs: bool = False
    # echo: the prompt's text, sent before each choice's text.
    echo: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # The SSE chunk's bytes up to its choices list: the same for every chunk of the request,
    # so it is encoded once instead of once per token.
    chunk_head: bytes = b""
    # The W3C trace context the request carried and its span attributes (tracing on only).
    trace_context: Any = None
    trace_attrs: dict[str, str] | None = None
    # Constrained decoding: the compiled grammar every choice starts a matcher in (None:
    # unconstrained); chat tools: how the output becomes tool calls (tool_calls.ToolPlan).
    grammar: Any = None
    tool_plan: Any = None

    @property
    def candidates(self) -> int:
        """The engine sequences the request runs (best_of when set, else n)."""
        return max(self.best_of, self.n)

    @property
    def reports_logprobs(self) -> bool:
        return self.sampling.logprobs is not None and not self.ranking_logprobs


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One engine event of choice ``index`` of a request run by ``WorkerService.job_events``.

    ``usage`` (the whole request's, as in the HTTP answer) is set on the event that finishes
    the request's last choice, and only there.
    """

    index: int
    event: TokenEvent
    usage: dict[str, int] | None = None


@dataclass(slots=True)
class ChoiceProgress:
    """What one choice's events have said so far (token times, counts, finish reason)."""

    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    # How the request ended, for metrics, once known.
    outcome: str | None = None
    # How the engine found the adapter (its first event carries it; tracing's span).
    resolution: AdapterResolution | None = None


def record_event(
    progress: ChoiceProgress, event: TokenEvent, prompt_length: int, now: float
) -> None:
    """Fold ``event``, received at monotonic time ``now``, into ``progress``; the prompt's
    length stands in for ``event.prompt_tokens`` until the engine reports it."""
    if event.resolution is not None:
        progress.resolution = event.resolution
    if event.token_id is not None or event.text:
        if progress.first_token is None:
            progress.first_token = now
        progress.last_token = now
    progress.prompt_tokens = event.prompt_tokens or prompt_length
    progress.completion_tokens = event.completion_tokens
    if event.finish_reason is not None:
        progress.finish_reason = event.finish_reason
        if progress.first_token is None and event.completion_tokens > 0:
            progress.first_token = now
        if progress.last_token is None and progress.first_token is not None:
            progress.last_token = now


def request_outcome(progresses: list[ChoiceProgress]) -> str:
    """A finished request's outcome: ``length`` when any choice hit its cap, else ``stop``."""
    reasons = {p.finish_reason for p in progresses}
    if None in reasons or not reasons <= {"stop", "length"}:
        return "error"
    return "length" if "length" in reasons else "stop"
