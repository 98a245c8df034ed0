"""The mmap ring-buffer consumer: record walking on synthetic rings, and end to end against
the classifier's am_events through BPF_PROG_TEST_RUN (wrap-around, overload, wakeups)."""

from __future__ import annotations

import ipaddress
import threading
import time

import numpy as np
import pytest

from adaptermesh.bpf import libbpf, ringbuf
from adaptermesh.bpf.loader import AmEvent, BpfShardTable
from adaptermesh.bpf.ringbuf import (
    BUSY_BIT,
    DISCARD_BIT,
    EVENT_SIZE,
    HEADER_SIZE,
    RECORD,
    EventBatch,
    drain_span,
)
from adaptermesh.bpf.table import FlowEvent, addr16

from .helpers import make_assignment
from .test_prog_run import _mark_shards, expected_maglev, udp4_fast

# ---- synthetic rings (no root) ------------------------------------------------------------


class FakeRing:
    """A data area of ``size`` bytes seen through a doubled view, as the kernel maps it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.area = np.zeros(size, dtype=np.uint8)
        self.prod = 0

    def doubled(self) -> np.ndarray:
        return np.concatenate([self.area, self.area])

    def _write(self, pos: int, payload: bytes) -> None:
        for k, byte in enumerate(payload):
            self.area[(pos + k) % self.size] = byte

    def put(self, payload: bytes, *, busy: bool = False, discard: bool = False) -> int:
        length = len(payload) | (BUSY_BIT if busy else 0) | (DISCARD_BIT if discard else 0)
        start = self.prod
        self._write(start, length.to_bytes(4, "little") + b"\0\0\0\0" + payload)
        self.prod += (len(payload) + HEADER_SIZE + 7) & ~7
        return start


def event_bytes(k: int) -> bytes:
    ev = AmEvent(ts_ns=1000 + k, shard=k % 7, reason=2, version=5)
    ev.src[:] = list(addr16(ipaddress.IPv4Address(f"10.9.{k // 256}.{k % 256}")))
    return bytes(ev)


def test_record_layout_matches_the_ring_header_and_struct_am_event() -> None:
    import ctypes

    assert EVENT_SIZE == ctypes.sizeof(AmEvent) == 40
    assert RECORD.itemsize == HEADER_SIZE + EVENT_SIZE
    assert RECORD.itemsize % 8 == 0  # kernel records are 8-byte aligned


def test_drain_decodes_committed_records_and_stops_at_a_busy_one() -> None:
    ring = FakeRing(4096)
    for k in range(5):
        ring.put(event_bytes(k))
    stop = ring.put(event_bytes(5), busy=True)
    ring.put(event_bytes(6))  # committed, but behind a busy record: must wait
    pos, batch = drain_span(ring.doubled(), 0, ring.prod, ring.size)
    assert pos == stop
    assert batch.ts_ns.tolist() == [1000 + k for k in range(5)]
    assert [str(e.source) for e in batch.events()] == [f"10.9.0.{k}" for k in range(5)]
    assert [e.shard for e in batch.events()] == [k % 7 for k in range(5)]
    assert {e.reason for e in batch.events()} == {"maglev"}


def test_drained_events_do_not_alias_the_ring() -> None:
    """The space is handed back to the producer right after a drain: a batch must own its data."""
    ring = FakeRing(4096)
    for k in range(3):
        ring.put(event_bytes(k))
    ring.put(b"x" * 13)  # forces a second run, through the one-record path
    ring.put(event_bytes(3))
    data = ring.doubled()
    for prod in (3 * RECORD.itemsize, ring.prod):  # one run, then several
        _, batch = drain_span(data, 0, prod, ring.size)
        expected = batch.ts_ns.tolist()
        data[:] = 0xAB  # the producer reuses the space
        assert batch.ts_ns.tolist() == expected
        assert batch.src[0, 12:].tolist() == [10, 9, 0, 0]
        data = ring.doubled()


def test_drain_skips_discarded_and_counts_foreign_records() -> None:
    ring = FakeRing(4096)
    ring.put(event_bytes(0))
    ring.put(event_bytes(1), discard=True)
    ring.put(b"x" * 13)  # another length: padded to 8, skipped, counted
    ring.put(event_bytes(2))
    pos, batch = drain_span(ring.doubled(), 0, ring.prod, ring.size)
    assert pos == ring.prod
    assert batch.ts_ns.tolist() == [1000, 1002]
    assert batch.foreign == 1


def test_a_record_that_wraps_past_the_end_is_read_whole() -> None:
    ring = FakeRing(1024)
    # Start close to the end so that the third record straddles the wrap point.
    ring.prod = 1024 - 2 * RECORD.itemsize - 16
    cons = ring.prod
    for k in range(4):
        ring.put(event_bytes(k))
    pos, batch = drain_span(ring.doubled(), cons, ring.prod, ring.size)
    assert pos == ring.prod
    assert pos > 1024
    assert batch.ts_ns.tolist() == [1000, 1001, 1002, 1003]
    assert [str(e.source) for e in batch.events()] == [f"10.9.0.{k}" for k in range(4)]


def test_ipv6_sources_decode_as_ipv6() -> None:
    ring = FakeRing(1024)
    ev = AmEvent(ts_ns=1, shard=1, reason=1, version=1)
    ev.src[:] = list(ipaddress.IPv6Address("2001:db8::7").packed)
    ring.put(bytes(ev))
    ring.put(event_bytes(3))
    _, batch = drain_span(ring.doubled(), 0, ring.prod, ring.size)
    assert [str(e.source) for e in batch.events()] == ["2001:db8::7", "10.9.0.3"]
    assert [e.reason for e in batch.events()] == ["pin", "maglev"]


# ---- the classifier's ring (root) ----------------------------------------------------------

needs_mmap = pytest.mark.skipif(not ringbuf.supported(), reason="mmap consumer is x86-64 only")


def _send(table: BpfShardTable, sources: list[str]) -> None:
    for src in sources:
        libbpf.prog_test_run(table.prog_fd, udp4_fast(src))


def _sources(base: str, n: int) -> list[str]:
    start = ipaddress.IPv4Address(base)
    return [str(start + k) for k in range(n)]


@pytest.mark.root
@needs_mmap
def test_events_equal_what_was_sent_across_ring_wrap_around(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_mark_shards()))
    version = fresh.applied_version
    cons0, _ = fresh.ring_positions()
    ring_bytes = fresh._ring.size if fresh._ring is not None else 0
    sent: list[str] = []
    got: list[FlowEvent] = []
    # 3 x 9,000 records of 48 bytes = 1.3 MB through a 1 MiB ring: the positions wrap, and a
    # record straddles the end of the data area (1 MiB is not a multiple of 48).
    for burst in range(3):
        sources = _sources(f"10.{120 + burst}.0.0", 9000)
        _send(fresh, sources)
        sent += sources
        while fresh.poll_events(got.append, 0):
            pass
    cons1, prod1 = fresh.ring_positions()
    assert cons1 == prod1
    assert cons1 // ring_bytes > cons0 // ring_bytes, "the ring did not wrap"
    assert [str(e.source) for e in got] == sent
    assert [e.shard for e in got] == [expected_maglev(fresh, s) for s in sent]
    assert {e.reason for e in got} == {"maglev"}
    assert {e.version for e in got} == {version}
    ts = [e.ts_ns for e in got]
    assert ts == sorted(ts)
    assert ts[0] > 0


@pytest.mark.root
@needs_mmap
def test_overload_with_a_slow_consumer_loses_only_what_is_counted(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_mark_shards()))
    before = fresh.read_counters().ringbuf_failed
    sent = _sources("10.130.0.0", 40000)
    got: list[str] = []
    done = threading.Event()

    def slow(ev: FlowEvent) -> None:
        got.append(str(ev.source))
        if len(got) == 1000:
            # Stall until every packet is sent: 40,000 new flows into a ring that holds
            # about 21,800 events must overrun it, while the consumer runs on both sides.
            done.wait(60)

    def consume() -> None:
        while not done.is_set():
            fresh.poll_events(slow, 20)
        while fresh.poll_events(slow, 0):
            pass

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        _send(fresh, sent)
    finally:
        done.set()
        consumer.join(30)
    lost = fresh.read_counters().ringbuf_failed - before
    assert lost > 0, "the consumer kept up; the test did not overload the ring"
    assert len(got) + lost == len(sent)
    # What arrived, arrived once, in order, undamaged: a subsequence of what was sent.
    it = iter(sent)
    assert all(any(s == g for s in it) for g in got)


@pytest.mark.root
@needs_mmap
def test_a_poll_with_a_timeout_wakes_up_on_the_first_event(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_mark_shards()))
    timer = threading.Timer(0.2, _send, args=(fresh, ["10.140.0.1"]))
    got: list[FlowEvent] = []
    t0 = time.monotonic()
    timer.start()
    try:
        n = fresh.poll_events(got.append, 5000)
    finally:
        timer.join()
    assert n == 1
    assert str(got[0].source) == "10.140.0.1"
    assert time.monotonic() - t0 < 3.0
    assert fresh.poll_events(got.append, 50) == 0  # nothing more: the timeout runs out


@pytest.mark.root
@needs_mmap
def test_a_failing_callback_keeps_the_rest_for_the_next_poll(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_mark_shards()))
    sent = _sources("10.150.0.0", 10)
    _send(fresh, sent)
    seen: list[str] = []

    def fail_on_third(ev: FlowEvent) -> None:
        seen.append(str(ev.source))
        if len(seen) == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fresh.poll_events(fail_on_third, 0)
    assert fresh.poll_events(lambda ev: seen.append(str(ev.source)), 0) == 7
    assert seen == sent


@pytest.mark.root
@needs_mmap
def test_poll_batch_hands_over_numpy_columns(fresh: BpfShardTable) -> None:
    fresh.apply(make_assignment(_mark_shards()))
    sent = _sources("10.160.0.0", 500)
    _send(fresh, sent)
    batches: list[EventBatch] = []
    assert fresh.poll_batch(batches.append, 0) == 500
    (batch,) = batches
    assert batch.shard.tolist() == [expected_maglev(fresh, s) for s in sent]
    assert [str(ipaddress.IPv4Address(bytes(row[12:]))) for row in batch.src] == sent
    assert [str(e.source) for e in batch.events()] == sent
