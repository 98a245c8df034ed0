"""Per-tenant bounded queues with start-time fair queuing admission into the engine.

The HTTP service puts every generation request through one ``FairQueue`` before it reaches
the engine. Three bounds keep memory finite whatever clients do:

- at most ``max_running`` requests are admitted (submitted to the engine) at once;
- each tenant has at most ``max_waiting_per_tenant`` requests waiting;
- all tenants together have at most ``max_waiting_total`` requests waiting.

A request over a bound is refused at once with ``QueueFullError`` (the service answers 429).

When a slot frees, the next request is picked by start-time fair queuing (SFQ, Goyal, Vin and
Cheng 1996), a virtual-clock cousin of deficit round robin. Each request costs its estimated
work in tokens (prompt plus ``max_tokens``) and gets a start tag
``max(virtual_time, finish tag of the tenant's previous request)`` and a finish tag
``start + cost``; the waiting request with the smallest start tag runs next, and the virtual
time moves to that tag. So:

- backlogged tenants share admitted tokens equally, within one request's cost of each other,
  whatever their request sizes (DRR's guarantee, without DRR's quantum-sized bursts);
- a tenant that was quiet starts at the current virtual time: its request runs next instead of
  behind a flooding tenant's backlog, and it cannot bank credit while idle;
- within a tenant, order is FIFO (tags grow along a tenant's requests).

DRR with a quantum admits up to a quantum's worth of one tenant's requests in a row, which
puts a quiet tenant behind that burst; SFQ's per-request interleaving avoids it at the cost of
a heap operation (O(log n)) per request.

The queue is single-threaded: call it from one event loop only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["FairQueue", "QueueFullError", "TenantSnapshot", "Ticket"]

TicketState = Literal["waiting", "admitted", "released", "withdrawn"]

# Tenants that went idle are remembered this long so their queue-depth series drops to 0 before
# it disappears, instead of vanishing while still showing the last non-zero value.
_IDLE_TENANT_TTL_S = 300.0
# Bound on idle tenants kept for reporting; live tenants are bounded by the queue bounds.
_MAX_IDLE_TENANTS = 1024


class QueueFullError(Exception):
    """The request would exceed a queue bound. ``scope`` says which one."""

    def __init__(self, scope: Literal["tenant", "global"], tenant: str, limit: int) -> None:
        what = f"tenant {tenant!r}" if scope == "tenant" else "this worker"
        super().__init__(f"queue for {what} is full ({limit} waiting requests)")
        self.scope = scope
        self.tenant = tenant
        self.limit = limit


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in the queue. ``admitted`` resolves when it may run."""

    tenant: str
    cost: int
    seq: int
    enqueued_at: float
    admitted: asyncio.Future[None]
    start_tag: float = 0.0
    finish_tag: float = 0.0
    state: TicketState = "waiting"
    admitted_at: float | None = None


@dataclass(slots=True)
class TenantSnapshot:
    waiting: int
    running: int
    admitted_total: int
    admitted_cost_total: int


@dataclass(slots=True)
class _Tenant:
    waiting: int = 0
    running: int = 0
    # Finish tag of the tenant's latest queued or admitted request.
    last_finish: float = 0.0
    admitted_total: int = 0
    admitted_cost_total: int = 0
    idle_since: float | None = None


