"""How a step's plan sits in the device inputs: shape buckets, regions, and the staging layout.

A step is a fixed shape once padded: ``num_tokens`` token rows and ``num_entries`` sequence
entries (a decode region of one entry per decode row, then the prompt chunks). All of a step's
integer inputs travel in one int64 vector (``split_staging`` names its parts), filled on the
host by ``fill_staging`` and copied to the device with one transfer. ``BlockTableMirror`` keeps
the block tables of admitted sequences in a host array and its device copy.

Everything here reads the scheduler's plain step description (``step_plan.ScheduledStep``),
never a scheduler ``Sequence``; everything but the mirror's device copy is host work on plain
arrays, testable without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from adaptermesh.kernels import dispatch
from adaptermesh.worker.adafuse import ExpertSet
from adaptermesh.worker.step_plan import BlockTableUpdate, SamplingRow, ScheduledStep

__all__ = [
    "BlockTableMirror",
    "StepBuffers",
    "StepLayout",
    "StepViews",
    "bucket_for",
    "decode_buckets",
    "fill_staging",
    "mixed_buckets",
    "plan_layout",
    "split_staging",
    "staging_length",
]

ArrayT = TypeVar("ArrayT", np.ndarray[Any, Any], torch.Tensor)

# int64 vectors per token row (ids, source entries, positions, KV slots, LoRA slots), per
# entry (seq_lens, logits_rows, table_rows, query_start), plus query_start's closing element.
_TOKEN_FIELDS = 5
_ENTRY_FIELDS = 4


def staging_length(num_tokens: int, num_entries: int) -> int:
    """int64 elements of one step's staging vector."""
    return _TOKEN_FIELDS * num_tokens + _ENTRY_FIELDS * num_entries + 1


@dataclass(slots=True)
class StepViews(Generic[ArrayT]):
    """The named parts of one step's staging vector (views, not copies). Layout: ids,
    source_entries, positions, slot_mapping, lora_slots (``num_tokens`` each), then seq_lens,
    logits_rows, table_rows (``num_entries`` each) and query_start (``num_entries`` + 1)."""

    ids: ArrayT  # input token ids (0 where the id comes from the device)
    source_entries: ArrayT  # -1, or the previous step's entry whose sampled id is this row's input
    positions: ArrayT
    slot_mapping: ArrayT  # KV slot each row writes, -1: none
    lora_slots: ArrayT  # LoRA pool slot of each row, -1: base model
    seq_lens: ArrayT
    logits_rows: ArrayT  # the row whose logits each entry samples from
    table_rows: ArrayT  # each entry's row of the block-table mirror
    query_start: ArrayT


def split_staging(flat: ArrayT, num_tokens: int, num_entries: int) -> StepViews[ArrayT]:
    """Views of the parts of ``flat`` (numpy on the host, torch on the device)."""
    ids, source_entries, positions, slot_mapping, lora_slots = (
        flat[i * num_tokens : (i + 1) * num_tokens] for i in range(_TOKEN_FIELDS)
    )
    offset = _TOKEN_FIELDS * num_tokens
    return StepViews(
        ids,
        source_entries,
        positions,
        slot_mapping,
        lora_slots,
        seq_lens=flat[offset : offset + num_entries],
        logits_rows=flat[offset + num_entries : offset + 2 * num_entries],
        table_rows=flat[offset + 2 * num_entries : offset + 3 * num_entries],
        query_start=flat[offset + 3 * num_entries : offset + 4 * num_entries + 1],
    )


class StepBuffers:
    """Device inputs of one step shape: one int64 staging vector, filled by one host->device
    copy, and the views the step reads."""

    def __init__(self, num_tokens: int, num_entries: int, device: torch.device) -> None:
        self.num_tokens, self.num_entries = num_tokens, num_entries
        self.size = staging_length(num_tokens, num_entries)
        self.device_buffer = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.views = split_staging(self.device_buffer, num_tokens, num_entries)


