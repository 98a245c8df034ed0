"""Whole-step CUDA graphs: their keys, capture, replay and static buffers.

A step is a fixed shape once padded (``step_layout.plan_layout`` gives the shape and the
graph key: the bucket, whether LoRA runs and on which stream, the sampler variant, a solo
expert set, a grammar mask, the LoRA density class). ``GraphRunner`` holds one captured graph
per key, with the static buffers the graph reads (the step's staging vector, its sampling
parameters, a solo expert set's selection, a masked graph's bitmask) and writes (the logits).
The step launcher (``step_launch.py``) owns the device work itself (``StepLauncher._step``)
and the eager path; it asks here for a layout's graph, which is captured on first use around
that same device work, and replays it after filling the static buffers.

A capture that fails switches graphs off for good (or, for a solo expert-set graph, only
solo graphs); the step runs eagerly. Nothing here runs without CUDA, but the module imports
and constructs on any device (``enabled`` is then False).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from adaptermesh.worker.adafuse import ExpertSet, GatedTerms, SoloGated
from adaptermesh.worker.model import ModelConfig
from adaptermesh.worker.sampling import RowParams, SamplerMode, SamplingBuffers
from adaptermesh.worker.step_layout import StepBuffers, StepLayout, split_staging

__all__ = ["DeviceStep", "GraphRunner", "StepGraph"]

log = logging.getLogger(__name__)


class DeviceStep(Protocol):
    """The whole step's device work (``StepLauncher._step``): input gather, forward, and
    (with ``sample``) sampling and the write of the ids into ``destination``; returns the
    logits."""

    def __call__(
        self,
        buffers: StepBuffers,
        layout: StepLayout,
        splits: int,
        lora: bool,
        sampling_buffers: SamplingBuffers,
        mode: SamplerMode,
        gated: GatedTerms | None,
        destination: torch.Tensor,
        *,
        sample: bool = True,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class StepGraph:
    graph: torch.cuda.CUDAGraph
    buffers: StepBuffers
    sampling_buffers: SamplingBuffers
    selection: torch.Tensor | None = None  # solo expert-set selection buffer
    logits: torch.Tensor | None = None  # [S, V] fp32, the graph's output, rewritten by each replay
    bitmask: torch.Tensor | None = None  # [S, W] int32 token mask of a masked graph's entries


def _is_solo(key: tuple[Any, ...]) -> bool:
    return bool(key[0] == "d" and key[4] is not None)


class GraphRunner:
    """The captured graphs of one engine, keyed by ``StepLayout.graph_key``."""

    def __init__(
        self,
        *,
        device: torch.device,
        enabled: bool,
        model_config: ModelConfig,
        pad_row: int,
        bitmask_words: int,
        max_model_len: int,
        last_tokens: torch.Tensor,
        step: DeviceStep,
        splits: Callable[[int, int], int],
    ) -> None:
        """``enabled``: capture and replay at all (CUDA and ``EngineConfig.use_cuda_graphs``).
        ``last_tokens``: where a replayed step writes its ids (a warm-up writes a scratch
        copy). ``pad_row``: the block-table row of padding entries."""
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.solo_enabled = self.enabled
        self.model_config = model_config
        self.pad_row = pad_row
        self.bitmask_words = bitmask_words
        self.max_model_len = max_model_len
        self.last_tokens = last_tokens
        self._scratch_tokens = torch.zeros_like(last_tokens)  # graph warm-ups write here
        self._step = step
        self._splits = splits
        self.graphs: dict[tuple[Any, ...], StepGraph] = {}
        self._pool: Any = None
        self.replays = 0

    def usable(self, solo: bool) -> bool:
        """Whether a step may take a graph (one with a solo expert set: ``solo``)."""
        return self.enabled and (self.solo_enabled or not solo)

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.graphs)

    def get(
        self,
        layout: StepLayout,
        lora: bool,
        mode: SamplerMode,
        expert_set: ExpertSet | None,
        masked: bool,
    ) -> StepGraph | None:
        """The layout's graph, captured on first use; None when the capture failed (the step
        runs eagerly, and so do the later ones the failure switched off)."""
        key = layout.graph_key
        assert key is not None
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        try:
            graph = self._capture(layout, lora, mode, expert_set, masked)
        except Exception:
            if expert_set is not None:  # the plain graphs stay in use
                log.exception(
                    "CUDA graph capture of a solo expert-set step failed; those run eagerly from now on"
                )
                self.solo_enabled = False
                return None
            log.exception("CUDA graph capture failed; running steps eagerly from now on")
            self.enabled = False
            return None
        self.graphs[key] = graph
        return graph

    def replay(
        self, graph: StepGraph, params: list[RowParams], selection: torch.Tensor | None
    ) -> None:
        """Fill the graph's sampling parameters (and a solo graph's expert selection) and
        replay it; the staging vector was already copied into ``graph.buffers``."""
        graph.sampling_buffers.fill(params)
        if selection is not None:
            assert graph.selection is not None
            graph.selection.copy_(
                selection.pin_memory() if self.device.type == "cuda" else selection,
                non_blocking=True,
            )
        graph.graph.replay()
        self.replays += 1

    def prune_solo(self, live: set[int]) -> None:
        """Drop solo graphs of expert sets whose ids are not in ``live`` (neither resident nor
        held by a running request: their graphs keep the sets' device tensors alive). The
        engine calls it on its thread, between launches, after a launch captured one."""
        for key in [key for key in self.graphs if _is_solo(key) and id(key[4]) not in live]:
            del self.graphs[key]

    def solo_count(self) -> int:
        return sum(1 for key in self.graphs if _is_solo(key))

    def _capture(
        self,
        layout: StepLayout,
        lora: bool,
        mode: SamplerMode,
        expert_set: ExpertSet | None,
        masked: bool,
    ) -> StepGraph:
        device = self.device
        buffers = StepBuffers(layout.num_tokens, layout.num_entries, device)
        # Padding everywhere: the warm-ups write no KV slot, read no key, use no adapter.
        padding = np.zeros(buffers.size, dtype=np.int64)
        padding_views = split_staging(padding, layout.num_tokens, layout.num_entries)
        padding_views.source_entries[:] = -1
        padding_views.slot_mapping[:] = -1
        padding_views.lora_slots[:] = -1
        padding_views.table_rows[:] = self.pad_row
        buffers.device_buffer.copy_(torch.from_numpy(padding).to(device))
        sampling_buffers = SamplingBuffers.allocate(layout.num_entries, device)
        sampling_buffers.fill([])
        # A masked graph is the forward only; its tail reads the step's bitmask from here.
        bitmask = (
            torch.full(
                (layout.num_entries, self.bitmask_words), -1, dtype=torch.int32, device=device
            )
            if masked
            else None
        )
        selection: torch.Tensor | None = None
        gated: SoloGated | None = None
        if expert_set is not None:
            selection = expert_set.solo_empty(1, device)
            gated = SoloGated(expert_set, selection, 1, self.model_config)
        splits = self._splits(layout.num_decode, self.max_model_len)
        capture_layout = StepLayout(
            layout.num_tokens,
            layout.num_entries,
            layout.num_decode,
            layout.max_prefill_len,
            [None] * layout.num_entries,
            layout.graph_key,
            layout.lora_active_slots,
        )

        def step(destination: torch.Tensor) -> torch.Tensor:
            # The warm-ups run the very step the graph captures; only the ids' target differs.
            return self._step(
                buffers,
                capture_layout,
                splits,
                lora,
                sampling_buffers,
                mode,
                gated,
                destination,
                sample=not masked,
            )

        side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation and autotuning must not be captured
                step(self._scratch_tokens)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: adapter uploads on the event-loop thread may run during the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = step(self.last_tokens)
        # Keeping the output referenced keeps its memory out of later captures in the shared
        # pool, so logprob steps can read it after a replay.
        return StepGraph(graph, buffers, sampling_buffers, selection, logits, bitmask)
