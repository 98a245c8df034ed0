"""Cached kernel launches: skip Triton's generic per-call dispatch once a kernel is compiled.

``kernel[grid](*args, **meta)`` binds every argument, computes a specialisation key (each
integer's value class, each pointer's 16-byte alignment), looks the compiled kernel up and
checks the globals it used: tens of microseconds per launch for kernels with 30-50 arguments,
which an eager ``add_lora`` pays twice. ``launch`` keys its own cache on exactly what Triton
specialises on and, on a hit, calls the compiled kernel's launcher directly with the same
arguments in the same order, the way ``JITFunction.run`` does after its lookup.

The fast path needs the launcher interface of triton >= 3.4 (``triton.knobs``, launchers taking
every bound argument, constexprs included). Anything else (older triton, the CPU interpreter,
non-CUDA tensors, an argument of a type the key does not model) goes through the generic path,
which is always correct. ``ADAPTERMESH_GENERIC_LAUNCH=1`` forces the generic path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from adaptermesh.kernels._backend import interpreter_enabled

__all__ = ["fast_path_available", "launch"]

try:  # triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton
    _knobs = None

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def fast_path_available() -> bool:
    return (
        _knobs is not None
        and not interpreter_enabled()
        and os.environ.get("ADAPTERMESH_GENERIC_LAUNCH", "") != "1"
    )


def _arg_key(a: object) -> object:
    """What Triton's specialisation depends on for one runtime argument, or None if unknown."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0, a.device.index)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, _I32_MIN <= a <= _I32_MAX)
    return None


# (kernel, grid-independent key) -> compiled kernel
_cache: dict[tuple[object, ...], Any] = {}


def launch(
    kernel: Any,  # a triton JITFunction
    grid: tuple[int, int, int],
    args: tuple[object, ...],  # runtime arguments in signature order
    constexprs: dict[str, object],  # every constexpr, in signature order
    *,
    num_warps: int,
    num_stages: int,
) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``, cached."""
    if not fast_path_available() or not args or not isinstance(args[0], torch.Tensor):
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    keys = tuple(_arg_key(a) for a in args)
    if any(k is None for k in keys):
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    key = (kernel, keys, tuple(constexprs.items()), num_warps, num_stages)
    compiled = _cache.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if compiled is not None and hasattr(compiled, "run"):
            _cache[key] = compiled
        return
    stream = _raw_stream(args[0].device)
    values = (*args, *constexprs.values())
    meta = compiled.launch_metadata(grid, stream, *values)
    compiled.run(
        grid[0],
        grid[1],
        grid[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        meta,
        _knobs.runtime.launch_enter_hook,
        _knobs.runtime.launch_exit_hook,
        *values,
    )


def prepare(
    kernel: Any,
    grid: tuple[int, int, int],
    args: tuple[object, ...],
    constexprs: dict[str, object],
    *,
    num_warps: int,
    num_stages: int,
) -> Callable[[], None]:
    """A launch with every argument bound now: calling it costs the driver call alone.

    The kernel is compiled here (without running); the closure keeps the tensors alive. Where
    the fast path is unavailable the closure is the generic launch, still correct.
    """
    if not fast_path_available() or not args or not isinstance(args[0], torch.Tensor):

        def generic() -> None:
            kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)

        return generic
    compiled = kernel.warmup(
        *args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages
    )
    values = (*args, *constexprs.values())
    device = args[0].device
    run = compiled.run
    function = compiled.function
    packed = compiled.packed_metadata
    g0, g1, g2 = grid
    runtime = _knobs.runtime

    def fast() -> None:
        stream = _raw_stream(device)
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
        run(g0, g1, g2, stream, function, packed, meta, enter, leave, *values)

    return fast


def _raw_stream(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(index))
    return int(torch.cuda.current_stream(device).cuda_stream)


def clear_cache() -> None:
    _cache.clear()

