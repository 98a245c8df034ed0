"""The batched sampler: greedy and random rows, filters, penalties, determinism per (seed, counter),
empirical distributions against an exact float64 oracle, parameter buffers, CUDA graph replay."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from adaptermesh.worker.sampling import (
    RowParams,
    SamplerMode,
    SamplingBuffers,
    _uniform,
    apply_penalties,
    counts_from_tokens,
    processed_logits,
    prompt_mask_from_tokens,
    sample,
    token_logprobs,
)

# ---- helpers ---------------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    """Records the aten ops dispatched inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def draw(
    logits: torch.Tensor, rows: list[RowParams], mode: SamplerMode | None = None, **kw: torch.Tensor
) -> list[int]:
    buf = SamplingBuffers.allocate(len(rows), logits.device)
    buf.fill(rows)
    return sample(logits, buf, mode=mode or SamplerMode.of(rows), **kw).tolist()


def oracle(logits: np.ndarray, r: RowParams, slack: float = 0.0) -> np.ndarray:
    """Exact filtered distribution of one row in float64 (independent of the implementation).

    ``slack`` loosens top-p and min-p so that the result is a superset robust to fp32 rounding.
    Filters keep every token tied with the last kept one (the sampler's documented tie rule).
    """
    v = logits.shape[0]
    x = logits.astype(np.float64)
    if r.temperature == 0.0:
        out = np.zeros(v)
        out[int(np.argmax(x))] = 1.0
        return out
    p = np.exp((x - x.max()) / r.temperature)
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    keep = np.ones(v, dtype=bool)
    if 0 < r.top_k < v:
        keep &= x >= x[order[r.top_k - 1]]
    top_p = r.top_p + slack
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        cum = np.cumsum(q[order]) / q.sum()
        cut = int(np.argmax(cum >= top_p))
        keep &= x >= x[order[cut]]
    if r.min_p > 0.0:
        keep &= p >= r.min_p * (1.0 - slack) * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def assert_frequencies(tokens: list[int], probs: np.ndarray) -> None:
    """Empirical frequencies within 4 standard errors of ``probs``; zero-probability tokens never drawn."""
    n = len(tokens)
    counts = np.bincount(np.asarray(tokens), minlength=probs.shape[0]) / n
    se = np.sqrt(probs * (1.0 - probs) / n)
    assert np.all(counts[probs == 0.0] == 0.0), (counts, probs)
    assert np.all(np.abs(counts - probs) <= 4.0 * se + 1e-12), (counts, probs)


LOGITS8 = torch.tensor([1.0, 2.2, -0.3, 1.6, 0.4, 2.0, -1.0, 0.9])
N_DRAWS = 20_000


def draws(r: RowParams, logits: torch.Tensor = LOGITS8, n: int = N_DRAWS) -> list[int]:
    """One token per counter 0..n-1 of the same request, in one batched call."""
    rows = [dataclasses.replace(r, counter=c) for c in range(n)]
    return draw(logits.expand(n, -1).contiguous(), rows)


# ---- greedy and mixed batches -----------------------------------------------------------------


def test_greedy_rows_are_argmax_in_one_launch() -> None:
    logits = torch.randn(6, 300)
    rows = [RowParams(0.0, top_p=0.3, top_k=4, seed=i) for i in range(6)]
    buf = SamplingBuffers.allocate(8, "cpu")
    buf.fill(rows)
    out = torch.empty(6, dtype=torch.int64)
    with _OpLog() as log:
        got = sample(logits, buf, mode=SamplerMode.of(rows), out=out)
    assert log.ops == ["argmax"]
    assert got is out
    assert torch.equal(got, logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax_and_random_rows_match_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 500)
    rows = [
        RowParams(0.0) if i % 2 else RowParams(1.0, top_p=0.9, seed=100 + i, counter=i)
        for i in range(8)
    ]
    got = draw(logits, rows)
    for i, r in enumerate(rows):
        if r.temperature == 0.0:
            assert got[i] == int(logits[i].argmax())
        else:
            assert got[i] == draw(logits[i : i + 1], [r])[0]


