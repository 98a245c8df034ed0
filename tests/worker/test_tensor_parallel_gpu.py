"""Tensor parallelism over NCCL: 2 GPUs give the one-GPU engine's and transformers + peft's
tokens (fp32, a batch of several adapters and the base model)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from adaptermesh.worker.engine import Engine, EngineConfig

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


async def _tokens(
    eng: Engine, jobs: list[tuple[str, tuple[int, ...], str | None]]
) -> list[list[int]]:
    streams = [eng.submit(request(rid, ids, name, max_tokens=6)) for rid, ids, name in jobs]
    return [tokens(ev) for ev in await asyncio.gather(*(collect(s) for s in streams))]


async def test_two_gpus_match_one_gpu_and_peft(tiny: Tiny) -> None:
    jobs = [(f"r-{n}", tiny.encode(PROMPTS[1]), n) for n in (None, *ADAPTERS)]
    kw = {"max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 16}
    one = Engine(tiny.model_dir, tiny.root, device="cuda", config=EngineConfig(**kw))
    try:
        want = await _tokens(one, jobs)
    finally:
        await one.shutdown()
    two = Engine(
        tiny.model_dir,
        tiny.root,
        device="cuda",
        config=EngineConfig(**kw, tensor_parallel_size=2),
    )
    try:
        assert two.ranks_up() == (True, True)
        got = await _tokens(two, jobs)
    finally:
        await two.shutdown()
    assert got == want
    for (_, ids, name), toks in zip(jobs, got, strict=True):
        assert toks == tiny.ref.greedy(list(ids), name, 6), name
