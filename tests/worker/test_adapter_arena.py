"""Memory that follows the adapters: per-group indices, the adapter arena and its allocator.

* Per-group indices (``lora_ops.GroupRoute``): a row's adapter handle reaches each pool group
  through that group's own index table; a row whose adapter leaves a group is a base row there.
* Fidelity: one batch mixing adapters on q,v only, on every module and on o only matches
  transformers + peft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker import lora_ops

from .fidelity_helpers import PROMPT, build_model, match_case, peft_adapter

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- per-group indices ---------------------------------------------------------------------


@st.composite
def routed_batch(draw: st.DrawFn) -> dict[str, Any]:
    handles = draw(st.integers(1, 6))
    groups = {}
    for g in ("g0", "g1"):
        size = draw(st.integers(1, 8))
        # Each handle: an index of the group's grid (distinct handles, distinct indices) or -1.
        free = list(range(size))
        table = []
        for _ in range(handles):
            if free and draw(st.booleans()):
                table.append(free.pop(draw(st.integers(0, len(free) - 1))))
            else:
                table.append(-1)
        groups[g] = (size, table)
    rows = draw(st.lists(st.integers(-1, handles - 1), min_size=1, max_size=12))
    return {"handles": handles, "groups": groups, "rows": rows, "seed": draw(st.integers(0, 99))}


@settings(max_examples=40, deadline=None)
@given(routed_batch())
def test_each_group_reads_its_own_index_of_each_row(case: dict[str, Any]) -> None:
    handles, groups, rows = case["handles"], case["groups"], case["rows"]
    gen = torch.Generator().manual_seed(case["seed"])
    hidden, out_n, r_max = 5, 3, 4
    x = torch.randn(len(rows), hidden, generator=gen, dtype=torch.float64).float()
    routes = {
        g: lora_ops.GroupRoute(torch.tensor(table, dtype=torch.int32), size)
        for g, (size, table) in groups.items()
    }
    meta = lora_ops.build_meta(torch.tensor(rows, dtype=torch.int32), handles, routes=routes)
    assert meta.kernel_meta is None
    for g, (size, table) in groups.items():
        a = torch.randn(1, size, r_max, hidden, generator=gen)
        b = torch.randn(size, out_n, r_max, generator=gen)
        ranks = torch.randint(1, r_max + 1, (size,), generator=gen, dtype=torch.int32)
        scales = torch.rand(size, generator=gen) + 0.5
        gm = meta.group(g)
        want_index = [table[h] if h >= 0 else -1 for h in rows]
        assert gm.token_slots.tolist() == want_index
        out = torch.zeros(len(rows), out_n)
        lora_ops.add_lora(out, x, a, (b,), scales, ranks, gm)
        for t, i in enumerate(want_index):
            if i < 0:  # a base row, or an adapter that leaves the group: untouched
                assert torch.equal(out[t], torch.zeros(out_n))
                continue
            r = int(ranks[i])
            ref = scales[i] * (x[t] @ a[0, i, :r].T) @ b[i, :, :r].T
            torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)


def test_a_batch_with_routes_has_no_segments_of_its_own() -> None:
    route = lora_ops.GroupRoute(torch.tensor([0, -1], dtype=torch.int32), 1)
    meta = lora_ops.build_meta(torch.tensor([1, 0, -1], dtype=torch.int32), 2, routes={"o": route})
    with pytest.raises(ValueError, match="group"):
        meta.segments()
    with pytest.raises(KeyError, match="qkv"):
        meta.group("qkv")
    assert meta.group("o").token_slots.tolist() == [-1, 0, -1]
    plain = lora_ops.build_meta(torch.tensor([1, 0, -1], dtype=torch.int32), 2)
    assert plain.group("qkv") is plain


# --- fidelity ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("arena") / "m", "llama", seed=5, pad_token_id=0)


def test_mixed_target_sets_in_one_batch_match_peft(llama: Path, tmp_path: Path) -> None:
    """q,v only, every module, and o only, side by side in one batch with base rows."""
    root = tmp_path / "adapters"
    peft_adapter(root, llama, "qv", 21, r=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"])
    peft_adapter(root, llama, "all", 22, r=4, lora_alpha=8.0, target_modules=ALL7)
    peft_adapter(root, llama, "o", 23, r=2, lora_alpha=4.0, target_modules=["o_proj"])
    peft_adapter(root, llama, "qv2", 24, r=3, lora_alpha=3.0, target_modules=["q_proj", "v_proj"])
    match_case(
        llama,
        root,
        ["qv", "all", "o", "qv2"],
        [PROMPT, PROMPT[2:9]],
        max_loras=4,
        max_lora_rank=8,
    )
