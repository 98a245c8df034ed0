"""``Engine``: the worker's inference engine, implementing ``types.EngineProtocol``.

The engine owns one model, one paged KV cache (``kv_cache.py`` + ``paging.py``), one LoRA pool
and one adapter manager. A background task on the caller's event loop repeats: plan a step
(scheduler, on the loop), launch it (inputs staged into one pinned buffer and copied with one
transfer; forward and sampling on the device), and deliver the previous step's tokens to each
request's stream.

**Overlap.** On CUDA, step N+1 is planned and launched while step N runs: the tokens step N
samples stay on the device in ``last_tokens`` and step N+1's decode rows gather them from
there; the host learns them through one asynchronous copy per step and applies them (stop
rules, detokenisation, streaming) while the GPU runs the next step. Steps that need host facts
the device has not returned yet (AdaFuse expert sets choose their path from the token,
penalties count tokens) drain the pipeline first.

**Graphs.** A step is a fixed shape once padded: ``T`` token rows and ``S`` sequence entries.
Pure-decode steps replay a CUDA graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, ...)
over the active rows only; steps that mix prompt chunks and decode rows under the token
budget replay a graph per token bucket (16, 32, ... up to ``graph_max_tokens``) with a decode
region and a region of up to ``max_prefill_seqs`` prompt chunks. Each graph is the whole step:
input gather, forward, sampling (greedy or random variant), and the write of the sampled ids.
A base-only variant (no adapter row in the step) has no LoRA launch at all. Larger steps run
the same code eagerly.

AdaFuse expert sets (``adafuse.py``): a step that is a single token of a single expert-set
request picks by cost. Merging a selection into the backbone (one ``fused_switch``) reads and
writes every targeted weight, gigabytes on a 7B model, while the unmerged gated path reads only
the selected experts' LoRA matrices. So the step runs on merged weights only when they already
hold the token's selection, or when the same selection has now repeated for
``EngineConfig.adafuse_merge_after`` consecutive tokens (then it merges once); otherwise it runs
the gated path on top of whatever the backbone holds (cancelling a merged selection with
negated gates), in the batch-1 decode graph on a GPU. Any step that runs another request first
restores the pristine backbone (bit-exact), and so does going idle, so the weights are only
ever merged for the request that is running alone.

**Logprobs.** A step where some sampling row asked for logprobs (``SamplingParams.logprobs``)
runs one more small piece of device work after the step (graph or eager) on the step's logits
buffer (the graph's static output, which stays valid until the next replay on the same stream):
``log_softmax`` over the vocabulary of the asking rows only (one ``index_select``), a gather
of each sampled token's logprob and one ``topk`` of the largest k asked. The values are
written behind the sampled ids in one device buffer, so the host still gets everything with
the step's single device-to-host copy. Rows that did not ask, and steps where none did, run
exactly as before; graphs are not duplicated per logprob setting. By default
(``EngineConfig.logprobs_mode="raw"``) the values are the raw model distribution (before
penalties, temperature and filters), as vLLM reports by default; ``"processed"`` first runs
``sampling.processed_logits`` over the step's logits with the step's own sampling buffers and
mode, so the values are the distribution the sampler drew each token from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptermesh.worker import lora_ops
from adaptermesh.worker.adafuse import (
    BackboneMasters,
    CpuExpertSet,
    ExpertSet,
    GatedBatch,
    GatedTerms,
    Selection,
    SoloGated,
)
from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.kv_cache import KVCacheSpec, PagedKVCache, spec_bytes_per_token
from adaptermesh.worker.model import (
    ModelConfig,
    StepInputs,
    TransformerModel,
    make_lora_pool,
    read_weights,
)
from adaptermesh.worker.paging import BlockManager
from adaptermesh.worker.sampling import (
    RowParams,
    SamplerMode,
    SamplingBuffers,
    processed_logits,
    sample,
    token_logprobs,
)
from adaptermesh.worker.scheduler import Detokenizer, Scheduler, Sequence, StepLogprobs, StepPlan
from adaptermesh.worker.types import (
    MAX_LOGPROBS,
    AdapterInfo,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
)

__all__ = ["LOGPROBS_MODES", "Engine", "EngineConfig", "EngineStream", "sample_logits"]

LOGPROBS_MODES = ("raw", "processed")

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

# Sampler variants a graph is captured for: greedy rows only, or any mix with random rows
# (top-k / top-p / min-p filters always on in that variant; disabled values are no-ops).
_GREEDY = SamplerMode(any_random=False, any_top_p_or_k=False, any_min_p=False, penalties=False, repetition=False)
_RANDOM = SamplerMode(any_random=True, any_top_p_or_k=True, any_min_p=True, penalties=False, repetition=False)


@dataclass(slots=True)
class EngineConfig:
    """Limits and sizes. Defaults suit a CPU test box; GPU deployments raise them."""

    max_model_len: int | None = None  # None: min(config max_position_embeddings, 4096)
    max_num_seqs: int = 8  # sequences running at once (decode batch rows)
    max_loras: int = 8  # GPU pool slots
    max_lora_rank: int = 64
    # GPU slot and CPU cache eviction: "lru", "lru-greedy", "s3-fifo" or "w-tinylfu" (worker.eviction).
    adapter_eviction: str = "w-tinylfu"
    # Adapter weights in the GPU pool: None (the model dtype), "bf16"/"fp16"/"fp32" (must be
    # the model dtype) or "int4" (grouped INT4, about a quarter of the bytes per slot).
    lora_dtype: str | None = None
    max_num_batched_tokens: int = 512  # token budget per step (decode rows + prompt chunks)
    max_prefill_chunk: int = 256
    max_prefill_seqs: int = 8  # prompt chunks per step
    gpu_memory_fraction: float = 0.85  # of total GPU memory, for weights + pool + KV cache
    # Explicit KV budget in bytes (all of it becomes blocks). None: from gpu_memory_fraction on
    # CUDA (256 MiB on CPU), capped at 4x what max_num_seqs full contexts need.
    kv_cache_bytes: int | None = None
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True  # share full prompt blocks between requests of one adapter
    cpu_cache_bytes: int = 2 << 30  # adapter CPU cache budget
    negative_ttl_s: float = 30.0
    max_waiting: int = 4096
    use_cuda_graphs: bool = True
    # CUDA: each LoRA shrink runs on a side stream beside its base matmul (both read the same
    # input), so its latency hides behind the matmul; the expand follows on the step's stream.
    lora_overlap: bool = True
    # ... for steps of at most this many tokens (batch-1/small decode, where launch latency
    # dominates); larger steps run the terms after each matmul.
    lora_overlap_max_tokens: int = 64
    graph_max_tokens: int = 512  # mixed prefill+decode steps up to this many tokens replay graphs
    # Plan and launch step N+1 while step N runs. None: on CUDA only. True also on CPU, where
    # steps finish at launch but the in-flight token path (device gather, dropped tokens of
    # sequences that stopped) runs the same way; tests use it.
    async_scheduling: bool | None = None
    profile_steps: bool = False  # record host and GPU time per step in Engine.step_profile
    adapter_slot_wait_s: float = 10.0
    max_expert_sets: int = 4  # resident AdaFuse expert sets (device memory outside the LoRA pool)
    # A request decoding alone merges its expert selection into the backbone only after the
    # same selection has repeated for this many consecutive tokens (0: never merge).
    adafuse_merge_after: int = 4
    # Which distribution logprobs describe (``SamplingParams.logprobs``): "raw" (log_softmax of
    # the model's logits, vLLM's default) or "processed" (the distribution the sampler draws
    # from: penalties, temperature and top-k/top-p/min-p applied; sampling.processed_logits).
    logprobs_mode: str = "raw"


def sample_logits(logits: torch.Tensor, buf: SamplingBuffers, mode: SamplerMode,
                  rows: list[Sequence | None], out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [S] for logits [S, V]; ``rows[e]`` is the sequence that samples from entry e
    (None: a padding entry or a chunk that does not sample). Inside a captured graph this runs
    once, at capture; the replays repeat its device work."""
    del rows  # a hook for tests that record what each sequence sampled from
    return sample(logits, buf, mode=mode, out=out)


