"""``logit_bias``, ``suffix`` (fill-in-the-middle) and ``best_of`` through the service around the
real engine, with the tiny random Llama on CPU (the engine-level batch checks, CUDA included,
are tests/worker/test_logit_bias.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import FIM_TOKENS, make_tiny_model

from .conftest import StartServer

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("openai-params")
    plain = make_tiny_model(base / "plain", max_position_embeddings=512)
    fim = make_tiny_model(base / "fim", max_position_embeddings=512, fim_tokens=True)
    root = base / "adapters"
    root.mkdir()
    return plain, fim, root


def engine_of(model: Path, root: Path, device: str = "cpu", **config: Any) -> Engine:
    return Engine(
        model,
        root,
        device=device,
        dtype="float32",
        config=EngineConfig(**config),
        model_name="tiny",
    )


async def generate(engine: Engine, prompt: list[int], **sampling: Any) -> list[int]:
    stream = engine.submit(
        GenerationRequest("direct", tuple(prompt), None, SamplingParams(**sampling))
    )
    return [event.token_id async for event in stream if event.token_id is not None]


async def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(
    model_dirs: tuple[Path, Path, Path], start_server: StartServer
) -> None:
    plain, _, root = model_dirs
    engine = engine_of(plain, root, max_num_seqs=4)
    server = await start_server(engine)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    prompt = engine.tokenize(PROMPT)
    plain_ids = await generate(engine, prompt, max_tokens=8)
    target = next(t for t in range(10, 300) if t not in plain_ids)
    # +100 on one token: greedy decoding outputs only it.
    forced = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(target): 100}
    )
    assert forced.choices[0].text == engine.detokenize([target] * 6)
    # So does sampling (the bias dwarfs every other logit), in chat too.
    sampled = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logit_bias={str(target): 100},
    )
    assert sampled.choices[0].message.content == engine.detokenize([target] * 5)
    # -100 on every token greedy decoding chose: none of them comes back.
    banned = {str(t): -100 for t in set(plain_ids)}
    avoided = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias=banned
    )
    avoided_ids = engine.tokenize(avoided.choices[0].text)[1:]  # without the BOS
    assert avoided.choices[0].text != engine.detokenize(plain_ids)
    assert not set(avoided_ids) & set(plain_ids)
    # A zero bias changes nothing.
    same = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias={"5": 0}
    )
    assert same.choices[0].text == engine.detokenize(plain_ids)
    await engine.shutdown()


async def test_logprobs_are_the_raw_distribution_before_the_bias(
    model_dirs: tuple[Path, Path, Path],
) -> None:
    plain, _, root = model_dirs
    engine = engine_of(plain, root)
    prompt = engine.tokenize(PROMPT)
    target = 77

    async def first_logprob(**sampling: Any) -> float:
        stream = engine.submit(
            GenerationRequest("lp", tuple(prompt), None, SamplingParams(max_tokens=1, **sampling))
        )
        entries = [lp async for event in stream for lp in event.logprobs]
        assert entries[0].token_id == target
        return entries[0].logprob

    # The raw logprob of the token the bias forced: what the model gives it, not ~0.
    raw = await first_logprob(logprobs=0, logit_bias=((target, 100.0),))
    with torch.no_grad():
        logits = engine_reference_logits(engine, prompt)
    expected = torch.log_softmax(logits, dim=-1)[target].item()
    assert raw == pytest.approx(expected, abs=1e-4)
    assert raw < -0.5
    await engine.shutdown()


def engine_reference_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(engine.model_dir))
    return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


async def test_suffix_builds_the_fill_in_the_middle_prompt(
    model_dirs: tuple[Path, Path, Path], start_server: StartServer
) -> None:
    plain, fim, root = model_dirs
    engine = engine_of(fim, root)
    server = await start_server(engine)
    vocab = engine.tokenizer.get_vocab()
    start, hole, middle = (vocab[name] for name in FIM_TOKENS)
    prefix, suffix = "def add(a, b):", "return a + b"
    plain_ids = engine.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    suffix_ids = engine.tokenizer(suffix, add_special_tokens=False)["input_ids"]
    bos = engine.tokenizer.bos_token_id
    expected_prompt = [bos, start, *plain_ids, hole, *suffix_ids, middle]
    assert engine.fill_in_middle(prefix, suffix) == expected_prompt
    want = engine.detokenize(await generate(engine, expected_prompt, max_tokens=8))
    r = await server.client.post(
        "/v1/completions",
        json={"prompt": prefix, "suffix": suffix, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    # Token-id prompts are the prefix as sent.
    r = await server.client.post(
        "/v1/completions",
        json={"prompt": plain_ids, "suffix": suffix, "max_tokens": 8, "temperature": 0},
    )
    assert r.json()["usage"]["prompt_tokens"] == len(expected_prompt) - 1
    await engine.shutdown()
    # The plain tokenizer has no FIM tokens: 400 naming suffix.
    other = engine_of(plain, root)
    assert other.fill_in_middle(prefix, suffix) is None
    server = await start_server(other)
    r = await server.client.post("/v1/completions", json={"prompt": prefix, "suffix": suffix})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "suffix")
    await other.shutdown()


async def test_best_of_answers_the_candidates_with_the_highest_cumulative_logprob(
    model_dirs: tuple[Path, Path, Path], start_server: StartServer
) -> None:
    plain, _, root = model_dirs
    engine = engine_of(plain, root, max_num_seqs=8)
    server = await start_server(engine)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    # Candidate i of a seeded request samples with seed + i, as choice i of n does: n = 4
    # with logprobs shows every candidate and its cumulative logprob.
    every = await server.client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0})
    candidates = every.json()["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    assert len({c["text"] for c in candidates}) > 1, "the candidates should differ"
    ranked = sorted(range(4), key=lambda i: -scores[i])
    r = await server.client.post("/v1/completions", json={**body, "n": 2, "best_of": 4})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["text"] for c in answer["choices"]] == [candidates[i]["text"] for i in ranked[:2]]
    assert all(c["logprobs"] is None for c in answer["choices"])
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"] == every.json()["usage"]
    await engine.shutdown()


async def test_logit_bias_applies_inside_a_grammar(
    model_dirs: tuple[Path, Path, Path], start_server: StartServer
) -> None:
    """A grammar-masked step adds the row's bias too: the grammar still decides what is allowed,
    the bias decides among it (and a biased token the grammar refuses stays refused)."""
    plain, _, root = model_dirs
    engine = engine_of(plain, root, max_num_seqs=4)
    server = await start_server(engine)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    choices = ["yes", "no"]
    first = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    chosen = first.choices[0].text
    assert chosen in choices
    other = choices[1 - choices.index(chosen)]
    specials = set(engine.tokenize(""))
    favoured = {str(t): 100 for t in engine.tokenize(other) if t not in specials}
    # Tokens outside both choices get +100 as well: the grammar refuses them all the same.
    either = set(engine.tokenize(chosen)) | set(engine.tokenize(other))
    refused = {str(t): 100 for t in range(3, 40) if t not in either}
    biased = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logit_bias={**refused, **favoured},
        extra_body={"guided_choice": choices},
    )
    assert biased.choices[0].text == other
    assert biased.choices[0].finish_reason == "stop"
