"""Tensor-parallel workers on the CPU (gloo): 2 and 4 ranks give, token for token, what the
single-process engine and transformers + peft give; the shard math reassembles; adapter loads
are all-or-nothing across ranks; a size that does not divide the heads is refused; no rank
outlives the group."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.lora_groups import GROUPS
from adaptermesh.worker.model import ModelConfig, StepInputs, read_weights
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh.worker.status_endpoints import health_response
from adaptermesh.worker.tp_group import TensorParallelError, decode_step, encode_step
from adaptermesh.worker.tp_shard import (
    COLUMN_GROUPS,
    TP_LORA_SCHEMES,
    check_divisible,
    lora_a_shard,
    lora_b_shard,
    padded_vocab,
    shard_config,
    shard_weights,
)
from adaptermesh.worker.types import EngineError, InvalidRequestError
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

from .conftest import ADAPTERS, PROMPTS, Reference, Tiny, collect, request, tokens

_BASE_KW = {"max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 16}


def _children(pid: int) -> set[int]:
    """The live children of every thread of ``pid``; a thread that exits while the
    listing is read (its ``task`` entry gone) has none to report."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out.update(int(x) for x in text if _alive(int(x)))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---- shard math (no processes) -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    per_kv=st.integers(1, 8),
    kv=st.integers(1, 16),
    inter=st.integers(1, 512),
    hidden=st.sampled_from([48, 64, 96, 100]),
    world=st.integers(1, 8),
    scheme=st.sampled_from(TP_LORA_SCHEMES),
)
def test_divisibility_error_names_the_field(
    per_kv: int, kv: int, inter: int, hidden: int, world: int, scheme: str
) -> None:
    heads = per_kv * kv
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 8,
        }
    )
    fields = [("num_attention_heads", heads), ("num_key_value_heads", kv),
              ("intermediate_size", inter)]  # fmt: skip
    if scheme == "sharded":  # o's and down's B split by output rows as well
        fields.append(("hidden_size", hidden))
    bad = [f for f, v in fields if v % world]
    if bad:
        with pytest.raises(ValueError, match=f"config.{bad[0]}") as e:
            check_divisible(cfg, world, scheme)
        assert str(e.value).startswith(f"tensor_parallel_size: {world} ")
    else:
        check_divisible(cfg, world, scheme)
        local = shard_config(cfg, world)
        assert local.num_heads * world == heads
        assert local.num_kv_heads * world == kv
        assert local.intermediate_size * world == inter
        assert local.vocab_size == cfg.vocab_size
        assert local.head_dim == cfg.head_dim


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shards_reassemble_the_checkpoint(tmp_path: Path, world: int, arch: str) -> None:
    model_dir = make_tiny_model(
        tmp_path / "m", arch, num_key_value_heads=4, num_hidden_layers=1, tie_word_embeddings=True
    )
    cfg = ModelConfig.from_dir(model_dir)
    full = read_weights(model_dir)
    shards = [shard_weights(cfg, full, r, world) for r in range(world)]
    for name, t in full.items():
        leaf, kind = name.split(".")[-2:]
        parts = [s[name] for s in shards]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert all(p.shape[0] == t.shape[0] // world for p in parts)
            torch.testing.assert_close(torch.cat(parts), t, rtol=0, atol=0)
        elif leaf in ("o_proj", "down_proj") and kind == "weight":
            torch.testing.assert_close(torch.cat(parts, dim=1), t, rtol=0, atol=0)
        elif leaf in ("o_proj", "down_proj"):
            torch.testing.assert_close(torch.stack(parts).sum(0), t, rtol=0, atol=0)
        elif name != "lm_head.weight":
            assert all(p is t for p in parts), name
    # Tied embeddings: each rank's head is its vocabulary slice of the embedding, padded.
    embed = full["model.embed_tokens.weight"]
    head = torch.cat([s["lm_head.weight"] for s in shards])
    assert head.shape[0] == padded_vocab(cfg.vocab_size, world)
    torch.testing.assert_close(head[: cfg.vocab_size], embed, rtol=0, atol=0)
    assert not head[cfg.vocab_size :].any()


@pytest.mark.parametrize("world", [2, 4])
def test_fused_checkpoint_shards_match_the_split_modules(world: int) -> None:
    """Phi-3 stores q/k/v and gate/up fused: each rank's fused rows are its q, k and v rows
    (gate and up rows), in that order, as if the modules had been stored apart."""
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 16,
            "hidden_size": 8,
            "intermediate_size": 12,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 2,
        }
    )
    g = torch.Generator().manual_seed(world)
    p = "model.layers.0."
    parts = {
        "self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "self_attn.k_proj.weight": torch.randn(8, 8, generator=g),
        "self_attn.v_proj.weight": torch.randn(8, 8, generator=g),
        "mlp.gate_proj.weight": torch.randn(12, 8, generator=g),
        "mlp.up_proj.weight": torch.randn(12, 8, generator=g),
    }
    split = {p + k: v for k, v in parts.items()}
    split["model.embed_tokens.weight"] = torch.randn(16, 8, generator=g)
    fused = {
        p + "self_attn.qkv_proj.weight": torch.cat([parts[f"self_attn.{m}.weight"] for m in
                                                   ("q_proj", "k_proj", "v_proj")]),
        p + "mlp.gate_up_proj.weight": torch.cat([parts["mlp.gate_proj.weight"],
                                                 parts["mlp.up_proj.weight"]]),
        "model.embed_tokens.weight": split["model.embed_tokens.weight"],
    }  # fmt: skip
    for r in range(world):
        a, b = shard_weights(cfg, split, r, world), shard_weights(cfg, fused, r, world)
        want_qkv = torch.cat(
            [a[p + f"self_attn.{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")]
        )
        want_gu = torch.cat([a[p + "mlp.gate_proj.weight"], a[p + "mlp.up_proj.weight"]])
        assert torch.equal(b[p + "self_attn.qkv_proj.weight"], want_qkv)
        assert torch.equal(b[p + "mlp.gate_up_proj.weight"], want_gu)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 40), world=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_vocab_parallel_head_pads_and_gathers_back(vocab: int, world: int, seed: int) -> None:
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": 8,
            "intermediate_size": 12 * world,
            "num_hidden_layers": 1,
            "num_attention_heads": world,
            "num_key_value_heads": world,
            "head_dim": 2,
        }
    )
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, 8, generator=g)
    weights = {"model.embed_tokens.weight": torch.randn(vocab, 8, generator=g),
               "lm_head.weight": head}  # fmt: skip
    h = torch.randn(3, 8, generator=g)
    # What TPComm.gather_vocab does with the ranks' logits: concatenate, drop the padding.
    parts = [h @ shard_weights(cfg, weights, r, world)["lm_head.weight"].T for r in range(world)]
    assert {p.shape[1] for p in parts} == {padded_vocab(vocab, world) // world}
    torch.testing.assert_close(torch.cat(parts, dim=-1)[:, :vocab], h @ head.T)


@settings(max_examples=40, deadline=None)
@given(
    group=st.sampled_from(sorted(GROUPS)),
    world=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 6),
    rank=st.integers(1, 8),
    tokens_=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    scheme=st.sampled_from(TP_LORA_SCHEMES),
)
def test_lora_shards_add_up_to_the_full_delta(
    group: str, world: int, per_rank: int, rank: int, tokens_: int, seed: int, scheme: str
) -> None:
    gen = torch.Generator().manual_seed(seed)
    d_in = d_out = per_rank * world
    x = torch.randn(tokens_, d_in, generator=gen, dtype=torch.float64)
    a = torch.randn(rank, d_in, generator=gen, dtype=torch.float64)
    b = torch.randn(d_out, rank, generator=gen, dtype=torch.float64)
    full = x @ a.T @ b.T

    def b_of(r: int) -> torch.Tensor:
        return lora_b_shard(group, b, r, world, scheme)

    if group in COLUMN_GROUPS:  # each rank its output columns, from the whole input
        parts = [x @ lora_a_shard(group, a, r, world).T @ b_of(r).T for r in range(world)]
        got = torch.cat(parts, dim=1)
    elif scheme == "base-reduce":  # each rank a partial sum; the base all-reduce adds them
        xs = x.chunk(world, dim=1)
        got = sum(xs[r] @ lora_a_shard(group, a, r, world).T @ b_of(r).T for r in range(world))
    else:  # the shrink outputs all-reduced, then each rank expands its output columns
        xs = x.chunk(world, dim=1)
        v = sum(xs[r] @ lora_a_shard(group, a, r, world).T for r in range(world))
        got = torch.cat([v @ b_of(r).T for r in range(world)], dim=1)
    torch.testing.assert_close(got, full)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 12),
    s=st.integers(1, 6),
    maxb=st.integers(1, 5),
    lora=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_step_inputs_cross_the_wire_unchanged(
    t: int, s: int, maxb: int, lora: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)

    def ints(n: int, dtype: torch.dtype, lo: int = -1) -> torch.Tensor:
        return torch.randint(lo, 1000, (n,), generator=g).to(dtype)

    inp = StepInputs(
        input_ids=ints(t, torch.int64, 0),
        positions=ints(t, torch.int64, 0),
        slot_mapping=ints(t, torch.int64),
        token_slots=ints(t, torch.int32),
        block_tables=ints(s * maxb, torch.int32, 0).view(s, maxb),
        seq_lens=ints(s, torch.int32, 0),
        query_start=ints(s + 1, torch.int32, 0),
        logits_rows=ints(s, torch.int64, 0),
        num_decode=int(torch.randint(0, s + 1, (1,), generator=g)),
        max_prefill_len=t,
        num_splits=int(torch.randint(1, 9, (1,), generator=g)),
    )
    header, payload = encode_step(inp, lora)
    back, got_lora = decode_step(header, payload)
    assert got_lora == lora
    for f in ("num_decode", "max_prefill_len", "num_splits"):
        assert getattr(back, f) == getattr(inp, f)
    for f in ("input_ids", "positions", "slot_mapping", "token_slots", "block_tables",
              "seq_lens", "query_start", "logits_rows"):  # fmt: skip
        want, got = getattr(inp, f), getattr(back, f)
        assert got.dtype == want.dtype, f
        assert torch.equal(got, want), f


