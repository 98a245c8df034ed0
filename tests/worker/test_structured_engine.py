"""Grammar-constrained decoding in the engine on CPU, with the tiny random Llama.

Every output of the JSON-schema suite parses and validates (greedy and sampled) and finishes
``stop``; constrained rows batch with unconstrained rows and other adapters without changing
the unconstrained rows' tokens; n > 1, logprobs and stop strings respect the mask; the packed
bitmask is applied exactly; random schemas and random token walks never leave the grammar.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from adaptermesh.worker.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    apply_bitmask,
    bitmask_words,
    choice_grammar,
)
from adaptermesh.worker.types import GenerationRequest, SamplingParams, TokenEvent

from .conftest import Tiny, collect, request, tokens

SUITE = json.loads((Path(__file__).parents[1] / "data" / "json_schema_suite.json").read_text())
PROMPT = "Answer in JSON:"


def schema(value: Any) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(value), "response_format.json_schema.schema")


def constrained(
    rid: str, ids: tuple[int, ...], grammar: Any, adapter: str | None = None, **sampling: Any
) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 160, **sampling})
    return GenerationRequest(rid, ids, adapter, params, grammar=grammar)


def text_of(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


@pytest.fixture(scope="module")
def compiler(tiny: Tiny) -> GrammarCompiler:
    return GrammarCompiler(tiny.tokenizer, len(tiny.tokenizer), [tiny.tokenizer.eos_token_id])


def test_suite_has_the_schema_kinds_the_target_names() -> None:
    text = json.dumps(SUITE)
    assert len(SUITE) >= 50
    for keyword in ('"$ref"', '"$defs"', '"anyOf"', '"enum"', '"minItems"', '"maxItems"'):
        assert keyword in text
    for keyword in ('"minimum"', '"maximum"', '"pattern"', '"maxLength"', '"required"'):
        assert keyword in text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_every_suite_output_validates(make_engine: Any, temperature: float) -> None:
    engine = make_engine(max_num_seqs=64)
    ids = tuple(engine.tokenize(PROMPT))
    streams = []
    for i, entry in enumerate(SUITE):
        grammar = engine.compile_grammar(schema(entry["schema"]))
        streams.append(
            engine.submit(
                constrained(f"s{i}", ids, grammar, temperature=temperature, seed=i, max_tokens=200)
            )
        )
    results = await asyncio.gather(*(collect(s) for s in streams))
    failures = []
    for entry, events in zip(SUITE, results, strict=True):
        text = text_of(events)
        try:
            jsonschema.validate(json.loads(text), entry["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((entry["name"], text, str(exc)[:80]))
        if events[-1].finish_reason != "stop":
            failures.append((entry["name"], text, events[-1].finish_reason))
    assert failures == []


async def test_unconstrained_rows_keep_their_tokens_beside_constrained_rows(
    make_engine: Any, tiny: Tiny
) -> None:
    """Greedy, three adapters and the base: the unconstrained rows of a mixed batch get the
    tokens they get alone."""
    engine = make_engine(max_num_seqs=16)
    prompts = [tiny.encode(p) for p in ("Hello world", "The quick brown fox", "A service mesh")]
    plain = [
        request(f"p{i}", ids, adapter, max_tokens=12)
        for i, (ids, adapter) in enumerate(zip(prompts, (None, "alpha", "beta"), strict=True))
    ]
    alone = [tokens(await collect(engine.submit(r))) for r in plain]
    grammars = [engine.compile_grammar(schema(SUITE[k]["schema"])) for k in (0, 3, 16)]
    mixed_streams = [engine.submit(r) for r in plain]
    extra = [
        engine.submit(constrained(f"c{i}", prompts[i % 3], g, adapter))
        for i, (g, adapter) in enumerate(zip(grammars, ("gamma", None, "alpha"), strict=True))
    ]
    mixed = [tokens(await collect(s)) for s in mixed_streams]
    constrained_out = [text_of(await collect(s)) for s in extra]
    assert mixed == alone
    for k, text in zip((0, 3, 16), constrained_out, strict=True):
        jsonschema.validate(json.loads(text), SUITE[k]["schema"])


async def test_overlapped_scheduling_gives_the_same_outputs(make_engine: Any, tiny: Tiny) -> None:
    """With overlapped scheduling, a masked step's forward is launched before the previous
    step's tokens are applied and its masks follow: greedy outputs, constrained and not, are
    those of the engine that runs every step to the end first."""

    async def run(engine: Any) -> list[list[int]]:
        ids = tiny.encode("Hello world")
        streams = [
            engine.submit(request(f"u{i}", ids, a, max_tokens=10))
            for i, a in enumerate((None, "alpha"))
        ]
        for k in range(0, len(SUITE), 4):
            grammar = engine.compile_grammar(schema(SUITE[k]["schema"]))
            streams.append(
                engine.submit(constrained(f"c{k}", ids, grammar, "beta" if k % 8 else None))
            )
        return [tokens(await collect(s)) for s in streams]

    overlapped = make_engine(max_num_seqs=32, async_scheduling=True)
    serial = make_engine(max_num_seqs=32, async_scheduling=False)
    assert overlapped._overlap
    assert not serial._overlap
    assert await run(overlapped) == await run(serial)


async def test_grammar_end_finishes_the_row_with_stop(make_engine: Any, tiny: Tiny) -> None:
    engine = make_engine()
    choices = ["alpha beta", "gamma", "delta"]
    grammar = engine.compile_grammar(GrammarSpec("choice", json.dumps(choices), "guided_choice"))
    events = await collect(
        engine.submit(constrained("c", tiny.encode("Hello"), grammar, max_tokens=50))
    )
    assert text_of(events) in choices
    assert events[-1].finish_reason == "stop"
    # No step is spent on a stop token: every output token is part of the text.
    assert tiny.tokenizer.decode(tokens(events)) == text_of(events)


async def test_cut_by_max_tokens_reports_length(make_engine: Any, tiny: Tiny) -> None:
    engine = make_engine()
    grammar = engine.compile_grammar(GrammarSpec("regex", "[a-z]{40}", "guided_regex"))
    events = await collect(
        engine.submit(constrained("r", tiny.encode("Hello"), grammar, max_tokens=5))
    )
    assert events[-1].finish_reason == "length"
    assert events[-1].completion_tokens == 5


async def test_n_choices_logprobs_and_stop_strings_respect_the_mask(
    make_engine: Any, tiny: Tiny
) -> None:
    engine = make_engine()
    grammar = engine.compile_grammar(GrammarSpec("regex", "(ab|cd|ef)+x", "guided_regex"))
    streams = [
        engine.submit(
            constrained(f"n{i}", tiny.encode("Hello"), grammar, temperature=1.0, seed=i, logprobs=5)
        )
        for i in range(4)
    ]
    for events in await asyncio.gather(*(collect(s) for s in streams)):
        text = text_of(events)
        assert events[-1].finish_reason in ("stop", "length")
        if events[-1].finish_reason == "stop":
            assert re.fullmatch("(ab|cd|ef)+x", text)
        entries = [entry for event in events for entry in event.logprobs]
        assert entries
        for entry in entries:
            # The sampled token was allowed: its probability under the mask is not 0.
            assert entry.logprob > -math.inf
        # The first token's alternatives: every one with a chance starts a match.
        first = entries[0]
        assert all(alt.token[:1] in "ace" for alt in first.top if alt.logprob > -math.inf)
    # A stop string still cuts a constrained output.
    grammar = engine.compile_grammar(GrammarSpec("regex", "ab(cd)+", "guided_regex"))
    events = await collect(
        engine.submit(constrained("s", tiny.encode("Hello"), grammar, stop=("cd",), max_tokens=20))
    )
    assert text_of(events) == "ab"
    assert events[-1].finish_reason == "stop"


def test_apply_bitmask_masks_exactly_the_cleared_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 100, 384):
        words = bitmask_words(vocab)
        bits = torch.randint(0, 2, (5, words * 32), generator=gen, dtype=torch.int64)
        weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
        packed = (bits.view(5, words, 32) * weights).sum(-1)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
        logits = torch.randn(7, vocab, generator=gen)
        expected = logits.clone()
        expected[:5][bits[:, :vocab] == 0] = -torch.inf
        apply_bitmask(logits, packed)
        assert torch.equal(logits, expected)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(choices=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
# Characters JSON leaves raw that are not printable: DEL, C1, separators, format, astral.
@example(choices=["\x7f", "\x85", "a\u2028b", "\u200b\ufeff", "\U000e0001", '"q"\\'])
def test_any_choices_compile_to_exactly_themselves(
    compiler: GrammarCompiler, tiny: Tiny, choices: list[str]
) -> None:
    assert choice_grammar(choices).startswith("start: ")
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(choices), "guided_choice"))
    for choice in choices:
        matcher = grammar.matcher()
        # A choice that spells a special token ("<s>") is text: its characters, not the token.
        ids = tiny.tokenizer(choice, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
        assert all(matcher.advance(t) for t in ids)
        assert matcher.allows(tiny.tokenizer.eos_token_id)


def test_invalid_constraints_name_their_field(compiler: GrammarCompiler) -> None:
    cases = [
        GrammarSpec("regex", "((", "guided_regex"),
        GrammarSpec("grammar", "root ::= (", "structured_outputs.grammar"),
        GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "(("}), "x.schema"),
    ]
    for spec in cases:
        with pytest.raises(GrammarError) as info:
            compiler.compile(spec)
        assert info.value.param == spec.param
        assert "[" not in info.value.message.split(":")[0]


# -------------------------------------------------------------------------- properties
_LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 500),
    ),
    st.builds(
        lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.lists(
        st.sampled_from(["a", "b", "on", 1, 2.5, True, None]), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
    st.sampled_from(["^[0-9]{2,4}$", "^[a-c]{1,3}-[xy]$"]).map(
        lambda p: {"type": "string", "pattern": p}
    ),
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def build(props: dict[str, Any], required: list[bool]) -> dict[str, Any]:
        names = sorted(props)
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(names, required, strict=False) if r],
            "additionalProperties": False,
        }

    return st.builds(
        build,
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=4, max_size=4),
    )


SCHEMAS = st.recursive(
    _LEAF,
    lambda children: st.one_of(
        _object(children),
        st.builds(
            lambda items, lo, span: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + span,
            },
            children,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=SCHEMAS, draws=st.lists(st.integers(0, 1 << 30), min_size=400, max_size=400))
def test_random_walks_under_the_mask_stay_valid(
    compiler: GrammarCompiler, tiny: Tiny, value: dict[str, Any], draws: list[int]
) -> None:
    """Any path of allowed tokens is accepted token by token, and once the grammar is
    complete the text validates; a disallowed token is never one the grammar accepts."""
    jsonschema.Draft202012Validator.check_schema(value)
    grammar = compiler.compile(schema(value))
    matcher = grammar.matcher()
    probe = grammar.matcher()
    out: list[int] = []
    vocab = len(tiny.tokenizer)
    for draw in draws:
        if matcher.only_stop_left:
            break
        allowed = [t for t in range(vocab) if matcher.allows(t)]
        assert allowed
        token = allowed[draw % len(allowed)]
        refused = [t for t in range(vocab) if not matcher.allows(t)]
        if refused:
            # A twin in the same state refuses a token the mask refuses.
            assert not probe.advance(refused[draw % len(refused)])
            probe = grammar.matcher()
            for t in out:
                assert probe.advance(t)
        assert matcher.advance(token)
        assert probe.advance(token)
        if token == tiny.tokenizer.eos_token_id:
            break
        out.append(token)
    else:
        assume(False)  # a walk that did not finish in 400 tokens proves nothing either way
    jsonschema.validate(json.loads(tiny.tokenizer.decode(out)), value)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    constrained_rows=st.lists(st.booleans(), min_size=4, max_size=4),
    picks=st.lists(st.integers(0, len(SUITE) - 1), min_size=4, max_size=4),
)
def test_mixed_batches_leave_unconstrained_rows_alone(
    tiny: Tiny, constrained_rows: list[bool], picks: list[int]
) -> None:
    from adaptermesh.worker.engine import Engine, EngineConfig

    async def run() -> None:
        engine = Engine(
            tiny.model_dir,
            tiny.root,
            config=EngineConfig(max_num_seqs=8, max_loras=4),
            model_name="t",
        )
        try:
            prompts = [tiny.encode(p) for p in ("Hello", "The quick", "A mesh", "GPU")]
            adapters = [None, "alpha", "beta", None]
            reference = [
                tokens(await collect(engine.submit(request(f"r{i}", p, a, max_tokens=8))))
                for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
            ]
            streams = []
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
                if constrained_rows[i]:
                    g = engine.compile_grammar(schema(SUITE[picks[i]]["schema"]))
                    streams.append(engine.submit(constrained(f"m{i}", p, g, a)))
                else:
                    streams.append(engine.submit(request(f"m{i}", p, a, max_tokens=8)))
            results = await asyncio.gather(*(collect(s) for s in streams))
            for i, events in enumerate(results):
                if constrained_rows[i]:
                    # A random model can write a number's digits (or an open object's keys)
                    # until max_tokens: such a row is cut ("length"), not wrong. A finished row
                    # validates; the property here is that the unconstrained rows are untouched.
                    if events[-1].finish_reason == "stop":
                        jsonschema.validate(json.loads(text_of(events)), SUITE[picks[i]]["schema"])
                    else:
                        assert events[-1].finish_reason == "length"
                else:
                    assert tokens(events) == reference[i]
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_closed_objects_only_closes_object_schemas() -> None:
    from adaptermesh.worker.grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"d": {"anyOf": [{"properties": {"y": {}}}, {"type": "string"}]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "open"}
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["anyOf"][1] == {"type": "string"}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_masked_steps_in_graphs_and_eager(tiny: Tiny, graphs: bool) -> None:
    """On a GPU: constrained rows batched with unconstrained ones, in the masked graph variant
    (and eagerly): every constrained output validates, the unconstrained rows keep their
    tokens, logprobs ride along, and masked steps replay graphs."""
    from adaptermesh.worker.engine import Engine, EngineConfig

    async def run() -> None:
        config = EngineConfig(max_num_seqs=16, max_loras=4, use_cuda_graphs=graphs)
        engine = Engine(
            tiny.model_dir, tiny.root, device="cuda", dtype="float32", config=config, model_name="t"
        )
        try:
            prompts = [tiny.encode(p) for p in ("Hello", "The quick", "A mesh", "GPU")]
            adapters = [None, "alpha", "beta", "gamma"]
            reference = [
                tokens(await collect(engine.submit(request(f"r{i}", p, a, max_tokens=12))))
                for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
            ]
            # Every fifth schema, closed ones only: allOf's parts stay open (any extra key), and a
            # random model may spell an extra key until max_tokens; the CPU suite covers them.
            picks = [k for k in range(0, len(SUITE), 5) if "allOf" not in json.dumps(SUITE[k])]
            plain = [
                engine.submit(request(f"p{i}", p, a, max_tokens=12))
                for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
            ]
            shaped = [
                engine.submit(
                    constrained(
                        f"c{k}",
                        prompts[k % 4],
                        engine.compile_grammar(schema(SUITE[k]["schema"])),
                        adapters[k % 4],
                        temperature=float(k % 2),
                        seed=k,
                        logprobs=2,
                    )
                )
                for k in picks
            ]
            assert [tokens(await collect(s)) for s in plain] == reference
            for k, stream in zip(picks, shaped, strict=True):
                events = await collect(stream)
                text = text_of(events)
                assert events[-1].finish_reason == "stop", (SUITE[k]["name"], text)
                jsonschema.validate(json.loads(text), SUITE[k]["schema"])
            if graphs:
                assert engine.launcher.graph_runner.replays > 0
                assert any(key[-1] for key in engine.launcher.graph_runner.graphs)
        finally:
            await engine.shutdown()

    asyncio.run(run())


def sentencepiece_tokenizer(directory: Path) -> Any:
    """A Llama-2/Mistral-style tokenizer: SentencePiece-like BPE over '▁'-marked words with
    byte fallback (<0x00>..<0xFF> tokens for anything outside its vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials + byte_tokens,
        initial_alphabet=list('{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz'),
        show_progress=False,
    )
    tok.train_from_iterator(
        ['{"name": "Ada", "age": 36, "tags": ["x", "y"]} true false null'] * 20, trainer=trainer
    )
    directory.mkdir(parents=True, exist_ok=True)
    # The byte tokens are plain vocabulary entries in Llama 2's and Mistral's tokenizers, not
    # added (special) tokens as the trainer leaves them.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pick=st.sampled_from(["nested_two", "enum_mixed", "person", "string_min_max", "ref_defs"]),
    draws=st.lists(st.integers(0, 1 << 30), min_size=300, max_size=300),
)
def test_byte_fallback_vocabularies_walk_to_valid_json(
    tmp_path_factory: pytest.TempPathFactory, pick: str, draws: list[int]
) -> None:
    """A SentencePiece-style vocabulary with byte fallback (Llama 2, Mistral): random
    allowed paths, non-ASCII text included, decode to valid JSON."""
    tokenizer = _SP_CACHE.get("tok")
    if tokenizer is None:
        tokenizer = _SP_CACHE["tok"] = sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 7, [tokenizer.eos_token_id])
    entry = next(e for e in SUITE if e["name"] == pick)
    value = dict(entry["schema"])
    if pick == "enum_mixed":
        value = {"enum": ["héllo", "日本", "∑x", 3]}
    matcher = compiler.compile(schema(value)).matcher()
    out: list[int] = []
    vocab = len(tokenizer) + 7
    for draw in draws:
        if matcher.only_stop_left:
            break
        allowed = [t for t in range(vocab) if matcher.allows(t)]
        # Padding rows past the tokenizer are never allowed.
        assert all(t < len(tokenizer) for t in allowed)
        token = allowed[draw % len(allowed)]
        assert matcher.advance(token)
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
    else:
        assume(False)
    jsonschema.validate(json.loads(tokenizer.decode(out)), value)


_SP_CACHE: dict[str, Any] = {}
