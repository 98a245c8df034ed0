"""One concurrent batch naming different adapters and the base model gives, token for token,
what transformers + peft gives for each request run alone, with close logits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import ADAPTERS, PROMPTS, Reference, Tiny, collect, request, tokens


async def test_mixed_batch_matches_peft(
    tiny: Tiny, make_engine: Any, logit_log: dict[str, list[torch.Tensor]]
) -> None:
    # Small chunks and fewer KV slots than requests: chunked prefill, queueing and requests
    # joining a running batch are all exercised in the same run.
    eng = make_engine(max_num_seqs=6, max_prefill_chunk=5, max_num_batched_tokens=16)
    names: list[str | None] = [None, *ADAPTERS]
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        for j, name in enumerate(names):
            rid = f"p{i}-{name}"
            n_tok = (
                6 + (i + j) % 4
            )  # different lengths: requests leave the batch at different steps
            jobs.append((rid, tiny.encode(prompt), name, n_tok))
    streams = [eng.submit(request(rid, ids, name, max_tokens=n)) for rid, ids, name, n in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for (rid, ids, name, n), events in zip(jobs, results, strict=True):
        got = tokens(events)
        assert events[-1].finish_reason == "length", rid
        assert events[-1].completion_tokens == n
        assert events[-1].prompt_tokens == len(ids)
        full = list(ids) + got
        ref_logits = tiny.ref.logits(full[:-1], name)[len(ids) - 1 :]
        want = [int(r.argmax()) for r in ref_logits]
        assert got == want, f"{rid}: engine {got} != peft {want}"
        engine_logits = torch.stack(logit_log[rid])
        torch.testing.assert_close(engine_logits, ref_logits, atol=2e-4, rtol=1e-4)
    st = eng.stats()
    assert st.adapter_hits + st.adapter_misses == len(PROMPTS) * len(ADAPTERS)
    assert st.num_running == 0
    assert st.num_waiting == 0
    assert st.kv_cache_usage == 0.0


async def test_adapter_really_changes_output(tiny: Tiny, make_engine: Any) -> None:
    # Guards the equivalence test against vacuous adapters (B = 0) or a dropped LoRA path.
    eng = make_engine()
    ids = tiny.encode(PROMPTS[1])
    outs = {}
    for name in [None, *ADAPTERS]:
        outs[name] = tokens(
            await collect(eng.submit(request(f"r-{name}", ids, name, max_tokens=8)))
        )
    assert len({tuple(v) for v in outs.values()}) == len(outs)


@pytest.mark.parametrize(
    ("arch", "rope_scaling"),
    [
        ("mistral", None),
        ("qwen2", None),
        ("llama", {"rope_type": "linear", "factor": 2.0}),
        (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ],
    ids=["mistral", "qwen2", "rope-linear", "rope-llama3", "rope-yarn"],
)
async def test_other_architectures_match_peft(
    tmp_path: Path, arch: str, rope_scaling: dict[str, Any] | None, make_engine: Any
) -> None:
    model_dir = make_tiny_model(
        tmp_path / "m", arch, seed=7, rope_scaling=rope_scaling, num_hidden_layers=1
    )
    root = tmp_path / "adapters"
    make_adapter(root, model_dir, "ad", 4, ("q_proj", "k_proj", "v_proj", "gate_proj"), seed=9)
    ref = Reference(model_dir, root, ["ad"])
    eng = make_engine(model_dir=model_dir, root=root)
    ids = tuple(eng.tokenize(PROMPTS[2]))
    streams = {
        name: eng.submit(request(f"x-{name}", ids, name, max_tokens=5)) for name in (None, "ad")
    }
    for name, stream in streams.items():
        got = tokens(await collect(stream))
        assert got == ref.greedy(list(ids), name, 5), (arch, name)
