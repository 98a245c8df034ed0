"""Worker-engine speed benchmark: decode latency and throughput, sampling, prefix caching, KV
capacity and the host/GPU split of a step, against a plain transformers baseline.

Model: Llama-2-7B shape (32 layers, hidden 4096, 32 heads, 32 KV heads, MLP 11008, vocab 32000)
with random bf16 weights made on the GPU (``bench_engine.random_weights``); nothing is
downloaded. Adapters: 64 PEFT adapters of rank 16 on all seven projection modules, written to
disk and loaded by the engine like any other adapter. Every figure below is timed by this script,
in one process and one run, and the results JSON is rewritten after every section, so a run cut
short by its time limit keeps what finished.

Sections (in the order they run):
  batch1      engine decode ms/token at batch 1 (prompt 128, 128 tokens, greedy): the backbone
              and one adapter; the share of the measured copy bandwidth that the bytes a decode
              step must read (weights + KV) imply.
  batch64     64 concurrent requests (prompt 128 / 128 tokens, greedy) with 64 distinct
              adapters, with 1 adapter, and base only: decode tok/s over the window where all 64
              decode.
  sampling    the 64-distinct run at temperature 1.0, top_p 0.9 (seeded), against greedy runs
              interleaved with it.
  prefix      time to first token of a 1,024-token system prompt + 32 user tokens: the first
              request (cold), the next five (prefix-cache hits), and the same under another
              adapter (the cache is keyed by adapter, so it must be cold again).
  logprobs    batch-64 decode (base model, greedy) with every row asking logprobs with the top 5
              alternatives against the same batch asking none, interleaved: decode tok/s of both
              and their ratio (the engine's logprob gather runs after each step, on its logits).
  kernels     batch-64 decode of the three batch64 configurations under torch.profiler: each
              step's device time by kernel and by kind (base GEMMs, LoRA shrink/expand, attention,
              norms, rotary, sampling, copies, the rest), the GPU's busy share of the step, and
              the kernels that cost the LoRA configurations more than the base one: where each
              microsecond of the adapter terms goes.
  capacity    the KV cache of the engine above (40 GiB, max_model_len >= 2048): its token
              capacity, sequences of a full 2,048-token context that fit at once, and the peak
              number of 200 requests (256-token prompts, 16 tokens) running at once.
  step_split  a second engine with ``profile_steps=True``: median host and GPU ms per decode
              step at batch 1, 64 and 256, and kernel launches per step from torch.profiler.
  hf_static   transformers ``LlamaForCausalLM`` with the same weights, ``generate()`` with a
              static cache (decode compiled by torch.compile with CUDA graphs), batch 1 and 64.
              Last, because its compilation takes minutes and the engine figures matter more.
  targets     each target row, computed from the figures above.

Floors (7B shape, bf16): a decode step reads every weight once (13.2 GB with the LM head) plus
the KV of every context token (0.5 MiB per token: 2 x 32 layers x 4096 x 2 bytes); a rank-16
all-seven-module adapter adds 80 MB per distinct adapter in the batch. At the ~4.3 TB/s a
device-to-device copy reaches on an H200, batch 1 at 192 tokens of mean context cannot beat
~3.1 ms/token, and 64 distinct adapters (5.1 GB of adapter weights per step) cannot reach more
than ~0.80x the tok/s of one shared adapter. 40 GiB holds 81,920 tokens of KV: 40 sequences of
2,048 tokens, whatever the cache layout. The JSON carries these floors beside the measurements.

Usage:
    python bench/bench_engine_speed.py                        # CUDA: bench/results/engine_speed_h200.json
    python bench/bench_engine_speed.py --tiny --out /tmp/s.json  # CPU smoke run, tiny model, seconds
    python bench/bench_engine_speed.py --skip hf_static --budget-s 240
    python bench/bench_engine_speed.py --only logprobs --out bench/results/engine_speed_logprobs_h200.json
    python bench/bench_engine_speed.py --base-quant fp8 --only batch1,batch64   # FP8 base

``--base-quant fp8|awq``: the main engine serves a quantised copy of the synthetic base, made by
this script from the same random weights: ``fp8``, compressed-tensors float8 with one e4m3 scale
per output channel (llm-compressor's FP8_DYNAMIC layout); ``awq``, AutoAWQ GEMM 4-bit, group
128, zero points. The tensors go to the engine as a checkpoint would give them and config.json
carries their ``quantization_config``; the engine keeps them packed on the GPU
(``EngineConfig.quant_kernels``). The floors then count the packed bytes; hf_static stays bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
SRC_DIR = BENCH_DIR.parent / "src"
GiB = 1 << 30
MiB = 1 << 20

# The tiny shape of bench_service.py: byte-level vocabulary, so any prompt id decodes.
SHAPE_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 384,
    "max_position_embeddings": 512,
}
SECTIONS = (
    "batch1",
    "batch64",
    "sampling",
    "prefix",
    "logprobs",
    "kernels",
    "capacity",
    "step_split",
    "hf_static",
)
MAIN_ENGINE_SECTIONS = (
    "batch1",
    "batch64",
    "sampling",
    "prefix",
    "logprobs",
    "kernels",
    "capacity",
)
# Rough H200 seconds per section (engine builds included where the section builds one); a
# section is skipped when --budget-s leaves less than this, so the run ends inside its limit.
SECTION_ESTIMATE_S = {
    "batch1": 20,
    "batch64": 40,
    "sampling": 25,
    "prefix": 15,
    "logprobs": 25,
    "kernels": 30,
    "capacity": 25,
    "step_split": 60,
    "hf_static": 100,
}
HF_BATCH_ESTIMATE_S = (
    90  # one batch size of hf_static: torch.compile of the decode step + timed runs
)
OLD_DESIGN_SLOTS = 64  # the slot KV cache: one max_model_len slot per decode row, 64 rows


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload sizes. GPU values are the benchmark; TINY scales each down for the CPU smoke run."""

    adapters: int = 64
    rank: int = 16
    prompt: int = 128
    new_tokens: int = 128
    batch: int = 64
    repeats: int = 3
    # Main engine (every section but step_split runs on it).
    max_model_len: int = 2304
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # 64 prompts of 128 tokens prefill in one step
    max_prefill_chunk: int = 2048
    kv_cache_bytes: int = 40 * GiB
    # capacity
    capacity_ctx: int = 2048
    # More requests than the KV holds at once (544 tokens each: 150 in 40 GiB, below
    # max_num_seqs), so the measured peak shows which bound binds.
    capacity_requests: int = 240
    capacity_prompt: int = 512
    capacity_new_tokens: int = 32
    # prefix
    system_prompt: int = 1024
    user_tokens: int = 32
    prefix_warm: int = 5
    prefix_rounds: int = 3  # distinct system prompts; cold and warm are medians over them
    # logprobs
    logprobs_batch: int = 64
    logprobs_top: int = 5
    logprobs_new_tokens: int = 128
    # step_split (its own engine)
    split_batches: tuple[int, ...] = (1, 64, 256)
    split_prompt: int = 32
    split_new_tokens: int = 64
    split_kv_bytes: int = 16 * GiB
    split_max_model_len: int = 512
    profile_window_steps: int = 20
    # hf_static
    hf_prompt: int = 32
    hf_new_tokens: int = 128
    hf_batches: tuple[int, ...] = (1, 64)
    # copy bandwidth
    copy_bytes: int = 2 * GiB


TINY = Sizes(
    adapters=8,
    prompt=16,
    new_tokens=8,
    batch=8,
    repeats=2,
    max_model_len=512,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    max_prefill_chunk=256,
    kv_cache_bytes=2 * MiB,
    capacity_ctx=256,
    capacity_requests=96,
    capacity_prompt=32,
    capacity_new_tokens=4,
    system_prompt=64,
    user_tokens=8,
    prefix_warm=3,
    logprobs_new_tokens=32,
    split_batches=(1, 4, 16),
    split_prompt=8,
    split_new_tokens=10,
    split_kv_bytes=4 * MiB,
    split_max_model_len=128,
    profile_window_steps=3,
    hf_prompt=8,
    hf_new_tokens=8,
    hf_batches=(1, 8),
    copy_bytes=64 * MiB,
)