@dataclass(slots=True)
class StepLayout:
    """How one plan sits in a step: shape, regions, and which entries sample."""

    num_tokens: int
    num_entries: int
    num_decode: int  # size of the decode region (entries)
    max_prefill_len: int
    entries: list[SamplingRow | None]  # per entry, the row that samples there (None: padding)
    graph_key: tuple[Any, ...] | None  # graph key, None = eager
    # The LoRA kernels' ``active_slots`` (dispatch.config_slots): for a graph, the bound of its
    # density class, which is part of its key; eager, the plan's distinct adapters.
    lora_active_slots: int | None = None


def decode_buckets(limit: int, start: int = 1) -> list[int]:
    """Batch-size buckets: powers of two up to 16, then steps of 8 to 64, of 32 to 256, of 64
    beyond; ``limit`` itself is always the last bucket."""
    out: list[int] = []
    size = start
    while size < limit:
        out.append(size)
        size = size * 2 if size < 16 else size + (8 if size < 64 else 32 if size < 256 else 64)
    out.append(limit)
    return out


def mixed_buckets(graph_max_tokens: int) -> list[int]:
    """Token buckets of mixed prefill+decode graphs: 16, 32, 64, ... up to
    ``graph_max_tokens``, which is itself the last bucket (none below 16)."""
    out = [size for size in (16 << i for i in range(16)) if size <= graph_max_tokens]
    if graph_max_tokens not in out and graph_max_tokens >= 16:
        out.append(graph_max_tokens)
    return out


def bucket_for(count: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``count``, None when none does."""
    for size in buckets:
        if size >= count:
            return size
    return None


def plan_layout(
    plan: ScheduledStep,
    *,
    graphable: bool,
    lora: bool,
    lora_side: bool,
    random_mode: bool,
    solo: ExpertSet | None,
    decode_sizes: list[int],
    masked: bool = False,
    mixed_sizes: list[int],
    max_num_seqs: int,
    max_prefill_seqs: int,
    active_slots: int = 0,
    lora_density: bool = True,
) -> StepLayout:
    """The step's layout: a pure-decode graph bucket, a mixed graph bucket (decode region of
    ``min(max_num_seqs, bucket)`` entries, then ``max_prefill_seqs`` chunk entries), or the
    plan's own shape (eager). ``solo`` (an expert set or None) and ``lora_side`` are part of a
    decode graph's key; steps with a solo set have no mixed graph. ``masked`` (some row is
    grammar-constrained: the graph applies the step's token bitmask) is part of every key.
    With ``lora`` and ``lora_density``, the density class of the plan's ``active_slots``
    distinct adapters over the layout's tokens is part of every key too, and picks the LoRA
    kernels' configs (``lora_active_slots``); without ``lora_density`` every step takes the
    worst case's (None)."""
    num_decode, num_prefill, num_tokens = len(plan.decode), len(plan.prefill), plan.num_tokens

    def density(tokens: int) -> tuple[str | None, int | None]:
        if not (lora and lora_density):
            return None, None
        return dispatch.config_slots(tokens, active_slots)

    decode_entries: list[SamplingRow | None] = [row.sampler for row in plan.decode]
    prefill_entries: list[SamplingRow | None] = [row.sampler for row in plan.prefill]
    if graphable and num_prefill == 0:
        size = bucket_for(num_decode, decode_sizes)
        if size is not None:
            cls, slots = density(size)
            return StepLayout(
                size,
                size,
                size,
                0,
                decode_entries + [None] * (size - num_decode),
                ("d", size, lora, random_mode, solo, lora_side, masked, cls),
                slots,
            )
    if graphable and solo is None and num_prefill <= max_prefill_seqs:
        token_bucket = bucket_for(num_tokens, mixed_sizes)
        if token_bucket is not None:
            decode_region = min(max_num_seqs, token_bucket)
            entries = (
                decode_entries
                + [None] * (decode_region - num_decode)
                + prefill_entries
                + [None] * (max_prefill_seqs - num_prefill)
            )
            cls, slots = density(token_bucket)
            return StepLayout(
                token_bucket,
                decode_region + max_prefill_seqs,
                decode_region,
                token_bucket,
                entries,
                ("m", token_bucket, lora, random_mode, lora_side, masked, cls),
                slots,
            )
    max_prefill_len = max((row.count for row in plan.prefill), default=0)
    return StepLayout(
        num_tokens,
        num_decode + num_prefill,
        num_decode,
        max_prefill_len,
        decode_entries + prefill_entries,
        None,
        max(1, active_slots) if lora and lora_density else None,
    )


