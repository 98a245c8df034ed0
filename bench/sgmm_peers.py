"""Peer multi-LoRA Triton kernels (vLLM, SGLang) for the side-by-side SGMM bench.

``prepare`` extracts only the peers' LoRA kernel files from local git mirrors (bare git dirs
under /work/.mirror/, or plain source trees given with ``--src``) into ``bench/.peers/`` (git
ignored; third-party sources are never committed) and writes a small shim package beside them
so they import with only torch and triton installed. ``load`` returns one ``Peer`` per kernel
family; ``Peer.build(case)`` does that peer's metadata preparation ahead and returns a callable
doing ``out += scale * (x @ A_s.T) @ B_s.T`` that can be captured in a CUDA graph.

Usage: python3 bench/sgmm_peers.py prepare --dest bench/.peers [--mirror-root /work/.mirror]
       [--src vllm=DIR] [--src sglang=DIR]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import inspect
import json
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PEER_FILES = {
    "vllm": [
        "vllm/lora/ops/triton_ops/lora_shrink_op.py",
        "vllm/lora/ops/triton_ops/lora_expand_op.py",
        "vllm/lora/ops/triton_ops/kernel_utils.py",
        "vllm/lora/ops/triton_ops/utils.py",
        "vllm/lora/ops/triton_ops/lora_kernel_metadata.py",
    ],
    "sglang": [
        "python/sglang/srt/lora/triton_ops/sgemm_lora_a.py",
        "python/sglang/srt/lora/triton_ops/sgemm_lora_b.py",
        "python/sglang/srt/lora/triton_ops/chunked_sgmv_shrink.py",
        "python/sglang/srt/lora/triton_ops/chunked_sgmv_expand.py",
    ],
}
STRIP = {"vllm": "", "sglang": "python/"}

# Shim modules written next to the extracted files (our own code).
SHIMS = {
    "vllm/__init__.py": "",
    "vllm/triton_utils.py": "import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/torch_utils.py": (
        "import torch\n\n\n"
        "def direct_register_custom_op(*args, **kwargs):\n"
        "    raise AttributeError('custom-op registration is not used by the bench')\n\n\n"
        "def async_tensor_h2d(data, device=None, dtype=None, out=None):\n"
        "    if dtype is None and out is not None:\n        dtype = out.dtype\n"
        "    t = torch.as_tensor(data, dtype=dtype)\n"
        "    if out is not None:\n        out.copy_(t, non_blocking=True)\n        return out\n"
        "    return t.to(device, non_blocking=True)\n"
    ),
    "vllm/utils/math_utils.py": (
        "def next_power_of_2(n):\n    return 1 if n < 1 else 1 << (int(n) - 1).bit_length()\n"
    ),
    "vllm/platforms/__init__.py": (
        "import torch\n\n\nclass _Platform:\n"
        "    device_type = 'cuda'\n"
        "    def is_cuda(self):\n        return torch.cuda.is_available()\n"
        "    def is_rocm(self):\n        return False\n"
        "    def is_cuda_alike(self):\n        return True\n"
        "    def get_device_name(self, device_id=0):\n"
        "        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() "
        "else 'cpu'\n"
        "    def _cap(self):\n"
        "        if not torch.cuda.is_available():\n            return -1\n"
        "        major, minor = torch.cuda.get_device_capability()\n"
        "        return major * 10 + minor\n"
        "    def has_device_capability(self, cap, device_id=0):\n"
        "        return self._cap() >= cap\n"
        "    def is_device_capability(self, cap, device_id=0):\n"
        "        return self._cap() == cap\n"
        "    def get_device_capability(self, device_id=0):\n"
        "        return torch.cuda.get_device_capability(device_id) "
        "if torch.cuda.is_available() else None\n\n\n"
        "current_platform = _Platform()\n"
    ),
    # vLLM's defaults for the settings its LoRA kernels read (PDL on where supported).
    "vllm/envs.py": (
        "VLLM_TUNED_CONFIG_FOLDER = None\nVLLM_LORA_TUNED_CONFIG_FOLDER = None\n"
        "VLLM_BATCH_INVARIANT = False\nVLLM_LORA_DISABLE_PDL = False\n"
        "VLLM_LORA_ENABLE_DUAL_STREAM = False\n"
    ),
    "vllm/logger.py": (
        "import logging\n\n\nclass _Logger(logging.LoggerAdapter):\n"
        "    def warning_once(self, msg, *args, **kwargs):\n"
        "        self.warning(msg, *args)\n"
        "    def info_once(self, msg, *args, **kwargs):\n"
        "        self.info(msg, *args)\n\n\n"
        "def init_logger(name):\n    return _Logger(logging.getLogger(name), {})\n"
    ),
    "vllm/lora/__init__.py": "",
    "vllm/lora/ops/__init__.py": "",
    "vllm/lora/ops/triton_ops/__init__.py": "",
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/environ.py": (
        "class _Flag:\n    def __init__(self, v):\n        self.v = v\n"
        "    def get(self):\n        return self.v\n\n\n"
        "class _Envs:\n    def __getattr__(self, name):\n        return _Flag(False)\n\n\n"
        "envs = _Envs()\n"
    ),
    "sglang/srt/utils.py": (
        "def cached_triton_kernel(key_fn=None, *args, **kwargs):\n"
        "    return lambda kernel: kernel\n"
    ),
    "sglang/srt/lora/__init__.py": "",
    "sglang/srt/lora/utils.py": (
        "from dataclasses import dataclass\nfrom typing import Optional\n\nimport torch\n\n\n"
        "@dataclass\nclass LoRABatchInfo:\n"
        "    bs: int\n    num_segments: int\n    seg_lens: torch.Tensor\n"
        "    seg_indptr: torch.Tensor\n    max_len: int\n    weight_indices: torch.Tensor\n"
        "    lora_ranks: torch.Tensor\n    scalings: torch.Tensor\n"
        "    use_cuda_graph: bool = True\n    permutation: Optional[torch.Tensor] = None\n"
        "    single_adapter: Optional[tuple] = None\n"
    ),
    "sglang/srt/lora/triton_ops/__init__.py": "",
}


def _find_mirror(root: Path, name: str) -> Path | None:
    for cand in sorted(root.glob(f"*{name}*")):
        for gd in [cand, *sorted(cand.glob("*.git")), *sorted(cand.glob("*/"))]:
            if (gd / "HEAD").exists() and (gd / "objects").exists():
                return gd
    return None


def _release_version(root: Path) -> str | None:
    """The release a plain source tree came from: an sdist's PKG-INFO or a wheel's METADATA."""
    for meta in [root / "PKG-INFO", *sorted(root.glob("*.dist-info/METADATA"))]:
        if meta.exists():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


def _git(gd: Path, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={gd}", *args], check=True, capture_output=True).stdout


def prepare(
    dest: Path, mirror_root: Path = Path("/work/.mirror"), srcs: dict[str, Path] | None = None
) -> dict[str, Any]:
    """Extract the peers' kernel files into ``dest`` and write the import shims."""
    srcs = srcs or {}
    dest.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    for peer, files in PEER_FILES.items():
        entry: dict[str, Any] = {"files": [], "missing": []}
        gd = None if peer in srcs else _find_mirror(mirror_root, peer)
        if peer in srcs:
            entry["source"] = str(srcs[peer])
            try:
                entry["commit"] = _git(srcs[peer] / ".git", "rev-parse", "HEAD").decode().strip()
            except Exception:
                entry["commit"] = None
            entry["version"] = _release_version(srcs[peer])
        elif gd is not None:
            entry["source"] = str(gd)
            entry["commit"] = _git(gd, "rev-parse", "HEAD").decode().strip()
        else:
            entry["error"] = f"no mirror of {peer} under {mirror_root}"
            info[peer] = entry
            continue
        for f in files:
            try:
                data = (
                    (srcs[peer] / f).read_bytes() if peer in srcs else _git(gd, "show", f"HEAD:{f}")
                )  # type: ignore[arg-type]
            except Exception:
                entry["missing"].append(f)
                continue
            out = dest / f[len(STRIP[peer]) :]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            entry["files"].append(f)
        info[peer] = entry
    for rel, text in SHIMS.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (dest / "SOURCES.json").write_text(json.dumps(info, indent=1))
    return info


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any vllm./sglang. module the extracted files import but we did not write: an empty
    stub whose attributes are inert, so optional imports do not stop the kernels loading."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name.split(".")[0] in ("vllm", "sglang"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        m = types.ModuleType(spec.name)
        m.__path__ = []  # type: ignore[attr-defined]
        m.__getattr__ = lambda attr: _Inert()  # type: ignore[method-assign]
        return m

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


