"""The step output path without a model: logprob gathering into the step's single output
vector (``sampling.gather_logprobs``), its host read-back (``InFlight.wait``), and the sampling
hook and graph sampler variants."""

from __future__ import annotations

import torch

from adaptermesh.worker.sampling import (
    SamplerMode,
    SamplingBuffers,
    gather_logprobs,
    unpack_logprobs,
)
from adaptermesh.worker.scheduler import StepPlan
from adaptermesh.worker.step_launch import GREEDY, RANDOM, InFlight, LogprobRequest, sample_logits
from adaptermesh.worker.step_layout import row_params


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
        StepPlan([], []),
        [],
        [2, 0],
        out,
        3,
        None,
        logprobs=LogprobRequest(row_of_sampler=[0, -1], wanted=[1, 0], num_rows=1, alternatives=2),
    )
    sampled, logprobs = in_flight.wait()
    assert sampled == [2, 5]
    assert logprobs is not None
    assert logprobs[1] is None
    first = logprobs[0]
    assert first is not None
    reference = torch.log_softmax(logits[2], -1)
    assert abs(first.logprob - float(reference[2])) < 1e-6
    assert first.top_ids == [int(torch.argmax(reference))]
    assert len(first.top_logprobs) == 1


def test_in_flight_wait_without_logprobs() -> None:
    host = torch.tensor([4, 8, 15, 16], dtype=torch.int64)
    assert InFlight(StepPlan([], []), [], [3, 1], host, 4, None).wait() == ([16, 8], None)


def test_graph_sampler_variants() -> None:
    assert (
        SamplerMode(
            any_random=False,
            any_top_p_or_k=False,
            any_min_p=False,
            penalties=False,
            repetition=False,
        )
        == GREEDY
    )
    assert (
        SamplerMode(
            any_random=True, any_top_p_or_k=True, any_min_p=True, penalties=False, repetition=False
        )
        == RANDOM
    )


def test_sample_logits_is_the_sampler() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    buffers = SamplingBuffers.allocate(2, torch.device("cpu"))
    params = row_params([None, None])
    buffers.fill(params)
    assert SamplerMode.of(params) == GREEDY
    assert sample_logits(logits, buffers, GREEDY, [None, None]).tolist() == [1, 0]
