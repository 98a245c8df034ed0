"""An adapter pool limited to the modules the served adapters target (``lora_target_modules``):
fewer bytes per slot, the same tokens for adapters inside it, a named refusal for the others."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptermesh.worker.engine_config import EngineConfig, validate_config
from adaptermesh.worker.lora_groups import GROUPS, MODULE_TO_GROUP, SUPPORTED_MODULES, pool_groups
from adaptermesh.worker.model import ModelConfig, make_lora_pool
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh.worker.types import InvalidRequestError

from .conftest import PROMPTS, Tiny, collect, request, tokens

pytestmark = pytest.mark.asyncio

ALPHA_MODULES = ("q_proj", "k_proj", "v_proj", "down_proj")  # alpha targets q, v and down


async def test_adapters_inside_the_pool_match_peft_and_others_are_refused(
    tiny: Tiny, make_engine: Any
) -> None:
    full = make_engine()
    eng = make_engine(lora_target_modules=ALPHA_MODULES)
    assert eng.pool.groups == frozenset({"qkv", "down"})
    assert eng.pool.nbytes < full.pool.nbytes
    ids = tiny.encode(PROMPTS[1])
    got = tokens(await collect(eng.submit(request("a", ids, "alpha", max_tokens=6))))
    assert got == tiny.ref.greedy(list(ids), "alpha", 6)
    base = tokens(await collect(eng.submit(request("b", ids, None, max_tokens=6))))
    assert base == tiny.ref.greedy(list(ids), None, 6)
    for name, modules in (("beta", "gate_proj, o_proj, up_proj"), ("delta", "o_proj")):
        with pytest.raises(AdapterValidationError) as err:
            await collect(eng.submit(request(name, ids, name, max_tokens=2)))
        assert err.value.field == "target_modules"
        assert modules in str(err.value)
    # The engine keeps serving after the refusals.
    again = tokens(await collect(eng.submit(request("a2", ids, "alpha", max_tokens=6))))
    assert again == got


@pytest.mark.parametrize("modules", [("q_projection",), (), ("q_proj", "lm_head")])
def test_unknown_or_empty_target_modules_are_refused_naming_the_field(
    modules: tuple[str, ...],
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        validate_config(EngineConfig(lora_target_modules=modules))
    assert err.value.field == "lora_target_modules"


@given(st.sets(st.sampled_from(SUPPORTED_MODULES), min_size=1))
def test_the_pool_holds_exactly_the_groups_of_its_modules(modules: set[str]) -> None:
    groups = pool_groups(sorted(modules))
    assert groups == {MODULE_TO_GROUP[m][0] for m in modules}


def test_a_qv_pool_takes_a_fraction_of_the_bytes(tiny: Tiny) -> None:
    cfg = ModelConfig.from_dir(tiny.model_dir)
    meta = torch.device("meta")
    every = make_lora_pool(cfg, 4, 8, meta, torch.float32)
    qv = make_lora_pool(cfg, 4, 8, meta, torch.float32, groups=pool_groups(["q_proj", "v_proj"]))
    assert set(every.a) == set(GROUPS)
    assert set(qv.a) == {"qkv"}
    assert qv.nbytes * 2 < every.nbytes
    int4 = make_lora_pool(cfg, 4, 8, meta, torch.float32, "int4", pool_groups(["o_proj"]))
    assert set(int4.qa) == {"o"}
