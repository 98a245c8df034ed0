"""Trained module copies (PEFT ``modules_to_save``) against transformers + peft: one batch
mixing base rows, plain LoRA rows and rows whose adapters save embed_tokens, lm_head and the
norms gives every request peft's greedy tokens and close logits, each row seeing its own
modules; copies of anything else, of a resized vocabulary, or on a worker without the pool's
tables are refused by name; the pool and the CPU cache count the copies, and an adapter's
copies leave with its slot."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from adaptermesh.worker.adapter_merge import read_part
from adaptermesh.worker.cli import _build_engine, build_parser
from adaptermesh.worker.engine import Engine
from adaptermesh.worker.engine_config import InvalidRequestError, validate_config
from adaptermesh.worker.model import ModelConfig, make_lora_pool
from adaptermesh.worker.peft_adapter import AdapterValidationError, read_adapter
from adaptermesh.worker.saved_modules import SavedStep, copy_sites, module_kinds

from .conftest import LogitLog, collect, request, tokens
from .fidelity_helpers import (
    EXAMPLES,
    PROMPT,
    Ref,
    assert_matches,
    build_model,
    engine_config,
    match_case,
    peft_adapter,
)

PROMPTS = [PROMPT, PROMPT[3:8]]
ALL = ("embed_tokens", "lm_head", "norms")


saved_adapter = peft_adapter  # trained copies are drawn by the shared helper


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("mts") / "m", "llama", seed=3, pad_token_id=0)


def _mixed_root(root: Path, model_dir: Path) -> list[str]:
    saved_adapter(
        root, model_dir, "emb", 1, r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]
    )
    saved_adapter(
        root,
        model_dir,
        "head",
        2,
        r=8,
        target_modules=["v_proj", "down_proj"],
        modules_to_save=["lm_head"],
    )
    saved_adapter(
        root, model_dir, "norms", 3, r=4, target_modules="all-linear", modules_to_save=["norm"]
    )
    saved_adapter(
        root,
        model_dir,
        "all",
        4,
        r=6,
        use_rslora=True,
        target_modules=["o_proj", "up_proj"],
        modules_to_save=["embed_tokens", "lm_head", "input_layernorm", "model.norm"],
    )
    saved_adapter(root, model_dir, "plain", 5, r=4, target_modules=["q_proj", "v_proj"])
    return ["emb", "head", "norms", "all", "plain"]


def test_copy_rows_and_plain_rows_in_one_batch_match_peft(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    names = _mixed_root(root, llama)
    # Four slots for five adapters: slots change hands mid-run, so a slot's copies must follow
    # what it holds (a plain adapter after one with copies must read none of them).
    match_case(
        llama,
        root,
        names,
        PROMPTS,
        n=4,
        tag="mts-",
        lora_saved_modules=ALL,
        max_loras=4,
        max_prefill_chunk=5,
        max_num_batched_tokens=16,
    )


# Every family's norms: Qwen3's per-head q/k norms, Gemma's (1 + weight) norms in fp32, Gemma
# 2/3's four norms a layer, Gemma's scaled embeddings, tied heads (a copy of the embedding
# leaves the tied head as it is, a copy of the head leaves the embedding), Phi-3's fused
# projections beside the copies.
FAMILIES = [
    ("qwen3", {"tie_word_embeddings": True}, ["q_proj", "down_proj"]),
    ("phi3", {}, ["qkv_proj", "down_proj"]),
    ("gemma", {"head_dim": 16}, ["q_proj", "gate_proj"]),
    ("gemma2", {"head_dim": 8, "final_logit_softcapping": 5.0}, ["v_proj", "o_proj"]),
    ("gemma3_text", {"head_dim": 8, "sliding_window": 3, "sliding_window_pattern": 2}, ["k_proj"]),
]


@pytest.mark.parametrize(("arch", "cfg", "mods"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_copies_on_every_family_match_peft(
    tmp_path: Path, arch: str, cfg: dict[str, Any], mods: list[str]
) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=6, pad_token_id=0, **cfg)
    root = tmp_path / "adapters"
    saved_adapter(root, model_dir, "n", 61, r=4, target_modules=mods, modules_to_save=["norm"])
    saved_adapter(
        root, model_dir, "e", 62, r=2, target_modules=mods[:1], modules_to_save=["embed_tokens"]
    )
    saved_adapter(
        root, model_dir, "h", 63, r=3, target_modules=mods[-1:], modules_to_save=["lm_head"]
    )
    saved_adapter(root, model_dir, "p", 64, r=2, target_modules=mods)
    match_case(
        model_dir, root, ["n", "e", "h", "p"], PROMPTS, n=3, tag=f"{arch}-", lora_saved_modules=ALL
    )  # fmt: skip


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_module_names_are_transformers(arch: str) -> None:
    # What an entry is matched against is every module transformers builds for the family,
    # named as named_modules() names them, and the copy sites have the weights' shapes.
    import transformers

    d = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1,
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformers.AutoConfig.for_model(arch, **d)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(tc)
    cfg = ModelConfig.from_dict({**tc.to_dict(), "model_type": arch})
    names = [n for n, _ in hf.named_modules(remove_duplicate=False)]
    assert sorted(module_kinds(cfg)) == sorted(names)
    params = dict(hf.named_parameters(remove_duplicate=False))
    for site in copy_sites(cfg):
        assert tuple(params[site.path + ".weight"].shape) == site.shape, site


def test_lora_on_a_saved_module_is_left_out_as_peft_does(llama: Path, tmp_path: Path) -> None:
    # PEFT puts no LoRA on a module modules_to_save names: lm_head and embed_tokens in both
    # lists are copies only, and the projections keep their LoRA.
    root = tmp_path / "adapters"
    saved_adapter(
        root, llama, "both", 7, r=4, target_modules=["q_proj", "lm_head", "embed_tokens"],
        modules_to_save=["lm_head", "embed_tokens"],
    )  # fmt: skip
    saved_adapter(root, llama, "vhead", 8, r=4, target_modules=["lm_head", "v_proj"])
    cfg = ModelConfig.from_dir(llama)
    cpu = read_adapter("both", root / "both", cfg, 16, torch.float32, False, per_module=True)
    assert cpu.vocab == frozenset()
    assert cpu.targets == frozenset({"q_proj"})
    assert {e.module for e in cpu.saved} == {"lm_head", "embed_tokens"}
    # A head copy beside another adapter's head LoRA in one batch. peft cannot put a LoRA on
    # a module another adapter of the same model wraps as a copy, so each has its reference.
    refs = {"both": Ref(llama, root, ["both"]), "vhead": Ref(llama, root, ["vhead"])}

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            llama, root, dtype="float32", sample_observer=log,
            config=engine_config(lora_saved_modules=ALL, lora_vocab=True),
        )  # fmt: skip
        try:
            await asyncio.gather(
                *(
                    assert_matches(eng, ref, [None, n], log, PROMPTS, n=3, tag=f"ex-{n}-")
                    for n, ref in refs.items()
                )
            )
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_copy_keys_with_the_wrapper_name_read_the_same(llama: Path, tmp_path: Path) -> None:
    # A state dict taken from a live PEFT model keeps the wrapper's modules_to_save.<adapter>
    # part in each copy's key; either form is the same copy. Both forms at once are refused.
    root = tmp_path / "adapters"
    src = saved_adapter(
        root, llama, "a", 9, r=4, target_modules=["q_proj"], modules_to_save=["norm", "lm_head"]
    )
    tensors = load_file(str(src / "adapter_model.safetensors"))
    cfg = ModelConfig.from_dir(llama)
    sites = {"base_model.model." + s.path + ".weight" for s in copy_sites(cfg)}
    wrapped = root / "w"
    wrapped.mkdir()
    shutil.copy(src / "adapter_config.json", wrapped / "adapter_config.json")
    renamed = {
        (k.removesuffix(".weight") + ".modules_to_save.default.weight" if k in sites else k): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(wrapped / "adapter_model.safetensors"))
    a = read_adapter("a", src, cfg, 16, torch.float32, False, per_module=True)
    w = read_adapter("w", wrapped, cfg, 16, torch.float32, False, per_module=True)
    assert [(e.module, e.layer) for e in a.saved] == [(e.module, e.layer) for e in w.saved]
    for ea, ew in zip(a.saved, w.saved, strict=True):
        assert torch.equal(ea.view(a.data), ew.view(w.data))
    both = root / "both"
    both.mkdir()
    shutil.copy(src / "adapter_config.json", both / "adapter_config.json")
    save_file(
        {**tensors, **{k: v.clone() for k, v in renamed.items()}},
        str(both / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("both", both, cfg, 16, torch.float32, False, per_module=True)
    assert exc.value.field == "modules_to_save"
    assert "more than one copy" in str(exc.value)


def _with_config(root: Path, src: Path, name: str, patch: dict[str, Any]) -> Path:
    d = root / name
    d.mkdir(parents=True)
    cj = json.loads((src / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cj, **patch}))
    shutil.copy(src / "adapter_model.safetensors", d / "adapter_model.safetensors")
    return d


REFUSED = [
    (["q_proj"], "a linear layer"),
    (["down_proj"], "a linear layer"),
    (["score"], "names no module"),
    (["classifier"], "names no module"),
    (["mlp"], "an MLP block"),
    (["layers.0"], "a decoder layer"),
    (["norm", "self_attn"], "an attention block"),
    (["act_fn"], "an activation"),
    (["emb"], "the rotary embedding"),
    ([""], "every module"),
    (["(norm"], "regular expression"),
    ("lm_head", "list of module names"),
    ([3], "list of module names"),
]


@pytest.mark.parametrize(("entries", "why"), REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_other_modules_refused_by_name(llama: Path, tmp_path: Path, entries: Any, why: str) -> None:
    root = tmp_path / "adapters"
    src = saved_adapter(root, llama, "src", 10, r=4, target_modules=["q_proj"])
    path = _with_config(root, src, "bad", {"modules_to_save": entries})
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter(
            "bad", path, ModelConfig.from_dir(llama), 16, torch.float32, False, per_module=True
        )
    assert exc.value.field == "modules_to_save"
    assert "modules_to_save" in str(exc.value)
    assert why in str(exc.value)
    named = isinstance(entries, list) and isinstance(entries[-1], str) and entries[-1]
    if named:  # the entry that matched what is not served
        assert repr(entries[-1]) in str(exc.value)


def test_bad_copies_refused_by_name(llama: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    root = tmp_path / "adapters"

    def refused(path: Path, field: str, text: str, **kw: Any) -> None:
        with pytest.raises(AdapterValidationError) as exc:
            read_adapter(
                path.name, path, cfg, 16, torch.float32, False, **{"per_module": True, **kw}
            )
        assert exc.value.field == field, exc.value
        assert text in str(exc.value), exc.value

    # A copy of a resized vocabulary (extra rows), for the embedding and for the head.
    big = build_model(
        tmp_path / "big", "llama", seed=3, pad_token_id=0, vocab_size=cfg.vocab_size + 8
    )
    for module in ("embed_tokens", "lm_head"):
        saved_adapter(
            root, big, f"big-{module}", 11, r=4, target_modules=["q_proj"], modules_to_save=[module]
        )
        refused(root / f"big-{module}", "modules_to_save", "extra vocabulary rows")
    # A norm copy of the wrong width; a copy the file lacks; a head copy beside a head LoRA.
    src = saved_adapter(
        root, llama, "n", 12, r=4, target_modules=["q_proj"], modules_to_save=["input_layernorm"]
    )
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.input_layernorm.weight"
    wide = _with_config(root, src, "wide", {})
    save_file(
        {**tensors, key: torch.ones(cfg.hidden_size + 1)}, str(wide / "adapter_model.safetensors")
    )
    refused(wide, "modules_to_save", f"tensor {key} has shape ({cfg.hidden_size + 1},)")
    gone = _with_config(root, src, "gone", {})
    save_file(
        {k: v for k, v in tensors.items() if k != key}, str(gone / "adapter_model.safetensors")
    )
    refused(gone, "modules_to_save", "no trained copy of model.layers.1.input_layernorm")
    nan = _with_config(root, src, "nan", {})
    save_file(
        {**tensors, key: torch.full((cfg.hidden_size,), float("nan"))},
        str(nan / "adapter_model.safetensors"),
    )
    refused(nan, "adapter_model.safetensors", f"tensor {key} holds NaN or Inf")
    src_h = saved_adapter(root, llama, "vh", 13, r=4, target_modules=["lm_head", "q_proj"])
    refused(
        _with_config(root, src_h, "suffix", {"modules_to_save": ["head"]}),
        "modules_to_save",
        "also puts a LoRA",
    )
    # AdaFuse experts (one rank and one scale, no slot tables) and merges refuse copies.
    refused(src, "modules_to_save", "AdaFuse", per_module=False)
    with pytest.raises(AdapterValidationError) as exc:
        read_part("n", src, cfg, 16)
    assert exc.value.field == "modules_to_save"
    # Pools that cannot hold copies refuse the option at start.
    for kw in ({"lora_dtype": "int4"}, {"tensor_parallel_size": 2}, {}):
        with pytest.raises(InvalidRequestError) as cerr:
            validate_config(
                engine_config(lora_saved_modules=("norms", "layers") if not kw else ALL, **kw)
            )
        assert cerr.value.field == "lora_saved_modules"


def test_worker_without_the_tables_refuses_by_name(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    saved_adapter(
        root,
        llama,
        "all",
        14,
        r=4,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "norm"],
    )
    saved_adapter(
        root, llama, "norms", 15, r=4, target_modules=["q_proj"], modules_to_save=["layernorm"]
    )

    async def go(kinds: tuple[str, ...], missing: str) -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_saved_modules=kinds))
        try:
            before = dict(eng.adapters.published)
            with pytest.raises(AdapterValidationError) as exc:
                await eng.adapters.load("all")
            assert exc.value.field == "modules_to_save"
            assert missing in str(exc.value)
            assert "--lora-saved-modules" in str(exc.value)
            assert eng.adapters.published == before
            assert not any(eng.pool.saved.held) if eng.pool.saved is not None else True
            # The request path refuses it the same way, and other requests are served.
            with pytest.raises(AdapterValidationError):
                await collect(eng.submit(request("r", PROMPT, "all", max_tokens=2)))
            assert tokens(await collect(eng.submit(request("ok", PROMPT, None, max_tokens=2))))
            if kinds:
                await eng.adapters.load("norms")  # its norm copies fit this pool
        finally:
            await eng.shutdown()

    asyncio.run(go((), "copies of embed_tokens, input_layernorm, norm, post_attention_layernorm:"))
    asyncio.run(go(("norms",), "copies of embed_tokens: "))


def test_pool_counts_the_copies(llama: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    dev = torch.device("meta")
    slots = 3
    plain = make_lora_pool(cfg, slots, 8, dev, torch.float32).nbytes
    v, h, layers = cfg.vocab_size, cfg.hidden_size, cfg.num_layers
    flags = (1 + 1 + 2 * layers + 1) * (slots + 1)  # one bool per module, layer and slot
    full = make_lora_pool(cfg, slots, 8, dev, torch.float32, saved=frozenset(ALL)).nbytes
    assert full - plain == slots * (2 * v * h + 2 * layers * h + h) * 4 + flags
    norms = make_lora_pool(cfg, slots, 8, dev, torch.float32, saved=frozenset({"norms"})).nbytes
    assert norms - plain == slots * (2 * layers * h + h) * 4 + (2 * layers + 1) * (slots + 1)
    with pytest.raises(ValueError, match="lora_saved_modules"):
        make_lora_pool(cfg, slots, 8, dev, torch.float32, "int4", saved=frozenset(ALL))


def test_copies_enter_and_leave_with_their_slot(llama: Path, tmp_path: Path) -> None:
    # One slot: the copy adapter, a plain adapter that evicts it (and must see none of its
    # copies), the copy adapter again from the CPU cache; each request against peft. The CPU
    # cache and the pool count the copies; residency and describe() report them.
    root = tmp_path / "adapters"
    saved_adapter(
        root, llama, "all", 16, r=4, target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head", "norm"],
    )  # fmt: skip
    saved_adapter(root, llama, "plain", 17, r=4, target_modules=["v_proj"])
    ref = Ref(llama, root, ["all", "plain"])

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            llama, root, dtype="float32", sample_observer=log,
            config=engine_config(lora_saved_modules=ALL, max_loras=1),
        )  # fmt: skip
        saved = eng.pool.saved
        assert saved is not None
        try:
            d = eng.describe()
            assert d["pool_bytes"] == eng.pool.nbytes >= d["saved_module_bytes"] == saved.nbytes > 0
            await assert_matches(eng, ref, ["all"], log, PROMPTS[:1], n=3, tag="a1-")
            cpu = eng.adapters.cpu_cache["all"]
            file = root / "all" / "adapter_model.safetensors"
            header = int.from_bytes(file.read_bytes()[:8], "little")
            assert cpu.nbytes == file.stat().st_size - 8 - header == eng.adapters.cpu_bytes
            copy_bytes = sum(e.end - e.start for e in cpu.saved)
            assert copy_bytes > sum(e.end - e.start for e in cpu.entries)
            slot = eng.adapters.published["all"].slot
            assert {m for m, _ in saved.held[slot]} == {
                "embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm",
            }  # fmt: skip
            assert eng.describe()["saved_module_slots"] == 1
            levels = {(r.name, r.level) for r in eng.adapters.held_by_tier()}
            assert {("all", "gpu"), ("all", "cpu")} <= levels
            await assert_matches(eng, ref, ["plain"], log, PROMPTS[:1], n=3, tag="p-")
            assert "all" not in eng.adapters.published
            assert eng.adapters.published["plain"].slot == slot
            assert saved.held[slot] == frozenset()
            assert not any(bool(f[:, slot].any()) for f in saved.on.values())
            assert eng.describe()["saved_module_slots"] == 0
            hits = eng.adapters.counters.cpu_hits
            await assert_matches(eng, ref, [None, "all"], log, PROMPTS, n=3, tag="a2-")
            assert eng.adapters.counters.cpu_hits == hits + 1  # from the CPU cache, copies too
            assert saved.held[eng.adapters.published["all"].slot]
            await eng.adapters.unload("all")
            assert not any(saved.held)
            assert "all" not in eng.adapters.cpu_cache
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_steps_without_copy_rows_pay_nothing(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With an adapter holding copies resident, steps of base and plain rows build no
    # per-row application, and may take a CUDA graph; a step with a copy row runs eagerly.
    root = tmp_path / "adapters"
    saved_adapter(root, llama, "c", 18, r=4, target_modules=["q_proj"], modules_to_save=["norm"])
    saved_adapter(root, llama, "plain", 19, r=4, target_modules=["v_proj"])
    bound: list[int] = []
    real_bind = SavedStep.bind

    def counting(self: SavedStep, *a: Any) -> Any:
        bound.append(1)
        return real_bind(self, *a)

    monkeypatch.setattr(SavedStep, "bind", counting)

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_saved_modules=ALL))
        launcher = eng.launcher
        # As on a GPU with graphs: a step may take one unless its traits say otherwise (the
        # capture itself is skipped here; such a step then runs eagerly).
        monkeypatch.setattr(launcher.graph_runner, "usable", lambda solo: True)
        monkeypatch.setattr(launcher.graph_runner, "get", lambda *a: None)
        seen: list[tuple[bool, tuple[int, ...], bool]] = []
        real_traits = launcher._traits

        def traits(plan: Any, decision: Any) -> Any:
            t = real_traits(plan, decision)
            seen.append((t.graphable, t.saved, t.lora))
            return t

        monkeypatch.setattr(launcher, "_traits", traits)
        try:
            await eng.adapters.load("c")
            for name in (None, "plain"):
                await collect(eng.submit(request(f"r-{name}", PROMPT, name, max_tokens=3)))
            assert seen
            assert all(g and not s for g, s, _ in seen)
            assert not bound
            seen.clear()
            await collect(eng.submit(request("r-c", PROMPT, "c", max_tokens=3)))
            slot = eng.adapters.published["c"].slot
            assert seen
            assert all(not g and s == (slot,) for g, s, _ in seen)
            assert bound
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_cli_flag_sets_the_pool_kinds(llama: Path, tmp_path: Path) -> None:
    base = ["--model", str(llama), "--adapter-root", str(tmp_path), "--device", "cpu"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--lora-saved-modules", "q_proj"])
    assert build_parser().parse_args(base).lora_saved_modules is None

    async def go() -> None:
        args = build_parser().parse_args(
            [*base, "--lora-saved-modules", "norms", "lm_head", "norms"]
        )
        eng = _build_engine(args)
        try:
            assert isinstance(eng, Engine)
            assert eng.config.lora_saved_modules == ("norms", "lm_head")
            assert eng.pool.saved is not None
            assert eng.pool.saved.kinds == {"norms", "lm_head"}
        finally:
            await eng.shutdown()

    asyncio.run(go())


# --- property: which modules are saved -----------------------------------------------------

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Entries as users write them: a module's own name, a suffix shared by several (every
# "layernorm", every norm), a dotted path of one layer's norm, the final norm alone.
ENTRIES = {
    "llama": ["embed_tokens", "lm_head", "norm", "layernorm", "input_layernorm",
              "post_attention_layernorm", "model.norm", "layers.1.input_layernorm"],
    "qwen3": ["embed_tokens", "lm_head", "norm", "q_norm", "k_norm", "layers.0.self_attn.k_norm",
              "input_layernorm", "model.norm"],
    "gemma2": ["embed_tokens", "lm_head", "norm", "feedforward_layernorm",
               "pre_feedforward_layernorm", "post_attention_layernorm", "layers.0.post_feedforward_layernorm"],
}  # fmt: skip


@st.composite
def saved_case(draw: st.DrawFn) -> dict[str, Any]:
    arch = draw(st.sampled_from(sorted(ENTRIES)))
    adapters = []
    for _ in range(draw(st.integers(1, 3))):
        saved = draw(st.lists(st.sampled_from(ENTRIES[arch]), min_size=1, max_size=3, unique=True))
        linear = draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=3, unique=True))
        vocab = draw(st.lists(st.sampled_from(["embed_tokens", "lm_head"]), unique=True))
        adapters.append({
            "r": draw(st.integers(1, 8)),
            "lora_alpha": float(draw(st.integers(1, 32))),
            "use_rslora": draw(st.booleans()),
            "target_modules": [*linear, *vocab],
            "modules_to_save": saved,
        })  # fmt: skip
    # A vocabulary LoRA only on a module no adapter copies: peft cannot put a LoRA on a
    # module another adapter of the reference model wraps (the exclusion test covers one
    # adapter with both).
    copied = {
        m for ad in adapters for m in ("embed_tokens", "lm_head") if m in ad["modules_to_save"]
    }
    for ad in adapters:
        ad["target_modules"] = sorted(m for m in ad["target_modules"] if m not in copied)
    return {
        "arch": arch,
        "tied": draw(st.booleans()),
        "adapters": adapters,
        "plain": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
    }


@settings(
    max_examples=min(EXAMPLES, 6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=saved_case())
def test_random_saved_modules_match_peft(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("mprop")
    seed = case["seed"]
    extra = {"head_dim": 8} if case["arch"] != "llama" else {}
    model_dir = build_model(
        tmp / "m", case["arch"], seed=seed, pad_token_id=0,
        tie_word_embeddings=case["tied"], **extra,
    )  # fmt: skip
    root = tmp / "adapters"
    names = []
    for i, ad in enumerate(case["adapters"]):
        saved_adapter(root, model_dir, f"s{i}", seed=seed + i, **ad)
        names.append(f"s{i}")
    if case["plain"]:
        saved_adapter(root, model_dir, "p", seed=seed + 7, r=4, target_modules="all-linear")
        names.append("p")
    match_case(
        model_dir, root, names, PROMPTS, n=3, tag="mp-",
        lora_saved_modules=ALL, lora_vocab=True,
        max_loras=max(2, len(names) - 1), max_prefill_chunk=5, max_num_batched_tokens=16,
    )  # fmt: skip


@pytest.mark.gpu
def test_copy_rows_with_cuda_graphs_on_match_peft(llama: Path, tmp_path: Path) -> None:
    # On the GPU with graphs on: steps of base and plain rows replay graphs, steps with a
    # copy row run eagerly (the fused norm kernel for the other rows, torch for the copy
    # rows); every request still gets peft's greedy tokens.
    root = tmp_path / "adapters"
    names = _mixed_root(root, llama)
    ref = Ref(llama, root, names)

    async def go() -> None:
        eng = Engine(
            llama,
            root,
            device="cuda",
            dtype="float32",
            config=engine_config(lora_saved_modules=ALL, use_cuda_graphs=True),
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
            # Base-only and plain-only steps replayed graphs.
            for rid in ("solo-base", "solo-plain"):
                name = None if rid == "solo-base" else "plain"
                await collect(eng.submit(request(rid, PROMPT, name, max_tokens=4)))
            assert eng.describe()["graph_steps"] > 0
        finally:
            await eng.shutdown()

    asyncio.run(go())
