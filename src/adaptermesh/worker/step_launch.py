"""Launching one step on the device: its traits and layout, the input staging, the eager
path (or a replay of the step's CUDA graph, ``graph_runner.py``), and the step's single
device-to-host output copy.

``StepLauncher.launch`` runs on a worker thread on CUDA. In order: the AdaFuse merge policy
prepares the step (``adafuse_policy``), the step's traits pick its layout (``step_layout``), a
graph is found or captured for that layout (or the step runs eagerly), the inputs are staged
on the host and copied with one transfer, the step runs (graph replay, or forward and sampling
eagerly), and the sampled ids (with logprobs when some row asked) are copied back in one
asynchronous copy. The host learns them from the returned ``InFlight``.

Threading contract: the launcher is handed only the scheduler's plain step description
(``step_plan.ScheduledStep``) and never imports, reads or changes the scheduler or the adapter
manager. What it learns for the host goes back as plain data: ``InFlight.entries`` (where each
sampling row sits in the step's output) and ``InFlight.wait``'s ``StepResult``, which the
engine applies to the scheduler on its own thread.

Each graph is the whole step: input gather, forward, sampling (greedy or random variant), and
the write of the sampled ids. A base-only variant (no adapter row in the step) has no LoRA
launch at all.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from adaptermesh.worker import lora_ops
from adaptermesh.worker.adafuse import ExpertSet, GatedTerms, SoloGated
from adaptermesh.worker.adafuse_policy import MergePolicy, SoloDecision
from adaptermesh.worker.engine_config import EngineBudget, EngineConfig
from adaptermesh.worker.grammar import apply_bitmask, bitmask_words, fill_masks
from adaptermesh.worker.graph_runner import GraphRunner, StepGraph
from adaptermesh.worker.kv_cache import PagedKVCache
from adaptermesh.worker.model import LoraPool, ModelConfig, StepInputs, TransformerModel
from adaptermesh.worker.sampling import (
    LogitBias,
    RowParams,
    SamplerMode,
    SamplingBuffers,
    eager_only,
    entry_logit_bias,
    gather_logprobs,
    graph_mode,
    penalised,
    processed_entries,
    row_params,
    sample_entries,
    unpack_logprobs,
)
from adaptermesh.worker.step_layout import (
    BlockTableMirror,
    StepBuffers,
    StepLayout,
    decode_buckets,
    fill_staging,
    mixed_buckets,
    plan_layout,
)
from adaptermesh.worker.step_plan import (
    SampledToken,
    SamplingRow,
    ScheduledStep,
    StepLogprobs,
    StepResult,
)

__all__ = ["InFlight", "LogprobRequest", "SampleObserver", "StepLauncher"]

# Host staging, three deep: step N+1 fills one while the copies of step N may still be queued
# behind step N-1 on the stream.
_RING_DEPTH = 3


class SampleObserver(Protocol):
    """Sees the logits [S, V] an eager step samples from and, per entry, the row that samples
    there (None: padding or a chunk that does not sample); tests record them to compare with
    a reference. Graph replays repeat the device work without calling it."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow | None]) -> None: ...


@dataclass(slots=True)
class LogprobRequest:
    """Which samplers of a step asked for logprobs: per sampler, its row among the asking rows
    (-1: did not ask) and how many alternatives it asked for; ``num_rows`` asking rows and
    ``alternatives`` per row in the step's output."""

    row_of_sampler: list[int]
    wanted: list[int]
    num_rows: int
    alternatives: int


