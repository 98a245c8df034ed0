"""Thin ctypes bindings to libbpf (``libbpf.so.1``) for what bcc's Python API lacks or does
slowly: batched map updates, whole-value writes of large values, object pins and
``BPF_PROG_TEST_RUN``.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = [
    "SKB_CTX_SIZE",
    "TestRunResult",
    "map_delete",
    "map_delete_batch",
    "map_lookup",
    "map_update",
    "map_update_batch",
    "obj_get",
    "prog_test_run",
]

BPF_ANY = 0
# sizeof(struct __sk_buff) on the kernels we run; TC test runs copy it in and out.
SKB_CTX_SIZE = 192
# struct __sk_buff.mark's offset.
SKB_MARK_OFFSET = 8


class _TestRunOpts(ctypes.Structure):
    # Must stay in sync with struct bpf_test_run_opts in libbpf's bpf.h (libbpf 1.x).
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


@cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    vp, u32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
    lib.bpf_map_update_batch.argtypes = [ctypes.c_int, vp, vp, u32p, vp]
    lib.bpf_map_update_batch.restype = ctypes.c_int
    lib.bpf_map_delete_batch.argtypes = [ctypes.c_int, vp, u32p, vp]
    lib.bpf_map_delete_batch.restype = ctypes.c_int
    lib.bpf_map_update_elem.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint64]
    lib.bpf_map_update_elem.restype = ctypes.c_int
    lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, vp, vp]
    lib.bpf_map_lookup_elem.restype = ctypes.c_int
    lib.bpf_map_delete_elem.argtypes = [ctypes.c_int, vp]
    lib.bpf_map_delete_elem.restype = ctypes.c_int
    lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
    lib.bpf_obj_get.restype = ctypes.c_int
    lib.bpf_obj_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
    lib.bpf_obj_pin.restype = ctypes.c_int
    lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(_TestRunOpts)]
    lib.bpf_prog_test_run_opts.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        # libbpf 1.x returns -errno directly.
        err = -rc if rc != -1 else ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _addr(buf: object) -> int:
    return ctypes.addressof(buf)  # type: ignore[arg-type]


def map_update_batch(fd: int, keys: Any, values: Any, count: int) -> None:
    """Write ``count`` key/value pairs in one syscall (bpf_map_update_batch)."""
    if count == 0:
        return
    n = ctypes.c_uint32(count)
    rc = _lib().bpf_map_update_batch(fd, _addr(keys), _addr(values), ctypes.byref(n), None)
    _check(rc, f"bpf_map_update_batch ({n.value}/{count} written)")


def map_delete_batch(fd: int, keys: Any, count: int) -> int:
    """Delete ``count`` keys in one syscall (bpf_map_delete_batch); returns how many went.

    The kernel deletes in order and stops at the first failure, so on an error the first
    ``deleted`` keys are gone and the rest are untouched; ``OSError.deleted`` says how many.
    """
    if count == 0:
        return 0
    n = ctypes.c_uint32(count)
    rc = _lib().bpf_map_delete_batch(fd, _addr(keys), ctypes.byref(n), None)
    if rc < 0:
        err = -rc if rc != -1 else ctypes.get_errno()
        e = OSError(err, f"bpf_map_delete_batch ({n.value}/{count} deleted): {os.strerror(err)}")
        e.deleted = n.value  # type: ignore[attr-defined]
        raise e
    return n.value


def map_update(fd: int, key: object, value: object | int) -> None:
    """Write one value; ``value`` may be a ctypes object or a raw address."""
    vaddr = value if isinstance(value, int) else _addr(value)
    _check(_lib().bpf_map_update_elem(fd, _addr(key), vaddr, BPF_ANY), "bpf_map_update_elem")


def map_lookup(fd: int, key: object, value: object) -> bool:
    rc = _lib().bpf_map_lookup_elem(fd, _addr(key), _addr(value))
    if rc == -errno.ENOENT or (rc == -1 and ctypes.get_errno() == errno.ENOENT):
        return False
    _check(rc, "bpf_map_lookup_elem")
    return True


def map_delete(fd: int, key: object) -> bool:
    rc = _lib().bpf_map_delete_elem(fd, _addr(key))
    if rc == -errno.ENOENT or (rc == -1 and ctypes.get_errno() == errno.ENOENT):
        return False
    _check(rc, "bpf_map_delete_elem")
    return True


def obj_get(path: str) -> int:
    fd = _lib().bpf_obj_get(path.encode())
    _check(fd, f"bpf_obj_get({path})")
    return int(fd)


def obj_pin(fd: int, path: str) -> None:
    """Pin the map or program ``fd`` at ``path`` on a bpffs."""
    _check(_lib().bpf_obj_pin(fd, path.encode()), f"bpf_obj_pin({path})")


@dataclass(frozen=True, slots=True)
class TestRunResult:
    retval: int
    data: bytes
    duration_ns: int
    mark: int


def prog_test_run(prog_fd: int, data: bytes, *, repeat: int = 1, mark: int = 0) -> TestRunResult:
    """Run a TC program on one packet through BPF_PROG_TEST_RUN.

    ``duration_ns`` is the kernel's own average per repetition.
    """
    data_in = ctypes.create_string_buffer(data, len(data))
    data_out = ctypes.create_string_buffer(len(data) + 256)
    ctx_in = ctypes.create_string_buffer(SKB_CTX_SIZE)
    ctypes.c_uint32.from_buffer(ctx_in, SKB_MARK_OFFSET).value = mark
    ctx_out = ctypes.create_string_buffer(SKB_CTX_SIZE)
    opts = _TestRunOpts()
    opts.sz = ctypes.sizeof(_TestRunOpts)
    opts.data_in = ctypes.addressof(data_in)
    opts.data_size_in = len(data)
    opts.data_out = ctypes.addressof(data_out)
    opts.data_size_out = len(data_out)
    opts.ctx_in = ctypes.addressof(ctx_in)
    opts.ctx_size_in = SKB_CTX_SIZE
    opts.ctx_out = ctypes.addressof(ctx_out)
    opts.ctx_size_out = SKB_CTX_SIZE
    opts.repeat = repeat
    _check(_lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "bpf_prog_test_run_opts")
    out_mark = ctypes.c_uint32.from_buffer(ctx_out, SKB_MARK_OFFSET).value
    return TestRunResult(
        retval=opts.retval,
        data=data_out.raw[: opts.data_size_out],
        duration_ns=opts.duration,
        mark=out_mark,
    )
