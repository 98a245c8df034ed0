"""vLLM parity: ``--lora-modules``, ``/v1/models``, the load/unload shapes and vLLM's series."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest

from adaptermesh.worker.cli import (
    LoraModule,
    build_parser,
    load_lora_modules,
    parse_lora_module,
    run_worker,
)
from adaptermesh.worker.service import ServiceConfig
from adaptermesh.worker.types import AdapterInfo
from adaptermesh.worker_scrape import parse_metrics

from .conftest import Server, StartServer
from .fakes import FakeEngine
from .test_metrics import scrape, value


class PinningEngine(FakeEngine):
    """The fake engine with the real engine's ``pinned`` argument."""

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterInfo:
        info = await super().load_adapter(name, path)
        info = AdapterInfo(info.name, info.path, info.rank, True, pinned)
        self.adapters[name] = info
        return info


# ------------------------------------------------------------------------------ --lora-modules
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=ok/sql", LoraModule("sql", "ok/sql")),
        ("a=b=c", LoraModule("a", "b=c")),
        ('{"name": "sql", "path": "ok/sql"}', LoraModule("sql", "ok/sql")),
        (
            '{"name": "sql", "path": "ok/sql", "base_model_name": "tiny-base"}',
            LoraModule("sql", "ok/sql", "tiny-base"),
        ),
    ],
)
def test_lora_module_forms(text: str, expected: LoraModule) -> None:
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "sql",
        "=path",
        "sql=",
        "{",
        "[1]",
        '{"name": "x"}',
        '{"path": "p"}',
        '{"name": 1, "path": "p"}',
        '{"name": "x", "path": "p", "rank": 8}',
        '{"name": "x", "path": "p", "base_model_name": 3}',
    ],
)
def test_bad_lora_modules_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)


def test_parser_accepts_several_and_repeated_lora_modules() -> None:
    args = build_parser().parse_args(
        [
            "--model",
            "m",
            "--adapter-root",
            "r",
            "--lora-modules",
            "a=ok/a",
            '{"name": "b", "path": "ok/b"}',
            "--lora-modules",
            "c=ok/c",
        ]
    )
    assert [m.name for m in args.lora_modules] == ["a", "b", "c"]
    assert build_parser().parse_args(["--model", "m", "--adapter-root", "r"]).lora_modules == []


async def test_lora_modules_are_loaded_pinned() -> None:
    engine = PinningEngine()
    await load_lora_modules(engine, [LoraModule("a", "ok/a"), LoraModule("b", "ok/b")])
    assert {n: (i.pinned, i.resident_on_gpu) for n, i in engine.adapters.items()} == {
        "a": (True, True),
        "b": (True, True),
    }
    # An engine without ``pinned`` still loads them.
    plain = FakeEngine()
    await load_lora_modules(plain, [LoraModule("a", "ok/a")])
    assert "a" in plain.adapters


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        ([LoraModule("a", "ok/a"), LoraModule("a", "ok/b")], "twice"),
        ([LoraModule("tiny-base", "ok/a")], "base model"),
        ([LoraModule("a", "ok/a", "other-base")], "other-base"),
        ([LoraModule("a", "missing/a")], "cannot load"),
    ],
)
async def test_bad_start_up_adapters_stop_the_start(
    modules: list[LoraModule], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await load_lora_modules(FakeEngine(), modules)


async def test_listener_opens_only_after_the_start_up_adapters() -> None:
    engine = PinningEngine()
    seen: list[set[str]] = []
    stop = asyncio.Event()

    def ready(port: int) -> None:
        seen.append(set(engine.adapters))
        stop.set()

    assert await run_worker(
        engine,
        ServiceConfig(),
        "127.0.0.1",
        0,
        stop=stop,
        on_ready=ready,
        lora_modules=[LoraModule("a", "ok/a")],
    )
    assert seen == [{"a"}]


async def test_failed_start_up_adapter_never_listens() -> None:
    ready: list[int] = []
    with pytest.raises(ValueError, match="cannot load"):
        await run_worker(
            FakeEngine(),
            ServiceConfig(),
            "127.0.0.1",
            0,
            stop=asyncio.Event(),
            on_ready=ready.append,
            lora_modules=[LoraModule("a", "nope")],
        )
    assert ready == []


# ----------------------------------------------------------------------------------- the API
async def test_models_list_parent_and_root(start_server: StartServer) -> None:
    engine = PinningEngine()
    await load_lora_modules(engine, [LoraModule("sql", "ok/sql")])
    s = await start_server(engine)
    data = (await s.client.get("/v1/models")).json()["data"]
    base, sql = data
    assert base["id"] == base["root"] == "tiny-base"
    assert base["parent"] is None
    assert (sql["id"], sql["parent"], sql["root"], sql["pinned"]) == (
        "sql",
        "tiny-base",
        "ok/sql",
        True,
    )
    assert {m["object"] for m in data} == {"model"}


async def test_load_and_unload_answer_as_vllm(server: Server) -> None:
    r = await server.client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "ok/x"}
    )
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'x' added successfully."
    r = await server.client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'x' removed successfully."
    r = await server.client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------ vLLM's series
async def test_vllm_series_follow_traffic(server: Server) -> None:
    body: dict[str, Any] = {"model": "alpha", "prompt": "a b", "max_tokens": 3}
    for _ in range(2):
        assert (await server.client.post("/v1/completions", json=body)).status_code == 200
    f = await scrape(server)
    m = {"model_name": "tiny-base"}
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **m) == 4
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", **m) == 6
    assert (
        value(
            f, "vllm:request_success", "vllm:request_success_total", finished_reason="length", **m
        )
        == 2
    )
    assert (
        value(f, "vllm:request_success", "vllm:request_success_total", finished_reason="stop", **m)
        == 0
    )
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert value(f, name, name + "_count", **m) == 2
    ours = value(
        f, "adaptermesh_time_to_first_token_seconds", "adaptermesh_time_to_first_token_seconds_sum"
    )
    assert (
        value(f, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum", **m)
        == ours
    )
    assert value(f, "vllm:gpu_cache_usage_perc", **m) == value(f, "vllm:kv_cache_usage_perc", **m)


async def test_idle_resident_adapters_are_exported(start_server: StartServer) -> None:
    engine = PinningEngine()
    await load_lora_modules(engine, [LoraModule("pinned-one", "ok/p")])
    s = await start_server(engine)
    await s.client.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1})
    engine.adapters["cold"] = AdapterInfo("cold", "ok/cold", 8, False)
    r = await s.client.get("/metrics")
    f = await scrape(s)
    assert value(f, "adaptermesh_adapter_resident", adapter="pinned-one", pinned="true") == 1
    assert value(f, "adaptermesh_adapter_resident", adapter="alpha", pinned="false") == 1
    assert value(f, "adaptermesh_adapter_resident", adapter="cold") == 0
    # The shared scrape parser (control plane, endpoint picker) sees both idle residents.
    raw = parse_metrics(r.text)
    assert raw.resident_adapters == {"pinned-one", "alpha"}
    assert raw.pinned_adapters == {"pinned-one"}  # the placement loop reads pins from here
    assert raw.max_lora == 4


def test_json_form_matches_what_vllm_documents() -> None:
    entry = {"name": "sql", "path": "/adapters/sql", "base_model_name": "meta-llama/x"}
    assert parse_lora_module(json.dumps(entry)) == LoraModule(**entry)
