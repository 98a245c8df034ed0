"""Continuous batching over a paged KV cache: admission, per-step token budget, chunked
prefill, prefix reuse, preemption, stop rules.

Between two forward passes the scheduler (on the event-loop thread) drops cancelled and expired
requests, plans adapter loads, admits waiting ones whose adapter is resident and whose blocks fit
(a request whose adapter is still loading waits without blocking the others), and plans the next
step: every decoding sequence contributes one token, and prompt chunks fill the rest of
``max_num_batched_tokens``.

Adapter-aware admission (``_plan_loads`` then ``_admit``). The LoRA pool has fewer slots than
there are adapters, so which waiting request may start a load decides whether loads evict each
other's work:

* A running or admitted sequence holds a lease (a reference on its adapter's slot) until it
  finishes, preempted or not: its adapter is never evicted. Preemption happens only when KV
  blocks run out (``_reserve``); nothing preempts to get an adapter.
* Every waiting request whose adapter is resident or loading *claims* it
  (``AdapterManager.claim``): a claimed slot is not evicted, so a completed load waits for the
  request it was made for, and a hit is not thrown out before it runs. The claim becomes the
  lease at admission, or goes when the request leaves (finish, cancel, deadline, error).
* Loads start in queue order: walking the queue from the head, each request whose adapter is
  absent starts its load while ``slots_for_loads`` (free slots plus slots that no running,
  admitted or waiting request uses or claims, less loads in flight still to reserve one) is
  positive; the first that finds none stops every load behind it. So at most as many loads are
  in flight as there are slots to give them, and a later request never takes the slot the
  head needs.
* Admission skips ahead: a request whose adapter is resident is admitted (rows and KV blocks
  permitting, first come first served) even while requests before it wait for their loads, so
  resident adapters fill the batch while the next ones load. Since every sequence of a step
  holds a lease, a step never holds more distinct adapters than there are slots.
* Aging bounds the skipping. A waiting request is *skipped* in a pass when it stays waiting
  for its adapter while a request behind it is admitted; after ``max_adapter_skips`` such
  passes (default 16) it is *aged*. The first aged request whose adapter is absent and finds no
  slot becomes the *barrier*, and one resident adapter is *drained* for it: the one with the
  fewest references, then the fewest waiting requests, among those that no request ahead of
  the barrier claims and no request anywhere claims for a load it waited for (pinned adapters
  never). Requests behind the barrier drop their claims on the drained adapter and may not
  acquire it; everything else keeps running and being admitted. No load starts behind the
  barrier (there is no slot to give). The drained adapter's sequences finish within their
  ``max_tokens``, its slot becomes evictable, and the barrier's load takes it in that pass,
  before anyone behind it. The drained adapter stays the same while the barrier does, and the
  requests ahead of the barrier only ever leave (new ones queue behind it; preempted ones
  come back to the head holding their lease), so an aged request is admitted within a bounded
  number of steps whatever keeps arriving (``tests/worker/test_adapter_scheduling.py`` checks
  this, and the invariants above, over random arrivals, load completions and cancellations).
  Draining is the one case where an adapter that a waiting request wants is evicted
  (``ManagerCounters.evictions_wanted``); a load a request waited for is never evicted
  before that request acquires it.

Steps overlap: the engine plans and launches step N+1 while step N still runs on the GPU.
A sequence therefore carries ``pending`` tokens: sampled on the device, not yet seen on the
host. Its next decode row reads that token from the device (the engine gathers it), and
everything the plan needs (positions, slots, lengths) follows from counts the host knows.

Threading contract. Every method of ``Scheduler`` runs on the engine's thread (the event
loop's), and the scheduler's state (its queues, every ``Sequence``, the block manager's
tables) changes only there. ``schedule`` emits a ``step_plan.ScheduledStep``: plain, immutable
data (sequence ids, input tokens or the device entry holding them, positions, block-table
growth, adapter slots, sampling rows) that the step launcher reads on its worker thread; the
launcher never sees a ``Sequence``. When the launch returns, the engine reports, still on its
own thread, where each sampling row sits in the step's output (``launched``), and when the step
completes, its ``step_plan.StepResult`` (``apply``); a step that failed goes to
``fail_step``. The scheduler therefore runs, and is tested, without an engine or a model:
drive it with ``schedule``, ``launched`` and recorded or synthetic results.

Logprobs (requests with ``SamplingParams.logprobs``) travel with the tokens: each applied token
gets a ``TokenLogprob`` whose ``text_offset`` is where its text starts in ``Sequence.text``. An
entry is released with the event that releases the text at its offset, so an entry never
precedes its text, and entries of tokens that a stop string cuts (offset at or past the cut)
are dropped with the text.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from adaptermesh.worker.adafuse import ExpertSet
from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.paging import BlockManager
from adaptermesh.worker.sampling import penalised
from adaptermesh.worker.step_plan import (
    BlockTableUpdate,
    SamplingRow,
    ScheduledStep,
    StepLogprobs,
    StepResult,
    StepRow,
)
from adaptermesh.worker.types import (
    AdapterLoadTimeoutError,
    AdapterNotFoundError,
    AdapterResolution,
    EngineError,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)

__all__ = ["Detokenizer", "Scheduler", "Sequence", "StepPlan"]

_ids = itertools.count(1)
_step_ids = itertools.count(1)


class Detokenizer:
    """Incremental detokenisation that never emits half of a multi-byte character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, tokens: list[int]) -> str:
        prefix = self.decode(tokens[self.prefix_offset : self.read_offset])
        full = self.decode(tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(tokens)
            return full[len(prefix) :]
        return ""

    def flush(self, tokens: list[int]) -> str:
        """Everything not yet returned, even an incomplete character (the sequence has ended)."""
        prefix = self.decode(tokens[self.prefix_offset : self.read_offset])
        full = self.decode(tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    queue: asyncio.Queue[TokenEvent | BaseException]
    detok: Detokenizer
    prompt: list[int]
    seed: int = 0  # counter-based sampling seed (the request's, or one drawn at submit)
    output: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_ids))
    table_row: int | None = None  # row of the engine's block-table mirror while admitted
    table_len: int = 0  # block-table entries already mirrored into that row
    lora_slot: int = -1
    cache_key: Hashable = None  # prefix-cache identity: (adapter, version) or the base model
    expert_set: ExpertSet | None = None  # held while running when the adapter is an expert set
    looked_up: bool = False
    # Waiting for an adapter: counted in AdapterManager.wanted; ``claim`` is 0 (none), 1 (a
    # claim on a resident adapter) or 2 (a claim on a load this request waited for, which an
    # aged request's barrier does not drop); ``skips`` counts passes it was skipped (aging).
    wanting: bool = False
    claim: int = 0
    skips: int = 0
    waited_on_load: bool = False  # its adapter was loading or absent at some pass
    # The first lookup's time and whether the adapter was resident on the GPU then; the
    # resolution rides on the sequence's first TokenEvent (then None).
    lookup_at: float = 0.0
    lookup_hit: bool = False
    # When it first waited on its adapter's load in flight (0: never); a request that waits
    # longer than the scheduler's ``adapter_load_wait_s`` fails with AdapterLoadTimeoutError.
    loading_since: float = 0.0
    resolution: AdapterResolution | None = None
    acquired: bool = False  # adapter lease taken (kept across preemption)
    num_computed: int = 0  # tokens whose KV is written or being written by a launched step
    reserved: int = 0  # tokens the block manager holds room for
    pending: int = 0  # tokens sampled by launched steps, not yet applied on the host
    last_entry: int = 0  # entry of the latest launched step that sampled for this sequence
    cancelled: bool = False
    finished: bool = False
    text: str = ""  # detokenised output so far, including text held back for stop matching
    emitted: int = 0  # characters of ``text`` already sent
    # Logprob entries of applied tokens not yet released (their text is held back).
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    # A constrained request's grammar position (worker/grammar.py RowMatcher): its ``mask``
    # limits the next token; each applied token advances it.
    matcher: Any = None
    # An adapter with its own tokenizer (adapter_text.py): its tokens' text for logprob
    # entries (None: the scheduler's), and end tokens beside the scheduler's.
    piece: Callable[[int], tuple[str, bytes]] | None = None
    stop_ids: frozenset[int] = frozenset()
    # Checks the request's token ids against its adapter's vocabulary once it has a slot
    # (set when that vocabulary was not known at submit): the error, or None.
    check_vocab: Callable[[int], BaseException | None] | None = None

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def context_len(self) -> int:
        """Tokens known on the host (prompt + applied output)."""
        return len(self.prompt) + len(self.output)

    @property
    def known_len(self) -> int:
        """Tokens the sequence has, counting those still on the device."""
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def in_decode(self) -> bool:
        return self.num_computed >= len(self.prompt)

    def token_at(self, pos: int) -> int:
        p = len(self.prompt)
        return self.prompt[pos] if pos < p else self.output[pos - p]