def test_sample_never_synchronises() -> None:
    logits = torch.randn(4, 64)
    rows = [
        RowParams(
            0.8,
            top_p=0.7,
            top_k=9,
            min_p=0.05,
            presence_penalty=0.3,
            repetition_penalty=1.2,
            seed=i,
        )
        for i in range(4)
    ]
    buf = SamplingBuffers.allocate(4, "cpu")
    buf.fill(rows)
    counts = counts_from_tokens([[1, 2], [3], [], [5, 5]], 64, "cpu")
    prompt = prompt_mask_from_tokens([[7], [8], [9], [10]], 64, "cpu")
    with _OpLog() as log:
        sample(logits, buf, mode=SamplerMode.of(rows), token_counts=counts, prompt_mask=prompt)
    syncing = {"_local_scalar_dense", "nonzero", "masked_select", "multinomial", "unique", "item"}
    assert not syncing & set(log.ops), log.ops


# ---- determinism ----------------------------------------------------------------------------


def test_same_seed_and_counter_give_the_same_token_in_any_batch() -> None:
    torch.manual_seed(1)
    v = 1000
    row_logits = torch.randn(v) * 2
    r = RowParams(0.9, top_p=0.95, top_k=200, min_p=0.01, seed=1234, counter=17)
    alone = draw(row_logits[None], [r])[0]
    for pos in (0, 7):
        for trial in range(3):
            others = torch.randn(16, v)
            others[pos] = row_logits
            rows = [
                RowParams(
                    float(trial + (i % 3)) * 0.5,
                    top_p=0.5 + 0.03 * i,
                    top_k=i,
                    seed=i * 7 + trial,
                    counter=trial,
                )
                for i in range(16)
            ]
            rows[pos] = r
            assert draw(others, rows)[pos] == alone


def test_different_counters_and_seeds_give_different_draws() -> None:
    logits = torch.zeros(1, 1000)
    by_counter = draws(RowParams(1.0, seed=5), logits=logits[0], n=200)
    by_seed = draw(
        logits.expand(200, -1).contiguous(), [RowParams(1.0, seed=s) for s in range(200)]
    )
    assert len(set(by_counter)) > 150
    assert len(set(by_seed)) > 150
    assert by_counter != draws(RowParams(1.0, seed=6), logits=logits[0], n=200)


def test_consecutive_counters_are_independent() -> None:
    tokens = draws(RowParams(1.0, seed=99), logits=torch.zeros(4), n=N_DRAWS + 1)
    pairs = Counter(itertools.pairwise(tokens))
    p, n = 1 / 16, N_DRAWS
    for a in range(4):
        for b in range(4):
            assert abs(pairs[(a, b)] / n - p) <= 4 * math.sqrt(p * (1 - p) / n)


def test_noise_matches_the_unsigned_hash() -> None:
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1

    def u(seed: int, counter: int, token: int) -> float:
        z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & m64
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & m64
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & m64
        w = (token * 0x9E3779B9) & m32
        x = (z >> 32) ^ w ^ (w >> 16)
        x = (x * 0x7FEB352D) & m32
        x ^= x >> 15
        x = (x * 0x846CA68B) & m32
        x ^= x >> 16
        return ((x & 0x7FFFFF) + 0.5) / 2**23

    seeds = [0, 1, 2**62 + 12345, 2**63 + 7, 2**64 - 1]
    as_int64 = [s - 2**64 if s >= 2**63 else s for s in seeds]
    counters = [0, 1, 3, 1 << 20, 123456789]
    got = _uniform(torch.tensor(as_int64), torch.tensor(counters), 70_000)
    for r, (s, c) in enumerate(zip(seeds, counters, strict=True)):
        for tok in (0, 1, 2, 65_535, 65_536, 69_999):
            assert got[r, tok].item() == u(s, c, tok)
    assert got.min().item() > 0.0
    assert got.max().item() < 1.0


