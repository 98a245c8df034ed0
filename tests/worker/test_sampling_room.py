"""The sampler room: typical-p against transformers' TypicalLogitsWarper, and one set of
parameter bounds that the OpenAI API models and the engine both apply."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from adaptermesh.worker.api import CompletionRequest
from adaptermesh.worker.sampling import (
    BOUNDS,
    LogitBias,
    RowParams,
    SamplerMode,
    SamplingBuffers,
    apply_logit_bias,
    apply_penalties,
    counts_from_tokens,
    processed_entries,
    processed_logits,
    prompt_mask_from_tokens,
    row_params,
    sample,
    sample_entries,
)
from adaptermesh.worker.step_plan import SamplingRow
from adaptermesh.worker.types import InvalidRequestError, SamplingParams

from .conftest import PROMPTS, LogitLog, Tiny, collect, request, tokens


def hf_kept(logits: torch.Tensor, r: RowParams) -> torch.Tensor:
    """[V] bool: the tokens transformers' warpers keep (temperature, top-k, top-p, min-p,
    then typical-p, the order ``generate`` applies them in)."""
    scores = logits[None, :] / r.temperature
    if r.top_k > 0:
        scores = TopKLogitsWarper(r.top_k)(None, scores)  # type: ignore[arg-type]
    if r.top_p < 1.0:
        scores = TopPLogitsWarper(r.top_p)(None, scores)  # type: ignore[arg-type]
    if r.min_p > 0.0:
        scores = MinPLogitsWarper(r.min_p)(None, scores)  # type: ignore[arg-type]
    if r.typical_p < 1.0:
        scores = TypicalLogitsWarper(r.typical_p)(None, scores)  # type: ignore[arg-type]
    return torch.isfinite(scores[0])


def ours_kept(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    buf = SamplingBuffers.allocate(len(rows), "cpu")
    buf.fill(rows)
    return torch.isfinite(processed_logits(logits, buf, mode=SamplerMode.of(rows)))


ROWS = st.builds(
    RowParams,
    temperature=st.floats(0.3, 2.0),
    typical_p=st.floats(0.05, 1.0),
    top_k=st.sampled_from([0, 0, 1, 3, 20]),
    min_p=st.sampled_from([0.0, 0.0, 0.05]),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(ROWS, min_size=1, max_size=5),
    st.integers(2, 300),
    st.integers(0, 2**31),
    st.sampled_from([1.0, 4.0, 12.0]),
)
def test_typical_p_keeps_the_tokens_transformers_keeps(
    rows: list[RowParams], vocab: int, seed: int, scale: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), vocab, generator=generator) * scale
    # Ragged: a few rows with ties (the warper keeps every token tied with its cut-off).
    logits[:, : vocab // 3] = torch.round(logits[:, : vocab // 3])
    kept = ours_kept(logits, rows)
    for i, r in enumerate(rows):
        want = hf_kept(logits[i], r)
        if not torch.equal(kept[i], want):
            # Only a token whose score sits at the cut-off within rounding may differ.
            diff = (kept[i] != want).nonzero().flatten().tolist()
            pytest.fail(f"row {i} {r}: kept sets differ at {diff[:8]}")
        assert kept[i].any()


def test_typical_p_one_is_no_filter_and_a_tiny_mass_keeps_the_most_typical_token() -> None:
    logits = torch.tensor([[3.0, 2.1, 2.0, 1.9, 1.8] + [0.0] * 20])
    off = ours_kept(logits, [RowParams(1.0, typical_p=1.0)])
    assert off.all()
    tiny = ours_kept(logits, [RowParams(1.0, typical_p=1e-6)])
    lp = torch.log_softmax(logits[0], -1)
    entropy = -(lp * lp.exp()).sum()
    assert tiny[0].tolist() == [i == int((-lp - entropy).abs().argmin()) for i in range(25)]
    assert not tiny[0, 0]  # the most likely token is not the most typical one here


def test_typical_draws_follow_the_typical_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    r = RowParams(0.8, typical_p=0.6)
    kept = hf_kept(logits[0], r)
    probs = torch.softmax((logits[0] / 0.8).masked_fill(~kept, -math.inf), -1)
    n = 6000
    buf = SamplingBuffers.allocate(n, "cpu")
    buf.fill([RowParams(0.8, typical_p=0.6, seed=5, counter=c) for c in range(n)])
    drawn = sample(logits.expand(n, -1).contiguous(), buf, mode=SamplerMode.of([r])).tolist()
    counts = Counter(drawn)
    assert set(counts) <= set(kept.nonzero().flatten().tolist())
    for token, p in enumerate(probs.tolist()):
        sd = math.sqrt(n * p * (1 - p)) + 1
        assert abs(counts.get(token, 0) - n * p) < 5 * sd, (token, counts, p)


def test_rows_without_typical_p_sample_as_before_in_a_typical_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    plain = [RowParams(1.0, seed=3), RowParams(0.0), RowParams(0.7, top_k=5, seed=4)]
    buf = SamplingBuffers.allocate(4, "cpu")
    buf.fill(plain)
    alone = sample(logits, buf, mode=SamplerMode.of(plain))
    mixed = [*plain, RowParams(1.0, typical_p=0.3, seed=9)]
    buf.fill(mixed)
    together = sample(torch.cat([logits, torch.randn(1, 30)]), buf, mode=SamplerMode.of(mixed))
    assert SamplerMode.of(mixed).any_typical
    assert together[:3].tolist() == alone.tolist()


# ---- a step's processor chain ----------------------------------------------------------------


def test_a_steps_processors_run_bias_then_penalties_then_the_draw() -> None:
    torch.manual_seed(2)
    vocab = 20
    logits = torch.randn(3, vocab)
    entries: list[SamplingRow | None] = [
        SamplingRow(1, "a", SamplingParams(temperature=0.9, logit_bias=((4, 5.0),)), 7, 1),
        None,  # padding
        SamplingRow(
            2,
            "b",
            SamplingParams(temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.3),
            0,
            3,
            output=(4, 4, 9),
            context=(1, 2, 4, 4, 9),
        ),
    ]
    params = row_params(entries)
    buf = SamplingBuffers.allocate(3, "cpu")
    buf.fill(params)
    bias = LogitBias.of([e.sampling.logit_bias if e else () for e in entries], vocab, "cpu")
    assert bias is not None
    seen: list[torch.Tensor] = []
    got = sample_entries(
        logits,
        buf,
        SamplerMode.of(params),
        entries,
        bias=bias,
        penalties=True,
        observe=lambda x, rows: seen.append(x.clone()),
    )
    biased = apply_logit_bias(logits, bias)
    assert torch.equal(seen[0], biased)  # the observer sees the biased logits
    counts = counts_from_tokens([[], [], [4, 4, 9]], vocab, "cpu")
    mask = prompt_mask_from_tokens([[], [], [1, 2, 4, 4, 9]], vocab, "cpu")
    want = sample(biased, buf, mode=SamplerMode.of(params), token_counts=counts, prompt_mask=mask)
    assert got.tolist() == want.tolist()
    assert int(got[2]) == int(apply_penalties(biased, buf, counts, mask)[2].argmax())
    processed = processed_entries(
        torch.cat([logits, torch.randn(2, vocab)]), buf, SamplerMode.of(params), entries, bias=bias
    )
    assert processed.shape == (3, vocab)
    assert torch.isfinite(processed[0, 4])


# ---- one set of bounds -------------------------------------------------------------------

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "typical_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


def api_accepts(name: str, value: float) -> bool:
    try:
        CompletionRequest.model_validate({"prompt": "x", name: value})
    except ValidationError:
        return False
    return True


def engine_accepts(name: str, value: float) -> bool:
    try:
        BOUNDS.check(SamplingParams(**{name: value}), vocab=10)
    except InvalidRequestError as e:
        if e.field != name:
            raise
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(FLOAT_FIELDS),
    st.one_of(
        st.floats(-12.0, 12.0),
        st.sampled_from(
            [0.0, -0.0, 1.0, 2.0, 2.0000001, -2.0, -2.0000001, 10.0, 10.5, 1e-9, math.inf, math.nan]
        ),
    ),
)
def test_the_api_and_the_engine_accept_the_same_values(name: str, value: float) -> None:
    assert api_accepts(name, value) == engine_accepts(name, value), (name, value)


def test_temperature_is_bounded_at_two_everywhere() -> None:
    assert api_accepts("temperature", 2.0)
    assert not api_accepts("temperature", 2.5)
    with pytest.raises(InvalidRequestError, match=r"temperature.*\[0, 2\]|\[0, 2\]") as err:
        BOUNDS.check(SamplingParams(temperature=2.5), vocab=10)
    assert err.value.field == "temperature"


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("typical_p", {"typical_p": 0.0}),
        ("typical_p", {"typical_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("logprobs", {"logprobs": 21}),
        ("seed", {"seed": -1}),
        ("logit_bias", {"logit_bias": ((3, 101.0),)}),
        ("logit_bias", {"logit_bias": ((10, 1.0),)}),
        ("logit_bias", {"logit_bias": ((5, 10**400),)}),  # larger than any float
        ("temperature", {"temperature": 10**400}),
    ],
)
def test_bounds_name_the_field(field: str, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        BOUNDS.check(SamplingParams(**kw), vocab=10)
    assert err.value.field == field


# ---- the engine ------------------------------------------------------------------------------


async def test_engine_typical_p_tokens_lie_in_the_typical_set(
    tiny: Tiny, make_engine: Any, logit_log: LogitLog
) -> None:
    """Every token a typical-p request samples is in transformers' typical set of the logits
    it was sampled from; seeded runs repeat; typical_p 1 is the unfiltered request."""
    eng = make_engine()
    ids = tiny.encode(PROMPTS[0])
    kw = {"temperature": 1.0, "typical_p": 0.4, "seed": 11, "max_tokens": 10}
    got = tokens(await collect(eng.submit(request("t", ids, "alpha", **kw))))
    log = dict(logit_log)
    again = tokens(await collect(eng.submit(request("u", ids, "alpha", **kw))))
    assert got == again
    assert len(log["t"]) == len(got)
    r = RowParams(1.0, typical_p=0.4)
    for token, row in zip(got, log["t"], strict=True):
        assert hf_kept(row, r)[token], token
    off = {**kw, "typical_p": 1.0}
    plain = {k: v for k, v in kw.items() if k != "typical_p"}
    assert tokens(await collect(eng.submit(request("v", ids, "alpha", **off)))) == tokens(
        await collect(eng.submit(request("w", ids, "alpha", **plain)))
    )
