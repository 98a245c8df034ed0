"""``merged_adapters`` over HTTP with the real engine on CPU: a merged request gets exactly the
engine's greedy output for the merged adapter; bad values get a 400 naming the sub-field, an
unknown part a 404, more parts than the limit a 400 naming ``merged_adapters.ids``, and the
worker keeps serving with nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.merge_spec import parse_merge_spec
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import StartServer
from .test_engine_integration import direct_greedy

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("merged-http")
    model = make_tiny_model(base / "tiny")
    root = base / "adapters"
    root.mkdir()
    for i, targets in enumerate((("q_proj", "v_proj"), ("q_proj", "o_proj"), ("v_proj",))):
        make_adapter(root, model, f"m{i}", rank=4, target_modules=targets, seed=10 + i)
    make_adapter(root, model, "r8", rank=8, target_modules=("q_proj",), seed=20)
    return model, root


def _engine(files: tuple[Path, Path]) -> Engine:
    model, root = files
    return Engine(
        model,
        root,
        device="cpu",
        dtype="float32",
        config=EngineConfig(max_num_seqs=4, max_loras=2),
        model_name="tiny",
    )


async def _post(s: Any, body: dict[str, Any]) -> Any:
    return await s.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body},
        headers={"authorization": "Bearer tenant-a"},
    )


async def test_merged_request_gets_the_merged_adapters_output(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    engine = _engine(model_files)
    s = await start_server(engine)
    merge = {"ids": ["m0", "m1", "m2"], "weights": [0.6, 0.9, -0.5], "merge_strategy": "ties",
             "density": 0.5}  # fmt: skip
    r = await _post(s, {"merged_adapters": merge})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    name = await engine.adapters.merged(parse_merge_spec(merge))
    assert engine.adapters.counters.merges == 1  # built by the request, not again here
    expected, _, _ = await direct_greedy(engine, engine.tokenize(PROMPT), name, 12)
    assert r.json()["choices"][0]["text"] == expected
    plain, _, _ = await direct_greedy(engine, engine.tokenize(PROMPT), "m0", 12)
    base, _, _ = await direct_greedy(engine, engine.tokenize(PROMPT), None, 12)
    assert expected not in (plain, base)
    chat = await s.client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
              "merged_adapters": merge},
        headers={"authorization": "Bearer tenant-a"},
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert engine.adapters.counters.merges == 1


@pytest.mark.parametrize(
    ("merge", "status", "param"),
    [
        ({"ids": ["m0", "nope"]}, 404, "merged_adapters.ids"),
        ({"ids": ["m0", "r8"], "merge_strategy": "ties", "density": 0.5}, 400, "merged_adapters.ids"),
        ({"ids": [f"m{i}" for i in range(9)]}, 400, "merged_adapters.ids"),
        ({"ids": ["m0", "m1"], "weights": [1.0]}, 400, "merged_adapters.weights"),
        ({"ids": ["m0", "m1"], "merge_strategy": "svd"}, 400, "merged_adapters.merge_strategy"),
        ({"ids": ["m0", "m1"], "density": 2}, 400, "merged_adapters.density"),
        ({"ids": ["m0", "m1"], "majority_sign_method": "most"}, 400,
         "merged_adapters.majority_sign_method"),
        ({"ids": ["m0", "m0"]}, 400, "merged_adapters.ids[1]"),
        ({"ids": ["m0"], "extra": 1}, 400, "merged_adapters.extra"),
        ({"ids": ["../m0"]}, 400, None),
        ("m0,m1", 400, "merged_adapters"),
    ],
)  # fmt: skip
async def test_bad_merges_get_their_status_and_change_nothing(
    model_files: tuple[Path, Path],
    start_server: StartServer,
    merge: Any,
    status: int,
    param: str | None,
) -> None:
    engine = _engine(model_files)
    s = await start_server(engine)
    before = set(engine.adapters.registered)
    r = await _post(s, {"merged_adapters": merge})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"]
    assert set(engine.adapters.registered) == before
    assert engine.adapters.counters.merges == 0
    ok = await _post(s, {"model": "m1"})
    assert ok.status_code == 200, ok.text


async def test_merge_names_the_base_model_and_respects_the_workers_limit(
    model_files: tuple[Path, Path], start_server: StartServer
) -> None:
    engine = _engine(model_files)
    engine.adapters.max_merge_parts = 2
    s = await start_server(engine)
    r = await _post(s, {"merged_adapters": {"ids": ["m0", "m1", "m2"]}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "merged_adapters.ids"
    assert "at most 2" in r.json()["error"]["message"]
    r = await _post(s, {"model": "m0", "merged_adapters": {"ids": ["m1", "m2"]}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"
    r = await _post(s, {"merged_adapters": {"ids": ["m1", "m2"]}})
    assert r.status_code == 200, r.text
