"""Batched, device-side token sampling with per-row parameters.

This module is the worker's one sampler room: the parameter bounds every entry point validates
against (``SamplingBounds``, ``BOUNDS``; the OpenAI API models in ``api.py`` and the engine's
``submit`` both read it), the logit processors (``logit_bias``, penalties; the grammar masks
are applied by ``grammar.apply_bitmask`` on the logits the step hands here), the filters, the
draw, and the log-probabilities, for eager steps and captured graphs alike (``GREEDY`` and
``RANDOM`` are the variants a graph is captured for). A new sampling parameter is a field of
the API model (``api.py``), of ``SamplingParams`` as the request translation fills it
(``request_translation.py``), and of ``RowParams``/``SamplingBuffers`` here. The step launcher
calls ``sample_entries`` (bias, penalties, draw) and ``processed_entries`` (processed
logprobs) with the step's rows; it holds no sampling rule of its own.

For each row r with logits l (after logit_bias and penalties, below), temperature T, and
filters top-k, top-p, min-p and typical-p::

    T == 0:  token = argmax_i l_i
    T  > 0:  p = softmax(l / T)
             S = top-k set  ∩  top-p set (on p renormalised over the top-k set)  ∩  min-p set
             S = S ∩ typical set (on p renormalised over S)
             token ~ p restricted to S, renormalised

* top-k keeps the k largest logits (k <= 0 or k >= V: no limit).
* top-p keeps the smallest prefix of the descending order whose mass reaches top_p; the most
  likely token is always kept; top_p >= 1 keeps everything.
* min-p keeps i with p_i >= min_p * max_j p_j, i.e. l_i >= max_j l_j + T * log(min_p).
* typical-p (locally typical sampling, Meister et al. 2022, as transformers'
  ``TypicalLogitsWarper`` defines it) orders the tokens of S by |-log q_i - H(q)|, q being p
  renormalised over S and H its entropy, and keeps the smallest prefix of that order whose
  mass under q reaches typical_p (at least one token); typical_p >= 1 keeps everything. It
  runs after the other filters, as transformers applies it after top-k, top-p and min-p, and
  is a mask, not a threshold (the most likely token may fall outside the typical set).

Each filter becomes one threshold in logit units per row (the smallest kept logit), and the mask
is ``l >= threshold``. Thresholds are values, not positions, so tokens tied with the last kept
one are kept too: a filter can keep a few more tokens than its exact definition when logits tie.

Drawing: the exponential race. With E_i ~ Exp(1) independent, argmax_{i in S} p_i / E_i is
distributed as p restricted to S and renormalised (the renormalisation never has to be computed,
since a common factor does not change an argmax). In logits::

    token = argmin_{i in S} (log E_i - l_i / T)

E_i = -log(u_i) with u_i = uniform(hash(seed, counter, i)) computed by integer ops on the device:
a SplitMix64 finaliser turns (seed, counter) into a 32-bit row key, and the lowbias32 hash
(Wellons) of key ^ w(i) gives 32 bits per token, of which 23 become u in (0, 1) exactly
(u = (m + 1/2) / 2^23, never 0 or 1, so log E is finite). The draw is therefore a pure function of
(seed, counter, logits row): the same in any batch, at any row, and after a preempted request
resumes (``counter`` is the index of the token within the request's output, not a step number).
PyTorch has no unsigned integers with logical shifts, so right shifts are arithmetic and masked;
multiplications wrap modulo 2^32 (int32) or 2^64 (int64), as the hashes require.

Penalties (applied before everything, greedy rows included), with c_i the count of token i in
the request's output so far:

    repetition (HF/vLLM; i in the prompt or c_i > 0):  l_i = l_i / r if l_i > 0 else l_i * r
    frequency and presence (OpenAI):                    l_i -= f * c_i + p * (c_i > 0)

Design for the serving loop:

* ``SamplingBuffers`` holds the per-row parameters as device tensors of a fixed capacity, filled by
  one host-to-device copy from a pinned staging buffer, so a CUDA graph captured around
  ``sample`` replays with new contents.
* ``sample`` never synchronises with the host and has no data-dependent shapes; its only Python
  branches are on ``SamplerMode``, host flags computed from the batch. A greedy-only batch without
  penalties is one argmax launch. A mode with more flags than the batch needs gives bitwise the
  same tokens (disabled filters and zero penalties are exact no-ops), so one graph captured with
  every flag set serves every batch.
* Temporaries: the random path holds two [N, V] 32-bit buffers (noise, scratch) and a bool mask
  beside the caller's logits; the top-k/top-p path adds one descending sort and a cumulative sum
  of the sorted probabilities, freed before the noise is drawn.

Log-probabilities: ``processed_logits`` rebuilds, with the same helpers, parameters and mode as
``sample``, each row's distribution as logits (penalised, divided by T, -inf outside the kept
set; greedy rows: the penalised logits at T = 1), and ``token_logprobs`` turns any [R, V] logits
into the sampled token's log_softmax and the top k, batched, without a host synchronisation.

Preconditions, validated where requests enter (``BOUNDS``): temperature in [0, 2], top_p and
typical_p in (0, 1], min_p in [0, 1], repetition_penalty in (0, 10]. Rows of ``logits`` past the batch may hold
anything (NaN, inf): they sample as greedy rows and yield some token id in [0, V).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from adaptermesh.worker.step_plan import SamplingRow
from adaptermesh.worker.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
)

__all__ = [
    "BOUNDS",
    "GREEDY",
    "RANDOM",
    "Bound",
    "LogitBias",
    "RowParams",
    "SamplerMode",
    "SamplingBounds",
    "SamplingBuffers",
    "apply_logit_bias",
    "apply_penalties",
    "counts_from_tokens",
    "entry_logit_bias",
    "gather_logprobs",
    "logprob_output_ends",
    "penalised",
    "penalty_inputs",
    "processed_entries",
    "processed_logits",
    "prompt_mask_from_tokens",
    "row_params",
    "sample",
    "sample_entries",
    "token_logprobs",
    "unpack_logprobs",
]


@dataclass(frozen=True, slots=True)
class RowParams:
    """One row's sampling parameters (see the module docstring for their meaning)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0  # any integer; its low 64 bits are used
    counter: int = 0  # index of the token being sampled within the request's output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    typical_p: float = 1.0