@dataclass(slots=True)
class InFlight:
    plan: ScheduledStep
    entries: list[int]  # entry of each sampling row (``plan.samplers``) in the token output
    host_output: torch.Tensor
    num_entries: int
    done: Any  # torch.cuda.Event or None (CPU: already complete)
    started: Any = None
    host_ms: float = 0.0
    graph: bool = False
    rows: int = 0
    tokens: int = 0
    logprobs: LogprobRequest | None = None
    # A grammar-masked step launched with its sampling deferred: the mask, sampling and
    # output copy still to run (``run_tail``), once the host knows the previous step's tokens.
    tail: Callable[[], None] | None = None
    captured_solo: bool = False  # the launch captured a solo expert-set graph

    def run_tail(self) -> None:
        tail, self.tail = self.tail, None
        if tail is not None:
            tail()

    def wait(self) -> StepResult:
        """Each sampling row's token and, for rows that asked, its logprobs (blocks until the
        step's output copy completed)."""
        assert self.tail is None, "a deferred step's tail has not run"
        if self.done is not None:
            self.done.synchronize()
        values = self.host_output[: self.num_entries].tolist()
        tokens = [int(values[entry]) for entry in self.entries]
        ids = [row.seq_id for row in self.plan.samplers]
        request = self.logprobs
        if request is None:
            return StepResult(
                self.plan.step_id,
                tuple(SampledToken(i, t) for i, t in zip(ids, tokens, strict=True)),
            )
        logprob_values, logprob_ids = unpack_logprobs(
            self.host_output, self.num_entries, request.num_rows, request.alternatives
        )
        logprobs: list[StepLogprobs | None] = []
        for row, want in zip(request.row_of_sampler, request.wanted, strict=True):
            logprobs.append(
                None
                if row < 0
                else StepLogprobs(
                    logprob_values[row][0],
                    logprob_ids[row][:want],
                    logprob_values[row][1 : 1 + want],
                )
            )
        return StepResult(
            self.plan.step_id,
            tuple(SampledToken(i, t, lp) for i, t, lp in zip(ids, tokens, logprobs, strict=True)),
        )


@dataclass(slots=True)
class StepTraits:
    """What a plan needs from its step, decided before the layout."""

    gated_sets: bool  # expert sets run on the eager gated path (several tokens or requests)
    penalties: bool
    biased: bool  # some sampling row has a logit_bias
    lora: bool
    solo_set: ExpertSet | None  # the single expert-set token's set on the solo gated path
    mode: SamplerMode  # the graph variant (sampling.GREEDY or RANDOM), or the eager rows' own
    graphable: bool
    masked: bool = False  # some sequence is grammar-constrained: the step applies a bitmask
    active_slots: int = 0  # distinct adapter slots the plan's sequences use
    # Slots of the plan's rows whose adapters hold trained module copies (modules_to_save):
    # such a step runs eagerly (its head copies are one matmul per slot, from this list).
    saved: tuple[int, ...] = ()
    # Slots of the plan's rows whose adapters have extra vocabulary rows (extra_vocab): such
    # a step runs eagerly, with logits as wide as the widest vocabulary a slot holds.
    extra: tuple[int, ...] = ()


@dataclass(slots=True)
class _DeviceRun:
    """What the step's device work left for the logprob gather."""

    logits: torch.Tensor | None  # [S, V]: the graph's output, or the eager step's logits
    sampling_buffers: SamplingBuffers
    mode: SamplerMode
    bias: LogitBias | None = None  # the step's logit biases (eager steps only)
    widths: torch.Tensor | None = None  # [S] each row's vocabulary, in a step with extra rows


