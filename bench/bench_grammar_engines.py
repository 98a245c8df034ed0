"""Grammar engines compared for structured outputs: xgrammar, llguidance and outlines-core.

For every schema of ``tests/data/json_schema_suite.json`` and each engine: whether the engine
accepts the schema (coverage), the time to compile it (cold, no cache), and the time per token
to compute the next-token mask along a random valid path (each step: compute the mask, draw a
uniformly random allowed token, advance). Every finished path is parsed and validated with
``jsonschema`` (an engine whose output does not validate is counted as wrong for that schema).

Two vocabularies: the tiny test tokenizer (384 tokens, byte-level BPE) and a 32k byte-level
BPE trained here on the Python standard library's sources (a real-size vocabulary; no model
download is needed). Writes ``bench/results/grammar_engines_cpu.json``.

    python bench/bench_grammar_engines.py [--out PATH] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import provenance, write_results

from adaptermesh.worker.tokenizer_helpers import is_byte_level, piece_of, special_ids
from adaptermesh_testkit.checkpoints import make_tokenizer

SUITE = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schema_suite.json"


def big_tokenizer(directory: Path, vocab_size: int = 32000) -> Any:
    """A byte-level BPE with ``vocab_size`` tokens trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = directory / "tokenizer.json"
    if not path.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib.glob("*.py"))[:400]
        texts = [f.read_text(errors="ignore") for f in files]
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="</s>", bos_token="<s>")


def tiny_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    make_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


class Engine:
    name = ""

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def walk(self, compiled: Any, rng: random.Random, steps: int) -> tuple[list[int], list[float]]:
        """A random valid path: its tokens and the seconds each mask took."""
        raise NotImplementedError


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = len(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab, stop_token_ids=[tokenizer.eos_token_id]
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.eos = tokenizer.eos_token_id

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def walk(self, compiled: Any, rng: random.Random, steps: int) -> tuple[list[int], list[float]]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        out: list[int] = []
        times: list[float] = []
        for _ in range(steps):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            allowed = allowed_ids(bitmask[0].numpy(), self.vocab)
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            if token == self.eos or matcher.is_terminated():
                break
            out.append(token)
        return out, times


# The character class xgrammar's schema converter gives length-bounded strings, and the one
# RFC 8259 allows unescaped in a string.
_LOOSE_STRING_CLASS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CLASS = '[^\\0-\\x1f\\"\\\\]'


def merge_all_of(node: Any) -> Any:
    """``node`` with every ``allOf`` of object schemas folded into its parent (xgrammar
    ignores ``allOf``)."""
    if isinstance(node, list):
        return [merge_all_of(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: merge_all_of(value) for key, value in node.items() if key != "allOf"}
    for part in (merge_all_of(p) for p in node.get("allOf", [])):
        for key, value in part.items():
            if key == "properties":
                out["properties"] = {**out.get("properties", {}), **value}
            elif key == "required":
                have = list(out.get("required", []))
                out["required"] = have + [name for name in value if name not in have]
            else:
                out.setdefault(key, value)
    return out


def xgrammar_schema_ebnf(schema: dict[str, Any]) -> str:
    import xgrammar as xgr

    text = json.dumps(merge_all_of(schema))
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    return str(grammar).replace(_LOOSE_STRING_CLASS, _JSON_STRING_CLASS)


class XGrammarStrictStrings(XGrammar):
    """xgrammar with the JSON string character class of its schema grammars narrowed to what
    RFC 8259 allows unescaped (no control characters) and ``allOf`` merged: the two fixes
    xgrammar needs to pass the suite."""

    name = "xgrammar+json-strings"

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_grammar(xgrammar_schema_ebnf(schema))


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.vocab = len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        self.eos = tokenizer.eos_token_id

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        # llguidance builds its parser lazily: the matcher and its first mask are the compile.
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        bitmask = self.ll.torch.allocate_token_bitmask(1, self.vocab)
        self.ll.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def walk(self, compiled: Any, rng: random.Random, steps: int) -> tuple[list[int], list[float]]:
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        bitmask = self.ll.torch.allocate_token_bitmask(1, self.vocab)
        out: list[int] = []
        times: list[float] = []
        for _ in range(steps):
            started = time.perf_counter()
            self.ll.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            allowed = allowed_ids(bitmask[0].numpy(), self.vocab)
            token = rng.choice(allowed)
            assert matcher.consume_token(token), matcher.get_error()
            if token == self.eos:
                break
            out.append(token)
            if matcher.is_stopped():
                break
        return out, times


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, tokenizer: Any) -> None:
        import outlines_core

        self.oc = outlines_core
        self.eos = tokenizer.eos_token_id
        self.vocab = len(tokenizer)
        special = special_ids(tokenizer)
        byte_level = is_byte_level(tokenizer)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(self.vocab):
            if token_id in special:
                continue
            raw = piece_of(tokenizer, token_id, byte_level, special)[1]
            by_bytes.setdefault(raw, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(self.eos, by_bytes)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, compiled: Any, rng: random.Random, steps: int) -> tuple[list[int], list[float]]:
        guide = self.oc.Guide(compiled)
        words = (self.vocab + 31) // 32
        mask = torch.zeros(words, dtype=torch.int32)
        out: list[int] = []
        times: list[float] = []
        for _ in range(steps):
            started = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), words, 4)
            times.append(time.perf_counter() - started)
            allowed = allowed_ids(mask.numpy(), self.vocab)
            token = rng.choice(allowed)
            if token == self.eos:
                break
            guide.advance(token)
            out.append(token)
            if guide.is_finished():
                break
        return out, times


