"""``adaptermesh worker``: serve one base model and its adapters over the OpenAI-style API.

    adaptermesh worker --model DIR --adapter-root DIR [--port 8000] [--host 127.0.0.1]
        [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16]
        [--admin-token-file FILE] [--served-model-name NAME] [--lora-modules NAME=PATH ...]
        [--max-connections N] [--header-timeout S] [--body-timeout S] [--keepalive-timeout S]
        [--adapter-cache-dir DIR] [--s3-endpoint-url URL] [--adapter-resolver s3://BUCKET/PREFIX]
        [--hf-cache-dir DIR] ...

SIGTERM or SIGINT drains: ``/health`` turns 503 at once (with Envoy's immediate-fail header),
requests are still served for ``--drain-grace`` seconds so that load balancers stop sending
first, then new generation requests get 503 with Retry-After, in-flight requests finish (up to
``--drain-timeout`` seconds from the signal, after which they are cancelled), then the listener
closes and the engine shuts down. Exit status 0 after a
clean drain, 1 when the drain timed out, 2 on bad arguments or an engine that cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from adaptermesh.cliargs import (
    fraction,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    read_secret,
)
from adaptermesh.clisetup import DefaultsHelpFormatter, setup_logging
from adaptermesh.httpserve import ListenerLimits, raise_fd_limit
from adaptermesh.tracing import Tracing
from adaptermesh.worker.cpu_threads import (
    apply_cpu_threads,
    choose_cpu_threads,
    parse_cpu_threads,
)
from adaptermesh.worker.eviction import POLICY_NAMES
from adaptermesh.worker.grpc_v2 import GrpcV2Server
from adaptermesh.worker.service import ServiceConfig, WorkerService, serve
from adaptermesh.worker.tool_calls import TOOL_CALL_PARSERS
from adaptermesh.worker.types import EngineError, EngineProtocol
from adaptermesh.worker.ws import mount_websocket

__all__ = [
    "LoraModule",
    "build_parser",
    "build_stores",
    "check_port_free",
    "load_lora_modules",
    "main",
    "parse_lora_module",
    "run_worker",
]

if TYPE_CHECKING:
    from adaptermesh.worker.adapter_stores import AdapterStores

log = logging.getLogger("adaptermesh.worker")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` entry: an adapter loaded and pinned at start-up."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=path``, or the JSON object vLLM accepts: ``{"name", "path", "base_model_name"}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON ({exc.msg}): {text}") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"must be a JSON object: {text}")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown field {unknown[0]!r}: {text}")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name:
            raise argparse.ArgumentTypeError(f'"name" must be a non-empty string: {text}')
        if not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(f'"path" must be a non-empty string: {text}')
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f'"base_model_name" must be a string: {text}')
        return LoraModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return LoraModule(name, path)


async def load_lora_modules(engine: EngineProtocol, modules: Sequence[LoraModule]) -> None:
    """Load and pin each start-up adapter, in order; the first failure raises.

    Pinned adapters are never evicted from their GPU slot. An engine whose ``load_adapter``
    takes no ``pinned`` argument (a test double) loads them unpinned.
    """
    names: set[str] = set()
    for module in modules:
        if module.name in names:
            raise ValueError(f"--lora-modules: {module.name!r} is given twice")
        names.add(module.name)
        if module.name == engine.model_name:
            raise ValueError(f"--lora-modules: {module.name!r} is the base model's name")
        if module.base_model_name not in (None, engine.model_name):
            raise ValueError(
                f"--lora-modules: {module.name!r} names base model "
                f"{module.base_model_name!r}; this worker serves "
                f"{engine.model_name!r}"
            )
    # The protocol's load_adapter has no ``pinned``; the real engine's does.
    load: Callable[..., Awaitable[object]] = engine.load_adapter
    pinned = {"pinned": True} if "pinned" in inspect.signature(load).parameters else {}
    for module in modules:
        try:
            await load(module.name, module.path, **pinned)
        except EngineError as exc:
            raise ValueError(
                f"--lora-modules: cannot load {module.name!r} from {module.path}: {exc}"
            ) from None
        log.info("loaded adapter %s from %s (pinned)", module.name, module.path)


def _resolver_uri(text: str) -> str:
    from adaptermesh.worker.adapter_stores import parse_s3_uri
    from adaptermesh.worker.types import AdapterNotFoundError

    try:
        parse_s3_uri(text, "--adapter-resolver")
    except AdapterNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cpu_threads(text: str) -> int | None:
    try:
        return parse_cpu_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_stores(args: argparse.Namespace) -> AdapterStores:
    """The worker's ``AdapterStores`` from the store flags."""
    from adaptermesh.worker.adapter_stores import (
        DEFAULT_MAX_FILE_BYTES,
        DEFAULT_MAX_TOTAL_BYTES,
        AdapterStores,
    )

    hf_cache = args.hf_cache_dir
    if hf_cache is None and os.environ.get("HF_HUB_CACHE"):
        hf_cache = Path(os.environ["HF_HUB_CACHE"])
    return AdapterStores(
        args.adapter_cache_dir,
        endpoint_url=args.s3_endpoint_url,
        resolvers=args.adapter_resolver,
        hf_cache_dir=hf_cache,
        max_file_bytes=args.adapter_max_file_bytes or DEFAULT_MAX_FILE_BYTES,
        max_total_bytes=args.adapter_max_bytes or DEFAULT_MAX_TOTAL_BYTES,
        timeout_s=args.adapter_store_timeout,
    )


