"""LoRA on ``embed_tokens`` and ``lm_head`` against transformers + peft: one batch mixing
embedding-LoRA, head-LoRA, both, plain LoRA and base rows gives every request peft's greedy
tokens and close logits, each row seeing its own embedding and head; extra vocabulary rows,
changed saved base weights, DoRA on them and a worker without the pool part are refused by
name; the pool counts the factors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from adaptermesh.worker.engine import Engine
from adaptermesh.worker.engine_config import InvalidRequestError, validate_config
from adaptermesh.worker.model import ModelConfig, make_lora_pool
from adaptermesh.worker.peft_adapter import AdapterValidationError, read_adapter

from .conftest import collect, request, tokens
from .fidelity_helpers import (
    DEVICE,
    EXAMPLES,
    PROMPT,
    build_model,
    engine_config,
    match_case,
    peft_adapter,
)

PROMPTS = [PROMPT, PROMPT[3:8]]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("vocab") / "m", "llama", seed=2, pad_token_id=0)


def _vocab_root(root: Path, model_dir: Path) -> list[str]:
    peft_adapter(root, model_dir, "emb", 1, r=4, target_modules=["embed_tokens"])
    peft_adapter(
        root, model_dir, "head", 2, r=8, lora_alpha=4.0, target_modules=["lm_head", "q_proj"]
    )
    peft_adapter(
        root, model_dir, "both", 3, r=6, use_rslora=True,
        target_modules=["embed_tokens", "lm_head", "down_proj"],
        alpha_pattern={"lm_head": 20.0}, rank_pattern={"embed_tokens": 2},
    )  # fmt: skip
    peft_adapter(root, model_dir, "plain", 4, r=4, target_modules=["q_proj", "v_proj"])
    return ["emb", "head", "both", "plain"]


def test_vocab_and_plain_rows_in_one_batch_match_peft(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    names = _vocab_root(root, llama)
    # Three slots for four adapters: slots change hands mid-run, so a slot's embedding and
    # head factors must follow what it holds (a plain adapter after a vocab one reads zeros).
    match_case(
        llama,
        root,
        names,
        PROMPTS,
        n=4,
        tag="vocab-",
        lora_vocab=True,
        max_loras=3,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


def test_vocab_lora_on_scaled_and_tied_embeddings(tmp_path: Path) -> None:
    # Gemma scales its embeddings by sqrt(hidden) (peft scales the LoRA term too) and ties
    # the head to the embedding (a head LoRA changes the head only).
    for arch, cfg in (
        ("gemma", {"head_dim": 16, "tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("phi3", {}),
    ):
        model_dir = build_model(tmp_path / arch / "m", arch, seed=5, pad_token_id=0, **cfg)
        root = tmp_path / arch / "adapters"
        peft_adapter(root, model_dir, "e", 7, r=4, target_modules=["embed_tokens"])
        peft_adapter(root, model_dir, "h", 8, r=3, target_modules=["lm_head"])
        peft_adapter(root, model_dir, "eh", 9, r=5, target_modules=["embed_tokens", "lm_head"])
        match_case(model_dir, root, ["e", "h", "eh"], PROMPTS, n=3, tag=f"{arch}-", lora_vocab=True)


def test_vocab_lora_really_changes_output(llama: Path, tmp_path: Path) -> None:
    # Guards the equivalence tests against factors that are ignored: the adapter's vocab
    # factors zeroed give other logits.
    root = tmp_path / "adapters"
    peft_adapter(root, llama, "v", 31, r=4, target_modules=["embed_tokens", "lm_head"])
    for part, keep in (("noemb", "lm_head"), ("nohead", "embed_tokens")):
        d = root / part
        d.mkdir()
        tensors = load_file(str(root / "v" / "adapter_model.safetensors"))
        save_file(
            {
                k: (v if keep in k or "base_layer" in k else torch.zeros_like(v))
                for k, v in tensors.items()
            },
            str(d / "adapter_model.safetensors"),
        )
        (d / "adapter_config.json").write_text((root / "v" / "adapter_config.json").read_text())

    async def go() -> dict[str, torch.Tensor]:
        from .conftest import LogitLog

        log = LogitLog()
        eng = Engine(
            llama,
            root,
            dtype="float32",
            config=engine_config(lora_vocab=True),
            sample_observer=log,
        )
        try:
            out = {}
            for name in (None, "v", "noemb", "nohead"):
                rid = f"r-{name}"
                await collect(eng.submit(request(rid, PROMPT, name, max_tokens=1)))
                out[str(name)] = log[rid][0]
            return out
        finally:
            await eng.shutdown()

    out = asyncio.run(go())
    keys = list(out)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not torch.allclose(out[a], out[b], atol=1e-4), (a, b)


def test_refused_by_name(llama: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    root = tmp_path / "adapters"
    # A worker without --lora-vocab names the module and the flag.
    peft_adapter(root, llama, "h", 1, r=4, target_modules=["lm_head"])

    async def plain_worker() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config())
        try:
            with pytest.raises(AdapterValidationError) as exc:
                await eng.adapters.load("h")
            assert exc.value.field == "target_modules"
            assert "lm_head" in str(exc.value)
            assert "--lora-vocab" in str(exc.value)
            assert tokens(await collect(eng.submit(request("ok", PROMPT, None, max_tokens=2))))
        finally:
            await eng.shutdown()

    asyncio.run(plain_worker())
    # Extra vocabulary rows: an adapter trained on a resized embedding.
    big = build_model(
        tmp_path / "big", "llama", seed=2, pad_token_id=0, vocab_size=cfg.vocab_size + 8
    )
    peft_adapter(root, big, "extra", 2, r=4, target_modules=["embed_tokens", "lm_head"])
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("extra", root / "extra", cfg, 16, torch.float32, False, per_module=True)
    assert exc.value.field == "target_modules"
    assert "extra vocabulary rows" in str(exc.value)
    # The saved base weight differs from the model's: a trained copy, refused at load.
    peft_adapter(root, llama, "copy", 3, r=4, target_modules=["lm_head"])
    f = root / "copy" / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = "base_model.model.lm_head.base_layer.weight"
    assert key in tensors
    tensors[key] = tensors[key] + 0.01
    save_file(tensors, str(f))

    async def copy_worker() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_vocab=True))
        try:
            with pytest.raises(AdapterValidationError) as exc:
                await eng.adapters.load("copy")
            assert "differs from the base model" in str(exc.value)
            assert "copy" not in eng.adapters.published
            await eng.adapters.load("h")  # the unchanged one loads
        finally:
            await eng.shutdown()

    asyncio.run(copy_worker())
    # DoRA on the vocabulary modules.
    d = root / "dora"
    d.mkdir()
    cj = json.loads((root / "h" / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cj, "use_dora": True}))
    save_file(
        load_file(str(root / "h" / "adapter_model.safetensors")),
        str(d / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("dora", d, cfg, 16, torch.float32, False, per_module=True)
    assert exc.value.field == "use_dora"
    # AdaFuse experts (no per-module slots) keep refusing them.
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("h", root / "h", cfg, 16, torch.float32, False)
    assert exc.value.field == "target_modules"
    # int4 pools and tensor parallelism refuse the flag at start.
    for kw in ({"lora_dtype": "int4"}, {"tensor_parallel_size": 2}):
        with pytest.raises(InvalidRequestError) as cerr:
            validate_config(engine_config(lora_vocab=True, **kw))
        assert cerr.value.field == "lora_vocab"


def test_pool_counts_the_vocab_factors(llama: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    dev = torch.device("meta")
    plain = make_lora_pool(cfg, 2, 8, dev, torch.float32).nbytes
    vocab = make_lora_pool(cfg, 2, 8, dev, torch.float32, vocab=True).nbytes
    v, h = cfg.vocab_size, cfg.hidden_size
    assert vocab - plain == 2 * 8 * (2 * v + 2 * h) * 4


def test_layers_to_transform_leaves_the_vocab_modules_as_peft(llama: Path, tmp_path: Path) -> None:
    # A list target with layers_to_transform: embed_tokens (a suffix match) has no layer
    # index, so peft leaves it; "lm_head" names the full module, which skips the filter.
    root = tmp_path / "adapters"
    peft_adapter(
        root, llama, "lt", 5, r=4, target_modules=["embed_tokens", "lm_head", "q_proj"],
        layers_to_transform=[1],
    )  # fmt: skip
    cfg = ModelConfig.from_dir(llama)
    cpu = read_adapter("lt", root / "lt", cfg, 16, torch.float32, False, per_module=True)
    assert cpu.vocab == frozenset({"head"})
    match_case(llama, root, ["lt"], PROMPTS, n=3, tag="lt-", lora_vocab=True)


@st.composite
def vocab_case(draw: st.DrawFn) -> dict[str, Any]:
    adapters = []
    for _ in range(draw(st.integers(1, 3))):
        vocab = draw(
            st.lists(st.sampled_from(["embed_tokens", "lm_head"]), min_size=1, unique=True)
        )
        linear = draw(st.lists(st.sampled_from(MODULES), max_size=3, unique=True))
        ad: dict[str, Any] = {
            "r": draw(st.integers(1, 16)),
            "lora_alpha": float(draw(st.integers(1, 64))),
            "use_rslora": draw(st.booleans()),
            "target_modules": sorted(vocab + linear),
        }
        if draw(st.booleans()):
            ad["rank_pattern"] = {draw(st.sampled_from(vocab)): draw(st.integers(1, 16))}
        if draw(st.booleans()):
            ad["alpha_pattern"] = {draw(st.sampled_from(vocab)): float(draw(st.integers(1, 64)))}
        adapters.append(ad)
    return {
        "arch": draw(st.sampled_from(["llama", "qwen2", "gemma"])),
        "adapters": adapters,
        "plain": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
    }


@settings(
    max_examples=min(EXAMPLES, 6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=vocab_case())
def test_random_vocab_configs_match_peft(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("vprop")
    seed = case["seed"]
    extra = {"head_dim": 8} if case["arch"] == "gemma" else {}
    model_dir = build_model(tmp / "m", case["arch"], seed=seed, pad_token_id=0, **extra)
    root = tmp / "adapters"
    names = []
    for i, ad in enumerate(case["adapters"]):
        peft_adapter(root, model_dir, f"v{i}", seed=seed + i, **ad)
        names.append(f"v{i}")
    if case["plain"]:
        peft_adapter(root, model_dir, "p", seed=seed + 7, r=4, target_modules="all-linear")
        names.append("p")
    match_case(
        model_dir,
        root,
        names,
        PROMPTS,
        n=3,
        tag="vp-",
        lora_vocab=True,
        max_loras=max(2, len(names) - 1),
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


@pytest.mark.gpu
def test_vocab_rows_with_cuda_graphs_match_peft(llama: Path, tmp_path: Path) -> None:
    # The decode step is captured once and replayed: the embedding gather, the expand and the
    # head's row segments are rebuilt inside the graph from each step's slots.
    from .fidelity_helpers import Ref

    root = tmp_path / "adapters"
    names = _vocab_root(root, llama)
    ref = Ref(llama, root, names)

    async def go() -> None:
        eng = Engine(
            llama,
            root,
            device="cuda",
            dtype="float32",
            config=engine_config(lora_vocab=True, use_cuda_graphs=True),
            model_name="fid",
        )
        try:
            jobs = [(f"{i}-{n}", p, n) for i, p in enumerate(PROMPTS) for n in (None, *names)]
            outs = await asyncio.gather(
                *(collect(eng.submit(request(r, p, n, max_tokens=6))) for r, p, n in jobs)
            )
            for (rid, p, n), events in zip(jobs, outs, strict=True):
                got = tokens(events)
                want = [int(r.argmax()) for r in ref.logits([*p, *got][:-1], n)[len(p) - 1 :]]
                assert got == want, rid
        finally:
            await eng.shutdown()

    assert DEVICE is not None
    asyncio.run(go())