@dataclass(slots=True)
class StepPlan:
    """The scheduler's own record of one step (engine thread only; the launcher gets the
    ``ScheduledStep`` built from it): ``decode`` sequences contribute one row each (their
    last token), then each ``prefill`` entry (sequence, start position, number of tokens) a
    chunk. ``samplers``: the sequences that sample, once the step is launched."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]
    samplers: list[Sequence] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, _, n in self.prefill)

    def sequences(self) -> list[Sequence]:
        return [*self.decode, *(s for s, _, _ in self.prefill)]


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        adapters: AdapterManager,
        *,
        base_names: frozenset[str],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        max_prefill_seqs: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        on_admit: Callable[[Sequence], None] | None = None,
        token_piece: Callable[[int], tuple[str, bytes]] | None = None,
        max_adapter_skips: int = 16,
        adapter_load_wait_s: float | None = None,
    ) -> None:
        """``token_piece(id)``: a token's text and exact bytes, for logprob entries.
        ``max_adapter_skips``: passes a request may be skipped before it ages (module docstring).
        ``adapter_load_wait_s``: the longest a request waits on its adapter's load in flight
        before it fails with ``AdapterLoadTimeoutError`` (503; the load goes on); None: no
        bound."""
        self.blocks = blocks
        self.adapters = adapters
        self.base_names = base_names
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_prefill_seqs = max_prefill_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.token_piece = token_piece or (lambda t: (str(t), str(t).encode()))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.generated_tokens = 0
        self.preemptions = 0
        self.max_adapter_skips = max_adapter_skips
        self.adapter_load_wait_s = adapter_load_wait_s
        self.load_wait_timeouts = 0
        # Admissions of requests that waited on an adapter load; passes in which an aged request
        # was the barrier; passes that planned no step while a waiting request's load ran.
        self.admissions_waited_on_load = 0
        self.barrier_passes = 0
        self.idle_passes_on_load = 0
        self._barrier: Sequence | None = None
        self._drain: str | None = None  # the adapter drained for the barrier's load
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Steps emitted and not yet completed or failed, by step id.
        self._steps: dict[int, StepPlan] = {}

    def adapter_of(self, seq: Sequence) -> str | None:
        name = seq.adapter
        return None if name is None or name in self.base_names else name

    # ---- finishing ----------------------------------------------------------------------------

    def _release_blocks(self, seq: Sequence) -> None:
        if seq.table_row is not None:
            self.blocks.free(seq.seq_id)
            self._free_rows.append(seq.table_row)
            seq.table_row = None
            seq.table_len = 0
        seq.reserved = 0
        seq.num_computed = 0

    def _drop_claim(self, seq: Sequence) -> None:
        if seq.claim:
            self.adapters.unclaim(self.adapter_of(seq) or "")
            seq.claim = 0

    def _drop_interest(self, seq: Sequence) -> None:
        """The sequence no longer waits for its adapter (it acquired it, or it leaves)."""
        self._drop_claim(seq)
        if seq.wanting:
            self.adapters.unwant(self.adapter_of(seq) or "")
            seq.wanting = False

    def _release(self, seq: Sequence) -> None:
        self._drop_interest(seq)
        self._release_blocks(seq)
        if seq.lora_slot >= 0:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1
        if seq.expert_set is not None:
            self.adapters.release_expert_set(seq.expert_set)
            seq.expert_set = None
        seq.acquired = False

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: BaseException | None = None,
        last_token: int | None = None,
    ) -> None:
        """Free the sequence's resources and send its last event (or ``error``)."""
        if seq.finished:
            return
        seq.finished = True
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        if error is not None:
            seq.queue.put_nowait(error)
            return
        tail = seq.text[seq.emitted :]
        seq.emitted = len(seq.text)
        lps, seq.held_logprobs = tuple(seq.held_logprobs), []
        resolution, seq.resolution = seq.resolution, None
        seq.queue.put_nowait(
            TokenEvent(last_token, tail, reason, len(seq.prompt), len(seq.output), lps, resolution)
        )

    def fail_all(self, error: BaseException) -> None:
        for seq in [*self.running, *self.waiting]:
            self.finish(seq, "error", error)
        self.waiting.clear()
        # Steps in flight stay recorded: their results may still arrive and are applied to
        # finished sequences as no-ops.

    # ---- planning -----------------------------------------------------------------------------

    def _wants_step(self, seq: Sequence) -> bool:
        """Whether processing the sequence's next tokens is of use: a last token is processed
        only if the token it samples may still be delivered (max_tokens, context limit)."""
        left = seq.known_len - seq.num_computed
        if left != 1:
            return left > 1
        return (
            len(seq.output) + seq.pending < seq.request.sampling.max_tokens
            and seq.known_len < self.max_model_len
        )

    def schedule(self, *, allow_preempt: bool = True) -> ScheduledStep | None:
        """The next step's description, or None when nothing can run now.

        ``allow_preempt`` False (a step is still in flight): a sequence that needs a block
        when none is free sits this step out instead of preempting another sequence, since a
        preempted sequence must not have tokens on the device."""
        now = time.monotonic()
        for seq in [*self.running, *self.waiting]:
            dl = seq.request.deadline
            if seq.cancelled or (dl is not None and now > dl):
                self.finish(seq, "cancelled")
        self._expire_load_waits(now)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._admit()
        budget = self.max_num_batched_tokens
        decode: list[Sequence] = []
        chunks: list[Sequence] = []
        planned: set[int] = set()
        for seq in list(self.running):
            if seq.table_row is None or not self._wants_step(seq):  # finished or preempted above
                continue
            left = seq.known_len - seq.num_computed
            if left == 1:
                if budget <= 0 or not self._reserve(seq, 1, planned, allow_preempt):
                    continue
                decode.append(seq)
                planned.add(seq.seq_id)
                budget -= 1
            elif left > 1:
                chunks.append(seq)
        prefill: list[tuple[Sequence, int, int]] = []
        for seq in chunks:
            if budget <= 0 or len(prefill) >= self.max_prefill_seqs:
                break
            if seq.table_row is None:
                continue  # preempted to make room above
            n = min(seq.known_len - seq.num_computed, budget, self.max_prefill_chunk)
            if not self._reserve(seq, n, planned, allow_preempt):
                continue
            prefill.append((seq, seq.num_computed, n))
            planned.add(seq.seq_id)
            budget -= n
        decode = [s for s in decode if s.table_row is not None]
        prefill = [p for p in prefill if p[0].table_row is not None]
        if not decode and not prefill:
            if any(s.wanting and s.waited_on_load for s in self.waiting):
                self.idle_passes_on_load += 1
            return None
        plan = StepPlan(decode, prefill)
        step = self._describe(plan)
        self._steps[step.step_id] = plan
        return step

    # ---- the step description -----------------------------------------------------------------

    def _describe(self, plan: StepPlan) -> ScheduledStep:
        """The plain description of ``plan`` the launcher reads (module ``step_plan``)."""
        tables = tuple(
            update
            for update in (self._table_update(seq) for seq in plan.sequences())
            if update is not None
        )
        decode = tuple(self._row(seq, seq.num_computed, 1, True) for seq in plan.decode)
        prefill = tuple(
            self._row(seq, start, count, start + count >= seq.known_len)
            for seq, start, count in plan.prefill
        )
        return ScheduledStep(next(_step_ids), decode, prefill, tables)

    def _table_update(self, seq: Sequence) -> BlockTableUpdate | None:
        """The block-table entries of ``seq`` not yet in its row of the engine's mirror."""
        need = -(-seq.reserved // self.blocks.block_size)
        if seq.table_len >= need:
            return None
        assert seq.table_row is not None
        table = self.blocks.block_table(seq.seq_id)
        update = BlockTableUpdate(seq.table_row, seq.table_len, tuple(table[seq.table_len :]))
        seq.table_len = len(table)
        return update

    def _row(self, seq: Sequence, start: int, count: int, samples: bool) -> StepRow:
        assert seq.table_row is not None
        source_entry = -1
        if count == 1 and seq.pending:  # a decode row whose input is still on the device
            assert start == seq.known_len - 1
            token_ids: tuple[int, ...] = ()
            source_entry = seq.last_entry
        elif start + count <= len(seq.prompt):
            assert seq.pending == 0
            token_ids = tuple(seq.prompt[start : start + count])
        else:
            assert seq.pending == 0
            token_ids = tuple(seq.token_at(position) for position in range(start, start + count))
        return StepRow(
            seq_id=seq.seq_id,
            start=start,
            count=count,
            token_ids=token_ids,
            source_entry=source_entry,
            table_row=seq.table_row,
            lora_slot=seq.lora_slot,
            expert_set=seq.expert_set,
            sampler=self._sampling_row(seq) if samples else None,
        )

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        sampling = seq.request.sampling
        output: tuple[int, ...] = ()
        context: tuple[int, ...] = ()
        if penalised(sampling):  # rows without penalties read no counts (zero is a no-op)
            output = tuple(seq.output)
            if sampling.repetition_penalty != 1.0:
                context = (*seq.prompt, *seq.output)
        return SamplingRow(
            seq_id=seq.seq_id,
            request_id=seq.request.request_id,
            sampling=sampling,
            seed=seq.seed,
            # The draw's counter: the output tokens before it, counting those in flight and
            # this one (a preempted request that resumes draws with the same counters).
            counter=len(seq.output) + seq.pending + 1,
            output=output,
            context=context,
            matcher=seq.matcher,
        )

    def _reserve(self, seq: Sequence, n: int, planned: set[int], allow_preempt: bool) -> bool:
        """Room for ``n`` more tokens of ``seq`` from ``num_computed``; preempts the newest
        other running sequences (not already in this plan) when blocks run out."""
        need = seq.num_computed + n - seq.reserved
        if need <= 0:
            return True
        while not self.blocks.append_slots(seq.seq_id, need):
            if not allow_preempt:
                return False
            victim = next(
                (v for v in reversed(self.running) if v is not seq and v.seq_id not in planned),
                None,
            )
            if victim is None:
                self.preempt(seq)
                return False
            self.preempt(victim)
        seq.reserved += need
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give back a running sequence's blocks; it resumes first, recomputing its context
        (full blocks it registered may still be cached). The adapter lease is kept."""
        assert seq.pending == 0, "a sequence with tokens in flight cannot be preempted"
        self._release_blocks(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _plan_loads(self) -> None:
        """Claims and loads in queue order; the barrier and its drain (module docstring)."""
        adapters = self.adapters
        avail = adapters.slots_for_loads()
        barrier: Sequence | None = None
        # Resident adapters the barrier may not drain: claimed ahead of it, or claimed anywhere
        # for a load that a request waited for.
        held: set[str] = set()
        for seq in self.waiting:
            if seq.acquired or seq.finished:
                continue
            name = self.adapter_of(seq)
            if name is None:
                continue
            if not seq.looked_up:
                seq.looked_up = True
                seq.lookup_at = time.monotonic()
                seq.lookup_hit = adapters.note_lookup(name)
            if not seq.wanting:
                adapters.want(name)
                seq.wanting = True
            try:
                where = adapters.residency(name)
            except AdapterNotFoundError as e:
                self.finish(seq, "error", e)
                continue
            if where == "resident":
                if not seq.claim:
                    adapters.claim(name)
                    seq.claim = 1
                if barrier is None or seq.claim == 2:
                    held.add(name)
                continue
            seq.waited_on_load = True
            if where == "absent":
                if avail <= 0:  # no slot to give: nothing behind this request loads either
                    if barrier is None and seq.skips >= self.max_adapter_skips:
                        barrier = seq
                    continue
                adapters.start_load(name)
                avail -= 1
            if not seq.loading_since:
                seq.loading_since = time.monotonic()
            if not seq.claim:
                adapters.claim(name)
            seq.claim = 2
        drain: str | None = None
        if barrier is not None:
            self.barrier_passes += 1
            if (
                self._barrier is barrier
                and self._drain is not None
                and self._drain not in held
                and adapters.is_resident(self._drain)
            ):
                drain = self._drain  # keep draining the same adapter until it goes
            else:
                drain = adapters.drain_candidate(held)
            if drain is not None:
                for seq in self.waiting:
                    if seq.claim == 1 and not seq.acquired and self.adapter_of(seq) == drain:
                        self._drop_claim(seq)  # only requests behind the barrier claim it
            if adapters.slots_for_loads() > 0:  # the drained adapter is free to go now
                name = self.adapter_of(barrier)
                assert name is not None
                adapters.start_load(name)
                adapters.claim(name)
                barrier.claim = 2
                barrier = drain = None
        self._barrier = barrier
        self._drain = drain

    def _expire_load_waits(self, now: float) -> None:
        """Fail the waiting requests whose adapter load has run longer than
        ``adapter_load_wait_s`` since they began waiting on it (503 with Retry-After at the
        HTTP layer). The load is not cancelled: later requests find it in flight or done."""
        bound = self.adapter_load_wait_s
        if bound is None:
            return
        for seq in self.waiting:
            if seq.finished or seq.acquired or not seq.loading_since:
                continue
            if now - seq.loading_since < bound:
                continue
            name = self.adapter_of(seq)
            if name is None or self.adapters.is_resident(name):
                continue
            self.load_wait_timeouts += 1
            self.finish(seq, "error", AdapterLoadTimeoutError(name, bound))

    def next_load_wait_expiry(self) -> float | None:
        """Seconds until the next waiting request's load wait runs out (None: none waits on a
        load, or there is no bound): the engine's idle loop wakes then to answer it."""
        bound = self.adapter_load_wait_s
        if bound is None:
            return None
        starts = [
            s.loading_since
            for s in self.waiting
            if s.loading_since and not s.finished and not s.acquired
        ]
        if not starts:
            return None
        return max(0.0, min(starts) + bound - time.monotonic())

    def _admit(self) -> None:
        self._plan_loads()
        still: deque[Sequence] = deque()
        # Per sequence left waiting for its adapter: admissions so far when it was passed.
        passed: list[tuple[Sequence, int]] = []
        admitted = 0
        blocked = False
        behind_barrier = False
        while self.waiting:
            seq = self.waiting.popleft()
            if seq.finished:
                continue
            if seq is self._barrier:
                behind_barrier = True
            if blocked or not self._free_rows:
                still.append(seq)
                continue
            if not seq.acquired:
                name = self.adapter_of(seq)
                if name is not None:
                    if not self.adapters.is_resident(name) or (
                        behind_barrier and name == self._drain and seq.claim != 2
                    ):
                        still.append(seq)  # loading; later requests may still be admitted
                        passed.append((seq, admitted))
                        continue
                    got = self.adapters.try_acquire(name, load=False)
                    assert got is not None
                    self._drop_interest(seq)
                    if seq.waited_on_load:
                        self.admissions_waited_on_load += 1
                    seq.lora_slot = got.slot
                    seq.expert_set = got.expert_set
                    bad = seq.check_vocab(got.slot) if seq.check_vocab is not None else None
                    if bad is not None:
                        self.finish(seq, "error", bad)  # releases the lease
                        continue
                    seq.cache_key = (name, got.version)
                    hit = seq.lookup_hit
                    seq.resolution = AdapterResolution(
                        "gpu" if hit else got.source,
                        seq.lookup_at,
                        time.monotonic(),
                        0.0 if hit else got.load_s,
                        got.version,
                    )
                seq.acquired = True
            tokens = [*seq.prompt, *seq.output]
            # Keep one free block per running sequence so decoding rarely has to preempt.
            headroom = len(self.running) * self.blocks.block_size
            if not self.blocks.can_allocate(len(tokens) + headroom, seq.cache_key, tokens):
                still.append(seq)
                blocked = True  # first come, first served: later arrivals wait behind it
                continue
            cached = self.blocks.allocate(seq.seq_id, seq.cache_key, tokens)
            seq.reserved = len(tokens)
            seq.num_computed = cached
            seq.table_row = self._free_rows.pop()
            seq.table_len = 0
            self.running.append(seq)
            admitted += 1
        for seq, before in passed:
            if before < admitted:
                seq.skips += 1
        self.waiting = still

    # ---- applying a step's result -------------------------------------------------------------

    def launched(self, step: ScheduledStep, entries: tuple[int, ...] | list[int]) -> None:
        """The step was launched; ``entries``: where each of its sampling rows (in
        ``step.samplers`` order) sits in the step's token output, which the next step's decode
        rows read while the token is still on the device. Advances the counts."""
        plan = self._steps[step.step_id]
        samplers: list[Sequence] = []
        for seq in plan.decode:
            seq.num_computed += 1
            seq.pending += 1
            samplers.append(seq)
        for seq, start, n in plan.prefill:
            seq.num_computed = start + n
            if seq.num_computed >= seq.known_len:
                seq.pending += 1
                samplers.append(seq)
        if len(entries) != len(samplers):
            raise ValueError(f"{len(entries)} output entries for {len(samplers)} sampling rows")
        for seq, entry in zip(samplers, entries, strict=True):
            seq.last_entry = entry
        plan.samplers = samplers
        # Full blocks whose tokens the host knows can be shared from now on: a later step that
        # reads them runs after this one on the same stream.
        for seq in plan.sequences():
            self.blocks.commit(seq.seq_id, _TokenView(seq, min(seq.num_computed, seq.context_len)))

    def apply(self, result: StepResult) -> None:
        """Deliver a completed step's tokens (and, for rows whose request asked, logprobs)."""
        plan = self._steps.get(result.step_id)
        if plan is None or plan.samplers is None:
            raise ValueError(f"step {result.step_id} is not a launched step in flight")
        samplers = plan.samplers
        ids = [seq.seq_id for seq in samplers]
        if [t.seq_id for t in result.tokens] != ids:
            raise ValueError(f"step {result.step_id}'s result is not for its sampling rows {ids}")
        del self._steps[result.step_id]
        for seq, sampled in zip(samplers, result.tokens, strict=True):
            seq.pending -= 1
            if seq.finished:
                continue
            self._append_token(seq, sampled.token, sampled.logprobs)

    def fail_step(self, step_id: int, error: BaseException) -> None:
        """A step that failed (at launch or on the device): its requests fail with ``error``
        named, the blocks it was writing leave the prefix cache, and the rest keeps serving."""
        plan = self._steps.pop(step_id, None)
        if plan is None:
            return
        for seq in plan.samplers or ():
            seq.pending -= 1
        for seq in plan.sequences():
            self.finish(seq, "error", EngineError(f"step failed: {error}"))
        # Blocks the failed step was writing may have been registered for sharing.
        self.blocks.reset_prefix_cache()

    def in_flight(self) -> int:
        """Steps emitted and not yet completed or failed."""
        return len(self._steps)

    def _entry(self, seq: Sequence, tok: int, lp: StepLogprobs, offset: int) -> TokenLogprob:
        piece = seq.piece or self.token_piece
        text, raw = piece(tok)
        top = tuple(
            TopLogprob(t, *piece(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        )
        return TokenLogprob(tok, text, raw, lp.logprob, offset, top)

    def _append_token(self, seq: Sequence, tok: int, lp: StepLogprobs | None = None) -> None:
        seq.output.append(tok)
        self.generated_tokens += 1
        sp = seq.request.sampling
        if seq.cancelled:
            self.finish(seq, "cancelled")
            return
        if lp is not None:
            seq.held_logprobs.append(self._entry(seq, tok, lp, len(seq.text)))
        if tok in self.eos_token_ids or tok in seq.stop_ids:
            self.finish(seq, "stop", last_token=tok)
            return
        # A constrained output whose grammar is complete, with nothing but a stop token left
        # to sample, is finished now (no step is spent on the stop token).
        complete = False
        if seq.matcher is not None:
            if not seq.matcher.advance(tok):
                self.finish(
                    seq, "error", EngineError(f"token {tok} left the request's output grammar")
                )
                return
            complete = seq.matcher.only_stop_left
        at_limit = (
            complete or len(seq.output) >= sp.max_tokens or seq.context_len >= self.max_model_len
        )
        seq.text += seq.detok.flush(seq.output) if at_limit else seq.detok.step(seq.output)
        reason: FinishReason | None = None
        if sp.stop:
            start = max(0, seq.emitted - max(len(s) for s in sp.stop))
            hits = [i for i in (seq.text.find(s, start) for s in sp.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                reason = "stop"
                # Tokens whose text starts at or past the cut are cut with it.
                cut = len(seq.text)
                seq.held_logprobs = [e for e in seq.held_logprobs if e.text_offset < cut]
        if reason is None and at_limit:
            reason = "stop" if complete else "length"
        if reason is not None:
            self.finish(seq, reason, last_token=tok)
            return
        visible = len(seq.text) - _held_back(seq.text, sp.stop)
        delta = seq.text[seq.emitted : visible] if visible > seq.emitted else ""
        seq.emitted = max(seq.emitted, visible)
        released: tuple[TokenLogprob, ...] = ()
        if seq.held_logprobs:
            held = seq.held_logprobs
            # Without stop strings nothing can be cut: release every entry at once.
            k = (
                len(held)
                if not sp.stop
                else next(
                    (i for i, e in enumerate(held) if e.text_offset >= seq.emitted), len(held)
                )
            )
            released, seq.held_logprobs = tuple(held[:k]), held[k:]
        resolution, seq.resolution = seq.resolution, None
        seq.queue.put_nowait(
            TokenEvent(tok, delta, None, len(seq.prompt), len(seq.output), released, resolution)
        )


class _TokenView:
    """The first ``n`` known tokens of a sequence as a read-only sequence, without copying
    prompt + output on every step (the block manager reads only blocks that just filled)."""

    __slots__ = ("_n", "_seq")

    def __init__(self, seq: Sequence, n: int) -> None:
        self._seq = seq
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self._seq.token_at(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._seq.token_at(i)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could still become the start of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StreamClosedError(EngineError):
    """The engine shut down while the request was running."""
