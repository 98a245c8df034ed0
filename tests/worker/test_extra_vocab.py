"""Adapters with extra vocabulary rows (a resized embedding and head, with the adapter's own
tokenizer) against transformers + peft: rows of adapters with copies of a resized embedding
and head, LoRA over a resized base, or a plain LoRA whose file carries the resized base, mixed
in one batch with base rows, plain LoRA rows and same-shape copies, each get peft's greedy
tokens and close logits over their own vocabulary, and -inf past it; base rows keep the base
vocabulary bit for bit; an added token the adapter's head picks is detokenised with the
adapter's tokenizer over HTTP; the sampler, logprobs, logit_bias and grammars never reach an
id past a row's vocabulary; more rows than the worker holds, a module without its extra rows
and saved base rows that differ from the model's are refused by name."""

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

from adaptermesh.worker.cli import _build_engine, build_parser
from adaptermesh.worker.engine import Engine
from adaptermesh.worker.engine_config import InvalidRequestError, validate_config
from adaptermesh.worker.grammar import GrammarError, GrammarSpec
from adaptermesh.worker.model import ModelConfig, make_lora_pool
from adaptermesh.worker.peft_adapter import AdapterValidationError, read_adapter
from adaptermesh.worker.sampling import token_logprobs
from adaptermesh.worker.types import GenerationRequest, SamplingParams

from .conftest import LogitLog, collect, request, tokens
from .fidelity_helpers import (
    DEVICE,
    EXAMPLES,
    PROMPT,
    TOLERANCE,
    Ref,
    build_model,
    engine_config,
    peft_adapter,
)
from .test_modules_to_save import saved_adapter

ALL = ("embed_tokens", "lm_head", "norms")
EXTRA = 8  # the worker's --lora-extra-vocab in these tests


def _randomize(pm: Any, gen: torch.Generator) -> None:
    """Random non-zero LoRA factors; trained copies moved off the base module they start as."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
            elif "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_embedding_A" in n:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lora_embedding_B" in n or "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "trainable_tokens_delta" in n:  # the new tokens' trained rows
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def resized_adapter(
    root: Path,
    model_dir: Path,
    name: str,
    seed: int,
    extra: int,
    *,
    hot: tuple[int, ...] | str | None = None,
    tokenizer: bool = True,
    **lora: Any,
) -> Path:
    """An adapter trained as users train one with added tokens: ``extra`` tokens added to the
    base tokenizer, ``resize_token_embeddings``, a LoRA config (``modules_to_save`` copies of
    the resized modules, LoRA on them, or neither), saved by peft (which saves the resized
    modules) with the tokenizer beside it. ``hot``: a prompt (ids, or a text the adapter's
    tokenizer encodes) after which the adapter's head gives its first added token the largest
    logit by a wide margin."""
    import peft
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        base = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        )
        v = base.config.vocab_size
        tok.add_tokens([f"<{name}-{i}>" for i in range(extra)])
        assert len(tok) == v + extra
        base.resize_token_embeddings(v + extra, mean_resizing=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            emb = base.get_input_embeddings().weight
            emb[v:] = 0.1 * torch.randn(emb[v:].shape, generator=gen)
            head = base.get_output_embeddings().weight
            if head.data_ptr() != emb.data_ptr():
                head[v:] = 0.1 * torch.randn(head[v:].shape, generator=gen)
        pm = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora))
        _randomize(pm, gen)
        if hot is not None:
            ids = tuple(tok(hot)["input_ids"]) if isinstance(hot, str) else hot
            _make_hot(pm, ids, v)
        pm.save_pretrained(str(root / name))
        if tokenizer:
            tok.save_pretrained(str(root / name))
    return root / name


def _make_hot(pm: Any, prompt: tuple[int, ...], v: int) -> None:
    """Row ``v`` of the head the adapter's rows use, set so that after ``prompt`` its logit
    beats every other by 20."""
    pm.eval()
    with torch.no_grad():
        out = pm(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        hn = out.hidden_states[-1][0, -1]
        top = float(out.logits[0, -1].max())
        head = pm.get_output_embeddings()
        weight = (
            head.modules_to_save["default"].weight
            if hasattr(head, "modules_to_save")
            else getattr(head, "base_layer", head).weight
        )
        now = float(out.logits[0, -1, v])
        weight[v] += (top - now + 20.0) * hn / hn.dot(hn)


class ResizedRef:
    """transformers + peft for one adapter with extra vocabulary rows: the base model resized
    to the adapter's vocabulary (as its user resized it), the adapter loaded over it."""

    def __init__(self, model_dir: Path, path: Path, vocab: int) -> None:
        import peft
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32, attn_implementation="eager"
            )
            base.resize_token_embeddings(vocab, mean_resizing=False)
            self.model: Any = peft.PeftModel.from_pretrained(base, str(path))
        self.model.eval()
        self.vocab = vocab

    def logits(self, ids: list[int], adapter: str | None = None) -> torch.Tensor:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model(input_ids=torch.tensor([ids])).logits[0].float()


def check_rows(
    rid: str, prompt: tuple[int, ...], got: list[int], rows: list[torch.Tensor], ref: Any,
    name: str | None, vocab: int,
) -> None:  # fmt: skip
    """The engine's greedy tokens are the reference's; each logits row is close to the
    reference's over the row's vocabulary and -inf past it (the rows may be wider)."""
    assert got, rid
    ref_logits = ref.logits([*prompt, *got][:-1], name)[len(prompt) - 1 :]
    assert ref_logits.shape[1] == vocab, (rid, ref_logits.shape)
    want = [int(r.argmax()) for r in ref_logits]
    assert got == want, f"{rid}: engine {got} != reference {want}"
    assert len(rows) == len(got), rid
    atol, rtol = TOLERANCE
    scale = max(1.0, float(ref_logits.abs().max()))
    for i, row in enumerate(rows):
        assert row.shape[0] >= vocab, (rid, row.shape)
        assert bool(torch.isneginf(row[vocab:]).all()), f"{rid}: ids past {vocab} not -inf"
        torch.testing.assert_close(row[:vocab], ref_logits[i], atol=atol * scale, rtol=rtol)