class FairQueue:
    """Start-time fair queuing over per-tenant FIFO queues, with bounded admission."""

    def __init__(
        self,
        *,
        max_running: int,
        max_waiting_per_tenant: int,
        max_waiting_total: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        if max_waiting_per_tenant < 0 or max_waiting_total < 0:
            raise ValueError("queue bounds must not be negative")
        self.max_running = max_running
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_waiting_total = max_waiting_total
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        # Waiting tickets by (start tag, arrival). Withdrawn tickets stay until popped or until
        # they outnumber the live ones, when the heap is rebuilt.
        self._heap: list[tuple[float, int, Ticket]] = []
        self._stale = 0
        self._virtual_time = 0.0
        self._num_waiting = 0
        self._num_running = 0
        self._seq = itertools.count()
        # Idle tenants are swept when the table reaches this size (amortised O(1) per new
        # tenant), so a stream of one-off client addresses cannot grow it without bound even
        # when nothing reads snapshot().
        self._sweep_at = 2 * _MAX_IDLE_TENANTS

    # ----------------------------------------------------------------------------------- state
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def virtual_time(self) -> float:
        return self._virtual_time

    def snapshot(self) -> dict[str, TenantSnapshot]:
        """Per-tenant counts: live tenants plus recently idle ones (reported with zeros)."""
        self._forget_idle_tenants()
        return {
            name: TenantSnapshot(t.waiting, t.running, t.admitted_total, t.admitted_cost_total)
            for name, t in self._tenants.items()
        }

    # ------------------------------------------------------------------------------ operations
    def submit(self, tenant: str, cost: int = 1) -> Ticket:
        """Queue a request, or admit it at once when a slot is free and nobody waits.

        Raises ``QueueFullError`` without changing any state when a bound would be exceeded.
        """
        cost = max(1, int(cost))
        state = self._tenants.get(tenant)
        immediate = self._num_running < self.max_running and self._num_waiting == 0
        if not immediate:
            if state is not None and state.waiting >= self.max_waiting_per_tenant:
                raise QueueFullError("tenant", tenant, self.max_waiting_per_tenant)
            if state is None and self.max_waiting_per_tenant == 0:
                raise QueueFullError("tenant", tenant, self.max_waiting_per_tenant)
            if self._num_waiting >= self.max_waiting_total:
                raise QueueFullError("global", tenant, self.max_waiting_total)
        state = self._tenant(tenant)
        loop = asyncio.get_running_loop()
        ticket = Ticket(tenant, cost, next(self._seq), self._clock(), loop.create_future())
        ticket.start_tag = max(self._virtual_time, state.last_finish)
        ticket.finish_tag = ticket.start_tag + cost
        state.last_finish = ticket.finish_tag
        state.idle_since = None
        if immediate:
            self._admit(state, ticket)
            return ticket
        state.waiting += 1
        self._num_waiting += 1
        heapq.heappush(self._heap, (ticket.start_tag, ticket.seq, ticket))
        self._dispatch()
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Wait until ``ticket`` is admitted. Cancelling the wait withdraws the ticket."""
        try:
            await asyncio.shield(ticket.admitted)
        except asyncio.CancelledError:
            self.release(ticket)
            raise

    def release(self, ticket: Ticket) -> None:
        """Give back the ticket's slot (if admitted) or its queue place (if waiting).

        Safe to call more than once and in any state.
        """
        state = self._tenants.get(ticket.tenant)
        if ticket.state == "waiting":
            ticket.state = "withdrawn"
            if not ticket.admitted.done():
                ticket.admitted.cancel()
            self._num_waiting -= 1
            self._stale += 1
            if state is not None:
                state.waiting -= 1
                # A withdrawn last request gives its tag back, so leaving costs no share.
                if state.last_finish == ticket.finish_tag:
                    state.last_finish = ticket.start_tag
                self._mark_idle_if_empty(state)
            if self._stale > max(64, len(self._heap) // 2):
                self._heap = [e for e in self._heap if e[2].state == "waiting"]
                heapq.heapify(self._heap)
                self._stale = 0
        elif ticket.state == "admitted":
            ticket.state = "released"
            self._num_running -= 1
            if state is not None:
                state.running -= 1
                self._mark_idle_if_empty(state)
        else:
            return
        self._dispatch()

    def set_max_running(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        self.max_running = max_running
        self._dispatch()

    # -------------------------------------------------------------------------------- internal
    def _tenant(self, name: str) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            if len(self._tenants) >= self._sweep_at:
                self._forget_idle_tenants()
                self._sweep_at = 2 * max(len(self._tenants), _MAX_IDLE_TENANTS)
            state = self._tenants[name] = _Tenant()
        return state

    def _admit(self, state: _Tenant, ticket: Ticket) -> None:
        ticket.state = "admitted"
        ticket.admitted_at = self._clock()
        self._virtual_time = max(self._virtual_time, ticket.start_tag)
        state.running += 1
        state.admitted_total += 1
        state.admitted_cost_total += ticket.cost
        state.idle_since = None
        self._num_running += 1
        if not ticket.admitted.done():
            ticket.admitted.set_result(None)

    def _mark_idle_if_empty(self, state: _Tenant) -> None:
        if state.waiting == 0 and state.running == 0:
            state.idle_since = self._clock()

    def _forget_idle_tenants(self) -> None:
        now = self._clock()
        idle = [
            (t.idle_since, name) for name, t in self._tenants.items() if t.idle_since is not None
        ]
        expired = {name for since, name in idle if now - since > _IDLE_TENANT_TTL_S}
        if len(idle) - len(expired) > _MAX_IDLE_TENANTS:
            idle.sort()
            keep = idle[-_MAX_IDLE_TENANTS:]
            expired = {name for _, name in idle} - {name for _, name in keep}
        for name in expired:
            # A forgotten tenant comes back at the current virtual time, as an idle one would.
            del self._tenants[name]

    def _dispatch(self) -> None:
        while self._num_running < self.max_running and self._num_waiting > 0:
            _, _, ticket = heapq.heappop(self._heap)
            if ticket.state != "waiting":
                self._stale -= 1
                continue
            state = self._tenants[ticket.tenant]
            state.waiting -= 1
            self._num_waiting -= 1
            self._admit(state, ticket)
