"""A tensor-parallel rank other than 0: ``python -m adaptermesh.worker.tp_worker --rank R ...``.

Started by rank 0 (``tp_group.TPGroup.start``). Joins the process group, waits for the sizes
(``WorkerSetup``), builds its shard of the model, KV cache and adapter pool, then runs rank 0's
commands until ``SHUTDOWN``. Exits as soon as its parent (rank 0) is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from adaptermesh.worker import lora_ops
from adaptermesh.worker.kv_cache import KVCacheSpec, PagedKVCache
from adaptermesh.worker.model import LoraPool, ModelConfig, TransformerModel, read_weights
from adaptermesh.worker.tp_group import (
    COLLECTIVE_TIMEOUT_S,
    HEADER_WORDS,
    OP_LOAD,
    OP_SHUTDOWN,
    OP_STEP,
    TPComm,
    WorkerSetup,
    backend_for,
    decode_step,
    mask_groups,
    rank_device,
    set_collective_env,
    write_slot_shard,
)
from adaptermesh.worker.tp_shard import row_b_rows, shard_config, shard_weights

__all__ = ["RankWorker", "main"]

log = logging.getLogger(__name__)


class RankWorker:
    """One rank's shard and the loop over rank 0's commands."""

    def __init__(self, rank: int, world: int, device: torch.device, setup: WorkerSetup) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.setup = setup
        dtype = getattr(torch, setup.dtype)
        self.full_cfg = full = ModelConfig.from_dir(Path(setup.model_dir))
        self.cfg = cfg = shard_config(full, world)
        weights = shard_weights(full, read_weights(Path(setup.model_dir)), rank, world)
        self.model = TransformerModel(cfg, weights, device, dtype, setup.max_len)
        self.model.tp = TPComm(world, full.vocab_size, rank, setup.lora_scheme)
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, setup.block_size, dtype)
        self.kv = PagedKVCache(spec, setup.num_blocks, device)
        self.pool = LoraPool(
            cfg,
            setup.num_slots,
            setup.max_rank,
            device,
            dtype,
            frozenset(setup.groups),
            out_features=row_b_rows(full, world, setup.lora_scheme),
        )
        self.steps = 0

    def serve(self) -> None:
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        while True:
            dist.broadcast(header, 0)
            words = [int(x) for x in header.tolist()]
            op = words[0]
            if op == OP_SHUTDOWN:
                return
            if op == OP_STEP:
                payload = torch.empty(words[8], dtype=torch.int64, device=self.device)
                dist.broadcast(payload, 0)
                inp, lora = decode_step(words, payload)
                meta = lora_ops.build_meta(inp.token_slots, self.pool.num_slots) if lora else None
                self.model.forward(inp, self.kv, self.pool if lora else None, meta)
                self.steps += 1
            elif op == OP_LOAD:
                _, slot, lora_rank, mask, numel, scale_bits = words[:6]
                flat = torch.empty(numel, dtype=self.pool.dtype, device=self.device)
                dist.broadcast(flat, 0)
                scale = float(torch.tensor([scale_bits], dtype=torch.int64).view(torch.float64))
                ok = write_slot_shard(
                    self.pool,
                    self.full_cfg,
                    flat,
                    slot,
                    lora_rank,
                    scale,
                    mask_groups(mask),
                    self.rank,
                    self.world,
                    fail=self.setup.fail_loads_rank == self.rank,
                    scheme=self.setup.lora_scheme,
                )
                verdict = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
                if ok and int(verdict.item()) != 1:
                    LoraPool.clear(self.pool, slot)
            else:
                raise RuntimeError(f"tensor parallelism: unknown command {op}")


def _watch_parent(parent: int) -> None:
    """Exit at once when rank 0 is gone (its children would otherwise wait in a collective)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="adaptermesh.worker.tp_worker", allow_abbrev=False)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=COLLECTIVE_TIMEOUT_S)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{a.rank} %(message)s")
    threading.Thread(target=_watch_parent, args=(a.parent_pid,), daemon=True).start()
    set_collective_env()
    device = rank_device(torch.device(a.device), a.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        a.store_port,
        a.world_size,
        is_master=False,
        timeout=timedelta(seconds=a.timeout_s),
    )
    store.set(f"rank{a.rank}-up", "1")
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=a.timeout_s),
    )
    objs: list[object] = [None]
    dist.broadcast_object_list(objs, 0, device=device if device.type == "cuda" else None)
    setup = objs[0]
    assert isinstance(setup, WorkerSetup)
    ok = 1
    worker: RankWorker | None = None
    try:
        worker = RankWorker(a.rank, a.world_size, device, setup)
    except Exception:
        log.exception("rank %d could not build its shard", a.rank)
        ok = 0
    ready = torch.tensor([ok], dtype=torch.int32, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if worker is None or int(ready.item()) != 1:
        return 1
    worker.serve()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
