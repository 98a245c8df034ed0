"""The hardening properties over the real tiny engine on CPU: random hostile bodies, the
bodies once answered 500 (a lone surrogate, a 100,000-deep array, a seed of 2^70, lora_path
with NUL, 300 characters or a symlink loop), and a 4 MB prompt refused without stalling the event loop
while another client's small requests keep their latency."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import StartServer
from .strategies import bodies, check_answer
from .threaded import threaded_service

pytestmark = pytest.mark.slow
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("hardening")
    model = make_tiny_model(base / "tiny", max_position_embeddings=256)
    root = base / "adapters"
    root.mkdir()
    make_adapter(root, model, "ok-a", rank=4, target_modules=("q_proj", "v_proj"), seed=1)
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    return model, root


def engine_for(files: tuple[Path, Path]) -> Engine:
    model, root = files
    return Engine(
        model,
        root,
        device="cpu",
        dtype="float32",
        config=EngineConfig(max_num_seqs=4),
        model_name="tiny-base",
    )


@pytest.fixture(scope="module")
def client(model_files: tuple[Path, Path]) -> Iterator[httpx.Client]:
    with (
        threaded_service(lambda: engine_for(model_files)) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        yield c


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"]
)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_real_engine_never_answers_5xx(
    client: httpx.Client, path: str, data: st.DataObject
) -> None:
    r = client.post(path, content=data.draw(bodies(path)), headers=JSON)
    check_answer(path, r)
    assert client.get("/health").status_code == 200


def test_lone_surrogate_is_400(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "\\ud800"}', headers=JSON)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"


def test_100000_deep_array_is_400(client: httpx.Client) -> None:
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "json_too_deep"


def test_seed_of_2_to_the_70_generates(client: httpx.Client) -> None:
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "hello world",
            "max_tokens": 3,
            "seed": 2**70,
            "temperature": 1.0,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
        },
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("lora_path", ["a\x00b", "x" * 300, "loop1", "loop1/adapter_config.json"])
def test_bad_lora_paths_are_4xx_naming_lora_path(client: httpx.Client, lora_path: str) -> None:
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "n1", "lora_path": lora_path})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert client.get("/health").status_code == 200


async def small_requests(client: httpx.AsyncClient, until: asyncio.Task) -> int:
    """How many small requests were answered while ``until`` ran (at least 20 in all)."""
    during = answered = 0
    while not until.done() or answered < 20:
        pending = not until.done()
        r = await client.get("/v1/models")
        assert r.status_code == 200
        answered += 1
        during += pending and not until.done()
        await asyncio.sleep(0.005)  # pacing: a probe every few ms, not a wait for a state
    return during


async def test_4mb_prompt_never_stalls_the_loop(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    server = await start_server(engine_for(model_files))
    prompt = ("The quick brown fox jumps over the lazy dog. " * 100_000)[:4_000_000]
    # Longer than max_model_len * max_token_chars: refused before the tokenizer runs.
    # Small requests are answered, each within the probe client's timeout, while the big one
    # is uploaded, parsed and refused; how much they slow down is bench/bench_http_hardening.py's
    # figure.
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=10) as other,
        httpx.AsyncClient(base_url=server.url, timeout=300) as heavy,
    ):
        big = asyncio.create_task(
            heavy.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        )
        during = await small_requests(other, until=big)
        r = await big
    assert r.status_code == 400, (
        r.text
    )  # longer than any tokenisation could fit: refused untokenised
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert during > 0, "no small request was answered while the 4 MB prompt was handled"


async def test_a_prompt_longer_than_any_tokenisation_is_refused_untokenised(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    engine = engine_for(model_files)
    server = await start_server(engine)
    bound = engine.max_model_len * engine.max_token_chars
    calls: list[int] = []
    real = engine.tokenize

    def counting(text: str) -> list[int]:
        calls.append(len(text))
        return real(text)

    engine.tokenize = counting  # type: ignore[method-assign]
    r = await server.client.post(
        "/v1/completions", json={"prompt": "a" * (bound + 1), "max_tokens": 1}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert calls == []  # refused before the tokenizer ran
    chat = await server.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "b" * (bound + 1)}], "max_tokens": 1},
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages"
    # At the bound the prompt is tokenised as before (and refused only if its tokens overflow).
    r = await server.client.post("/v1/completions", json={"prompt": "hello " * 3, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert calls == [18]
    await engine.shutdown()
