"""Continuous batching: admission, per-step token budget, chunked prefill, sampling, stop rules.

Between two forward passes the scheduler (on the event-loop thread) drops cancelled and expired
requests, admits waiting ones whose adapter is resident (a request whose adapter is still
loading waits without blocking the others), and plans the next step: every decoding sequence
contributes one token, and prompt chunks fill the rest of ``max_num_batched_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from adaptermesh.worker.adafuse import ExpertSet
from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.kv_cache import KVCache
from adaptermesh.worker.types import (
    AdapterNotFoundError,
    EngineError,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)

__all__ = ["Detokenizer", "Scheduler", "Sequence", "StepPlan", "sample_rows"]


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
    output: list[int] = field(default_factory=list)
    kv_slot: int | None = None
    lora_slot: int = -1
    expert_set: ExpertSet | None = None  # held while running when the adapter is an expert set
    looked_up: bool = False
    computed: int = 0  # prompt tokens already in the KV cache
    cancelled: bool = False
    finished: bool = False
    generator: torch.Generator | None = None
    text: str = ""  # detokenised output so far, including text held back for stop matching
    emitted: int = 0  # characters of ``text`` already sent
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def in_decode(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass(slots=True)
class StepPlan:
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]  # (sequence, start position, number of tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, _, n in self.prefill)


def sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits`` [R, V] (fp32), with each sequence's own parameters."""
    greedy = [i for i, s in enumerate(seqs) if s.request.sampling.temperature == 0.0]
    out = [0] * len(seqs)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, t in zip(greedy, logits.index_select(0, idx).argmax(-1).tolist(), strict=True):
            out[i] = int(t)
    for i, s in enumerate(seqs):
        sp = s.request.sampling
        if sp.temperature == 0.0:
            continue
        row = logits[i].float().cpu() / sp.temperature
        probs = torch.softmax(row, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            keep = (cum - sorted_p) < sp.top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=s.generator).item())
    return out


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        adapters: AdapterManager,
        *,
        base_names: frozenset[str],
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.base_names = base_names
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.generated_tokens = 0

    def adapter_of(self, seq: Sequence) -> str | None:
        name = seq.adapter
        return None if name is None or name in self.base_names else name

    # ---- finishing ----------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        if seq.kv_slot is not None:
            self.kv.free(seq.kv_slot)
            seq.kv_slot = None
        if seq.lora_slot >= 0:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1
        if seq.expert_set is not None:
            self.adapters.release_expert_set(seq.expert_set)
            seq.expert_set = None

    def finish(
        self, seq: Sequence, reason: FinishReason, error: BaseException | None = None, last_token: int | None = None
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
        seq.queue.put_nowait(TokenEvent(last_token, tail, reason, len(seq.prompt), len(seq.output)))

    def fail_all(self, error: BaseException) -> None:
        for seq in [*self.running, *self.waiting]:
            self.finish(seq, "error", error)
        self.waiting.clear()

    # ---- planning -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        now = time.monotonic()
        for seq in [*self.running, *self.waiting]:
            dl = seq.request.deadline
            if seq.cancelled or (dl is not None and now > dl):
                self.finish(seq, "cancelled")
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._admit()
        decode = [s for s in self.running if s.in_decode]
        budget = self.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int, int]] = []
        for seq in self.running:
            if seq.in_decode or budget <= 0:
                continue
            n = min(len(seq.prompt) - seq.computed, budget, self.max_prefill_chunk)
            prefill.append((seq, seq.computed, n))
            budget -= n
        if not decode and not prefill:
            return None
        return StepPlan(decode, prefill)

    def _admit(self) -> None:
        still: deque[Sequence] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if self.kv.num_free() == 0:
                still.append(seq)
                still.extend(self.waiting)
                self.waiting.clear()
                break
            name = self.adapter_of(seq)
            if name is not None:
                if not seq.looked_up:
                    seq.looked_up = True
                    self.adapters.note_lookup(name)
                try:
                    got = self.adapters.try_acquire(name)
                except AdapterNotFoundError as e:
                    self.finish(seq, "error", e)
                    continue
                if got is None:
                    still.append(seq)  # loading; later requests may still be admitted
                    continue
                seq.lora_slot = got.slot
                seq.expert_set = got.expert_set
            slot = self.kv.allocate()
            assert slot is not None
            seq.kv_slot = slot
            self.running.append(seq)
        self.waiting = still

    # ---- applying a step's result -------------------------------------------------------------

    def apply(self, plan: StepPlan, sampled: dict[int, int]) -> None:
        """Advance sequences after a forward pass; ``sampled`` maps id(seq) -> new token."""
        for seq, _, n in plan.prefill:
            seq.computed += n
            if seq.kv_slot is not None:
                self.kv.lengths[seq.kv_slot] = seq.computed
        for seq in plan.decode:
            if seq.kv_slot is not None:
                self.kv.lengths[seq.kv_slot] = seq.context_len
        for seq in [*plan.decode, *(s for s, _, _ in plan.prefill)]:
            tok = sampled.get(id(seq))
            if tok is None or seq.finished:
                continue
            self._append_token(seq, tok)

    def _append_token(self, seq: Sequence, tok: int) -> None:
        seq.output.append(tok)
        self.generated_tokens += 1
        sp = seq.request.sampling
        if seq.cancelled:
            self.finish(seq, "cancelled")
            return
        if tok in self.eos_token_ids:
            self.finish(seq, "stop", last_token=tok)
            return
        at_limit = len(seq.output) >= sp.max_tokens or seq.context_len >= self.max_model_len
        seq.text += seq.detok.flush(seq.output) if at_limit else seq.detok.step(seq.output)
        reason: FinishReason | None = None
        if sp.stop:
            start = max(0, seq.emitted - max(len(s) for s in sp.stop))
            hits = [i for i in (seq.text.find(s, start) for s in sp.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                reason = "stop"
        if reason is None and at_limit:
            reason = "length"
        if reason is not None:
            self.finish(seq, reason, last_token=tok)
            return
        visible = len(seq.text) - _held_back(seq.text, sp.stop)
        delta = seq.text[seq.emitted : visible] if visible > seq.emitted else ""
        seq.emitted = max(seq.emitted, visible)
        seq.queue.put_nowait(TokenEvent(tok, delta, None, len(seq.prompt), len(seq.output)))


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