async def run_and_check(
    eng: Engine,
    log: LogitLog,
    jobs: list[tuple[str, tuple[int, ...], str | None]],
    refs: dict[str | None, Any],
    vocabs: dict[str | None, int],
    n: int = 3,
) -> dict[str, list[int]]:
    """One concurrent batch of ``jobs`` (request id, prompt, adapter), each checked against
    its adapter's reference."""
    streams = [eng.submit(request(rid, p, name, max_tokens=n)) for rid, p, name in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    out = {}
    for (rid, p, name), events in zip(jobs, results, strict=True):
        got = tokens(events)
        check_rows(rid, p, got, log[rid], refs[name], name, vocabs[name])
        out[rid] = got
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("xv") / "m", "llama", seed=4, pad_token_id=0)


def _prompts(v: int, extra: int) -> list[tuple[int, ...]]:
    """Prompts of an adapter with ``extra`` added tokens: its first and last added ids among
    base ids, and one of base ids only."""
    return [(*PROMPT[:6], v, *PROMPT[6:9], v + extra - 1, 5), PROMPT[3:8]]


def _mixed_root(root: Path, model_dir: Path) -> dict[str, int]:
    """Adapters of every kind over the llama model; name -> added tokens (0: none)."""
    resized_adapter(
        root, model_dir, "mts", 1, 3, r=4, target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
    )  # fmt: skip
    resized_adapter(
        root, model_dir, "lora", 2, 5, r=4, use_rslora=True,
        target_modules=["embed_tokens", "lm_head", "v_proj"],
    )  # fmt: skip
    resized_adapter(root, model_dir, "plainres", 3, 2, r=4, target_modules=["q_proj", "down_proj"])
    resized_adapter(
        root, model_dir, "mixed", 4, 4, r=6, target_modules=["lm_head", "o_proj"],
        modules_to_save=["embed_tokens"],
    )  # fmt: skip
    saved_adapter(
        root, model_dir, "copy", 5, r=4, target_modules=["k_proj"],
        modules_to_save=["lm_head", "norm"],
    )  # fmt: skip
    peft_adapter(root, model_dir, "plain", 6, r=4, target_modules=["q_proj", "v_proj"])
    return {"mts": 3, "lora": 5, "plainres": 2, "mixed": 4, "copy": 0, "plain": 0}


def _refs(
    model_dir: Path, root: Path, kinds: dict[str, int]
) -> tuple[dict[str | None, Any], dict[str | None, int]]:
    v = ModelConfig.from_dir(model_dir).vocab_size
    same = [n for n, k in kinds.items() if not k]
    shared = Ref(model_dir, root, same)
    refs: dict[str | None, Any] = {None: shared, **{n: shared for n in same}}
    vocabs: dict[str | None, int] = {None: v, **{n: v for n in same}}
    for n, k in kinds.items():
        if k:
            refs[n] = ResizedRef(model_dir, root / n, v + k)
            vocabs[n] = v + k
    return refs, vocabs


def _jobs(
    kinds: dict[str, int], v: int, tag: str = ""
) -> list[tuple[str, tuple[int, ...], str | None]]:
    jobs: list[tuple[str, tuple[int, ...], str | None]] = []
    for name in (None, *kinds):
        k = kinds.get(name or "", 0)
        prompts = _prompts(v, k) if k else [PROMPT, PROMPT[3:8]]
        jobs += [(f"{tag}{i}-{name}", p, name) for i, p in enumerate(prompts)]
    return jobs


def test_extra_vocab_rows_mixed_with_base_plain_and_copies_match_peft(
    llama: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    kinds = _mixed_root(root, llama)
    refs, vocabs = _refs(llama, root, kinds)
    v = vocabs[None]

    async def go() -> None:
        log = LogitLog()
        # Four slots for six adapters: slots change hands mid-run between adapters with and
        # without extra rows, so a slot's rows and vocabulary must follow what it holds.
        eng = Engine(
            llama, root, device=DEVICE, dtype="float32", sample_observer=log,
            config=engine_config(
                lora_extra_vocab=EXTRA, lora_saved_modules=ALL, lora_vocab=True, max_loras=4,
                max_prefill_chunk=5, max_num_batched_tokens=16,
            ),
        )  # fmt: skip
        try:
            await run_and_check(eng, log, _jobs(kinds, v), refs, vocabs)
            d = eng.describe()
            assert d["extra_vocab_bytes"] == eng.pool.extra.nbytes > 0  # type: ignore[union-attr]
        finally:
            await eng.shutdown()

    asyncio.run(go())


# Tied heads (the head is the embedding: an embedding copy leaves the tied head with the
# resized base's rows, a LoRA on the embedding alone gives the head the embedding's base
# rows), Gemma's scaled embeddings (the extra rows are scaled too), Qwen3's q/k norms.
TIED = [
    ("qwen2", {"tie_word_embeddings": True}),
    ("gemma", {"head_dim": 16, "tie_word_embeddings": True}),
    ("qwen3", {"head_dim": 8, "tie_word_embeddings": False}),
]


@pytest.mark.parametrize(("arch", "cfg"), TIED, ids=[t[0] for t in TIED])
def test_tied_and_scaled_embeddings_match_peft(
    tmp_path: Path, arch: str, cfg: dict[str, Any]
) -> None:
    model_dir = build_model(tmp_path / "m", arch, seed=7, pad_token_id=0, **cfg)
    root = tmp_path / "adapters"
    resized_adapter(
        root, model_dir, "e", 71, 3, r=4, target_modules=["q_proj"],
        modules_to_save=["embed_tokens"],
    )  # fmt: skip
    resized_adapter(
        root, model_dir, "h", 72, 2, r=4, target_modules=["v_proj"], modules_to_save=["lm_head"]
    )
    if cfg["tie_word_embeddings"]:
        # peft saves only the LoRA-wrapped embedding: a tied head is its base.
        resized_adapter(root, model_dir, "le", 73, 4, r=3, target_modules=["embed_tokens"])
    resized_adapter(root, model_dir, "leh", 74, 5, r=5, target_modules=["embed_tokens", "lm_head"])
    resized_adapter(root, model_dir, "p", 75, 1, r=2, target_modules=["o_proj"])
    kinds = {n: k for n, k in {"e": 3, "h": 2, "le": 4, "leh": 5, "p": 1}.items()
             if (root / n).is_dir()}  # fmt: skip
    refs, vocabs = _refs(model_dir, root, kinds)
    v = vocabs[None]

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            model_dir, root, device=DEVICE, dtype="float32", sample_observer=log,
            config=engine_config(
                lora_extra_vocab=EXTRA, lora_saved_modules=ALL, lora_vocab=True, max_loras=3
            ),
        )  # fmt: skip
        try:
            await run_and_check(eng, log, _jobs(kinds, v), refs, vocabs)
        finally:
            await eng.shutdown()

    asyncio.run(go())


