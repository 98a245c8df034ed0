"""The engine's per-step profile (``EngineConfig.profile_steps``, ``--step-profile PATH``):
one record per step with its shape, distinct adapters and times, in memory or as JSON lines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from .conftest import Tiny, collect, request, tokens

FIELDS = {
    "t",
    "rows",
    "tokens",
    "decode_rows",
    "prefill_tokens",
    "adapters",
    "graph",
    "host_ms",
    "gpu_ms",
}


def _prompts(tiny: Tiny) -> list[tuple[int, ...]]:
    return [tiny.encode(p) for p in ("Hello world", "The quick brown fox", "A mesh")]


async def _run_mix(tiny: Tiny, eng: Any) -> list[list[int]]:
    prompts = _prompts(tiny)
    reqs = [
        request("a", prompts[0], "alpha", max_tokens=6),
        request("b", prompts[1], "beta", max_tokens=6),
        request("c", prompts[2], None, max_tokens=6),
        request("d", prompts[0], "alpha", max_tokens=6),
    ]
    events = await asyncio.gather(*(collect(eng.submit(r)) for r in reqs))
    return [tokens(e) for e in events]


async def test_records_name_each_steps_shape_and_adapters(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(profile_steps=True)
    outs = await _run_mix(tiny, eng)
    steps = eng.step_profile
    assert steps
    for st in steps:
        assert set(st) == FIELDS
        assert st["tokens"] == st["decode_rows"] + st["prefill_tokens"]
        assert 0 <= st["adapters"] <= 2  # alpha and beta; the base request holds no slot
        assert st["rows"] >= st["decode_rows"]
    # Every prompt token was prefilled once (the second alpha request may reuse the first
    # one's cached prefix) and every output token but the last decoded.
    prompts = _prompts(tiny)
    total = sum(len(p) for p in prompts) + len(prompts[0])
    assert total - len(prompts[0]) <= sum(st["prefill_tokens"] for st in steps) <= total
    assert sum(st["decode_rows"] for st in steps) == sum(len(o) - 1 for o in outs)
    # Some step held both adapters at once (four requests submitted together).
    assert max(st["adapters"] for st in steps) == 2
    assert [st["t"] for st in steps] == sorted(st["t"] for st in steps)


async def test_records_go_to_the_file_as_json_lines(
    tiny: Tiny, make_engine: Any, tmp_path: Path
) -> None:
    path = tmp_path / "steps.jsonl"
    eng = make_engine(profile_steps=True, step_profile_path=str(path))
    await _run_mix(tiny, eng)
    await eng.shutdown()
    lines = path.read_text().splitlines()
    assert lines
    records = [json.loads(line) for line in lines]
    assert all(set(r) == FIELDS for r in records)
    assert eng.step_profile == []  # kept out of the heap when a file takes them
    assert max(r["adapters"] for r in records) == 2


async def test_nothing_is_recorded_unless_asked(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    await _run_mix(tiny, eng)
    assert eng.step_profile == []