def fill_staging(
    stage: np.ndarray[Any, Any],
    layout: StepLayout,
    plan: ScheduledStep,
    block_table: np.ndarray[Any, Any],
    block_size: int,
    pad_row: int,
) -> list[tuple[int, int]]:
    """Write the step's inputs into ``stage`` (the staging layout of ``split_staging``);
    returns each plan row's (first token row, token rows). ``block_table`` must already hold
    every plan row's blocks (``BlockTableMirror.apply``)."""
    views = split_staging(stage, layout.num_tokens, layout.num_entries)
    ids, source_entries, positions = views.ids, views.source_entries, views.positions
    slot_mapping, lora_slots, seq_lens = views.slot_mapping, views.lora_slots, views.seq_lens
    logits_rows, table_rows, query_start = views.logits_rows, views.table_rows, views.query_start
    ids[:] = 0
    source_entries[:] = -1
    positions[:] = 0
    slot_mapping[:] = -1
    lora_slots[:] = -1
    seq_lens[:] = 0
    logits_rows[:] = 0
    table_rows[:] = pad_row
    ranges: list[tuple[int, int]] = []
    num_decode = len(plan.decode)
    for index, row in enumerate(plan.decode):
        position = row.start
        table_row = row.table_row
        if row.source_entry >= 0:
            source_entries[index] = row.source_entry
        else:
            ids[index] = row.token_ids[0]
        positions[index] = position
        slot_mapping[index] = (
            int(block_table[table_row, position // block_size]) * block_size + position % block_size
        )
        lora_slots[index] = row.lora_slot
        seq_lens[index] = position + 1
        logits_rows[index] = index
        table_rows[index] = table_row
        ranges.append((index, 1))
    query_start[: num_decode + 1] = np.arange(num_decode + 1)
    query_start[num_decode + 1 : layout.num_decode + 1] = num_decode
    cursor = num_decode
    entry = layout.num_decode
    for row in plan.prefill:
        start, count, table_row = row.start, row.count, row.table_row
        assert row.source_entry < 0
        assert len(row.token_ids) == count
        chunk = slice(cursor, cursor + count)
        ids[chunk] = row.token_ids
        chunk_positions = np.arange(start, start + count)
        positions[chunk] = chunk_positions
        slot_mapping[chunk] = (
            block_table[table_row, chunk_positions // block_size].astype(np.int64) * block_size
            + chunk_positions % block_size
        )
        lora_slots[chunk] = row.lora_slot
        seq_lens[entry] = start + count
        logits_rows[entry] = cursor + count - 1
        table_rows[entry] = table_row
        query_start[entry] = cursor
        ranges.append((cursor, count))
        cursor += count
        entry += 1
    query_start[entry:] = cursor
    return ranges


class BlockTableMirror:
    """Block tables of admitted sequences, one row each (row ``pad_row``, the last, stays all
    zeros: padding entries read it), mirrored on the device whenever a row grew. The
    scheduler names the growth in each step's description (``ScheduledStep.tables``)."""

    def __init__(
        self,
        rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.pad_row = rows
        self.table = np.zeros((rows + 1, max_blocks_per_seq), dtype=np.int32)
        self.device_table = torch.zeros(
            (rows + 1, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.dirty = False

    def apply(self, updates: Iterable[BlockTableUpdate]) -> None:
        """Write each update's new block-table entries into its row of the host mirror."""
        for update in updates:
            if not 0 <= update.table_row < self.pad_row:
                raise ValueError(f"block-table row {update.table_row} is not a sequence's row")
            end = update.first + len(update.blocks)
            self.table[update.table_row, update.first : end] = update.blocks
            self.dirty = True

    def upload(self, host_staging: torch.Tensor) -> None:
        """Queue the host table's copy to the device through ``host_staging`` (pinned on
        CUDA; it must stay untouched until the copy ran), when some row changed."""
        if self.dirty:
            host_staging.numpy()[:] = self.table
            self.device_table.copy_(host_staging, non_blocking=True)
            self.dirty = False