def log(msg: str) -> None:
    print(f"[bench_engine_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ====================================================================== shape arithmetic
def kv_bytes_per_token(shape: dict[str, int], dtype_bytes: int) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype_bytes


def weight_bytes_per_step(shape: dict[str, int], dtype_bytes: int, rows: int) -> int:
    """Bytes of weights one decode step reads: every matrix once, one embedding row per row."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kvd = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = 2 * h * h + 2 * kvd * h + 3 * h * inter + 2 * h
    return (shape["num_hidden_layers"] * layer + v * h + h + rows * h) * dtype_bytes


def quant_weight_bytes_per_step(
    shape: dict[str, int], dtype_bytes: int, rows: int, quant: str, group: int = 128
) -> int:
    """``weight_bytes_per_step`` with every projection in its packed form (``quant.packed_bytes``):
    the embedding rows, norms and LM head stay at ``dtype_bytes``."""
    from adaptermesh.worker.quant import packed_bytes

    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kvd = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    method = "compressed-tensors" if quant == "fp8" else "awq"
    proj = (
        packed_bytes(h, h + 2 * kvd, method, group)
        + packed_bytes(h, h, method, group)
        + packed_bytes(h, 2 * inter, method, group)
        + packed_bytes(inter, h, method, group)
    )
    rest = shape["num_hidden_layers"] * 2 * h + v * h + h + rows * h
    return shape["num_hidden_layers"] * proj + rest * dtype_bytes


def step_weight_bytes(b: Bench, rows: int) -> int:
    if b.args.base_quant:
        return quant_weight_bytes_per_step(
            b.shape, b.dtype_bytes, rows, b.args.base_quant, b.quant_group
        )
    return weight_bytes_per_step(b.shape, b.dtype_bytes, rows)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column 8 j + [i]


def _awq_pack(v: Any) -> Any:
    """int [rows, cols] 0..15 -> int32 [rows, cols / 8] in AutoAWQ's interleaved order."""
    import torch

    rows, cols = v.shape
    g = v.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, device=v.device, dtype=torch.int64)
    words = (g << shifts).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_base(weights: dict[str, Any], quant: str, group: int = 128) -> dict[str, Any]:
    """The synthetic base as a quantised checkpoint's tensors, every projection converted on
    the weights' device and left there (the engine's load then repacks on the GPU, and the
    dense bf16 projections are freed one by one); the rest as is."""
    import torch

    out: dict[str, Any] = {}
    for name in list(weights):
        t = weights.pop(name)
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ):  # fmt: skip
            out[name] = t
            continue
        w = t.float()
        if quant == "fp8":
            scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
            out[name] = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            out[module + ".weight_scale"] = scale.to(torch.bfloat16)
        else:
            n, k = w.shape
            g = w.T.reshape(k // group, group, n)  # [groups, group, out]
            lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8).half()
            z = torch.round(-lo / s.float()).clamp(0, 15)
            q = (torch.round(g / s.float()[:, None, :]) + z[:, None, :]).clamp(0, 15)
            out[module + ".qweight"] = _awq_pack(q.reshape(k, n))
            out[module + ".qzeros"] = _awq_pack(z)
            out[module + ".scales"] = s
        del t, w
    return out


QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    },
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": None,
    },
}


def adapter_bytes(shape: dict[str, int], rank: int, dtype_bytes: int = 2) -> int:
    """A and B of a rank-``rank`` adapter on all seven modules of every layer (bf16 on the GPU)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kvd = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    in_out = (h + h) + 2 * (h + kvd) + (h + h) + 2 * (h + inter) + (inter + h)
    return shape["num_hidden_layers"] * rank * in_out * dtype_bytes


# ====================================================================== header
def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no NVML on this machine: the header says so
        return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or fails to import here: the header says None
            out[mod] = None
    import torch

    out["cuda"] = torch.version.cuda
    return out


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> dict[str, Any]:
    """A large device-to-device copy (random bytes); bytes read + written over the median time."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        if device == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    assert torch.equal(dst[:4096], src[:4096])
    med = statistics.median(times)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "GB_s": 2 * nbytes / med / 1e9,
        "bytes_per_copy": nbytes,
        "bytes_counted": 2 * nbytes,
        "median_s": med,
        "min_s": min(times),
        "repeats": reps,
        "method": "dst.copy_(src), bytes read + written, median of repeats after 3 warm-ups",
    }