class EngineStream:
    """Async iterator of TokenEvent for one request; the last event has finish_reason set.

    Adapter resolution errors that happen after submit (for example a corrupt file found while
    loading on demand) are raised from the iteration, before any token.
    """

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self._engine = engine
        self._seq = seq

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                item = await self._seq.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:
                self.cancel()

    def cancel(self) -> None:
        if not self._seq.finished:
            self._seq.cancelled = True
            self._engine._wake()


@dataclass(slots=True)
class _SoloStep:
    """One token of one expert-set request (a batch of one row)."""

    seq: Sequence
    es: ExpertSet
    token: int
    rows: int
    row: int


class _StepBuffers:
    """Device inputs of one step shape: one int64 staging vector, filled by one host->device
    copy, and the views the step reads. Layout: ids, src, positions, slots, lora slots (T
    each), then seq_lens, logits_rows, table_rows (S each) and query_start (S + 1)."""

    def __init__(self, T: int, S: int, device: torch.device) -> None:
        self.T, self.S = T, S
        self.size = 5 * T + 4 * S + 1
        self.dev = torch.zeros(self.size, dtype=torch.int64, device=device)
        d = self.dev
        self.ids, self.src, self.pos, self.slot, self.lora = (d[i * T : (i + 1) * T] for i in range(5))
        o = 5 * T
        self.seq_lens = d[o : o + S]
        self.logits_rows = d[o + S : o + 2 * S]
        self.table_rows = d[o + 2 * S : o + 3 * S]
        self.query_start = d[o + 3 * S : o + 4 * S + 1]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    buf: _StepBuffers
    sbuf: SamplingBuffers
    sel: torch.Tensor | None = None  # solo expert-set selection buffer
    logits: torch.Tensor | None = None  # [S, V] fp32, the graph's output, rewritten by each replay


@dataclass(slots=True)
class _Layout:
    """How one plan sits in a step: shape, regions, and which entries sample."""

    T: int
    S: int
    num_decode: int  # size of the decode region (entries)
    max_prefill_len: int
    entries: list[Sequence | None]  # per entry, the sequence that samples there
    key: tuple[Any, ...] | None  # graph key, None = eager


@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    samplers: list[Sequence]
    entries: list[int]  # entry of each sampler in the step's token output
    host_tokens: torch.Tensor
    S: int
    done: Any  # torch.cuda.Event or None (CPU: already complete)
    started: Any = None
    host_ms: float = 0.0
    graph: bool = False
    rows: int = 0
    tokens: int = 0
    logits: torch.Tensor | None = None  # CPU only: kept for tests through sample_logits
    # Logprobs: per sampler, its row among the asking rows (-1: did not ask) and how many
    # alternatives it asked for; ``lp_rows`` asking rows, ``lp_k`` alternatives per row.
    lp_index: list[int] | None = None
    lp_want: list[int] | None = None
    lp_rows: int = 0
    lp_k: int = 0

    def wait(self) -> tuple[list[int], list[StepLogprobs | None] | None]:
        """Each sampler's token and, when some sampler asked, the logprobs of each."""
        if self.done is not None:
            self.done.synchronize()
        S, R, k = self.S, self.lp_rows, self.lp_k
        vals = self.host_tokens[:S].tolist()
        toks = [int(vals[e]) for e in self.entries]
        if self.lp_index is None or self.lp_want is None:
            return toks, None
        lv = self.host_tokens[S : S + R * (k + 1)].view(torch.float64).view(R, k + 1).tolist()
        li = self.host_tokens[S + R * (k + 1) : S + R * (2 * k + 1)].view(R, k).tolist()
        lps: list[StepLogprobs | None] = []
        for j, want in zip(self.lp_index, self.lp_want, strict=True):
            lps.append(None if j < 0 else StepLogprobs(lv[j][0], li[j][:want], lv[j][1 : 1 + want]))
        return toks, lps


def _buckets(limit: int, start: int = 1) -> list[int]:
    """Batch-size buckets: powers of two up to 16, then steps of 8 to 64, of 32 to 256, of 64
    beyond; ``limit`` itself is always the last bucket."""
    out: list[int] = []
    b = start
    while b < limit:
        out.append(b)
        b = b * 2 if b < 16 else b + (8 if b < 64 else 32 if b < 256 else 64)
    out.append(limit)
    return out