# ---- distributions --------------------------------------------------------------------------


def test_filtered_distribution_matches_the_exact_one() -> None:
    # top-k drops 2 and 6; top-p on the top-k-renormalised mass also drops 4 (on the raw mass it
    # would keep it); min-p drops 7.
    r = RowParams(0.7, top_k=6, top_p=0.96, min_p=0.16, seed=42)
    probs = oracle(LOGITS8.numpy(), r)
    assert set(np.flatnonzero(probs)) == {0, 1, 3, 5}
    assert_frequencies(draws(r), probs)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_softmax(temperature: float) -> None:
    probs = torch.softmax(LOGITS8.double() / temperature, -1).numpy()
    assert_frequencies(draws(RowParams(temperature, seed=3)), probs)


def test_top_p_one_and_top_k_zero_disable_filtering() -> None:
    torch.manual_seed(2)
    v = 50
    logits = torch.randn(64, v)
    plain = [RowParams(1.0, seed=i, counter=i) for i in range(64)]
    reference = draw(logits, plain)
    every_flag = SamplerMode(
        any_random=True, any_top_p_or_k=True, any_min_p=True, penalties=False, repetition=False
    )
    assert draw(logits, plain, mode=every_flag) == reference
    for top_k in (v, v + 5, -1):
        assert (
            draw(logits, [dataclasses.replace(r, top_k=top_k) for r in plain], mode=every_flag)
            == reference
        )


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(32, 200)
    greedy = logits.argmax(-1).tolist()
    assert draw(logits, [RowParams(1.5, top_k=1, seed=i) for i in range(32)]) == greedy
    assert draw(logits, [RowParams(1.5, top_p=1e-6, seed=i) for i in range(32)]) == greedy


# ---- penalties ------------------------------------------------------------------------------