def test_health_lists_ranks_and_fails_when_one_is_down() -> None:
    ok = health_response(False, 5, (True, True))
    assert ok.status == 200
    assert b'"ranks": ["up", "up"]' in ok.body
    down = health_response(False, 5, (True, False))
    assert down.status == 503
    assert b'"status": "rank_down"' in down.body  # type: ignore[operator]
    assert health_response(False, 5).status == 200


# ---- the engine over 2 and 4 ranks -------------------------------------------------------------


def _engine(
    model_dir: Path,
    root: Path,
    tp: int,
    *,
    observer: Any = None,
    fail_loads_rank: int = -1,
    **kw: Any,
) -> Engine:
    cfg = EngineConfig(**{**_BASE_KW, "tensor_parallel_size": tp, **kw})
    return Engine(
        model_dir,
        root,
        config=cfg,
        model_name="tiny",
        sample_observer=observer,
        tp_fail_loads_rank=fail_loads_rank,
    )


async def _run_batch(
    eng: Engine, jobs: list[tuple[str, tuple[int, ...], str | None, int]]
) -> dict[str, list[int]]:
    streams = [eng.submit(request(rid, ids, name, max_tokens=n)) for rid, ids, name, n in jobs]
    results = await asyncio.gather(*(collect(s) for s in streams))
    return {rid: tokens(ev) for (rid, *_), ev in zip(jobs, results, strict=True)}