# ====================================================================== the run
class Bench:
    """Holds the run's inputs and its results; each section fills one key and saves."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, device: str, out: Path) -> None:
        import bench_engine as be
        import torch

        self.args, self.s, self.device, self.out = args, sizes, device, out
        self.be = be
        self.shape: dict[str, int] = dict(SHAPE_TINY if args.tiny else be.SHAPE_7B)
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.dtype_bytes = 2 if device == "cuda" else 4
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s if args.budget_s else None
        self.selected = [
            s for s in SECTIONS if (not args.only or s in args.only) and s not in args.skip
        ]
        self._rid = itertools.count()
        self.work = Path(tempfile.mkdtemp(prefix="bench_engine_speed_"))
        self.model_dir = self.work / "model"
        self.root = self.work / "adapters"
        self.names = [f"ad{i:02d}" for i in range(sizes.adapters)]
        self.copy_Bps = 0.0
        self.result: dict[str, Any] = {"bench": "bench_engine_speed", "header": {}, "engines": {}}

    # ---- bookkeeping
    @property
    def quant_group(self) -> int:
        return 32 if self.args.tiny else 128  # the tiny shape's hidden size is 64

    def quant_config(self) -> dict[str, Any] | None:
        if not self.args.base_quant:
            return None
        cfg = json.loads(json.dumps(QUANT_CONFIGS[self.args.base_quant]))
        if "group_size" in cfg:
            cfg["group_size"] = self.quant_group
        return dict(cfg)

    def save(self) -> None:
        self.result["targets"] = compute_targets(self.result)
        self.result["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, self.out)

    def rid(self, tag: str) -> str:
        return f"{tag}-{next(self._rid)}"

    def prompt(self, seed: int, n: int) -> tuple[int, ...]:
        rng = random.Random(seed)
        return tuple(rng.randrange(3, self.shape["vocab_size"]) for _ in range(n))

    def skip_reason(self, name: str) -> str | None:
        if name not in self.selected:
            return "not selected (--only/--skip)"
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < SECTION_ESTIMATE_S[name]:
                return f"time budget: {left:.0f} s left, the section needs ~{SECTION_ESTIMATE_S[name]} s"
        return None

    async def section(
        self, name: str, fn: Callable[..., Awaitable[dict[str, Any]]], *a: Any
    ) -> None:
        reason = self.skip_reason(name)
        if reason is not None:
            log(f"{name}: skipped ({reason})")
            self.result[name] = {"skipped": reason}
            self.save()
            return
        log(f"{name}: start")
        t = time.monotonic()
        try:
            out = await fn(*a)
        except Exception as e:  # recorded; the other sections still run
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            log(f"{name} failed: {type(e).__name__}: {e}")
        out["section_s"] = time.monotonic() - t
        self.result[name] = out
        self.save()
        log(f"{name}: done in {out['section_s']:.1f} s")

    # ---- setup
    def header(self) -> None:
        import torch

        h: dict[str, Any] = {
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "hostname": socket.gethostname(),
            "command": shlex.join([sys.executable, *sys.argv]),
            "cwd": os.getcwd(),
            "device": self.device,
            "gpu": torch.cuda.get_device_name(0) if self.device == "cuda" else None,
            "driver": driver_version() if self.device == "cuda" else None,
            "versions": versions(),
            "mode": "tiny (CPU smoke run)" if self.args.tiny else "benchmark",
            "shape": self.shape,
            "dtype": str(self.dtype),
            "weights": "random (bench_engine.random_weights, seed 0)",
            "base_quant": self.args.base_quant,
            "base_quantization_config": self.quant_config(),
            "adapters": {
                "count": self.s.adapters,
                "rank": self.s.rank,
                "targets": list(self.be.ALL7),
                "dora": self.args.dora,
                "format": "PEFT safetensors, bf16",
                "bytes_on_device_each": adapter_bytes(self.shape, self.s.rank, self.dtype_bytes),
            },
            "sizes": dataclasses.asdict(self.s),
            "sections_selected": self.selected,
            "budget_s": self.args.budget_s,
        }
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            h["gpu_memory_bytes"] = p.total_memory
            h["sm_count"] = p.multi_processor_count
        self.result["header"] = h
        log("measuring copy bandwidth")
        h["copy_bandwidth"] = copy_bandwidth(self.device, self.s.copy_bytes)
        self.copy_Bps = h["copy_bandwidth"]["GB_s"] * 1e9
        log(f"copy bandwidth {h['copy_bandwidth']['GB_s']:.0f} GB/s (read + write)")
        h["floors"] = self.floors()
        self.save()

    def floors(self) -> dict[str, Any]:
        """Byte floors of the decode workloads at the measured copy bandwidth."""
        s, db = self.s, self.dtype_bytes
        kvpt = kv_bytes_per_token(self.shape, db)
        ad = adapter_bytes(self.shape, s.rank, db)
        ctx = s.prompt + s.new_tokens / 2  # mean context over the decode steps of one request
        b1 = step_weight_bytes(self, 1) + kvpt * ctx
        b64 = {
            label: step_weight_bytes(self, s.batch) + s.batch * ctx * kvpt + n * ad
            for label, n in (("distinct", s.adapters), ("one_adapter", 1), ("base", 0))
        }
        tok_s = {k: s.batch / (v / self.copy_Bps) for k, v in b64.items()}
        return {
            "kv_bytes_per_token": kvpt,
            "adapter_bytes": ad,
            "mean_decode_context": ctx,
            "weight_bytes_per_decode_step": step_weight_bytes(self, 1),
            "batch1_bytes_per_step": b1,
            "batch1_floor_ms_per_token": 1e3 * b1 / self.copy_Bps,
            "batch64_bytes_per_step": b64,
            "batch64_floor_tok_s": tok_s,
            "batch64_distinct_vs_one_at_floor": tok_s["distinct"] / tok_s["one_adapter"],
            "kv_tokens_in_budget": s.kv_cache_bytes // kvpt,
            "full_ctx_sequences_in_budget": s.kv_cache_bytes // kvpt // s.capacity_ctx,
            "note": "bytes a step must read (weights once, KV of every context token, each distinct "
            "adapter's A and B) over the measured copy bandwidth; no engine runs faster",
        }

    def write_adapters(self) -> None:
        from adaptermesh_testkit.checkpoints import make_model_config, make_tokenizer

        make_tokenizer(self.model_dir)
        cfg = make_model_config("llama", **self.shape)
        if self.args.base_quant:
            cfg["quantization_config"] = self.quant_config()
        (self.model_dir / "config.json").write_text(json.dumps(cfg))
        t = time.perf_counter()
        for i, name in enumerate(self.names):
            self.be.write_adapter(
                self.root,
                name,
                self.shape,
                self.s.rank,
                i,
                self.device,
                self.be.ALL7,
                dora=self.args.dora,
            )
        self.result["header"]["adapter_write_s"] = time.perf_counter() - t
        log(f"wrote {len(self.names)} adapters in {time.perf_counter() - t:.1f} s")

    async def open_engine(self, label: str, **overrides: Any) -> Any:
        import torch

        from adaptermesh.worker.engine import Engine, EngineConfig

        s = self.s
        kw: dict[str, Any] = dict(
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_loras=s.adapters,
            max_lora_rank=s.rank,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_prefill_chunk=s.max_prefill_chunk,
            kv_cache_bytes=s.kv_cache_bytes,
            use_cuda_graphs=True,
            block_size=16,
            enable_prefix_caching=True,
            profile_steps=False,
        )
        if self.args.base_quant:
            # On CUDA "auto" packs too; "on" also runs the packed path (its twins) in --tiny.
            kw["quant_kernels"] = "on"
        if label == "main":
            if self.args.dora:
                kw["lora_dora"] = True
            kw.update(self.args.config_overrides)
        kw.update(overrides)
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unsupported = sorted(k for k in kw if k not in known)
        cfg = EngineConfig(**{k: v for k, v in kw.items() if k in known})
        entry: dict[str, Any] = {
            "config": dataclasses.asdict(cfg),
            "unsupported_config_fields": unsupported,
        }
        self.result["engines"][label] = entry
        if unsupported:
            log(f"engine {label}: EngineConfig lacks {unsupported}; built without them")
        weights = self.be.random_weights(self.shape, self.device, self.dtype)
        if self.args.base_quant:
            t = time.perf_counter()
            weights = quantize_base(weights, self.args.base_quant, self.quant_group)
            entry["quantize_base_s"] = time.perf_counter() - t
            if self.device == "cuda":
                torch.cuda.empty_cache()  # the dense copies: gone before the engine sizes itself
        t = time.perf_counter()
        eng = Engine(
            self.model_dir,
            self.root,
            device=self.device,
            dtype=self.dtype,
            config=cfg,
            model_name="llama-7b-shape",
            weights=weights,
        )
        del weights
        entry["build_s"] = time.perf_counter() - t
        entry["weights_bytes"] = eng.model.nbytes
        entry["packed_projections"] = len(eng.model.packed)
        t = time.perf_counter()
        await asyncio.gather(*eng.prefetch(self.names))
        entry["prefetch_s"] = time.perf_counter() - t
        entry["describe"] = eng.describe()
        log(
            f"engine {label}: built in {entry['build_s']:.1f} s, {len(self.names)} adapters prefetched in "
            f"{entry['prefetch_s']:.1f} s; kv_tokens {entry['describe'].get('kv_tokens')}, "
            f"graph_buckets {entry['describe'].get('graph_buckets')}"
        )
        self.save()
        return eng

    async def close_engine(self, label: str, eng: Any) -> None:
        with contextlib.suppress(Exception):  # a failed describe() must not stop the shutdown
            self.result["engines"][label]["describe_at_end"] = eng.describe()
        await eng.shutdown()

    def free_memory(self, label: str) -> None:
        """After the last reference to an engine is dropped: give its device memory back."""
        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.result["engines"].setdefault(label, {})["gpu_free_bytes_after_shutdown"] = (
                torch.cuda.mem_get_info()[0]
            )
        self.save()


# ====================================================================== request helpers
async def trace(
    eng: Any,
    rid: str,
    ids: tuple[int, ...],
    adapter: str | None,
    sp: Any,
    on_token: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One request: submit time, the arrival time of every token, the final counts."""
    from adaptermesh.worker.types import GenerationRequest

    t0 = time.perf_counter()
    stamps: list[float] = []
    last = None
    async for ev in eng.submit(GenerationRequest(rid, ids, adapter, sp)):
        if ev.token_id is not None:
            stamps.append(time.perf_counter())
            if on_token is not None:
                on_token(len(stamps))
        last = ev
    return {
        "t0": t0,
        "stamps": stamps,
        "finish_reason": last.finish_reason if last else None,
        "completion_tokens": last.completion_tokens if last else 0,
    }


def decode_ms(tr: dict[str, Any]) -> float | None:
    st = tr["stamps"]
    return 1e3 * (st[-1] - st[0]) / (len(st) - 1) if len(st) > 1 else None


def ttft_ms(tr: dict[str, Any]) -> float | None:
    return 1e3 * (tr["stamps"][0] - tr["t0"]) if tr["stamps"] else None


