"""The step output path without a model: logprob gathering into the step's single output
vector (``sampling.gather_logprobs``), its host read-back (``InFlight.wait``), and the sampling
graph sampler variants."""

from __future__ import annotations

import torch

from adaptermesh.worker.sampling import (
    GREEDY,
    RANDOM,
    RowParams,
    SamplerMode,
    SamplingBuffers,
    gather_logprobs,
    sample,
    unpack_logprobs,
)
from adaptermesh.worker.step_launch import InFlight, LogprobRequest
from adaptermesh.worker.step_plan import (
    SampledToken,
    SamplingRow,
    ScheduledStep,
    StepResult,
    StepRow,
)
from adaptermesh.worker.types import SamplingParams


def decode_step(*seq_ids: int) -> ScheduledStep:
    """A step of one decode row per id, each sampling."""
    return ScheduledStep(
        7,
        tuple(
            StepRow(i, 3, 1, (1,), -1, n, -1, None, SamplingRow(i, f"r{i}", SamplingParams(), 0, 1))
            for n, i in enumerate(seq_ids)
        ),
        (),
    )


def test_gather_logprobs_layout_and_read_back() -> None:
    torch.manual_seed(0)
    num_entries, vocab, alternatives = 4, 11, 3
    logits = torch.randn(num_entries, vocab)
    tokens = torch.tensor([7, 2, 9, 4, 0, 0], dtype=torch.int64)  # entries past S are not read
    out = torch.zeros(32, dtype=torch.int64)
    rows_host = torch.zeros(8, dtype=torch.int64)
    asking = [3, 1]
    used = gather_logprobs(out, tokens, logits, num_entries, asking, alternatives, rows_host)
    assert used == num_entries + 2 * (2 * alternatives + 1)
    assert out[:num_entries].tolist() == [7, 2, 9, 4]
    values, ids = unpack_logprobs(out, num_entries, 2, alternatives)
    reference = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(asking):
        assert abs(values[row][0] - float(reference[entry, tokens[entry]])) < 1e-6
        top = torch.topk(reference[entry], alternatives)
        assert ids[row] == top.indices.tolist()
        assert torch.allclose(
            torch.tensor(values[row][1:], dtype=torch.float64), top.values.double(), atol=1e-6
        )


def test_gather_logprobs_with_k_zero_has_only_the_sampled_tokens_logprob() -> None:
    logits = torch.randn(2, 5)
    tokens = torch.tensor([1, 3], dtype=torch.int64)
    out = torch.zeros(8, dtype=torch.int64)
    used = gather_logprobs(out, tokens, logits, 2, [1], 0, torch.zeros(2, dtype=torch.int64))
    assert used == 3
    values, ids = unpack_logprobs(out, 2, 1, 0)
    assert ids == [[]]
    assert abs(values[0][0] - float(torch.log_softmax(logits[1], -1)[3])) < 1e-6


def test_in_flight_wait_reads_each_samplers_token_and_logprobs() -> None:
    logits = torch.randn(3, 6)
    tokens = torch.tensor([5, 1, 2], dtype=torch.int64)
    out = torch.zeros(16, dtype=torch.int64)
    gather_logprobs(out, tokens, logits, 3, [2], 2, torch.zeros(3, dtype=torch.int64))
    # Samplers at entries 2 and 0; only the first asked (for 1 of the 2 gathered alternatives).
    in_flight = InFlight(
        decode_step(11, 12),
        [2, 0],
        out,
        3,
        None,
        logprobs=LogprobRequest(row_of_sampler=[0, -1], wanted=[1, 0], num_rows=1, alternatives=2),
    )
    result = in_flight.wait()
    assert result.step_id == 7
    assert [(t.seq_id, t.token) for t in result.tokens] == [(11, 2), (12, 5)]
    assert result.tokens[1].logprobs is None
    first = result.tokens[0].logprobs
    assert first is not None
    reference = torch.log_softmax(logits[2], -1)
    assert abs(first.logprob - float(reference[2])) < 1e-6
    assert first.top_ids == [int(torch.argmax(reference))]
    assert len(first.top_logprobs) == 1


def test_in_flight_wait_without_logprobs() -> None:
    host = torch.tensor([4, 8, 15, 16], dtype=torch.int64)
    assert InFlight(decode_step(4, 5), [3, 1], host, 4, None).wait() == StepResult(
        7, (SampledToken(4, 16), SampledToken(5, 8))
    )


def test_graph_sampler_variants_serve_every_graphable_batch() -> None:
    """The two variants a graph is captured for: GREEDY is exactly what a greedy batch needs,
    and RANDOM sets every flag any batch without penalties can need, so the mode of any such
    batch (``SamplerMode.of``) is covered by it (a flag may be set when unneeded, never
    cleared when needed)."""
    assert SamplerMode.of([RowParams(temperature=0.0)] * 3) == GREEDY
    flags = ("any_random", "any_top_p_or_k", "any_min_p", "penalties", "repetition")
    batches = [
        [RowParams(temperature=0.7)],
        [RowParams(temperature=0.0), RowParams(temperature=1.3, top_p=0.5)],
        [RowParams(temperature=1.0, top_k=4)],
        [RowParams(temperature=0.2, min_p=0.3), RowParams(temperature=0.0)],
        [RowParams(temperature=0.9, top_p=0.8, top_k=2, min_p=0.05)],
    ]
    for rows in batches:
        mode = SamplerMode.of(rows)
        assert mode.any_random
        for flag in flags:
            assert getattr(RANDOM, flag) or not getattr(mode, flag), (flag, rows)
    # Penalised, biased and typical-p steps run eagerly: no graph variant has them.
    assert not RANDOM.penalties
    assert not RANDOM.any_typical
    # RANDOM samples a batch without filters as that batch's own (filterless) mode does.
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    rows = [RowParams(temperature=0.3 * (i + 1), seed=i, counter=2) for i in range(5)]
    buffers = SamplingBuffers.allocate(5, torch.device("cpu"))
    buffers.fill(rows)
    exact = SamplerMode.of(rows)
    assert exact != RANDOM
    assert torch.equal(sample(logits, buffers, mode=RANDOM), sample(logits, buffers, mode=exact))
