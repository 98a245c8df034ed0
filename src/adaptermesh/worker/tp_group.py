"""The ranks of a tensor-parallel worker over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Rank 0 is the worker process: it runs the HTTP service, the scheduler and the step loop, as
with one device. Ranks 1..N-1 are child processes (``python -m adaptermesh.worker.tp_worker``)
that hold their shard of the weights (``tp_shard``), of the paged KV cache and of the adapter
pool, and do what rank 0 tells them, in order, over the default process group:

* ``STEP``: rank 0 broadcasts a header and the step's inputs (token ids, positions, KV slots,
  adapter slots, block tables, ...), then every rank runs the same forward pass; the
  row-parallel projections all-reduce and the logits are all-gathered, and rank 0 samples.
* ``LOAD``: rank 0 broadcasts one adapter slot, whole (its staging copy), every rank writes and
  verifies its share and publishes it on its own slot only when every rank succeeded (an
  all-reduce of the verdicts): all ranks load, or none does. The manager's commit
  (``name -> slot``) happens on rank 0 afterwards, and no other rank reads a slot before rank 0
  sends a step that names it, so the swap is atomic across ranks.
* ``SHUTDOWN``: the ranks leave the loop and exit.

A lock keeps each command's collectives together (steps run on the event loop or a launch
thread, adapter uploads in worker threads). Every rank's process exits when rank 0's does (a
watchdog on the parent), and rank 0 stops the others and reports itself unhealthy when any of
them dies (``on_failure``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from adaptermesh.worker import lora_ops
from adaptermesh.worker.kv_cache import PagedKVCache
from adaptermesh.worker.lora_groups import GROUPS
from adaptermesh.worker.model import (
    GatedTerms,
    LoraPool,
    ModelConfig,
    StepInputs,
    TransformerModel,
)
from adaptermesh.worker.tp_shard import lora_a_shard, lora_b_shard, row_b_rows
from adaptermesh.worker.types import EngineError

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "HEADER_WORDS",
    "OP_LOAD",
    "OP_SHUTDOWN",
    "OP_STEP",
    "ShardedLoraPool",
    "TPComm",
    "TPGroup",
    "TPModel",
    "TensorParallelError",
    "WorkerSetup",
    "backend_for",
    "decode_step",
    "encode_step",
    "mask_groups",
    "rank_device",
    "set_collective_env",
    "write_slot_shard",
]

log = logging.getLogger(__name__)

OP_STEP, OP_LOAD, OP_SHUTDOWN = 1, 2, 3
# Collectives may wait this long: the other ranks wait in the first one while rank 0 reads its
# weights (minutes for a 70B model), and dead ranks are found by the watchdog, not by timeouts.
COLLECTIVE_TIMEOUT_S = 1800.0


class TensorParallelError(EngineError):
    """The rank group cannot serve: a rank exited, could not start, or the group is closed."""


HEADER_WORDS = 10  # int64 words of every command header


def set_collective_env() -> None:
    """NVLink multicast off (NVLS in NCCL, multicast in symmetric memory), before any init."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: ``cuda:r`` on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class TPComm:
    """The model's collectives (``model.ParallelComm``) over the default process group."""

    def __init__(self, world: int, vocab: int, rank: int = 0, scheme: str = "base-reduce") -> None:
        self.world = world
        self.vocab = vocab
        self.rank = rank
        self.scheme = scheme

    def row_lora_columns(self, width: int) -> tuple[int, int] | None:
        if self.scheme != "sharded":
            return None
        share = width // self.world
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)[:, : self.vocab]


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What rank 0 tells the other ranks once sizing is done."""

    model_dir: str
    dtype: str  # torch dtype name, e.g. "float32"
    max_len: int
    num_blocks: int
    block_size: int
    num_slots: int
    max_rank: int
    groups: tuple[str, ...]
    lora_scheme: str = "base-reduce"  # tp_shard.TP_LORA_SCHEMES
    fail_loads_rank: int = -1  # fault injection for tests: this rank refuses every load


# ---- step inputs on the wire -----------------------------------------------------------------


def encode_step(inp: StepInputs, lora: bool) -> tuple[list[int], torch.Tensor]:
    """(header, int64 payload) of one step."""
    t = int(inp.input_ids.shape[0])
    s, maxb = int(inp.block_tables.shape[0]), int(inp.block_tables.shape[1])
    header = [OP_STEP, t, s, maxb, inp.num_decode, inp.max_prefill_len, inp.num_splits, int(lora)]
    parts = [
        inp.input_ids,
        inp.positions,
        inp.slot_mapping,
        inp.token_slots,
        inp.block_tables.reshape(-1),
        inp.seq_lens,
        inp.query_start,
        inp.logits_rows,
    ]
    return header, torch.cat([p.reshape(-1).to(torch.int64) for p in parts])


def decode_step(header: list[int], payload: torch.Tensor) -> tuple[StepInputs, bool]:
    _, t, s, maxb, num_decode, max_prefill, splits, lora = header[:8]
    sizes = [t, t, t, t, s * maxb, s, s + 1, s]
    cuts, start = [], 0
    for n in sizes:
        cuts.append(payload[start : start + n])
        start += n
    ids, pos, slots, tslots, tables, lens, qstart, rows = cuts
    i32 = torch.int32
    inp = StepInputs(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        token_slots=tslots.to(i32),
        block_tables=tables.to(i32).view(s, maxb),
        seq_lens=lens.to(i32),
        query_start=qstart.to(i32),
        logits_rows=rows,
        num_decode=num_decode,
        max_prefill_len=max_prefill,
        num_splits=splits,
    )
    return inp, bool(lora)


def _broadcast_header(words: list[int], device: torch.device) -> None:
    h = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device)
    h[: len(words)] = torch.tensor(words, dtype=torch.int64)
    dist.broadcast(h, 0)


# ---- adapter slots ----------------------------------------------------------------------------


def _slot_layout(cfg: ModelConfig, max_rank: int, groups: frozenset[str]) -> list[tuple[str, int, bool, tuple[int, ...]]]:  # fmt: skip
    """(group, slice, is_b, full shape) of every tensor of one slot, in wire order."""
    out: list[tuple[str, int, bool, tuple[int, ...]]] = []
    L = cfg.num_layers
    for g, mods in GROUPS.items():
        if g not in groups:
            continue
        out.append((g, -1, False, (L, len(mods), max_rank, cfg.module_shape(mods[0])[0])))
        for i, m in enumerate(mods):
            out.append((g, i, True, (L, cfg.module_shape(m)[1], max_rank)))
    return out


def _group_mask(groups: frozenset[str]) -> int:
    return sum(1 << i for i, g in enumerate(GROUPS) if g in groups)


def mask_groups(mask: int) -> frozenset[str]:
    return frozenset(g for i, g in enumerate(GROUPS) if mask >> i & 1)


def write_slot_shard(
    pool: LoraPool,
    full_cfg: ModelConfig,
    flat: torch.Tensor,
    slot: int,
    lora_rank: int,
    scale: float,
    groups: frozenset[str],
    rank: int,
    world: int,
    fail: bool = False,
    scheme: str = "base-reduce",
) -> bool:
    """Write this rank's share of a whole slot (``flat``, in ``_slot_layout`` order) into
    ``slot`` of ``pool`` (a LoraPool of the rank's shard config) and verify it by float64 sums.
    Publishes the slot's rank and scale only when the copy verified; returns the verdict."""
    LoraPool.zero_slot(pool, slot)
    offset = 0
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for g, i, is_b, shape in _slot_layout(full_cfg, pool.max_rank, pool.groups):
        n = 1
        for d in shape:
            n *= d
        full = flat[offset : offset + n].view(shape)
        offset += n
        if is_b:
            src = lora_b_shard(g, full, rank, world, scheme)
            dst = pool.b[g][i][:, slot]
        else:
            src = lora_a_shard(g, full, rank, world)
            dst = pool.a[g][:, :, slot]
        dst.copy_(src)
        got.append(dst.sum(dtype=torch.float64))
        want.append(src.sum(dtype=torch.float64))
    g_sum, w_sum, w_abs = (
        torch.stack(got).sum().item(),
        torch.stack(want).sum().item(),
        torch.stack(want).abs().sum().item(),
    )
    ok = (
        not fail
        and offset == flat.numel()
        and w_sum == w_sum
        and abs(w_sum) != float("inf")
        and abs(g_sum - w_sum) <= 1e-7 * (1.0 + w_abs)
    )
    if ok:
        LoraPool.set_slot(pool, slot, lora_rank, scale, groups)
    else:
        LoraPool.clear(pool, slot)
    return ok


# ---- rank 0 -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TPGroup:
    """Rank 0's handle on the group: starts the other ranks, sends them commands, watches them."""

    def __init__(self, world: int, device: torch.device, procs: list[subprocess.Popen[bytes]]) -> None:  # fmt: skip
        self.world = world
        self.device = device
        self.procs = procs
        self.lock = threading.Lock()
        self.failed_rank: int | None = None
        self.closed = False
        self.ready = False  # every rank has built its shard (``setup``)
        # Called once (from the watchdog thread) when a rank other than 0 dies; the CLI
        # stops the worker process.
        self.on_failure: Callable[[int], None] | None = None
        self._watch = threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True)
        self._watch.start()

    @classmethod
    def start(
        cls, world: int, device: torch.device, *, timeout_s: float = COLLECTIVE_TIMEOUT_S
    ) -> TPGroup:
        """Spawn ranks 1..world-1 and join them in the default process group as rank 0."""
        if world < 2:
            raise ValueError(f"tensor_parallel_size: a group needs at least 2 ranks, got {world}")
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size: {world} ranks need {world} GPUs, "
                f"{torch.cuda.device_count()} are visible"
            )
        if dist.is_initialized():
            raise TensorParallelError("tensor parallelism: a process group is already initialised")
        set_collective_env()
        port = _free_port()
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            port,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "adaptermesh.worker.tp_worker",
                    "--rank",
                    str(r),
                    "--world-size",
                    str(world),
                    "--store-port",
                    str(port),
                    "--device",
                    device.type,
                    "--parent-pid",
                    str(os.getpid()),
                ],
                # The rank's torch takes the thread count the worker chose (--cpu-threads): it
                # starts its own interpreter, which would count every core again.
                env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
            )
            for r in range(1, world)
        ]
        try:
            # Each rank checks in on the store before it joins the group: a rank that dies
            # while starting (a bad install, no GPU) fails the start at once, not at a timeout.
            for r, p in enumerate(procs, start=1):
                while not store.check([f"rank{r}-up"]):
                    if p.poll() is not None:
                        raise TensorParallelError(
                            f"tensor parallelism: rank {r} exited while starting "
                            f"(status {p.returncode})"
                        )
                    time.sleep(0.05)
            if device.type == "cuda":
                torch.cuda.set_device(rank_device(device, 0))
            dist.init_process_group(
                backend_for(device),
                store=store,
                rank=0,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
        return cls(world, device, procs)

    # ---- commands ----

    def setup(self, setup: WorkerSetup) -> None:
        """Send the other ranks their sizes; returns once every rank built its shard."""
        self._check()
        with self.lock:
            dist.broadcast_object_list([setup], 0, device=self._obj_device())
            ready = torch.ones(1, dtype=torch.int32, device=self.device)
            dist.all_reduce(ready, op=dist.ReduceOp.MIN)
        if int(ready.item()) != 1:
            raise TensorParallelError("tensor parallelism: a rank could not build its shard")
        self.ready = True

    def _obj_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def send_step(self, inp: StepInputs, lora: bool) -> None:
        """Under ``lock``: the header and inputs of one step (rank 0 then runs its forward)."""
        self._check()
        header, payload = encode_step(inp, lora)
        header.append(int(payload.numel()))
        _broadcast_header(header, self.device)
        dist.broadcast(payload.to(self.device), 0)

    def load_slot(
        self,
        pool: ShardedLoraPool,
        flat: torch.Tensor,
        slot: int,
        lora_rank: int,
        scale: float,
        groups: frozenset[str],
    ) -> bool:
        """Every rank writes its share of ``flat`` into ``slot``; True when all verified (then
        every rank has published it), False when any failed (then none has)."""
        self._check()
        scale_bits = int(torch.tensor([scale], dtype=torch.float64).view(torch.int64).item())
        with self.lock:
            # The upload runs on its own stream (and thread): finish every step queued before
            # it, and the load itself before any later step, so the communicator's collectives
            # run on this rank in the order every other rank issues them.
            self._sync()
            _broadcast_header(
                [OP_LOAD, slot, lora_rank, _group_mask(groups), int(flat.numel()), scale_bits],
                self.device,
            )
            dist.broadcast(flat, 0)
            ok = write_slot_shard(
                pool, pool.full_cfg, flat, slot, lora_rank, scale, groups, 0, self.world,
                scheme=pool.scheme,
            )  # fmt: skip
            verdict = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
            every = int(verdict.item()) == 1
            if ok and not every:
                LoraPool.clear(pool, slot)
            self._sync()
        return every

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- liveness and shutdown ----

    def ranks_up(self) -> tuple[bool, ...]:
        """Each rank's liveness: rank 0 (this process) and whether each child still runs."""
        return (True, *(p.poll() is None for p in self.procs))

    def _check(self) -> None:
        if self.failed_rank is not None:
            raise TensorParallelError(f"tensor parallelism: rank {self.failed_rank} has exited")
        if self.closed:
            raise TensorParallelError("tensor parallelism: the group is shut down")

    def _watchdog(self) -> None:
        while not self.closed:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self.closed:
                    self.failed_rank = r
                    log.error("tensor-parallel rank %d exited with %s", r, p.returncode)
                    self._stop_children()
                    if not self.ready and self.device.type == "cuda":
                        # Rank 0 waits in the set-up collective, which NCCL does not give up
                        # on when a peer dies: leave rather than hang.
                        os._exit(1)
                    if self.on_failure is not None:
                        self.on_failure(r)
                    return
            time.sleep(0.1)

    def _stop_children(self, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the ranks to exit, wait for them (killing stragglers), leave the group."""
        if self.closed:
            return
        healthy = self.failed_rank is None and all(self.ranks_up())
        if healthy and self.lock.acquire(timeout=timeout_s):
            try:
                _broadcast_header([OP_SHUTDOWN], self.device)
            except Exception:  # a rank died meanwhile: the children are stopped below
                log.exception("tensor parallelism: shutdown message failed")
            finally:
                self.lock.release()
        self.closed = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self._stop_children(grace_s=1.0)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class ShardedLoraPool(LoraPool):
    """Rank 0's shard of the adapter pool. A load writes the whole slot into a staging copy
    (``slot_view``, full shapes), and ``set_slot`` hands it to every rank (``TPGroup.load_slot``);
    ``slot_sum`` is the staging's sum when every rank verified its share, +inf otherwise (so the
    manager's check fails the load and it publishes nothing)."""

    def __init__(
        self,
        full_cfg: ModelConfig,
        shard_cfg: ModelConfig,
        group: TPGroup,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        groups: frozenset[str] | None = None,
        scheme: str = "base-reduce",
    ) -> None:
        super().__init__(
            shard_cfg,
            num_slots,
            max_rank,
            device,
            dtype,
            groups,
            out_features=row_b_rows(full_cfg, group.world, scheme),
        )
        self.full_cfg = full_cfg
        self.scheme = scheme
        self.group = group
        self._staging: dict[int, list[torch.Tensor]] = {}
        self._index: dict[tuple[str, int, bool], int] = {}
        self._verdict: dict[int, bool] = {}

    def zero_slot(self, slot: int, written: Mapping[str, int] | None = None) -> None:
        layout = _slot_layout(self.full_cfg, self.max_rank, self.groups)
        self._index = {(g, i, b): k for k, (g, i, b, _) in enumerate(layout)}
        self._staging[slot] = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for *_, shape in layout
        ]

    def slot_view(
        self, group: str, index: int, layer: int, slot: int, rank: int, is_b: bool
    ) -> torch.Tensor:
        parts = self._staging[slot]
        if is_b:
            return parts[self._index[(group, index, True)]][layer, :, :rank]
        return parts[self._index[(group, -1, False)]][layer, index, :rank]

    def set_slot(self, slot: int, rank: int, scale: float, groups: frozenset[str]) -> None:
        parts = self._staging.get(slot)
        if parts is None:
            raise RuntimeError(f"slot {slot}: set_slot without a staged copy (zero_slot first)")
        flat = torch.cat([p.reshape(-1) for p in parts])
        self._verdict[slot] = self.group.load_slot(self, flat, slot, rank, scale, groups)

    def slot_sum(self, slot: int) -> torch.Tensor:
        parts = self._staging.pop(slot, None)
        ok = self._verdict.pop(slot, False)
        if parts is None or not ok:
            return torch.full((), float("inf"), dtype=torch.float64, device=self.device)
        return torch.stack([p.sum(dtype=torch.float64) for p in parts]).sum()


class TPModel(TransformerModel):
    """Rank 0's shard of the model: each forward first sends the step to the other ranks, and
    all ranks then run it together (the collectives inside keep them in step)."""

    def __init__(
        self,
        shard_cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_len: int,
        group: TPGroup,
        vocab: int,
        scheme: str = "base-reduce",
    ) -> None:
        super().__init__(shard_cfg, weights, device, dtype, max_len)
        self.group = group
        self.tp = TPComm(group.world, vocab, 0, scheme)

    @torch.inference_mode()
    def forward(
        self,
        inp: StepInputs,
        kv: PagedKVCache,
        pool: LoraPool | None,
        meta: lora_ops.LoraBatchMeta | None,
        gated: GatedTerms | None = None,
    ) -> torch.Tensor:
        if gated is not None:
            raise RuntimeError("tensor parallelism: AdaFuse expert sets are not supported")
        with self.group.lock:
            self.group.send_step(inp, pool is not None and meta is not None)
            return super().forward(inp, kv, pool, meta)