@dataclass(frozen=True, slots=True)
class SamplerMode:
    """Which stages ``sample`` runs. Flags may be set when no row needs them (same tokens, more
    work), never cleared when one does. ``repetition`` implies ``penalties``."""

    any_random: bool  # some row has temperature > 0
    any_top_p_or_k: bool  # some random row has top_p < 1 or top_k > 0
    any_min_p: bool  # some random row has min_p > 0
    penalties: bool  # some row has a presence, frequency or repetition penalty
    repetition: bool  # some row has repetition_penalty != 1
    any_typical: bool = False  # some random row has typical_p < 1

    def __post_init__(self) -> None:
        if self.repetition and not self.penalties:
            raise ValueError("SamplerMode: repetition requires penalties")

    @staticmethod
    def of(rows: list[RowParams]) -> SamplerMode:
        random = [r for r in rows if r.temperature > 0.0]
        repetition = any(r.repetition_penalty != 1.0 for r in rows)
        return SamplerMode(
            any_random=bool(random),
            any_top_p_or_k=any(r.top_p < 1.0 or r.top_k > 0 for r in random),
            any_min_p=any(r.min_p > 0.0 for r in random),
            penalties=repetition
            or any(r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 for r in rows),
            repetition=repetition,
            any_typical=any(r.typical_p < 1.0 for r in random),
        )


# Sampler variants a graph is captured for: greedy rows only, or any mix with random rows
# (top-k / top-p / min-p filters always on in that variant; disabled values are no-ops).
# Penalties, logit_bias and typical-p rows run eagerly (no graph variant has them).
GREEDY = SamplerMode(
    any_random=False, any_top_p_or_k=False, any_min_p=False, penalties=False, repetition=False
)
RANDOM = SamplerMode(
    any_random=True, any_top_p_or_k=True, any_min_p=True, penalties=False, repetition=False
)


def graph_mode(rows: list[SamplingRow | None]) -> SamplerMode:
    """The graph variant that serves these entries: RANDOM when some row draws."""
    return RANDOM if any(r is not None and r.sampling.temperature > 0 for r in rows) else GREEDY


def eager_only(sampling: SamplingParams) -> bool:
    """Whether a row needs a logit processor or filter no graph variant has."""
    return penalised(sampling) or bool(sampling.logit_bias) or sampling.typical_p < 1.0


# ---- parameter bounds -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bound:
    """A closed interval [low, high], or (low, high] with ``low_open``."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False  # (an int of any size compares exactly with the float limits)
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        low = f"{self.low:g}"
        return f"{'(' if self.low_open else '['}{low}, {self.high:g}]"

    def field_limits(self) -> dict[str, float]:
        """The limits as a pydantic ``Field``'s keyword arguments."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}