async def test_two_ranks_match_single_process_and_peft(
    tiny: Tiny, logit_log: dict[str, list[torch.Tensor]]
) -> None:
    """Four adapters of different ranks and targets and the base model in one batch."""
    names: list[str | None] = [None, *ADAPTERS]
    jobs = [
        (f"p{i}-{name}", tiny.encode(p), name, 5 + (i + j) % 3)
        for i, p in enumerate(PROMPTS[:2])
        for j, name in enumerate(names)
    ]
    single = Engine(
        tiny.model_dir,
        tiny.root,
        config=EngineConfig(**_BASE_KW),
        model_name="t",
        sample_observer=logit_log,
    )
    try:
        want_single = await _run_batch(single, jobs)
    finally:
        await single.shutdown()
    logit_log.clear()
    eng = _engine(
        tiny.model_dir,
        tiny.root,
        2,
        observer=logit_log,
        max_prefill_chunk=6,
        max_num_batched_tokens=24,
    )
    try:
        assert eng.ranks_up() == (True, True)
        # NVLink multicast is off in every rank (set before the group starts, inherited).
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        got = await _run_batch(eng, jobs)
        assert eng.tp_group is not None
        assert eng.tp_group.failed_rank is None
    finally:
        await eng.shutdown()
    assert got == want_single
    for rid, ids, name, _n in jobs:
        ref_logits = tiny.ref.logits(list(ids) + got[rid][:-1], name)[len(ids) - 1 :]
        assert got[rid] == [int(r.argmax()) for r in ref_logits], rid
        torch.testing.assert_close(torch.stack(logit_log[rid]), ref_logits, atol=2e-4, rtol=1e-4)
    assert len({tuple(v) for k, v in got.items() if k.startswith("p1-")}) == len(names)