HOT_TEXT = "Hello world <hot-1> and"


def test_added_token_picked_and_detokenised_by_the_adapter_tokenizer_over_http(
    llama: Path, tmp_path: Path
) -> None:
    import httpx

    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

    root = tmp_path / "adapters"
    resized_adapter(root, llama, "hot", 81, 3, hot=HOT_TEXT, r=4, target_modules=["q_proj"])
    v = ModelConfig.from_dir(llama).vocab_size
    import transformers

    mine = transformers.AutoTokenizer.from_pretrained(str(root / "hot"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(llama))
    ids = list(mine(HOT_TEXT)["input_ids"])
    assert v + 1 in ids
    assert v + 1 not in theirs(HOT_TEXT)["input_ids"]
    ref = ResizedRef(llama, root / "hot", v + 3)
    assert int(ref.logits(ids)[-1].argmax()) == v  # the adapter's head picks <hot-0>

    async def go() -> None:
        eng = Engine(
            llama, root, dtype="float32", model_name="tiny",
            config=engine_config(lora_extra_vocab=EXTRA),
        )  # fmt: skip
        service = WorkerService(eng, ServiceConfig())
        runner, port = await serve(service, "127.0.0.1", 0)
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        auth = {"authorization": "Bearer tenant-a"}

        def refused(r: Any, param: str) -> None:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text

        async def post(body: dict[str, Any], path: str = "/v1/completions") -> Any:
            base = {"max_tokens": 1, "temperature": 0}
            return await client.post(path, json={**base, **body}, headers=auth)

        try:
            # The prompt text goes through the adapter's tokenizer (its added token is one
            # id), the head picks an added token, and its text is the adapter tokenizer's.
            r = await post({"model": "hot", "prompt": HOT_TEXT, "logprobs": 2})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == "<hot-0>"
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert body["choices"][0]["logprobs"]["tokens"] == ["<hot-0>"]
            assert "<hot-0>" in body["choices"][0]["logprobs"]["top_logprobs"][0]
            # Echo detokenises the prompt ids with the adapter's tokenizer too.
            r = await post({"model": "hot", "prompt": ids, "echo": True, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert (
                r.json()["choices"][0]["text"]
                == mine.decode(ids, skip_special_tokens=True) + "<hot-0>"
            )
            # The base model tokenises the same text with its own tokenizer and never
            # produces an added token.
            r = await post({"model": "tiny", "prompt": HOT_TEXT, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(theirs(HOT_TEXT)["input_ids"])
            assert "<hot-" not in r.json()["choices"][0]["text"]
            # Token ids are checked against the row's vocabulary: an added id is the
            # adapter's, not the base model's; past the adapter's vocabulary it is nobody's.
            r = await post({"model": "tiny", "prompt": [5, v + 1]})
            refused(r, "prompt")
            r = await post({"model": "hot", "prompt": [5, v + 3]})
            refused(r, "prompt")
            # logit_bias likewise; an added id biased up is sampled and named.
            r = await post({"model": "tiny", "prompt": [5, 6], "logit_bias": {str(v + 2): 5}})
            refused(r, "logit_bias")
            r = await post({"model": "hot", "prompt": [5, 6], "logit_bias": {str(v + 3): 5}})
            refused(r, "logit_bias")
            r = await post({"model": "hot", "prompt": [5, 6], "logit_bias": {str(v + 2): 100}})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "<hot-2>"
            # A chat goes through the adapter's chat template and tokenizer.
            r = await post(
                {"model": "hot", "messages": [{"role": "user", "content": "<hot-1> hi"}]},
                "/v1/chat/completions",
            )
            assert r.status_code == 200, r.text
            assert eng.describe()["adapter_tokenizers"] == 1
        finally:
            await client.aclose()
            await runner.cleanup()
            await eng.shutdown()

    asyncio.run(go())


def _read(path: Path, cfg: ModelConfig, extra: int = EXTRA) -> Any:
    return read_adapter(
        path.name, path, cfg, 16, torch.float32, False, per_module=True, extra_vocab=extra
    )


def _refused(path: Path, cfg: ModelConfig, field: str, *texts: str, extra: int = EXTRA) -> None:
    with pytest.raises(AdapterValidationError) as exc:
        _read(path, cfg, extra)
    assert exc.value.field == field, exc.value
    for text in texts:
        assert text in str(exc.value), exc.value


def _rewrite(root: Path, src: Path, name: str, change: Any) -> Path:
    """A copy of adapter ``src`` whose tensors ``change(tensors)`` edits in place."""
    d = root / name
    shutil.copytree(src, d)
    tensors = load_file(str(d / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def test_refused_by_name(llama: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    v, h = cfg.vocab_size, cfg.hidden_size
    root = tmp_path / "adapters"
    mts = resized_adapter(
        root, llama, "mts", 1, 3, r=4, target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
    )  # fmt: skip
    lora = resized_adapter(
        root, llama, "lora", 2, 3, r=4, target_modules=["embed_tokens", "lm_head"]
    )
    plain = resized_adapter(root, llama, "plain", 3, 3, r=4, target_modules=["q_proj"])
    # Each loads on a worker holding 3 extra rows a slot or more.
    for path in (mts, lora, plain):
        assert _read(path, cfg, 3).vocab_size == v + 3
    # A worker holding none (0 keeps today's refusal) or too few: the field of the tensor
    # with the extra rows, and the flag.
    for path, field in ((mts, "modules_to_save"), (lora, "target_modules"),
                        (plain, "adapter_model.safetensors")):  # fmt: skip
        _refused(path, cfg, field, "extra vocabulary rows", "--lora-extra-vocab 3", extra=0)
        _refused(
            path, cfg, field, f"{v + 3} vocabulary rows", "at most 2", "--lora-extra-vocab", extra=2
        )
    # peft saves only the LoRA-wrapped embedding when the LoRA targets it: an untied head
    # then has no rows past the model's vocabulary.
    emb = resized_adapter(root, llama, "emb", 4, 3, r=4, target_modules=["embed_tokens"])
    assert "base_model.model.lm_head.weight" not in load_file(
        str(emb / "adapter_model.safetensors")
    )
    _refused(
        emb, cfg, "adapter_model.safetensors", "lm_head", f"no rows of lm_head past the model's {v}"
    )
    # Vocabulary tensors that disagree on the vocabulary.
    head = "base_model.model.lm_head.weight"
    short = _rewrite(root, plain, "short", lambda t: t.update({head: t[head][: v + 2].clone()}))
    _refused(short, cfg, "adapter_model.safetensors", f"{head} has shape ({v + 2}, {h})")
    a_key = "base_model.model.model.embed_tokens.lora_embedding_A"
    narrow = _rewrite(
        root, lora, "narrow", lambda t: t.update({a_key: t[a_key][:, : v + 1].clone()})
    )
    _refused(narrow, cfg, "adapter_model.safetensors", f"tensor {a_key} has shape (4, {v + 1})")
    copy = "base_model.model.model.embed_tokens.weight"
    dup = "base_model.model.model.embed_tokens.modules_to_save.weight"
    wide = _rewrite(
        root,
        mts,
        "wide",
        lambda t: t.update({copy: torch.zeros(v + 5, h), dup: torch.zeros(v + 5, h)}),
    )
    _refused(
        wide,
        cfg,
        "modules_to_save",
        f"has shape ({v + 3}, {h}), the adapter's vocabulary needs ({v + 5}, {h})",
    )
    # The copy peft writes twice, once changed."
    twice = _rewrite(root, mts, "twice", lambda t: t.update({dup: t[dup] + 1.0}))
    _refused(twice, cfg, "modules_to_save", "more than one copy", "differ")

    # A saved base whose rows of the model's vocabulary differ from the model's: refused
    # when the adapter first enters a slot, naming the tensor; nothing changes.
    changed = _rewrite(root, plain, "changed", lambda t: t.update({head: t[head] + 0.01}))

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_extra_vocab=EXTRA))
        try:
            with pytest.raises(AdapterValidationError) as exc:
                await eng.adapters.load("changed")
            assert head in str(exc.value)
            assert "differs from the base model" in str(exc.value)
            assert "changed" not in eng.adapters.published
            assert eng.describe()["extra_vocab_slots"] == 0
            await eng.adapters.load("plain")
            assert eng.describe()["extra_vocab_slots"] == 1
        finally:
            await eng.shutdown()

    asyncio.run(go())
    assert changed.is_dir()
    # Merges combine projection factors only; AdaFuse experts take no vocabulary tensors.
    from adaptermesh.worker.adapter_merge import read_part

    with pytest.raises(AdapterValidationError) as exc:
        read_part("plain", plain, cfg, 16)
    assert exc.value.field == "adapter_model.safetensors"
    assert "merged_adapters" in str(exc.value)
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("plain", plain, cfg, 16, torch.float32, False, extra_vocab=EXTRA)
    assert "unexpected tensor" in str(exc.value)
    # Pools that cannot hold the rows refuse the option at start.
    for kw in ({"lora_dtype": "int4"}, {"tensor_parallel_size": 2}, {"lora_extra_vocab": -1}):
        with pytest.raises(InvalidRequestError) as cerr:
            validate_config(engine_config(**{"lora_extra_vocab": EXTRA, **kw}))
        assert cerr.value.field == "lora_extra_vocab"


def test_tied_head_saved_twice_must_agree(tmp_path: Path) -> None:
    model_dir = build_model(
        tmp_path / "m", "qwen2", seed=9, pad_token_id=0, tie_word_embeddings=True
    )
    cfg = ModelConfig.from_dir(model_dir)
    root = tmp_path / "adapters"
    src = resized_adapter(root, model_dir, "p", 91, 2, r=4, target_modules=["q_proj"])
    tensors = load_file(str(src / "adapter_model.safetensors"))
    head, emb = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"
    assert torch.equal(tensors[head], tensors[emb])  # peft saves the tied weight under both
    assert _read(src, cfg).vocab_size == cfg.vocab_size + 2

    def change(t: dict[str, torch.Tensor]) -> None:
        t[head] = t[head].clone()
        t[head][-1] += 1.0

    _refused(
        _rewrite(root, src, "q", change),
        cfg,
        "adapter_model.safetensors",
        "differ in their extra vocabulary rows",
    )


def test_token_logprobs_never_name_ids_past_a_rows_vocabulary() -> None:
    # Tied -inf values (tokens a filter removed, ids past the row's vocabulary): torch's topk
    # picks any of them; with the rows' widths the alternatives stay inside each vocabulary.
    logits = torch.full((3, 12), -torch.inf)
    logits[:, 0] = 0.0
    logits[1, 3] = -1.0
    widths = torch.tensor([4, 7, 12])
    for k in (1, 5, 12):
        chosen, values, ids = token_logprobs(logits, torch.zeros(3, dtype=torch.int64), k, widths)
        for r in range(3):
            # Every id of the row's vocabulary comes before any past it (k <= 20 in service,
            # vocabularies are far larger: the alternatives are all inside).
            inside = min(k, int(widths[r]))
            assert bool((ids[r, :inside] < widths[r]).all()), (r, ids[r])
            assert bool(torch.isfinite(values[r, :inside]).all()), values[r]
        assert torch.equal(chosen, torch.log_softmax(logits, -1)[:, 0])
    # Without widths the answer is as before.
    plain = token_logprobs(logits, torch.zeros(3, dtype=torch.int64), 2)
    assert torch.equal(plain[1], torch.topk(torch.log_softmax(logits, -1), 2).values)


def _zero_head(path: Path) -> None:
    """The adapter's head copy (both keys peft writes it under) set to zeros: every logit of
    its rows is 0, so a draw may land on any id of its vocabulary."""
    f = path / "adapter_model.safetensors"
    t = load_file(str(f))
    for key in (
        "base_model.model.lm_head.weight",
        "base_model.model.lm_head.modules_to_save.weight",
    ):
        t[key] = torch.zeros_like(t[key])
    save_file(t, str(f))


def test_sampler_never_reaches_past_a_rows_vocabulary(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    v = ModelConfig.from_dir(llama).vocab_size
    flat = resized_adapter(
        root, llama, "flat", 11, 2, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    _zero_head(flat)
    resized_adapter(root, llama, "mts", 12, 5, r=2, target_modules=["v_proj"],
                    modules_to_save=["embed_tokens", "lm_head"])  # fmt: skip
    # Base rows through every sampler path: penalties, logit_bias, the filters.
    variants: list[dict[str, Any]] = [
        {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.3},
        {"logit_bias": ((5, 3.0), (9, -2.0))},
        {"top_p": 0.9, "top_k": 20},
        {"min_p": 0.05},
        {"typical_p": 0.9},
        {},
    ]
    base_jobs = [
        request(f"b{i}", PROMPT, None, temperature=1.0, seed=100 + i, max_tokens=8, **kw)
        for i, kw in enumerate(variants)
    ]

    async def go() -> None:
        eng = Engine(
            llama, root, device=DEVICE, dtype="float32",
            config=engine_config(
                lora_extra_vocab=EXTRA, lora_saved_modules=ALL, logprobs_mode="processed",
                max_num_seqs=16,
            ),
        )  # fmt: skip
        try:
            alone = [tokens(await collect(eng.submit(r))) for r in base_jobs]
            await eng.adapters.load("flat")
            await eng.adapters.load("mts")
            eager = eng.launcher.eager_steps
            drawn = [
                request(f"f{i}", (*PROMPT, v + 1), "flat", temperature=1.0, seed=i, max_tokens=64,
                        frequency_penalty=0.1, logit_bias=((v, 3.0), (v + 1, 3.0)))
                for i in range(3)
            ]  # fmt: skip
            drawn.append(
                request("m", (v + 4, *PROMPT), "mts", temperature=1.5, seed=7, max_tokens=16)
            )
            asking = [
                request("lf", PROMPT, "flat", top_k=1, temperature=1.0, logprobs=5, max_tokens=4),
                request("lb", PROMPT, None, top_k=1, temperature=1.0, logprobs=5, max_tokens=4),
            ]
            streams = [eng.submit(r) for r in (*base_jobs, *drawn, *asking)]
            results = await asyncio.gather(*(collect(s) for s in streams))
            assert eng.launcher.eager_steps > eager
            n = len(base_jobs)
            # Base rows in steps with rows of wider vocabularies: the same draws, bit for bit.
            assert [tokens(r) for r in results[:n]] == alone
            # A flat head draws over its whole vocabulary and nothing past it.
            flat_ids = [t for r in results[n : n + 3] for t in tokens(r)]
            assert max(flat_ids) < v + 2, flat_ids
            assert {v, v + 1} & set(flat_ids)
            assert max(tokens(results[n + 3])) < v + 5
            # Logprob alternatives stay inside each row's vocabulary, filtered ones included.
            for events, vocab in zip(results[-2:], (v + 2, v), strict=True):
                tops = [t.token_id for e in events for lp in e.logprobs for t in lp.top]
                assert len(tops) == 4 * 5
                assert max(tops) < vocab, tops
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_token_ids_checked_against_the_rows_vocabulary(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    v = ModelConfig.from_dir(llama).vocab_size
    resized_adapter(root, llama, "x", 21, 3, r=2, target_modules=["q_proj"])
    peft_adapter(root, llama, "p", 22, r=2, target_modules=["q_proj"])

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_extra_vocab=EXTRA))
        try:
            # Not read yet: ids up to the widest vocabulary a slot holds pass the submit
            # check, and the request fails at admission naming the field; others run on.
            assert "x" not in eng.adapters.published
            stream = eng.submit(request("late", (5, v + 3), "x", max_tokens=2))
            ok = eng.submit(request("ok", (5, v + 2), "x", max_tokens=2))
            with pytest.raises(InvalidRequestError) as exc:
                await collect(stream)
            assert exc.value.field == "prompt"
            assert str(v + 3) in str(exc.value)
            assert tokens(await collect(ok))
            await eng.adapters.load("p")
            # Known now: refused at submit. Beyond the widest slot vocabulary: always.
            for rid, ids, name, bias, field in (
                ("a", (5, v + 3), "x", (), "prompt"),
                ("b", (5, v), None, (), "prompt"),
                ("c", (5, v), "p", (), "prompt"),
                ("d", (5,), "x", ((v + 3, 1.0),), "logit_bias"),
                ("e", (5,), None, ((v, 1.0),), "logit_bias"),
                ("f", (5, v + EXTRA), "x", (), "prompt"),
            ):
                with pytest.raises(InvalidRequestError) as exc:
                    eng.submit(request(rid, ids, name, max_tokens=2, logit_bias=bias))
                assert exc.value.field == field, (rid, exc.value)
            # A logit_bias past the adapter's vocabulary, on a request submitted before its
            # adapter was read: refused at admission too.
            await eng.adapters.unload("x")
            late = eng.submit(request("g", (5,), "x", max_tokens=2, logit_bias=((v + 4, 1.0),)))
            with pytest.raises(InvalidRequestError) as exc:
                await collect(late)
            assert exc.value.field == "logit_bias"
            assert not any(s.refcount for s in eng.adapters.slots)  # the lease went back
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_pool_counts_the_extra_rows(llama: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    dev = torch.device("meta")
    slots, n, r = 3, 8, 4
    v, h = cfg.vocab_size, cfg.hidden_size
    plain = make_lora_pool(cfg, slots, r, dev, torch.float32).nbytes
    extra = make_lora_pool(cfg, slots, r, dev, torch.float32, extra_vocab=n)
    # The base embedding's and head's rows past V, and one vocabulary per slot (+ base rows).
    assert extra.nbytes - plain == slots * 2 * n * h * 4 + (slots + 1) * 4
    vocab = make_lora_pool(cfg, slots, r, dev, torch.float32, vocab=True).nbytes
    both = make_lora_pool(cfg, slots, r, dev, torch.float32, vocab=True, extra_vocab=n).nbytes
    # Vocabulary factors one row (or column) per extra id wider: embed A and head B.
    assert both - vocab == extra.nbytes - plain + slots * 2 * r * n * 4
    saved = make_lora_pool(cfg, slots, r, dev, torch.float32, saved=frozenset(ALL)).nbytes
    wide = make_lora_pool(cfg, slots, r, dev, torch.float32, saved=frozenset(ALL), extra_vocab=n)
    # Copies of the embedding and head n rows longer.
    assert wide.nbytes - saved == extra.nbytes - plain + slots * 2 * n * h * 4
    assert wide.saved is not None
    assert wide.saved.tables["lm_head"].shape[2] == v + n
    with pytest.raises(ValueError, match="lora_extra_vocab"):
        make_lora_pool(cfg, slots, r, dev, torch.float32, "int4", extra_vocab=n)


def test_extra_rows_enter_and_leave_with_their_slot(llama: Path, tmp_path: Path) -> None:
    # One slot: the extra-vocabulary adapter, a plain adapter that takes its slot (and must
    # see the model's vocabulary there, against peft), the first again from the CPU cache.
    root = tmp_path / "adapters"
    resized_adapter(
        root, llama, "x", 31, 4, r=4, target_modules=["embed_tokens", "lm_head", "q_proj"]
    )
    peft_adapter(root, llama, "plain", 32, r=4, target_modules=["v_proj"])
    kinds = {"x": 4, "plain": 0}
    refs, vocabs = _refs(llama, root, kinds)
    v = vocabs[None]

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            llama, root, dtype="float32", sample_observer=log,
            config=engine_config(lora_extra_vocab=EXTRA, lora_vocab=True, max_loras=1),
        )  # fmt: skip
        extra = eng.pool.extra
        assert extra is not None
        try:
            await run_and_check(eng, log, [("x1", _prompts(v, 4)[0], "x")], refs, vocabs)
            slot = eng.adapters.published["x"].slot
            assert extra.vocab[slot] == v + 4
            assert int(extra.widths[slot]) == v + 4
            assert extra.held[slot] == {"embed", "head"}
            cpu = eng.adapters.cpu_cache["x"]
            assert cpu.vocab_size == v + 4
            assert eng.adapters.cpu_bytes == cpu.nbytes
            assert {("x", "gpu"), ("x", "cpu")} <= {
                (r.name, r.level) for r in eng.adapters.held_by_tier()
            }
            assert eng.describe()["extra_vocab_slots"] == 1
            await run_and_check(eng, log, [("p1", PROMPT, "plain")], refs, vocabs)
            assert "x" not in eng.adapters.published
            assert eng.adapters.published["plain"].slot == slot
            assert extra.vocab[slot] == v
            assert int(extra.widths[slot]) == v
            assert not bool(extra.rows["embed"][slot].any())
            assert eng.describe()["extra_vocab_slots"] == 0
            hits = eng.adapters.counters.cpu_hits
            await run_and_check(
                eng, log, [("x2", _prompts(v, 4)[1], "x"), ("b", PROMPT, None)], refs, vocabs
            )
            assert eng.adapters.counters.cpu_hits == hits + 1
            await eng.adapters.unload("x")
            assert "x" not in eng.adapters.cpu_cache
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_cli_flag_sets_the_extra_rows(llama: Path, tmp_path: Path) -> None:
    base = ["--model", str(llama), "--adapter-root", str(tmp_path), "--device", "cpu"]
    assert build_parser().parse_args(base).lora_extra_vocab is None

    async def go() -> None:
        eng = _build_engine(build_parser().parse_args([*base, "--lora-extra-vocab", "16"]))
        try:
            assert isinstance(eng, Engine)
            assert eng.config.lora_extra_vocab == 16
            assert eng.pool.extra is not None
            assert eng.pool.extra.width == eng.model_config.vocab_size + 16
        finally:
            await eng.shutdown()

    asyncio.run(go())
    with pytest.raises(InvalidRequestError) as exc:
        _build_engine(build_parser().parse_args([*base, "--lora-extra-vocab", "-1"]))
    assert exc.value.field == "lora_extra_vocab"


def _tokenizer_with(path: Path, model_dir: Path, added: list[str], eos: str | None = None) -> None:
    """Save the base tokenizer with ``added`` tokens (and ``eos``) into ``path``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_tokens(added)
    if eos is not None:
        tok.eos_token = eos
    tok.save_pretrained(str(path))


def test_adapter_tokenizer_per_version_and_its_end_token(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    v = ModelConfig.from_dir(llama).vocab_size
    t = resized_adapter(root, llama, "t", 41, 3, hot="Hello <t-1>", r=2, target_modules=["q_proj"])
    resized_adapter(root, llama, "bare", 42, 2, tokenizer=False, r=2, target_modules=["q_proj"])

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_extra_vocab=EXTRA))
        try:
            base_ids = eng.tokenize("Hello <t-1>")
            ids = eng.tokenize("Hello <t-1>", adapter="t")
            assert v + 1 in ids
            assert v + 1 not in base_ids
            assert eng.detokenize([5, v + 2], adapter="t").endswith("<t-2>")
            assert eng.tokenize("Hello <t-1>", adapter="bare") == base_ids  # ships none
            assert eng.texts.loads == 1
            got = await collect(eng.submit(request("r1", tuple(ids), "t", max_tokens=3)))
            assert tokens(got)[0] == v
            assert "".join(e.text for e in got).startswith("<t-0>")
            assert eng.texts.loads == 1  # cached
            # A new version of the files: a new tokenizer, whose EOS is the added token the
            # adapter's head picks; its outputs end there.
            _tokenizer_with(t, llama, ["<t-0>", "<t-1>", "<t-2>"], eos="<t-0>")
            got = await collect(eng.submit(request("r2", tuple(ids), "t", max_tokens=5)))
            assert eng.texts.loads == 2
            assert tokens(got) == [v]
            assert got[-1].finish_reason == "stop"
            # Base rows keep the base tokenizer's EOS only.
            assert v not in eng.scheduler.eos_token_ids
            # Tokenizer files that do not load: refused naming the file, nothing else changes.
            (t / "tokenizer.json").write_text("{not json")
            with pytest.raises(AdapterValidationError) as exc:
                eng.tokenize("Hello", adapter="t")
            assert exc.value.field == "tokenizer.json"
            with pytest.raises(AdapterValidationError):
                eng.submit(request("r3", (5, 6), "t", max_tokens=2))
            assert tokens(await collect(eng.submit(request("r4", (5, 6), None, max_tokens=2))))
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_grammars_compile_with_the_adapter_tokenizer(llama: Path, tmp_path: Path) -> None:
    # The adapter's head picks its added token. A grammar naming that token (llguidance
    # takes added tokens as special tokens, named in angle brackets) compiles with the
    # adapter's tokenizer and its rows produce it; the base tokenizer has no such token. A
    # choice spelling the token's text is spelt with base tokens under either tokenizer: the
    # mask, as wide as the widest slot vocabulary, refuses the added id the head prefers.
    root = tmp_path / "adapters"
    v = ModelConfig.from_dir(llama).vocab_size
    resized_adapter(root, llama, "g", 51, 2, hot="Say", r=2, target_modules=["q_proj"])
    named = GrammarSpec("grammar", 'start: <g-0> "!" | "no"', "structured_outputs.grammar")
    choice = GrammarSpec("choice", json.dumps(["<g-0>!", "no"]), "structured_outputs.choice")

    async def go() -> None:
        eng = Engine(llama, root, dtype="float32", config=engine_config(lora_extra_vocab=EXTRA))

        async def run(rid: str, grammar: Any) -> list[Any]:
            ids = tuple(eng.tokenize("Say", adapter="g"))
            sp = SamplingParams(max_tokens=12)
            return await collect(eng.submit(GenerationRequest(rid, ids, "g", sp, grammar=grammar)))

        try:
            events = await run("named", eng.compile_grammar(named, adapter="g"))
            assert tokens(events)[0] == v
            assert "".join(e.text for e in events) == "<g-0>!"
            with pytest.raises(GrammarError) as exc:
                eng.compile_grammar(named)
            assert exc.value.param == "structured_outputs.grammar"
            for rid, adapter in (("own", "g"), ("base", None)):
                events = await run(rid, eng.compile_grammar(choice, adapter=adapter))
                assert max(tokens(events)) < v, (rid, tokens(events))
                assert "".join(e.text for e in events) in ("<g-0>!", "no"), rid
        finally:
            await eng.shutdown()

    asyncio.run(go())


# --- property: how adapters bring their extra rows ---------------------------------------

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# How the adapter's file holds its vocabulary: copies of both modules; an embedding copy
# with a head LoRA over the resized base; the reverse; LoRA on both; a plain LoRA whose file
# carries the resized base; trained rows of some added tokens.
KINDS = {
    "copies": {"modules_to_save": ["embed_tokens", "lm_head"]},
    "embed_copy": {"modules_to_save": ["embed_tokens"], "vocab": ["lm_head"]},
    "head_copy": {"modules_to_save": ["lm_head"], "vocab": ["embed_tokens"]},
    "lora": {"vocab": ["embed_tokens", "lm_head"]},
    "plain": {},
    "tokens": {"tokens": True},
}


@st.composite
def extra_case(draw: st.DrawFn) -> dict[str, Any]:
    adapters = []
    for _ in range(draw(st.integers(1, 3))):
        kind = KINDS[draw(st.sampled_from(sorted(KINDS)))]
        linear = draw(st.lists(st.sampled_from(LINEAR), min_size=1, max_size=2, unique=True))
        extra = draw(st.integers(1, EXTRA))
        ad: dict[str, Any] = {
            "extra": extra,
            "r": draw(st.integers(1, 8)),
            "lora_alpha": float(draw(st.integers(1, 32))),
            "use_rslora": draw(st.booleans()),
            "target_modules": sorted([*linear, *kind.get("vocab", [])]),
        }
        if "modules_to_save" in kind:
            ad["modules_to_save"] = kind["modules_to_save"]
        if "tokens" in kind:  # offsets past the model's vocabulary
            rows = st.lists(st.integers(0, extra - 1), min_size=1, max_size=extra, unique=True)
            ad["tokens"] = draw(rows)
        adapters.append(ad)
    return {
        "arch": draw(st.sampled_from(["llama", "qwen2"])),
        "tied": draw(st.booleans()),
        "adapters": adapters,
        "same": draw(st.booleans()),  # a plain adapter of the model's vocabulary beside them
        "seed": draw(st.integers(0, 1000)),
    }


@settings(
    max_examples=min(EXAMPLES, 8),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=extra_case())
def test_random_extra_vocab_adapters_match_peft(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("xprop")
    seed = case["seed"]
    model_dir = build_model(
        tmp / "m", case["arch"], seed=seed, pad_token_id=0, tie_word_embeddings=case["tied"]
    )
    root = tmp / "adapters"
    kinds: dict[str, int] = {}
    for i, ad in enumerate(case["adapters"]):
        ad = dict(ad)
        extra = ad.pop("extra")
        if "tokens" in ad:
            v = ModelConfig.from_dir(model_dir).vocab_size
            ad["trainable_token_indices"] = [v + t for t in ad.pop("tokens")]
        resized_adapter(root, model_dir, f"x{i}", seed + i, extra, **ad)
        kinds[f"x{i}"] = extra
    if case["same"]:
        peft_adapter(root, model_dir, "p", seed + 9, r=4, target_modules=["q_proj", "o_proj"])
        kinds["p"] = 0
    refs, vocabs = _refs(model_dir, root, kinds)

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            model_dir, root, device=DEVICE, dtype="float32", sample_observer=log,
            config=engine_config(
                lora_extra_vocab=EXTRA, lora_saved_modules=("embed_tokens", "lm_head"),
                lora_vocab=True, max_loras=max(2, len(kinds) - 1), max_prefill_chunk=5,
                max_num_batched_tokens=16,
            ),
        )  # fmt: skip
        try:
            await run_and_check(eng, log, _jobs(kinds, vocabs[None]), refs, vocabs)
        finally:
            await eng.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trained_rows_of_added_tokens_match_peft(tmp_path: Path, arch: str) -> None:
    # trainable_token_indices over the added tokens: peft saves the resized base and the
    # trained rows, which replace the base's (a tied head reads them too; an untied head
    # keeps the resized base's rows, saved beside them). Beside LoRA rows and base rows.
    tied = arch == "qwen2"
    model_dir = build_model(tmp_path / "m", arch, seed=8, pad_token_id=0, tie_word_embeddings=tied)
    v = ModelConfig.from_dir(model_dir).vocab_size
    root = tmp_path / "adapters"
    resized_adapter(
        root, model_dir, "tt", 61, 4, r=4, target_modules=["q_proj"],
        trainable_token_indices=[v + 2, v, v + 3],
    )  # fmt: skip
    resized_adapter(
        root, model_dir, "td", 62, 2, r=2, target_modules=["v_proj", "down_proj"],
        trainable_token_indices={"embed_tokens": [v + 1]},
    )  # fmt: skip
    peft_adapter(root, model_dir, "plain", 63, r=4, target_modules=["o_proj"])
    tensors = load_file(str(root / "tt" / "adapter_model.safetensors"))
    delta = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    assert tuple(tensors[delta].shape) == (3, 32)
    assert ("base_model.model.lm_head.token_adapter.trainable_tokens_delta" in tensors) == tied
    kinds = {"tt": 4, "td": 2, "plain": 0}
    refs, vocabs = _refs(model_dir, root, kinds)

    async def go() -> None:
        log = LogitLog()
        eng = Engine(
            model_dir, root, device=DEVICE, dtype="float32", sample_observer=log,
            config=engine_config(lora_extra_vocab=EXTRA, lora_vocab=True, max_loras=2),
        )  # fmt: skip
        try:
            await run_and_check(eng, log, _jobs(kinds, v), refs, vocabs)
        finally:
            await eng.shutdown()

    asyncio.run(go())


def test_trained_token_rows_refused_by_name(llama: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(llama)
    v = cfg.vocab_size
    root = tmp_path / "adapters"
    src = resized_adapter(
        root, llama, "tt", 65, 2, r=2, target_modules=["q_proj"], trainable_token_indices=[v]
    )

    def patched(name: str, value: Any) -> Path:
        d = root / name
        shutil.copytree(src, d)
        cj = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cj, "trainable_token_indices": value}))
        return d

    field = "trainable_token_indices"
    _refused(patched("own", [5]), cfg, field, "token 5 is a row of the model's own vocabulary")
    _refused(patched("past", [v + 2]), cfg, field, f"token {v + 2} is past")
    _refused(patched("twice", [v, v]), cfg, field, "more than once")
    _refused(patched("head", {"lm_head": [v]}), cfg, field, "embed_tokens only")
    _refused(patched("kind", ["x"]), cfg, field, "list of token ids")
    _refused(patched("rows", [v, v + 1]), cfg, "adapter_model.safetensors", "has shape (1, 32)")
    with pytest.raises(AdapterValidationError) as exc:
        read_adapter("tt", src, cfg, 16, torch.float32, False, extra_vocab=EXTRA)
    assert exc.value.field == field  # AdaFuse experts
    _refused(src, cfg, "trainable_token_indices", "extra vocabulary rows", extra=0)
    # With a LoRA on lm_head peft saves the LoRA-wrapped head alone: the embedding's added
    # rows it did not train are not in the file.
    lm = resized_adapter(
        root, llama, "lm", 66, 2, r=2, target_modules=["lm_head"], trainable_token_indices=[v]
    )
    _refused(lm, cfg, "adapter_model.safetensors", "missing tensor", "token_adapter.base_layer")


@pytest.mark.gpu
def test_extra_vocab_rows_on_cuda_match_peft(llama: Path, tmp_path: Path) -> None:
    # On the GPU with graphs on: base and plain steps replay graphs; steps with extra-vocab
    # rows run eagerly (the torch ops of extra_vocab.py, no host sync) beside the Triton
    # kernels; every request still gets peft's greedy tokens.
    root = tmp_path / "adapters"
    kinds = _mixed_root(root, llama)
    refs, vocabs = _refs(llama, root, kinds)
    v = vocabs[None]

    async def go() -> None:
        eng = Engine(
            llama, root, device="cuda", dtype="float32", model_name="fid",
            config=engine_config(
                lora_extra_vocab=EXTRA, lora_saved_modules=ALL, lora_vocab=True,
                use_cuda_graphs=True,
            ),
        )  # fmt: skip
        try:
            jobs = _jobs(kinds, v)
            outs = await asyncio.gather(
                *(collect(eng.submit(request(r, p, n, max_tokens=6))) for r, p, n in jobs)
            )
            for (rid, p, n), events in zip(jobs, outs, strict=True):
                got = tokens(events)
                ref = refs[n]
                want = [int(r.argmax()) for r in ref.logits([*p, *got][:-1], n)[len(p) - 1 :]]
                assert got == want, rid
            for rid, name in (("solo-base", None), ("solo-plain", "plain")):
                await collect(eng.submit(request(rid, PROMPT, name, max_tokens=4)))
            assert eng.describe()["graph_steps"] > 0
        finally:
            await eng.shutdown()

    asyncio.run(go())
