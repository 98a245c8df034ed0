"""Adapters from S3 on the CPU box: cold load from a local S3 API server vs the CPU cache, and
100 concurrent first requests for one unresolved adapter name.

Setup: moto's S3 server (server mode, in a thread of this process, on 127.0.0.1), reached
through boto3 over HTTP. The adapter is rank 16 on all seven modules (q, k, v, o, gate, up,
down) of the Llama-2-7B shape (32 layers, hidden 4096, intermediate 11008), random bf16,
written with safetensors directly: 80 MB.

What is timed (the 7B model itself is not built: a CPU box cannot run it, and the adapter path
does not depend on its weights). An ``AdapterManager`` for the 7B shape with a two-slot bf16
``LoraPool`` on the CPU:

* ``cold_s3``: ``AdapterManager.load(name, "s3://...")`` with an empty download cache: list the
  prefix, download both objects (streamed, MD5-verified against the ETag), rename into the
  cache, read and validate the adapter (``read_adapter``: config, every tensor's name, shape and
  finiteness, packing), copy it into the pool slot, verify the copy's checksum, commit.
  ``fetch_s`` is the download part alone.
* ``disk_cache``: the same explicit load again: one listing finds that version already in the
  download cache (no object downloaded), then read, validate, upload and commit.
* ``cpu_cache``: the adapter was evicted from its slot (two other adapters took both slots);
  an on-demand load (what a request starts) finds its packed weights in the CPU cache: reserve,
  copy, verify, commit. No store and no file is touched.

The targets are about first tokens: the first token of a 7B model adds one prefill (not
measured here) to these figures.

Concurrency: the tiny test model (``adaptermesh_testkit.checkpoints``) served by the real
engine, with ``--adapter-resolver`` pointing at the server; 100 requests for one adapter name
that no directory holds are submitted at once. Reported: the store's downloads and GETs (a
counting wrapper around the boto3 client) and how many requests got an answer.

    .venv/bin/python bench/bench_adapter_stores.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boto3
import torch
from _results import provenance, write_results
from moto.server import ThreadedMotoServer
from safetensors.torch import save_file

from adaptermesh.worker.adapter_stores import AdapterStores
from adaptermesh.worker.adapters import AdapterManager
from adaptermesh.worker.model import LoraPool, ModelConfig
from adaptermesh.worker.types import GenerationRequest, SamplingParams

CREDENTIALS = {
    "aws_access_key_id": "bench",
    "aws_secret_access_key": "bench",
    "region_name": "us-east-1",
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class CountingClient:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.gets = 0
        self.lock = threading.Lock()

    def list_objects_v2(self, **kw: Any) -> Any:
        return self.client.list_objects_v2(**kw)

    def get_object(self, **kw: Any) -> Any:
        with self.lock:
            self.gets += 1
        return self.client.get_object(**kw)


def write_7b_adapter(out: Path, rank: int, seed: int) -> int:
    """A rank-``rank`` all-module LoRA adapter for the Llama-2-7B shape, random bf16."""
    hidden, inter, layers = 4096, 11008, 32
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, hidden),
        "v_proj": (hidden, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in MODULES:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (
                0.01 * torch.randn(fan_out, rank, generator=gen)
            ).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "meta-llama/Llama-2-7b-hf",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(f.stat().st_size for f in out.iterdir())


def upload(s3: Any, bucket: str, prefix: str, directory: Path) -> None:
    """One PUT per file, so each ETag is the file's MD5 and the download verifies it (a
    multipart upload's ETag is not an MD5 of the object)."""
    for file in sorted(directory.iterdir()):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{file.name}", Body=file.read_bytes())