@pytest.mark.slow
async def test_four_ranks_qwen2_with_a_hot_load_match_peft(tmp_path: Path) -> None:
    """With o's and down's B split too (``tp_lora_scheme="sharded"``)."""
    model_dir = make_tiny_model(
        tmp_path / "m", "qwen2", seed=5, num_key_value_heads=4, num_hidden_layers=1
    )
    root = tmp_path / "adapters"
    make_adapter(root, model_dir, "one", 4, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=1)
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    make_adapter(root, model_dir, "two", 8, all7, seed=2)
    make_adapter(root, model_dir, "hot", 16, all7, seed=3, use_rslora=True)
    ref = Reference(model_dir, root, ["one", "two", "hot"])
    eng = _engine(model_dir, root, 4, max_loras=3, tp_lora_scheme="sharded")
    try:
        assert eng.ranks_up() == (True,) * 4
        assert eng.pool.b["o"][0].shape[2] == 64 // 4  # rank 0 holds a quarter of o's B
        assert eng.pool.b["down"][0].shape[2] == 64 // 4
        ids = tuple(eng.tokenize(PROMPTS[2]))
        first = [eng.submit(request(f"a-{n}", ids, n, max_tokens=10)) for n in (None, "one", "two")]
        # The hot load starts once the first batch has produced tokens (it is decoding), and
        # its requests join the batch.
        heads = [s.__aiter__() for s in first]
        started = [await h.__anext__() for h in heads]
        assert all(e.token_id is not None and e.finish_reason is None for e in started)
        info = await eng.load_adapter("hot", "hot")
        assert info.name == "hot"
        later = [eng.submit(request(f"b-{n}", ids, n, max_tokens=6)) for n in ("hot", "one")]
        rests = await asyncio.gather(*(collect(h) for h in heads), *(collect(s) for s in later))
        outs = [[e, *r] for e, r in zip(started, rests[:3], strict=True)] + rests[3:]
        single = Engine(model_dir, root, config=EngineConfig(**_BASE_KW), model_name="t")
        try:
            want = await _run_batch(
                single,
                [(f"a-{n}", ids, n, 10) for n in (None, "one", "two")]
                + [(f"b-{n}", ids, n, 6) for n in ("hot", "one")],
            )
        finally:
            await single.shutdown()
    finally:
        await eng.shutdown()
    for (rid, w), ev in zip(want.items(), outs, strict=True):
        name = rid.split("-", 1)[1]
        assert tokens(ev) == w, rid
        assert w == ref.greedy(list(ids), None if name == "None" else name, len(w)), rid


async def test_size_that_does_not_divide_the_heads_is_refused(tiny: Tiny) -> None:
    before = _children(os.getpid())
    with pytest.raises(InvalidRequestError) as e:
        _engine(tiny.model_dir, tiny.root, 3)
    assert e.value.field == "tensor_parallel_size"  # type: ignore[attr-defined]
    assert "config.num_attention_heads (4)" in str(e.value)
    with pytest.raises(InvalidRequestError, match="num_key_value_heads"):
        _engine(tiny.model_dir, tiny.root, 4)  # 4 heads, but 2 KV heads
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        _engine(tiny.model_dir, tiny.root, 0)
    with pytest.raises(InvalidRequestError, match="lora_dtype: int4 adapter pools"):
        _engine(tiny.model_dir, tiny.root, 2, lora_dtype="int4")
    assert _children(os.getpid()) <= before  # nothing was started


