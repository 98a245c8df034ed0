"""INT4 LoRA pool (``--lora-dtype int4``): a tiny model served with INT4 adapters against the
full-precision reference (transformers + peft), and the pool's bytes per adapter slot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from adaptermesh.worker.model import Int4LoraPool, ModelConfig, make_lora_pool

from .conftest import ADAPTERS, PROMPTS, Tiny, collect, request, tokens

# Measured on the tiny Llama (fp32 on CPU, group 64, 4 adapters x 2 prompts x 6 tokens):
# max |dlogit| 0.99, mean 0.090, against a mean logit change of 0.44 from the adapters
# themselves (the tiny model's random adapters move logits as much as the logits spread, std
# 0.66, so the INT4 error is large in absolute terms; it scales with the LoRA term).
MAX_ABS = 1.5
MEAN_ABS = 0.15
MAX_REL_TO_EFFECT = 0.3


async def test_int4_logits_close_to_full_precision(
    tiny: Tiny, make_engine: Any, logit_log: dict[str, list[torch.Tensor]]
) -> None:
    eng = make_engine(lora_dtype="int4")
    assert isinstance(eng.pool, Int4LoraPool)
    jobs = [
        (f"{name}-{i}", tiny.encode(p), name)
        for name in ADAPTERS
        for i, p in enumerate(PROMPTS[:2])
    ]
    streams = [eng.submit(request(rid, ids, name, max_tokens=6)) for rid, ids, name in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    diffs, effects, agree, firm = [], [], 0, 0
    for (rid, ids, name), events in zip(jobs, results, strict=True):
        full = list(ids) + tokens(events)
        ref = tiny.ref.logits(full[:-1], name)[len(ids) - 1 :]
        got = torch.stack(logit_log[rid])
        d = (got - ref).abs()
        base = tiny.ref.logits(full[:-1], None)[len(ids) - 1 :]
        effects.append((ref - base).abs().mean())
        diffs.append(d)
        # Greedy tokens agree wherever the reference's top-2 margin exceeds twice the error.
        # Elsewhere they may not: the error is ~20 % of these adapters' own effect, so close
        # calls between two tokens can flip.
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        sure = margin > 2 * d.amax(dim=-1)
        firm += int(sure.sum())
        agree += int((got.argmax(-1) == ref.argmax(-1))[sure].sum())
    all_d = torch.cat([d.flatten() for d in diffs])
    max_abs, mean_abs = float(all_d.max()), float(all_d.mean())
    effect = float(torch.stack(effects).mean())
    print(f"int4 vs full precision: max |dlogit| {max_abs:.4f}, mean {mean_abs:.4f} "
          f"(the adapters move logits by {effect:.4f} on average); "
          f"{agree}/{firm} firm greedy positions agree")  # fmt: skip
    assert max_abs < MAX_ABS
    assert mean_abs < MEAN_ABS
    assert mean_abs < MAX_REL_TO_EFFECT * effect
    assert firm > 0
    assert agree == firm


async def test_int4_adapter_still_changes_output(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(lora_dtype="int4")
    assert isinstance(eng.pool, Int4LoraPool)
    ids = tiny.encode(PROMPTS[1])
    outs = {}
    for name in [None, *ADAPTERS]:
        outs[name] = tokens(
            await collect(eng.submit(request(f"r-{name}", ids, name, max_tokens=8)))
        )
    assert len({tuple(v) for v in outs.values()}) == len(outs)


def test_slot_bytes_against_bf16(tiny: Tiny) -> None:
    cfg = ModelConfig.from_dir(tiny.model_dir)
    dev = torch.device("cpu")
    bf16 = make_lora_pool(cfg, 2, 16, dev, torch.bfloat16)
    int4 = make_lora_pool(cfg, 2, 16, dev, torch.bfloat16, "int4")
    ratio = bf16.slot_nbytes / int4.slot_nbytes
    print(
        f"slot bytes: bf16 {bf16.slot_nbytes}, int4 {int4.slot_nbytes} ({ratio:.2f}x adapters per GB)"
    )
    assert ratio >= 3.5


def test_make_lora_pool_checks_dtype(tiny: Tiny) -> None:
    cfg = ModelConfig.from_dir(tiny.model_dir)
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match="lora_dtype"):
        make_lora_pool(cfg, 2, 8, dev, torch.float32, "int8")
    with pytest.raises(ValueError, match="model dtype"):
        make_lora_pool(cfg, 2, 8, dev, torch.float32, "bf16")


def test_engine_refuses_unknown_lora_dtype(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        make_engine(lora_dtype="int8")
