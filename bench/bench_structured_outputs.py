"""Structured outputs: validity over the JSON-schema suite, and the decode cost of constraints.

``--device cpu`` (default; writes ``bench/results/structured_outputs_cpu.json``):

  validity    every schema of ``tests/data/json_schema_suite.json`` as one request (all at
              once, one batch) through the engine on the tiny random test model, greedy and
              sampled (temperature 1, seeded): an output counts as valid when it parses, validates
              against its schema (``jsonschema``) and finished ``stop``; one cut by max_tokens
              (``length``) is a failure.
  throughput  the code path of the GPU figure below, on the tiny model: a batch where every
              row has a different JSON schema against the same batch unconstrained (a smoke
              figure; the target is the GPU's).

``--device cuda`` (writes ``bench/results/structured_outputs_h200.json``):

  throughput  batch-64 decode, Llama-2-7B shape with random bf16 weights made on the GPU and a
              32k-token byte-level BPE vocabulary (trained on the standard library's sources, as
              in bench_grammar_engines.py): every row under a different JSON schema against the
              same 64 prompts unconstrained, interleaved runs (the best of each kind), decode
              tok/s over the window where all 64 rows decode; the ratio is the target figure (>= 0.95x on an H200). The
              schemas force outputs longer than max_tokens (fixed-length strings and arrays), so
              every row decodes for the whole window.

    python bench/bench_structured_outputs.py [--device cpu|cuda] [--out PATH] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import provenance, write_results

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.grammar import GrammarSpec
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import make_tiny_model

SUITE_PATH = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schema_suite.json"
SEVEN_B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}


def spec_of(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")


async def collect(stream: Any) -> list[Any]:
    return [event async for event in stream]


async def validity(engine: Engine, suite: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    ids = tuple(engine.tokenize("Answer in JSON:"))
    out: dict[str, Any] = {}
    for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        started = time.perf_counter()
        streams = []
        for i, entry in enumerate(suite):
            grammar = engine.compile_grammar(spec_of(entry["schema"]))
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
            streams.append(
                engine.submit(GenerationRequest(f"{label}-{i}", ids, None, params, grammar=grammar))
            )
        results = await asyncio.gather(*(collect(s) for s in streams))
        elapsed = time.perf_counter() - started
        failures: dict[str, str] = {}
        lengths = []
        for entry, events in zip(suite, results, strict=True):
            text = "".join(e.text for e in events)
            reason = events[-1].finish_reason
            lengths.append(events[-1].completion_tokens)
            try:
                jsonschema.validate(json.loads(text), entry["schema"])
            except (ValueError, jsonschema.ValidationError) as exc:
                failures[entry["name"]] = f"{reason}: {str(exc)[:120]}"
                continue
            if reason != "stop":
                failures[entry["name"]] = f"finish_reason {reason}"
        valid = len(suite) - len(failures)
        out[label] = {
            "schemas": len(suite),
            "valid": valid,
            "validity_rate": round(valid / len(suite), 4),
            "failures": failures,
            "completion_tokens_mean": round(statistics.fmean(lengths), 1),
            "completion_tokens_max": max(lengths),
            "seconds": round(elapsed, 2),
        }
    return out


def long_schemas(rows: int) -> list[dict[str, Any]]:
    """``rows`` different schemas, each forcing an output far longer than the window."""
    schemas: list[dict[str, Any]] = []
    for i in range(rows):
        if i % 3 == 0:
            body: dict[str, Any] = {"type": "string", "minLength": 600 + i, "maxLength": 600 + i}
        elif i % 3 == 1:
            body = {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 300 + i,
                "maxItems": 300 + i,
            }
        else:
            body = {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", f"c{i}"]},
                "minItems": 300 + i,
                "maxItems": 300 + i,
            }
        schemas.append(
            {
                "type": "object",
                "properties": {f"field_{i}": body, "done": {"type": "boolean"}},
                "required": [f"field_{i}", "done"],
                "additionalProperties": False,
            }
        )
    return schemas


async def decode_run(
    engine: Engine,
    prompts: list[tuple[int, ...]],
    grammars: list[Any] | None,
    max_tokens: int,
    tag: str,
) -> dict[str, Any]:
    """Tokens per second over the window where every row decodes (from the last row's first
    token to the first row's last token)."""
    times: list[list[float]] = [[] for _ in prompts]

    async def run(i: int) -> None:
        grammar = None if grammars is None else grammars[i]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        stream = engine.submit(
            GenerationRequest(f"{tag}-{i}", prompts[i], None, params, grammar=grammar)
        )
        async for event in stream:
            if event.token_id is not None or event.finish_reason is not None:
                times[i].append(time.perf_counter())

    await asyncio.gather(*(run(i) for i in range(len(prompts))))
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    tokens = sum(sum(1 for x in t if start < x <= end) for t in times)
    finished = [len(t) for t in times]
    return {
        "tokens_in_window": tokens,
        "window_s": round(end - start, 4),
        "tok_s": round(tokens / (end - start), 1) if end > start else None,
        "tokens_per_row_min": min(finished),
    }


class MaskClock:
    """Times every ``fill_masks`` call the engine's step launcher makes while it is entered
    (the launcher calls the module-level function, so the bench wraps it there)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.wall = 0.0

    def __enter__(self) -> MaskClock:
        from adaptermesh.worker import step_launch

        self._module = step_launch
        self._real = step_launch.fill_masks

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        step_launch.fill_masks = timed  # type: ignore[assignment]
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self._module.fill_masks = self._real  # type: ignore[assignment]


async def throughput(
    engine: Engine, rows: int, prompt_len: int, max_tokens: int, reps: int
) -> dict[str, Any]:
    vocab = len(engine.tokenizer)
    candidates = [
        tuple(
            int(x)
            for x in torch.randint(
                6, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)
            )
        )
        for i in range(4 * rows)
    ]
    # Prompts whose unconstrained greedy output runs the whole window without EOS, so both
    # runs decode every row to the end (random weights stop early now and then).
    prompts: list[tuple[int, ...]] = []
    for start in range(0, len(candidates), rows):
        batch = candidates[start : start + rows]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        streams = [
            engine.submit(GenerationRequest(f"screen{start + i}", p, None, params))
            for i, p in enumerate(batch)
        ]
        for p, events in zip(
            batch, await asyncio.gather(*(collect(s) for s in streams)), strict=True
        ):
            if events[-1].finish_reason == "length" and len(prompts) < rows:
                prompts.append(p)
        if len(prompts) == rows:
            break
    started = time.perf_counter()
    grammars = [engine.compile_grammar(spec_of(s)) for s in long_schemas(rows)]
    compile_s = time.perf_counter() - started
    # Warm-up: graph capture of both variants.
    await decode_run(engine, prompts, None, 8, "warm-plain")
    await decode_run(engine, prompts, grammars, 8, "warm-constrained")
    plain: list[dict[str, Any]] = []
    constrained: list[dict[str, Any]] = []
    for rep in range(reps):
        plain.append(await decode_run(engine, prompts, None, max_tokens, f"plain{rep}"))
        with MaskClock() as clock:
            run = await decode_run(engine, prompts, grammars, max_tokens, f"json{rep}")
        # The host time llguidance spent filling the rows' masks during the run, against the
        # run's wall time: the mask's share of a step (on the step's critical path only where
        # the step waits for it).
        run["mask_fill_calls"] = clock.calls
        run["mask_fill_ms_per_call"] = (
            round(1e3 * clock.seconds / clock.calls, 4) if clock.calls else None
        )
        run["mask_fill_share_of_wall"] = (
            round(clock.seconds / clock.wall, 4) if clock.wall else None
        )
        constrained.append(run)
    # The best of interleaved runs: the least disturbed by other load on the machine.
    plain_tps = max(r["tok_s"] for r in plain)
    json_tps = max(r["tok_s"] for r in constrained)
    return {
        "rows": len(prompts),
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "distinct_schemas": rows,
        "schema_compile_s_total": round(compile_s, 3),
        "unconstrained_runs": plain,
        "constrained_runs": constrained,
        "unconstrained_tok_s_best": plain_tps,
        "constrained_tok_s_best": json_tps,
        "ratio_constrained_vs_unconstrained": round(json_tps / plain_tps, 4),
        "mask_fill_share_of_wall_median": statistics.median(
            r["mask_fill_share_of_wall"]
            for r in constrained
            if r["mask_fill_share_of_wall"] is not None
        )
        if any(r["mask_fill_share_of_wall"] is not None for r in constrained)
        else None,
        "describe": {
            k: v
            for k, v in engine.describe().items()
            if k in ("graph_steps", "eager_steps", "cuda_graphs", "async_scheduling")
        },
    }


def seven_b_model(directory: Path) -> Path:
    from bench_grammar_engines import big_tokenizer  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast

    from adaptermesh_testkit.checkpoints import CHAT_TEMPLATE, make_model_config

    directory.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.gettempdir()) / "adaptermesh-bench-tokenizers" / "big"
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer: PreTrainedTokenizerFast = big_tokenizer(cache, SEVEN_B["vocab_size"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    config = make_model_config(
        "llama",
        vocab_size=SEVEN_B["vocab_size"],
        hidden_size=SEVEN_B["hidden_size"],
        intermediate_size=SEVEN_B["intermediate_size"],
        num_hidden_layers=SEVEN_B["num_hidden_layers"],
        num_attention_heads=SEVEN_B["num_attention_heads"],
        num_key_value_heads=SEVEN_B["num_key_value_heads"],
        max_position_embeddings=4096,
        eos_token_id=int(tokenizer.eos_token_id),
        bos_token_id=int(tokenizer.bos_token_id),
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    suite = json.loads(SUITE_PATH.read_text())
    work = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    adapters = work / "adapters"
    adapters.mkdir()
    result: dict[str, Any] = {}
    if args.device == "cpu":
        model = make_tiny_model(work / "tiny", max_position_embeddings=1024)
        engine = Engine(
            model, adapters, config=EngineConfig(max_num_seqs=64, max_loras=1), model_name="tiny"
        )
        try:
            result["model"] = (
                "tiny random Llama (tests' checkpoint: 2 layers, hidden 64, vocab 384)"
            )
            result["validity"] = await validity(engine, suite, args.max_tokens)
            result["throughput_cpu_smoke"] = await throughput(
                engine, args.rows, 16, args.decode_tokens, args.reps
            )
        finally:
            await engine.shutdown()
        return result
    import bench_engine  # type: ignore[import-not-found]

    model = seven_b_model(work / "model")
    engine = Engine(
        model,
        adapters,
        device="cuda",
        dtype="bfloat16",
        config=EngineConfig(
            max_num_seqs=args.rows,
            max_loras=1,
            max_model_len=2048,
            kv_cache_bytes=24 << 30,
            use_cuda_graphs=True,
        ),
        model_name="llama-7b-shape",
        weights=bench_engine.random_weights(SEVEN_B, "cuda", torch.bfloat16),
    )
    try:
        result["model"] = "Llama-2-7B shape, random bf16 weights, 32k byte-level BPE vocabulary"
        result["gpu"] = torch.cuda.get_device_name(0)
        result["throughput"] = await throughput(
            engine, args.rows, args.prompt_tokens, args.decode_tokens, args.reps
        )
    finally:
        await engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-tokens", type=int, default=400, help="validity runs' cap")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cpu" and args.decode_tokens == 128:
        args.decode_tokens = 48
    out = (
        args.out
        or f"bench/results/structured_outputs_{'cpu' if args.device == 'cpu' else 'h200'}.json"
    )
    load_start = os.getloadavg()[0]
    result = asyncio.run(main_async(args))
    doc = {
        **provenance("torch", "llguidance", "transformers", load_start=load_start),
        "suite": str(SUITE_PATH.relative_to(SUITE_PATH.parents[2])),
        "max_tokens": args.max_tokens,
        **result,
    }
    write_results(out, doc)


if __name__ == "__main__":
    main()
