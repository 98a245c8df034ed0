"""Compile, pin, attach and drive the shard classifier.

Usage by the node agent::

    table = BpfShardTable(ifname="eth0", pin_dir="/sys/fs/bpf/adaptermesh", vxlan_dev="am-vx0")
    table.attach()                     # clsact ingress, direct-action filter, replaced in place
    table.apply(assignment)            # validate -> shards -> pins -> idle Maglev table -> flip
    table.read_stats()                 # {shard index: ShardStats}
    table.read_counters()              # DatapathCounters: lost events, each pass reason
    table.poll_events(callback, 100)   # FlowEvent per new flow
    table.poll_batch(callback, 100)    # or one EventBatch (numpy columns) per drain
    table.inspect()                    # Attachment: interface, our filter, the pins still there?
    table.reattach()                   # pin what was unpinned, attach again (a new interface)
    table.watch_links(wake, stop)      # call wake() on every link or tc change (a thread)
    table.close(detach=False)          # keep the filter and pins: a restart picks them up
    table.discard()                    # a start that failed: remove the pins this table made

``netns`` names a network namespace that holds ``ifname`` and ``vxlan_dev`` (tests and the
demo; :mod:`adaptermesh.bpf.namespace` enters it); the default is the caller's namespace.

Restarts: every map is pinned under ``pin_dir``. A new BpfShardTable compiles the program,
reuses the pinned maps (counters, sticky flows, the live Maglev table and its version stay),
and ``attach()`` swaps the new program into the same filter slot with one netlink replace, so
traffic never sees a missing or empty classifier.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import ipaddress
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from adaptermesh.bpf import libbpf, maglev, ringbuf
from adaptermesh.bpf.namespace import inside
from adaptermesh.bpf.ringbuf import EventBatch, RingBuffer
from adaptermesh.bpf.table import (
    AM_MAX_PINS,
    AM_MAX_SHARDS,
    F_INGRESS,
    F_SET_MAC,
    REASON_NAMES,
    STATE_ACTIVE,
    STATE_DRAINING,
    Attachment,
    DatapathCounters,
    FlowEvent,
    Plan,
    ShardPlan,
    ShardStats,
    SteerPlan,
    addr16,
    validate_assignment,
)

if TYPE_CHECKING:  # the lazy re-export hides the generated types from mypy
    from adaptermesh.proto.adaptermesh.v1 import assignment_pb2
else:
    from adaptermesh.proto import assignment_pb2

__all__ = [
    "DEFAULT_PIN_DIR",
    "AmCtl",
    "AmEvent",
    "AmFlow",
    "AmLpmKey",
    "AmShard",
    "AmStats",
    "ApplyTiming",
    "BpfShardTable",
    "classifier_source",
]

DEFAULT_PIN_DIR = "/sys/fs/bpf/adaptermesh"
MAP_NAMES = (
    "am_pins",
    "am_flows",
    "am_conns",
    "am_maglev",
    "am_ctl",
    "am_shards",
    "am_stats",
    "am_counters",
    "am_events",
)
# The filter slot we own on the clsact ingress hook; replace-in-place targets exactly it.
FILTER_PRIO = 0xA11
FILTER_HANDLE = 1
TC_INGRESS = "ffff:fff2"
ETH_P_ALL = 0x0003
AM_CNT_MAX = 8
_BYTEORDER: Literal["little", "big"] = "little" if sys.byteorder == "little" else "big"
# Pin changes at least this large are written beside the Maglev build (see _apply); below
# it a thread's start-up (about 0.1 ms) costs more than the overlap gains.
PIN_WRITER_THREAD_MIN = 256
ENOTSUPP = 524  # the kernel-internal errno the bpf syscall returns for unsupported map ops


# ---- mirrors of classifier.h --------------------------------------------------------------


class AmLpmKey(ctypes.Structure):
    # Must stay in sync with struct am_lpm_key.
    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 16)]


class AmFlow(ctypes.Structure):
    # Must stay in sync with struct am_flow.
    _fields_ = [
        ("last_seen_ns", ctypes.c_uint64),
        ("shard", ctypes.c_uint32),
        ("reason", ctypes.c_uint32),
    ]


class AmShard(ctypes.Structure):
    # Must stay in sync with struct am_shard.
    _fields_ = [
        ("state", ctypes.c_uint8),
        ("kind", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pad0", ctypes.c_uint8),
        ("ifindex", ctypes.c_uint32),
        ("remote_ipv4", ctypes.c_uint32),
        ("vni", ctypes.c_uint32),
        ("mark", ctypes.c_uint32),
        ("mac", ctypes.c_uint8 * 6),
        ("pad1", ctypes.c_uint8 * 2),
    ]


class AmCtl(ctypes.Structure):
    # Must stay in sync with struct am_ctl.
    _fields_ = [
        ("active", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("version", ctypes.c_uint64),
    ]


class AmStats(ctypes.Structure):
    # Must stay in sync with struct am_stats.
    _fields_ = [
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("new_flows", ctypes.c_uint64),
        ("events_dropped", ctypes.c_uint64),
    ]


class AmEvent(ctypes.Structure):
    # Must stay in sync with struct am_event.
    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("src", ctypes.c_uint8 * 16),
        ("shard", ctypes.c_uint32),
        ("reason", ctypes.c_uint32),
        ("version", ctypes.c_uint64),
    ]


@dataclass(frozen=True, slots=True)
class ApplyTiming:
    """Where the last apply() spent its time (nanoseconds from the apply() call)."""

    validated_ns: int
    # shards that stay or become ACTIVE and the pins written, and the idle table built (a
    # large pin change is written while the table is built)
    table_built_ns: int
    flipped_ns: int
    done_ns: int
    pins_written: int
    pins_deleted: int


def classifier_source() -> Path:
    """Absolute path of the packaged classifier.bpf.c."""
    return Path(str(resources.files("adaptermesh.bpf").joinpath("classifier.bpf.c")))


def _possible_cpus() -> int:
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) if hi else int(lo)) - int(lo) + 1
    return n


def _ensure_bpffs(pin_dir: Path) -> None:
    """Mount bpffs on /sys/fs/bpf when nothing is mounted there, then create pin_dir."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    if not any(m.split()[2] == "bpf" and str(pin_dir).startswith(m.split()[1]) for m in mounts):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"bpf", b"/sys/fs/bpf", b"bpf", 0, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount bpffs on /sys/fs/bpf: {os.strerror(err)}")
    pin_dir.mkdir(parents=True, exist_ok=True)


