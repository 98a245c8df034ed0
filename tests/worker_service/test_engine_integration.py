"""The service around the real engine on CPU, with the tiny random Llama and PEFT adapters.

A real OpenAI client talks to the server on 127.0.0.1 and must get exactly the engine's greedy
output; a flooding tenant gets 429 while a quiet tenant keeps its latency; a disconnect frees
the slot; /metrics has every series; adapters load and unload under traffic without losing a
request; bad input gets the documented status and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from waiting import async_wait_until as wait_until

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.types import GenerationRequest, SamplingParams
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import StartServer
from .test_metrics import EXPECTED

pytestmark = pytest.mark.slow

ADAPTERS = ("a0", "a1", "a2")
# Prompts whose greedy continuations run long on the tiny model (checked in test_greedy_...).
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("worker-service")
    model = make_tiny_model(base / "tiny", max_position_embeddings=1024)
    root = base / "adapters"
    root.mkdir()
    for i, name in enumerate(ADAPTERS):
        targets = ("q_proj", "v_proj") if i != 1 else ("q_proj", "k_proj", "v_proj", "o_proj")
        make_adapter(root, model, name, rank=4 * (i + 1), target_modules=targets, seed=i)
    shutil.copytree(root / "a1", root / "hot")
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    return model, root


CANDIDATES = (
    "Once upon a time",
    "adapters",
    "1 2 3",
    "GPU workers batch",
    "hello world",
    "def add(a, b):",
    "The quick brown fox",
)


async def long_running(
    engine: Engine, max_tokens: int, exclude: tuple[str | None, str] | None = None
) -> tuple[str | None, str]:
    """An (adapter, prompt) pair whose greedy output runs to ``max_tokens`` without EOS.

    The tiny model has random weights, so which continuations hit EOS early is found, not
    assumed; tests that need a long request (a flood, a stream to walk away from) use this.
    """
    # Greedy decoding is deterministic: a pair found to run N tokens without EOS runs every
    # shorter length too, so later tests on the same model reuse it instead of probing again.
    key = (str(engine.model_dir), exclude)
    found = _LONG_RUNNING.get(key)
    if found is not None and found[2] >= max_tokens:
        return found[0], found[1]
    for prompt in CANDIDATES:
        for adapter in (None, *ADAPTERS):
            if (adapter, prompt) == exclude:
                continue
            _, n, reason = await direct_greedy(engine, engine.tokenize(prompt), adapter, max_tokens)
            if reason == "length" and n == max_tokens:
                _LONG_RUNNING[key] = (adapter, prompt, max_tokens)
                return adapter, prompt
    raise AssertionError(f"no candidate runs {max_tokens} tokens without EOS")


_LONG_RUNNING: dict[tuple[str, tuple[str | None, str] | None], tuple[str | None, str, int]] = {}


QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def engine_for(files: tuple[Path, Path], **config: Any) -> Engine:
    model, root = files
    return Engine(
        model, root, device="cpu", dtype="float32", config=EngineConfig(**config), model_name="tiny"
    )


async def direct_greedy(
    engine: Engine, prompt_ids: list[int], adapter: str | None, max_tokens: int
) -> tuple[str, int, str]:
    stream = engine.submit(
        GenerationRequest(
            f"direct-{adapter}", tuple(prompt_ids), adapter, SamplingParams(max_tokens=max_tokens)
        )
    )
    text, n, reason = "", 0, ""
    async for event in stream:
        text += event.text
        n = event.completion_tokens
        reason = event.finish_reason or ""
    return text, n, reason


async def test_openai_client_matches_engine_greedy_output(
    model_files, start_server: StartServer
) -> None:
    engine = engine_for(model_files, max_num_seqs=4)
    s = await start_server(engine)
    client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="tenant-a", max_retries=0)
    ids = engine.tokenize(PROMPT)
    try:
        for model in ("tiny", *ADAPTERS):
            expected, n, reason = await direct_greedy(
                engine, ids, None if model == "tiny" else model, 24
            )
            got = await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, temperature=0
            )
            assert got.choices[0].text == expected, model
            assert got.choices[0].finish_reason == reason
            assert got.usage is not None
            assert got.usage.completion_tokens == n
            assert got.usage.prompt_tokens == len(ids)
            stream = await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
            )
            pieces, reasons = [], []
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            assert "".join(pieces) == expected, model
            assert reasons[-1] == reason
            assert set(reasons[:-1]) <= {None}
        # The adapters really change the output (otherwise the comparison above is weak).
        outputs = {(await direct_greedy(engine, ids, a, 24))[0] for a in (None, *ADAPTERS)}
        assert len(outputs) == 4
        # Chat goes through the tokenizer's chat template.
        messages = [{"role": "user", "content": "hello"}]
        chat_ids = engine.apply_chat_template(messages)
        assert chat_ids is not None
        expected, n, _ = await direct_greedy(engine, chat_ids, "a2", 16)
        chat = await client.chat.completions.create(
            model="a2", messages=messages, max_tokens=16, temperature=0
        )
        assert chat.choices[0].message.content == expected
        assert chat.usage is not None
        assert chat.usage.completion_tokens == n
        chunks = await client.chat.completions.create(
            model="a2", messages=messages, max_tokens=16, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in chunks])
        assert text == expected
        # Token-id prompts and a concurrent mixed batch give the same answers.
        results = await asyncio.gather(
            *[
                client.completions.create(model=m, prompt=ids, max_tokens=24, temperature=0)
                for m in ("tiny", *ADAPTERS) * 2
            ]
        )
        for m, r in zip(("tiny", *ADAPTERS) * 2, results, strict=True):
            exp = (await direct_greedy(engine, ids, None if m == "tiny" else m, 24))[0]
            assert r.choices[0].text == exp, m
        models = await client.models.list()
        assert {m.id for m in models.data} >= {"tiny", *ADAPTERS}
    finally:
        await client.close()
        await engine.shutdown()


async def test_flooding_tenant_gets_429_while_quiet_tenant_goes_ahead_of_its_backlog(
    model_files, start_server: StartServer
) -> None:
    engine = engine_for(model_files, max_num_seqs=2)
    s = await start_server(engine, max_running=2, max_waiting_per_tenant=3, max_waiting_total=64)
    adapter, prompt = await long_running(engine, 96)
    flood_body = {"model": adapter or "tiny", "prompt": prompt, "max_tokens": 96, "temperature": 0}
    quiet_body = {"model": "a0", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}

    # The order in which answers come back (an ordering, not a time: a loaded CI machine
    # slows every request alike; the latency figure is bench/bench_http_hardening.py's).
    finished: list[str] = []

    async def post(body: dict, tenant: str) -> httpx.Response:
        r = await s.client.post("/v1/completions", json=body, headers={"x-tenant-id": tenant})
        finished.append(tenant)
        return r

    try:
        assert (await post(quiet_body, "quiet")).status_code == 200  # a0 loaded: a warm start
        assert (await post(flood_body, "flood")).status_code == 200
        finished.clear()
        flood = [asyncio.create_task(post(flood_body, "flood")) for _ in range(16)]
        await wait_until(lambda: s.service.queue.num_waiting == 3)
        # Two flood requests run and three wait; the refused ones are answered at once.
        await wait_until(lambda: finished.count("flood") == 11)
        quiet = []
        for _ in range(3):
            quiet.append(await post(quiet_body, "quiet"))
        flood_results = await asyncio.gather(*flood)
    finally:
        await engine.shutdown()
    codes = [r.status_code for r in flood_results]
    assert codes.count(200) == 5
    assert codes.count(429) == 11
    assert all(r.headers.get("retry-after") for r in flood_results if r.status_code == 429)
    assert [r.status_code for r in quiet] == [200, 200, 200]
    # Fair queuing puts each quiet request in the next free slot, ahead of the flood's
    # backlog: the first waits only for a running flood request (first-come order would put
    # it behind all three queued ones), and all three are answered before the flood's last.
    served = finished[11:]  # after the eleven refusals
    assert served.index("quiet") <= 2, served
    assert served[-1] == "flood", served


async def test_disconnect_mid_stream_frees_the_slot(model_files, start_server: StartServer) -> None:
    engine = engine_for(model_files, max_num_seqs=1)
    s = await start_server(engine, max_running=1)
    client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
    try:
        adapter, prompt = await long_running(engine, 400)
        before = engine.stats().generated_tokens
        stream = await client.completions.create(
            model=adapter or "tiny", prompt=prompt, max_tokens=400, temperature=0, stream=True
        )
        seen = 0
        async for _chunk in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        await wait_until(lambda: s.service.queue.num_running == 0)
        await wait_until(lambda: engine.stats().num_running == 0)
        generated = engine.stats().generated_tokens
        assert generated - before < 400
        r = await client.completions.create(model="a0", prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        # Nothing ran for the lost client: the engine generated this answer's tokens only.
        assert r.usage is not None
        assert engine.stats().generated_tokens == generated + r.usage.completion_tokens
        text = (await s.client.get("/metrics")).text
        assert 'adaptermesh_requests_total{outcome="disconnected"} 1.0' in text
    finally:
        await client.close()
        await engine.shutdown()


async def test_metrics_from_the_real_engine(model_files, start_server: StartServer) -> None:
    # A pool over exactly the adapters' modules: its arena holds two of a1 (q, k, v, o) and so
    # never all three adapters.
    engine = engine_for(model_files, max_num_seqs=2, max_loras=2, lora_target_modules=QKVO)
    s = await start_server(engine)
    try:
        for name in ADAPTERS:  # three adapters through two GPU slots: a miss each, an eviction
            r = await s.client.post(
                "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 8}
            )
            assert r.status_code == 200
        r = await s.client.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
    finally:
        await engine.shutdown()
    for name, (kind, labels) in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind
        for sample in families[name].samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)

    def one(name: str) -> float:
        return families[name].samples[0].value

    assert families["vllm:lora_requests_info"].samples[0].labels["max_lora"] == "2"
    assert one("adaptermesh_adapter_cache_misses") == 3
    assert one("adaptermesh_adapter_cache_evictions") >= 1
    # Three adapters through two slots, one request each: three loads in queue order, and the
    # only evictions are of adapters nobody waits for.
    assert one("adaptermesh_adapter_loads_started") == 3
    assert one("adaptermesh_adapter_evictions_wanted") == 0
    assert one("adaptermesh_admissions_waited_on_adapter_load") == 3
    assert one("adaptermesh_gpu_slots_total") == engine.pool.num_slots  # the most it holds
    assert one("adaptermesh_gpu_slots_used") <= 2
    assert one("adaptermesh_generation_tokens") >= 3
    load = {s.name: s.value for s in families["adaptermesh_adapter_load_latency_seconds"].samples}
    assert load["adaptermesh_adapter_load_latency_seconds_count"] == 3
    assert one("vllm:num_requests_running") == 0


async def test_load_and_unload_under_concurrent_traffic_loses_no_request(
    model_files, start_server: StartServer
) -> None:
    engine = engine_for(model_files, max_num_seqs=4, max_loras=4)
    s = await start_server(engine, admin_token="tok", max_running=8)
    admin = {"Authorization": "Bearer tok"}
    names = [*ADAPTERS, "hot"]

    async def traffic(i: int) -> httpx.Response:
        return await s.client.post(
            "/v1/completions",
            json={"model": names[i % len(names)], "prompt": PROMPT, "max_tokens": 12},
            headers={"x-tenant-id": f"t{i % 3}"},
        )

    async def churn() -> list[int]:
        codes = []
        for i in range(6):
            path = "hot" if i % 2 == 0 else "a2"  # reload "hot" with different weights
            r = await s.client.post(
                "/v1/load_lora_adapter", headers=admin, json={"lora_name": "hot", "lora_path": path}
            )
            codes.append(r.status_code)
            await asyncio.sleep(0.02)
            r = await s.client.post(
                "/v1/unload_lora_adapter", headers=admin, json={"lora_name": "hot"}
            )
            codes.append(r.status_code)
        r = await s.client.post(
            "/v1/load_lora_adapter", headers=admin, json={"lora_name": "hot", "lora_path": "hot"}
        )
        codes.append(r.status_code)
        return codes

    try:
        results = await asyncio.gather(churn(), *[traffic(i) for i in range(40)])
        admin_codes, responses = results[0], results[1:]
        assert all(r.status_code == 200 for r in responses), [
            (r.status_code, r.text) for r in responses if r.status_code != 200
        ]
        assert all(r.json()["choices"][0]["finish_reason"] in ("length", "stop") for r in responses)
        # An unload can race with an on-demand load of "hot" by traffic; both outcomes are
        # valid (404 means traffic had not loaded it yet), but loads always succeed.
        assert all(c == 200 for c in admin_codes[::2])
        assert set(admin_codes) <= {200, 404}
        models = (await s.client.get("/v1/models")).json()["data"]
        assert "hot" in {m["id"] for m in models}
        assert s.service.queue.num_running == 0
        assert s.service.queue.num_waiting == 0
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "broken", "prompt": "x"}, 400, "model"),
        ("/v1/completions", {"model": "../etc", "prompt": "x"}, 400, "model"),
        ("/v1/completions", {"prompt": [5000]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "word " * 1100}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": [1]}, 400, "temperature"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../outside"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 404, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "broken"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "bad name!", "lora_path": "a0"}, 400, "lora_name"),
        ("/v1/unload_lora_adapter", {"lora_name": "a0"}, 404, "lora_name"),
    ],
)
async def test_bad_input_against_the_real_engine(
    model_files, start_server: StartServer, path, body, status, param
) -> None:
    engine = engine_for(model_files, max_num_seqs=2)
    s = await start_server(engine)
    try:
        r = await s.client.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert param in error["message"]
        ok = await s.client.post(
            "/v1/completions", json={"model": "a0", "prompt": PROMPT, "max_tokens": 4}
        )
        assert ok.status_code == 200
        assert {a.name for a in engine.list_adapters()} == {"a0"}
    finally:
        await engine.shutdown()


async def test_cli_serves_and_drains_on_sigterm(model_files, tmp_path: Path) -> None:
    model, root = model_files
    token = tmp_path / "admin-token"
    token.write_text("cli-secret\n")
    import sys

    probe = engine_for(model_files, max_num_seqs=1)
    adapter, prompt = await long_running(probe, 400)
    await probe.shutdown()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from adaptermesh.cli.main import main; sys.exit(main())",
        "worker",
        "--model",
        str(model),
        "--adapter-root",
        str(root),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--admin-token-file",
        str(token),
        "--max-num-seqs",
        "2",
        # Long enough for the 400-token request to finish on a loaded machine: the test checks
        # that the drain lets it end and the worker exits 0, not how fast.
        "--drain-timeout",
        "180",
        # No grace: refused at once (the grace itself: test_service.py and the fault suite).
        "--drain-grace",
        "0",
        "--log-level",
        "WARNING",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.strip().rsplit(" ", 1)[-1]
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "a0"})
            assert r.status_code == 401
            r = await c.post(
                "/v1/load_lora_adapter",
                headers={"Authorization": "Bearer cli-secret"},
                json={"lora_name": "x", "lora_path": adapter or "a0"},
            )
            assert r.status_code == 200
            events: list[str] = []
            async with c.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": "x" if adapter else "tiny",
                    "prompt": prompt,
                    "max_tokens": 400,
                    "temperature": 0,
                    "stream": True,
                },
            ) as stream:
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(15)
                        async with httpx.AsyncClient(base_url=url, timeout=5) as c2:

                            async def draining(c2: httpx.AsyncClient = c2) -> httpx.Response | None:
                                h = await c2.get("/health")
                                return h if h.status_code == 503 else None

                            health = await wait_until(draining)
                            refused = await c2.post("/v1/completions", json={"prompt": "x"})
            assert health.status_code == 503
            assert health.headers["x-envoy-immediate-health-check-fail"] == "true"
            assert refused.status_code == 503
            assert refused.headers["retry-after"]
            assert refused.headers["x-envoy-immediate-health-check-fail"] == "true"
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert await asyncio.wait_for(proc.wait(), 200) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from adaptermesh.worker.cli import main

    assert main(["--model", str(tmp_path / "none"), "--adapter-root", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    empty = tmp_path / "token"
    empty.write_text("  \n")
    assert (
        main(
            [
                "--model",
                str(tmp_path),
                "--adapter-root",
                str(tmp_path),
                "--admin-token-file",
                str(empty),
            ]
        )
        == 2
    )
    assert "empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--adapter-root", str(tmp_path), "--port", "70000"])


async def test_a_cpu_worker_says_where_its_adapters_are(model_files, start_server: StartServer):
    """A CPU worker's slots are host memory: ``resident`` but never ``resident_on_gpu``; and
    ``GET /v1/models/{name}`` says whether (and where) a request would find an adapter,
    without loading it."""
    engine = engine_for(model_files, max_num_seqs=2, max_loras=2)
    s = await start_server(engine)
    try:
        r = await s.client.post(
            "/v1/completions", json={"model": "a0", "prompt": PROMPT, "max_tokens": 2}
        )
        assert r.status_code == 200
        cards = {m["id"]: m for m in (await s.client.get("/v1/models")).json()["data"]}
        assert (cards["a0"]["resident"], cards["a0"]["resident_on_gpu"]) == (True, False)
        located = {
            name: (r.status_code, r.json().get("location"), r.json().get("error", {}).get("code"))
            for name in ("tiny", "a0", "a2", "a2@9.9.9", "nosuch")
            for r in [await s.client.get(f"/v1/models/{name}")]
        }
        assert located == {
            "tiny": (200, "resident", None),
            "a0": (200, "resident", None),
            "a2": (200, "root", None),
            "a2@9.9.9": (404, None, "model_not_found"),
            "nosuch": (404, None, "model_not_found"),
        }
        assert "a2" not in {m["id"] for m in (await s.client.get("/v1/models")).json()["data"]}
    finally:
        await engine.shutdown()
