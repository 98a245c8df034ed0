"""The scheduler on its own: no engine, no model, no adapter manager in use (base-model
requests only). It emits plain step descriptions and is driven with synthetic or recorded
step results, as the engine drives it on its thread."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.paging import BlockManager
from adaptermesh.worker.scheduler import Detokenizer, Scheduler, Sequence
from adaptermesh.worker.step_plan import (
    BlockTableUpdate,
    SampledToken,
    SamplingRow,
    ScheduledStep,
    StepLogprobs,
    StepResult,
    StepRow,
)
from adaptermesh.worker.types import EngineError, GenerationRequest, SamplingParams, TokenEvent

BLOCK = 4
EOS = 0


class NoAdapters:
    """Base-model requests never reach the adapter manager beyond asking for free load
    slots: any other use is a failure."""

    def slots_for_loads(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the scheduler used the adapter manager ({name}) for base requests")


def make_scheduler(
    *,
    num_blocks: int = 64,
    rows: int = 4,
    step_tokens: int = 32,
    chunk: int = 8,
    prefill_seqs: int = 2,
    max_model_len: int = 64,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BLOCK, enable_prefix_caching=False),
        cast(AdapterManager, NoAdapters()),
        base_names=frozenset({"base"}),
        max_num_seqs=rows,
        max_num_batched_tokens=step_tokens,
        max_prefill_chunk=chunk,
        max_prefill_seqs=prefill_seqs,
        max_model_len=max_model_len,
        eos_token_ids=frozenset({EOS}),
    )


def submit(scheduler: Scheduler, prompt: list[int], rid: str = "r", **sampling: Any) -> Sequence:
    request = GenerationRequest(rid, tuple(prompt), None, SamplingParams(**sampling))
    seq = Sequence(
        request=request,
        queue=asyncio.Queue(),
        detok=Detokenizer(lambda ids: "".join(chr(97 + t % 26) for t in ids)),
        prompt=list(prompt),
    )
    scheduler.waiting.append(seq)
    return seq


def launch(scheduler: Scheduler, step: ScheduledStep) -> None:
    """What the launcher reports for an eager step: samplers at their row's entry."""
    scheduler.launched(step, [i for i, row in enumerate(step.rows) if row.sampler is not None])


def result(step: ScheduledStep, tokens: list[int]) -> StepResult:
    return StepResult(
        step.step_id,
        tuple(SampledToken(row.seq_id, t) for row, t in zip(step.samplers, tokens, strict=True)),
    )


def events(seq: Sequence) -> list[TokenEvent | BaseException]:
    out = []
    while not seq.queue.empty():
        out.append(seq.queue.get_nowait())
    return out


def _walk(value: Any) -> list[Any]:
    """Every value reachable from ``value`` through dataclass fields and tuples."""
    out = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name in ("sampling", "matcher", "expert_set"):
                continue  # the request's settings and live non-scheduler objects
            out += _walk(getattr(value, f.name))
    elif isinstance(value, tuple):
        for item in value:
            out += _walk(item)
    return out


def test_a_step_description_is_plain_immutable_data() -> None:
    scheduler = make_scheduler()
    seq = submit(scheduler, [5, 6, 7, 8, 9], max_tokens=3)
    step = scheduler.schedule()
    assert step is not None
    for value in _walk(step):
        assert not isinstance(value, Sequence | Scheduler | BlockManager), value
        assert isinstance(
            value, int | str | tuple | ScheduledStep | StepRow | SamplingRow | BlockTableUpdate
        ), value
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.decode = ()  # type: ignore[misc]
    (row,) = step.prefill
    assert (row.seq_id, row.start, row.count, row.token_ids) == (seq.seq_id, 0, 5, (5, 6, 7, 8, 9))
    assert row.sampler is not None
    assert row.sampler.counter == 1
    # The blocks the row writes are named in the step: two of four tokens each.
    (update,) = step.tables
    assert (update.table_row, update.first, len(update.blocks)) == (seq.table_row, 0, 2)
    # Nothing changed the sequence's counts yet: only the launch report does.
    assert (seq.num_computed, seq.pending) == (0, 0)