@dataclass(frozen=True, slots=True)
class SamplingBounds:
    """The limits of every sampling parameter, in one place: the OpenAI API models
    (``api.py``) build their field constraints from it and the engine checks each request
    against it (``check``), so the two cannot disagree. Temperature follows OpenAI (0 to 2)."""

    temperature: Bound = Bound(0.0, 2.0)
    top_p: Bound = Bound(0.0, 1.0, low_open=True)
    typical_p: Bound = Bound(0.0, 1.0, low_open=True)
    min_p: Bound = Bound(0.0, 1.0)
    max_top_k: int = (1 << 31) - 1  # an int32 on the device; 0 = off
    presence_penalty: Bound = Bound(-2.0, 2.0)
    frequency_penalty: Bound = Bound(-2.0, 2.0)
    repetition_penalty: Bound = Bound(0.0, 10.0, low_open=True)
    max_logprobs: int = MAX_LOGPROBS
    max_logit_bias: int = MAX_LOGIT_BIAS
    logit_bias: Bound = Bound(-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)

    def check(self, sampling: SamplingParams, vocab: int) -> None:
        """``InvalidRequestError`` naming the first parameter of ``sampling`` out of bounds."""
        for name in ("temperature", "top_p", "typical_p", "min_p"):
            self._check_float(name, getattr(sampling, name))
        top_k = sampling.top_k
        if (
            not isinstance(top_k, int)
            or isinstance(top_k, bool)
            or not 0 <= top_k <= self.max_top_k
        ):
            raise InvalidRequestError(
                "top_k", f"must be an integer in [0, {self.max_top_k}] (0 = off), got {top_k!r}"
            )
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            self._check_float(name, getattr(sampling, name))
        logprobs = sampling.logprobs
        if logprobs is not None and (
            not isinstance(logprobs, int)
            or isinstance(logprobs, bool)
            or not 0 <= logprobs <= self.max_logprobs
        ):
            raise InvalidRequestError(
                "logprobs",
                f"must be None or an integer in [0, {self.max_logprobs}], got {logprobs!r}",
            )
        seed = sampling.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {seed!r}")
        self.check_logit_bias(sampling.logit_bias, vocab)

    def _check_float(self, name: str, value: object) -> None:
        bound: Bound = getattr(self, name)
        if value not in bound:
            raise InvalidRequestError(
                name, f"must be a number in {bound.describe()}, got {value!r}"
            )

    def check_logit_bias(self, pairs: tuple[tuple[int, float], ...], vocab: int) -> None:
        if len(pairs) > self.max_logit_bias:
            raise InvalidRequestError(
                "logit_bias", f"may bias at most {self.max_logit_bias} tokens, got {len(pairs)}"
            )
        seen: set[int] = set()
        for token, bias in pairs:
            if type(token) is not int or not 0 <= token < vocab:
                raise InvalidRequestError(
                    "logit_bias", f"token id {token!r} is outside the vocabulary [0, {vocab})"
                )
            if token in seen:
                raise InvalidRequestError("logit_bias", f"token {token} is named twice")
            seen.add(token)
            if bias not in self.logit_bias:
                raise InvalidRequestError(
                    "logit_bias",
                    f"the bias of token {token} must be in {self.logit_bias.describe()}, "
                    f"got {bias!r}",
                )


BOUNDS = SamplingBounds()


def penalised(sampling: SamplingParams) -> bool:
    """Whether a request samples with presence, frequency or repetition penalties."""
    return (
        sampling.presence_penalty != 0.0
        or sampling.frequency_penalty != 0.0
        or sampling.repetition_penalty != 1.0
    )


def row_params(rows: list[SamplingRow | None]) -> list[RowParams]:
    """Each step entry's sampling parameters (padding entries, None: greedy)."""
    out: list[RowParams] = []
    for row in rows:
        if row is None:
            out.append(RowParams(temperature=0.0))
            continue
        sampling = row.sampling
        out.append(
            RowParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                seed=row.seed,
                counter=row.counter,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                repetition_penalty=sampling.repetition_penalty,
                typical_p=sampling.typical_p,
            )
        )
    return out


# ---- parameter buffers ----------------------------------------------------------------------

# Staging layout, one block of ``capacity`` elements per field, int64 fields first so every
# block starts aligned: [seed, counter] int64 | [the _F32_FIELDS] fp32 | [top_k] int32.
# SamplingBuffers' tensor fields are views of one device buffer with this layout.
_I64_FIELDS = ("seed", "counter")
_F32_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "typical_p",
)
_I32_FIELDS = ("top_k",)
_ROW_BYTES = 8 * len(_I64_FIELDS) + 4 * len(_F32_FIELDS) + 4 * len(_I32_FIELDS)
# Values of the rows past the batch: a greedy row with every filter and penalty off.
_F32_DEFAULTS = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=np.float32)[:, None]
_get_f32 = operator.attrgetter(*_F32_FIELDS)
_U64_MASK = (1 << 64) - 1
_Array = np.ndarray[Any, Any]