# The flags that set a ListenerLimits field: (flag, field, type, help); the default is the
# field's, the value is read back from the flag's argparse name.
_LISTENER_FLAGS: tuple[tuple[str, str, Callable[[str], object], str], ...] = (
    (
        "--max-connections",
        "max_connections",
        positive_int,
        "open connections at once; above it a stalled one is evicted, else the new one gets 503",
    ),
    (
        "--header-timeout",
        "header_timeout_s",
        positive_float,
        "seconds for a request's line and headers to arrive (else 408)",
    ),
    (
        "--body-timeout",
        "body_timeout_s",
        positive_float,
        "seconds for a request's body to arrive (else 408)",
    ),
    (
        "--keepalive-timeout",
        "keepalive_timeout_s",
        positive_float,
        "seconds an idle kept-alive connection stays open",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adaptermesh worker",
        description="Serve a base model and its LoRA adapters with an OpenAI-compatible API.",
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="local Hugging Face model directory (config.json, *.safetensors)",
    )
    p.add_argument(
        "--adapter-root",
        required=True,
        type=Path,
        help="directory whose subdirectories are PEFT adapters, resolved by name",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; use 0.0.0.0 in a pod)",
    )
    p.add_argument("--port", type=port, default=8000, help="port (0 picks a free one)")
    p.add_argument(
        "--grpc-port",
        type=port,
        default=None,
        help="port of the KServe v2 gRPC API (0 picks a free one; default: off; "
        "the chart's layout is 8001 beside HTTP 8000)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when a GPU is visible, else cpu",
    )
    p.add_argument(
        "--cpu-threads",
        type=_cpu_threads,
        default=None,
        metavar="N|auto",
        help="threads torch runs CPU operators on; auto: the CPUs the process may use, the "
        "smaller of its affinity mask and its cgroup CPU quota (a pod's CPU limit)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name of the base model in the API (default: the model directory name)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="the format chat tool calls are parsed from when tool_choice is auto: "
        'llama3_json (Llama 3.1+: {"name", "parameters"}, <|python_tag|>), hermes '
        "(Qwen2/2.5/3: <tool_call>...</tool_call>), mistral ([TOOL_CALLS][...]); auto picks "
        "by the tokenizer's marker tokens, then by the model family (tool_choice required or "
        "a named function is grammar-enforced in any family)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="file holding the token that load/unload requests must present (none: they "
        "need no token)",
    )
    p.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH|JSON",
        help="adapters loaded and pinned before the listener opens (so /health "
        "answers only once they are in): name=path, or vLLM's JSON form "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a path '
        "relative to --adapter-root or inside it, s3://bucket/prefix or "
        "hf://org/name[@revision]",
    )
    # Adapter stores (adapter_stores.py).
    p.add_argument(
        "--adapter-cache-dir",
        type=Path,
        default=None,
        help="where adapters fetched from s3:// are cached (default: "
        "<temp dir>/adaptermesh-adapter-cache-<uid>)",
    )
    p.add_argument(
        "--s3-endpoint-url",
        default=None,
        metavar="URL",
        help="S3 API endpoint (default: AWS_ENDPOINT_URL, else AWS); credentials "
        "come from boto3's standard chain",
    )
    p.add_argument(
        "--adapter-resolver",
        type=_resolver_uri,
        action="append",
        default=[],
        metavar="s3://BUCKET/PREFIX",
        help="look an adapter name the adapter root does not hold up as "
        "PREFIX/<name>/ in this store on its first request (repeatable, tried in "
        "order; default: off)",
    )
    p.add_argument(
        "--hf-cache-dir",
        type=Path,
        default=None,
        help="local Hugging Face cache that hf://org/name[@revision] paths are "
        "found in (default: HF_HUB_CACHE; the Hub itself is never contacted)",
    )
    p.add_argument(
        "--adapter-max-file-bytes",
        type=positive_int,
        default=None,
        help="largest adapter weights file fetched from a store (default 4 GiB)",
    )
    p.add_argument(
        "--adapter-max-bytes",
        type=positive_int,
        default=None,
        help="largest adapter (all its files) fetched from a store (default 4 GiB)",
    )
    p.add_argument(
        "--adapter-store-timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="connect and read timeout of each S3 request (a store that accepts and never "
        "answers fails the download after at most 3 attempts of this)",
    )
    p.add_argument(
        "--adapter-load-wait",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="longest a generation request waits on its adapter's load in flight (a slow or "
        "stalled store); then it gets 503 adapter_load_timeout with Retry-After, and the "
        "load goes on for later requests",
    )
    # Engine sizes.
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest sequence, prompt and output together, in tokens (default: the model's "
        "max_position_embeddings, at most 4096)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="sequences running at once (decode batch rows; default: 256 on a GPU unless "
        "its memory says fewer, 8 on the CPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="token budget of one step (decode rows + prompt chunks; default: twice the "
        "sequences, at least 512)",
    )
    p.add_argument(
        "--max-prefill-chunk",
        type=positive_int,
        default=None,
        help="most prompt tokens of one sequence computed in one step (default 256)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="tokens per KV block (8..256, a power of two; default 16)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=None,
        help="KV cache size in bytes (default: what --gpu-memory-fraction leaves beside "
        "the weights and the adapter pool)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share prompt blocks between requests of the same adapter",
    )
    p.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help="adapter GPU slots (default: 15%% of the GPU budget at --max-lora-rank, 8 on the CPU)",
    )
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="modules the adapter pool holds LoRA weights for (default: all of "
        "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj); a pool for "
        "q_proj v_proj adapters holds several times the adapters in the same memory, "
        "and an adapter on another module is refused",
    )
    p.add_argument(
        "--cpu-cache-bytes",
        type=positive_int,
        default=None,
        help="adapter CPU cache size in bytes (default: from host memory)",
    )
    p.add_argument(
        "--max-adapter-skips",
        type=non_negative_int,
        default=None,
        help="times a waiting request may be passed over while its adapter waits "
        "for a GPU slot before it gets the next one (default 16)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=None,
        help="largest adapter rank a GPU slot holds; a higher-rank adapter is refused (default 64)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks the model is split over (one GPU each on CUDA; default 1): starts N-1 "
        "more processes; N must divide the model's attention heads, KV heads and "
        "intermediate size",
    )
    p.add_argument(
        "--tp-lora-scheme",
        choices=["base-reduce", "sharded"],
        default="base-reduce",
        help="with --tensor-parallel-size > 1, how o_proj's and down_proj's adapters split: "
        "base-reduce keeps B whole on every rank and adds the delta into the base all-reduce; "
        "sharded splits B too and all-reduces the rank-sized shrink output first "
        "(default base-reduce)",
    )
    p.add_argument(
        "--lora-dtype",
        choices=["bf16", "fp16", "fp32", "int4"],
        default=None,
        help="adapter pool storage (default: the model dtype); int4 quantises each "
        "adapter on load, group-wise, about 3.7x the adapters per GB of slots",
    )
    p.add_argument(
        "--lora-dora",
        action="store_true",
        help="hold DoRA factors in the adapter pool so use_dora adapters load (one vector "
        "per module and slot; each projection scales its rows by their adapter's factor)",
    )
    p.add_argument(
        "--lora-density-configs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pick the LoRA kernels' tiles by the step's tokens per adapter and key CUDA "
        "graphs by that density class (default: EngineConfig.lora_density_configs)",
    )
    p.add_argument(
        "--lora-vocab",
        action="store_true",
        help="hold LoRA on embed_tokens and lm_head in the adapter pool so adapters "
        "targeting them load (rank x vocabulary per module and slot)",
    )
    p.add_argument(
        "--lora-saved-modules",
        nargs="+",
        choices=["embed_tokens", "lm_head", "norms"],
        default=None,
        metavar="KIND",
        help="hold trained module copies (PEFT modules_to_save) in the adapter pool so "
        "adapters saving them load: embed_tokens and lm_head (vocabulary x hidden values "
        "per slot each), norms (every norm of the model, a few vectors per layer)",
    )
    p.add_argument(
        "--lora-extra-vocab",
        type=int,
        default=None,
        metavar="N",
        help="hold up to N vocabulary rows past the model's per adapter slot, so adapters "
        "trained on a resized embedding and head load (their tokenizer files tokenize and "
        "detokenize their requests); 0 (default) refuses them",
    )
    p.add_argument(
        "--adapter-eviction",
        choices=list(POLICY_NAMES),
        default=None,
        help="eviction policy of the adapter GPU slots and CPU cache (default: w-tinylfu, "
        "EngineConfig.adapter_eviction)",
    )
    p.add_argument(
        "--step-profile",
        metavar="PATH",
        default=None,
        help="profile every engine step: append one JSON line per step (rows, prefill tokens, "
        "distinct adapters, host and GPU ms, completion time) to PATH; costs a timing event "
        "per step, for benches and investigations",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=None,
        help="share of the GPU's memory for the weights, the adapter pool and the KV cache "
        "(default 0.85)",
    )
    p.add_argument(
        "--logprobs-mode",
        choices=["raw", "processed"],
        default=None,
        help="what logprobs describe: raw (log_softmax of the model's logits, the "
        "default, as vLLM) or processed (the distribution the sampler draws from: "
        "penalties, temperature, top-k/top-p/min-p applied)",
    )
    # Service limits.
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=None,
        help="requests admitted into the engine at once (default 2 x max-num-seqs)",
    )
    p.add_argument(
        "--max-queue-per-tenant",
        type=non_negative_int,
        default=64,
        help="requests one tenant may have waiting for admission (more get 429)",
    )
    p.add_argument(
        "--max-queue-total",
        type=non_negative_int,
        default=1024,
        help="requests waiting for admission, all tenants together (more get 429)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="default request deadline in seconds (x-request-timeout overrides)",
    )
    p.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests",
    )
    p.add_argument(
        "--drain-grace",
        type=non_negative_float,
        default=6.0,
        help="seconds of the drain during which /health already fails but new requests are "
        "still served, so a load balancer stops sending first (at least its health-check "
        "interval plus timeout: the mesh's Envoy checks every 5 s with a 1 s timeout); 0 "
        "refuses at once",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=4 << 20,
        help="largest request body (and gRPC message) in bytes; a larger one is refused (413)",
    )
    # Listener limits (defaults: adaptermesh.httpserve.ListenerLimits).
    limits = ListenerLimits()
    for flag, field, kind, text in _LISTENER_FLAGS:
        p.add_argument(flag, type=kind, default=getattr(limits, field), help=text)
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export OpenTelemetry spans to this OTLP/gRPC collector (off when "
        "not given; docs/tracing.md)",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=fraction,
        default=1.0,
        help="share of new traces sampled (a sampled parent is always followed)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the least severe log lines written",
    )
    return p