class StepLauncher:
    """Graphs, staging buffers and the step output of one engine."""

    def __init__(
        self,
        *,
        model: TransformerModel,
        kv: PagedKVCache,
        pool: LoraPool,
        config: EngineConfig,
        device: torch.device,
        max_model_len: int,
        budget: EngineBudget,
        tables: BlockTableMirror,
        merge_policy: MergePolicy,
        sample_observer: SampleObserver | None = None,
    ) -> None:
        self.model = model
        self.model_config: ModelConfig = model.cfg
        self.kv = kv
        self.pool = pool
        self.config = config
        self.device = device
        self.max_model_len = max_model_len
        self.tables = tables
        self.merge_policy = merge_policy
        self._observe = sample_observer
        rows = config.max_num_seqs
        self.decode_sizes = decode_buckets(rows)
        self.mixed_sizes = mixed_buckets(min(config.graph_max_tokens, budget.step_tokens))
        # Every step writes its sampled ids here; the next step's decode rows gather from it.
        self.last_tokens = torch.zeros(budget.max_entries, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        self._staging = [
            self._host(torch.zeros(budget.staging_len, dtype=torch.int64))
            for _ in range(_RING_DEPTH)
        ]
        self._table_staging = [
            self._host(torch.zeros_like(tables.device_table, device="cpu"))
            for _ in range(_RING_DEPTH)
        ]
        # Per step, one copy to the host (sampling.gather_logprobs lays it out).
        self._output_device = torch.zeros(budget.output_len, dtype=torch.int64, device=device)
        self._output_host = [
            self._host(torch.zeros(budget.output_len, dtype=torch.int64))
            for _ in range(_RING_DEPTH)
        ]
        self._logprob_rows_host = [
            self._host(torch.zeros(budget.logprob_rows, dtype=torch.int64))
            for _ in range(_RING_DEPTH)
        ]
        # Grammar-constrained steps: each entry's packed token mask, staged on the host.
        extra = pool.extra
        self._bitmask_words = bitmask_words(
            extra.width if extra is not None else self.model_config.vocab_size
        )
        self._bitmask_host = [
            self._host(torch.zeros((budget.max_entries, self._bitmask_words), dtype=torch.int32))
            for _ in range(_RING_DEPTH)
        ]
        self.logprob_steps = 0
        self._ring_position = 0
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if self._cuda else 1
        )
        self.graph_runner = GraphRunner(
            device=device,
            enabled=self._cuda and config.use_cuda_graphs,
            model_config=self.model_config,
            pad_row=tables.pad_row,
            bitmask_words=self._bitmask_words,
            max_model_len=max_model_len,
            last_tokens=self.last_tokens,
            step=self._step,
            splits=self._splits,
        )
        self.eager_steps = 0

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.device.type == "cuda" else tensor

    # ---- one step ---------------------------------------------------------------------------

    def launch(self, plan: ScheduledStep, defer_masked: bool = False) -> InFlight:
        """Launch ``plan``'s step. A step with a grammar-constrained row runs its forward
        (graph or eager) now and its tail (the rows' masks, applied to the logits, sampling,
        the output copy) in ``InFlight.run_tail``: at once, or, with ``defer_masked``, when
        the caller has applied the previous step's tokens (the masks need them), so the
        forward runs on the device meanwhile."""
        started_at = time.perf_counter()
        decision = self.merge_policy.prepare_step(plan)
        traits = self._traits(plan, decision)
        layout = self._layout(
            plan,
            traits.graphable,
            traits.lora,
            traits.mode,
            traits.solo_set,
            traits.masked,
            traits.active_slots,
        )
        ring_index = self._next_ring_index()
        solo_graphs = self.graph_runner.solo_count()
        graph, layout = self._graph_for(plan, layout, traits)
        buffers = (
            graph.buffers
            if graph is not None
            else StepBuffers(layout.num_tokens, layout.num_entries, self.device)
        )
        ranges, entries = self._stage(plan, layout, ring_index)
        started = self._record_event()
        self._upload(ring_index, buffers)
        params = row_params(layout.entries)
        if graph is not None:
            run = self._replay(graph, params, traits, decision)
        else:
            run = self._run_eager(plan, layout, ranges, buffers, params, traits, decision)
        in_flight = InFlight(
            plan,
            entries,
            self._output_host[ring_index],
            layout.num_entries,
            None,
            started,
            0.0,
            graph is not None,
            len(plan.rows),
            plan.num_tokens,
            captured_solo=self.graph_runner.solo_count() > solo_graphs,
        )

        launch_ms = 1e3 * (time.perf_counter() - started_at)

        def finish_step() -> None:
            tail_started = time.perf_counter()
            if traits.masked:
                self._masked_tail(ring_index, layout, graph, run, traits.penalties)
            in_flight.host_output, in_flight.logprobs = self._copy_output(
                ring_index, plan.samplers, entries, layout, run
            )
            in_flight.done = self._record_event()
            in_flight.host_ms = launch_ms + 1e3 * (time.perf_counter() - tail_started)

        in_flight.tail = finish_step
        if not (traits.masked and defer_masked):
            in_flight.run_tail()
        return in_flight

    def _masked_tail(
        self,
        ring_index: int,
        layout: StepLayout,
        graph: StepGraph | None,
        run: _DeviceRun,
        penalties: bool,
    ) -> None:
        """The tail of a grammar-masked step: the rows' masks to the device, -inf on each
        refused token, sampling (greedy, random, penalties: all on the masked logits), and
        the write of the ids every later step reads."""
        logits = run.logits
        assert logits is not None
        bitmask = self._upload_bitmask(ring_index, layout, graph)
        with torch.inference_mode():  # the forward's logits are an inference tensor
            apply_bitmask(logits, bitmask)
        # A refused token stays at -inf whatever its bias: the order of the two does not matter.
        tokens = sample_entries(
            logits,
            run.sampling_buffers,
            run.mode,
            layout.entries,
            bias=run.bias,
            penalties=penalties,
            observe=self._observe,
        )
        self.last_tokens[: tokens.shape[0]].copy_(tokens)

    def _traits(self, plan: ScheduledStep, decision: SoloDecision) -> StepTraits:
        rows = plan.rows
        samplers = plan.samplers
        gated_sets = decision.solo is None and any(row.expert_set is not None for row in rows)
        # The logit processors run on the rows that sample: a prompt chunk that does not
        # sample needs none of them.
        penalties = any(penalised(row.sampling) for row in samplers)
        biased = any(row.sampling.logit_bias for row in samplers)
        slots = {row.lora_slot for row in rows if row.lora_slot >= 0}
        lora = bool(slots)
        solo_set = decision.gated_set
        masked = any(row.matcher is not None for row in samplers)
        eager = any(eager_only(row.sampling) for row in samplers)
        saved = self.pool.saved.slots_with_copies(slots) if self.pool.saved is not None else ()
        extra = self.pool.extra.slots_with_extra(slots) if self.pool.extra is not None else ()
        graphable = (
            self.graph_runner.usable(solo_set is not None)
            and not gated_sets
            and not eager
            and not saved
            and not extra
        )
        mode = graph_mode(list(samplers))
        if any(row.sampling.typical_p < 1.0 for row in samplers):  # eager: no graph variant
            mode = dataclasses.replace(mode, any_typical=mode.any_random)
        return StepTraits(
            gated_sets,
            penalties,
            biased,
            lora,
            solo_set,
            mode,
            graphable,
            masked,
            len(slots),
            saved,
            extra,
        )

    def _lora_side(self, lora: bool) -> bool:
        # Part of a graph's key: a graph records the LoRA path it was captured with.
        return lora and self.model.lora_side is not None

    def _layout(
        self,
        plan: ScheduledStep,
        graphable: bool,
        lora: bool,
        mode: SamplerMode,
        solo: ExpertSet | None,
        masked: bool = False,
        active_slots: int = 0,
    ) -> StepLayout:
        return plan_layout(
            plan,
            graphable=graphable,
            lora=lora,
            lora_side=self._lora_side(lora),
            random_mode=mode.any_random,
            solo=solo,
            decode_sizes=self.decode_sizes,
            mixed_sizes=self.mixed_sizes,
            max_num_seqs=self.config.max_num_seqs,
            max_prefill_seqs=self.config.max_prefill_seqs,
            masked=masked,
            active_slots=active_slots,
            lora_density=self.config.lora_density_configs,
        )

    def _next_ring_index(self) -> int:
        index = self._ring_position
        self._ring_position = (index + 1) % _RING_DEPTH
        return index

    def _graph_for(
        self, plan: ScheduledStep, layout: StepLayout, traits: StepTraits
    ) -> tuple[StepGraph | None, StepLayout]:
        """The layout's graph, captured on first use; when capture fails, no graph and the
        plan's eager layout."""
        if layout.graph_key is None:
            return None, layout
        graph = self.graph_runner.get(
            layout, traits.lora, traits.mode, traits.solo_set, traits.masked
        )
        if graph is None:
            layout = self._layout(
                plan, False, traits.lora, traits.mode, None, traits.masked, traits.active_slots
            )
        return graph, layout

    def _stage(
        self, plan: ScheduledStep, layout: StepLayout, ring_index: int
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Fill the ring slot's host staging with the step's inputs (the block-table mirror
        first); returns each plan row's (first token row, token rows) and the output entry of
        each sampling row."""
        self.tables.apply(plan.tables)
        ranges = fill_staging(
            self._staging[ring_index].numpy(),
            layout,
            plan,
            self.tables.table,
            self.kv.block_size,
            self.tables.pad_row,
        )
        entries = [entry for entry, row in enumerate(layout.entries) if row is not None]
        return ranges, entries

    def _record_event(self) -> Any:
        if not self._cuda:
            return None
        event = torch.cuda.Event(enable_timing=self.config.profile_steps)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _upload(self, ring_index: int, buffers: StepBuffers) -> None:
        """Queue the block-table mirror (when it changed) and the staged inputs to the device."""
        self.tables.upload(self._table_staging[ring_index])
        buffers.device_buffer.copy_(self._staging[ring_index][: buffers.size], non_blocking=True)

    def _upload_bitmask(
        self, ring_index: int, layout: StepLayout, graph: StepGraph | None
    ) -> torch.Tensor:
        """Queue the step's token bitmask to the device: each constrained entry's row is its
        matcher's next-token mask (all rows computed in parallel outside the GIL, on CUDA on
        the launch's worker thread), every other row allows everything. Returns the device
        bitmask (the graph's own buffer)."""
        entries = layout.num_entries
        host = self._bitmask_host[ring_index][:entries]
        host.fill_(-1)
        fill_masks(
            [
                (row.matcher, entry)
                for entry, row in enumerate(layout.entries)
                if row is not None and row.matcher is not None
            ],
            host,
        )
        if graph is not None:
            assert graph.bitmask is not None
            device = graph.bitmask
        else:
            device = torch.empty_like(host, device=self.device)
        device.copy_(host, non_blocking=True)
        return device

    def _replay(
        self, graph: StepGraph, params: list[RowParams], traits: StepTraits, decision: SoloDecision
    ) -> _DeviceRun:
        selection = None
        if traits.solo_set is not None:
            assert decision.selection is not None
            selection = decision.selection
            self.merge_policy.solo_graph_steps += 1
        self.graph_runner.replay(graph, params, selection)
        return _DeviceRun(graph.logits, graph.sampling_buffers, traits.mode)

    def _run_eager(
        self,
        plan: ScheduledStep,
        layout: StepLayout,
        ranges: list[tuple[int, int]],
        buffers: StepBuffers,
        params: list[RowParams],
        traits: StepTraits,
        decision: SoloDecision,
    ) -> _DeviceRun:
        sampling_buffers = SamplingBuffers.allocate(layout.num_entries, self.device)
        sampling_buffers.fill(params)
        gated: GatedTerms | None = None
        if traits.gated_sets:
            gated = self.merge_policy.gated_batch(
                plan, ranges, layout.num_tokens, self.device, self.model_config
            )
        elif traits.solo_set is not None:
            assert decision.selection is not None
            gated = SoloGated(
                traits.solo_set, decision.selection.to(self.device), 1, self.model_config
            )
        mode = SamplerMode.of(params) if traits.penalties else traits.mode
        # The bound the split heuristic reads: one past the longest decode row's length.
        splits = self._splits(
            layout.num_decode, max((row.start + 2 for row in plan.decode), default=1)
        )
        ev = self.pool.extra.step(traits.extra) if self.pool.extra is not None else None
        width = ev.width if ev is not None else self.model_config.vocab_size  # the logits'
        bias = entry_logit_bias(layout.entries, width, self.device) if traits.biased else None
        logits = self._step(
            buffers,
            layout,
            splits,
            traits.lora,
            sampling_buffers,
            mode,
            gated,
            self.last_tokens,
            traits.penalties,
            sample=not traits.masked,
            bias=bias,
            saved=traits.saved,
            extra=traits.extra,
        )
        self.eager_steps += 1
        widths = None
        if ev is not None:
            views = buffers.views
            widths = ev.pool.row_widths(views.lora_slots, views.logits_rows)
        return _DeviceRun(logits, sampling_buffers, mode, bias, widths)

    def _copy_output(
        self,
        ring_index: int,
        samplers: tuple[SamplingRow, ...],
        entries: list[int],
        layout: StepLayout,
        run: _DeviceRun,
    ) -> tuple[torch.Tensor, LogprobRequest | None]:
        """Queue the step's single device-to-host copy: the sampled ids, and the logprobs of the
        samplers that asked (after gathering them on the device)."""
        host_output = self._output_host[ring_index]
        wants = [row.sampling.logprobs for row in samplers]
        if not any(want is not None for want in wants):
            host_output[: layout.num_entries].copy_(
                self.last_tokens[: layout.num_entries], non_blocking=True
            )
            return host_output, None
        step_logits = run.logits
        assert step_logits is not None
        if self.config.logprobs_mode == "processed":
            step_logits = processed_entries(
                step_logits, run.sampling_buffers, run.mode, layout.entries, bias=run.bias
            )
        row_of_sampler: list[int] = []
        wanted: list[int] = []
        asking: list[int] = []
        for entry, want in zip(entries, wants, strict=True):
            row_of_sampler.append(len(asking) if want is not None else -1)
            wanted.append(want or 0)
            if want is not None:
                asking.append(entry)
        request = LogprobRequest(row_of_sampler, wanted, len(asking), max(wanted))
        output_len = gather_logprobs(
            self._output_device,
            self.last_tokens,
            step_logits,
            layout.num_entries,
            asking,
            request.alternatives,
            self._logprob_rows_host[ring_index],
            run.widths,
        )
        host_output[:output_len].copy_(self._output_device[:output_len], non_blocking=True)
        self.logprob_steps += 1
        return host_output, request

    # ---- device work ------------------------------------------------------------------------

    def _splits(self, num_seqs: int, max_len: int) -> int:
        if not self._cuda:
            return 1
        from adaptermesh.kernels.paged_attention import decode_splits

        return int(decode_splits(num_seqs, self.model_config.num_kv_heads, max_len, self._num_sms))

    def _step(
        self,
        buffers: StepBuffers,
        layout: StepLayout,
        splits: int,
        lora: bool,
        sampling_buffers: SamplingBuffers,
        mode: SamplerMode,
        gated: GatedTerms | None,
        destination: torch.Tensor,
        penalties: bool = False,
        sample: bool = True,
        bias: LogitBias | None = None,
        saved: tuple[int, ...] = (),
        extra: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """The whole step on the device: input gather, forward, sampling (from the logits
        with ``bias`` added, when given), write of the ids; without ``sample`` (a
        grammar-masked step, whose tail masks, biases and samples) the forward only. Returns
        the raw logits. ``saved``: the slots of rows whose adapters hold trained module
        copies (eager steps only); ``extra``: those of rows whose adapters have extra
        vocabulary rows (eager steps only; the logits are then that much wider)."""
        views = buffers.views
        source_entries = views.source_entries
        ids = torch.where(
            source_entries >= 0,
            self.last_tokens.index_select(0, source_entries.clamp(min=0)),
            views.ids,
        )
        inputs = StepInputs(
            input_ids=ids,
            positions=views.positions,
            slot_mapping=views.slot_mapping,
            token_slots=views.lora_slots.to(torch.int32),
            block_tables=self.tables.device_table.index_select(0, views.table_rows),
            seq_lens=views.seq_lens.to(torch.int32),
            query_start=views.query_start.to(torch.int32),
            logits_rows=views.logits_rows,
            num_decode=layout.num_decode,
            max_prefill_len=layout.max_prefill_len,
            num_splits=splits,
            saved=self.pool.saved.step(saved) if saved and self.pool.saved is not None else None,
            extra=self.pool.extra.step(extra) if extra and self.pool.extra is not None else None,
        )
        meta = (
            lora_ops.build_meta(
                inputs.token_slots,
                self.pool.num_slots,
                layout.lora_active_slots,
                self.pool.routes,
            )
            if lora
            else None
        )
        logits = self.model.forward(inputs, self.kv, self.pool if lora else None, meta, gated)
        if not sample:
            return logits
        tokens = sample_entries(
            logits,
            sampling_buffers,
            mode,
            layout.entries,
            bias=bias,
            penalties=penalties,
            observe=self._observe,
        )
        destination[: tokens.shape[0]].copy_(tokens)
        return logits
