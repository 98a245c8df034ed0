"""What crosses between the scheduler and the step launcher: plain, immutable data.

The scheduler (``scheduler.py``) plans a step on the engine's thread and emits a
``ScheduledStep``: which sequences (by id) contribute which rows, the input token ids the host
knows (or, for a decode row whose last token is still on the device, the entry of the previous
step's output that holds it), positions, the block-table entries that grew, adapter slots and
each sampling row's parameters. The launcher (``step_launch.py``) is handed only that
description; it never sees a scheduler ``Sequence`` and never changes scheduler state. It
answers with where each sampling row sits in the step's output (``InFlight.entries``) and,
when the step completes, a ``StepResult``: per sampling row, the token it sampled and its
logprobs. The engine hands both back to the scheduler on its own thread
(``Scheduler.launched``, ``Scheduler.apply``), which is the only place the scheduler's state
changes.

Two references in a description are live objects that are not scheduler state: a row's
``expert_set`` (an adapter resource the row holds a lease on) and a sampling row's
``matcher`` (the request's grammar position, whose next-token mask the step's tail reads; the
engine advances it when it applies a token, never while a step's tail reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from adaptermesh.worker.types import SamplingParams

if TYPE_CHECKING:
    from adaptermesh.worker.adafuse import ExpertSet

__all__ = [
    "BlockTableUpdate",
    "SampledToken",
    "SamplingRow",
    "ScheduledStep",
    "StepLogprobs",
    "StepResult",
    "StepRow",
]


class StepLogprobs(NamedTuple):
    """What one step measured for one sampled token (raw or processed distribution)."""

    logprob: float  # of the sampled token
    top_ids: list[int]  # the k most likely token ids, most likely first
    top_logprobs: list[float]  # their logprobs


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row that samples a token in the step: the request's sampling settings, the
    counter-based seed and counter of this draw, and what the logit processors read."""

    seq_id: int
    request_id: str
    sampling: SamplingParams
    seed: int
    counter: int  # the draw's counter (sampling.RowParams.counter)
    # Output tokens so far and prompt + output, for the penalties; () for rows without any.
    output: tuple[int, ...] = ()
    context: tuple[int, ...] = ()
    matcher: Any = None  # grammar position whose next-token mask limits the row; None: free


@dataclass(frozen=True, slots=True)
class StepRow:
    """One sequence's part of a step: ``count`` tokens from position ``start``.

    ``token_ids`` holds the input ids the host knows; a decode row whose input is the token
    the previous step sampled (still on the device) has none and names that step's output
    entry in ``source_entry`` (-1 otherwise)."""

    seq_id: int
    start: int
    count: int
    token_ids: tuple[int, ...]
    source_entry: int
    table_row: int
    lora_slot: int  # -1: base model
    expert_set: ExpertSet | None = None
    sampler: SamplingRow | None = None  # None: a prompt chunk that does not sample


@dataclass(frozen=True, slots=True)
class BlockTableUpdate:
    """Block-table entries that grew: ``blocks`` go to row ``table_row`` from ``first``."""

    table_row: int
    first: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One step: ``decode`` rows contribute one token each, then each ``prefill`` row a
    chunk; ``tables`` the block-table growth the step's rows need mirrored first."""

    step_id: int
    decode: tuple[StepRow, ...]
    prefill: tuple[StepRow, ...]
    tables: tuple[BlockTableUpdate, ...] = ()

    @property
    def rows(self) -> tuple[StepRow, ...]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(row.count for row in self.prefill)

    @property
    def samplers(self) -> tuple[SamplingRow, ...]:
        """The rows that sample, in row order (decode rows, then prompt chunks)."""
        return tuple(row.sampler for row in self.rows if row.sampler is not None)


@dataclass(frozen=True, slots=True)
class SampledToken:
    seq_id: int
    token: int
    logprobs: StepLogprobs | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """A completed step's tokens, one per sampling row, in ``ScheduledStep.samplers`` order."""

    step_id: int
    tokens: tuple[SampledToken, ...]