def test_chunks_then_overlapped_decode_rows_read_the_device_entry() -> None:
    scheduler = make_scheduler(chunk=4, step_tokens=4)
    seq = submit(scheduler, list(range(1, 11)), max_tokens=3)  # 10 prompt tokens
    chunks = []
    for _ in range(3):
        step = scheduler.schedule()
        assert step is not None
        assert not step.decode
        chunks.append(step.prefill[0])
        launch(scheduler, step)
        scheduler.apply(result(step, [42] * len(step.samplers)))
    assert [(c.start, c.count, c.sampler is not None) for c in chunks] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, True),
    ]
    assert [e.token_id for e in events(seq) if isinstance(e, TokenEvent)] == [42]
    # Overlap: the next step is launched before this one's token is known on the host.
    first = scheduler.schedule()
    assert first is not None
    (row,) = first.decode
    assert (row.start, row.token_ids, row.source_entry) == (10, (42,), -1)
    launch(scheduler, first)
    second = scheduler.schedule(allow_preempt=False)
    assert second is not None
    (row,) = second.decode
    assert (row.start, row.token_ids, row.source_entry) == (11, (), 0)
    assert row.sampler is not None
    assert row.sampler.counter == 3
    launch(scheduler, second)
    assert seq.pending == 2
    scheduler.apply(result(first, [7]))
    scheduler.apply(result(second, [8]))
    got = events(seq)
    assert [e.token_id for e in got if isinstance(e, TokenEvent)] == [7, 8]
    last = got[-1]
    assert isinstance(last, TokenEvent)
    assert last.finish_reason == "length"
    assert scheduler.blocks.num_free() == 64 - 1  # every block back (block 0 is the null one)
    assert scheduler.in_flight() == 0


def test_a_result_for_other_rows_is_refused_and_changes_nothing() -> None:
    scheduler = make_scheduler()
    seq = submit(scheduler, [3, 4, 5], max_tokens=4)
    step = scheduler.schedule()
    assert step is not None
    with pytest.raises(ValueError, match="not a launched step"):
        scheduler.apply(result(step, [9]))  # not launched yet
    launch(scheduler, step)
    with pytest.raises(ValueError, match="not for its sampling rows"):
        scheduler.apply(StepResult(step.step_id, (SampledToken(seq.seq_id + 1, 9),)))
    assert (seq.output, seq.pending) == ([], 1)
    scheduler.apply(result(step, [9]))
    assert seq.output == [9]


def test_recorded_results_drive_stop_rules_and_logprobs() -> None:
    scheduler = make_scheduler()
    seq = submit(scheduler, [1, 2, 3], max_tokens=10, logprobs=1)
    recorded = [5, 6, EOS, 9]
    delivered = []
    while True:
        step = scheduler.schedule()
        if step is None:
            break
        launch(scheduler, step)
        token = recorded[len(delivered)]
        delivered.append(token)
        lp = StepLogprobs(-0.5, [token], [-0.5])
        scheduler.apply(
            StepResult(step.step_id, (SampledToken(step.samplers[0].seq_id, token, lp),))
        )
    assert delivered == [5, 6, EOS]  # the stop token ends it: no step after
    got = [e for e in events(seq) if isinstance(e, TokenEvent)]
    assert [e.token_id for e in got] == [5, 6, EOS]
    assert got[-1].finish_reason == "stop"
    assert [lp.logprob for e in got for lp in e.logprobs] == [-0.5, -0.5, -0.5]


def test_a_resumed_sequence_recomputes_prompt_and_output() -> None:
    scheduler = make_scheduler()
    seq = submit(scheduler, [1, 2, 3], max_tokens=8)
    for token in (7, 8):
        step = scheduler.schedule()
        assert step is not None
        launch(scheduler, step)
        scheduler.apply(result(step, [token]))
    scheduler.preempt(seq)
    step = scheduler.schedule()
    assert step is not None
    (row,) = step.prefill
    assert (row.start, row.count, row.token_ids) == (0, 5, (1, 2, 3, 7, 8))
    assert row.sampler is not None
    assert row.sampler.counter == 3


def test_penalised_rows_carry_their_tokens_and_others_do_not() -> None:
    scheduler = make_scheduler(prefill_seqs=3)
    plain = submit(scheduler, [1, 2], "plain", max_tokens=4)
    freq = submit(scheduler, [3, 4], "freq", max_tokens=4, frequency_penalty=0.5)
    rep = submit(scheduler, [5, 6], "rep", max_tokens=4, repetition_penalty=1.2)
    step = scheduler.schedule()
    assert step is not None
    launch(scheduler, step)
    scheduler.apply(result(step, [10, 11, 12]))
    step = scheduler.schedule()
    assert step is not None
    rows = {row.sampler.request_id: row.sampler for row in step.decode if row.sampler}
    assert (rows["plain"].output, rows["plain"].context) == ((), ())
    assert (rows["freq"].output, rows["freq"].context) == ((11,), ())
    assert (rows["rep"].output, rows["rep"].context) == ((12,), (5, 6, 12))
    assert {plain.seq_id, freq.seq_id, rep.seq_id} == set(rows[k].seq_id for k in rows)


