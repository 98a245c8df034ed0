"""``Engine``: the worker's inference engine, implementing ``types.EngineProtocol``.

The engine owns one model, one KV cache, one LoRA pool and one adapter manager. A background
task on the caller's event loop repeats: plan a step (scheduler, on the loop), run it (forward +
sampling, in a worker thread so the loop keeps serving HTTP and adapter loads), and deliver
tokens to each request's stream.

On CUDA, pure-decode steps replay a CUDA graph per context-length bucket; the graph covers every
KV slot, so its shapes never change. Steps that contain prompt chunks run eagerly.

AdaFuse expert sets (``adafuse.py``): a step that is a single token of a single expert-set
request picks by cost. Merging a selection into the backbone (one ``fused_switch``) reads and
writes every targeted weight, gigabytes on a 7B model, while the unmerged gated path reads only
the selected experts' LoRA matrices. So the step runs on merged weights only when they already
hold the token's selection, or when the same selection has now repeated for
``EngineConfig.adafuse_merge_after`` consecutive tokens (then it merges once); otherwise it runs
the gated path on top of whatever the backbone holds (cancelling a merged selection with
negated gates), in the decode CUDA graph on a GPU. Any step that runs another request first
restores the pristine backbone (bit-exact), and so does going idle, so the weights are only
ever merged for the request that is running alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from adaptermesh.worker.kv_cache import KVCache, KVCacheSpec, kv_bytes_per_slot, slots_for_budget
from adaptermesh.worker.model import (
    BatchInputs,
    LoraPool,
    ModelConfig,
    PrefillSegment,
    TransformerModel,
    read_weights,
)
from adaptermesh.worker.scheduler import Detokenizer, Scheduler, Sequence, StepPlan, sample_rows
from adaptermesh.worker.types import (
    AdapterInfo,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
)

__all__ = ["Engine", "EngineConfig", "EngineStream"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """Limits and sizes. Defaults suit a CPU test box; GPU deployments raise them."""

    max_model_len: int | None = None  # None: min(config max_position_embeddings, 4096)
    max_num_seqs: int = 8  # KV slots = decode batch rows (fewer if the memory budget is short)
    max_loras: int = 8  # GPU pool slots
    max_lora_rank: int = 64
    max_num_batched_tokens: int = 512  # token budget per step (decode rows + prompt chunks)
    max_prefill_chunk: int = 256
    gpu_memory_fraction: float = 0.85  # of total GPU memory, for weights + pool + KV cache
    kv_cache_bytes: int | None = None  # CPU (or explicit) KV budget; default 256 MiB on CPU
    cpu_cache_bytes: int = 2 << 30  # adapter CPU cache budget
    negative_ttl_s: float = 30.0
    max_waiting: int = 4096
    use_cuda_graphs: bool = True
    adapter_slot_wait_s: float = 10.0
    max_expert_sets: int = 4  # resident AdaFuse expert sets (device memory outside the LoRA pool)
    # A request decoding alone merges its expert selection into the backbone only after the
    # same selection has repeated for this many consecutive tokens (0: never merge).
    adafuse_merge_after: int = 4


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


class _DecodeGraph:
    """A captured decode step over every KV slot, for one context-length bucket.

    ``sel``: for a solo expert-set graph, the static int32 [2, slots, 2k] selection buffer."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: BatchInputs, logits: torch.Tensor,
                 sel: torch.Tensor | None = None) -> None:
        self.graph = graph
        self.inputs = inputs
        self.logits = logits
        self.sel = sel


@dataclass(slots=True)
class _SoloStep:
    """One token of one expert-set request: where its row sits in the step's flat batch."""

    seq: Sequence
    es: ExpertSet
    token: int
    rows: int  # rows of the flat batch
    row: int  # the request's row


