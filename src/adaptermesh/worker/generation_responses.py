"""How a generation request's engine events become its HTTP answer: an SSE stream (one choice,
or n interleaved), or each choice's text collected for one JSON body; ``interleaved`` gives n choices' events as they
come to the routes that are not HTTP responses.

Each choice is read through a ``NextEvent``: a call that waits for the choice's next engine
event (raising ``ApiError`` past the deadline or on an engine error) and records it in the
choice's ``ChoiceProgress``. ``FinishError`` turns a ``cancelled`` or ``error`` finish reason
into the error the client gets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from aiohttp import web

from adaptermesh.worker.generation_job import ChoiceProgress, GenerationJob, request_outcome
from adaptermesh.worker.http_errors import ApiError
from adaptermesh.worker.response_rendering import (
    SSE_DONE,
    choice_chunk,
    delta_chunk,
    sse_event,
    usage_chunk,
)
from adaptermesh.worker.types import TokenEvent, TokenLogprob

__all__ = [
    "FinishError",
    "NextEvent",
    "collect_choice",
    "interleaved",
    "stream_choices",
    "stream_single_choice",
]

NextEvent = Callable[[], Awaitable[TokenEvent]]
FinishError = Callable[[str], ApiError]
_FAILED_FINISH_REASONS = ("cancelled", "error")


def _carries_chunk(event: TokenEvent) -> bool:
    # One chunk per generated token, even when its text is "" (an incomplete multi-byte
    # character): clients time tokens by chunks, as with vLLM.
    return event.token_id is not None or bool(event.text) or event.finish_reason is not None


class _ChoiceChunks:
    """The SSE chunks of one streamed choice's events: one per token as text deltas, or,
    for a chat with tools whose output is parsed, OpenAI's ``tool_calls`` deltas (and content
    deltas for text outside the calls) as ``tool_calls.ToolCallStream`` finds them."""

    def __init__(self, job: GenerationJob, index: int) -> None:
        self.job = job
        self.index = index
        plan = job.tool_plan if job.kind == "chat" else None
        self.plan = plan
        self.tools = None if plan is None or plan.format is None else plan.stream()

    def of(self, event: TokenEvent) -> list[bytes]:
        job, index = self.job, self.index
        if self.tools is None:
            if not _carries_chunk(event):
                return []
            return [
                choice_chunk(
                    job, event.text, event.finish_reason, index=index, logprobs=event.logprobs
                )
            ]
        deltas = self.tools.feed(event.text) if event.text else []
        reason: str | None = event.finish_reason
        if reason is not None:
            deltas += self.tools.finish()
            assert self.plan is not None  # tools are parsed only under a plan
            reason = self.plan.finish_reason(reason, self.tools.called)
        chunks = []
        logprobs = event.logprobs
        for delta in deltas:
            chunks.append(delta_chunk(job, delta, None, index, logprobs))
            logprobs = ()
        if reason is not None or logprobs:
            chunks.append(delta_chunk(job, {}, reason, index, logprobs))
        return chunks


async def _open_stream(request: web.Request, job: GenerationJob) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "x-request-id": job.request_id,
        }
    )
    await response.prepare(request)
    return response


async def _end_with_error(response: web.StreamResponse, error: ApiError) -> str:
    """Headers are gone: report ``error`` in-band, as vLLM does, and end the stream; returns
    the request's outcome."""
    await response.write(sse_event(error.body()))
    await response.write(SSE_DONE)
    return error.code or "error"