def check_port_free(host: str, port: int | None) -> None:
    """Raise OSError when ``host:port`` cannot be bound now (in use, or an address this host
    does not have). Binds every address ``host`` resolves to, with the listener's
    SO_REUSEADDR, and releases them at once; port 0 and None (off) are not checked."""
    if not port:
        return
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


def _build_engine(args: argparse.Namespace) -> EngineProtocol:
    import torch

    from adaptermesh.worker.engine import Engine, EngineConfig
    from adaptermesh.worker.engine_config import SIZING_FIELDS

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    config = EngineConfig()
    for flag, attr in (
        ("max_model_len", "max_model_len"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_loras", "max_loras"),
        ("max_lora_rank", "max_lora_rank"),
        ("gpu_memory_fraction", "gpu_memory_fraction"),
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("max_prefill_chunk", "max_prefill_chunk"),
        ("block_size", "block_size"),
        ("kv_cache_bytes", "kv_cache_bytes"),
        ("cpu_cache_bytes", "cpu_cache_bytes"),
        ("max_adapter_skips", "max_adapter_skips"),
        ("adapter_load_wait", "adapter_load_wait_s"),
    ):
        value = getattr(args, flag)
        if value is not None:
            setattr(config, attr, value)
    # Sizes without a flag are the worker's to choose from the device and host memory
    # (worker/sizing.py: 256 sequences on a GPU unless memory says less; small on the CPU).
    config.auto_size = frozenset(name for name in SIZING_FIELDS if getattr(args, name) is None)
    if args.no_prefix_caching:
        config.enable_prefix_caching = False
    if args.lora_dtype is not None:
        config.lora_dtype = args.lora_dtype
    if args.lora_dora:
        config.lora_dora = True
    if args.lora_density_configs is not None:
        config.lora_density_configs = args.lora_density_configs
    if args.lora_vocab:
        config.lora_vocab = True
    if args.lora_saved_modules is not None:
        config.lora_saved_modules = tuple(dict.fromkeys(args.lora_saved_modules))
    if args.lora_extra_vocab is not None:
        config.lora_extra_vocab = args.lora_extra_vocab
    if args.lora_target_modules is not None:
        config.lora_target_modules = tuple(args.lora_target_modules)
    if args.adapter_eviction is not None:
        config.adapter_eviction = args.adapter_eviction
    if args.logprobs_mode is not None:
        config.logprobs_mode = args.logprobs_mode
    if args.step_profile is not None:
        config.profile_steps = True
        config.step_profile_path = args.step_profile
    config.tensor_parallel_size = args.tensor_parallel_size
    config.tp_lora_scheme = args.tp_lora_scheme
    # Before the model: a bad endpoint fails the start at once, and the store's client is
    # ready before the first request for one of its adapters.
    stores = build_stores(args)
    stores.prepare()
    built = Engine(
        args.model,
        args.adapter_root,
        device=device,
        dtype=dtype,
        config=config,
        model_name=args.served_model_name,
    )
    built.adapters.stores = stores
    engine: EngineProtocol = built
    return engine


async def run_worker(
    engine: EngineProtocol,
    config: ServiceConfig,
    host: str,
    port: int,
    *,
    stop: asyncio.Event,
    on_ready: Callable[[int], None] | None = None,
    lora_modules: Sequence[LoraModule] = (),
    grpc_port: int | None = None,
    on_grpc_ready: Callable[[int], None] | None = None,
    tracing: Tracing | None = None,
) -> bool:
    """Load ``lora_modules``, serve until ``stop`` is set, then drain. Returns True when the
    drain finished in time.

    The listener opens only after every start-up adapter is loaded, so ``/health`` never
    answers ready without them. The engine is shut down on the way out, whatever happens.
    """
    service = WorkerService(engine, config, tracing)
    mount_websocket(service)  # GET /v1/ws, on the same port, limits and metrics
    # KServe v2 over gRPC on its own port, through the same service (queue, limits, metrics).
    grpc_server = GrpcV2Server(service) if grpc_port is not None else None
    try:
        await load_lora_modules(engine, lora_modules)
        runner, bound = await serve(service, host, port)
    except BaseException:
        await engine.shutdown()
        raise
    try:
        if grpc_server is not None and grpc_port is not None:
            grpc_bound = await grpc_server.start(host, grpc_port)
            if on_grpc_ready is not None:
                on_grpc_ready(grpc_bound)
        if on_ready is not None:
            on_ready(bound)
        await stop.wait()
        log.info("draining: %d requests in flight", service.inflight)
        if grpc_server is not None:
            await grpc_server.draining()
        drained = await service.drain()
        if not drained:
            log.warning(
                "drain timed out after %.0f s; cancelling %d requests",
                config.drain_timeout_s,
                service.inflight,
            )
        return drained
    finally:
        # Closing the runner cancels handlers still running (after a timed-out drain).
        if grpc_server is not None:
            await grpc_server.stop()
        await runner.cleanup()
        await engine.shutdown()
        if tracing is not None:
            tracing.shutdown()  # flushes the spans still batched


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level)
    try:
        if not args.model.is_dir():
            raise ValueError(f"--model: {args.model} is not a directory")
        if not args.adapter_root.is_dir():
            raise ValueError(f"--adapter-root: {args.adapter_root} is not a directory")
        token = (
            read_secret(args.admin_token_file, "--admin-token-file")
            if args.admin_token_file
            else None
        )
    except ValueError as exc:
        print(f"adaptermesh worker: {exc}", file=sys.stderr)
        return 2
    # Before the model loads (minutes for a large one): a port in use fails the start at once.
    for flag, listen_port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        try:
            check_port_free(args.host, listen_port)
        except OSError as exc:
            print(
                f"adaptermesh worker: cannot listen on {args.host}:{listen_port} ({flag}): "
                f"{exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
    nofile = raise_fd_limit()
    log.info("RLIMIT_NOFILE soft limit: %d", nofile)
    threads = choose_cpu_threads(args.cpu_threads)
    apply_cpu_threads(threads)
    log.info("torch: %s", threads.describe())
    return asyncio.run(_main(args, token))


async def _main(args: argparse.Namespace, token: str | None) -> int:
    # The engine starts its step loop on this event loop, so it is built inside it.
    try:
        engine = _build_engine(args)
    except (EngineError, ValueError, OSError) as exc:
        print(f"adaptermesh worker: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    engine_seqs = getattr(getattr(engine, "config", None), "max_num_seqs", 8)
    config = ServiceConfig(
        max_running=args.max_running or 2 * int(engine_seqs),
        max_waiting_per_tenant=args.max_queue_per_tenant,
        max_waiting_total=args.max_queue_total,
        request_timeout_s=args.request_timeout,
        max_request_timeout_s=max(args.request_timeout, 3600.0),
        admin_token=token,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        drain_grace_s=args.drain_grace,
        tool_call_parser=args.tool_call_parser,
        listener=ListenerLimits(
            **{
                field: getattr(args, flag.removeprefix("--").replace("-", "_"))
                for flag, field, _, _ in _LISTENER_FLAGS
            }
        ),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A tensor-parallel rank that dies stops the worker (the others are stopped already).
    group = getattr(engine, "tp_group", None)
    if group is not None:

        def rank_died(_rank: int) -> None:
            loop.call_soon_threadsafe(stop.set)
            # A collective stuck on the dead rank (NCCL) may keep the drain from ending.
            hard = threading.Timer(args.drain_timeout + 30.0, os._exit, (1,))
            hard.daemon = True
            hard.start()

        group.on_failure = rank_died

    def ready(port: int) -> None:
        # One parseable line on stdout so scripts (and tests) learn a port picked with 0.
        print(f"adaptermesh worker listening on http://{args.host}:{port}", flush=True)
        log.info("serving %s with %d admission slots", engine.model_name, config.max_running)

    def grpc_ready(port: int) -> None:
        print(f"adaptermesh worker gRPC listening on {args.host}:{port}", flush=True)

    try:
        drained = await run_worker(
            engine,
            config,
            args.host,
            args.port,
            stop=stop,
            on_ready=ready,
            lora_modules=args.lora_modules,
            grpc_port=args.grpc_port,
            on_grpc_ready=grpc_ready,
            tracing=Tracing.from_config(
                args.otlp_endpoint, args.trace_sample_ratio, "adaptermesh-worker"
            ),
        )
    except ValueError as exc:
        print(f"adaptermesh worker: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"adaptermesh worker: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 2
    if group is not None and group.failed_rank is not None:
        print(
            f"adaptermesh worker: tensor-parallel rank {group.failed_rank} exited", file=sys.stderr
        )
        return 1
    return 0 if drained else 1


if __name__ == "__main__":
    sys.exit(main())