def _bucket(n: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class Engine:
    """Multi-LoRA inference engine over a local Llama/Mistral/Qwen2 checkpoint."""

    def __init__(
        self,
        model_dir: str | Path,
        adapter_root: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        config: EngineConfig | None = None,
        model_name: str | None = None,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``weights``: use these tensors (Hugging Face names) instead of reading
        ``model_dir/*.safetensors``; benches pass random weights made on the device."""
        from transformers import AutoTokenizer

        self.config = cfg = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.adapter_root = Path(adapter_root)
        if not self.adapter_root.is_dir():
            raise InvalidRequestError("adapter_root", f"{self.adapter_root} is not a directory")
        self.device = torch.device(device)
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise InvalidRequestError("dtype", f"unknown dtype {dtype!r} (float32, bfloat16, float16)")
            dtype = _DTYPES[dtype]
        self.dtype = dtype
        if cfg.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, "
                                      f"got {cfg.logprobs_mode!r}")
        bs = cfg.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 8 or bs > 256 or bs & (bs - 1):
            raise InvalidRequestError("block_size", f"must be a power of two in [8, 256], got {bs!r}")
        if not isinstance(cfg.max_num_seqs, int) or cfg.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs", f"must be a positive integer, got {cfg.max_num_seqs!r}")
        if not isinstance(cfg.max_prefill_seqs, int) or cfg.max_prefill_seqs < 1:
            raise InvalidRequestError("max_prefill_seqs", f"must be a positive integer, got {cfg.max_prefill_seqs!r}")
        if not isinstance(cfg.adafuse_merge_after, int) or isinstance(cfg.adafuse_merge_after, bool) \
                or cfg.adafuse_merge_after < 0:
            raise InvalidRequestError(
                "adafuse_merge_after", f"must be an integer >= 0, got {cfg.adafuse_merge_after!r}"
            )
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        self.model_name = model_name or self.model_dir.name
        self.max_model_len = int(cfg.max_model_len or min(mc.max_position_embeddings, 4096))
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.model_dir))
        # No token covers more characters than its vocabulary string has (byte-level BPE
        # spells one byte per character, SentencePiece one character per character), so a text
        # longer than max_model_len * this cannot fit the context: it is refused untokenised.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)

        tensors = weights if weights is not None else read_weights(self.model_dir)
        self.model = TransformerModel(mc, tensors, self.device, dtype, self.max_model_len)
        self.pool = make_lora_pool(mc, cfg.max_loras, cfg.max_lora_rank, self.device, dtype, cfg.lora_dtype)
        if cfg.lora_overlap and self.device.type == "cuda":
            self.model.lora_side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.model.lora_side_max_tokens = cfg.lora_overlap_max_tokens

        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, bs, dtype)
        per_block = spec_bytes_per_token(spec) * bs
        self.max_blocks_per_seq = -(-self.max_model_len // bs)
        rows = cfg.max_num_seqs
        cap: int | None = 1 + 4 * rows * self.max_blocks_per_seq
        if cfg.kv_cache_bytes is not None:
            budget, cap = cfg.kv_cache_bytes, None
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_fraction) - (total - free) - (1 << 30)  # activations, graphs
        else:
            budget = 256 << 20
        num_blocks = max(0, budget) // per_block
        if cap is not None:
            num_blocks = min(num_blocks, cap)
        if num_blocks - 1 < self.max_blocks_per_seq:
            raise ValueError(
                f"kv_cache: the memory budget holds {max(0, num_blocks - 1) * bs} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len}; lower max_model_len or raise the budget"
            )
        self.kv = PagedKVCache(spec, int(num_blocks), self.device)
        self.blocks = BlockManager(self.kv.num_blocks, bs, enable_prefix_caching=cfg.enable_prefix_caching)

        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.adapters = AdapterManager(
            self.adapter_root, mc, self.pool, max_rank=cfg.max_lora_rank, cpu_cache_bytes=cfg.cpu_cache_bytes,
            dtype=dtype, negative_ttl_s=cfg.negative_ttl_s, slot_wait_s=cfg.adapter_slot_wait_s, on_change=self._wake,
            build_expert_set=self._build_expert_set, max_expert_sets=cfg.max_expert_sets,
            eviction=cfg.adapter_eviction,
        )
        budget_tokens = max(cfg.max_num_batched_tokens, rows + 1)
        self.scheduler = Scheduler(
            self.blocks, self.adapters, base_names=frozenset({self.model_name, str(self.model_dir)}),
            max_num_seqs=rows, max_num_batched_tokens=budget_tokens, max_prefill_chunk=cfg.max_prefill_chunk,
            max_prefill_seqs=cfg.max_prefill_seqs, max_model_len=self.max_model_len, eos_token_ids=frozenset(eos),
            token_piece=self._token_piece,
        )
        self._pieces: dict[int, tuple[str, bytes]] = {}
        self._byte_level = _is_byte_level(self.tokenizer)
        self._special_ids = _special_ids(self.tokenizer)

        # Block tables of admitted sequences, one row each (row ``rows`` stays all zeros: padding
        # entries read it), mirrored on the device whenever a row grew.
        self._pad_row = rows
        self._table = np.zeros((rows + 1, self.max_blocks_per_seq), dtype=np.int32)
        self._table_dev = torch.zeros((rows + 1, self.max_blocks_per_seq), dtype=torch.int32, device=self.device)
        self._table_dirty = False
        self._decode_buckets = _buckets(rows)
        gmax = min(cfg.graph_max_tokens, budget_tokens)
        self._mixed_buckets = [b for b in (16 << i for i in range(16)) if b <= gmax]
        if gmax not in self._mixed_buckets and gmax >= 16:
            self._mixed_buckets.append(gmax)
        max_entries = rows + cfg.max_prefill_seqs
        self._max_entries = max(max_entries, budget_tokens)
        # Every step writes its sampled ids here; the next step's decode rows gather from it.
        self.last_tokens = torch.zeros(self._max_entries, dtype=torch.int64, device=self.device)
        self._scratch_tokens = torch.zeros_like(self.last_tokens)  # graph warm-ups write here
        self._cuda = self.device.type == "cuda"
        stage_len = 5 * budget_tokens + 4 * self._max_entries + 1
        # Host staging, three deep: step N+1 fills one while the copies of step N may still be
        # queued behind step N-1 on the stream.
        self._ring = 3
        self._stage = [self._host(torch.zeros(stage_len, dtype=torch.int64)) for _ in range(self._ring)]
        self._tstage = [self._host(torch.zeros_like(self._table_dev, device="cpu")) for _ in range(self._ring)]
        # Per step, one copy to the host: the sampled ids [S], then for logprob steps the values
        # [R, k + 1] (fp64 bits: the sampled token's, then the top k) and the top ids [R, k] of
        # the R <= rows + max_prefill_seqs asking rows (at most that many entries sample).
        self._lp_max_rows = rows + cfg.max_prefill_seqs
        out_len = self._max_entries + self._lp_max_rows * (2 * MAX_LOGPROBS + 1)
        self._out_dev = torch.zeros(out_len, dtype=torch.int64, device=self.device)
        self._tok_host = [self._host(torch.zeros(out_len, dtype=torch.int64)) for _ in range(self._ring)]
        self._lp_rows_host = [self._host(torch.zeros(self._lp_max_rows, dtype=torch.int64))
                              for _ in range(self._ring)]
        self.logprob_steps = 0
        self._ring_pos = 0
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self._cuda else 1
        self._overlap = self._cuda if cfg.async_scheduling is None else bool(cfg.async_scheduling)

        self._masters = BackboneMasters(self.model)
        # The expert set whose selection the backbone weights hold right now (merged path), that
        # selection, and the request it was merged for.
        self._merged: ExpertSet | None = None
        self._merged_sel: Selection | None = None
        self._merged_owner: Sequence | None = None
        # The current run of identical selections of one request: (seq, set, selection), length.
        self._streak: tuple[Sequence, ExpertSet, Selection] | None = None
        self._streak_len = 0
        self.adafuse_merges = 0  # fused_switch launches that merged a new selection
        self.adafuse_restores = 0  # launches that restored the pristine backbone
        self.adafuse_gated_steps = 0  # steps with several tokens or requests (eager, routed live)
        self.adafuse_merged_steps = 0  # single-request tokens run on merged weights
        self.adafuse_solo_gated_steps = 0  # single-request tokens on the gated path
        self.adafuse_compensated_steps = 0  # of those, run over a merged older selection
        self.adafuse_solo_graph_steps = 0  # of those, replayed in a decode graph
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
        self._graph_pool: Any = None
        self._graphs_ok = self._cuda and cfg.use_cuda_graphs
        self._solo_graphs_ok = self._graphs_ok
        self.graph_steps = 0
        self.eager_steps = 0
        self.step_profile: list[dict[str, Any]] = []
        self._event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._latency_cursor = 0
        self.steps = 0
        log.info(
            "engine ready: %s on %s (%s), kv %d blocks x %d tokens (%.1f MiB), %d sequences, lora slots %d, lora ops %s",
            self.model_name, self.device, dtype, self.kv.num_blocks, bs, self.kv.nbytes / 2**20, rows,
            cfg.max_loras, lora_ops.kernels_description(),
        )

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.device.type == "cuda" else t

    # ---- EngineProtocol -----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> EngineStream:
        if self._closed:
            raise EngineError("engine is shut down")
        self._validate(request)
        name = request.adapter
        if name is not None and name not in self.scheduler.base_names:
            self.adapters.check_request(name)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are already waiting")
        sp = request.sampling
        seq = Sequence(
            request=request, queue=asyncio.Queue(), detok=Detokenizer(self._decode_for_stream),
            prompt=list(request.prompt_token_ids),
            # Counter-based sampling: (seed, output index) decides each draw, so a request's
            # tokens do not depend on its batch neighbours or on preemption. Seeds of any size
            # are folded into the sampler's 63 bits.
            seed=sp.seed % (1 << 63) if sp.seed is not None else random.getrandbits(63),
        )
        self.scheduler.waiting.append(seq)
        self._ensure_loop()
        self._wake()
        return EngineStream(self, seq)

    def _validate(self, r: GenerationRequest) -> None:
        sp = r.sampling
        if not r.prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if len(r.prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(r.prompt_token_ids)} tokens leave no room to generate (max_model_len {self.max_model_len})"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in r.prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(sp.max_tokens, int) or sp.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {sp.max_tokens!r}")
        if not (sp.temperature >= 0.0) or sp.temperature == float("inf"):
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {sp.temperature!r}")
        if not (0.0 < sp.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {sp.top_p!r}")
        if sp.logprobs is not None and (
            not isinstance(sp.logprobs, int) or isinstance(sp.logprobs, bool) or not 0 <= sp.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}], got {sp.logprobs!r}"
            )
        if sp.seed is not None and (not isinstance(sp.seed, int) or sp.seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {sp.seed!r}")
        if not isinstance(sp.top_k, int) or isinstance(sp.top_k, bool) or sp.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {sp.top_k!r}")
        if not (0.0 <= sp.min_p <= 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {sp.min_p!r}")
        for fname in ("presence_penalty", "frequency_penalty"):
            val = getattr(sp, fname)
            if not (-2.0 <= val <= 2.0):
                raise InvalidRequestError(fname, f"must be in [-2, 2], got {val!r}")
        if not (0.0 < sp.repetition_penalty <= 10.0):
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 10], got {sp.repetition_penalty!r}")
        if any(not isinstance(s, str) or not s for s in sp.stop):
            raise InvalidRequestError("stop", "stop sequences must be non-empty strings")

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _decode_for_stream(self, token_ids: list[int]) -> str:
        # The Rust tokenizer directly: the Python wrapper costs more than the decode itself, and
        # this runs for every sequence on every step.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return str(backend.decode(token_ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _token_piece(self, tid: int) -> tuple[str, bytes]:
        """A token's text and exact bytes on its own (cached; logprob entries name tokens)."""
        hit = self._pieces.get(tid)
        if hit is None:
            hit = self._pieces[tid] = _piece_of(self.tokenizer, tid, self._byte_level, self._special_ids)
        return hit

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int] | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterInfo:
        self._ensure_loop()
        return await self.adapters.load(name, path, pinned=pinned)

    async def unload_adapter(self, name: str) -> None:
        await self.adapters.unload(name)

    def prefetch(self, names: list[str]) -> list[asyncio.Task[int]]:
        """Warm adapters into GPU slots ahead of their requests."""
        self._ensure_loop()
        return self.adapters.prefetch(names)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

    def stats(self) -> EngineStats:
        c = self.adapters.counters
        lat = tuple(c.latencies[self._latency_cursor :])
        self._latency_cursor = len(c.latencies)
        free_gpu = int(torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else 0
        sch = self.scheduler
        return EngineStats(
            num_waiting=len(sch.waiting), num_running=len(sch.running), kv_cache_usage=self.blocks.usage(),
            gpu_slots_used=self.adapters.slots_used(), gpu_slots_total=self.pool.num_slots,
            adapter_hits=c.hits, adapter_misses=c.misses, adapter_evictions=c.evictions,
            free_gpu_bytes=free_gpu, generated_tokens=sch.generated_tokens, new_load_latencies=lat,
            running_adapters=tuple(sorted({a for s in sch.running if (a := sch.adapter_of(s))})),
            waiting_adapters=tuple(sorted({a for s in sch.waiting if (a := sch.adapter_of(s))})),
            max_loras=self.pool.num_slots,
        )

    async def shutdown(self) -> None:
        self._closed = True
        self.scheduler.fail_all(EngineError("engine is shutting down"))
        for t in list(self.adapters.inflight.values()):
            t.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- the step loop ------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._event = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _needs_sync(self) -> bool:
        """Steps that decide on the host from tokens the device holds run without overlap:
        expert sets (the path depends on the token) and penalties (counts of past tokens)."""
        for s in self.scheduler.running:
            if s.expert_set is not None or _penalised(s):
                return True
        return bool(self._merged is not None)

    async def _run(self) -> None:
        assert self._event is not None
        inflight: _InFlight | None = None
        while not self._closed:
            self._event.clear()
            if inflight is not None and (not self._overlap or self._needs_sync()):
                await self._finish(inflight)
                inflight = None
            plan = self.scheduler.schedule(allow_preempt=inflight is None)
            if plan is None:
                if inflight is not None:
                    await self._finish(inflight)
                    inflight = None
                    continue
                if self._merged is not None:
                    await asyncio.to_thread(self._restore_backbone)
                    continue
                await self._event.wait()
                continue
            try:
                launched = await asyncio.to_thread(self._launch, plan) if self._cuda else self._launch(plan)
            except Exception as e:  # a failed step fails its requests; the engine keeps serving
                log.exception("engine step failed")
                self._fail(plan, e)
                continue
            if inflight is not None:
                await self._finish(inflight)
            inflight = launched
            if not self._overlap:
                await self._finish(inflight)
                inflight = None
            await asyncio.sleep(0)  # let HTTP handlers and adapter loads run between steps
        if inflight is not None:
            with contextlib.suppress(Exception):
                inflight.wait()

    def _fail(self, plan: StepPlan, e: BaseException) -> None:
        for seq in plan.sequences():
            self.scheduler.finish(seq, "error", EngineError(f"step failed: {e}"))
        # Blocks the failed step was writing may have been registered for sharing.
        self.blocks.reset_prefix_cache()

    async def _finish(self, fl: _InFlight) -> None:
        try:
            toks = await asyncio.to_thread(fl.wait) if fl.done is not None else fl.wait()
        except Exception as e:
            log.exception("engine step failed on the device")
            for s in fl.samplers:
                s.pending -= 1
            self._fail(fl.plan, e)
            return
        self.scheduler.apply(fl.samplers, *toks)
        self.steps += 1
        if self.config.profile_steps:
            gpu_ms = float(fl.started.elapsed_time(fl.done)) if fl.done is not None else 0.0
            self.step_profile.append({"rows": len(fl.plan.decode) + len(fl.plan.prefill), "tokens": fl.tokens,
                                      "graph": fl.graph, "host_ms": fl.host_ms, "gpu_ms": gpu_ms})

    # ---- launching a step (worker thread on CUDA) -------------------------------------------

    def _lora_side(self, lora: bool) -> bool:
        # Part of a graph's key: a graph records the LoRA path it was captured with.
        return lora and self.model.lora_side is not None

    def _layout(self, plan: StepPlan, graphable: bool, lora: bool, mode: SamplerMode,
                solo: ExpertSet | None) -> _Layout:
        nd, npf, T = len(plan.decode), len(plan.prefill), plan.num_tokens
        dec: list[Sequence | None] = list(plan.decode)
        pre: list[Sequence | None] = [s if start + n >= s.known_len else None for s, start, n in plan.prefill]
        random_mode = mode.any_random
        if graphable and npf == 0:
            b = _bucket(nd, self._decode_buckets)
            if b is not None:
                return _Layout(b, b, b, 0, dec + [None] * (b - nd), ("d", b, lora, random_mode, solo, self._lora_side(lora)))
        if graphable and solo is None and npf <= self.config.max_prefill_seqs:
            tb = _bucket(T, self._mixed_buckets)
            if tb is not None:
                dr = min(self.config.max_num_seqs, tb)
                P = self.config.max_prefill_seqs
                entries = dec + [None] * (dr - nd) + pre + [None] * (P - npf)
                return _Layout(tb, dr + P, dr, tb, entries, ("m", tb, lora, random_mode, self._lora_side(lora)))
        mp = max((n for _, _, n in plan.prefill), default=0)
        return _Layout(T, nd + npf, nd, mp, dec + pre, None)

    def _fill(self, stage: np.ndarray[Any, Any], lay: _Layout, plan: StepPlan) -> list[tuple[int, int]]:
        """Write the step's inputs into ``stage`` (the int64 staging layout of _StepBuffers);
        returns each plan sequence's (first row, rows)."""
        T, S = lay.T, lay.S
        bs = self.kv.block_size
        tab = self._table
        ids, src, pos, slot, lora = (stage[i * T : (i + 1) * T] for i in range(5))
        o = 5 * T
        seq_lens, lrows, trows = stage[o : o + S], stage[o + S : o + 2 * S], stage[o + 2 * S : o + 3 * S]
        qs = stage[o + 3 * S : o + 4 * S + 1]
        ids[:] = 0
        src[:] = -1
        pos[:] = 0
        slot[:] = -1
        lora[:] = -1
        seq_lens[:] = 0
        lrows[:] = 0
        trows[:] = self._pad_row
        ranges: list[tuple[int, int]] = []
        nd = len(plan.decode)
        for j, s in enumerate(plan.decode):
            self._mirror(s)
            p = s.num_computed
            row = s.table_row
            assert row is not None
            if s.pending:
                src[j] = s.last_entry
            else:
                ids[j] = s.token_at(p)
            pos[j] = p
            slot[j] = int(tab[row, p // bs]) * bs + p % bs
            lora[j] = s.lora_slot
            seq_lens[j] = p + 1
            lrows[j] = j
            trows[j] = row
            ranges.append((j, 1))
        qs[: nd + 1] = np.arange(nd + 1)
        qs[nd + 1 : lay.num_decode + 1] = nd
        cursor = nd
        e = lay.num_decode
        for s, start, n in plan.prefill:
            self._mirror(s)
            assert s.pending == 0
            assert s.table_row is not None
            row = s.table_row
            r = slice(cursor, cursor + n)
            if start + n <= len(s.prompt):
                ids[r] = s.prompt[start : start + n]
            else:
                ids[r] = [s.token_at(q) for q in range(start, start + n)]
            p_arr = np.arange(start, start + n)
            pos[r] = p_arr
            slot[r] = tab[row, p_arr // bs].astype(np.int64) * bs + p_arr % bs
            lora[r] = s.lora_slot
            seq_lens[e] = start + n
            lrows[e] = cursor + n - 1
            trows[e] = row
            qs[e] = cursor
            ranges.append((cursor, n))
            cursor += n
            e += 1
        qs[e:] = cursor
        return ranges

    def _mirror(self, s: Sequence) -> None:
        """Copy the sequence's new block-table entries into its row of the mirror."""
        need = -(-s.reserved // self.kv.block_size)
        if s.table_len >= need:
            return
        bt = self.blocks.block_table(s.seq_id)
        assert s.table_row is not None
        self._table[s.table_row, s.table_len : len(bt)] = bt[s.table_len :]
        s.table_len = len(bt)
        self._table_dirty = True

    def _row_params(self, entries: list[Sequence | None]) -> list[RowParams]:
        out: list[RowParams] = []
        for s in entries:
            if s is None:
                out.append(RowParams(temperature=0.0))
                continue
            sp = s.request.sampling
            out.append(RowParams(
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=s.seed,
                counter=len(s.output) + s.pending, presence_penalty=sp.presence_penalty,
                frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
            ))
        return out

    def _splits(self, num_seqs: int, max_len: int) -> int:
        if not self._cuda:
            return 1
        from adaptermesh.kernels.paged_attention import decode_splits

        return int(decode_splits(num_seqs, self.model_config.num_kv_heads, max_len, self._num_sms))

    def _launch(self, plan: StepPlan) -> _InFlight:
        t0 = time.perf_counter()
        single = self._single_expert_token(plan)
        if self._merged is not None and (
            single is None or single.es is not self._merged or single.seq is not self._merged_owner
        ):
            self._restore_backbone()  # nothing else may ever run on merged weights
        solo_sel: torch.Tensor | None = None
        if single is not None:
            solo_sel = self._choose_solo_path(single)
        else:
            self._streak, self._streak_len = None, 0
        seqs = plan.sequences()
        has_sets = single is None and any(s.expert_set is not None for s in seqs)
        penalties = any(_penalised(s) for s in seqs)
        lora = any(s.lora_slot >= 0 for s in seqs)
        solo_es = single.es if single is not None and solo_sel is not None else None
        random_mode = any(s.request.sampling.temperature > 0 for s in seqs)
        mode = _RANDOM if random_mode else _GREEDY
        graphable = self._graphs_ok and not has_sets and not penalties and (solo_es is None or self._solo_graphs_ok)
        lay = self._layout(plan, graphable, lora, mode, solo_es)
        k = self._ring_pos
        self._ring_pos = (k + 1) % self._ring
        stage = self._stage[k]
        g: _Graph | None = None
        if lay.key is not None:
            g = self._graphs.get(lay.key)
            if g is None:
                g = self._try_capture(lay, lora, mode, solo_es)
                if g is None:
                    lay = self._layout(plan, False, lora, mode, None)
        buf = g.buf if g is not None else _StepBuffers(lay.T, lay.S, self.device)
        ranges = self._fill(stage.numpy(), lay, plan)
        samplers = self.scheduler.launched(plan)
        entries = [e for e, s in enumerate(lay.entries) if s is not None]
        for e in entries:
            s = lay.entries[e]
            assert s is not None
            s.last_entry = e
        started = done = None
        if self._cuda:
            started = torch.cuda.Event(enable_timing=self.config.profile_steps)  # type: ignore[no-untyped-call]
            started.record()
        if self._table_dirty:
            ts = self._tstage[k]
            ts.numpy()[:] = self._table
            self._table_dev.copy_(ts, non_blocking=True)
            self._table_dirty = False
        buf.dev.copy_(stage[: buf.size], non_blocking=True)
        params = self._row_params(lay.entries)
        logits: torch.Tensor | None = None
        step_sbuf: SamplingBuffers | None = g.sbuf if g is not None else None
        step_mode = mode
        if g is not None:
            g.sbuf.fill(params)
            if solo_es is not None:
                assert g.sel is not None
                assert solo_sel is not None
                g.sel.copy_(solo_sel.pin_memory() if self._cuda else solo_sel, non_blocking=True)
                self.adafuse_solo_graph_steps += 1
            g.graph.replay()
            self.graph_steps += 1
        else:
            sbuf = SamplingBuffers.allocate(lay.S, self.device)
            sbuf.fill(params)
            gated: GatedTerms | None = None
            if has_sets:
                gated = self._gated_batch(plan, ranges, lay.T)
            elif solo_es is not None:
                assert solo_sel is not None
                gated = SoloGated(solo_es, solo_sel.to(self.device), 1, self.model_config)
            mode_e = SamplerMode.of(params) if penalties else mode
            step_sbuf, step_mode = sbuf, mode_e
            split = self._splits(lay.num_decode, max((s.num_computed + 1 for s in plan.decode), default=1))
            logits = self._step(buf, lay, split, lora, sbuf, mode_e, gated, self.last_tokens, penalties)
            self.eager_steps += 1
        host = self._tok_host[k]
        wants = [s.request.sampling.logprobs for s in samplers]
        lp_index: list[int] | None = None
        lp_want: list[int] | None = None
        rows_lp = kmax = 0
        if any(w is not None for w in wants):
            step_logits = g.logits if g is not None else logits
            assert step_logits is not None
            assert step_sbuf is not None
            if self.config.logprobs_mode == "processed":
                step_logits = self._processed_logits(step_logits, lay, step_sbuf, step_mode)
            lp_index, lp_want = [], []
            asking: list[int] = []
            for s, w in zip(samplers, wants, strict=True):
                lp_index.append(len(asking) if w is not None else -1)
                lp_want.append(w or 0)
                if w is not None:
                    asking.append(s.last_entry)
            rows_lp, kmax = len(asking), max(lp_want)
            n_out = self._gather_logprobs(step_logits, lay.S, asking, kmax, self._lp_rows_host[k])
            host[:n_out].copy_(self._out_dev[:n_out], non_blocking=True)
            self.logprob_steps += 1
        else:
            host[: lay.S].copy_(self.last_tokens[: lay.S], non_blocking=True)
        if self._cuda:
            done = torch.cuda.Event(enable_timing=self.config.profile_steps)  # type: ignore[no-untyped-call]
            done.record()
        del logits
        return _InFlight(plan, samplers, [s.last_entry for s in samplers], host, lay.S, done, started,
                         1e3 * (time.perf_counter() - t0), g is not None, len(seqs), plan.num_tokens,
                         lp_index=lp_index, lp_want=lp_want, lp_rows=rows_lp, lp_k=kmax)

    def _gather_logprobs(self, logits: torch.Tensor, S: int, entries: list[int], k: int,
                         rows_host: torch.Tensor) -> int:
        """Fill ``_out_dev`` with the step's ids [S], then the fp64 bits of [R, k + 1] values
        (each asking entry's sampled-token logprob, then its top k) and the top ids [R, k];
        returns how many int64 elements to copy. All on the device, after the step's work on
        the same stream; no host synchronisation."""
        R = len(entries)
        rows_host[:R] = torch.tensor(entries, dtype=torch.int64)
        rows = rows_host[:R].to(self.device, non_blocking=True)
        out = self._out_dev
        out[:S].copy_(self.last_tokens[:S])
        chosen, top_vals, top_ids = token_logprobs(
            logits.index_select(0, rows), self.last_tokens.index_select(0, rows), k)
        vals = out[S : S + R * (k + 1)].view(torch.float64).view(R, k + 1)
        vals[:, 0] = chosen
        if k:
            vals[:, 1:] = top_vals
            out[S + R * (k + 1) : S + R * (2 * k + 1)].view(R, k).copy_(top_ids)
        return S + R * (2 * k + 1)

    def _processed_logits(self, logits: torch.Tensor, lay: _Layout, sbuf: SamplingBuffers,
                          mode: SamplerMode) -> torch.Tensor:
        """The step's logits as the sampler processed them (same buffers, same mode), for
        ``logprobs_mode="processed"``; penalty steps rebuild their token counts."""
        counts = pmask = None
        if mode.penalties:
            counts, pmask = self._penalty_inputs(lay, int(logits.shape[1]), mode)
        return processed_logits(logits[: lay.S], sbuf, mode=mode, token_counts=counts, prompt_mask=pmask)

    def _step(self, buf: _StepBuffers, lay: _Layout, splits: int, lora: bool, sbuf: SamplingBuffers,
              mode: SamplerMode, gated: GatedTerms | None, dst: torch.Tensor, penalties: bool = False) -> torch.Tensor:
        """The whole step on the device: input gather, forward, sampling, write of the ids."""
        src = buf.src
        ids = torch.where(src >= 0, self.last_tokens.index_select(0, src.clamp(min=0)), buf.ids)
        inp = StepInputs(
            input_ids=ids, positions=buf.pos, slot_mapping=buf.slot, token_slots=buf.lora.to(torch.int32),
            block_tables=self._table_dev.index_select(0, buf.table_rows), seq_lens=buf.seq_lens.to(torch.int32),
            query_start=buf.query_start.to(torch.int32), logits_rows=buf.logits_rows,
            num_decode=lay.num_decode, max_prefill_len=lay.max_prefill_len, num_splits=splits,
        )
        meta = lora_ops.build_meta(inp.token_slots, self.pool.num_slots) if lora else None
        logits = self.model.forward(inp, self.kv, self.pool if lora else None, meta, gated)
        if penalties:
            toks = self._sample_penalised(logits, sbuf, lay)
        else:
            toks = sample_logits(logits, sbuf, mode, lay.entries)
        dst[: toks.shape[0]].copy_(toks)
        return logits

    def _sample_penalised(self, logits: torch.Tensor, sbuf: SamplingBuffers, lay: _Layout) -> torch.Tensor:
        mode = SamplerMode.of(self._row_params(lay.entries))
        counts, pmask = self._penalty_inputs(lay, int(logits.shape[1]), mode)
        return sample_logits_penalised(logits, sbuf, mode, lay.entries, counts, pmask)

    def _penalty_inputs(self, lay: _Layout, vocab: int, mode: SamplerMode
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        from adaptermesh.worker.sampling import counts_from_tokens, prompt_mask_from_tokens

        outs = [list(s.output) if s is not None else [] for s in lay.entries]
        prompts = [[*s.prompt, *s.output] if s is not None else [] for s in lay.entries]
        counts = counts_from_tokens(outs, vocab, self.device) if mode.penalties else None
        pmask = prompt_mask_from_tokens(prompts, vocab, self.device) if mode.repetition else None
        return counts, pmask

    def _try_capture(self, lay: _Layout, lora: bool, mode: SamplerMode, es: ExpertSet | None) -> _Graph | None:
        assert lay.key is not None
        try:
            g = self._capture(lay, lora, mode, es)
        except Exception:
            if es is not None:  # the plain graphs stay in use
                log.exception("CUDA graph capture of a solo expert-set step failed; those run eagerly from now on")
                self._solo_graphs_ok = False
                return None
            log.exception("CUDA graph capture failed; running steps eagerly from now on")
            self._graphs_ok = False
            return None
        if es is not None:
            self._prune_solo_graphs()
        self._graphs[lay.key] = g
        return g

    def _capture(self, lay: _Layout, lora: bool, mode: SamplerMode, es: ExpertSet | None) -> _Graph:
        dev = self.device
        buf = _StepBuffers(lay.T, lay.S, dev)
        # Padding everywhere: the warm-ups write no KV slot, read no key, use no adapter.
        pad = np.zeros(buf.size, dtype=np.int64)
        T, S = lay.T, lay.S
        pad[T : 2 * T] = -1
        pad[3 * T : 5 * T] = -1
        pad[5 * T + 2 * S : 5 * T + 3 * S] = self._pad_row
        buf.dev.copy_(torch.from_numpy(pad).to(dev))
        sbuf = SamplingBuffers.allocate(lay.S, dev)
        sbuf.fill([])
        sel: torch.Tensor | None = None
        gated: SoloGated | None = None
        if es is not None:
            sel = es.solo_empty(1, dev)
            gated = SoloGated(es, sel, 1, self.model_config)
        splits = self._splits(lay.num_decode, self.max_model_len)
        lay_c = _Layout(lay.T, lay.S, lay.num_decode, lay.max_prefill_len, [None] * lay.S, lay.key)
        side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation and autotuning must not be captured
                self._step(buf, lay_c, splits, lora, sbuf, mode, gated, self._scratch_tokens)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: adapter uploads on the event-loop thread may run during the capture.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = self._step(buf, lay_c, splits, lora, sbuf, mode, gated, self.last_tokens)
        # Keeping the output referenced keeps its memory out of later captures in the shared
        # pool, so logprob steps can read it after a replay.
        return _Graph(graph, buf, sbuf, sel, logits)

    def _prune_solo_graphs(self) -> None:
        """Drop solo graphs of expert sets that are neither resident nor held by a running
        request: their graphs keep the sets' device tensors alive."""
        live = {id(ps.expert_set) for ps in self.adapters.expert_sets.values()}
        live |= {id(s.expert_set) for s in self.scheduler.running if s.expert_set is not None}
        for key in [k for k in self._graphs if k[0] == "d" and k[4] is not None and id(k[4]) not in live]:
            del self._graphs[key]

    def _gated_batch(self, plan: StepPlan, ranges: list[tuple[int, int]], T: int) -> GatedBatch:
        """Which rows of the flat batch each expert set owns."""
        sets: list[ExpertSet] = []
        index: dict[int, int] = {}
        token_set = [-1] * T
        for s, (r0, n) in zip(plan.sequences(), ranges, strict=True):
            if s.expert_set is None:
                continue
            if id(s.expert_set) not in index:
                index[id(s.expert_set)] = len(sets)
                sets.append(s.expert_set)
            token_set[r0 : r0 + n] = [index[id(s.expert_set)]] * n
        self.adafuse_gated_steps += 1
        t = torch.tensor(token_set, dtype=torch.int32, device=self.device)
        return GatedBatch(sets, t, self.model_config)

    # ---- expert sets ----------------------------------------------------------------------------

    def _build_expert_set(self, cpu: CpuExpertSet, version: int) -> ExpertSet:
        return ExpertSet.build(cpu, self.model, self._masters, version)

    def _restore_backbone(self) -> None:
        if self._merged is not None:
            self._merged.unmerge()
            self._merged = None
            self._merged_sel = None
            self._merged_owner = None
            self.adafuse_restores += 1

    def _single_expert_token(self, plan: StepPlan) -> _SoloStep | None:
        """The step when it is exactly one token of one expert-set request."""
        if len(plan.decode) == 1 and not plan.prefill:
            s = plan.decode[0]
            if s.expert_set is None:
                return None
            return _SoloStep(s, s.expert_set, s.token_at(s.num_computed), 1, 0)
        if not plan.decode and len(plan.prefill) == 1 and plan.prefill[0][2] == 1:
            s, start, _ = plan.prefill[0]
            return _SoloStep(s, s.expert_set, s.token_at(start), 1, 0) if s.expert_set is not None else None
        return None

    def _choose_solo_path(self, solo: _SoloStep) -> torch.Tensor | None:
        """Merge or not, for one token of one request. Returns None to run the step on merged
        weights (plain base step), else the host selection rows for ``SoloGated``.

        Cost rule: a switch moves every targeted weight (read W0, write W); the gated path
        moves only the token's experts. So merge only a selection that keeps repeating."""
        es, seq = solo.es, solo.seq
        sel = es.selection(solo.token)
        key = (seq, es, sel)
        st = self._streak
        if st is not None and st[0] is seq and st[1] is es and st[2] == sel:
            self._streak_len += 1
        else:
            self._streak, self._streak_len = key, 1
        if self._merged is es and self._merged_sel == sel:
            self.adafuse_merged_steps += 1
            return None
        n = self.config.adafuse_merge_after
        if n > 0 and self._streak_len >= n:
            es.merge(sel)  # exact mode: rebuilt from W0, so any previous selection is gone
            self._merged, self._merged_sel, self._merged_owner = es, sel, seq
            self.adafuse_merges += 1
            self.adafuse_merged_steps += 1
            return None
        # The caller restored the backbone unless it holds this request's set.
        held = self._merged_sel if self._merged is es else None
        self.adafuse_solo_gated_steps += 1
        if held is not None:
            self.adafuse_compensated_steps += 1
        return es.solo_rows(solo.rows, solo.row, sel, held)

    # ---- introspection for tests and benches ----------------------------------------------------

    @property
    def cuda_graphs_active(self) -> bool:
        return self._graphs_ok and bool(self._graphs)

    def describe(self) -> dict[str, Any]:
        keys = sorted((k for k in self._graphs), key=repr)
        return {
            "model": self.model_name, "device": str(self.device), "dtype": str(self.dtype),
            "max_num_seqs": self.config.max_num_seqs, "kv_slots": self.config.max_num_seqs,
            "max_model_len": self.max_model_len, "lora_slots": self.pool.num_slots,
            "kv_blocks": self.kv.num_blocks, "block_size": self.kv.block_size, "kv_tokens": self.kv.num_tokens,
            "kv_cached_blocks": self.blocks.num_cached_blocks(),
            "prefix_hit_tokens": self.blocks.stats.hit_tokens, "prefix_query_tokens": self.blocks.stats.query_tokens,
            "preemptions": self.scheduler.preemptions,
            "lora_ops": lora_ops.kernels_description(), "cuda_graphs": self.cuda_graphs_active,
            "graph_buckets": [list(map(str, k[:4])) for k in keys],
            "decode_buckets": list(self._decode_buckets), "mixed_buckets": list(self._mixed_buckets),
            "graph_steps": self.graph_steps, "eager_steps": self.eager_steps, "async_scheduling": self._overlap,
            "weights_bytes": self.model.nbytes, "pool_bytes": self.pool.nbytes, "kv_bytes": self.kv.nbytes,
            "expert_sets": len(self.adapters.expert_sets), "backbone_master_bytes": self._masters.nbytes,
            "adafuse_merges": self.adafuse_merges, "adafuse_restores": self.adafuse_restores,
            "adafuse_gated_steps": self.adafuse_gated_steps, "adafuse_merged_steps": self.adafuse_merged_steps,
            "adafuse_solo_gated_steps": self.adafuse_solo_gated_steps,
            "adafuse_compensated_steps": self.adafuse_compensated_steps,
            "adafuse_solo_graph_steps": self.adafuse_solo_graph_steps,
            "adafuse_merge_after": self.config.adafuse_merge_after,
            "solo_graphs": sum(1 for k in self._graphs if k[0] == "d" and k[4] is not None),
        }


def _byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every other
    byte for the code point 256 + its rank among them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _byte_to_char().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return "ByteLevel" in json.dumps(decoder)


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Named special tokens and added tokens marked special (the text skips both)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
    return frozenset(ids)


def _piece_of(tokenizer: Any, tid: int, byte_level: bool, special: frozenset[int]) -> tuple[str, bytes]:
    """(text, exact bytes) of one token on its own. Byte-level vocabularies map back to their
    bytes (a token may hold part of a multi-byte character; its text then shows U+FFFD);
    SentencePiece byte tokens (<0xE2>) are that byte; special tokens are spelt out."""
    tok = tokenizer.convert_ids_to_tokens(tid)
    if not isinstance(tok, str):
        tok = ""
    if tid in special:
        return tok, tok.encode()
    if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
        with contextlib.suppress(ValueError):
            raw = bytes([int(tok[3:5], 16)])
            return raw.decode("utf-8", errors="replace"), raw
    if byte_level and all(c in _CHAR_TO_BYTE for c in tok):
        raw = bytes(_CHAR_TO_BYTE[c] for c in tok)
        return raw.decode("utf-8", errors="replace"), raw
    text = tok.replace("\u2581", " ") if "\u2581" in tok else str(
        tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return text, text.encode()


def _penalised(s: Sequence) -> bool:
    sp = s.request.sampling
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0


def sample_logits_penalised(logits: torch.Tensor, buf: SamplingBuffers, mode: SamplerMode,
                            rows: list[Sequence | None], counts: torch.Tensor | None,
                            prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """``sample_logits`` with penalties over each row's past tokens (eager steps only)."""
    del rows
    return sample(logits, buf, mode=mode, token_counts=counts, prompt_mask=prompt_mask)