def test_a_failed_step_fails_its_requests_and_frees_their_blocks() -> None:
    scheduler = make_scheduler()
    a = submit(scheduler, [1, 2, 3], "a", max_tokens=4)
    b = submit(scheduler, [4, 5], "b", max_tokens=4)
    step = scheduler.schedule()
    assert step is not None
    launch(scheduler, step)
    scheduler.fail_step(step.step_id, RuntimeError("CUDA error: boom"))
    for seq in (a, b):
        (error,) = events(seq)
        assert isinstance(error, EngineError)
        assert "step failed: CUDA error: boom" in str(error)
        assert seq.finished
        assert seq.pending == 0
    assert scheduler.blocks.num_free() == 63
    assert scheduler.in_flight() == 0
    assert not scheduler.running
    assert scheduler.schedule() is None


def test_a_result_after_shutdown_is_a_no_op() -> None:
    scheduler = make_scheduler()
    seq = submit(scheduler, [1, 2, 3], max_tokens=4)
    step = scheduler.schedule()
    assert step is not None
    launch(scheduler, step)
    scheduler.fail_all(EngineError("engine is shutting down"))
    scheduler.apply(result(step, [5]))  # the step completed on the device meanwhile
    assert seq.finished
    assert seq.output == []
    assert seq.pending == 0
    assert scheduler.in_flight() == 0


# ---- random admissions, finishes and overlap keep the accounting consistent ---------------

_STEP = st.tuples(st.just("step"), st.integers(0, 3), st.just(0))
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 19), st.integers(1, 16)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
        _STEP,
        _STEP,
        _STEP,
        st.tuples(st.just("settle"), st.just(0), st.just(0)),
    ),
    min_size=20,
    max_size=150,
)


def _check_accounting(scheduler: Scheduler, total_blocks: int) -> None:
    blocks = scheduler.blocks
    running = scheduler.running
    held = sum(len(blocks.block_table(s.seq_id)) for s in running if s.seq_id in blocks)
    assert blocks.num_free() + held == total_blocks - 1  # block 0 is never handed out
    rows = [s.table_row for s in running]
    assert None not in rows
    assert len(set(rows)) == len(rows)
    assert len(rows) + len(scheduler._free_rows) == scheduler.max_num_seqs
    for seq in running:
        assert seq.reserved <= len(blocks.block_table(seq.seq_id)) * BLOCK
        assert seq.num_computed <= seq.reserved
        assert 0 <= seq.pending <= 2
    for seq in scheduler.waiting:
        assert seq.table_row is None
        assert seq.pending == 0


@settings(max_examples=100, deadline=None)
@given(ACTIONS, st.integers(6, 16))
def test_random_traffic_keeps_block_accounting_consistent(
    actions: list[tuple[str, int, int]], num_blocks: int
) -> None:
    # The cache holds one sequence of max_model_len, as the engine's budget guarantees.
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        rows=3,
        step_tokens=12,
        chunk=5,
        max_model_len=(num_blocks - 1) * BLOCK,
    )
    submitted: list[Sequence] = []
    in_flight: list[ScheduledStep] = []  # launched, tokens not yet applied (at most one)
    token = 1

    def complete_one() -> None:
        nonlocal token
        step = in_flight.pop(0)
        scheduler.apply(result(step, [token + i for i in range(len(step.samplers))]))
        token += len(step.samplers)

    for kind, a, b in actions:
        if kind == "submit":
            submitted.append(submit(scheduler, [1 + (a + i) % 50 for i in range(a)], max_tokens=b))
        elif kind == "cancel" and submitted:
            submitted[a % len(submitted)].cancelled = True
        elif kind == "step":
            # Overlap as the engine does: at most one step in flight, no preemption then.
            if len(in_flight) > 1 or (in_flight and a == 0):
                complete_one()
            step = scheduler.schedule(allow_preempt=not in_flight)
            if step is not None:
                launch(scheduler, step)
                in_flight.append(step)
        elif kind == "settle":
            while in_flight:
                complete_one()
        _check_accounting(scheduler, num_blocks)
    # Drain: everything finishes, and every block and row comes back.
    for _ in range(500):
        while in_flight:
            complete_one()
        step = scheduler.schedule()
        if step is None:
            break
        launch(scheduler, step)
        in_flight.append(step)
        _check_accounting(scheduler, num_blocks)
    while in_flight:
        complete_one()
    assert scheduler.schedule() is None
    for seq in submitted:
        assert seq.finished, seq
        assert seq.pending == 0
        assert len(seq.output) <= seq.request.sampling.max_tokens
    assert scheduler.blocks.num_free() == num_blocks - 1
    assert not scheduler.running
    assert not scheduler.waiting
    assert scheduler.in_flight() == 0


# ---- replaying an engine's recorded steps -------------------------------------------------


