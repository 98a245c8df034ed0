"""The expand kernels' PTX for sm_90, compiled without a GPU, to compare two trees' kernels.

Triton compiles a kernel for a named target on any machine (its bundled LLVM and ptxas), so a
change to a kernel's source can be checked for what it does to the code before a GPU is at hand:
the bf16 tile and gemv expands and the INT4 expand, in their PDL / prefetch / hoist / gemv
variants, at one tile shape each. The PTX is written with its debug lines, line-table labels
and comments taken out and its registers numbered away, so two trees' files differ only where
the instructions do.

Usage:
    env -u TRITON_INTERPRET python bench/expand_ptx.py --src SRC --out DIR
    python bench/expand_ptx.py --compare DIR_A DIR_B

``--src`` is the ``src`` folder of the tree to compile (default: this checkout's); ``--compare``
prints, per variant, the lines of each and how many differ.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

_REGISTER = re.compile(r"%(rd|r|p|f|rs|fd|h|hh)\d+")
_LABEL = re.compile(r"\$L__\w+")


def _signature(fn: Any, consts: dict[str, Any]) -> tuple[dict[str, str], dict[tuple[int], Any]]:
    """Triton types for the kernel's parameters: bf16 activations and B, fp32 v and scales,
    int32 metadata, uint8 packed INT4 weights; every other scalar an int32."""
    sig: dict[str, str] = {}
    constexprs: dict[tuple[int], Any] = {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        elif not name.endswith("_ptr"):
            sig[name] = "i32"
        elif name.startswith(("v_", "scales_")):
            sig[name] = "*fp32"
        elif name in ("ranks_ptr", "sorted_ptr", "seg_start_ptr"):
            sig[name] = "*i32"
        elif re.fullmatch(r"q\d_ptr", name):
            sig[name] = "*u8"
        else:
            sig[name] = "*bf16"
    return sig, constexprs


def normalise(ptx: str) -> list[str]:
    """PTX without debug sections, .loc/.file lines, comments and line-table labels, with
    register numbers, label names and the kernel's name folded."""
    body = re.split(r"\.section\s+\.debug", ptx)[0]
    entry = re.search(r"\.entry\s+(\w+)", body)
    if entry:
        body = body.replace(entry.group(1), "KERNEL")
    out = []
    for line in body.splitlines():
        text = line.strip()
        if not text or text.startswith(("//", ".loc", ".file")):
            continue
        if re.fullmatch(r"\$L__tmp\d+:", text):
            continue
        text = text.split("//")[0].rstrip()
        out.append(_LABEL.sub("$L", _REGISTER.sub(r"%\1", text)))
    return out


def _variants() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, kernel, constexprs) for each variant compiled."""
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for prefetch in (False, True):
        for pdl in (False, True):
            for hoist in (False, True):
                rows.append((
                    f"expand-prefetch{int(prefetch)}-pdl{int(pdl)}-hoist{int(hoist)}",
                    "sgmm_kernels.sgmm_expand_kernel",
                    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, BLOCK_S=64, DOT_FP32=False,
                         PREFETCH_OUT=prefetch, PDL=pdl, HOIST_V=hoist, GEMV=False),
                ))  # fmt: skip
    for pdl in (False, True):
        rows.append((
            f"expand_gemv-pdl{int(pdl)}",
            "sgmm_kernels.sgmm_expand_kernel",
            dict(BLOCK_M=2, BLOCK_N=128, BLOCK_K=16, BLOCK_S=64, DOT_FP32=False,
                 PREFETCH_OUT=False, PDL=pdl, HOIST_V=False, GEMV=True),
        ))  # fmt: skip
        for gemv in (False, True):
            rows.append((
                f"expand_int4-gemv{int(gemv)}-pdl{int(pdl)}",
                "sgmm_int4_kernels.expand_int4_kernel",
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, BLOCK_S=64, GROUP=64,
                     GROUP_ALONG_K=False, DOT_FP32=False, SCALE_BLOCKS=False, GEMV=gemv,
                     PDL=pdl),
            ))  # fmt: skip
    rows.append((
        "fused",
        "sgmm_kernels.sgmm_fused_kernel",
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, BLOCK_R=16, BLOCK_S=64, DOT_FP32=False),
    ))  # fmt: skip
    return rows


def compile_all(src: Path, out: Path) -> dict[str, int]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    sys.path.insert(0, str(src))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out.mkdir(parents=True, exist_ok=True)
    target = GPUTarget("cuda", 90, 32)
    lines: dict[str, int] = {}
    for name, where, consts in _variants():
        module, attr = where.split(".")
        mod = importlib.import_module(f"adaptermesh.kernels.{module}")
        fn = getattr(mod, attr)
        if consts.get("GEMV") and hasattr(mod, "sgmm_expand_gemv_kernel"):
            # A tree from before the gemv expand was a variant of the tile expand's kernel.
            fn = mod.sgmm_expand_gemv_kernel
        params = inspect.signature(fn.fn).parameters
        consts = {k: v for k, v in consts.items() if k in params}
        missing = [
            n for n, q in params.items() if "constexpr" in str(q.annotation) and n not in consts
        ]
        if missing:
            raise SystemExit(f"{name}: no value for the constexprs {missing}")
        sig, constexprs = _signature(fn, consts)
        kernel = triton.compile(
            ASTSource(fn, sig, constexprs), target=target, options={"num_warps": 4}
        )
        text = normalise(kernel.asm["ptx"])
        (out / f"{name}.ptx").write_text("\n".join(text) + "\n")
        lines[name] = len(text)
    (out / "lines.json").write_text(json.dumps(lines, indent=1) + "\n")
    return lines


def compare(a: Path, b: Path) -> None:
    for path in sorted(a.glob("*.ptx")):
        left = path.read_text().splitlines()
        other = b / path.name
        if not other.exists():
            print(f"{path.stem}: only in {a}")
            continue
        right = other.read_text().splitlines()
        changed = sum(
            1
            for d in difflib.unified_diff(left, right, lineterm="", n=0)
            if d.startswith(("+", "-")) and not d.startswith(("+++", "---"))
        )
        print(f"{path.stem}: {len(left)} / {len(right)} lines, {changed} differ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    p.add_argument("--out", type=Path)
    p.add_argument("--compare", type=Path, nargs=2, metavar=("DIR_A", "DIR_B"))
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.out:
        for name, n in compile_all(args.src, args.out).items():
            print(f"{name}: {n} lines")
    else:
        p.error("--out or --compare")


if __name__ == "__main__":
    main()