def allowed_ids(words: np.ndarray[Any, Any], vocab: int) -> list[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return [int(i) for i in np.flatnonzero(bits)]


def run_engine(
    make: Callable[[], Engine], tokenizer: Any, suite: list[dict[str, Any]], steps: int, seed: int
) -> dict[str, Any]:
    started = time.perf_counter()
    engine = make()
    setup_s = time.perf_counter() - started
    compile_ms: list[float] = []
    mask_us: list[float] = []
    unsupported: dict[str, str] = {}
    invalid: list[str] = []
    unfinished: list[str] = []
    rng = random.Random(seed)
    for entry in suite:
        name, schema = entry["name"], entry["schema"]
        try:
            started = time.perf_counter()
            compiled = engine.compile(schema)
            compile_ms.append(1e3 * (time.perf_counter() - started))
        except Exception as exc:  # an engine that refuses a schema does not cover it
            unsupported[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        try:
            tokens, times = engine.walk(compiled, rng, steps)
        except Exception as exc:
            unsupported[name] = f"walk failed: {type(exc).__name__}: {str(exc)[:160]}"
            continue
        mask_us.extend(1e6 * t for t in times)
        if len(times) >= steps:
            unfinished.append(name)
            continue
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            invalid.append(name)
    covered = len(suite) - len(unsupported)
    return {
        "setup_s": round(setup_s, 3),
        "schemas": len(suite),
        "compiled": covered,
        "valid_paths": covered - len(invalid) - len(unfinished),
        "unsupported": unsupported,
        "invalid_outputs": invalid,
        "unfinished_paths": unfinished,
        "compile_ms_mean": round(statistics.fmean(compile_ms), 3) if compile_ms else None,
        "compile_ms_median": round(statistics.median(compile_ms), 3) if compile_ms else None,
        "compile_ms_p90": round(float(np.percentile(compile_ms, 90)), 3) if compile_ms else None,
        "compile_ms_total": round(sum(compile_ms), 1),
        "mask_us_mean": round(statistics.fmean(mask_us), 2) if mask_us else None,
        "mask_us_median": round(statistics.median(mask_us), 2) if mask_us else None,
        "mask_us_p99": round(float(np.percentile(mask_us, 99)), 2) if mask_us else None,
        "mask_samples": len(mask_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="bench/results/grammar_engines_cpu.json")
    parser.add_argument("--steps", type=int, default=400, help="most tokens of one random path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    suite = json.loads(SUITE.read_text())
    cache = Path(tempfile.gettempdir()) / "adaptermesh-bench-tokenizers"
    cache.mkdir(exist_ok=True)
    (cache / "big").mkdir(exist_ok=True)
    tokenizers = {
        "tiny_384": tiny_tokenizer(cache / "tiny"),
        "bpe_32k": big_tokenizer(cache / "big"),
    }
    results: dict[str, Any] = {}
    for vocab_name, tokenizer in tokenizers.items():
        results[vocab_name] = {}
        for cls in (XGrammar, XGrammarStrictStrings, LLGuidance, OutlinesCore):
            print(f"{vocab_name}: {cls.name}", file=sys.stderr)
            results[vocab_name][cls.name] = run_engine(
                lambda cls=cls, tokenizer=tokenizer: cls(tokenizer),  # type: ignore[misc]
                tokenizer,
                suite,
                args.steps,
                args.seed,
            )
    doc = {
        **provenance(
            "xgrammar", "llguidance", "outlines-core", "torch", "tokenizers", load_start=load_start
        ),
        "suite": str(SUITE.relative_to(SUITE.parents[2])),
        "steps_per_path_max": args.steps,
        "method": (
            "compile: cold, cache off, JSON schema without free whitespace (llguidance: grammar, "
            "matcher and first mask, since it compiles lazily; outlines-core: regex and index); "
            "mask: next-token bitmask along a uniformly random valid path per schema, one thread"
        ),
        "results": results,
    }
    write_results(args.out, doc)


if __name__ == "__main__":
    main()
