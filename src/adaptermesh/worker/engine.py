"""``Engine``: the worker's inference engine, implementing ``types.EngineProtocol``.

The engine owns one model, one paged KV cache (``kv_cache.py`` + ``paging.py``), one LoRA pool
and one adapter manager. A background task on the caller's event loop repeats: plan a step
(scheduler, on the loop), launch it (inputs staged into one pinned buffer and copied with one
transfer; forward and sampling on the device), and deliver the previous step's tokens to each
request's stream.

This module holds the step loop (submit, overlap, finishing). The rest lives beside it:
``engine_config`` (``EngineConfig``, validation, the memory budget), ``step_plan`` (the plain
step description and result), ``step_layout`` (step shapes, buckets, input staging, the
block-table mirror), ``step_launch`` (a step's launch, the eager path, the output copy),
``graph_runner`` (CUDA graph capture and replay), ``adafuse_policy`` (when expert selections
merge into the backbone), ``tokenizer_helpers`` and ``sampling`` (the sampler's bounds,
processors, sampling and logprob gathering).

**Threads.** The step loop, and every call into the scheduler, runs on the event loop's
thread. ``Scheduler.schedule`` emits a ``ScheduledStep`` (plain data); on CUDA the launch runs
on a worker thread (``asyncio.to_thread``) and sees only that description; when it returns,
the loop reports the launch (``Scheduler.launched``), and when the step's copy completes it
hands the ``StepResult`` to ``Scheduler.apply``. The scheduler's state is never touched from
the worker thread.

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
logit_bias, penalties, temperature and filters), as vLLM reports by default; ``"processed"`` first runs
``sampling.processed_logits`` over the step's logits with the step's own sampling buffers and
mode, so the values are the distribution the sampler drew each token from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from adaptermesh.worker import lora_ops
from adaptermesh.worker.adafuse import CpuExpertSet, ExpertSet
from adaptermesh.worker.adafuse_policy import MergePolicy
from adaptermesh.worker.adapter_text import AdapterTexts
from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.engine_config import (
    EngineConfig,
    device_memory,
    plan_budget,
    resolve_dtype,
    resolve_max_model_len,
    size_config,
    validate_config,
)
from adaptermesh.worker.faults import StepFault
from adaptermesh.worker.grammar import CompiledGrammar, GrammarSpec
from adaptermesh.worker.kv_cache import KVCacheSpec, PagedKVCache, spec_bytes_per_token
from adaptermesh.worker.lora_groups import pool_groups
from adaptermesh.worker.model import (
    LoraPool,
    ModelConfig,
    TransformerModel,
    arena_part_bytes,
    make_lora_pool,
    read_weights,
)
from adaptermesh.worker.paging import BlockManager
from adaptermesh.worker.sampling import BOUNDS, penalised
from adaptermesh.worker.scheduler import Detokenizer, Scheduler, Sequence
from adaptermesh.worker.sizing import arena_adapters, arena_size_for
from adaptermesh.worker.step_launch import InFlight, SampleObserver, StepLauncher
from adaptermesh.worker.step_layout import BlockTableMirror
from adaptermesh.worker.step_plan import ScheduledStep
from adaptermesh.worker.tokenizer_helpers import TokenizerHelper, load_tokenizer
from adaptermesh.worker.tp_group import ShardedLoraPool, TPGroup, TPModel, WorkerSetup
from adaptermesh.worker.tp_shard import check_divisible, shard_config, shard_weights
from adaptermesh.worker.types import (
    AdapterInfo,
    AdapterLoadTimeoutError,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
)

# EngineConfig is the constructor's own argument type, named with the engine.
__all__ = ["Engine", "EngineConfig", "EngineStream"]

log = logging.getLogger(__name__)


def _check_ids(request: GenerationRequest, vocab: int) -> None:
    """InvalidRequestError naming ``prompt`` for a prompt token id outside ``vocab``."""
    bad = [
        token
        for token in request.prompt_token_ids
        if not isinstance(token, int) or not 0 <= token < vocab
    ]
    if bad:
        raise InvalidRequestError(
            "prompt", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})"
        )


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
        sample_observer: SampleObserver | None = None,
        step_fault: StepFault | None = None,
        tp_fail_loads_rank: int = -1,
    ) -> None:
        """``weights``: use these tensors (Hugging Face names) instead of reading
        ``model_dir/*.safetensors``; benches pass random weights made on the device.

        For tests and the fault-injection suite: ``sample_observer(logits, rows)`` sees the
        logits each eager step samples from (``step_launch.SampleObserver``); ``step_fault``
        fails steps on demand (default: the one the environment arms,
        ``faults.StepFault.from_environment``, usually none); ``tp_fail_loads_rank``: with
        tensor parallelism, this rank refuses every adapter load."""
        self._sample_observer = sample_observer
        self.step_fault = step_fault if step_fault is not None else StepFault.from_environment()
        self.tp_fail_loads_rank = tp_fail_loads_rank
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.adapter_root = Path(adapter_root)
        if not self.adapter_root.is_dir():
            raise InvalidRequestError("adapter_root", f"{self.adapter_root} is not a directory")
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.dtype = dtype = resolve_dtype(dtype)
        validate_config(config)
        self.model_config = model_config = ModelConfig.from_dir(self.model_dir)
        self.model_name = model_name or self.model_dir.name
        self.max_model_len = resolve_max_model_len(config, model_config.max_position_embeddings)
        self.text = TokenizerHelper(load_tokenizer(self.model_dir))
        self.tokenizer: Any = self.text.tokenizer
        self.max_token_chars = self.text.max_token_chars

        tp_size = config.tensor_parallel_size
        self.tp_group: TPGroup | None = None
        if tp_size > 1:
            try:
                check_divisible(model_config, tp_size, config.tp_lora_scheme)
            except ValueError as e:
                raise InvalidRequestError("tensor_parallel_size", str(e)) from e
            if weights is not None:
                raise InvalidRequestError(
                    "weights", "tensor parallelism reads the weights from model_dir on every rank"
                )
            # Steps send their inputs to the other ranks from Python: no whole-step graphs.
            config = dataclasses.replace(config, use_cuda_graphs=False)
            self.config = config
            self.tp_group = TPGroup.start(tp_size, self.device)
        try:
            self._build(config, model_config, weights, tp_size)
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.close()
            raise

    def _build(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor] | None,
        tp_size: int,
    ) -> None:
        dtype = self.dtype
        tensors = weights if weights is not None else read_weights(self.model_dir)
        group = self.tp_group
        if group is not None:
            shard_cfg = shard_config(model_config, tp_size)
            self.model: TransformerModel = TPModel(
                shard_cfg,
                shard_weights(model_config, tensors, 0, tp_size),
                self.device,
                dtype,
                self.max_model_len,
                group,
                model_config.vocab_size,
                config.tp_lora_scheme,
            )
            del tensors
        else:
            shard_cfg = model_config
            self.model = TransformerModel(
                model_config,
                tensors,
                self.device,
                dtype,
                self.max_model_len,
                quant_kernels=config.quant_kernels == "on"
                or (config.quant_kernels == "auto" and self.device.type == "cuda"),
                fp8_activations=config.quant_fp8_activations,
            )
            if self.model.packed and config.lora_dora:
                raise InvalidRequestError(
                    "quant_kernels",
                    "DoRA pools need the base weights dense (their norms read them); set "
                    "quant_kernels off to serve DoRA over a quantised base",
                )
        block_size = config.block_size
        kv_spec = KVCacheSpec(
            shard_cfg.num_layers,
            shard_cfg.num_kv_heads,
            shard_cfg.head_dim,
            block_size,
            dtype,
        )
        # Sizes the worker chooses itself, now that the weights hold their share of the device.
        groups = pool_groups(config.lora_target_modules)
        # A float pool on one device is an adapter arena (each adapter takes only the parts
        # it targets); INT4 and tensor-parallel pools, and pools holding trained module
        # copies or extra vocabulary rows (tables per slot), keep slots.
        part_bytes = (
            arena_part_bytes(
                shard_cfg, config.max_lora_rank, dtype, groups, config.lora_dora, config.lora_vocab
            )
            if group is None
            and config.lora_dtype != "int4"
            and not config.lora_saved_modules
            and not config.lora_extra_vocab
            else None
        )
        if part_bytes is not None and "max_loras" not in config.auto_size:
            try:
                arena_size_for(config.max_loras, part_bytes)
            except ValueError:
                part_bytes = None  # more adapters than an arena's steps index: slots
        slot_bytes = (
            sum(part_bytes.values())
            if part_bytes is not None
            else make_lora_pool(
                shard_cfg,
                1,
                config.max_lora_rank,
                torch.device("meta"),
                dtype,
                config.lora_dtype,
                groups,
                config.lora_dora,
                config.lora_vocab,
                frozenset(config.lora_saved_modules),
                extra_vocab=config.lora_extra_vocab,
            ).nbytes
        )
        self.config = config
        config, self.sizing = size_config(
            config,
            device=self.device,
            kv_bytes_per_token=spec_bytes_per_token(kv_spec),
            slot_bytes=max(1, slot_bytes),
            max_model_len=self.max_model_len,
            part_bytes=part_bytes,
        )
        if self.sizing is not None:
            self.config = config
            log.info("sizes: %s", self.sizing.describe())
        arena_bytes = None
        if part_bytes is not None:
            arena_bytes = config.lora_arena_bytes or arena_size_for(config.max_loras, part_bytes)
            short = sorted(
                p for p in part_bytes if arena_adapters(arena_bytes, part_bytes, [p]) < 1
            )
            if short:
                raise InvalidRequestError(
                    "lora_arena_bytes",
                    f"{arena_bytes} bytes hold no adapter on {', '.join(short)}; one adapter "
                    f"on every module at rank {config.max_lora_rank} takes {slot_bytes}",
                )
        self.pool: LoraPool
        if group is None:
            self.pool = make_lora_pool(
                model_config,
                config.max_loras,
                config.max_lora_rank,
                self.device,
                dtype,
                config.lora_dtype,
                groups,
                config.lora_dora,
                config.lora_vocab,
                frozenset(config.lora_saved_modules),
                arena_bytes=arena_bytes,
                extra_vocab=config.lora_extra_vocab,
            )
        else:
            self.pool = ShardedLoraPool(
                model_config,
                shard_cfg,
                group,
                config.max_loras,
                config.max_lora_rank,
                self.device,
                dtype,
                groups,
                config.tp_lora_scheme,
            )
        if config.lora_overlap and self.device.type == "cuda":
            self.model.lora_side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.model.lora_side_max_tokens = config.lora_overlap_max_tokens

        self.budget = budget = plan_budget(
            config, self.max_model_len, kv_spec, device_memory(self.device, config)
        )
        self.max_blocks_per_seq = budget.max_blocks_per_seq
        self.kv = PagedKVCache(kv_spec, budget.num_kv_blocks, self.device)
        self.blocks = BlockManager(
            self.kv.num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        if group is not None:
            group.setup(
                WorkerSetup(
                    model_dir=str(self.model_dir),
                    dtype=str(dtype).removeprefix("torch."),
                    max_len=self.max_model_len,
                    num_blocks=self.kv.num_blocks,
                    block_size=block_size,
                    num_slots=self.pool.num_slots,
                    max_rank=self.pool.max_rank,
                    groups=tuple(sorted(self.pool.groups)),
                    lora_scheme=config.tp_lora_scheme,
                    fail_loads_rank=self.tp_fail_loads_rank,
                )
            )

        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.merge_policy = MergePolicy(self.model, config)
        if self.pool.dora:
            # DoRA's norms are of the base weights: never of an AdaFuse merge in them.
            self.pool.base_weight = self.merge_policy.masters.pristine
        if group is None:
            # The base weights an adapter saves beside its vocabulary tensors (a vocabulary
            # LoRA's, a resized vocabulary's) are checked against these.
            model = self.model
            self.pool.base_vocab = lambda part: model.embed if part == "embed" else model.lm_head
        self.adapters = AdapterManager(
            self.adapter_root,
            model_config,
            self.pool,
            max_rank=config.max_lora_rank,
            cpu_cache_bytes=config.cpu_cache_bytes,
            dtype=dtype,
            negative_ttl_s=config.negative_ttl_s,
            slot_wait_s=config.adapter_slot_wait_s,
            on_change=self._wake,
            build_expert_set=self._build_expert_set if group is None else None,
            max_expert_sets=config.max_expert_sets,
            eviction=config.adapter_eviction,
        )
        extra = self.pool.extra
        self.texts = AdapterTexts(
            self.text,
            self.adapters.local_path,
            extra.width if extra is not None else model_config.vocab_size,
            frozenset(eos),
        )
        rows = config.max_num_seqs
        self.scheduler = Scheduler(
            self.blocks,
            self.adapters,
            base_names=frozenset({self.model_name, str(self.model_dir)}),
            max_num_seqs=rows,
            max_num_batched_tokens=budget.step_tokens,
            max_prefill_chunk=config.max_prefill_chunk,
            max_prefill_seqs=config.max_prefill_seqs,
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(eos),
            token_piece=self.text.token_piece,
            max_adapter_skips=config.max_adapter_skips,
            adapter_load_wait_s=config.adapter_load_wait_s,
        )
        self.tables = BlockTableMirror(rows, budget.max_blocks_per_seq, block_size, self.device)
        self.launcher = StepLauncher(
            model=self.model,
            kv=self.kv,
            pool=self.pool,
            config=config,
            device=self.device,
            max_model_len=self.max_model_len,
            budget=budget,
            tables=self.tables,
            merge_policy=self.merge_policy,
            sample_observer=self._sample_observer,
        )
        self._cuda = self.device.type == "cuda"
        self._overlap = (
            self._cuda if config.async_scheduling is None else bool(config.async_scheduling)
        )
        self.step_profile: list[dict[str, Any]] = []
        self._profile_out = (
            open(config.step_profile_path, "a", buffering=1)  # noqa: SIM115 (closed at shutdown)
            if config.profile_steps and config.step_profile_path
            else None
        )
        self._event: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._latency_cursor = 0
        self.steps = 0
        log.info(
            "engine ready: %s on %s (%s), kv %d blocks x %d tokens (%.1f MiB), %d sequences, lora pool %s, lora ops %s",
            self.model_name,
            self.device,
            dtype,
            self.kv.num_blocks,
            block_size,
            self.kv.nbytes / 2**20,
            rows,
            self.pool.describe(),
            lora_ops.kernels_description(),
        )

    # ---- EngineProtocol -----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> EngineStream:
        if self._closed:
            raise EngineError("engine is shut down")
        vocab, exact = self._request_vocab(request.adapter)
        self._validate(request, vocab)
        name = request.adapter
        if name is not None and name not in self.scheduler.base_names:
            self.adapters.check_request(name)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{len(self.scheduler.waiting)} requests are already waiting"
            )
        sampling = request.sampling
        text = self.texts.helper(self._adapter_name(name))
        seq = Sequence(
            request=request,
            queue=asyncio.Queue(),
            detok=Detokenizer(text.decode_for_stream),
            prompt=list(request.prompt_token_ids),
            # Counter-based sampling: (seed, output index) decides each draw, so a request's
            # tokens do not depend on its batch neighbours or on preemption. Seeds of any size
            # are folded into the sampler's 63 bits.
            seed=sampling.seed % (1 << 63) if sampling.seed is not None else random.getrandbits(63),
            matcher=request.grammar.matcher() if request.grammar is not None else None,
        )
        if text is not self.text:  # the adapter's own tokenizer names its tokens and stops
            seq.piece = text.token_piece
            seq.stop_ids = self.texts.stops(text)
        if not exact:
            # The adapter's vocabulary is known once it has a slot: checked at admission.
            seq.check_vocab = functools.partial(self._check_slot_vocab, request)
        self.scheduler.waiting.append(seq)
        self._ensure_loop()
        self._wake()
        return EngineStream(self, seq)

    def _validate(self, request: GenerationRequest, vocab: int | None = None) -> None:
        """``vocab``: the vocabulary the request's token ids are checked against (None: the
        model's)."""
        sampling = request.sampling
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(request.prompt_token_ids)} tokens leave no room to generate (max_model_len {self.max_model_len})",
            )
        vocab = self.model_config.vocab_size if vocab is None else vocab
        _check_ids(request, vocab)
        if not isinstance(sampling.max_tokens, int) or sampling.max_tokens < 1:
            raise InvalidRequestError(
                "max_tokens", f"must be a positive integer, got {sampling.max_tokens!r}"
            )
        BOUNDS.check(sampling, vocab)  # the sampler's bounds, as the API models check them
        if any(not isinstance(stop, str) or not stop for stop in sampling.stop):
            raise InvalidRequestError("stop", "stop sequences must be non-empty strings")

    def _adapter_name(self, name: str | None) -> str | None:
        return None if name is None or name in self.scheduler.base_names else name

    def _request_vocab(self, name: str | None) -> tuple[int, bool]:
        """The vocabulary a request's token ids are checked against, and whether it is the
        adapter's own (else the widest a slot holds: checked again at admission)."""
        extra = self.pool.extra
        name = self._adapter_name(name)
        if name is None or extra is None:
            return self.model_config.vocab_size, True
        known = self.adapters.vocab_of(name)
        return (known, True) if known is not None else (extra.width, False)

    def _check_slot_vocab(self, request: GenerationRequest, slot: int) -> BaseException | None:
        """At admission: the request's ids against its adapter's vocabulary (its slot's)."""
        extra = self.pool.extra
        if extra is None or slot < 0:
            return None
        try:
            _check_ids(request, extra.vocab[slot])
            BOUNDS.check_logit_bias(request.sampling.logit_bias, extra.vocab[slot])
        except InvalidRequestError as e:
            return e
        return None

    def tokenize(self, text: str, adapter: str | None = None) -> list[int]:
        return self.texts.helper(self._adapter_name(adapter)).tokenize(text)

    def detokenize(self, token_ids: list[int], adapter: str | None = None) -> str:
        return self.texts.helper(self._adapter_name(adapter)).detokenize(token_ids)

    def fill_in_middle(
        self, prefix: str | list[int], suffix: str, adapter: str | None = None
    ) -> list[int] | None:
        """A completion's fill-in-the-middle prompt, or None when the model has no FIM tokens."""
        return self.texts.helper(self._adapter_name(adapter)).fill_in_middle(prefix, suffix)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        adapter: str | None = None,
    ) -> list[int] | None:
        return self.texts.helper(self._adapter_name(adapter)).apply_chat_template(messages, tools)

    async def adapter_text(self, name: str | None) -> TokenizerHelper | None:
        """The tokenizer helper of requests for ``name`` when it is the adapter's own
        (loaded off the event loop), None when the base model's serves them."""
        helper = await self.texts.prepare(self._adapter_name(name))
        return None if helper is self.text else helper

    def compile_grammar(self, spec: GrammarSpec, adapter: str | None = None) -> CompiledGrammar:
        """``spec`` compiled for this model's vocabulary, with the tokenizer of requests for
        ``adapter`` (``GrammarError`` naming the field when it does not compile). Thread-safe;
        the service calls it off the event loop."""
        helper = self.texts.helper(self._adapter_name(adapter))
        return self.texts.compiler(helper).compile(spec)

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterInfo:
        self._ensure_loop()
        return await self.adapters.load(name, path, pinned=pinned)

    async def unload_adapter(self, name: str) -> None:
        await self.adapters.unload(name)

    async def await_adapter(self, name: str | None) -> None:
        """Before a request takes an admission slot: when its adapter is loading (or only a
        store holds it, and its load starts here), wait for that load, at most
        ``adapter_load_wait_s``, so that a slow or stalled store never holds the slots the
        other adapters' requests need. Raises AdapterLoadTimeoutError when the wait runs
        out and the load's own error when it fails; the load itself is shared and never
        cancelled here (a waiter that goes away leaves it to the others)."""
        if name is None or name in self.scheduler.base_names:
            return
        self._ensure_loop()
        task = self.adapters.store_load(name)
        if task is None:
            return
        wait = self.config.adapter_load_wait_s
        try:
            await asyncio.wait_for(asyncio.shield(task), wait)
        except TimeoutError:
            self.scheduler.load_wait_timeouts += 1
            raise AdapterLoadTimeoutError(name, wait or 0.0) from None

    def prefetch(self, names: list[str]) -> list[asyncio.Task[int]]:
        """Warm adapters into GPU slots ahead of their requests."""
        self._ensure_loop()
        return self.adapters.prefetch(names)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

    async def locate_adapter(self, name: str) -> str | None:
        return await self.adapters.locate(name)

    def knows_adapter(self, name: str) -> bool:
        # The names list_adapters lists (AdapterManager.list), as three dictionary lookups.
        a = self.adapters
        return name in a.published or name in a.expert_sets or name in a.registered

    def stats(self) -> EngineStats:
        counters = self.adapters.counters
        latencies = tuple(counters.latencies[self._latency_cursor :])
        self._latency_cursor = len(counters.latencies)
        free_gpu = int(torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else 0
        scheduler = self.scheduler
        return EngineStats(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            kv_cache_usage=self.blocks.usage(),
            gpu_slots_used=self.adapters.slots_used(),
            gpu_slots_total=self.pool.num_slots,
            adapter_hits=counters.hits,
            adapter_misses=counters.misses,
            adapter_evictions=counters.evictions,
            free_gpu_bytes=free_gpu,
            generated_tokens=scheduler.generated_tokens,
            new_load_latencies=latencies,
            running_adapters=tuple(
                sorted({name for seq in scheduler.running if (name := scheduler.adapter_of(seq))})
            ),
            waiting_adapters=tuple(
                sorted({name for seq in scheduler.waiting if (name := scheduler.adapter_of(seq))})
            ),
            # Adapters on every module the pool holds at once (an arena holds more on fewer).
            max_loras=self.config.max_loras,
            adapter_loads_started=counters.loads_started,
            adapter_evictions_wanted=counters.evictions_wanted,
            admissions_waited_on_load=scheduler.admissions_waited_on_load,
            idle_passes_on_adapter_load=scheduler.idle_passes_on_load,
            adapter_residency=self.adapters.held_by_tier(),
            tp_ranks_up=self.ranks_up(),
        )

    def ranks_up(self) -> tuple[bool, ...]:
        """Each tensor-parallel rank's liveness (rank 0 first); () without tensor parallelism."""
        return () if self.tp_group is None else self.tp_group.ranks_up()

    async def shutdown(self) -> None:
        self._closed = True
        self.scheduler.fail_all(EngineError("engine is shutting down"))
        for task in list(self.adapters.inflight.values()):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.tp_group is not None:
            await asyncio.to_thread(self.tp_group.close)
        if self._profile_out is not None:
            self._profile_out.close()
            self._profile_out = None

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
        expert sets (the path depends on the token) and penalties (counts of past tokens).
        Grammar-constrained rows overlap differently: their step's forward is launched, and
        its masks and sampling follow once the previous step's tokens are applied."""
        for seq in self.scheduler.running:
            if seq.expert_set is not None or penalised(seq.request.sampling):
                return True
        return bool(self.merge_policy.merged is not None)

    async def _run(self) -> None:
        assert self._event is not None
        inflight: InFlight | None = None
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
                if self.merge_policy.merged is not None:
                    await asyncio.to_thread(self.merge_policy.restore_backbone)
                    continue
                expiry = self.scheduler.next_load_wait_expiry()
                if expiry is None:
                    await self._event.wait()
                else:  # wake when a request's wait on its adapter's load runs out
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._event.wait(), expiry + 0.01)
                continue
            try:
                launched = (
                    await asyncio.to_thread(self._launch, plan)
                    if self._cuda
                    else self._launch(plan)
                )
            except Exception as error:  # a failed step fails its requests; the engine keeps serving
                log.exception("engine step failed")
                self._fail(plan, error)
                continue
            # On this thread, before the previous step's tokens are applied: the step's
            # sampling rows now have tokens in flight, at these entries of its output.
            self.scheduler.launched(plan, launched.entries)
            if launched.captured_solo:
                self.launcher.graph_runner.prune_solo(self._live_expert_sets())
            if inflight is not None:
                await self._finish(inflight)
            if launched.tail is not None:
                # A masked step: its forward runs while the previous step's tokens were
                # applied above; now its rows' masks are known.
                try:
                    if self._cuda:
                        await asyncio.to_thread(launched.run_tail)
                    else:
                        launched.run_tail()
                except Exception as error:
                    log.exception("engine step failed")
                    self._fail(plan, error)
                    continue
            inflight = launched
            if not self._overlap:
                await self._finish(inflight)
                inflight = None
            await asyncio.sleep(0)  # let HTTP handlers and adapter loads run between steps
        if inflight is not None:
            with contextlib.suppress(Exception):
                inflight.wait()

    def _fail(self, plan: ScheduledStep, error: BaseException) -> None:
        self.scheduler.fail_step(plan.step_id, error)

    def _live_expert_sets(self) -> set[int]:
        """Ids of the expert sets resident or held by a running request."""
        live = {id(pending.expert_set) for pending in self.adapters.expert_sets.values()}
        live |= {id(s.expert_set) for s in self.scheduler.running if s.expert_set is not None}
        return live

    async def _finish(self, in_flight: InFlight) -> None:
        try:
            result = (
                await asyncio.to_thread(in_flight.wait)
                if in_flight.done is not None
                else in_flight.wait()
            )
        except Exception as error:
            log.exception("engine step failed on the device")
            self._fail(in_flight.plan, error)
            return
        self.scheduler.apply(result)
        self.steps += 1
        if self.config.profile_steps:
            self._record_step(in_flight)

    def _record_step(self, in_flight: InFlight) -> None:
        """One step's profile record: its shape (decode rows, prefill tokens, the distinct
        adapters in it, which is the SGMM kernels' segment count less the base rows'), where
        it ran (graph or eager), its host launch time and its GPU time between the step's
        two events, and the wall time it completed at."""
        gpu_ms = (
            float(in_flight.started.elapsed_time(in_flight.done))
            if in_flight.done is not None
            else 0.0
        )
        plan = in_flight.plan
        record = {
            "t": time.time(),
            "rows": len(plan.decode) + len(plan.prefill),
            "tokens": in_flight.tokens,
            "decode_rows": len(plan.decode),
            "prefill_tokens": sum(row.count for row in plan.prefill),
            "adapters": len({row.lora_slot for row in plan.rows if row.lora_slot >= 0}),
            "graph": in_flight.graph,
            "host_ms": in_flight.host_ms,
            "gpu_ms": gpu_ms,
        }
        if self._profile_out is not None:
            self._profile_out.write(json.dumps(record) + "\n")
        else:
            self.step_profile.append(record)

    def _launch(self, plan: ScheduledStep) -> InFlight:
        if self.step_fault is not None:  # only the fault-injection suite arms one
            self.step_fault.check()
        return self.launcher.launch(plan, defer_masked=True)

    def _build_expert_set(self, cpu: CpuExpertSet, version: int) -> ExpertSet:
        return self.merge_policy.build_expert_set(cpu, version)

    def describe(self) -> dict[str, Any]:
        launcher = self.launcher
        graphs = launcher.graph_runner
        policy = self.merge_policy
        keys = sorted(graphs.graphs, key=repr)
        return {
            "model": self.model_name,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "max_num_seqs": self.config.max_num_seqs,
            "kv_slots": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "lora_slots": self.pool.num_slots,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "tp_lora_scheme": self.config.tp_lora_scheme,
            "kv_blocks": self.kv.num_blocks,
            "block_size": self.kv.block_size,
            "kv_tokens": self.kv.num_tokens,
            "kv_cached_blocks": self.blocks.num_cached_blocks(),
            "prefix_hit_tokens": self.blocks.stats.hit_tokens,
            "prefix_query_tokens": self.blocks.stats.query_tokens,
            "preemptions": self.scheduler.preemptions,
            # Adapter scheduling (worker/scheduler.py): loads started in queue order, evictions
            # of an adapter a waiting request wanted, admissions that waited on a load, and
            # scheduling passes where nothing could run while a request waited on a load.
            # No step waits on a load: loads run as tasks beside the step loop.
            "adapter_loads_started": self.adapters.counters.loads_started,
            "adapter_evictions": self.adapters.counters.evictions,
            "adapter_evictions_wanted": self.adapters.counters.evictions_wanted,
            "admissions_waited_on_load": self.scheduler.admissions_waited_on_load,
            "idle_passes_on_load": self.scheduler.idle_passes_on_load,
            "sizes": None if self.sizing is None else dict(self.sizing.origin),
            "lora_ops": lora_ops.kernels_description(),
            "cuda_graphs": graphs.active,
            "graph_buckets": [list(map(str, key[:4])) for key in keys],
            "decode_buckets": list(launcher.decode_sizes),
            "mixed_buckets": list(launcher.mixed_sizes),
            "graph_steps": graphs.replays,
            "eager_steps": launcher.eager_steps,
            "async_scheduling": self._overlap,
            "weights_bytes": self.model.nbytes,
            "pool_bytes": self.pool.nbytes,
            # Of pool_bytes: the per-slot tables of trained module copies (modules_to_save),
            # and the slots holding any copy now.
            "saved_module_bytes": self.pool.saved.nbytes if self.pool.saved is not None else 0,
            "saved_module_slots": (
                len(self.pool.saved.slots_with_copies(range(self.pool.num_slots)))
                if self.pool.saved is not None
                else 0
            ),
            # Of pool_bytes: the extra vocabulary rows and widths (extra_vocab), and the slots
            # whose adapter's vocabulary exceeds the model's now.
            "extra_vocab_bytes": self.pool.extra.nbytes if self.pool.extra is not None else 0,
            "extra_vocab_slots": (
                len(self.pool.extra.slots_with_extra(range(self.pool.num_slots)))
                if self.pool.extra is not None
                else 0
            ),
            **self.texts.describe(),
            "kv_bytes": self.kv.nbytes,
            "expert_sets": len(self.adapters.expert_sets),
            "backbone_master_bytes": self.merge_policy.masters.nbytes,
            "adafuse_merges": policy.merges,
            "adafuse_restores": policy.restores,
            "adafuse_gated_steps": policy.gated_steps,
            "adafuse_merged_steps": policy.merged_steps,
            "adafuse_solo_gated_steps": policy.solo_gated_steps,
            "adafuse_compensated_steps": policy.compensated_steps,
            "adafuse_solo_graph_steps": policy.solo_graph_steps,
            "adafuse_merge_after": self.config.adafuse_merge_after,
            "solo_graphs": graphs.solo_count(),
        }