async def stream_single_choice(
    request: web.Request,
    job: GenerationJob,
    first: TokenEvent,
    next_event: NextEvent,
    finish_error: FinishError,
    progress: ChoiceProgress,
) -> web.StreamResponse:
    """Send the SSE stream of a one-choice request; ``progress.outcome`` says how it ended."""
    response = await _open_stream(request, job)
    progress.outcome = "disconnected"  # until a later line knows better
    event = first
    chunks = _ChoiceChunks(job, 0)
    try:
        if job.kind == "chat":
            await response.write(choice_chunk(job, "", None, role=True))
        elif job.echo:
            await response.write(choice_chunk(job, job.echo, None))
        while True:
            if event.finish_reason in _FAILED_FINISH_REASONS:
                assert event.finish_reason is not None
                progress.outcome = await _end_with_error(
                    response, finish_error(event.finish_reason)
                )
                return response
            for chunk in chunks.of(event):
                await response.write(chunk)
            if event.finish_reason is not None:
                break
            try:
                event = await next_event()
            except ApiError as exc:
                progress.outcome = await _end_with_error(response, exc)
                return response
        if job.include_usage:
            await response.write(usage_chunk(job, progress))
        await response.write(SSE_DONE)
        progress.outcome = progress.finish_reason or "error"
        await response.write_eof()
    except ConnectionResetError:
        progress.outcome = "disconnected"
    return response


async def stream_choices(
    request: web.Request,
    job: GenerationJob,
    firsts: list[TokenEvent],
    next_events: list[NextEvent],
    finish_error: FinishError,
    progresses: list[ChoiceProgress],
) -> web.StreamResponse:
    """The SSE stream of n > 1 choices: each choice's chunks in the order its tokens come,
    interleaved, each naming its ``index``; ``progresses[0].outcome`` says how it ended."""
    response = await _open_stream(request, job)
    head = progresses[0]
    head.outcome = "disconnected"
    writers = [_ChoiceChunks(job, index) for index in range(job.n)]
    try:
        if job.kind == "chat":
            for index in range(job.n):
                await response.write(choice_chunk(job, "", None, role=True, index=index))
        elif job.echo:
            for index in range(job.n):
                await response.write(choice_chunk(job, job.echo, None, index=index))
        async with contextlib.aclosing(interleaved(next_events, firsts)) as items:
            async for index, item in items:
                if isinstance(item, ApiError) or item.finish_reason in _FAILED_FINISH_REASONS:
                    error = (
                        item
                        if isinstance(item, ApiError)
                        else finish_error(str(item.finish_reason))
                    )
                    head.outcome = await _end_with_error(response, error)
                    return response
                for chunk in writers[index].of(item):
                    await response.write(chunk)
        if job.include_usage:
            await response.write(usage_chunk(job, progresses))
        await response.write(SSE_DONE)
        head.outcome = request_outcome(progresses)
        await response.write_eof()
    except ConnectionResetError:
        head.outcome = "disconnected"
    return response


async def interleaved(
    next_events: list[NextEvent], firsts: list[TokenEvent] | None = None
) -> AsyncGenerator[tuple[int, TokenEvent | ApiError], None]:
    """Every choice's events as they come, each with its choice's index, starting from
    ``firsts`` when those were read already; a choice ends at its finish reason or at the
    ``ApiError`` its read raised (yielded, not raised). Close it (``contextlib.aclosing``) to
    stop the reads of choices still running."""
    if firsts is None and len(next_events) == 1:
        while True:
            try:
                event = await next_events[0]()
            except ApiError as exc:
                yield 0, exc
                return
            yield 0, event
            if event.finish_reason is not None:
                return
    items: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()

    async def pump(index: int) -> None:
        event = None if firsts is None else firsts[index]
        try:
            while True:
                if event is None:
                    event = await next_events[index]()
                items.put_nowait((index, event))
                if event.finish_reason is not None:
                    return
                event = None
        except Exception as exc:
            items.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(index)) for index in range(len(next_events))]
    try:
        ended = 0
        while ended < len(pumps):
            index, item = await items.get()
            if isinstance(item, BaseException) and not isinstance(item, ApiError):
                raise item
            if isinstance(item, ApiError) or item.finish_reason is not None:
                ended += 1
            yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def collect_choice(
    first: TokenEvent, next_event: NextEvent, finish_error: FinishError
) -> tuple[str, list[TokenLogprob]]:
    """A choice's whole text and logprobs, read to its finish reason."""
    parts = [first.text]
    logprobs = list(first.logprobs)
    event = first
    while event.finish_reason is None:
        event = await next_event()
        parts.append(event.text)
        logprobs.extend(event.logprobs)
    reason = event.finish_reason
    if reason in _FAILED_FINISH_REASONS:
        raise finish_error(reason)
    return "".join(parts), logprobs
