"""Engine.knows_adapter: the names list_adapters lists, by lookup, through every way an
adapter comes and goes (loaded, registered on demand and evicted, unloaded)."""

from __future__ import annotations

from typing import Any

from .conftest import PROMPTS, Tiny, collect, request

CANDIDATES = ("alpha", "beta", "gamma", "delta", "alpha@2.0.0", "nope", "")


def _agrees(eng: Any) -> set[str]:
    listed = {info.name for info in eng.list_adapters()}
    known = {name for name in CANDIDATES if eng.knows_adapter(name)}
    assert known == listed & set(CANDIDATES)
    return known


async def test_knows_adapter_agrees_with_list_adapters(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine(max_loras=2)
    assert _agrees(eng) == set()
    await eng.load_adapter("alpha", "alpha", pinned=True)
    assert _agrees(eng) == {"alpha"}
    ids = tiny.encode(PROMPTS[0])
    for name in ("beta", "gamma", "delta"):  # on demand; two slots: beta and gamma evicted
        await collect(eng.submit(request(f"k-{name}", ids, name, max_tokens=2)))
    assert {"alpha", "delta"} <= _agrees(eng)
    await eng.unload_adapter("alpha")
    assert "alpha" not in _agrees(eng)
