"""``SamplingParams.logit_bias`` in the engine: the device-side add (``sampling.apply_logit_bias``)
and biased rows batched with unbiased ones, on CPU and (marked gpu) on CUDA, where the steps
without a biased row keep their graphs. Sync tests (``asyncio.run``), so the GPU machine needs
no asyncio plugin."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.sampling import LogitBias, apply_logit_bias
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import make_tiny_model

TARGET = 77


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("logit-bias")
    model = make_tiny_model(base / "tiny", max_position_embeddings=256)
    root = base / "adapters"
    root.mkdir()
    return model, root


def test_apply_logit_bias_adds_to_the_named_rows_only() -> None:
    logits = torch.zeros(3, 5)
    bias = LogitBias.of([((1, 2.0), (4, -100.0)), (), ((0, 0.5),)], 5, "cpu")
    assert bias is not None
    out = apply_logit_bias(logits, bias)
    assert out.tolist() == [[0, 2, 0, 0, -100], [0] * 5, [0.5, 0, 0, 0, 0]]
    assert logits.abs().sum().item() == 0  # not modified
    assert LogitBias.of([(), ()], 5, "cpu") is None
    with pytest.raises(ValueError, match="outside"):
        LogitBias.of([((5, 1.0),)], 5, "cpu")


async def _generate(engine: Engine, prompt: list[int], **sampling: Any) -> list[int]:
    stream = engine.submit(
        GenerationRequest("direct", tuple(prompt), None, SamplingParams(**sampling))
    )
    return [event.token_id async for event in stream if event.token_id is not None]


def _check_batch(engine: Engine) -> None:
    prompts = [engine.tokenize(text) for text in ("Once upon a time", "hello world", "1 2 3")]

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        alone = [await _generate(engine, p, max_tokens=6) for p in prompts]
        together = await asyncio.gather(
            _generate(engine, prompts[0], max_tokens=6),
            _generate(engine, prompts[1], max_tokens=6, logit_bias=((TARGET, 100.0),)),
            _generate(
                engine,
                prompts[1],
                max_tokens=6,
                temperature=0.8,
                seed=1,
                logit_bias=((TARGET, 100.0),),
            ),
            _generate(engine, prompts[2], max_tokens=6),
            _generate(engine, prompts[2], max_tokens=6, temperature=0.7, seed=2),
        )
        sampled_alone = await _generate(engine, prompts[2], max_tokens=6, temperature=0.7, seed=2)
        # -100 on every token greedy decoding chose for the first prompt: none comes back.
        banned = await _generate(
            engine, prompts[0], max_tokens=6, logit_bias=tuple((t, -100.0) for t in set(alone[0]))
        )
        await engine.shutdown()
        return alone, [*together, sampled_alone, banned]

    alone, results = asyncio.run(scenario())
    # Unbiased rows, greedy and seeded, get the tokens they get alone.
    assert results[0] == alone[0]
    assert results[3] == alone[2]
    assert results[4] == results[5]
    # +100 makes greedy and sampled rows pick the token.
    assert results[1] == [TARGET] * 6
    assert results[2] == [TARGET] * 6
    assert not set(results[6]) & set(alone[0])


def test_biased_and_unbiased_rows_share_a_cpu_batch(tiny_dirs: tuple[Path, Path]) -> None:
    model, root = tiny_dirs
    engine = Engine(model, root, device="cpu", dtype="float32", config=EngineConfig(max_num_seqs=8))
    _check_batch(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_biased_and_unbiased_rows_share_a_cuda_batch(
    tiny_dirs: tuple[Path, Path], graphs: bool
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, root = tiny_dirs
    engine = Engine(
        model,
        root,
        device="cuda",
        dtype="float32",
        config=EngineConfig(max_num_seqs=8, use_cuda_graphs=graphs),
    )
    _check_batch(engine)
    if graphs:
        # The steps without a biased row kept graphs.
        assert engine.launcher.graph_runner.replays > 0
    assert engine.launcher.eager_steps > 0


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_before_the_bias_raw_and_after_it_processed(
    tiny_dirs: tuple[Path, Path], mode: str
) -> None:
    model, root = tiny_dirs
    engine = Engine(
        model, root, device="cpu", dtype="float32", config=EngineConfig(logprobs_mode=mode)
    )
    prompt = engine.tokenize("Once upon a time")

    async def first() -> tuple[int, float]:
        request = GenerationRequest(
            "lp",
            tuple(prompt),
            None,
            SamplingParams(max_tokens=1, logprobs=0, logit_bias=((TARGET, 100.0),)),
        )
        entries = [lp async for event in engine.submit(request) for lp in event.logprobs]
        await engine.shutdown()
        return entries[0].token_id, entries[0].logprob

    token, logprob = asyncio.run(first())
    assert token == TARGET
    if mode == "raw":
        assert logprob < -0.5  # what the model gives the token, not the forced ~0
    else:
        assert logprob > -1e-3  # the distribution the sampler drew from