async def run_batch(
    b: Bench,
    eng: Any,
    adapters: list[str | None],
    prompt_len: int,
    new_tokens: int,
    seed: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_token: Callable[[int, int], None] | None = None,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """Submit one request per entry of ``adapters`` at once. Decode tok/s counts the tokens that
    arrived while every request was decoding: after the last first token, up to the first last
    token. Prompts are distinct per request and per call, so no run reuses another's prefix."""
    from adaptermesh.worker.types import SamplingParams

    def sp(i: int) -> Any:
        return SamplingParams(
            max_tokens=new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=(seed * 1009 + i) if temperature > 0 else None,
            logprobs=logprobs,
        )

    t0 = time.perf_counter()
    traces = await asyncio.gather(
        *(
            trace(
                eng,
                b.rid("batch"),
                b.prompt(seed * 100_003 + i, prompt_len),
                a,
                sp(i),
                None if on_token is None else (lambda n, i=i: on_token(i, n)),
            )
            for i, a in enumerate(adapters)
        )
    )
    firsts = [tr["stamps"][0] for tr in traces if tr["stamps"]]
    lasts = [tr["stamps"][-1] for tr in traces if tr["stamps"]]
    t_a, t_b = max(firsts), min(lasts)
    if t_b > t_a:
        n = sum(1 for tr in traces for t in tr["stamps"] if t_a < t <= t_b)
        rate, window = n / (t_b - t_a), t_b - t_a
    else:  # some request ended before the last one started: count each request's own decode
        n = sum(len(tr["stamps"]) - 1 for tr in traces)
        window = max(lasts) - t_a
        rate = n / window if window > 0 else None
    return {
        "decode_tok_s": rate,
        "window_s": window,
        "window_tokens": n,
        "ttft_max_ms": 1e3 * (t_a - t0),
        "wall_s": max(lasts) - t0,
        "completion_tokens": sum(tr["completion_tokens"] for tr in traces),
        "finish_reasons": sorted({str(tr["finish_reason"]) for tr in traces}),
    }


# ====================================================================== sections
async def sec_batch1(b: Bench, eng: Any) -> dict[str, Any]:
    from adaptermesh.worker.types import SamplingParams

    s = b.s
    sp = SamplingParams(max_tokens=s.new_tokens)
    configs = [("backbone", None), ("lora_r16_all7", b.names[0])]
    # The LoRA shrink beside the base matmul on a side stream (EngineConfig.lora_overlap) against
    # the same engine with it off (graphs are keyed by the path, so each has its own), interleaved.
    side = getattr(getattr(eng, "model", None), "lora_side", None)
    if side is not None:
        configs.append(("lora_r16_all7_serial", b.names[0]))

    async def one(label: str, name: str | None, rid: str, prompt: Any) -> Any:
        if label.endswith("_serial"):
            eng.model.lora_side = None
        try:
            return await trace(eng, rid, prompt, name, sp)
        finally:
            if side is not None:
                eng.model.lora_side = side

    for label, name in configs:  # warm-up: batch-1 graph capture, prefill of this length
        await one(label, name, b.rid(f"b1warm-{label}"), b.prompt(10_000 + len(label), s.prompt))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
    for k in range(s.repeats):  # interleaved: clock drift hits both alike
        for j, (label, name) in enumerate(configs):
            tr = await one(
                label, name, b.rid(f"b1-{label}"), b.prompt(11_000 + 10 * k + j, s.prompt)
            )
            runs[label].append(
                {
                    "decode_ms_per_token": decode_ms(tr),
                    "ttft_ms": ttft_ms(tr),
                    "tokens": len(tr["stamps"]),
                }
            )
    kvpt = kv_bytes_per_token(b.shape, b.dtype_bytes)
    ctx = s.prompt + s.new_tokens / 2
    out: dict[str, Any] = {
        "prompt_tokens": s.prompt,
        "new_tokens": s.new_tokens,
        "sampling": "greedy",
        "repeats": s.repeats,
        "timing": "first token to last token / (tokens - 1), median of repeats",
        "mean_decode_context": ctx,
    }
    for label, name in configs:
        ms = median([r["decode_ms_per_token"] for r in runs[label]])
        nbytes = step_weight_bytes(b, 1) + kvpt * ctx
        if name is not None:
            nbytes += adapter_bytes(b.shape, s.rank, b.dtype_bytes)
        achieved = nbytes / (ms / 1e3) if ms else None
        out[label] = {
            "decode_ms_per_token": ms,
            "ttft_ms": median([r["ttft_ms"] for r in runs[label]]),
            "bytes_per_step": nbytes,
            "achieved_GB_s": achieved / 1e9 if achieved else None,
            "pct_of_copy_bw": 100 * achieved / b.copy_Bps if achieved and b.copy_Bps else None,
            "floor_ms_per_token": 1e3 * nbytes / b.copy_Bps if b.copy_Bps else None,
            "runs": runs[label],
        }
        log(
            f"batch1 {label}: {_fmt(ms)} ms/token ({_fmt(out[label]['pct_of_copy_bw'])}% of copy bw)"
        )
    out["lora_vs_backbone"] = ratio(
        out["lora_r16_all7"]["decode_ms_per_token"], out["backbone"]["decode_ms_per_token"]
    )
    if "lora_r16_all7_serial" in out:
        out["lora_serial_vs_backbone"] = ratio(
            out["lora_r16_all7_serial"]["decode_ms_per_token"],
            out["backbone"]["decode_ms_per_token"],
        )
    return out


def batch_configs(b: Bench) -> list[tuple[str, list[str | None]]]:
    n = b.s.batch
    return [
        ("distinct", [b.names[i % len(b.names)] for i in range(n)]),
        ("one_adapter", [b.names[0]] * n),
        ("base", [None] * n),
    ]


async def sec_batch64(b: Bench, eng: Any) -> dict[str, Any]:
    s = b.s
    configs = batch_configs(b)
    for j, (_, names) in enumerate(configs):  # warm-up: graph bucket of this batch, each path once
        await run_batch(b, eng, names, s.prompt, s.new_tokens, seed=100 + j)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
    for k in range(s.repeats):
        for j, (label, names) in enumerate(configs):
            runs[label].append(
                await run_batch(b, eng, names, s.prompt, s.new_tokens, seed=200 + 10 * k + j)
            )
    out: dict[str, Any] = {
        "batch": s.batch,
        "prompt_tokens": s.prompt,
        "new_tokens": s.new_tokens,
        "sampling": "greedy",
        "repeats": s.repeats,
        "distinct_adapters": len(set(configs[0][1])),
        "timing": "tokens that arrived after the last first token and up to the first last "
        "token, over that window; median of repeats",
    }
    floor = b.result["header"].get("floors", {}).get("batch64_floor_tok_s", {})
    for label, _ in configs:
        tok_s = median([r["decode_tok_s"] for r in runs[label]])
        out[label] = {
            "decode_tok_s": tok_s,
            "floor_tok_s": floor.get(label),
            "pct_of_floor": 100 * tok_s / floor[label] if tok_s and floor.get(label) else None,
            "runs": runs[label],
        }
        log(f"batch{s.batch} {label}: {_fmt(tok_s)} decode tok/s")
    out["distinct_vs_one"] = ratio(
        out["distinct"]["decode_tok_s"], out["one_adapter"]["decode_tok_s"]
    )
    out["distinct_vs_one_at_floor"] = (
        b.result["header"].get("floors", {}).get("batch64_distinct_vs_one_at_floor")
    )
    return out


async def sec_sampling(b: Bench, eng: Any) -> dict[str, Any]:
    s = b.s
    names = batch_configs(b)[0][1]
    configs = (("greedy", 0.0, 1.0), ("t1_p09", 1.0, 0.9))
    await run_batch(
        b, eng, names, s.prompt, s.new_tokens, seed=300, temperature=1.0, top_p=0.9
    )  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    for k in range(s.repeats):
        for j, (label, temp, top_p) in enumerate(configs):
            runs[label].append(
                await run_batch(
                    b,
                    eng,
                    names,
                    s.prompt,
                    s.new_tokens,
                    seed=400 + 10 * k + j,
                    temperature=temp,
                    top_p=top_p,
                )
            )
    out: dict[str, Any] = {
        "batch": s.batch,
        "distinct_adapters": len(set(names)),
        "repeats": s.repeats,
        "sampled": {"temperature": 1.0, "top_p": 0.9, "seed": "per request"},
        "timing": "as batch64; greedy and sampled runs interleaved",
    }
    for label, _, _ in configs:
        out[label] = {
            "decode_tok_s": median([r["decode_tok_s"] for r in runs[label]]),
            "runs": runs[label],
        }
        log(f"sampling {label}: {_fmt(out[label]['decode_tok_s'])} decode tok/s")
    out["sampled_vs_greedy"] = ratio(out["t1_p09"]["decode_tok_s"], out["greedy"]["decode_tok_s"])
    return out


async def sec_logprobs(b: Bench, eng: Any) -> dict[str, Any]:
    s = b.s
    names: list[str | None] = [None] * s.logprobs_batch
    configs: tuple[tuple[str, int | None], ...] = (
        ("none", None),
        (f"top{s.logprobs_top}", s.logprobs_top),
    )
    for j, (_, k) in enumerate(configs):  # warm-up: this batch's graph bucket, the logprob path
        await run_batch(b, eng, names, s.prompt, s.logprobs_new_tokens, seed=500 + j, logprobs=k)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
    steps0 = eng.launcher.logprob_steps
    for rep in range(s.repeats):  # interleaved: clock drift hits both alike
        for j, (label, k) in enumerate(configs):
            runs[label].append(
                await run_batch(
                    b,
                    eng,
                    names,
                    s.prompt,
                    s.logprobs_new_tokens,
                    seed=600 + 10 * rep + j,
                    logprobs=k,
                )
            )
    out: dict[str, Any] = {
        "batch": s.logprobs_batch,
        "prompt_tokens": s.prompt,
        "new_tokens": s.logprobs_new_tokens,
        "model": "base",
        "sampling": "greedy",
        "repeats": s.repeats,
        "asked": f"every row: logprobs with the top {s.logprobs_top} alternatives",
        "logprob_steps": eng.launcher.logprob_steps - steps0,
        "timing": "as batch64; runs with and without logprobs interleaved",
    }
    for label, _ in configs:
        out[label] = {
            "decode_tok_s": median([r["decode_tok_s"] for r in runs[label]]),
            "runs": runs[label],
        }
        log(f"logprobs {label}: {_fmt(out[label]['decode_tok_s'])} decode tok/s")
    out["logprobs_vs_none"] = ratio(out[configs[1][0]]["decode_tok_s"], out["none"]["decode_tok_s"])
    log(f"logprobs: top{s.logprobs_top} vs none {_fmt(out['logprobs_vs_none'])}")
    return out


def prefix_counters(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if "prefix" in k or "cached" in k or "hit" in k}


async def sec_prefix(b: Bench, eng: Any) -> dict[str, Any]:
    from adaptermesh.worker.types import SamplingParams

    s = b.s
    sp = SamplingParams(max_tokens=2)
    seeds = itertools.count(50_000)

    async def ttft(system: tuple[int, ...], adapter: str) -> float:
        tr = await trace(
            eng, b.rid("prefix"), system + b.prompt(next(seeds), s.user_tokens), adapter, sp
        )
        value = ttft_ms(tr)
        assert value is not None, "request produced no token"
        return value

    a, other = b.names[0], b.names[1 % len(b.names)]
    # Warm-up on another system prompt: compiles the full-length prefill and the prefix-hit path
    # (a short chunk over a cached context) for both adapters, so "cold" below is a cache miss
    # and not a first compilation.
    warm_system = b.prompt(49_999, s.system_prompt)
    for ad in (a, other):
        await ttft(warm_system, ad)
        await ttft(warm_system, ad)
    # Each round: a new system prompt, its first request (cold), warm repeats, then the same
    # prompt under the other adapter (cold again: blocks are never shared across adapters).
    before = prefix_counters(eng.describe())
    colds: list[float] = []
    warm: list[float] = []
    colds_other: list[float] = []
    warm_other: list[float] = []
    for rnd in range(s.prefix_rounds):
        system = b.prompt(49_998 - rnd, s.system_prompt)
        colds.append(await ttft(system, a))
        warm += [await ttft(system, a) for _ in range(s.prefix_warm)]
        colds_other.append(await ttft(system, other))
        warm_other += [await ttft(system, other) for _ in range(s.prefix_warm)]
    after = prefix_counters(eng.describe())
    cold, cold_other = median(colds), median(colds_other)
    warm_med, warm_other_med = median(warm), median(warm_other)
    out = {
        "system_prompt_tokens": s.system_prompt,
        "user_tokens": s.user_tokens,
        "max_tokens": 2,
        "rounds": s.prefix_rounds,
        "same_adapter": {
            "adapter": a,
            "cold_ttft_ms": cold,
            "warm_ttft_ms": warm_med,
            "warm_all_ms": warm,
            "cold_all_ms": colds,
            "cold_over_warm": ratio(cold, warm_med),
        },
        "other_adapter": {
            "adapter": other,
            "cold_ttft_ms": cold_other,
            "warm_ttft_ms": warm_other_med,
            "warm_all_ms": warm_other,
            "cold_all_ms": colds_other,
            "cold_over_warm": ratio(cold_other, warm_other_med),
        },
        "other_adapter_cold_over_same_adapter_warm": ratio(cold_other, warm_med),
        # Shared blocks would make the other adapter's first request about as fast as a warm one.
        "no_sharing_across_adapters": cold_other > (cold + (warm_med or 0)) / 2,
        "engine_counters_before": before,
        "engine_counters_after": after,
        "timing": "submit to first token, one request at a time on an idle engine; medians over the rounds",
    }
    log(
        f"prefix: cold {cold:.1f} ms, warm {warm_med:.1f} ms, other adapter cold {cold_other:.1f} ms"
    )
    return out


async def sec_capacity(b: Bench, eng: Any) -> dict[str, Any]:
    from adaptermesh.worker.types import SamplingParams

    s = b.s
    info = eng.describe()
    kvpt = kv_bytes_per_token(b.shape, b.dtype_bytes)
    kv_tokens = info.get("kv_tokens")
    block = info.get("block_size") or 1
    out: dict[str, Any] = {
        "kv_cache_bytes_config": s.kv_cache_bytes,
        "kv_bytes": info.get("kv_bytes"),
        "kv_blocks": info.get("kv_blocks"),
        "block_size": info.get("block_size"),
        "max_model_len": info.get("max_model_len"),
        "max_num_seqs": info.get("max_num_seqs", s.max_num_seqs),
        "kv_bytes_per_token": kvpt,
        "context": s.capacity_ctx,
        "old_design_slots": OLD_DESIGN_SLOTS,
        "full_ctx_sequences_in_budget": s.kv_cache_bytes // kvpt // s.capacity_ctx,
    }
    if kv_tokens is not None:
        out["kv_tokens"] = kv_tokens
        out["kv_tokens_source"] = "describe()['kv_tokens']"
        out["full_ctx_sequences"] = kv_tokens // s.capacity_ctx
    elif info.get("kv_slots") is not None:  # a slot cache: one max_model_len slot per sequence
        out["kv_tokens"] = info["kv_slots"] * info["max_model_len"]
        out["kv_tokens_source"] = "kv_slots x max_model_len (describe() has no kv_tokens)"
        out["full_ctx_sequences"] = info["kv_slots"]
    # Measured: many short requests at once; with a paged cache their number is bounded by the
    # tokens they hold (and max_num_seqs), not by a count of max-length slots.
    n, per_req = s.capacity_requests, s.capacity_prompt + s.capacity_new_tokens
    per_req_held = -(-per_req // block) * block
    sp = SamplingParams(max_tokens=s.capacity_new_tokens)
    peak = {"running": 0, "waiting": 0, "kv_usage": 0.0, "polls": 0, "last": 0.0}

    def poll(_: int = 0) -> None:
        # Also called on token arrival (at most once a millisecond): a step that keeps the event
        # loop busy cannot hide the batch it ran from the timer loop below.
        now = time.perf_counter()
        if now - peak["last"] < 1e-3:
            return
        st = eng.stats()
        peak["last"] = now
        peak["polls"] += 1
        peak["running"] = max(peak["running"], st.num_running)
        peak["waiting"] = max(peak["waiting"], st.num_waiting)
        peak["kv_usage"] = max(peak["kv_usage"], st.kv_cache_usage)

    task = asyncio.ensure_future(
        asyncio.gather(
            *(
                trace(
                    eng,
                    b.rid("cap"),
                    b.prompt(70_000 + i, s.capacity_prompt),
                    b.names[i % len(b.names)],
                    sp,
                    poll,
                )
                for i in range(n)
            )
        )
    )
    t = time.perf_counter()
    while not task.done():
        poll()
        await asyncio.sleep(0.002)
    traces = await task
    polls = int(peak["polls"])
    bounds = {"requests": n, "max_num_seqs": out["max_num_seqs"]}
    if kv_tokens is not None:
        bounds["tokens_held"] = kv_tokens // per_req_held
    elif info.get("kv_slots") is not None:
        bounds["kv_slots"] = info["kv_slots"]
    out["measured"] = {
        "requests": n,
        "prompt_tokens": s.capacity_prompt,
        "new_tokens": s.capacity_new_tokens,
        "tokens_held_per_request": per_req_held,
        "peak_running": peak["running"],
        "peak_waiting": peak["waiting"],
        "peak_kv_usage": peak["kv_usage"],
        "polls": polls,
        "wall_s": time.perf_counter() - t,
        "upper_bounds": bounds,
        "binding_bound": min(bounds, key=lambda k: bounds[k]),
        "completion_tokens": sum(tr["completion_tokens"] for tr in traces),
        "peak_running_over_old_slots": peak["running"] > OLD_DESIGN_SLOTS,
    }
    log(
        f"capacity: kv_tokens {out.get('kv_tokens')}, {out.get('full_ctx_sequences')} x {s.capacity_ctx}-token "
        f"sequences; peak running {peak['running']} of {n}"
    )
    return out


async def decoding_batch(
    b: Bench,
    eng: Any,
    adapters: list[str | None],
    prompt_len: int,
    new_tokens: int,
    seed: int,
) -> tuple[asyncio.Future[dict[str, Any]], list[int]]:
    """Start a batch (``run_batch``) and return once every request has its first token (or
    the batch ended): the running batch and a one-item list that tracks how many tokens its
    first request has, which counts its decode steps from here."""
    started: set[int] = set()
    tokens0 = [0]
    all_started = asyncio.Event()

    def on_token(i: int, count: int) -> None:
        started.add(i)
        if i == 0:
            tokens0[0] = count
        if len(started) == len(adapters):
            all_started.set()

    task = asyncio.ensure_future(
        run_batch(b, eng, adapters, prompt_len, new_tokens, seed=seed, on_token=on_token)
    )
    waiter = asyncio.ensure_future(all_started.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return task, tokens0


async def launches_per_step(
    b: Bench, eng: Any, adapters: list[str | None], window: int
) -> dict[str, Any]:
    """torch.profiler over ``window`` decode steps of a batch, once every request is decoding."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    s = b.s
    prof_list = getattr(eng, "step_profile", None)
    task, tokens0 = await decoding_batch(
        b, eng, adapters, s.split_prompt, s.split_new_tokens, 900 + len(adapters)
    )
    # CUDA activity alone records kernels, copies and the runtime/driver API calls (launches) of
    # every thread; CPU op events would only slow the window down and its post-processing.
    acts = [ProfilerActivity.CUDA] if b.device == "cuda" else [ProfilerActivity.CPU]

    def steps_done(p0: int, k0: int) -> int:
        return len(prof_list) - p0 if prof_list is not None else tokens0[0] - k0

    with profile(activities=acts) as prof:
        p0, k0 = len(prof_list) if prof_list is not None else 0, tokens0[0]
        t = time.perf_counter()
        while not task.done() and steps_done(p0, k0) < window:
            await asyncio.sleep(0.0005)
        steps = steps_done(p0, k0)
        wall = time.perf_counter() - t
        if b.device == "cuda":
            torch.cuda.synchronize()
    await task
    events = prof.events()
    dev = [e for e in events if e.device_type == DeviceType.CUDA]
    copies = [e for e in dev if e.name.startswith(("Memcpy", "Memset"))]
    host_launch = [
        e
        for e in events
        if e.device_type == DeviceType.CPU and ("LaunchKernel" in e.name or "GraphLaunch" in e.name)
    ]
    graph_launch = [e for e in host_launch if "GraphLaunch" in e.name]
    per = (lambda x: x / steps) if steps else (lambda x: None)
    return {
        "steps_in_window": steps,
        "step_count_source": "step_profile" if prof_list is not None else "tokens of one request",
        "counts": "device kernels: kernel records the CUDA profiler reports (those a CUDA graph runs "
        "included), copies apart; host launch calls: cudaLaunchKernel / cuLaunchKernel / "
        "cudaGraphLaunch runtime calls from any thread",
        "window_wall_ms_per_step_profiled": per(1e3 * wall),
        "device_kernels_per_step": per(len(dev) - len(copies)),
        "device_copies_per_step": per(len(copies)),
        "host_launch_calls_per_step": per(len(host_launch)),
        "graph_launches_per_step": per(len(graph_launch)),
    }


# Kernel kinds by name, first match wins. Triton kernels carry their function's name; cuBLAS's
# and CUTLASS's carry gemm/sm90/nvjet; torch's elementwise kernels are "the rest".
KERNEL_KINDS = (
    ("lora", ("sgmm", "lora", "shrink", "expand", "_bgmv", "_sgmv")),
    # paged_attention.py's kernels: _decode_kernel, _decode_merge_kernel, _prefill_kernel.
    ("attention", ("attention", "attn", "paged", "flash", "_decode_", "_prefill_kernel")),
    ("base_gemm", ("gemm", "gemv", "nvjet", "sm90_", "cutlass", "cublas", "matmul", "_mm_")),
    ("norm", ("rms", "norm")),
    ("activation", ("act_mul",)),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("sample", "argmax", "softmax", "topk", "top_k", "sort", "gumbel", "logprob")),
    ("copy", ("memcpy", "memset", "copy_", "index_put", "gather", "scatter")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time the GPU ran anything."""
    total, cur_s, cur_e = 0.0, None, None
    for start, end in sorted(spans):
        if cur_e is None or start > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = start, end
        else:
            cur_e = max(cur_e, end)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


async def kernel_profile(
    b: Bench, eng: Any, adapters: list[str | None], window: int, seed: int
) -> dict[str, Any]:
    """Device kernels of ``window`` decode steps of a batch, once every request decodes: time
    per step by kernel and by kind, and the GPU's busy time against the window's wall time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    s = b.s
    task, tokens0 = await decoding_batch(b, eng, adapters, s.prompt, s.new_tokens, seed)
    acts = [ProfilerActivity.CUDA] if b.device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        k0 = tokens0[0]
        t = time.perf_counter()
        while not task.done() and tokens0[0] - k0 < window:
            await asyncio.sleep(0.0005)
        steps = tokens0[0] - k0
        wall_us = 1e6 * (time.perf_counter() - t)
        if b.device == "cuda":
            torch.cuda.synchronize()
    await task
    want = DeviceType.CUDA if b.device == "cuda" else DeviceType.CPU
    dev = [e for e in prof.events() if e.device_type == want]
    if not steps or not dev:
        return {"steps_in_window": steps, "error": "no steps or no device kernels in the window"}
    by_name: dict[str, list[float]] = {}
    spans = []
    for e in dev:
        dur = e.time_range.end - e.time_range.start
        by_name.setdefault(e.name, []).append(dur)
        spans.append((e.time_range.start, e.time_range.end))
    by_kind: dict[str, float] = {}
    for name, durs in by_name.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + sum(durs)
    kernels = sorted(
        (
            {
                "name": name[:160],
                "kind": kernel_kind(name),
                "us_per_step": sum(durs) / steps,
                "calls_per_step": len(durs) / steps,
            }
            for name, durs in by_name.items()
        ),
        key=lambda k: -k["us_per_step"],
    )
    return {
        "steps_in_window": steps,
        "window_wall_us_per_step": wall_us / steps,
        "kernel_us_per_step": sum(by_kind.values()) / steps,
        "busy_us_per_step": busy_us(spans) / steps,
        "kernels_per_step": len(dev) / steps,
        "us_per_step_by_kind": {k: v / steps for k, v in sorted(by_kind.items())},
        "top_kernels": kernels[:25],
        "all_kernels": {k["name"]: [k["us_per_step"], k["calls_per_step"]] for k in kernels},
    }


async def sec_kernels(b: Bench, eng: Any) -> dict[str, Any]:
    s = b.s
    configs = batch_configs(b)
    window = min(s.profile_window_steps, max(2, s.new_tokens // 4))
    out: dict[str, Any] = {
        "batch": s.batch,
        "prompt_tokens": s.prompt,
        "window_steps": window,
        "profiler": "torch.profiler, CUDA activity only (kernels a CUDA graph runs included); "
        "us per decode step; busy = the union of kernel intervals, so busy < wall is time "
        "the GPU ran nothing (launch gaps, stream joins, host waits)",
    }
    for j, (label, names) in enumerate(configs):
        await run_batch(b, eng, names, s.prompt, s.new_tokens, seed=300 + j)  # warm-up
        out[label] = await kernel_profile(b, eng, names, window, seed=350 + j)
        log(
            f"kernels {label}: {_fmt(out[label].get('kernel_us_per_step'))} us of kernels, "
            f"{_fmt(out[label].get('busy_us_per_step'))} busy, "
            f"{_fmt(out[label].get('window_wall_us_per_step'))} wall per step"
        )
    base = out["base"].get("all_kernels", {})
    for label in ("one_adapter", "distinct"):
        mine = out[label].get("all_kernels", {})
        if not mine or not base:
            continue
        extra = {
            name: mine[name][0] - base.get(name, [0.0])[0]
            for name in mine
            if mine[name][0] - base.get(name, [0.0])[0] > 0.5
        }
        out[f"{label}_over_base"] = {
            "wall_us_per_step": out[label]["window_wall_us_per_step"]
            - out["base"]["window_wall_us_per_step"],
            "kernel_us_per_step": out[label]["kernel_us_per_step"]
            - out["base"]["kernel_us_per_step"],
            "busy_us_per_step": out[label]["busy_us_per_step"] - out["base"]["busy_us_per_step"],
            "by_kind": {
                k: v - out["base"]["us_per_step_by_kind"].get(k, 0.0)
                for k, v in out[label]["us_per_step_by_kind"].items()
            },
            "kernels_adding_us": dict(sorted(extra.items(), key=lambda kv: -kv[1])[:20]),
        }
    for label in ("base", "one_adapter", "distinct"):
        out[label].pop("all_kernels", None)  # the diffs above keep what matters
    return out


async def sec_step_split(b: Bench, eng: Any) -> dict[str, Any]:
    s = b.s
    prof_list = getattr(eng, "step_profile", None)
    max_seqs = b.result["engines"]["step_split"]["config"].get("max_num_seqs", s.max_num_seqs)
    window = min(s.profile_window_steps, max(2, s.split_new_tokens // 3))
    out: dict[str, Any] = {
        "prompt_tokens": s.split_prompt,
        "new_tokens": s.split_new_tokens,
        "profile_steps_supported": prof_list is not None,
        "profiler_window_steps": window,
        "adapters": "cycled over all adapters",
        "batches": {},
    }
    for bsz in s.split_batches:
        if bsz > max_seqs:
            out["batches"][str(bsz)] = {"skipped": f"batch {bsz} > max_num_seqs {max_seqs}"}
            continue
        names: list[str | None] = [b.names[i % len(b.names)] for i in range(bsz)]
        await run_batch(
            b, eng, names, s.split_prompt, s.split_new_tokens, seed=800 + bsz
        )  # warm-up
        i0 = len(prof_list) if prof_list is not None else 0
        r = await run_batch(b, eng, names, s.split_prompt, s.split_new_tokens, seed=850 + bsz)
        row: dict[str, Any] = {
            "decode_tok_s": r["decode_tok_s"],
            "wall_ms_per_step": 1e3 * bsz / r["decode_tok_s"] if r["decode_tok_s"] else None,
        }
        if prof_list is not None:
            steps = list(prof_list)[i0:]
            dec = [st for st in steps if st.get("rows") == bsz and st.get("tokens") == bsz]
            row.update(
                {
                    "steps": len(steps),
                    "decode_steps": len(dec),
                    "host_ms_per_step": median([st.get("host_ms") for st in dec]),
                    "gpu_ms_per_step": median([st.get("gpu_ms") for st in dec]),
                    "graph_share": sum(1 for st in dec if st.get("graph")) / len(dec)
                    if dec
                    else None,
                    "host_ms_p90": _quantile([st.get("host_ms") for st in dec], 0.9),
                    "gpu_ms_p90": _quantile([st.get("gpu_ms") for st in dec], 0.9),
                }
            )
        row["profiler"] = await launches_per_step(b, eng, names, window)
        out["batches"][str(bsz)] = row
        log(
            f"step_split batch {bsz}: host {row.get('host_ms_per_step')} ms, gpu {row.get('gpu_ms_per_step')} ms, "
            f"kernels/step {row['profiler']['device_kernels_per_step']}, "
            f"host launches/step {row['profiler']['host_launch_calls_per_step']}"
        )
    if prof_list is None:
        out["error"] = (
            "the engine has no step_profile: host/GPU split not measured (profile_steps unsupported)"
        )
    return out


def _quantile(values: list[float | None], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None


def hf_generate(model: Any, ids: Any, n: int, compiled: bool) -> tuple[float, int]:
    """Seconds for one generate() of exactly ``n`` new tokens (greedy), and the tokens it made."""
    import torch

    if compiled:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        o = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache_implementation="static",
            do_sample=False,
            min_new_tokens=n,
            max_new_tokens=n,
            pad_token_id=0,
            disable_compile=not compiled,
        )
    if compiled:
        torch.cuda.synchronize()
    return time.perf_counter() - t, int(o.shape[1] - ids.shape[1])


async def sec_hf_static(b: Bench) -> dict[str, Any]:
    """transformers generate() with a static cache: compiled decode with CUDA graphs on CUDA
    (transformers compiles it on its own for a static cache), eager on CPU."""
    import torch

    s = b.s
    compiled = b.device == "cuda"
    model = b.be.hf_model(b.shape, b.device, b.dtype)
    weights = b.be.random_weights(b.shape, b.device, b.dtype)  # seed 0: the engine's weights
    model.load_state_dict(weights, strict=True, assign=True)
    del weights
    gc.collect()
    out: dict[str, Any] = {
        "harness": "transformers LlamaForCausalLM.generate(cache_implementation='static', "
        "do_sample=False, min_new_tokens=N, max_new_tokens=N)",
        "compiled": compiled,
        "prompt_tokens": s.hf_prompt,
        "new_tokens": s.hf_new_tokens,
        "repeats": s.repeats,
        "timing": "decode ms/token = (t(N tokens) - t(1 token)) / (N - 1), medians; the "
        "first generate of each batch size compiles and is not timed",
    }
    try:
        for bsz in s.hf_batches:
            left = b.deadline - time.monotonic() if b.deadline is not None else None
            if left is not None and left < HF_BATCH_ESTIMATE_S:
                out[f"batch{bsz}"] = {
                    "skipped": f"time budget: {left:.0f} s left, a batch size needs ~{HF_BATCH_ESTIMATE_S} s"
                }
                continue
            g = torch.Generator().manual_seed(bsz)
            ids = torch.randint(3, b.shape["vocab_size"], (bsz, s.hf_prompt), generator=g).to(
                b.device
            )
            t = time.perf_counter()
            hf_generate(
                model, ids, s.hf_new_tokens, compiled
            )  # warm-up: compiles this batch size's decode
            warm_s = time.perf_counter() - t
            full = [hf_generate(model, ids, s.hf_new_tokens, compiled) for _ in range(s.repeats)]
            first = [hf_generate(model, ids, 1, compiled) for _ in range(s.repeats)]
            t_full = statistics.median(x for x, _ in full)
            t_first = statistics.median(x for x, _ in first)
            n = s.hf_new_tokens
            dec_s = max(t_full - t_first, 1e-9)
            out[f"batch{bsz}"] = {
                "decode_ms_per_token": 1e3 * dec_s / (n - 1),
                "decode_tok_s": bsz * (n - 1) / dec_s,
                "e2e_ms_per_token": 1e3 * t_full / n,
                "e2e_tok_s": bsz * n / t_full,
                "t_full_s": t_full,
                "t_first_token_s": t_first,
                "warmup_compile_s": warm_s,
                "new_tokens_seen": sorted({k for _, k in full}),
            }
            log(
                f"hf_static batch {bsz}: {out[f'batch{bsz}']['decode_ms_per_token']:.2f} ms/token, "
                f"{out[f'batch{bsz}']['decode_tok_s']:.0f} decode tok/s (warm-up {warm_s:.0f} s)"
            )
    finally:
        del model
        gc.collect()
        if compiled:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    e1 = _get(b.result, "batch1", "backbone", "decode_ms_per_token")
    e64 = _get(b.result, "batch64", "base", "decode_tok_s")
    h1 = _get(out, "batch1", "decode_ms_per_token")
    h64 = _get(out, f"batch{s.batch}", "decode_tok_s")
    out["engine_vs_hf"] = {
        "batch1_backbone_speedup": ratio(h1, e1),
        f"batch{s.batch}_base_speedup": ratio(e64, h64),
        "note": f"engine prompts {s.prompt} tokens, hf prompts {s.hf_prompt}; both {s.new_tokens} "
        "new tokens, greedy, base weights",
    }
    return out


# ====================================================================== targets
def _get(r: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(r, dict):
            return None
        r = r.get(p)  # type: ignore[assignment]
    return r


def compute_targets(r: dict[str, Any]) -> dict[str, Any]:
    """One row per target: {"value", "target", "met"}; met is None while the value is unmeasured."""

    def row(value: Any, target: str, ok: Callable[[float], bool], **extra: Any) -> dict[str, Any]:
        return {
            "value": value,
            "target": target,
            "met": None if value is None else bool(ok(value)),
            **extra,
        }

    cap = r.get("capacity", {}) if isinstance(r.get("capacity"), dict) else {}
    quant = _get(r, "header", "base_quant")
    if quant:
        # The quantised-base issue's rows (FP8: <= 2.4 ms batch-1; AWQ: <= 1.8 ms).
        limit = 2.4 if quant == "fp8" else 1.8
        return {
            f"batch1_backbone_ms_per_token_{quant}": row(
                _get(r, "batch1", "backbone", "decode_ms_per_token"),
                f"<= {limit}",
                lambda v: v <= limit,
                floor_ms_per_token=_get(r, "batch1", "backbone", "floor_ms_per_token"),
                pct_of_copy_bw=_get(r, "batch1", "backbone", "pct_of_copy_bw"),
            ),
            f"batch1_lora_r16_all7_vs_{quant}_backbone": row(
                _get(r, "batch1", "lora_vs_backbone"), "<= 1.10", lambda v: v <= 1.10
            ),
            f"batch64_64_distinct_tok_s_{quant}": row(
                _get(r, "batch64", "distinct", "decode_tok_s"),
                ">= 10000",
                lambda v: v >= 10000,
                floor_tok_s=_get(r, "batch64", "distinct", "floor_tok_s"),
            ),
        }
    return {
        "batch1_backbone_ms_per_token": row(
            _get(r, "batch1", "backbone", "decode_ms_per_token"),
            "<= 4.5",
            lambda v: v <= 4.5,
            pct_of_copy_bw=_get(r, "batch1", "backbone", "pct_of_copy_bw"),
            floor_ms_per_token=_get(r, "batch1", "backbone", "floor_ms_per_token"),
        ),
        "batch1_lora_r16_all7_vs_backbone": row(
            _get(r, "batch1", "lora_vs_backbone"), "<= 1.10", lambda v: v <= 1.10
        ),
        "batch64_64_distinct_tok_s": row(
            _get(r, "batch64", "distinct", "decode_tok_s"),
            ">= 10000",
            lambda v: v >= 10000,
            floor_tok_s=_get(r, "batch64", "distinct", "floor_tok_s"),
        ),
        "batch64_64_vs_1": row(
            _get(r, "batch64", "distinct_vs_one"),
            ">= 0.9",
            lambda v: v >= 0.9,
            at_floor=_get(r, "batch64", "distinct_vs_one_at_floor"),
        ),
        "sampling_t1_p09_vs_greedy": row(
            _get(r, "sampling", "sampled_vs_greedy"), ">= 0.95", lambda v: v >= 0.95
        ),
        # The row: sequences held at once are bounded by the tokens they hold, not by
        # slots of the longest context. Value: the peak of sequences running at once when more
        # requests arrive than the KV holds; met when that bound is the tokens held (not the
        # request count or max_num_seqs) and the peak reaches 90% of it. 40 GiB of 7B KV hold
        # 40 full 2,048-token contexts in any layout (full_ctx_sequences, reported beside).
        "kv_sequences_2048ctx_40GB": row(
            _get(cap, "measured", "peak_running"),
            "bounded by tokens held (peak >= 90% of that bound)",
            lambda v: (
                _get(cap, "measured", "binding_bound") == "tokens_held"
                and v
                >= 0.9 * (_get(cap, "measured", "upper_bounds", "tokens_held") or float("inf"))
            ),
            tokens_held_bound=_get(cap, "measured", "upper_bounds", "tokens_held"),
            measured_binding_bound=_get(cap, "measured", "binding_bound"),
            tokens_held_per_request=_get(cap, "measured", "tokens_held_per_request"),
            kv_tokens=cap.get("kv_tokens"),
            full_ctx_sequences=cap.get("full_ctx_sequences"),
            budget_bound=cap.get("full_ctx_sequences_in_budget"),
            old_design_slots=OLD_DESIGN_SLOTS,
        ),
        "prefix_ttft_cold_over_warm": row(
            _get(r, "prefix", "same_adapter", "cold_over_warm"),
            ">= 5",
            lambda v: v >= 5,
            no_sharing_across_adapters=_get(r, "prefix", "no_sharing_across_adapters"),
        ),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def print_table(r: dict[str, Any]) -> None:
    print("\n== engine speed: targets ==", flush=True)
    print(f"{'row':36s} {'value':>10s} {'target':>34s} met")
    for name, t in r.get("targets", {}).items():
        print(f"{name:36s} {_fmt(t['value']):>10s} {t['target']:>34s} {_fmt(t['met'])}")
    h = r.get("header", {})
    print(
        f"copy bw {_fmt(_get(h, 'copy_bandwidth', 'GB_s'))} GB/s; batch1 backbone at "
        f"{_fmt(_get(r, 'batch1', 'backbone', 'pct_of_copy_bw'))}% of it, floor "
        f"{_fmt(_get(h, 'floors', 'batch1_floor_ms_per_token'))} ms/token"
    )
    hf = r.get("hf_static", {})
    for key in sorted(k for k in hf if k.startswith("batch")):
        print(
            f"hf_static {key}: {_fmt(hf[key].get('decode_ms_per_token'))} ms/token, "
            f"{_fmt(hf[key].get('decode_tok_s'))} tok/s"
        )
    for bsz, row in sorted(
        (_get(r, "step_split", "batches") or {}).items(), key=lambda kv: int(kv[0])
    ):
        prof = row.get("profiler", {})
        print(
            f"step batch {bsz}: host {_fmt(row.get('host_ms_per_step'))} ms, gpu {_fmt(row.get('gpu_ms_per_step'))} ms, "
            f"wall {_fmt(row.get('wall_ms_per_step'))} ms, kernels {_fmt(prof.get('device_kernels_per_step'))}, "
            f"launch calls {_fmt(prof.get('host_launch_calls_per_step'))}"
        )
    bad = [
        k for k in SECTIONS if isinstance(r.get(k), dict) and ("error" in r[k] or "skipped" in r[k])
    ]
    for k in bad:
        print(f"{k}: {r[k].get('error') or 'skipped: ' + r[k]['skipped']}")
    print(f"elapsed {_fmt(r.get('elapsed_s'))} s", flush=True)


# ====================================================================== main
async def run_all(b: Bench) -> None:
    main_sections = [n for n in MAIN_ENGINE_SECTIONS if n in b.selected]
    fns = {
        "batch1": sec_batch1,
        "batch64": sec_batch64,
        "sampling": sec_sampling,
        "prefix": sec_prefix,
        "logprobs": sec_logprobs,
        "kernels": sec_kernels,
        "capacity": sec_capacity,
    }
    if main_sections:
        eng = None
        try:
            eng = await b.open_engine("main")
        except Exception as e:
            err = {
                "error": f"engine build failed: {type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
            for n in main_sections:
                b.result[n] = dict(err)
            b.save()
            log(err["error"])
        if eng is not None:
            for n in main_sections:
                await b.section(n, fns[n], b, eng)
            await b.close_engine("main", eng)
        del eng
        b.free_memory("main")
    if b.skip_reason("step_split") is None:
        eng2 = None
        try:
            eng2 = await b.open_engine(
                "step_split",
                profile_steps=True,
                kv_cache_bytes=b.s.split_kv_bytes,
                max_model_len=b.s.split_max_model_len,
            )
        except Exception as e:
            b.result["step_split"] = {
                "error": f"engine build failed: {type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
            b.save()
        if eng2 is not None:
            await b.section("step_split", sec_step_split, b, eng2)
            await b.close_engine("step_split", eng2)
        del eng2
        b.free_memory("step_split")
    else:
        await b.section("step_split", sec_step_split, b, None)  # records the skip reason
    await b.section("hf_static", sec_hf_static, b)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results JSON (default on CUDA: bench/results/engine_speed_h200.json)",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: tiny model, every section, seconds"
    )
    ap.add_argument(
        "--only",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help=f"comma list of sections to run ({','.join(SECTIONS)})",
    )
    ap.add_argument(
        "--skip",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help="comma list of sections to skip",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget: a section that would not finish inside it is skipped",
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed runs per configuration (median)"
    )
    ap.add_argument(
        "--hf-batches",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=None,
        help="hf_static batch sizes, e.g. 1,64",
    )
    ap.add_argument(
        "--keep-files", action="store_true", help="keep the model dir and adapters (temp dir)"
    )
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an EngineConfig field for the main engine (true/false, numbers, or text), e.g. "
        "--config lora_density_configs=false to measure without a feature; repeatable",
    )
    ap.add_argument(
        "--dora",
        action="store_true",
        help="DoRA adapters (use_dora, a magnitude vector per module) on an engine with "
        "lora_dora; compare its batch64 with a plain run's in the same session",
    )
    ap.add_argument(
        "--base-quant",
        choices=("fp8", "awq"),
        default=None,
        help="serve a quantised copy of the synthetic base (fp8: compressed-tensors per-channel "
        "e4m3; awq: AutoAWQ GEMM 4-bit, group 128), packed on the GPU; compare with a bf16 run "
        "in the same session",
    )
    args = ap.parse_args()
    args.config_overrides = {}
    for item in args.config:
        field, sep, text = item.partition("=")
        if not sep:
            ap.error(f"--config {item!r}: want FIELD=VALUE")
        value: Any = {"true": True, "false": False}.get(text.lower(), text)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(text) if "." in text else int(text)
        args.config_overrides[field] = value
    for name in (*args.only, *args.skip):
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")

    sys.path.insert(0, str(SRC_DIR))
    sys.path.insert(0, str(BENCH_DIR))
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(
            "bench_engine_speed: no CUDA device; use --tiny for the CPU smoke run", file=sys.stderr
        )
        return 2
    device = "cpu" if args.tiny else "cuda"
    sizes = TINY if args.tiny else Sizes()
    if args.repeats is not None:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    if args.hf_batches is not None:
        sizes = dataclasses.replace(sizes, hf_batches=args.hf_batches)
    if args.out is None:
        args.out = (
            str(
                BENCH_DIR
                / "results"
                / (
                    f"engine_speed_{args.base_quant}_h200.json"
                    if args.base_quant
                    else "engine_speed_h200.json"
                )
            )
            if device == "cuda"
            else str(Path(tempfile.gettempdir()) / "engine_speed_tiny.json")
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    b = Bench(args, sizes, device, out)
    try:
        b.header()
        b.write_adapters()
        asyncio.run(run_all(b))
    finally:
        b.save()
        if not args.keep_files:
            shutil.rmtree(b.work, ignore_errors=True)
    print_table(b.result)
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
