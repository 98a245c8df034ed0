"""``EngineConfig.lora_density_configs``: the LoRA kernels pick their tiles by the step's
tokens per adapter. Configs change speed, never results: the same requests give the same
tokens with it on and off, over batches of one adapter, several, and base rows."""

from __future__ import annotations

import asyncio
from typing import Any

from .conftest import Tiny, collect, request, tokens


async def _outputs(tiny: Tiny, eng: Any) -> list[list[int]]:
    prompts = [tiny.encode(p) for p in ("Hello world", "The quick brown fox", "A mesh")]
    reqs = [
        request(f"r{i}", prompts[i % 3], adapter, max_tokens=6)
        for i, adapter in enumerate(["alpha", "alpha", "alpha", "beta", None, "gamma", "delta"])
    ]
    return [tokens(e) for e in await asyncio.gather(*(collect(eng.submit(r)) for r in reqs))]


async def test_density_configs_change_no_token(tiny: Tiny, make_engine: Any) -> None:
    off = await _outputs(tiny, make_engine(lora_density_configs=False))
    on_engine = make_engine(lora_density_configs=True, profile_steps=True)
    on = await _outputs(tiny, on_engine)
    assert on == off
    # The steps did run LoRA rows of several adapters at once with the configs picked by them.
    assert max(st["adapters"] for st in on_engine.step_profile) >= 2
