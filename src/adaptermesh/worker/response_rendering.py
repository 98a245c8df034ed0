"""The bytes and bodies a generation request answers with: the whole JSON body of a collected
request, and the SSE chunks of a streamed one, in OpenAI's (and vLLM's) shapes. Pure."""

from __future__ import annotations

import json
import math
from typing import Any

from adaptermesh.worker.api import (
    ChatChoice,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
)
from adaptermesh.worker.generation_job import ChoiceProgress, GenerationJob, GenerationKind
from adaptermesh.worker.types import TokenLogprob

__all__ = [
    "MIN_LOGPROB",
    "SSE_DONE",
    "best_candidates",
    "chat_logprobs",
    "chat_message",
    "choice_chunk",
    "completion_logprobs",
    "delta_chunk",
    "final_body",
    "sse_event",
    "usage_body",
    "usage_chunk",
]

# A logprob the model gives (almost) no chance is reported as this, not -inf, which JSON
# cannot carry.
MIN_LOGPROB = -9999.0
# The last line of every SSE stream.
SSE_DONE = b"data: [DONE]\n\n"
_CHUNK_TAIL = b"]}\n\n"


def _clamped_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """The legacy completions shape; each ``top_logprobs`` dict holds the asked-for most
    likely alternatives and the sampled token, keyed by text (the first of equal texts)."""
    tops: list[dict[str, float]] = []
    for entry in logprobs:
        top: dict[str, float] = {}
        for alternative in entry.top:
            top.setdefault(alternative.token, _clamped_logprob(alternative.logprob))
        top.setdefault(entry.token, _clamped_logprob(entry.logprob))
        tops.append(top)
    return {
        "tokens": [entry.token for entry in logprobs],
        "token_logprobs": [_clamped_logprob(entry.logprob) for entry in logprobs],
        "top_logprobs": tops,
        "text_offset": [entry.text_offset for entry in logprobs],
    }


def chat_logprobs(logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """The chat shape: one entry per token, with its bytes and its alternatives."""
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": _clamped_logprob(entry.logprob),
                "bytes": list(entry.token_bytes),
                "top_logprobs": [
                    {
                        "token": alternative.token,
                        "logprob": _clamped_logprob(alternative.logprob),
                        "bytes": list(alternative.token_bytes),
                    }
                    for alternative in entry.top
                ],
            }
            for entry in logprobs
        ]
    }


def _compact_json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def sse_event(payload: dict[str, Any]) -> bytes:
    """``payload`` as one SSE ``data:`` event."""
    return b"data: " + _compact_json(payload) + b"\n\n"


def usage_body(progresses: ChoiceProgress | list[ChoiceProgress]) -> dict[str, int]:
    """Usage of the whole request: the prompt once, the tokens of every choice."""
    choices = progresses if isinstance(progresses, list) else [progresses]
    prompt = choices[0].prompt_tokens
    completion = sum(p.completion_tokens for p in choices)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    ).model_dump()


def _chunk_object(kind: GenerationKind) -> str:
    return "text_completion" if kind == "completion" else "chat.completion.chunk"


def best_candidates(outputs: list[tuple[str, list[TokenLogprob]]], n: int) -> list[int]:
    """The indices of the ``n`` outputs with the highest cumulative logprob (the sum of their
    tokens' logprobs), best first; equal sums keep their order."""
    scores = [math.fsum(entry.logprob for entry in logprobs) for _, logprobs in outputs]
    return sorted(range(len(outputs)), key=lambda i: -scores[i])[:n]


def final_body(
    job: GenerationJob,
    outputs: list[tuple[str, list[TokenLogprob]]],
    progresses: list[ChoiceProgress],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The JSON body of a request answered whole: each choice's text (after the echoed prompt
    when asked for, and with logprobs when asked for) and the request's usage (by default that
    of ``progresses``)."""
    if usage is None:
        usage = usage_body(progresses)
    choices: list[dict[str, Any]] = []
    asked = job.reports_logprobs
    echo = job.echo or ""
    for index, ((text, logprobs), progress) in enumerate(zip(outputs, progresses, strict=True)):
        if job.kind == "completion":
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + text,
                    finish_reason=progress.finish_reason,
                    logprobs=CompletionLogprobs(**completion_logprobs(logprobs)) if asked else None,
                ).model_dump()
            )
        else:
            message, finish_reason = chat_message(job, text, progress.finish_reason)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    finish_reason=finish_reason,
                    logprobs=ChatLogprobs(**chat_logprobs(logprobs)) if asked else None,
                ).model_dump()
            )
    obj = "text_completion" if job.kind == "completion" else "chat.completion"
    return {
        "id": job.request_id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage,
    }


def chat_message(
    job: GenerationJob, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish reason: its text, or, when the request has tools
    and the output holds calls, the calls (``finish_reason`` as ``ToolPlan.finish_reason``
    says: ``tool_calls`` when the model chose the calls and stopped by itself)."""
    plan = job.tool_plan
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [call.as_openai() for call in calls],
    }
    return message, plan.finish_reason(finish_reason, True)


def delta_chunk(
    job: GenerationJob,
    delta: dict[str, Any],
    finish_reason: str | None,
    index: int = 0,
    logprobs: tuple[TokenLogprob, ...] = (),
) -> bytes:
    """One chat SSE chunk of choice ``index`` carrying ``delta`` as is (tool-call deltas)."""
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs) if logprobs else None,
        "finish_reason": finish_reason,
    }
    return _chunk(job, choice)


def _chunk(job: GenerationJob, choice: dict[str, Any]) -> bytes:
    if not job.chunk_head:
        head = sse_event(
            {
                "id": job.request_id,
                "object": _chunk_object(job.kind),
                "created": job.created,
                "model": job.model,
                "choices": [],
            }
        )
        job.chunk_head = head[: -len(_CHUNK_TAIL)]
    return job.chunk_head + _compact_json(choice) + _CHUNK_TAIL


def choice_chunk(
    job: GenerationJob,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    index: int = 0,
    logprobs: tuple[TokenLogprob, ...] = (),
) -> bytes:
    """One SSE chunk of choice ``index``; ``logprobs``: those of the tokens whose text it
    carries; ``role``: the chat stream's opening chunk, which names the assistant."""
    if job.kind != "completion":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return delta_chunk(job, delta, finish_reason, index, logprobs)
    choice = {
        "index": index,
        "text": text or "",
        "logprobs": completion_logprobs(logprobs) if logprobs else None,
        "finish_reason": finish_reason,
    }
    return _chunk(job, choice)


def usage_chunk(job: GenerationJob, progresses: ChoiceProgress | list[ChoiceProgress]) -> bytes:
    """The stream's closing usage chunk (``stream_options.include_usage``)."""
    return sse_event(
        {
            "id": job.request_id,
            "object": _chunk_object(job.kind),
            "created": job.created,
            "model": job.model,
            "choices": [],
            "usage": usage_body(progresses),
        }
    )