class _Inert:
    def __call__(self, *a: Any, **k: Any) -> Any:
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # used as a decorator
        return _Inert()

    def __getattr__(self, name: str) -> Any:
        return _Inert()

    def __bool__(self) -> bool:
        return False


@dataclass
class PeerCase:
    """One case in a peer-neutral form. Adapters live in a pool; ``a`` [P, R, H], ``b``
    [P, N, R] (ranks below R are zero-padded), ``slots`` [T] int32 in contiguous segments."""

    x: torch.Tensor
    out: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor  # [P] int32
    scale: float


@dataclass
class Peer:
    name: str
    commit: str | None
    build: Callable[[PeerCase], Callable[[], None]]


def _segments(slots: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    s = slots.tolist()
    starts, lens, ids = [], [], []
    for i, v in enumerate(s):
        if i == 0 or v != s[i - 1]:
            starts.append(i)
            lens.append(0)
            ids.append(v)
        lens[-1] += 1
    return starts, lens, ids


def _sglang_sgemm(mods: dict[str, Any]) -> Callable[[PeerCase], Callable[[], None]]:
    la, lb, util = mods["a"], mods["b"], mods["utils"]

    def build(c: PeerCase) -> Callable[[], None]:
        dev = c.x.device
        starts, lens, ids = _segments(c.slots)
        i32 = dict(dtype=torch.int32, device=dev)
        kw: dict[str, Any] = dict(
            bs=len(lens),
            num_segments=len(lens),
            seg_lens=torch.tensor(lens, **i32),
            seg_indptr=torch.tensor([*starts, c.x.shape[0]], **i32),
            max_len=max(lens),
            weight_indices=torch.tensor(ids, **i32),
            lora_ranks=c.ranks.to(dev),
            scalings=torch.full((c.a.shape[0],), c.scale, device=dev),
            use_cuda_graph=True,
            permutation=None,
        )
        names = {f.name for f in util.LoRABatchInfo.__dataclass_fields__.values()}
        info = util.LoRABatchInfo(**{k: v for k, v in kw.items() if k in names})
        # Older releases took the scale as an argument; newer ones read batch_info.scalings.
        extra = (
            {"scaling": c.scale}
            if "scaling" in inspect.signature(lb.sgemm_lora_b_fwd).parameters
            else {}
        )

        def run() -> None:
            v = la.sgemm_lora_a_fwd(c.x, c.a, info)
            lb.sgemm_lora_b_fwd(v, c.b, info, base_output=c.out, **extra)

        return run

    return build


def _sglang_chunk_size(tokens: int, cap: int = 128) -> int:
    """SGLang's chunked backend picks its chunk from the batch's token count (128 from 256
    tokens, 32 from 64, else 16), capped by ``--max-lora-chunk-size`` (here its maximum)."""
    return min(cap, 128 if tokens >= 256 else 32 if tokens >= 64 else 16)


def _sglang_chunked(mods: dict[str, Any]) -> Callable[[PeerCase], Callable[[], None]]:
    shrink, expand, util = mods["shrink"], mods["expand"], mods["utils"]

    def build(c: PeerCase) -> Callable[[], None]:
        dev = c.x.device
        t, n = c.x.shape[0], c.out.shape[1]
        chunk = _sglang_chunk_size(t)
        _, lens, ids = _segments(c.slots)  # slots are contiguous: the permutation is identity
        seg_ids, seg_lens = [], []
        for w, ln in zip(ids, lens, strict=True):
            k = -(-ln // chunk)
            seg_ids += [w] * k
            seg_lens += [chunk] * (k - 1) + [ln - (k - 1) * chunk]
        indptr = [0]
        for ln in seg_lens:
            indptr.append(indptr[-1] + ln)
        i32 = dict(dtype=torch.int32, device=dev)
        kw: dict[str, Any] = dict(
            use_cuda_graph=True,
            bs=len(seg_lens),
            num_segments=len(seg_lens),
            seg_indptr=torch.tensor(indptr, **i32),
            weight_indices=torch.tensor(seg_ids, **i32),
            lora_ranks=c.ranks.to(dev),
            scalings=torch.full((c.a.shape[0],), c.scale, device=dev),
            max_len=chunk,
            seg_lens=torch.tensor(seg_lens, **i32),
            permutation=torch.arange(t, **i32),
        )
        names = {f.name for f in util.LoRABatchInfo.__dataclass_fields__.values()}
        info = util.LoRABatchInfo(**{k: v for k, v in kw.items() if k in names})
        offsets = torch.tensor([0, n], **i32)

        def run() -> None:
            v = shrink.chunked_sgmv_lora_shrink_forward(c.x, c.a, info, 1)
            expand.chunked_sgmv_lora_expand_forward(v, c.b, info, offsets, n, c.out)

        return run

    return build


def _vllm_meta(c: PeerCase) -> dict[str, Any]:
    dev = c.x.device
    p = c.a.shape[0]
    mapping = c.slots.to(torch.int64)
    order = torch.argsort(mapping, stable=True)
    ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
    n = ids.numel()
    lora_ids = torch.full((p + 1,), -1, dtype=torch.int32, device=dev)
    lora_ids[:n] = ids.to(torch.int32)
    ntok = torch.zeros(p + 1, dtype=torch.int32, device=dev)
    ntok[:n] = counts.to(torch.int32)
    start = torch.zeros(p + 2, dtype=torch.int32, device=dev)
    start[1:] = torch.cumsum(ntok, 0)
    return dict(
        token_lora_mapping=mapping.to(torch.int32), token_indices_sorted_by_lora_ids=order.to(
            torch.int32), num_tokens_per_lora=ntok, lora_token_start_loc=start, lora_ids=lora_ids,
        no_lora_flag_cpu=torch.tensor([False]), num_active_loras=torch.tensor([n]),
    )  # fmt: skip


def _call(fn: Callable[..., Any], known: dict[str, Any]) -> Callable[[], None]:
    params = inspect.signature(fn).parameters
    args = {k: v for k, v in known.items() if k in params}
    missing = [k for k, q in params.items() if k not in args and q.default is q.empty]
    if missing:
        raise TypeError(f"{fn.__name__}: no value for {missing}")
    return lambda: fn(**args)


def _vllm(mods: dict[str, Any]) -> Callable[[PeerCase], Callable[[], None]]:
    shrink = getattr(mods["shrink"], "_lora_shrink", None) or mods["shrink"].lora_shrink
    expand = getattr(mods["expand"], "_lora_expand", None) or mods["expand"].lora_expand
    shrink = inspect.unwrap(shrink)
    expand = inspect.unwrap(expand)

    def build(c: PeerCase) -> Callable[[], None]:
        meta = _vllm_meta(c)
        t, r = c.x.shape[0], c.a.shape[1]
        v = torch.zeros(1, t, r, dtype=torch.float32, device=c.x.device)
        s = _call(
            shrink, dict(meta, inputs=c.x, lora_a_weights=[c.a], output_tensor=v, scaling=c.scale)
        )
        e = _call(
            expand,
            dict(
                meta,
                inputs=v,
                lora_b_weights=[c.b],
                output_tensor=c.out,
                offset_start=0,
                add_inputs=True,
            ),
        )

        def run() -> None:
            with torch.inference_mode(False):
                s()
                e()

        return run

    return build


def load(dest: Path) -> tuple[dict[str, Peer], dict[str, str]]:
    """Import the extracted peers. Returns (peers, errors by peer name)."""
    dest = Path(dest)
    peers: dict[str, Peer] = {}
    errors: dict[str, str] = {}
    if not (dest / "SOURCES.json").exists():
        return peers, {"all": f"{dest} not prepared (run: python3 bench/sgmm_peers.py prepare)"}
    info = json.loads((dest / "SOURCES.json").read_text())
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    have = {k for k, v in info.items() if v.get("files")}
    for k in ("sglang", "vllm"):
        if k not in have:
            errors[k] = info.get(k, {}).get("error", "no files extracted")
    try:
        if "sglang" not in have:
            raise LookupError("not extracted")
        mods = {
            "a": importlib.import_module("sglang.srt.lora.triton_ops.sgemm_lora_a"),
            "b": importlib.import_module("sglang.srt.lora.triton_ops.sgemm_lora_b"),
            "utils": importlib.import_module("sglang.srt.lora.utils"),
        }
        peers["sglang_sgemm"] = Peer(
            "sglang_sgemm", info.get("sglang", {}).get("commit"), _sglang_sgemm(mods)
        )
    except LookupError:
        pass
    except Exception as e:
        errors["sglang_sgemm"] = f"{type(e).__name__}: {e}"
    try:
        if "sglang" not in have:
            raise LookupError("not extracted")
        mods = {
            "shrink": importlib.import_module("sglang.srt.lora.triton_ops.chunked_sgmv_shrink"),
            "expand": importlib.import_module("sglang.srt.lora.triton_ops.chunked_sgmv_expand"),
            "utils": importlib.import_module("sglang.srt.lora.utils"),
        }
        peers["sglang_chunked"] = Peer(
            "sglang_chunked", info.get("sglang", {}).get("commit"), _sglang_chunked(mods)
        )
    except LookupError:
        pass
    except Exception as e:
        errors["sglang_chunked"] = f"{type(e).__name__}: {e}"
    try:
        if "vllm" not in have:
            raise LookupError("not extracted")
        mods = {
            "shrink": importlib.import_module("vllm.lora.ops.triton_ops.lora_shrink_op"),
            "expand": importlib.import_module("vllm.lora.ops.triton_ops.lora_expand_op"),
        }
        peers["vllm"] = Peer("vllm", info.get("vllm", {}).get("commit"), _vllm(mods))
    except LookupError:
        pass
    except Exception as e:
        errors["vllm"] = f"{type(e).__name__}: {e}"
    return peers, errors


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", allow_abbrev=False)
    p.add_argument("--dest", type=Path, default=Path(__file__).parent / ".peers")
    p.add_argument("--mirror-root", type=Path, default=Path("/work/.mirror"))
    p.add_argument("--src", action="append", default=[], help="PEER=DIR: a plain source tree")
    args = ap.parse_args()
    srcs = {k: Path(v) for k, v in (s.split("=", 1) for s in args.src)}
    info = prepare(args.dest, args.mirror_root, srcs)
    print(json.dumps(info, indent=1))
    peers, errors = load(args.dest)
    print("importable:", sorted(peers), "errors:", errors)


if __name__ == "__main__":
    main()