@dataclass(eq=False)
class SamplingBuffers:
    """Per-row sampling parameters as device tensors of a fixed capacity (so a CUDA graph can
    capture ``sample()`` once and replay it with new contents).

    ``fill`` and ``sample`` must run on the same CUDA stream.
    """

    temperature: Tensor  # [C] fp32, 0 = greedy
    top_p: Tensor  # [C] fp32 in (0, 1]
    top_k: Tensor  # [C] int32, <= 0 or >= vocab = disabled
    min_p: Tensor  # [C] fp32, 0 = disabled
    seed: Tensor  # [C] int64
    counter: Tensor  # [C] int64, index of the token being sampled within the request's output
    presence_penalty: Tensor  # [C] fp32
    frequency_penalty: Tensor  # [C] fp32
    repetition_penalty: Tensor  # [C] fp32, 1 = disabled
    typical_p: Tensor  # [C] fp32 in (0, 1], 1 = disabled
    _device: Tensor = field(repr=False)  # [C * _ROW_BYTES] uint8, the storage of the fields above
    _host: Tensor = field(repr=False)  # same layout on the host, pinned when the device is CUDA
    _staging: tuple[_Array, _Array, _Array] = field(
        repr=False
    )  # numpy views of _host: i64, f32, i32
    _copied: torch.Event | None = field(repr=False)  # the last fill's copy, on CUDA

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str) -> SamplingBuffers:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        device = torch.device(device)
        c = capacity
        dev = torch.zeros(c * _ROW_BYTES, dtype=torch.uint8, device=device)
        host = torch.zeros(c * _ROW_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
        f32_at, i32_at = 8 * len(_I64_FIELDS) * c, (8 * len(_I64_FIELDS) + 4 * len(_F32_FIELDS)) * c

        def blocks(buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return (
                buf[:f32_at].view(torch.int64).view(len(_I64_FIELDS), c),
                buf[f32_at:i32_at].view(torch.float32).view(len(_F32_FIELDS), c),
                buf[i32_at:].view(torch.int32).view(len(_I32_FIELDS), c),
            )

        i64, f32, i32 = blocks(dev)
        views = {name: i64[j] for j, name in enumerate(_I64_FIELDS)}
        views |= {name: f32[j] for j, name in enumerate(_F32_FIELDS)}
        views |= {name: i32[j] for j, name in enumerate(_I32_FIELDS)}
        staging = tuple(b.numpy() for b in blocks(host))
        buffers = cls(
            **views,
            _device=dev,
            _host=host,
            _staging=(staging[0], staging[1], staging[2]),
            _copied=torch.Event(device) if device.type == "cuda" else None,
        )
        buffers.fill([])
        return buffers

    @property
    def capacity(self) -> int:
        return int(self.temperature.shape[0])

    def fill(self, rows: list[RowParams]) -> None:
        """Rows 0..len(rows)-1 take ``rows``; the rest become greedy. One host-to-device copy."""
        n = len(rows)
        if n > self.capacity:
            raise ValueError(f"{n} rows do not fit in sampling buffers of capacity {self.capacity}")
        if self._copied is not None:
            # The previous copy may still be reading the pinned staging buffer.
            self._copied.synchronize()
        i64, f32, i32 = self._staging
        if n:
            i64[0, :n] = np.array([r.seed & _U64_MASK for r in rows], dtype=np.uint64).view(
                np.int64
            )
            i64[1, :n] = [r.counter for r in rows]
            f32[:, :n] = np.array([_get_f32(r) for r in rows], dtype=np.float32).T
            i32[0, :n] = [r.top_k for r in rows]
        i64[:, n:] = 0
        f32[:, n:] = _F32_DEFAULTS
        i32[:, n:] = 0
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


# ---- noise ----------------------------------------------------------------------------------


def _s64(x: int) -> int:
    """The int64 with the bits of the unsigned 64-bit constant ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _s32(x: int) -> int:
    """The int32 with the bits of the unsigned 32-bit constant ``x``."""
    return x - (1 << 32) if x >= 1 << 31 else x


# SplitMix64 (Steele, Lea, Flood 2014): state seed + (counter + 1) * golden gamma, then its finaliser.
_GAMMA64 = _s64(0x9E3779B97F4A7C15)
_MIX64_A = _s64(0xBF58476D1CE4E5B9)
_MIX64_B = _s64(0x94D049BB133111EB)
# lowbias32 (C. Wellons, "hash-prospector"): x ^= x >> 16; x *= A; x ^= x >> 15; x *= B; x ^= x >> 16.
_MIX32_A = _s32(0x7FEB352D)
_MIX32_B = _s32(0x846CA68B)
_GAMMA32 = _s32(0x9E3779B9)  # spreads consecutive token ids before the hash
_ONE_MINUS_HALF_ULP = 1.0 - 2.0**-24


def _lsr64(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``s`` (an arithmetic shift with the sign bits masked)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _xorshift32_(x: Tensor, s: int, scratch: Tensor) -> None:
    """x ^= x >>> s for int32 ``x``, in place; ``scratch`` is an int32 tensor of x's shape."""
    torch.bitwise_right_shift(x, s, out=scratch)
    scratch &= (1 << (32 - s)) - 1
    x ^= scratch


def _row_keys(seed: Tensor, counter: Tensor) -> Tensor:
    """[N] int32 key of each (seed, counter): the high half of SplitMix64's mix."""
    z = torch.add(seed, counter, alpha=_GAMMA64)
    z += _GAMMA64  # state seed + (counter + 1) * gamma: (0, 0) does not hash to the fixed point 0
    z ^= _lsr64(z, 30)
    z *= _MIX64_A
    z ^= _lsr64(z, 27)
    z *= _MIX64_B
    # The high 32 bits of the last product are the best mixed; SplitMix64's final
    # z ^= z >>> 31 would only flip their lowest bit.
    return (z >> 32).to(torch.int32)


def _uniform(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """[N, V] fp32 u in (0, 1), u[r, i] = uniform(lowbias32(key(seed_r, counter_r) ^ w(i))).

    lowbias32's first xorshift is linear over xor, so it is applied to the token term w(i) alone
    ([V] work instead of [N, V]); the row key, already a hash output, needs no such step.
    """
    w = torch.arange(vocab, dtype=torch.int32, device=seed.device)
    w *= _GAMMA32
    w ^= (w >> 16) & 0xFFFF
    x = _row_keys(seed, counter)[:, None] ^ w
    scratch = torch.empty_like(x)
    x *= _MIX32_A
    _xorshift32_(x, 15, scratch)
    x *= _MIX32_B
    _xorshift32_(x, 16, scratch)
    # 23 random mantissa bits under the exponent of 1.0 give f in [1, 2); f - (1 - 2^-24) is
    # exact and lies in [2^-24, 1 - 2^-24].
    x &= 0x7FFFFF
    x |= 0x3F800000
    return x.view(torch.float32).sub_(_ONE_MINUS_HALF_ULP)


# ---- penalties ------------------------------------------------------------------------------


def apply_penalties(
    logits: Tensor,  # [N, V] fp32
    buf: SamplingBuffers,  # capacity >= N; uses the first N rows
    token_counts: Tensor,  # [N, V] int32, count of each token in each row's output so far
    prompt_mask: Tensor
    | None = None,  # [N, V] bool, token present in the prompt; None: skip repetition
) -> Tensor:
    """[N, V] fp32 logits with the repetition (when ``prompt_mask`` is given), frequency and
    presence penalties applied; ``logits`` is not modified."""
    n = logits.shape[0]
    if token_counts.shape != logits.shape:
        raise ValueError(
            f"token_counts has shape {tuple(token_counts.shape)}, logits {tuple(logits.shape)}"
        )
    in_output = token_counts > 0
    if prompt_mask is not None:
        if prompt_mask.shape != logits.shape:
            raise ValueError(
                f"prompt_mask has shape {tuple(prompt_mask.shape)}, logits {tuple(logits.shape)}"
            )
        rep = buf.repetition_penalty[:n, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(in_output | prompt_mask, penalised, logits)
    out = logits - token_counts * buf.frequency_penalty[:n, None]
    out -= in_output * buf.presence_penalty[:n, None]
    return out


# ---- sampling -------------------------------------------------------------------------------


def _top_k_top_p_threshold(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor
) -> Tensor:
    """[N, 1] smallest logit kept by top-k then top-p (on the top-k renormalised distribution).

    ``temperature`` [N, 1] (> 0), ``top_k`` [N] int32, ``top_p`` [N] fp32.
    """
    vocab = logits.shape[1]
    ordered = torch.sort(logits, dim=-1, descending=True).values
    # Position of the k-th largest logit; k <= 0 and k >= V both mean V.
    last_k = (top_k.to(torch.int64).clamp(0, vocab) - 1).remainder_(vocab)[:, None]
    cum = torch.softmax(ordered / temperature, dim=-1).cumsum_(dim=-1)
    # First position where the mass reaches top_p of the top-k mass; clamped to the top-k set
    # and ignored for top_p >= 1, where cumsum rounding could otherwise drop a long tail.
    target = cum.gather(1, last_k) * top_p[:, None]
    last_p = torch.searchsorted(cum, target)
    last = torch.where(top_p[:, None] >= 1.0, last_k, torch.minimum(last_p, last_k))
    return ordered.gather(1, last)


def _tempered_threshold(
    logits: Tensor, top: Tensor, buf: SamplingBuffers, mode: SamplerMode
) -> tuple[Tensor, Tensor, Tensor | None]:
    """For a mode with random rows, from the logits and their [N, 1] row maxima: ([N] greedy-row
    flags, [N, 1] temperature with greedy rows at 1, [N, 1] smallest kept logit or None when no
    filter runs)."""
    n = logits.shape[0]
    temp = buf.temperature[:n]
    is_greedy = temp == 0.0
    t = torch.where(is_greedy, 1.0, temp)[:, None]  # greedy rows divide by 1
    threshold: Tensor | None = None
    if mode.any_top_p_or_k:
        threshold = _top_k_top_p_threshold(logits, t, buf.top_k[:n], buf.top_p[:n])
    if mode.any_min_p:
        # p_i >= min_p * p_max  <=>  l_i >= l_max + T * log(min_p); min_p = 0 gives -inf.
        floor = torch.addcmul(top, t, torch.log(buf.min_p[:n])[:, None])
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    return is_greedy, t, threshold


def _typical_removed(
    logits: Tensor, t: Tensor, threshold: Tensor | None, buf: SamplingBuffers, mode: SamplerMode
) -> Tensor | None:
    """[N, V] bool: the tokens typical-p removes from each row's kept set (None when no row
    asks). The distribution is the tempered one renormalised over the tokens the other
    filters keep (``logits >= threshold``), as transformers' ``TypicalLogitsWarper`` sees it
    after them; the steps are the warper's, so the sets agree token for token."""
    if not mode.any_typical:
        return None
    n, vocab = logits.shape
    typical_p = buf.typical_p[:n]
    scores = logits / t
    if threshold is not None:
        scores = scores.masked_fill(logits < threshold, -math.inf)
    log_q = torch.log_softmax(scores, dim=-1)
    entropy = -(log_q * log_q.exp()).nansum(dim=-1, keepdim=True)
    shifted = (-log_q - entropy).abs_()
    ordered, order = torch.sort(shifted, dim=-1)
    mass = scores.gather(1, order).softmax(dim=-1).cumsum_(dim=-1)
    last = (mass < typical_p[:, None]).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)
    removed = shifted > ordered.gather(1, last)
    removed &= (typical_p < 1.0)[:, None]
    return removed


def _penalised(
    logits: Tensor,
    buf: SamplingBuffers,
    mode: SamplerMode,
    token_counts: Tensor | None,
    prompt_mask: Tensor | None,
) -> Tensor:
    if not mode.penalties:
        return logits
    if token_counts is None:
        raise ValueError("mode.penalties needs token_counts")
    if mode.repetition and prompt_mask is None:
        raise ValueError("mode.repetition needs prompt_mask")
    return apply_penalties(logits, buf, token_counts, prompt_mask if mode.repetition else None)


def _check(logits: Tensor, buf: SamplingBuffers) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [N, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[0] > buf.capacity:
        raise ValueError(
            f"{logits.shape[0]} rows exceed sampling buffers of capacity {buf.capacity}"
        )


def sample(
    logits: Tensor,  # [N, V] fp32; rows past the batch may hold anything
    buf: SamplingBuffers,  # capacity >= N; uses the first N rows
    *,
    mode: SamplerMode,
    token_counts: Tensor | None = None,  # [N, V] int32, needed when mode.penalties
    prompt_mask: Tensor | None = None,  # [N, V] bool, needed when mode.repetition
    out: Tensor | None = None,  # [N] int64 destination
) -> Tensor:
    """[N] int64 token ids, one per row, on the logits' device (see the module docstring)."""
    _check(logits, buf)
    n, vocab = logits.shape
    logits = _penalised(logits, buf, mode, token_counts, prompt_mask)
    if not mode.any_random:
        return torch.argmax(logits, dim=-1, out=out)

    top, greedy = logits.max(dim=-1, keepdim=True)
    is_greedy, t, threshold = _tempered_threshold(logits, top, buf, mode)
    removed = _typical_removed(logits, t, threshold, buf, mode)
    # score = log E - l / T with E = -log(u); the minimum wins the race.
    score = _uniform(buf.seed[:n], buf.counter[:n], vocab).log_().neg_().log_()
    score.addcdiv_(logits, t, value=-1.0)
    if threshold is not None:
        score.masked_fill_(logits < threshold, math.inf)
    if removed is not None:
        score.masked_fill_(removed, math.inf)
    drawn = score.argmin(dim=-1)
    return torch.where(is_greedy, greedy[:, 0], drawn, out=out)


# ---- log-probabilities ----------------------------------------------------------------------


def processed_logits(
    logits: Tensor,  # [N, V] fp32
    buf: SamplingBuffers,  # capacity >= N; uses the first N rows
    *,
    mode: SamplerMode,
    token_counts: Tensor | None = None,  # [N, V] int32, needed when mode.penalties
    prompt_mask: Tensor | None = None,  # [N, V] bool, needed when mode.repetition
) -> Tensor:
    """[N, V] fp32: each row's sampling distribution as logits, built by the same code as
    ``sample`` with the same parameters and mode: penalties applied, divided by the row's
    temperature, and -inf outside the row's kept set (top-k, top-p, min-p, typical-p). ``log_softmax`` of a
    row is then the log-probability ``sample`` draws each token with, so a drawn token's is
    always finite. A greedy row (temperature 0) is its penalised logits, unfiltered: the token
    is their argmax and its log-probability is that of the penalised distribution at T = 1.
    The result may be ``logits`` itself (a greedy mode without penalties)."""
    _check(logits, buf)
    logits = _penalised(logits, buf, mode, token_counts, prompt_mask)
    if not mode.any_random:
        return logits
    top = logits.amax(dim=-1, keepdim=True)
    is_greedy, t, threshold = _tempered_threshold(logits, top, buf, mode)
    removed = _typical_removed(logits, t, threshold, buf, mode)
    out = logits / t
    if threshold is not None:
        out.masked_fill_((logits < threshold) & ~is_greedy[:, None], -math.inf)
    if removed is not None:
        out.masked_fill_(removed & ~is_greedy[:, None], -math.inf)
    return out


def token_logprobs(
    logits: Tensor,  # [R, V] float, the distribution of each row as logits (raw or processed)
    tokens: Tensor,  # [R] int64, each row's sampled token
    k: int,  # alternatives per row, 0 <= k <= V
    widths: Tensor | None = None,  # [R] int: each row's vocabulary (None: all of V)
) -> tuple[Tensor, Tensor, Tensor]:
    """(the [R] log-probability of each row's token, the [R, k] k largest log-probabilities in
    descending order, their [R, k] int64 token ids), from ``log_softmax`` over each row in fp32.
    Batched: a handful of launches whatever R is, and no host synchronisation.

    With ``widths`` (rows of different vocabularies, ``extra_vocab``), the alternatives never
    name an id at or past the row's vocabulary: a token of the vocabulary that the row's
    filters removed (-inf) is reported at the most negative float instead, ahead of them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    ranked = lp
    if widths is not None:
        cols = torch.arange(lp.shape[1], device=lp.device)
        inside = cols.unsqueeze(0) < widths.to(lp.device).unsqueeze(1)
        floor = torch.finfo(lp.dtype).min
        ranked = torch.where(inside, lp.clamp(min=floor), torch.full_like(lp, -math.inf))
    top = torch.topk(ranked, k, dim=-1)
    return chosen, top.values, top.indices


# ---- logprobs in a step's output --------------------------------------------------------------
# One int64 vector per step carries everything the host reads back, with one copy: the sampled
# ids [S], then for logprob steps the values [R, k + 1] (fp64 bits: the sampled token's, then
# the top k) and the top ids [R, k] of the R asking entries, k alternatives each.


def logprob_output_ends(num_entries: int, num_rows: int, alternatives: int) -> tuple[int, int]:
    """Where the values [R, alternatives + 1] and the top ids [R, alternatives] of a step's
    output end (they start at ``num_entries`` and at the values' end)."""
    values_end = num_entries + num_rows * (alternatives + 1)
    return values_end, values_end + num_rows * alternatives


def gather_logprobs(
    out: Tensor,
    tokens: Tensor,
    logits: Tensor,
    num_entries: int,
    entries: list[int],
    alternatives: int,
    rows_host: Tensor,
    widths: Tensor | None = None,
) -> int:
    """Fill ``out`` with the step's ids ``tokens[:num_entries]``, then the fp64 bits of the
    [R, alternatives + 1] values (each asking entry's sampled-token logprob, then its top
    ``alternatives``) and the top ids [R, alternatives]; returns how many int64 elements to
    copy. ``rows_host`` stages the asking entries' indices (pinned on CUDA); ``widths`` [S]:
    each entry's vocabulary, in a step with rows of different vocabularies. All on the
    device, after the step's work on the same stream; no host synchronisation."""
    num_rows = len(entries)
    rows_host[:num_rows] = torch.tensor(entries, dtype=torch.int64)
    rows = rows_host[:num_rows].to(out.device, non_blocking=True)
    out[:num_entries].copy_(tokens[:num_entries])
    chosen, top_values, top_ids = token_logprobs(
        logits.index_select(0, rows),
        tokens.index_select(0, rows),
        alternatives,
        None if widths is None else widths.index_select(0, rows),
    )
    values_end, ids_end = logprob_output_ends(num_entries, num_rows, alternatives)
    values = out[num_entries:values_end].view(torch.float64).view(num_rows, alternatives + 1)
    values[:, 0] = chosen
    if alternatives:
        values[:, 1:] = top_values
        out[values_end:ids_end].view(num_rows, alternatives).copy_(top_ids)
    return ids_end


def unpack_logprobs(
    host: Tensor, num_entries: int, num_rows: int, alternatives: int
) -> tuple[list[list[float]], list[list[int]]]:
    """The host copy of ``gather_logprobs``'s output: per asking row, [its token's logprob,
    then the top ``alternatives``], and the top ids."""
    values_end, ids_end = logprob_output_ends(num_entries, num_rows, alternatives)
    values = (
        host[num_entries:values_end].view(torch.float64).view(num_rows, alternatives + 1).tolist()
    )
    ids = host[values_end:ids_end].view(num_rows, alternatives).tolist()
    return values, ids


# ---- logit bias -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogitBias:
    """A step's logit biases as device tensors: ``index`` [B] int64 (row * V + token id) and
    ``values`` [B] fp32, for ``apply_logit_bias``."""

    index: Tensor
    values: Tensor

    @staticmethod
    def of(
        rows: list[tuple[tuple[int, float], ...]], vocab: int, device: torch.device | str
    ) -> LogitBias | None:
        """The biases of each row (``rows[r]``: its (token id, bias) pairs, ids distinct and in
        [0, vocab)), or None when no row has one. One host-to-device copy per tensor."""
        index = [r * vocab + token for r, pairs in enumerate(rows) for token, _ in pairs]
        if not index:
            return None
        for r, pairs in enumerate(rows):
            for token, _ in pairs:
                if not 0 <= token < vocab:
                    raise ValueError(f"row {r} biases token {token}, outside [0, {vocab})")
        device = torch.device(device)
        pin = device.type == "cuda"
        host_index = torch.tensor(index, dtype=torch.int64)
        host_values = torch.tensor(
            [bias for pairs in rows for _, bias in pairs], dtype=torch.float32
        )
        if pin:
            host_index, host_values = host_index.pin_memory(), host_values.pin_memory()
        return LogitBias(
            host_index.to(device, non_blocking=True), host_values.to(device, non_blocking=True)
        )


def apply_logit_bias(logits: Tensor, bias: LogitBias) -> Tensor:
    """[N, V] ``logits`` with each row's biases added (OpenAI's ``logit_bias``, as vLLM applies
    it: to the logits, before penalties, temperature and filters); ``logits`` is not modified.
    The biased tokens' indices must lie within the first N rows."""
    out = logits.clone()
    out.view(-1).index_add_(0, bias.index, bias.values)
    return out


# ---- penalty inputs -------------------------------------------------------------------------


def _flat_token_index(tokens: list[list[int]], vocab: int, device: torch.device | str) -> Tensor:
    """[N * L] int64 on ``device``: r * V + token for each token of each row, padded with N * V
    (a spare slot past the [N, V] block). One host-to-device copy."""
    device = torch.device(device)
    rows = len(tokens)
    width = max((len(t) for t in tokens), default=0)
    host = torch.full(
        (rows, max(width, 1)), rows * vocab, dtype=torch.int64, pin_memory=device.type == "cuda"
    )
    flat = host.numpy()
    for r, toks in enumerate(tokens):
        if toks:
            ids = np.asarray(toks, dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"row {r} has a token id outside [0, {vocab})")
            flat[r, : len(ids)] = ids + r * vocab
    return host.view(-1).to(device, non_blocking=True)


def counts_from_tokens(tokens: list[list[int]], vocab: int, device: torch.device | str) -> Tensor:
    """[N, V] int32 count of each token id in each row of ``tokens`` (N = len(tokens))."""
    index = _flat_token_index(tokens, vocab, device)
    counts = torch.zeros(len(tokens) * vocab + 1, dtype=torch.int32, device=index.device)
    counts.scatter_add_(
        0, index, torch.ones(1, dtype=torch.int32, device=index.device).expand_as(index)
    )
    return counts[:-1].view(len(tokens), vocab)


def prompt_mask_from_tokens(
    tokens: list[list[int]], vocab: int, device: torch.device | str
) -> Tensor:
    """[N, V] bool, True where the token id occurs in that row of ``tokens`` (N = len(tokens))."""
    index = _flat_token_index(tokens, vocab, device)
    mask = torch.zeros(len(tokens) * vocab + 1, dtype=torch.bool, device=index.device)
    mask.index_fill_(0, index, True)
    return mask[:-1].view(len(tokens), vocab)


# ---- a step's processor inputs --------------------------------------------------------------


def entry_logit_bias(
    entries: list[SamplingRow | None], vocab: int, device: torch.device | str
) -> LogitBias | None:
    """The logit biases of a step's entries on the device (padding entries: none)."""
    return LogitBias.of(
        [row.sampling.logit_bias if row is not None else () for row in entries], vocab, device
    )


def penalty_inputs(
    entries: list[SamplingRow | None], vocab: int, device: torch.device | str, mode: SamplerMode
) -> tuple[Tensor | None, Tensor | None]:
    """The token counts (``mode.penalties``) and prompt masks (``mode.repetition``) of a step's
    entries, from the tokens each row carries (rows without penalties carry none: zero
    penalties are exact no-ops)."""
    outputs = [list(row.output) if row is not None else [] for row in entries]
    contexts = [list(row.context) if row is not None else [] for row in entries]
    counts = counts_from_tokens(outputs, vocab, device) if mode.penalties else None
    prompt_mask = prompt_mask_from_tokens(contexts, vocab, device) if mode.repetition else None
    return counts, prompt_mask


def sample_entries(
    logits: Tensor,  # [S, V] fp32: the step's logits (a masked step's already masked)
    buf: SamplingBuffers,
    mode: SamplerMode,
    entries: list[SamplingRow | None],
    *,
    bias: LogitBias | None = None,
    penalties: bool = False,
    observe: Callable[[Tensor, list[SamplingRow | None]], None] | None = None,
) -> Tensor:
    """A step's token ids [S], through the processors in order: ``logit_bias``, then (when
    some row has them, eager steps only) penalties over each row's past tokens with the rows'
    exact mode, then the filters and the draw. ``observe`` sees the logits the draw starts
    from (after the bias). Inside a captured graph this runs once, at capture; the replays
    repeat its device work."""
    biased = logits if bias is None else apply_logit_bias(logits, bias)
    if observe is not None:
        observe(biased, entries)
    if not penalties:
        return sample(biased, buf, mode=mode)
    mode = SamplerMode.of(row_params(entries))
    counts, prompt_mask = penalty_inputs(entries, int(logits.shape[1]), logits.device, mode)
    return sample(biased, buf, mode=mode, token_counts=counts, prompt_mask=prompt_mask)


def processed_entries(
    logits: Tensor,  # [>= S, V] fp32
    buf: SamplingBuffers,
    mode: SamplerMode,
    entries: list[SamplingRow | None],
    *,
    bias: LogitBias | None = None,
) -> Tensor:
    """The step's first S = len(entries) logits as its sampler processed them (bias, the same
    buffers and mode; penalty steps rebuild their token counts), for processed logprobs."""
    logits = logits[: len(entries)]
    if bias is not None:
        logits = apply_logit_bias(logits, bias)
    counts = prompt_mask = None
    if mode.penalties:
        counts, prompt_mask = penalty_inputs(entries, int(logits.shape[1]), logits.device, mode)
    return processed_logits(logits, buf, mode=mode, token_counts=counts, prompt_mask=prompt_mask)