def _shard_value(p: ShardPlan, state: int) -> AmShard:
    v = AmShard()
    v.state = state
    v.kind = p.steer.kind
    v.ifindex = p.steer.ifindex
    v.remote_ipv4 = p.steer.remote_ipv4
    v.vni = p.steer.vni
    v.mark = p.steer.mark
    flags = 0
    if p.steer.mac is not None:
        flags |= F_SET_MAC
        v.mac[:] = list(p.steer.mac)
    if p.steer.ingress:
        flags |= F_INGRESS
    v.flags = flags
    return v


def _lpm_keys(keys: list[tuple[int, bytes]]) -> ctypes.Array[AmLpmKey]:
    blob = b"".join([plen.to_bytes(4, _BYTEORDER) + addr for plen, addr in keys])
    return (AmLpmKey * len(keys)).from_buffer_copy(blob)


@contextmanager
def _gc_deferred() -> Iterator[None]:
    """Hold the cyclic garbage collector off for one apply() (a few milliseconds).

    A full collection in an agent process takes about 10 ms (measured: 11.5 ms with bcc and
    the protobufs loaded) and lands inside an apply() every few hundred calls, which alone
    breaks a 10 ms p99 from the call to the flip. Deferred, it runs right after the apply.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class BpfShardTable:
    """The kernel ShardTable: the classifier program and its pinned maps."""

    def __init__(
        self,
        ifname: str,
        pin_dir: str = DEFAULT_PIN_DIR,
        vxlan_dev: str | None = None,
        *,
        netns: str | None = None,
        maglev_size: int = maglev.DEFAULT_SIZE,
        max_shards: int = AM_MAX_SHARDS,
        max_pins: int = AM_MAX_PINS,
        max_flows: int = 262144,
        ringbuf_pages: int = 256,
        learn: bool = True,
    ) -> None:
        from bcc import BPF  # imported here so the Protocol and the fake need no bcc

        if not maglev.is_prime(maglev_size):
            raise ValueError(f"maglev_size: {maglev_size} is not prime")
        if not 0 < max_shards <= maglev.NO_SHARD:
            raise ValueError(f"max_shards: {max_shards} out of range")
        self.ifname = ifname
        self.pin_dir = Path(pin_dir)
        self.vxlan_dev = vxlan_dev
        self.netns = netns
        self.maglev_size = maglev_size
        self.max_shards = max_shards
        self.max_pins = max_pins
        self.last_apply: ApplyTiming | None = None
        # What this table creates, so discard() (a start that failed) removes exactly that and
        # never the pins an earlier run left for a restart to resume from.
        self._created_pin_dir = not self.pin_dir.exists()
        _ensure_bpffs(self.pin_dir)
        self._created_pins = tuple(n for n in MAP_NAMES if not (self.pin_dir / n).exists())
        self._bpf: Any = None
        try:
            src = classifier_source()
            cflags = [
                f"-I{src.parent}",
                f'-DAM_PIN_DIR="{self.pin_dir}"',
                f"-DAM_MAGLEV_SIZE={maglev_size}",
                f"-DAM_MAX_SHARDS={max_shards}",
                f"-DAM_MAX_PINS={max_pins}",
                f"-DAM_MAX_FLOWS={max_flows}",
                f"-DAM_MAX_CONNS={max_flows}",  # as many TCP connections as sticky sources
                f"-DAM_RINGBUF_PAGES={ringbuf_pages}",
                f"-DAM_LEARN={1 if learn else 0}",
            ]
            self._bpf = BPF(src_file=str(src).encode(), cflags=cflags)
            self._fn: Any = self._bpf.load_func(b"am_classify", BPF.SCHED_CLS)
            self._fd = {name: int(self._bpf[name.encode()].map_fd) for name in MAP_NAMES}
            self._ncpu = _possible_cpus()
            self._batch_delete = True  # cleared if the kernel refuses batch deletes on am_pins
            self._ring_open = False  # bcc's consumer (CPUs other than x86-64)
            self._ring: RingBuffer | None = None  # the mmap consumer
            self._ring_lock = threading.Lock()  # close() must not unmap under a running poll
            # Events decoded but not yet delivered because a callback raised: delivered first by
            # the next poll_events(), so a failing callback loses only its own event.
            self._pending: deque[FlowEvent] = deque()
            self._callback: Callable[[FlowEvent], None] | None = None
            self._delivered = 0
            self._callback_error: BaseException | None = None
            self._load_shadow()
        except BaseException:
            # A compile, load or pinned-map error: nothing of this start stays behind.
            if self._bpf is not None:
                self._bpf.cleanup()
            self._unpin_created()
            raise

    # ---- state carried over from the pins (a restarted loader resumes from them) ----------

    def _load_shadow(self) -> None:
        ctl = AmCtl()
        libbpf.map_lookup(self._fd["am_ctl"], ctypes.c_uint32(0), ctl)
        self._active = ctl.active & 1
        self._version: int | None = ctl.version if ctl.version else None
        self._shard_state: dict[int, int] = {}
        # (state, steer) last written per shard index by this process; empty after a restart,
        # so the first apply() rewrites every shard.
        self._shard_written: dict[int, tuple[int, SteerPlan]] = {}
        for idx in range(self.max_shards):
            v = AmShard()
            if libbpf.map_lookup(self._fd["am_shards"], ctypes.c_uint32(idx), v) and v.state:
                self._shard_state[idx] = v.state
        self._reload_pins()

    def _reload_pins(self) -> None:
        """Read am_pins back into the shadow (start-up, and after a failed pin write)."""
        self._pins: dict[tuple[int, bytes], int] = {}
        self._pins_applied: dict[tuple[int, bytes], int] | None = None
        for k, v in self._bpf[b"am_pins"].items():
            self._pins[(int(k.prefixlen), bytes(k.addr))] = int(v.value)

    def read_pins(self) -> dict[tuple[int, bytes], int]:
        """What am_pins holds now: (prefixlen, 16-byte address) -> shard index."""
        out: dict[tuple[int, bytes], int] = {}
        for k, v in self._bpf[b"am_pins"].items():
            out[(int(k.prefixlen), bytes(k.addr))] = int(v.value)
        return out

    @property
    def applied_version(self) -> int | None:
        return self._version

    @property
    def prog_fd(self) -> int:
        return int(self._fn.fd)

    def map_fd(self, name: str) -> int:
        return self._fd[name]

    # ---- attach / detach -------------------------------------------------------------------

    @contextmanager
    def _ipr(self) -> Iterator[Any]:
        from pyroute2 import IPRoute

        # A netlink socket opened inside the namespace stays bound to it; this avoids
        # pyroute2's NetNS, which forks a helper process.
        if self.netns:
            with inside(self.netns):
                ipr = IPRoute()
        else:
            ipr = IPRoute()
        try:
            yield ipr
        finally:
            ipr.close()

    def _ifindex(self, ipr: Any, name: str) -> int | None:
        found = ipr.link_lookup(ifname=name)
        return int(found[0]) if found else None

    def attach(self) -> None:
        """Attach to ``ifname``'s clsact ingress, replacing our filter in place."""
        from pyroute2 import NetlinkError

        with self._ipr() as ipr:
            idx = self._ifindex(ipr, self.ifname)
            if idx is None:
                raise ValueError(f"ifname: no interface {self.ifname!r}")
            try:
                ipr.tc("add", "clsact", idx)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise
            ipr.tc(
                "replace-filter",
                "bpf",
                idx,
                f":{FILTER_HANDLE}",
                fd=self._fn.fd,
                name=self._fn.name.decode(),
                parent=TC_INGRESS,
                classid=1,
                direct_action=True,
                prio=FILTER_PRIO,
                protocol=ETH_P_ALL,
            )

    def _has_filter(self, ipr: Any, idx: int) -> bool:
        # tcm_info holds the filter's priority in its upper 16 bits (and the protocol below).
        for f in ipr.get_filters(index=idx, parent=0xFFFFFFF2):
            if f.get_attr("TCA_KIND") == "bpf" and f["info"] >> 16 == FILTER_PRIO:
                return True
        return False

    def inspect(self) -> Attachment:
        """What is still in place: the interface, our filter on its ingress, each pin.

        A CNI or an operator that deletes the interface takes the filter with it; ``rm`` on
        bpffs unpins a map while this process keeps using it. Neither tells the loader.
        """
        unpinned = tuple(n for n in MAP_NAMES if not (self.pin_dir / n).exists())
        with self._ipr() as ipr:
            idx = self._ifindex(ipr, self.ifname)
            attached = idx is not None and self._has_filter(ipr, idx)
        return Attachment(interface=idx is not None, filter=attached, unpinned=unpinned)

    def reattach(self) -> None:
        """Pin again every map whose pin is gone (this process still holds the maps, with
        their pins, sticky flows and counters), then attach to ``ifname`` (a new interface of
        the same name gets the filter again). The caller re-applies the Assignment first
        when the interface is new, so its first packet meets the current state."""
        _ensure_bpffs(self.pin_dir)
        for name in MAP_NAMES:
            path = self.pin_dir / name
            if not path.exists():
                libbpf.obj_pin(self._fd[name], str(path))
        self.attach()

    def watch_links(self, wake: Callable[[], None], stop: threading.Event) -> None:
        """Call ``wake`` on every link or traffic-control change in ``ifname``'s namespace,
        until ``stop`` is set (run it in a thread: it blocks on a netlink socket)."""
        import select

        from pyroute2.netlink.rtnl import RTMGRP_LINK, RTMGRP_TC

        with self._ipr() as ipr:
            ipr.bind(groups=RTMGRP_LINK | RTMGRP_TC)
            while not stop.is_set():
                ready, _, _ = select.select([ipr.fileno()], [], [], 0.2)
                if ready:
                    ipr.get()
                    wake()

    def detach(self) -> None:
        """Remove our filter (the clsact qdisc stays: other programs may use it)."""
        from pyroute2 import NetlinkError

        with self._ipr() as ipr:
            idx = self._ifindex(ipr, self.ifname)
            if idx is None:
                return
            try:
                ipr.tc(
                    "del-filter",
                    "bpf",
                    idx,
                    f":{FILTER_HANDLE}",
                    parent=TC_INGRESS,
                    prio=FILTER_PRIO,
                    protocol=ETH_P_ALL,
                )
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):
                    raise

    def close(self, detach: bool = False, *, unpin: bool = False) -> None:
        """Release this process's handles. ``detach`` removes the filter; ``unpin`` the maps."""
        if detach:
            self.detach()
        if unpin:
            for name in MAP_NAMES:
                (self.pin_dir / name).unlink(missing_ok=True)
            with suppress(FileNotFoundError, OSError):
                self.pin_dir.rmdir()  # fails while other pins still live there
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
        self._bpf.cleanup()

    def discard(self) -> None:
        """Undo a start that failed (``attach()`` raised): release this process's handles and
        remove the pins this table created, and ``pin_dir`` when it created it and nothing
        else lives there. Pins that were there before (an earlier run's) stay."""
        self.close(detach=False)
        self._unpin_created()

    def _unpin_created(self) -> None:
        for name in self._created_pins:
            (self.pin_dir / name).unlink(missing_ok=True)
        if self._created_pin_dir:
            with suppress(OSError):
                self.pin_dir.rmdir()  # fails while other pins live there

    # ---- apply -------------------------------------------------------------------------------

    def _resolve(self, name: str) -> int | None:
        # if_nametoindex is one ioctl; a netlink socket costs about a millisecond, once per
        # redirect shard and once for the VXLAN device on every apply().
        try:
            if self.netns:
                with inside(self.netns):
                    return socket.if_nametoindex(name)
            return socket.if_nametoindex(name)
        except OSError:
            return None

    def validate(self, assignment: assignment_pb2.Assignment) -> Plan:
        vx = None
        if self.vxlan_dev is not None:
            vx = self._resolve(self.vxlan_dev)
            if vx is None:
                raise ValueError(f"vxlan_dev: no interface {self.vxlan_dev!r}")
        return validate_assignment(
            assignment,
            max_shards=self.max_shards,
            max_pins=self.max_pins,
            applied_version=self._version,
            resolve_ifname=self._resolve,
            vxlan_ifindex=vx,
        )

    def apply(self, assignment: assignment_pb2.Assignment) -> None:
        """Validate, then write shards and pins, fill the idle Maglev table and flip am_ctl.

        A shard that leaves ACTIVE, or leaves the assignment, is rewritten only after the flip,
        so the table still in use never points at a shard the classifier would refuse.
        """
        with _gc_deferred():
            self._apply(assignment)

    def _apply(self, assignment: assignment_pb2.Assignment) -> None:
        t0 = time.perf_counter_ns()
        plan = self.validate(assignment)
        t_valid = time.perf_counter_ns()

        before: list[tuple[int, AmShard]] = []
        after: list[tuple[int, AmShard]] = []
        written = dict(self._shard_written)
        for idx, p in plan.shards.items():
            if p.state == STATE_DRAINING and self._shard_state.get(idx) == STATE_ACTIVE:
                after.append((idx, _shard_value(p, STATE_DRAINING)))
            elif written.get(idx) != (p.state, p.steer):
                # Weights live in the Maglev table, not in am_shards: an unchanged shard needs
                # no write (100 ctypes values cost about 0.3 ms).
                before.append((idx, _shard_value(p, p.state)))
            written[idx] = (p.state, p.steer)
        for idx in self._shard_state:
            if idx not in plan.shards:
                after.append((idx, AmShard()))
                written.pop(idx, None)
        self._write_shards(before)

        if plan.pins is self._pins_applied:
            # Validation handed back the dict we applied last: the pins did not change.
            upserts: list[tuple[tuple[int, bytes], int]] = []
            deletes: list[tuple[int, bytes]] = []
        elif plan.pins_delta is not None and plan.pins_delta.base is self._pins_applied:
            # Validation diffed against exactly what we applied: write only the change.
            upserts = list(plan.pins_delta.upserts.items())
            deletes = list(plan.pins_delta.deletes)
        else:
            # Another base (first apply after a restart, shard indices moved, another table
            # validated in between): compare with what the map holds.
            old = self._pins
            upserts = [(k, v) for k, v in plan.pins.items() if old.get(k) != v]
            deletes = [k for k in old if k not in plan.pins]
        # Upserts before deletes, both after the shards they name were written: the
        # classifier never meets a pin to an unwritten shard, and a CIDR that moved between
        # two spellings (or a narrower prefix) is never absent in between. A large change
        # (about 1.2 us of kernel time per LPM insert) is written by a helper thread while
        # this one builds the Maglev table: both run outside the GIL (a syscall and the C
        # fill), so on two cores they overlap. The table is pure data, so building it after
        # the shard writes changes nothing the classifier sees.
        writer: threading.Thread | None = None
        failed: list[BaseException] = []

        def write_pins() -> None:
            try:
                self._write_pins(upserts)
                self._delete_pins(deletes)
            except BaseException as e:  # re-raised by the applying thread
                failed.append(e)

        if len(upserts) + len(deletes) >= PIN_WRITER_THREAD_MIN:
            writer = threading.Thread(target=write_pins, name="am-pin-writer")
            writer.start()
        else:
            write_pins()
        try:
            table = maglev.build_table(plan.backends, self.maglev_size)
        finally:
            if writer is not None:
                writer.join()
        t_built = time.perf_counter_ns()
        if failed:
            # The map now holds some mix of old and new pins: forget the shadow so the next
            # apply() compares with what the map really holds.
            self._reload_pins()
            raise failed[0]

        idle = self._active ^ 1
        buf_addr, _ = table.buffer_info()
        libbpf.map_update(self._fd["am_maglev"], ctypes.c_uint32(idle), buf_addr)
        libbpf.map_update(
            self._fd["am_ctl"], ctypes.c_uint32(0), AmCtl(active=idle, version=plan.version)
        )
        t_flip = time.perf_counter_ns()
        self._write_shards(after)

        self._active = idle
        self._version = plan.version
        # Plan.pins is never mutated (validation copies before it changes a dict), so the
        # shadow can be the plan's own dict.
        self._pins = plan.pins
        self._pins_applied = plan.pins
        self._shard_state = {idx: p.state for idx, p in plan.shards.items()}
        self._shard_written = written
        self.last_apply = ApplyTiming(
            validated_ns=t_valid - t0,
            table_built_ns=t_built - t0,
            flipped_ns=t_flip - t0,
            done_ns=time.perf_counter_ns() - t0,
            pins_written=len(upserts),
            pins_deleted=len(deletes),
        )

    def _write_shards(self, items: list[tuple[int, AmShard]]) -> None:
        if not items:
            return
        keys = (ctypes.c_uint32 * len(items))(*(i for i, _ in items))
        values = (AmShard * len(items))(*(v for _, v in items))
        libbpf.map_update_batch(self._fd["am_shards"], keys, values, len(items))

    def _write_pins(self, items: list[tuple[tuple[int, bytes], int]]) -> None:
        if not items:
            return
        # Keys and values go in as packed bytes (struct am_lpm_key is a native u32 prefix
        # length and 16 address bytes): about 10x cheaper than filling ctypes structs.
        keys = _lpm_keys([k for k, _ in items])
        values = (ctypes.c_uint32 * len(items))(*(v for _, v in items))
        libbpf.map_update_batch(self._fd["am_pins"], keys, values, len(items))

    def _delete_pins(self, keys: list[tuple[int, bytes]]) -> None:
        if not keys:
            return
        arr = _lpm_keys(keys)
        fd = self._fd["am_pins"]
        done = 0
        if self._batch_delete:
            try:
                done = libbpf.map_delete_batch(fd, arr, len(keys))
            except OSError as e:
                # Kernels without batch ops on LPM tries say EINVAL/ENOTSUPP: delete one by
                # one from now on. ENOENT (a key already gone) stops the batch at that key:
                # the rest go one by one, and a missing key is fine.
                done = getattr(e, "deleted", 0)
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP):
                    self._batch_delete = False
                elif e.errno != errno.ENOENT:
                    raise
        for i in range(done, len(keys)):
            libbpf.map_delete(fd, arr[i])

    def lookup_flow(self, source: str) -> int | None:
        """The shard index in ``source``'s sticky flow entry (None: no entry, or not an IP)."""
        try:
            key = addr16(ipaddress.ip_address(source))
        except ValueError:
            return None
        value = AmFlow()
        if not libbpf.map_lookup(self._fd["am_flows"], (ctypes.c_uint8 * 16)(*key), value):
            return None
        return int(value.shard)

    def clear_flows(self) -> None:
        """Forget every sticky flow and every TCP connection's shard (the next packet of each
        is classified afresh)."""
        self._bpf[b"am_flows"].clear()
        self._bpf[b"am_conns"].clear()

    def active_table(self) -> list[int]:
        """The live Maglev table as the classifier reads it."""
        buf = (ctypes.c_uint16 * self.maglev_size)()
        libbpf.map_lookup(self._fd["am_maglev"], ctypes.c_uint32(self._active), buf)
        return list(buf)

    # ---- stats and events ----------------------------------------------------------------

    def _percpu(self, name: str, key: int, ctype: type[Any]) -> list[Any]:
        stride = (ctypes.sizeof(ctype) + 7) // 8 * 8
        buf = ctypes.create_string_buffer(stride * self._ncpu)
        if not libbpf.map_lookup(self._fd[name], ctypes.c_uint32(key), buf):
            return []
        return [ctype.from_buffer(buf, i * stride) for i in range(self._ncpu)]

    def read_stats(self) -> dict[int, ShardStats]:
        """Per-shard counters summed over CPUs, for every shard known or ever counted."""
        # One buffer for every lookup, summed over CPUs by numpy: a ctypes struct per CPU per
        # shard index would cost max_shards * CPUs objects on every load report.
        nfields = ctypes.sizeof(AmStats) // 8  # all u64, so no per-CPU padding
        buf = ctypes.create_string_buffer(ctypes.sizeof(AmStats) * self._ncpu)
        per_cpu = np.frombuffer(memoryview(buf), dtype=np.uint64).reshape(self._ncpu, nfields)
        fd = self._fd["am_stats"]
        out: dict[int, ShardStats] = {}
        for idx in range(self.max_shards):
            if libbpf.map_lookup(fd, ctypes.c_uint32(idx), buf):
                s = ShardStats(*per_cpu.sum(axis=0).tolist())
            else:
                s = ShardStats()
            if idx in self._shard_state or s != ShardStats():
                out[idx] = s
        return out

    def read_counters(self) -> DatapathCounters:
        vals = [
            sum(c.value for c in self._percpu("am_counters", i, ctypes.c_uint64))
            for i in range(AM_CNT_MAX)
        ]
        return DatapathCounters(
            ringbuf_failed=vals[0],
            non_ip=vals[1],
            malformed=vals[2],
            vlan=vals[3],
            no_shard=vals[4],
            steer_failed=vals[5],
            link_local=vals[6],
            martian_source=vals[7],
        )

    def _ring_consumer(self) -> RingBuffer | None:
        if self._ring is None and ringbuf.supported():
            self._ring = RingBuffer(self._fd["am_events"])
        return self._ring

    def poll_events(self, callback: Callable[[FlowEvent], None], timeout_ms: int = 0) -> int:
        """Deliver queued new-flow events to ``callback``; wait up to ``timeout_ms`` for one.

        Returns how many were delivered. If ``callback`` raises, the error propagates and the
        events after the failing one are kept for the next call.
        """
        with self._ring_lock:
            ring = self._ring_consumer()
            if ring is None:
                return self._poll_bcc(callback, timeout_ms)
            if self._pending:
                events = list(self._pending)
                self._pending.clear()
            else:
                events = ring.poll(timeout_ms).events()
            for i, ev in enumerate(events):
                try:
                    callback(ev)
                except BaseException:
                    self._pending.extend(events[i + 1 :])
                    raise
            return len(events)

    def poll_batch(self, callback: Callable[[EventBatch], None], timeout_ms: int = 0) -> int:
        """Like :meth:`poll_events`, but hands over each drain as one :class:`EventBatch`
        (numpy columns), for consumers that aggregate: no per-event Python objects.

        Returns the number of events in the batch (0: no callback). Needs the mmap consumer
        (x86-64).
        """
        with self._ring_lock:
            ring = self._ring_consumer()
            if ring is None:
                raise NotImplementedError("poll_batch needs the mmap ring consumer (x86-64)")
            if self._pending:
                raise RuntimeError("poll_events() has undelivered events; call it first")
            batch = ring.poll(timeout_ms)
            if len(batch):
                callback(batch)
            return len(batch)

    def ring_positions(self) -> tuple[int, int]:
        """(consumer_pos, producer_pos) of am_events in bytes since creation (tests, metrics)."""
        with self._ring_lock:
            ring = self._ring_consumer()
            if ring is None:
                raise NotImplementedError("needs the mmap ring consumer (x86-64)")
            return ring.consumer_pos, ring.producer_pos

    def ring_bytes(self) -> int:
        """Size of am_events' data area (from the map itself: a reused pin keeps its size)."""
        return ringbuf.map_max_entries(self._fd["am_events"])

    # bcc's per-event callback consumer, kept for CPUs where the mmap consumer's plain loads
    # and stores are not acquire/release (see ringbuf.supported()).

    def _on_event(self, _ctx: Any, data: Any, _size: Any) -> int:
        try:
            ev = AmEvent.from_address(data)
            raw = bytes(ev.src)
            src: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(raw)
            if raw[:12] == b"\x00" * 10 + b"\xff\xff":
                src = ipaddress.IPv4Address(raw[12:])
            event = FlowEvent(
                ts_ns=ev.ts_ns,
                source=src,
                shard=ev.shard,
                reason=REASON_NAMES.get(ev.reason, str(ev.reason)),
                version=ev.version,
            )
            if self._callback is not None:
                self._callback(event)
            self._delivered += 1
        except BaseException as e:  # surfaced by poll_events(); ctypes would swallow it
            self._callback_error = e
            return -1
        return 0

    def _poll_bcc(self, callback: Callable[[FlowEvent], None], timeout_ms: int) -> int:
        if not self._ring_open:
            self._bpf[b"am_events"].open_ring_buffer(self._on_event)
            self._ring_open = True
        self._callback = callback
        self._delivered = 0
        self._bpf.ring_buffer_poll(timeout_ms)
        if self._callback_error is not None:
            err, self._callback_error = self._callback_error, None
            raise err
        return self._delivered