class _PrefillGraph:
    """A captured first-chunk prefill of one prompt, padded to ``bucket`` tokens."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: BatchInputs, logits: torch.Tensor, bucket: int) -> None:
        self.graph = graph
        self.inputs = inputs
        self.logits = logits
        self.bucket = bucket


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
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        self.model_name = model_name or self.model_dir.name
        self.max_model_len = int(cfg.max_model_len or min(mc.max_position_embeddings, 4096))
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.model_dir))

        tensors = weights if weights is not None else read_weights(self.model_dir)
        self.model = TransformerModel(mc, tensors, self.device, dtype, self.max_model_len)
        self.pool = LoraPool(mc, cfg.max_loras, cfg.max_lora_rank, self.device, dtype)
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.max_model_len, dtype)
        if not isinstance(cfg.adafuse_merge_after, int) or isinstance(cfg.adafuse_merge_after, bool) \
                or cfg.adafuse_merge_after < 0:
            raise InvalidRequestError(
                "adafuse_merge_after", f"must be an integer >= 0, got {cfg.adafuse_merge_after!r}"
            )
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cfg.gpu_memory_fraction) - used - (256 << 20)  # headroom for activations
        else:
            budget = 256 << 20
        self.kv = KVCache(spec, slots_for_budget(spec, budget, cfg.max_num_seqs), self.device)
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.adapters = AdapterManager(
            self.adapter_root, mc, self.pool, max_rank=cfg.max_lora_rank, cpu_cache_bytes=cfg.cpu_cache_bytes,
            dtype=dtype, negative_ttl_s=cfg.negative_ttl_s, slot_wait_s=cfg.adapter_slot_wait_s, on_change=self._wake,
            build_expert_set=self._build_expert_set, max_expert_sets=cfg.max_expert_sets,
        )
        self.scheduler = Scheduler(
            self.kv, self.adapters, base_names=frozenset({self.model_name, str(self.model_dir)}),
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, self.kv.num_slots + 1),
            max_prefill_chunk=cfg.max_prefill_chunk, max_model_len=self.max_model_len, eos_token_ids=frozenset(eos),
        )
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
        self._graphs: dict[int, _DecodeGraph] = {}
        self._solo_graphs: dict[tuple[int, ExpertSet], _DecodeGraph] = {}
        self._prefill_graphs: dict[int, _PrefillGraph] = {}
        # Prompts up to this many tokens prefill through a graph when they run alone.
        self._prefill_graph_max = min(512, self.max_model_len, cfg.max_prefill_chunk)
        self._prefill_graphs_ok = self.device.type == "cuda" and cfg.use_cuda_graphs
        self._graph_pool: Any = None
        self._graphs_ok = self.device.type == "cuda" and cfg.use_cuda_graphs
        self._solo_graphs_ok = self._graphs_ok
        self._event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._latency_cursor = 0
        self.steps = 0
        log.info(
            "engine ready: %s on %s (%s), kv slots %d x %d tokens (%.1f MiB), lora slots %d, lora ops %s",
            self.model_name, self.device, dtype, self.kv.num_slots, self.max_model_len,
            kv_bytes_per_slot(spec) * self.kv.num_slots / 2**20, cfg.max_loras, lora_ops.kernels_description(),
        )

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
        gen = None
        if sp.temperature > 0:
            gen = torch.Generator()
            if sp.seed is not None:
                gen.manual_seed(sp.seed)
            else:
                gen.seed()
        seq = Sequence(
            request=request, queue=asyncio.Queue(), detok=Detokenizer(self._decode_for_stream),
            prompt=list(request.prompt_token_ids), generator=gen,
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
        if sp.seed is not None and (not isinstance(sp.seed, int) or sp.seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {sp.seed!r}")
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
            num_waiting=len(sch.waiting), num_running=len(sch.running), kv_cache_usage=self.kv.usage(),
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

    async def _run(self) -> None:
        assert self._event is not None
        while not self._closed:
            self._event.clear()
            plan = self.scheduler.schedule()
            if plan is None:
                if self._merged is not None:
                    await asyncio.to_thread(self._restore_backbone)
                    continue
                await self._event.wait()
                continue
            try:
                sampled = await asyncio.to_thread(self._execute, plan)
            except Exception as e:  # a failed step fails its requests; the engine keeps serving
                log.exception("engine step failed")
                for seq in [*plan.decode, *(s for s, _, _ in plan.prefill)]:
                    self.scheduler.finish(seq, "error", EngineError(f"step failed: {e}"))
                continue
            self.scheduler.apply(plan, sampled)
            self.steps += 1

    # ---- execution (worker thread) ------------------------------------------------------------

    def _len_bucket(self, n: int) -> int:
        b = 16
        while b < n:
            b *= 2
        return min(b, self.max_model_len)

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
            assert s.kv_slot is not None
            return _SoloStep(s, s.expert_set, s.output[-1], self.kv.num_slots, s.kv_slot)
        if not plan.decode and len(plan.prefill) == 1 and plan.prefill[0][2] == 1:
            s, start, _ = plan.prefill[0]
            return _SoloStep(s, s.expert_set, s.prompt[start], 1, 0) if s.expert_set is not None else None
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

    def _execute(self, plan: StepPlan) -> dict[int, int]:
        sample_seqs: list[Sequence] = []
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
        has_sets = single is None and any(
            s.expert_set is not None for s in [*plan.decode, *(p[0] for p in plan.prefill)]
        )
        if (self._prefill_graphs_ok and not plan.decode and len(plan.prefill) == 1 and not has_sets
                and solo_sel is None):
            s, start, n = plan.prefill[0]
            if start == 0 and n <= self._prefill_graph_max:
                logits = self._run_prefill_graph(s, n)
                if logits is not None:
                    if n < len(s.prompt):
                        return {}  # more chunks follow; nothing to sample yet
                    return {id(s): sample_rows(logits, [s])[0]}
        solo = None if single is None or solo_sel is None else (single.es, solo_sel)
        if plan.decode and not plan.prefill and self._graphs_ok and not has_sets and (solo is None or self._solo_graphs_ok):
            logits_all = self._run_graph(plan, solo)
            if logits_all is not None:
                if solo is not None:
                    self.adafuse_solo_graph_steps += 1
                rows = torch.tensor([s.kv_slot for s in plan.decode], device=self.device)
                logits = logits_all.index_select(0, rows)
                toks = sample_rows(logits, plan.decode)
                return {id(s): t for s, t in zip(plan.decode, toks, strict=True)}
        batch, sample_seqs = self._build_batch(plan)
        meta = lora_ops.build_meta(batch.token_slots, self.pool.num_slots)
        gated: GatedTerms | None = None
        if has_sets:
            gated = self._gated_batch(plan, batch)
        elif single is not None and solo_sel is not None:
            gated = SoloGated(single.es, solo_sel.to(self.device), single.rows, self.model_config)
        logits = self.model.forward(batch, self.kv, self.pool, meta, gated)
        toks = sample_rows(logits, sample_seqs)
        return {id(s): t for s, t in zip(sample_seqs, toks, strict=True)}

    def _decode_arrays(self, plan: StepPlan) -> tuple[list[int], list[int], list[int], list[int], list[int], int]:
        n = self.kv.num_slots
        ids, pos, write, slots, lens = [0] * n, [0] * n, [self.kv.scratch_slot] * n, [-1] * n, [1] * n
        for s in plan.decode:
            assert s.kv_slot is not None
            r = s.kv_slot
            ids[r] = s.output[-1]
            pos[r] = s.context_len - 1
            write[r] = r
            slots[r] = s.lora_slot
            lens[r] = s.context_len
        return ids, pos, write, slots, lens, self._len_bucket(max(lens))

    def _build_batch(self, plan: StepPlan) -> tuple[BatchInputs, list[Sequence]]:
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sample_seqs: list[Sequence] = []
        decode_rows = 0
        lens_t = None
        bucket = 0
        if plan.decode:
            ids, pos, write, slots, lens, bucket = self._decode_arrays(plan)
            decode_rows = len(ids)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)
            for s in plan.decode:
                assert s.kv_slot is not None
                rows.append(s.kv_slot)
                sample_seqs.append(s)
        segs: list[PrefillSegment] = []
        for s, start, n in plan.prefill:
            assert s.kv_slot is not None
            off = len(ids)
            ids.extend(s.prompt[start : start + n])
            pos.extend(range(start, start + n))
            write.extend([s.kv_slot] * n)
            slots.extend([s.lora_slot] * n)
            segs.append(PrefillSegment(s.kv_slot, start, n, off))
            if start + n == len(s.prompt):
                rows.append(off + n - 1)
                sample_seqs.append(s)
        dev = self.device
        batch = BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            write_slots=torch.tensor(write, dtype=torch.int64, device=dev),
            token_slots=torch.tensor(slots, dtype=torch.int32, device=dev),
            decode_rows=decode_rows, decode_lengths=lens_t, decode_len_bucket=bucket, prefill=segs,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            self_prefill=not plan.decode and len(plan.prefill) == 1 and plan.prefill[0][1] == 0,
        )
        return batch, sample_seqs

    def _gated_batch(self, plan: StepPlan, batch: BatchInputs) -> GatedBatch:
        """Which rows of the flat batch (laid out by ``_build_batch``) each expert set owns."""
        sets: list[ExpertSet] = []
        index: dict[int, int] = {}
        token_set = [-1] * int(batch.input_ids.shape[0])

        def idx(es: ExpertSet) -> int:
            if id(es) not in index:
                index[id(es)] = len(sets)
                sets.append(es)
            return index[id(es)]

        for s in plan.decode:
            if s.expert_set is not None:
                assert s.kv_slot is not None
                token_set[s.kv_slot] = idx(s.expert_set)
        off = batch.decode_rows
        for s, _, n in plan.prefill:
            if s.expert_set is not None:
                token_set[off : off + n] = [idx(s.expert_set)] * n
            off += n
        self.adafuse_gated_steps += 1
        t = torch.tensor(token_set, dtype=torch.int32, device=self.device)
        return GatedBatch(sets, t, self.model_config)

    def _run_graph(self, plan: StepPlan, solo: tuple[ExpertSet, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Replay the bucket's decode graph. ``solo``: (expert set, host selection rows) runs
        that set's solo gated graph instead, its selection copied into the static buffer."""
        ids, pos, write, slots, lens, bucket = self._decode_arrays(plan)
        g = self._graphs.get(bucket) if solo is None else self._solo_graphs.get((bucket, solo[0]))
        if g is None:
            try:
                if solo is None:
                    g = self._capture(bucket)
                    self._graphs[bucket] = g
                else:
                    self._prune_solo_graphs()
                    g = self._capture(bucket, solo[0])
                    self._solo_graphs[(bucket, solo[0])] = g
            except Exception:
                if solo is not None:  # the plain decode graphs stay in use
                    log.exception("CUDA graph capture of a solo expert-set step failed; those run eagerly from now on")
                    self._solo_graphs_ok = False
                    return None
                log.exception("CUDA graph capture failed; decoding eagerly from now on")
                self._graphs_ok = False
                return None
        if solo is not None:
            assert g.sel is not None
            g.sel.copy_(solo[1].pin_memory(), non_blocking=True)
        inp = g.inputs
        host = torch.tensor([ids, pos, write, slots, lens], dtype=torch.int64).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        inp.input_ids.copy_(dev[0])
        inp.positions.copy_(dev[1])
        inp.write_slots.copy_(dev[2])
        inp.token_slots.copy_(dev[3])
        assert inp.decode_lengths is not None
        inp.decode_lengths.copy_(dev[4])
        g.graph.replay()
        return g.logits

    def _run_prefill_graph(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """Logits [1, V] of the chunk's last token, or None when graphs are unavailable."""
        bucket = self._len_bucket(n)
        g = self._prefill_graphs.get(bucket)
        if g is None:
            try:
                g = self._capture_prefill(bucket)
            except Exception:
                log.exception("CUDA graph capture of prefill failed; prefilling eagerly from now on")
                self._prefill_graphs_ok = False
                return None
            self._prefill_graphs[bucket] = g
        assert seq.kv_slot is not None
        pad = bucket - n
        ids = seq.prompt[:n] + [0] * pad
        write = [seq.kv_slot] * n + [self.kv.scratch_slot] * pad
        slots = [seq.lora_slot] * n + [-1] * pad
        # One pinned host buffer and one copy for every input of the step.
        host = torch.tensor([ids, write, slots, [n - 1] + [0] * (bucket - 1)], dtype=torch.int64).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        inp = g.inputs
        inp.input_ids.copy_(dev[0])
        inp.write_slots.copy_(dev[1])
        inp.token_slots.copy_(dev[2])
        assert inp.logits_rows is not None
        inp.logits_rows.copy_(dev[3, :1])
        g.graph.replay()
        return g.logits

    def _capture_prefill(self, bucket: int) -> _PrefillGraph:
        dev = self.device
        inputs = BatchInputs(
            input_ids=torch.zeros(bucket, dtype=torch.int64, device=dev),
            positions=torch.arange(bucket, dtype=torch.int64, device=dev),
            write_slots=torch.full((bucket,), self.kv.scratch_slot, dtype=torch.int64, device=dev),
            token_slots=torch.full((bucket,), -1, dtype=torch.int32, device=dev),
            decode_rows=0, decode_lengths=None, decode_len_bucket=0,
            logits_rows=torch.zeros(1, dtype=torch.int64, device=dev), self_prefill=True,
        )

        def step() -> torch.Tensor:
            meta = lora_ops.build_meta(inputs.token_slots, self.pool.num_slots)
            return self.model.forward(inputs, self.kv, self.pool, meta)

        graph, logits = self._capture_graph(step)
        return _PrefillGraph(graph, inputs, logits, bucket)

    def _capture_graph(self, step: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        dev = self.device
        # Warm up on a side stream (lazy initialisation and autotuning must not be captured),
        # writing only to the scratch KV row.
        side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = step()
        return graph, logits

    def _prune_solo_graphs(self) -> None:
        """Drop solo graphs of expert sets that are neither resident nor held by a running
        request: their graphs keep the sets' device tensors alive."""
        live = {id(ps.expert_set) for ps in self.adapters.expert_sets.values()}
        live |= {id(s.expert_set) for s in self.scheduler.running if s.expert_set is not None}
        for key in [k for k in self._solo_graphs if id(k[1]) not in live]:
            del self._solo_graphs[key]

    def _capture(self, bucket: int, es: ExpertSet | None = None) -> _DecodeGraph:
        n = self.kv.num_slots
        dev = self.device
        inputs = BatchInputs(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            write_slots=torch.full((n,), self.kv.scratch_slot, dtype=torch.int64, device=dev),
            token_slots=torch.full((n,), -1, dtype=torch.int32, device=dev),
            decode_rows=n, decode_lengths=torch.ones(n, dtype=torch.int64, device=dev), decode_len_bucket=bucket,
            logits_rows=None,
        )

        sel: torch.Tensor | None = None
        solo: SoloGated | None = None
        if es is not None:
            # Static selection buffer, adding nothing until a replay fills it.
            sel = es.solo_empty(n, dev)
            solo = SoloGated(es, sel, n, self.model_config)

        def step() -> torch.Tensor:
            meta = lora_ops.build_meta(inputs.token_slots, self.pool.num_slots)
            return self.model.forward(inputs, self.kv, self.pool, meta, solo)

        graph, logits = self._capture_graph(step)
        return _DecodeGraph(graph, inputs, logits, sel)

    # ---- introspection for tests and benches ----------------------------------------------------

    @property
    def cuda_graphs_active(self) -> bool:
        return self._graphs_ok and bool(self._graphs)

    @property
    def prefill_graphs_active(self) -> bool:
        return self._prefill_graphs_ok and bool(self._prefill_graphs)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model_name, "device": str(self.device), "dtype": str(self.dtype),
            "kv_slots": self.kv.num_slots, "max_model_len": self.max_model_len, "lora_slots": self.pool.num_slots,
            "lora_ops": lora_ops.kernels_description(), "cuda_graphs": self.cuda_graphs_active,
            "prefill_graph_buckets": sorted(self._prefill_graphs),
            "weights_bytes": self.model.nbytes, "pool_bytes": self.pool.nbytes, "kv_bytes": self.kv.nbytes,
            "expert_sets": len(self.adapters.expert_sets), "backbone_master_bytes": self._masters.nbytes,
            "adafuse_merges": self.adafuse_merges, "adafuse_restores": self.adafuse_restores,
            "adafuse_gated_steps": self.adafuse_gated_steps, "adafuse_merged_steps": self.adafuse_merged_steps,
            "adafuse_solo_gated_steps": self.adafuse_solo_gated_steps,
            "adafuse_compensated_steps": self.adafuse_compensated_steps,
            "adafuse_solo_graph_steps": self.adafuse_solo_graph_steps,
            "adafuse_merge_after": self.config.adafuse_merge_after, "solo_graphs": len(self._solo_graphs),
        }
