"""The AdaFuse merge policy with stand-in expert sets (no model, no kernels): which steps are a
single expert-set token, when a selection merges, when the backbone is restored, and the
counters the engine reports."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from adaptermesh.worker.adafuse_policy import MergePolicy, single_expert_token
from adaptermesh.worker.engine_config import EngineConfig
from adaptermesh.worker.scheduler import Detokenizer, Sequence
from adaptermesh.worker.step_plan import ScheduledStep, StepRow
from adaptermesh.worker.types import GenerationRequest

Selection = tuple[tuple[int, ...], tuple[float, ...]]


class FakeExpertSet:
    """Routes token t to expert ``t // 10`` and records merges."""

    def __init__(self) -> None:
        self.merged: list[Selection] = []
        self.unmerges = 0
        self.solo_calls: list[tuple[int, int, Selection, Selection | None]] = []

    def selection(self, token: int) -> Selection:
        return (token // 10,), (1.0,)

    def merge(self, selection: Selection) -> None:
        self.merged.append(selection)

    def unmerge(self) -> None:
        self.unmerges += 1

    def solo_rows(
        self, rows: int, row: int, selection: Selection, held: Selection | None
    ) -> torch.Tensor:
        self.solo_calls.append((rows, row, selection, held))
        return torch.zeros(2, rows, dtype=torch.int32)


def make_seq(prompt: list[int], expert_set: Any = None, computed: int | None = None) -> Sequence:
    request = GenerationRequest("r", tuple(prompt))
    seq = Sequence(
        request=request,
        queue=asyncio.Queue(),
        detok=Detokenizer(lambda ids: ""),
        prompt=list(prompt),
    )
    seq.expert_set = expert_set
    seq.num_computed = len(prompt) - 1 if computed is None else computed
    return seq


def row(seq: Sequence, start: int, count: int) -> StepRow:
    tokens = tuple(seq.token_at(p) for p in range(start, start + count))
    return StepRow(seq.seq_id, start, count, tokens, -1, 0, -1, seq.expert_set)


def step_of(
    decode: list[Sequence],
    prefill: list[tuple[Sequence, int, int]] = (),  # type: ignore[assignment]
) -> ScheduledStep:
    """The scheduler's description of a step over these sequences (a decode row at each
    one's ``num_computed``, then the chunks)."""
    return ScheduledStep(
        1,
        tuple(row(seq, seq.num_computed, 1) for seq in decode),
        tuple(row(seq, start, count) for seq, start, count in prefill),
    )


def decode_plan(seq: Sequence) -> ScheduledStep:
    return step_of([seq])


def policy(merge_after: int) -> MergePolicy:
    return MergePolicy(model=object(), config=EngineConfig(adafuse_merge_after=merge_after))  # type: ignore[arg-type]


def test_single_expert_token() -> None:
    experts = FakeExpertSet()
    seq = make_seq([5, 17, 23], experts)
    solo = single_expert_token(decode_plan(seq))
    assert solo is not None
    assert (solo.seq_id, solo.expert_set, solo.token, solo.rows, solo.row) == (
        seq.seq_id,
        experts,
        23,
        1,
        0,
    )
    # A one-token prompt chunk is one too; its token is the chunk's.
    chunk = single_expert_token(step_of([], [(seq, 1, 1)]))
    assert chunk is not None
    assert chunk.token == 17
    assert single_expert_token(step_of([], [(seq, 0, 2)])) is None
    assert single_expert_token(decode_plan(make_seq([1, 2]))) is None  # no expert set
    other = make_seq([1, 2], experts)
    assert single_expert_token(step_of([seq, other])) is None


def test_merges_after_the_selection_repeats() -> None:
    experts = FakeExpertSet()
    merge_policy = policy(3)
    seq = make_seq([10, 11, 12, 13, 14], experts)
    decisions = []
    for position in range(5):
        seq.num_computed = position
        decisions.append(merge_policy.prepare_step(decode_plan(seq)))
    # Tokens 10..14 all select expert 1: two gated tokens, the third merges, then merged.
    assert [d.selection is None for d in decisions] == [False, False, True, True, True]
    assert [d.gated_set is experts for d in decisions] == [True, True, False, False, False]
    assert experts.merged == [((1,), (1.0,))]
    assert merge_policy.merged is experts
    assert merge_policy.merged_owner == seq.seq_id
    assert (merge_policy.merges, merge_policy.merged_steps, merge_policy.solo_gated_steps) == (
        1,
        3,
        2,
    )
    assert merge_policy.compensated_steps == 0


def test_a_new_selection_runs_gated_over_the_merged_one() -> None:
    experts = FakeExpertSet()
    merge_policy = policy(2)
    seq = make_seq([10, 11, 25, 26, 27], experts)
    for position in range(3):
        seq.num_computed = position
        merge_policy.prepare_step(decode_plan(seq))
    assert experts.merged == [((1,), (1.0,))]
    assert experts.solo_calls[-1] == (
        1,
        0,
        ((2,), (1.0,)),
        ((1,), (1.0,)),
    )  # cancels the held selection
    assert merge_policy.compensated_steps == 1
    seq.num_computed = 3
    merge_policy.prepare_step(decode_plan(seq))  # expert 2 repeated: merges it (exact, from W0)
    assert experts.merged == [((1,), (1.0,)), ((2,), (1.0,))]
    assert experts.unmerges == 0


def test_never_merges_with_merge_after_zero() -> None:
    experts = FakeExpertSet()
    merge_policy = policy(0)
    seq = make_seq([10] * 9, experts)
    for position in range(8):
        seq.num_computed = position
        assert merge_policy.prepare_step(decode_plan(seq)).selection is not None
    assert experts.merged == []
    assert merge_policy.solo_gated_steps == 8


def test_merge_after_is_read_at_each_decision() -> None:
    experts = FakeExpertSet()
    merge_policy = policy(0)
    seq = make_seq([10] * 4, experts)
    merge_policy.prepare_step(decode_plan(seq))
    merge_policy.config.adafuse_merge_after = 1
    assert merge_policy.prepare_step(decode_plan(seq)).selection is None
    assert merge_policy.merges == 1


def test_any_other_step_restores_the_backbone() -> None:
    experts = FakeExpertSet()
    merge_policy = policy(1)
    owner = make_seq([10, 11], experts)
    assert merge_policy.prepare_step(decode_plan(owner)).selection is None
    assert merge_policy.merged is experts
    # Another request with the same set: restored first, then its own decision (merges again).
    other = make_seq([10, 11], experts)
    merge_policy.prepare_step(decode_plan(other))
    assert experts.unmerges == 1
    assert merge_policy.merged_owner == other.seq_id
    # A base-model step: restored, and the streak ends.
    merge_policy.prepare_step(decode_plan(make_seq([1, 2])))
    assert experts.unmerges == 2
    assert merge_policy.merged is None
    assert merge_policy.streak is None
    assert merge_policy.restores == 2
    merge_policy.restore_backbone()  # nothing merged: nothing to do
    assert merge_policy.restores == 2


def test_gated_batch_maps_rows_to_sets() -> None:
    first, second = FakeExpertSet(), FakeExpertSet()
    decode_a = make_seq([1, 2], first)
    decode_base = make_seq([1, 2])
    chunk_b = make_seq([1, 2, 3, 4], second)
    chunk_a = make_seq([1, 2, 3], first)
    plan = step_of([decode_a, decode_base], [(chunk_b, 0, 4), (chunk_a, 0, 3)])
    ranges = [(0, 1), (1, 1), (2, 4), (6, 3)]
    config = type(
        "Config",
        (),
        {
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 4,
        },
    )()
    merge_policy = policy(4)
    batch = merge_policy.gated_batch(plan, ranges, 10, torch.device("cpu"), config)  # type: ignore[arg-type]
    assert batch.sets == [first, second]
    assert batch.token_set.tolist() == [0, -1, 1, 1, 1, 1, 0, 0, 0, -1]
    assert merge_policy.gated_steps == 1
    batch = merge_policy.gated_batch(plan, ranges, 9, torch.device("cpu"), config)  # type: ignore[arg-type]
    assert batch.token_set.shape == (9,)
    assert merge_policy.gated_steps == 2