def _normalised(step: ScheduledStep, index: dict[int, int]) -> Any:
    """A step with sequence ids replaced by submission order (ids are process-wide)."""

    def row(r: StepRow) -> Any:
        sampler = None
        if r.sampler is not None:
            s = r.sampler
            sampler = (index[s.seq_id], s.request_id, s.seed, s.counter, s.output, s.context)
        return (
            index[r.seq_id],
            r.start,
            r.count,
            r.token_ids,
            r.source_entry,
            r.lora_slot,
            sampler,
        )

    tables = [(u.first, len(u.blocks)) for u in step.tables]
    return [row(r) for r in step.decode], [row(r) for r in step.prefill], tables


async def test_a_scheduler_alone_replays_an_engines_recorded_results(
    tiny: Any, make_engine: Any
) -> None:
    """Record the steps, launch reports and results an engine's scheduler saw; a fresh
    scheduler fed the same requests and the recorded results emits the same steps and the
    same events, without a model."""
    from .conftest import PROMPTS, collect, request

    eng = make_engine(max_num_seqs=3, max_prefill_chunk=5, max_num_batched_tokens=8)
    recorded: list[tuple[ScheduledStep, list[int], StepResult | None]] = []
    real = eng.scheduler
    schedule, launched, apply = real.schedule, real.launched, real.apply

    def record_schedule(**kw: Any) -> ScheduledStep | None:
        step = schedule(**kw)
        if step is not None:
            recorded.append((step, [], None))
        return step

    def record_launched(step: ScheduledStep, entries: list[int]) -> None:
        recorded[-1] = (step, list(entries), None)
        launched(step, entries)

    def record_apply(result: StepResult) -> None:
        at = next(i for i, (s, _, _) in enumerate(recorded) if s.step_id == result.step_id)
        recorded[at] = (recorded[at][0], recorded[at][1], result)
        apply(result)

    real.schedule, real.launched, real.apply = record_schedule, record_launched, record_apply
    sampling = [
        {"max_tokens": 6},
        {"max_tokens": 4, "temperature": 0.8},
        {"max_tokens": 7, "frequency_penalty": 0.5},
        {"max_tokens": 5, "stop": ("e",)},
    ]
    prompts = [tiny.encode(PROMPTS[i % len(PROMPTS)]) for i in range(len(sampling))]
    streams = [
        eng.submit(request(f"r{i}", ids, None, seed=11 + i, **kw))
        for i, (ids, kw) in enumerate(zip(prompts, sampling, strict=True))
    ]
    # The engine's sequences, in submission order (its loop has not run yet).
    engine_ids = {seq.seq_id: i for i, seq in enumerate(real.waiting)}
    assert len(engine_ids) == len(sampling)
    want = [await collect(s) for s in streams]
    assert len(recorded) > 4

    scheduler = Scheduler(
        BlockManager(eng.blocks.num_blocks, real.blocks.block_size, enable_prefix_caching=True),
        cast(AdapterManager, NoAdapters()),
        base_names=real.base_names,
        max_num_seqs=real.max_num_seqs,
        max_num_batched_tokens=real.max_num_batched_tokens,
        max_prefill_chunk=real.max_prefill_chunk,
        max_prefill_seqs=real.max_prefill_seqs,
        max_model_len=real.max_model_len,
        eos_token_ids=real.eos_token_ids,
        token_piece=real.token_piece,
    )
    seqs = []
    for i, (ids, kw) in enumerate(zip(prompts, sampling, strict=True)):
        req = request(f"r{i}", ids, None, seed=11 + i, **kw)
        seq = Sequence(
            request=req,
            queue=asyncio.Queue(),
            detok=Detokenizer(eng.text.decode_for_stream),
            prompt=list(ids),
            seed=11 + i,
        )
        scheduler.waiting.append(seq)
        seqs.append(seq)
    for n, (step, entries, result) in enumerate(recorded):
        mine = scheduler.schedule(allow_preempt=True)
        assert mine is not None, n
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        ours = _normalised(mine, index)
        theirs = _normalised(step, engine_ids)
        assert ours == theirs, n
        scheduler.launched(mine, entries)
        assert result is not None
        mapped = tuple(
            SampledToken(seqs[engine_ids[t.seq_id]].seq_id, t.token, t.logprobs)
            for t in result.tokens
        )
        scheduler.apply(StepResult(mine.step_id, mapped))
    assert scheduler.schedule() is None
    for seq, events in zip(seqs, want, strict=True):
        got = [e for e in events_of(seq)]
        assert [(e.token_id, e.text, e.finish_reason) for e in got] == [
            (e.token_id, e.text, e.finish_reason) for e in events
        ]


def events_of(seq: Sequence) -> list[TokenEvent]:
    out = []
    while not seq.queue.empty():
        item = seq.queue.get_nowait()
        assert isinstance(item, TokenEvent)
        out.append(item)
    return out