async def seven_b(url: str, s3: Any, bucket: str, work: Path, repeats: int) -> dict[str, Any]:
    cfg = ModelConfig.from_dict(LLAMA2_7B)
    adapter = work / "src" / "big"
    nbytes = write_7b_adapter(adapter, 16, 1)
    small = write_7b_adapter(work / "root" / "other", 1, 2)
    write_7b_adapter(work / "root" / "other2", 1, 3)
    upload(s3, bucket, "lib/big", adapter)
    rows: dict[str, list[float]] = {"cold_s3": [], "fetch_s": [], "disk_cache": [], "cpu_cache": []}
    phases: dict[str, dict[str, float]] = {}
    gets: list[int] = []
    for i in range(repeats):
        pool = LoraPool(cfg, 2, 16, torch.device("cpu"), torch.bfloat16)
        counting = CountingClient(boto3.client("s3", endpoint_url=url, **CREDENTIALS))
        stores = AdapterStores(work / f"cache{i}", client_factory=lambda c=counting: c)
        manager = AdapterManager(
            work / "root",
            cfg,
            pool,
            max_rank=16,
            cpu_cache_bytes=1 << 30,
            dtype=torch.bfloat16,
            eviction="lru",
            stores=stores,
        )
        t0 = time.perf_counter()
        await manager.load("big", f"s3://{bucket}/lib/big")
        rows["cold_s3"].append(time.perf_counter() - t0)
        rows["fetch_s"].append(stores.counters.seconds[-1])
        phases["cold_s3"] = manager.counters.last_phases
        gets.append(counting.gets)
        t0 = time.perf_counter()
        await manager.load("big", f"s3://{bucket}/lib/big")
        rows["disk_cache"].append(time.perf_counter() - t0)
        phases["disk_cache"] = manager.counters.last_phases
        assert stores.counters.cache_hits == 1
        assert counting.gets == gets[-1]
        # Two other adapters take both slots: "big" (least recently used) leaves the GPU tier.
        await manager.load("other", None)
        await manager.load("other2", None)
        assert not manager.is_resident("big")
        t0 = time.perf_counter()
        await asyncio.gather(*manager.prefetch(["big"]))
        rows["cpu_cache"].append(time.perf_counter() - t0)
        phases["cpu_cache"] = manager.counters.last_phases
        assert manager.published["big"].source == "cpu"
    return {
        "adapter": {
            "shape": "Llama-2-7B (32 layers, hidden 4096, intermediate 11008)",
            "rank": 16,
            "modules": list(MODULES),
            "dtype": "bfloat16",
            "bytes": nbytes,
            "other_adapter_bytes": small,
        },
        "pool": "LoraPool, 2 slots, rank 16, bf16, CPU",
        "repeats": repeats,
        "gets_per_cold_load": gets,
        "seconds": {
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
            for k, v in rows.items()
        },
        "last_phases_s": phases,
    }


async def concurrent_first_requests(url: str, s3: Any, bucket: str, work: Path) -> dict[str, Any]:
    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

    model_dir = make_tiny_model(work / "tiny")
    make_adapter(work / "tiny-src", model_dir, "remote", 16, MODULES, 3)
    upload(s3, bucket, "tinylib/team/remote", work / "tiny-src" / "remote")
    (work / "tiny-root").mkdir()
    engine = Engine(
        model_dir,
        work / "tiny-root",
        config=EngineConfig(max_num_seqs=8, max_loras=4, max_lora_rank=16),
        model_name="tiny",
    )
    counting = CountingClient(boto3.client("s3", endpoint_url=url, **CREDENTIALS))
    stores = AdapterStores(
        work / "tiny-cache",
        resolvers=[f"s3://{bucket}/tinylib"],
        client_factory=lambda: counting,
    )
    engine.adapters.stores = stores
    try:
        prompt = (1, 2, 3, 4)
        t0 = time.perf_counter()
        first: list[float] = []

        async def one(i: int) -> int:
            stream = engine.submit(
                GenerationRequest(
                    f"r{i}", prompt, "team/remote", SamplingParams(max_tokens=1, temperature=0.0)
                )
            )
            count = 0
            async for event in stream:
                if event.token_id is not None:
                    if count == 0:
                        first.append(time.perf_counter() - t0)
                    count += 1
            return count

        answers = await asyncio.gather(*(one(i) for i in range(100)))
        wall = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    return {
        "model": "adaptermesh_testkit tiny Llama (CPU engine)",
        "adapter": "rank 16, all seven modules, resolved from s3 on first request",
        "requests": 100,
        "answered": sum(1 for n in answers if n >= 1),
        "downloads": stores.counters.downloads,
        "fetches": stores.counters.fetches,
        "get_requests": counting.gets,
        "first_token_s": {"min": min(first), "median": statistics.median(first), "max": max(first)},
        "wall_s": wall,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=url, **CREDENTIALS)
    s3.create_bucket(Bucket="bench-adapters")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            big = await seven_b(url, s3, "bench-adapters", work, args.repeats)
            many = await concurrent_first_requests(url, s3, "bench-adapters", work)
    finally:
        server.stop()
    return {
        **provenance("torch", "boto3", "moto", load_start=load_start),
        "store": "moto S3 server (server mode, in-process thread) on 127.0.0.1, boto3 client",
        "seven_b_adapter": big,
        "concurrent_first_requests": many,
        "targets": {
            "cold_s3_le_1_5_s": big["seconds"]["cold_s3"]["median"] <= 1.5,
            "cpu_cache_le_50_ms": big["seconds"]["cpu_cache"]["median"] <= 0.050,
            "one_download_100_answers": many["downloads"] == 1 and many["answered"] == 100,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "adapter_stores_cpu.json")
    )
    args = parser.parse_args()
    doc = asyncio.run(main_async(args))
    write_results(args.out, doc)


if __name__ == "__main__":
    main()
