"""Per-request merges (``merged_adapters``) against peft's ``add_weighted_adapter``: the merged
factors equal peft's for every method and option Hypothesis draws, and a batch mixing the
merged adapter's rows with its parts' rows and base rows gives peft's greedy tokens. The merge
is built once per key, served as an ordinary adapter, and a bad merge changes nothing."""

from __future__ import annotations

import asyncio
import math
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from adaptermesh.worker.adapter_merge import (
    build_merged,
    merge_factors,
    merged_config,
    read_part,
)
from adaptermesh.worker.engine import Engine
from adaptermesh.worker.merge_spec import (
    MERGE_STRATEGIES,
    MergeSpec,
    MergeSpecError,
    parse_merge_spec,
)
from adaptermesh.worker.model import ModelConfig
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh.worker.types import AdapterNotFoundError

from .conftest import LogitLog
from .fidelity_helpers import (
    DEVICE,
    EXAMPLES,
    PROMPT,
    Ref,
    assert_matches,
    build_model,
    engine_config,
    peft_adapter,
)

PROMPTS = [PROMPT, PROMPT[3:8]]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("merge") / "m", "llama", seed=7, pad_token_id=0)


@pytest.fixture(scope="module")
def parts(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three rank-8 adapters: different targets, alphas, rsLoRA and an alpha pattern."""
    root = tmp_path_factory.mktemp("merge-parts")
    peft_adapter(root, llama, "p0", 1, r=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"])
    peft_adapter(
        root, llama, "p1", 2, r=8, lora_alpha=4.0, use_rslora=True, target_modules="all-linear"
    )
    peft_adapter(
        root, llama, "p2", 3, r=8, lora_alpha=8.0, target_modules=["v_proj", "o_proj", "down_proj"],
        alpha_pattern={r"layers\.1\.self_attn\.v_proj": 24.0},
    )  # fmt: skip
    peft_adapter(root, llama, "r4", 4, r=4, target_modules=["q_proj"])
    return root


def _peft_kwargs(spec: MergeSpec) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "combination_type": spec.merge_strategy,
        "majority_sign_method": spec.majority_sign_method,
    }
    if spec.merge_strategy != "linear":
        kw["density"] = spec.density
    return kw


def peft_merge(model: Any, spec: MergeSpec, name: str) -> None:
    """peft's add_weighted_adapter, with torch's global generator seeded with ``spec.seed``
    just before the first module is merged (peft's DARE draws from it; the new adapter's
    own initialisation before that draws from it too)."""
    from peft.tuners.lora.model import LoraModel

    real = LoraModel._generalized_task_arithmetic_weighted_adapter
    seeded = [False]

    def seeding(self: Any, *a: Any, **k: Any) -> Any:
        if not seeded[0]:
            torch.manual_seed(spec.seed)
            seeded[0] = True
        return real(self, *a, **k)

    with (
        mock.patch.object(LoraModel, "_generalized_task_arithmetic_weighted_adapter", seeding),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        model.add_weighted_adapter(list(spec.ids), list(spec.weights), name, **_peft_kwargs(spec))


def _peft_factors(model_dir: Path, root: Path, spec: MergeSpec) -> dict[str, torch.Tensor]:
    ref = Ref(model_dir, root, list(spec.ids))
    peft_merge(ref.model, spec, "merged")
    out = {}
    for key, value in ref.model.state_dict().items():
        if ".merged." in key or key.endswith(".merged"):
            out[
                key.replace(".lora_A.merged.", ".lora_A.").replace(".lora_B.merged.", ".lora_B.")
            ] = value
    return out


def _ours(model_dir: Path, root: Path, spec: MergeSpec, out: Path) -> dict[str, torch.Tensor]:
    cfg = ModelConfig.from_dir(model_dir)
    cpus = [read_part(n, root / n, cfg, 64) for n in spec.ids]
    build_merged(spec, cpus, out, cfg)
    return load_file(str(out / "adapter_model.safetensors"))


def _compare(model_dir: Path, root: Path, spec: MergeSpec, out: Path) -> None:
    got = _ours(model_dir, root, spec, out)
    try:
        want = _peft_factors(model_dir, root, spec)
    except IndexError:
        # peft fails on a module its merged config covers (the union of the targets, the
        # first part's layer filter) that no part adapts; the worker gives it a zero update.
        cfg = ModelConfig.from_dir(model_dir)
        cpus = [read_part(n, root / n, cfg, 64) for n in spec.ids]
        _, covered = merged_config(cpus, cfg)
        keys = {k for c in cpus for k in c.module_scales}
        empty = [
            k
            for k in covered
            if not any(f".layers.{k[0]}." in x and x.endswith(k[1]) for x in keys)
        ]
        assert empty
        for layer, module in empty:
            hits = [v for k, v in got.items() if f".layers.{layer}." in k and f".{module}." in k]
            assert len(hits) == 2
            assert all(not bool(h.any()) for h in hits)
        return
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:4]
    for key, w in want.items():
        torch.testing.assert_close(
            got[key], w, atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("strategy", MERGE_STRATEGIES)
def test_each_method_builds_peft_factors(
    llama: Path, parts: Path, tmp_path: Path, strategy: str
) -> None:
    spec = parse_merge_spec(
        {
            "ids": ["p0", "p1", "p2"],
            "weights": [0.7, -0.4, 1.3],
            "merge_strategy": strategy,
            "density": 0.6,
            "seed": 5,
        }
    )
    _compare(llama, parts, spec, tmp_path / "out")


def test_frequency_sign_and_full_density(llama: Path, parts: Path, tmp_path: Path) -> None:
    for i, (strategy, density) in enumerate((("ties", 0.3), ("dare_ties", 1.0), ("ties", 1.0))):
        spec = parse_merge_spec(
            {
                "ids": ["p2", "p0"],
                "weights": [1.0, 2.0],
                "merge_strategy": strategy,
                "density": density,
                "majority_sign_method": "frequency",
            }
        )
        _compare(llama, parts, spec, tmp_path / f"o{i}")


@st.composite
def merge_case(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    rank = draw(st.integers(1, 8))
    adapters = []
    for _ in range(n):
        targets = draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=4, unique=True))
        ad: dict[str, Any] = {
            "r": rank,
            "lora_alpha": float(draw(st.integers(1, 32))),
            "use_rslora": draw(st.booleans()),
            "target_modules": sorted(targets),
        }
        if draw(st.booleans()):
            ad["alpha_pattern"] = {draw(st.sampled_from(targets)): float(draw(st.integers(1, 32)))}
        if draw(st.integers(0, 3)) == 0:
            ad["layers_to_transform"] = [draw(st.integers(0, 1))]
        adapters.append(ad)
    weight = st.floats(-2.0, 2.0, allow_nan=False).filter(lambda w: abs(w) > 1e-3)
    spec = {
        "ids": [f"a{i}" for i in range(n)],
        "weights": [draw(weight) for _ in range(n)],
        "merge_strategy": draw(st.sampled_from(MERGE_STRATEGIES)),
        "density": draw(st.sampled_from([0.1, 0.35, 0.5, 0.8, 1.0])),
        "majority_sign_method": draw(st.sampled_from(["total", "frequency"])),
        "seed": draw(st.integers(0, 2**31)),
    }
    return {"adapters": adapters, "spec": spec, "seed": draw(st.integers(0, 1000))}


@settings(
    max_examples=max(EXAMPLES, 10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=merge_case())
def test_random_merges_build_peft_factors(
    llama: Path, tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    root = tmp_path_factory.mktemp("mprop")
    for i, ad in enumerate(case["adapters"]):
        peft_adapter(root, llama, f"a{i}", seed=case["seed"] + i, **ad)
    _compare(llama, root, parse_merge_spec(case["spec"]), root / "out")


def test_merge_factors_tie_rules() -> None:
    # Majority sign by total mass vs by count; entries of the losing sign are dropped and
    # the rest averaged over how many agree (never divided by zero).
    a = torch.tensor([[3.0, -1.0, 0.0]])
    b = torch.tensor([[-1.0, -1.0, 0.0]])
    c = torch.tensor([[-1.0, 2.0, 0.0]])
    total = merge_factors([a, b, c], [1.0, 1.0, 1.0], "ties", 1.0, "total", None)
    freq = merge_factors([a, b, c], [1.0, 1.0, 1.0], "ties", 1.0, "frequency", None)
    assert total.tolist() == [[3.0, 2.0, 0.0]]  # a tie of mass (0) elects the + sign
    assert freq.tolist() == [[-1.0, -1.0, 0.0]]
    pruned = merge_factors(
        [torch.tensor([[4.0, -3.0, 2.0, 1.0]])], [2.0], "magnitude_prune", 0.5, "total", None
    )
    assert pruned.tolist() == [[8.0, -6.0, 0.0, 0.0]]
    gen = torch.Generator().manual_seed(0)
    dare = merge_factors([torch.ones(64, 64)], [1.0], "dare_linear", 0.25, "total", gen)
    kept = dare[dare != 0]
    assert torch.all(kept == 4.0)
    assert 0.15 < kept.numel() / 4096 < 0.35


def test_refused_parts_name_the_field(llama: Path, parts: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    spec = parse_merge_spec({"ids": ["p0", "r4"], "merge_strategy": "ties", "density": 0.5})
    cpus = [read_part(n, parts / n, cfg, 64) for n in spec.ids]
    with pytest.raises(MergeSpecError) as exc:
        build_merged(spec, cpus, tmp_path / "o", cfg)
    assert exc.value.param == "merged_adapters.ids"
    assert "r4: 4" in exc.value.message
    assert not (tmp_path / "o").exists()
    peft_adapter(tmp_path, llama, "dora", 9, r=8, use_dora=True, target_modules=["q_proj"])
    with pytest.raises(AdapterValidationError) as verr:
        read_part("dora", tmp_path / "dora", cfg, 64)
    assert verr.value.field == "use_dora"
    peft_adapter(
        tmp_path,
        llama,
        "pat",
        9,
        r=8,
        rank_pattern={"q_proj": 2},
        target_modules=["q_proj", "k_proj"],
    )
    pat = read_part("pat", tmp_path / "pat", cfg, 64)
    with pytest.raises(AdapterValidationError) as perr:
        merged_config([pat], cfg)
    assert perr.value.field == "rank_pattern"


# --- the engine: built once, served like any adapter, token for token -------------------------


def test_merged_rows_match_peft_in_one_batch(llama: Path, parts: Path) -> None:
    specs = [
        parse_merge_spec(
            {
                "ids": ["p0", "p1", "p2"],
                "weights": [0.8, 0.5, -0.6],
                "merge_strategy": s,
                "density": 0.7,
                "seed": 3,
            }
        )
        for s in ("linear", "ties", "dare_ties", "magnitude_prune")
    ]

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            llama,
            parts,
            device=DEVICE,
            dtype="float32",
            config=engine_config(max_loras=3, max_prefill_chunk=5, max_num_batched_tokens=16),
            model_name="fid",
            sample_observer=log,
        )
        try:
            from .conftest import collect, request

            # p0 and p1 enter the CPU cache (one scale each: merged from there); p2's alpha
            # pattern folded its scales into B there, so it is read from its files again.
            for part in ("p0", "p1", "p2"):
                await collect(eng.submit(request(f"warm-{part}", PROMPT, part, max_tokens=1)))
            assert {"p0", "p1", "p2"} <= set(eng.adapters.cpu_cache)
            import adaptermesh.worker.adapters as adapters_mod

            read: list[str] = []
            real_read = adapters_mod.read_part

            def counting(name: str, *a: Any) -> Any:
                read.append(name)
                return real_read(name, *a)

            with mock.patch.object(adapters_mod, "read_part", counting):
                names = [await eng.adapters.merged(s) for s in specs]
            assert set(read) == {"p2"}
            assert len(set(names)) == len(names)
            assert eng.adapters.counters.merges == len(specs)
            # The same request again: the same adapter, not built again.
            assert await eng.adapters.merged(specs[1]) == names[1]
            assert eng.adapters.counters.merges == len(specs)
            ref = Ref(llama, parts, ["p0", "p1", "p2"])
            for s, n in zip(specs, names, strict=True):
                peft_merge(ref.model, s, n)
            # Four merged adapters and two parts through three slots: loads, evictions
            # and reloads of merged adapters mid-batch.
            log.clear()
            await assert_matches(
                eng, ref, [None, "p1", *names, "p0"], log, PROMPTS, n=4, tag="merge-"
            )
            held = {r.name for r in eng.adapters.held_by_tier()}
            assert set(names) & held
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_merge_changes_the_output(llama: Path, parts: Path) -> None:
    # Guards the equivalence test against weights or methods that are ignored: other weights,
    # another method, give other logits.
    async def go() -> list[torch.Tensor]:
        from .conftest import collect, request

        log = LogitLog()
        eng = Engine(
            llama, parts, dtype="float32", config=engine_config(max_loras=2), sample_observer=log
        )
        try:
            outs = []
            for body in (
                {"ids": ["p0", "p2"], "weights": [1.0, 1.0]},
                {"ids": ["p0", "p2"], "weights": [1.0, -1.0]},
                {
                    "ids": ["p0", "p2"],
                    "weights": [1.0, 1.0],
                    "merge_strategy": "ties",
                    "density": 0.3,
                },
            ):
                name = await eng.adapters.merged(parse_merge_spec(body))
                await collect(eng.submit(request(name, PROMPT, name, max_tokens=1)))
                outs.append(log[name][0])
            return outs
        finally:
            await eng.shutdown()

    outs = asyncio.run(go())
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert not torch.allclose(outs[i], outs[j], atol=1e-4), (i, j)


def test_bad_merges_change_nothing(llama: Path, parts: Path, tmp_path: Path) -> None:
    async def go() -> None:
        eng = Engine(llama, parts, dtype="float32", config=engine_config(max_loras=2))
        m = eng.adapters
        try:
            before = (set(m.registered), set(m.published), m.counters.merges)
            with pytest.raises(AdapterNotFoundError) as nf:
                await m.merged(parse_merge_spec({"ids": ["p0", "nope"]}))
            assert not isinstance(nf.value, AdapterValidationError)
            with pytest.raises(MergeSpecError) as rk:
                await m.merged(parse_merge_spec({"ids": ["p0", "r4"]}))
            assert rk.value.param == "merged_adapters.ids"
            m.max_merge_parts = 2
            with pytest.raises(MergeSpecError) as lim:
                await m.merged(parse_merge_spec({"ids": ["p0", "p1", "p2"]}))
            assert lim.value.param == "merged_adapters.ids"
            assert "at most 2" in lim.value.message
            assert (set(m.registered), set(m.published), m.counters.merges) == before
            # Still serving: a good merge after the bad ones builds and loads.
            name = await m.merged(parse_merge_spec({"ids": ["p0", "p2"], "weights": [0.5, 0.5]}))
            from .conftest import collect, request, tokens

            assert tokens(await collect(eng.submit(request("ok", PROMPT, name, max_tokens=2))))
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_key_names_parts_versions_and_method(llama: Path, tmp_path: Path) -> None:
    import os
    import shutil

    root = tmp_path / "adapters"
    peft_adapter(root, llama, "x", 1, r=4, target_modules=["q_proj"])
    peft_adapter(root, llama, "y", 2, r=4, target_modules=["q_proj", "o_proj"])

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(max_loras=2))
        m = eng.adapters
        try:
            base = {"ids": ["x", "y"], "weights": [1.0, 0.5]}
            a = await m.merged(parse_merge_spec(base))
            assert await m.merged(parse_merge_spec({**base, "ids": ["x", "y"]})) == a
            assert await m.merged(parse_merge_spec({**base, "weights": [1.0, 0.25]})) != a
            assert await m.merged(parse_merge_spec({**base, "merge_strategy": "ties"})) != a
            # density does not change a linear merge: the same key
            assert await m.merged(parse_merge_spec({**base, "density": 0.5})) == a
            # a new version of a part's files: another merged adapter
            f = root / "y" / "adapter_model.safetensors"
            st = f.stat()
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            b = await m.merged(parse_merge_spec(base))
            assert b != a
            shutil.rmtree(root / "x")
            with pytest.raises(AdapterNotFoundError):
                await m.merged(parse_merge_spec(base))
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_parse_errors_name_the_sub_field() -> None:
    cases = [
        ([], "merged_adapters"),
        ({"ids": []}, "merged_adapters.ids"),
        ({"ids": ["a", 3]}, "merged_adapters.ids"),
        ({"ids": ["a", "a"]}, "merged_adapters.ids[1]"),
        ({"ids": ["a"], "weights": [1, 2]}, "merged_adapters.weights"),
        ({"ids": ["a"], "weights": [math.inf]}, "merged_adapters.weights"),
        ({"ids": ["a"], "weights": [True]}, "merged_adapters.weights"),
        ({"ids": ["a"], "merge_strategy": "svd"}, "merged_adapters.merge_strategy"),
        ({"ids": ["a"], "density": 0}, "merged_adapters.density"),
        ({"ids": ["a"], "density": 1.5}, "merged_adapters.density"),
        ({"ids": ["a"], "majority_sign_method": "x"}, "merged_adapters.majority_sign_method"),
        ({"ids": ["a"], "seed": -1}, "merged_adapters.seed"),
        ({"ids": ["a"], "colour": 1}, "merged_adapters.colour"),
        ({"ids": [f"a{i}" for i in range(9)]}, "merged_adapters.ids"),
    ]
    for value, field in cases:
        with pytest.raises(MergeSpecError) as exc:
            parse_merge_spec(value)
        assert exc.value.param == field, (value, exc.value)


def test_regex_targets_merge_as_peft_and_mixed_kinds_are_refused(
    llama: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    peft_adapter(root, llama, "x", 1, r=4, target_modules=r".*\.(q_proj|v_proj)")
    peft_adapter(root, llama, "y", 2, r=4, target_modules=r".*layers\.1\.mlp\.down_proj")
    peft_adapter(root, llama, "z", 3, r=4, target_modules=["o_proj"])
    spec = parse_merge_spec(
        {"ids": ["x", "y"], "weights": [0.5, 1.5], "merge_strategy": "ties", "density": 0.4}
    )
    _compare(llama, root, spec, tmp_path / "o")
    cfg = ModelConfig.from_dir(llama)
    cpus = [read_part(n, root / n, cfg, 64) for n in ("x", "z")]
    with pytest.raises(MergeSpecError) as exc:
        merged_config(cpus, cfg)
    assert exc.value.param == "merged_adapters.ids"
    assert "(x)" in exc.value.message


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", MERGE_STRATEGIES)
def test_merge_on_the_gpu_builds_peft_factors_there(
    llama: Path, parts: Path, tmp_path: Path, strategy: str
) -> None:
    # A GPU worker merges on its pool's device; DARE then draws from a CUDA generator, which
    # equals peft with its model on the GPU.
    spec = parse_merge_spec(
        {"ids": ["p0", "p1", "p2"], "weights": [0.7, -0.4, 1.3], "merge_strategy": strategy,
         "density": 0.6, "seed": 5}
    )  # fmt: skip
    cfg = ModelConfig.from_dir(llama)
    cpus = [read_part(n, parts / n, cfg, 64) for n in spec.ids]
    build_merged(spec, cpus, tmp_path / "o", cfg, device=torch.device("cuda"))
    got = load_file(str(tmp_path / "o" / "adapter_model.safetensors"))
    ref = Ref(llama, parts, list(spec.ids))
    ref.model.to("cuda")
    peft_merge(ref.model, spec, "merged")
    want = {
        k.replace(".lora_A.merged.", ".lora_A.").replace(".lora_B.merged.", ".lora_B."): v.cpu()
        for k, v in ref.model.state_dict().items()
        if ".merged." in k
    }
    assert set(got) == set(want)
    for key, w in want.items():
        torch.testing.assert_close(got[key], w, atol=1e-6, rtol=1e-5)