def test_penalties_match_the_formula_and_touch_only_seen_tokens() -> None:
    torch.manual_seed(4)
    n, v = 3, 40
    logits = torch.randn(n, v) * 3
    counts = torch.randint(0, 3, (n, v), dtype=torch.int32) * (torch.rand(n, v) < 0.3)
    prompt = torch.rand(n, v) < 0.2
    rows = [
        RowParams(0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
        RowParams(1.0, presence_penalty=-0.4, frequency_penalty=0.0, repetition_penalty=0.8),
        RowParams(0.0),
    ]
    buf = SamplingBuffers.allocate(n, "cpu")
    buf.fill(rows)
    got = apply_penalties(logits, buf, counts, prompt)
    want = logits.double().clone()
    for i, r in enumerate(rows):
        for j in range(v):
            c = int(counts[i, j])
            x = float(logits[i, j])
            if c > 0 or bool(prompt[i, j]):
                x = x / r.repetition_penalty if x > 0 else x * r.repetition_penalty
            want[i, j] = x - r.frequency_penalty * c - r.presence_penalty * (c > 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    untouched = (counts == 0) & ~prompt
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.equal(got[2], logits[2])
    # Without a prompt mask only frequency and presence apply.
    no_rep = apply_penalties(logits, buf, counts)
    assert torch.equal(no_rep[counts == 0], logits[counts == 0])


@pytest.mark.parametrize(
    ("row", "logits", "prompt", "output"),
    [
        (RowParams(0.0, frequency_penalty=0.2), [3.0, 2.9], [], [0]),
        (RowParams(0.0, presence_penalty=0.2), [3.0, 2.9], [], [0]),
        (RowParams(0.0, repetition_penalty=1.5), [3.0, 2.9], [0], []),  # 3 / 1.5 < 2.9
        (RowParams(0.0, repetition_penalty=1.5), [-1.0, -1.2], [], [0]),  # -1 * 1.5 < -1.2
    ],
)
def test_each_penalty_moves_the_greedy_token(
    row: RowParams, logits: list[float], prompt: list[int], output: list[int]
) -> None:
    x = torch.tensor([logits])
    assert draw(x, [RowParams(0.0)]) == [0]
    kw = {
        "token_counts": counts_from_tokens([output], 2, "cpu"),
        "prompt_mask": prompt_mask_from_tokens([prompt], 2, "cpu"),
    }
    assert draw(x, [row], **kw) == [1]


def test_penalty_inputs_are_required_by_the_mode() -> None:
    rows = [RowParams(0.0, repetition_penalty=1.2)]
    buf = SamplingBuffers.allocate(1, "cpu")
    buf.fill(rows)
    with pytest.raises(ValueError, match="token_counts"):
        sample(torch.zeros(1, 4), buf, mode=SamplerMode.of(rows))
    with pytest.raises(ValueError, match="prompt_mask"):
        sample(
            torch.zeros(1, 4),
            buf,
            mode=SamplerMode.of(rows),
            token_counts=torch.zeros(1, 4, dtype=torch.int32),
        )


def test_counts_and_prompt_mask_from_tokens() -> None:
    counts = counts_from_tokens([[1, 1, 4], [], [0, 4, 4, 4]], 5, "cpu")
    assert counts.dtype == torch.int32
    assert counts.tolist() == [[0, 2, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 3]]
    mask = prompt_mask_from_tokens([[2], [0, 0]], 3, "cpu")
    assert mask.tolist() == [[False, False, True], [True, False, False]]
    with pytest.raises(ValueError, match="outside"):
        counts_from_tokens([[5]], 5, "cpu")


# ---- buffers and modes ----------------------------------------------------------------------


def test_fill_lands_in_the_fields_in_one_copy_and_pads_with_greedy_rows() -> None:
    buf = SamplingBuffers.allocate(4, "cpu")
    rows = [
        RowParams(
            0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            seed=2**64 - 1,
            counter=3,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            repetition_penalty=1.1,
        ),
        RowParams(1.2, seed=2**40, counter=1),
        RowParams(0.5, top_k=2, seed=9),
    ]
    buf.fill(rows)
    with _OpLog() as log:
        buf.fill(rows[:2])
    assert log.ops == ["copy_"]
    assert buf.seed.tolist() == [-1, 2**40, 0, 0]
    assert buf.counter.tolist() == [3, 1, 0, 0]
    assert buf.top_k.tolist() == [5, 0, 0, 0]
    for name, want in [
        ("temperature", [0.7, 1.2, 0.0, 0.0]),
        ("top_p", [0.9, 1.0, 1.0, 1.0]),
        ("min_p", [0.05, 0.0, 0.0, 0.0]),
        ("presence_penalty", [0.1, 0.0, 0.0, 0.0]),
        ("frequency_penalty", [0.2, 0.0, 0.0, 0.0]),
        ("repetition_penalty", [1.1, 1.0, 1.0, 1.0]),
    ]:
        assert getattr(buf, name).tolist() == pytest.approx(want), name
    with pytest.raises(ValueError, match="capacity"):
        buf.fill(rows * 2)


def test_mode_of_rows() -> None:
    assert SamplerMode.of([RowParams(0.0, top_p=0.5, top_k=3, min_p=0.1)]) == SamplerMode(
        False, False, False, False, False
    )
    assert SamplerMode.of([RowParams(0.0), RowParams(1.0, top_k=3)]) == SamplerMode(
        True, True, False, False, False
    )
    assert SamplerMode.of([RowParams(1.0, min_p=0.1)]) == SamplerMode(
        True, False, True, False, False
    )
    assert SamplerMode.of([RowParams(0.0, presence_penalty=0.1)]) == SamplerMode(
        False, False, False, True, False
    )
    assert SamplerMode.of([RowParams(0.0, repetition_penalty=1.1)]) == SamplerMode(
        False, False, False, True, True
    )
    with pytest.raises(ValueError, match="repetition"):
        SamplerMode(False, False, False, penalties=False, repetition=True)


def test_rows_past_the_batch_may_hold_garbage() -> None:
    logits = torch.randn(4, 30)
    logits[2:] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(10)
    rows = [RowParams(1.0, top_p=0.8, min_p=0.1, seed=1), RowParams(0.0)]
    buf = SamplingBuffers.allocate(4, "cpu")
    buf.fill(rows)
    got = sample(logits, buf, mode=SamplerMode.of(rows))
    assert got.shape == (4,)
    assert ((got >= 0) & (got < 30)).all()
    assert got[1] == logits[1].argmax()


# ---- properties -----------------------------------------------------------------------------


@st.composite
def batches(draw_: st.DrawFn) -> tuple[torch.Tensor, list[RowParams], list[int]]:
    n = draw_(st.integers(1, 8))
    v = draw_(st.integers(2, 40))
    values = st.floats(-8.0, 8.0, width=32)
    logits = torch.tensor(
        draw_(st.lists(st.lists(values, min_size=v, max_size=v), min_size=n, max_size=n))
    )
    row = st.builds(
        RowParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
        top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        top_k=st.integers(-1, v + 2),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
        seed=st.integers(0, 2**64 - 1),
        counter=st.integers(0, 2**31),
    )
    rows = draw_(st.lists(row, min_size=n, max_size=n))
    perm = draw_(st.permutations(range(n)))
    return logits, rows, perm


@settings(max_examples=30, deadline=None)
@given(batches())
def test_tokens_are_allowed_and_independent_of_row_order(
    batch: tuple[torch.Tensor, list[RowParams], list[int]],
) -> None:
    logits, rows, perm = batch
    got = draw(logits, rows)
    for i, r in enumerate(rows):
        allowed = oracle(logits[i].numpy(), r, slack=1e-3) > 0.0
        assert allowed[got[i]], (i, r, got[i], allowed)
    permuted = draw(logits[perm], [rows[p] for p in perm])
    assert [permuted[perm.index(i)] for i in range(len(rows))] == got
    assert [draw(logits[i : i + 1], [r])[0] for i, r in enumerate(rows)] == got


# ---- log-probabilities ------------------------------------------------------------------------


def logprobs_of(
    logits: torch.Tensor,
    rows: list[RowParams],
    k: int,
    counts: torch.Tensor | None = None,
    prompt: torch.Tensor | None = None,
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens and (chosen, top values, top ids) the way the engine gathers them: one ``sample``
    and one ``processed_logits`` over the same buffers and mode."""
    buf = SamplingBuffers.allocate(len(rows), logits.device)
    buf.fill(rows)
    mode = SamplerMode.of(rows)
    kw = {"token_counts": counts, "prompt_mask": prompt}
    toks = sample(logits, buf, mode=mode, **kw)
    chosen, vals, ids = token_logprobs(processed_logits(logits, buf, mode=mode, **kw), toks, k)
    return toks.tolist(), chosen, vals, ids


def penalised_ref(
    logits: np.ndarray, r: RowParams, counts: np.ndarray, seen: np.ndarray
) -> np.ndarray:
    """The penalty formula of the module docstring, in float64."""
    x = logits.astype(np.float64)
    rep = np.where(x > 0, x / r.repetition_penalty, x * r.repetition_penalty)
    x = np.where(seen | (counts > 0), rep, x)
    return x - r.frequency_penalty * counts - r.presence_penalty * (counts > 0)


@st.composite
def penalised_batches(
    draw_: st.DrawFn,
) -> tuple[torch.Tensor, list[RowParams], list[int], torch.Tensor, torch.Tensor, int]:
    logits, rows, perm = draw_(batches())
    n, v = logits.shape
    pen = st.floats(-1.0, 2.0, width=32)
    rows = [
        dataclasses.replace(
            r,
            presence_penalty=draw_(pen),
            frequency_penalty=draw_(pen),
            repetition_penalty=draw_(st.floats(0.5, 2.0, width=32)),
        )
        if draw_(st.booleans())
        else r
        for r in rows
    ]
    counts = torch.tensor(
        draw_(
            st.lists(st.lists(st.integers(0, 3), min_size=v, max_size=v), min_size=n, max_size=n)
        ),
        dtype=torch.int32,
    )
    prompt = torch.tensor(
        draw_(st.lists(st.lists(st.booleans(), min_size=v, max_size=v), min_size=n, max_size=n))
    )
    return logits, rows, perm, counts, prompt, draw_(st.integers(0, v))


@settings(max_examples=40, deadline=None)
@given(penalised_batches())
def test_logprobs_are_the_sampled_distribution_sorted_and_batch_independent(
    batch: tuple[torch.Tensor, list[RowParams], list[int], torch.Tensor, torch.Tensor, int],
) -> None:
    logits, rows, perm, counts, prompt, k = batch
    toks, chosen, vals, ids = logprobs_of(logits, rows, k, counts, prompt)
    assert chosen.shape == (len(rows),)
    assert vals.shape == ids.shape == (len(rows), k)
    assert torch.all(chosen <= 0.0)
    assert torch.all(vals <= 0.0)
    assert torch.all(vals[:, :-1] >= vals[:, 1:])  # most likely first
    for i, r in enumerate(rows):
        x = penalised_ref(logits[i].numpy(), r, counts[i].numpy(), prompt[i].numpy())
        # The drawn token is inside the kept set: its logprob is finite.
        assert math.isfinite(float(chosen[i])), (i, r)
        if r.temperature == 0.0:
            ref = torch.log_softmax(torch.from_numpy(x), dim=-1)
        else:
            keep = oracle(x, r) > 0.0
            if not np.array_equal(keep, oracle(x, r, slack=1e-3) > 0.0):
                continue  # a row on a filter's rounding edge: the kept set is not well defined
            ref = torch.log_softmax(
                torch.from_numpy(np.where(keep, x / r.temperature, -np.inf)), dim=-1
            )
        assert float(chosen[i]) == pytest.approx(float(ref[toks[i]]), abs=1e-4), (i, r)
        want = torch.sort(ref, descending=True).values[:k]
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(vals[i]), finite), (i, r)
        assert torch.allclose(vals[i][finite].double(), want[finite], atol=1e-4), (i, r)
        assert torch.allclose(ref[ids[i]][finite], want[finite], atol=1e-4)
        if k:
            assert float(chosen[i]) <= float(vals[i, 0]) + 1e-6
    # Same seed, same logprobs, wherever the row sits and whoever shares the batch.
    p_toks, p_chosen, p_vals, _ = logprobs_of(
        logits[perm], [rows[p] for p in perm], k, counts[perm], prompt[perm]
    )
    for j, i in enumerate(perm):
        assert p_toks[j] == toks[i]
        assert torch.allclose(p_chosen[j], chosen[i], atol=1e-6, rtol=0)
        assert torch.allclose(p_vals[j], vals[i], atol=1e-6, rtol=0)
    for i, r in enumerate(rows):
        a_toks, a_chosen, a_vals, _ = logprobs_of(
            logits[i : i + 1], [r], k, counts[i : i + 1], prompt[i : i + 1]
        )
        assert a_toks == [toks[i]]
        assert torch.allclose(a_chosen[0], chosen[i], atol=1e-6, rtol=0)
        assert torch.allclose(a_vals[0], vals[i], atol=1e-6, rtol=0)


def test_processed_logprobs_follow_temperature_and_filters() -> None:
    logits = LOGITS8[None, :]
    greedy = logprobs_of(logits, [RowParams(0.0)], 3)
    assert float(greedy[1][0]) == pytest.approx(
        float(torch.log_softmax(LOGITS8, -1).max()), abs=1e-6
    )
    hot = logprobs_of(logits, [RowParams(2.0, seed=1)], 8)
    assert torch.allclose(
        hot[2][0], torch.log_softmax(LOGITS8 / 2.0, -1).sort(descending=True).values, atol=1e-6
    )
    # top-k 2 keeps logits 2.2 and 2.0: the rest are impossible (-inf) and the two renormalise.
    top2 = logprobs_of(logits, [RowParams(1.0, top_k=2, seed=3)], 4)
    vals = top2[2][0]
    assert sorted(top2[3][0, :2].tolist()) == [1, 5]
    assert torch.isinf(vals[2:]).all()
    assert float(torch.logsumexp(vals[:2], 0)) == pytest.approx(0.0, abs=1e-6)
    assert top2[0][0] in (1, 5)


def test_processed_logits_never_synchronise_and_greedy_modes_are_the_logits() -> None:
    logits = torch.randn(4, 50)
    buf = SamplingBuffers.allocate(4, "cpu")
    rows = [RowParams(0.7, top_p=0.9, top_k=5, min_p=0.1, seed=i) for i in range(4)]
    rows = [dataclasses.replace(r, repetition_penalty=1.3, frequency_penalty=0.2) for r in rows]
    buf.fill(rows)
    counts = counts_from_tokens([[1, 2], [3], [], [5, 5]], 50, "cpu")
    prompt = prompt_mask_from_tokens([[7], [8], [9], [10]], 50, "cpu")
    toks = torch.tensor([1, 2, 3, 4])
    with _OpLog() as log:
        p = processed_logits(
            logits, buf, mode=SamplerMode.of(rows), token_counts=counts, prompt_mask=prompt
        )
        token_logprobs(p, toks, 5)
    syncing = {"_local_scalar_dense", "nonzero", "masked_select", "multinomial", "unique", "item"}
    assert not syncing & set(log.ops), log.ops
    buf.fill([RowParams(0.0)] * 4)
    assert processed_logits(logits, buf, mode=SamplerMode.of([RowParams(0.0)])) is logits


# ---- CUDA -----------------------------------------------------------------------------------


def _random_rows(n: int, step: int) -> list[RowParams]:
    return [
        RowParams(0.0, frequency_penalty=0.3)
        if i % 4 == 0
        else RowParams(
            0.3 + 0.1 * (i % 7),
            top_p=0.5 + 0.05 * (i % 9),
            top_k=(i * 13) % 60,
            min_p=0.02 * (i % 3),
            seed=1000 * step + i,
            counter=step + i,
            presence_penalty=0.1 * (i % 2),
            repetition_penalty=1.0 + 0.05 * (i % 5),
        )
        for i in range(n)
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    n, cap, v = 12, 16, 32_000
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    every_flag = SamplerMode(True, True, True, True, True)
    buf = SamplingBuffers.allocate(cap, dev)
    logits = torch.zeros(cap, v, device=dev)
    counts = torch.zeros(cap, v, dtype=torch.int32, device=dev)
    prompt = torch.zeros(cap, v, dtype=torch.bool, device=dev)
    out = torch.zeros(cap, dtype=torch.int64, device=dev)

    def run() -> torch.Tensor:
        return sample(
            logits, buf, mode=every_flag, token_counts=counts, prompt_mask=prompt, out=out
        )

    buf.fill(_random_rows(n, 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    for step in range(1, 4):
        rows = _random_rows(n, step)
        logits.copy_(torch.randn(cap, v, device=dev, generator=gen) * 3)
        toks = [[(i * 31 + k * step) % v for k in range(i)] for i in range(cap)]
        counts.copy_(counts_from_tokens(toks, v, dev))
        prompt.copy_(prompt_mask_from_tokens([[i, i + 1] for i in range(cap)], v, dev))
        buf.fill(rows)
        graph.replay()
        replayed = out.clone()
        eager = sample(logits, buf, mode=every_flag, token_counts=counts, prompt_mask=prompt)
        assert torch.equal(replayed, eager)
        alone = sample(
            logits[:n],
            buf,
            mode=SamplerMode.of(rows),
            token_counts=counts[:n],
            prompt_mask=prompt[:n],
        )
        assert torch.equal(alone, eager[:n])
        # The noise is integer arithmetic: bitwise the same on both devices.
        assert torch.equal(
            _uniform(buf.seed, buf.counter, 1000).cpu(),
            _uniform(buf.seed.cpu(), buf.counter.cpu(), 1000),
        )
