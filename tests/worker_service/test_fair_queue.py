"""Fair queue: bounds, deficit round robin order, withdrawal, and invariants under random use."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.fair_queue import FairQueue, QueueFullError, Ticket


def make(**kw: int) -> FairQueue:
    args = {"max_running": 1, "max_waiting_per_tenant": 100, "max_waiting_total": 1000}
    args.update(kw)
    return FairQueue(**args)


async def test_admits_at_once_when_free() -> None:
    q = make(max_running=2)
    a = q.submit("a")
    b = q.submit("b")
    assert a.state == b.state == "admitted"
    assert a.admitted.done()
    c = q.submit("c")
    assert c.state == "waiting"
    assert (q.num_running, q.num_waiting) == (2, 1)
    q.release(a)
    assert c.state == "admitted"
    assert (q.num_running, q.num_waiting) == (2, 0)


async def test_bounds_refuse_without_changing_state() -> None:
    q = make(max_waiting_per_tenant=2, max_waiting_total=3)
    q.submit("a")  # running
    q.submit("a")
    q.submit("a")
    with pytest.raises(QueueFullError) as info:
        q.submit("a")
    assert info.value.scope == "tenant"
    q.submit("b")
    with pytest.raises(QueueFullError) as info:
        q.submit("c")
    assert info.value.scope == "global"
    snap = q.snapshot()
    assert snap["a"].waiting == 2
    assert snap["a"].running == 1
    assert snap["b"].waiting == 1
    assert "c" not in snap
    assert q.num_waiting == 3


async def test_round_robin_interleaves_a_flood_with_a_quiet_tenant() -> None:
    q = make()
    first = q.submit("flood")
    flood = [q.submit("flood") for _ in range(10)]
    quiet = [q.submit("quiet") for _ in range(3)]
    order: list[str] = []
    running = first
    for _ in range(13):
        q.release(running)
        running = next(t for t in flood + quiet if t.state == "admitted")
        order.append(running.tenant)
    # The quiet tenant goes first (it was idle) and then gets every other slot, not the 11th.
    assert order[:6] == ["quiet", "flood"] * 3
    assert order[6:] == ["flood"] * 7


async def test_fair_queuing_shares_tokens_not_requests() -> None:
    q = make(max_waiting_per_tenant=1000)
    blocker = q.submit("x")
    big = [q.submit("big", cost=100) for _ in range(20)]
    small = [q.submit("small", cost=10) for _ in range(200)]
    q.release(blocker)
    for _ in range(100):
        admitted = [t for t in big + small if t.state == "admitted"]
        assert len(admitted) == 1
        q.release(admitted[0])
    snap = q.snapshot()
    big_cost = snap["big"].admitted_cost_total
    small_cost = snap["small"].admitted_cost_total
    assert abs(big_cost - small_cost) <= 100 + 10
    assert snap["small"].admitted_total > 5 * snap["big"].admitted_total


async def test_idle_tenant_cannot_bank_credit() -> None:
    q = make()
    blocker = q.submit("busy", cost=1)
    busy = [q.submit("busy", cost=10) for _ in range(50)]
    for _ in range(20):  # virtual time moves on while "late" is idle
        q.release(next(t for t in [blocker, *busy] if t.state == "admitted"))
    late = [q.submit("late", cost=10) for _ in range(10)]
    order = []
    for _ in range(10):
        q.release(next(t for t in busy + late if t.state == "admitted"))
        order.append(next(t for t in busy + late if t.state == "admitted").tenant)
    # Strict alternation: "late" gets no burst for the time it was idle.
    assert order.count("late") in (5, 6)
    assert all(a != b for a, b in itertools.pairwise(order))


async def test_cancelled_wait_withdraws_the_ticket() -> None:
    q = make()
    running = q.submit("a")
    waiting = q.submit("b")
    task = asyncio.create_task(q.wait(waiting))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert waiting.state == "withdrawn"
    assert q.num_waiting == 0
    q.release(running)
    assert q.num_running == 0
    # Releasing twice, or a withdrawn ticket, changes nothing.
    q.release(running)
    q.release(waiting)
    assert (q.num_running, q.num_waiting) == (0, 0)


async def test_wait_returns_once_admitted() -> None:
    q = make()
    running = q.submit("a")
    waiting = q.submit("b")
    task = asyncio.create_task(q.wait(waiting))
    await asyncio.sleep(0)
    assert not task.done()
    q.release(running)
    await asyncio.wait_for(task, 1)
    assert waiting.state == "admitted"


async def test_idle_tenants_are_reported_then_forgotten() -> None:
    now = [0.0]
    q = FairQueue(
        max_running=1, max_waiting_per_tenant=4, max_waiting_total=4, clock=lambda: now[0]
    )
    t = q.submit("a")
    q.release(t)
    assert q.snapshot()["a"].running == 0
    now[0] = 1000.0
    assert "a" not in q.snapshot()


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="max_running"):
        FairQueue(max_running=0, max_waiting_per_tenant=1, max_waiting_total=1)
    with pytest.raises(ValueError, match="negative"):
        FairQueue(max_running=1, max_waiting_per_tenant=-1, max_waiting_total=1)


ops = st.lists(
    st.tuples(
        st.sampled_from(["submit", "release", "withdraw", "resize"]),
        st.integers(0, 4),  # tenant
        st.integers(1, 300),  # cost
        st.integers(0, 10**6),  # pick
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops, max_running=st.integers(1, 4), per_tenant=st.integers(0, 5), total=st.integers(0, 12)
)
def test_invariants_hold_under_any_sequence(ops, max_running, per_tenant, total) -> None:
    async def body() -> None:
        q = FairQueue(
            max_running=max_running, max_waiting_per_tenant=per_tenant, max_waiting_total=total
        )
        tickets: list[Ticket] = []
        for op, tenant, cost, pick in ops:
            if op == "submit":
                before = (q.num_running, q.num_waiting)
                try:
                    tickets.append(q.submit(f"t{tenant}", cost))
                except QueueFullError:
                    assert (q.num_running, q.num_waiting) == before
            elif op == "resize":
                q.set_max_running(1 + cost % 4)
            else:
                state = "admitted" if op == "release" else "waiting"
                live = [t for t in tickets if t.state == state]
                if live:
                    q.release(live[pick % len(live)])
            live_waiting = [t for t in tickets if t.state == "waiting"]
            live_running = [t for t in tickets if t.state == "admitted"]
            assert q.num_waiting == len(live_waiting)
            assert q.num_running == len(live_running)
            assert q.num_waiting <= total
            # Work conserving: nothing waits while a slot is free.
            assert q.num_running >= q.max_running or q.num_waiting == 0
            for name, snap in q.snapshot().items():
                assert snap.waiting <= per_tenant
                assert snap.waiting == sum(t.tenant == name for t in live_waiting)
                assert snap.running == sum(t.tenant == name for t in live_running)
            # FIFO within a tenant.
            for name in {t.tenant for t in live_waiting}:
                seqs = [t.seq for t in tickets if t.tenant == name and t.state == "admitted"]
                waits = [t.seq for t in live_waiting if t.tenant == name]
                assert not seqs or not waits or max(seqs) < min(waits)

    asyncio.run(body())


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(1, 400), min_size=2, max_size=5), seed=st.integers(0, 1000))
def test_backlogged_tenants_get_equal_token_shares(costs, seed) -> None:
    """Each always-backlogged tenant sends requests of its own fixed cost; fair queuing keeps
    their admitted tokens within two requests' cost of each other."""

    async def body() -> None:
        rng = random.Random(seed)
        q = FairQueue(max_running=1, max_waiting_per_tenant=10**6, max_waiting_total=10**6)
        blocker = q.submit("blocker")
        tickets = [q.submit(f"t{i}", c) for i, c in enumerate(costs) for _ in range(400)]
        rng.shuffle(tickets)  # release order must not matter
        q.release(blocker)
        for _ in range(300):
            running = next(t for t in tickets if t.state == "admitted")
            q.release(running)
        snap = q.snapshot()
        shares = [snap[f"t{i}"].admitted_cost_total for i in range(len(costs))]
        assert max(shares) - min(shares) <= 2 * max(costs)

    asyncio.run(body())


async def test_one_off_tenants_do_not_grow_the_table_without_a_scrape() -> None:
    """Every new client address is a tenant; with nothing reading snapshot() the idle ones
    must still be forgotten, or memory grows with every address ever seen."""
    from adaptermesh.worker import fair_queue

    q = FairQueue(max_running=4, max_waiting_per_tenant=4, max_waiting_total=16)
    for i in range(10 * fair_queue._MAX_IDLE_TENANTS):
        q.release(q.submit(f"10.0.{i // 256}.{i % 256}"))
    assert len(q._tenants) <= 2 * fair_queue._MAX_IDLE_TENANTS + 1