async def test_failed_load_on_one_rank_publishes_on_none(tiny: Tiny) -> None:
    eng = _engine(tiny.model_dir, tiny.root, 2, fail_loads_rank=1)
    try:
        with pytest.raises(AdapterValidationError, match="gpu_copy"):
            await eng.load_adapter("gamma", "gamma")
        assert "gamma" not in {a.name for a in eng.list_adapters()}
        for g in eng.pool.ranks:  # rank 0 wrote its share, then withdrew it
            assert int(eng.pool.ranks[g].abs().sum()) == 0
        assert float(eng.pool.scales.abs().sum()) == 0.0
        ids = tiny.encode(PROMPTS[0])
        got = tokens(await collect(eng.submit(request("base", ids, None, max_tokens=6))))
        assert got == tiny.ref.greedy(list(ids), None, 6)  # the ranks are still in step
    finally:
        await eng.shutdown()


async def test_shutdown_and_a_dying_rank_leave_no_process(tiny: Tiny) -> None:
    eng = _engine(tiny.model_dir, tiny.root, 2)
    group = eng.tp_group
    assert group is not None
    pids = [p.pid for p in group.procs]
    assert set(pids) <= _children(os.getpid())
    await eng.shutdown()
    assert all(p.returncode == 0 for p in group.procs)  # they left on SHUTDOWN
    assert not any(_alive(p) for p in pids)

    eng = _engine(tiny.model_dir, tiny.root, 2)
    group = eng.tp_group
    assert group is not None
    failed: list[int] = []
    group.on_failure = failed.append
    try:
        group.procs[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert failed == [1]
        assert eng.ranks_up() == (True, False)
        assert eng.stats().tp_ranks_up == (True, False)
        # Requests now fail at once instead of waiting on the dead rank.
        with pytest.raises(EngineError, match="rank 1 has exited"):
            await asyncio.wait_for(
                collect(eng.submit(request("after", tiny.encode(PROMPTS[0]), None))), 30
            )
    finally:
        await eng.shutdown()
    assert not any(_alive(p.pid) for p in group.procs)


async def test_ranks_take_the_workers_cpu_thread_count(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank is its own interpreter: it gets the thread count rank 0 chose (--cpu-threads),
    not one per core nor what the worker's own environment said."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = _engine(tiny.model_dir, tiny.root, 2)
        group = eng.tp_group
        assert group is not None
        try:
            environ = Path(f"/proc/{group.procs[0].pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_NUM_THREADS=1" in environ
        finally:
            await eng.shutdown()
    finally:
        torch.set_num_threads(before)


def test_ranks_exit_when_rank_0_is_killed(tiny: Tiny, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from adaptermesh.worker.engine import Engine, EngineConfig
        eng = Engine({str(tiny.model_dir)!r}, {str(tiny.root)!r},
                     config=EngineConfig(max_num_seqs=2, max_loras=1, max_lora_rank=16,
                                         tensor_parallel_size=2))
        print(" ".join(str(p.pid) for p in eng.tp_group.procs), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 1
        assert _alive(pids[0])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_worker_cli_reports_ranks_and_exits_when_one_dies(tiny: Tiny) -> None:
    """``adaptermesh worker --tensor-parallel-size 2``: /health lists both ranks, /metrics has
    a gauge per rank; killing rank 1 stops the worker with status 1 and leaves no process."""
    import httpx

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from adaptermesh.cli.main import main; sys.exit(main())",
        "worker",
        "--model",
        str(tiny.model_dir),
        "--adapter-root",
        str(tiny.root),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--max-num-seqs",
        "2",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--tensor-parallel-size",
        "2",
        "--drain-grace",
        "0",
        "--log-level",
        "WARNING",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.strip().rsplit(" ", 1)[-1]
        ranks = sorted(_children(proc.pid))
        assert len(ranks) == 1
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            h = await c.get("/health")
            assert h.status_code == 200
            assert h.json() == {"status": "ok", "ranks": ["up", "up"]}
            text = (await c.get("/metrics")).text
            assert 'adaptermesh_tp_rank_up{rank="0"} 1.0' in text
            assert 'adaptermesh_tp_rank_up{rank="1"} 1.0' in text
            r = await c.post(
                "/v1/completions",
                json={"model": "alpha", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        os.kill(ranks[0], signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 60) == 1
        assert proc.stderr is not None
        assert b"tensor-parallel rank 1 exited" in await proc.stderr.read()
        assert not _alive(ranks[0])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_rank_that_cannot_start_fails_the_start_at_once(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _children(os.getpid())
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the rank's interpreter exits at once
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited while starting"):
        _engine(tiny.model_dir, tiny.root, 2)
    assert time.monotonic() - t0 < 30  # not the collectives' timeout
    assert _children(os.getpid()) == before
