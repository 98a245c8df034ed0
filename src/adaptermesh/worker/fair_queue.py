"""Per-tenant bounded queues with deficit round robin admission into the engine.

The HTTP service puts every generation request through one ``FairQueue`` before it reaches
the engine. Three bounds keep memory finite whatever clients do:

- at most ``max_running`` requests are admitted (submitted to the engine) at once;
- each tenant has at most ``max_waiting_per_tenant`` requests waiting;
- all tenants together have at most ``max_waiting_total`` requests waiting.

A request over a bound is refused at once with ``QueueFullError`` (the service answers 429).

When a slot frees, the next request is picked by deficit round robin (Shreedhar and Varghese)
over the tenants that have waiting requests. Each request costs its estimated work in tokens
(prompt plus ``max_tokens``), so a tenant that sends long requests gets the same token share,
not the same request count, as a tenant that sends short ones. Within a tenant, order is FIFO.

The queue is single-threaded: call it from one event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
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
    queue: deque[Ticket] = field(default_factory=deque)
    running: int = 0
    deficit: int = 0
    # True while this tenant's current DRR turn has already been credited with its quantum.
    credited: bool = False
    admitted_total: int = 0
    admitted_cost_total: int = 0
    idle_since: float | None = None


class FairQueue:
    """Deficit round robin over per-tenant FIFO queues, with bounded admission."""

    def __init__(
        self,
        *,
        max_running: int,
        max_waiting_per_tenant: int,
        max_waiting_total: int,
        quantum: int = 512,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_running < 1:
            raise ValueError("max_running must be at least 1")
        if max_waiting_per_tenant < 0 or max_waiting_total < 0:
            raise ValueError("queue bounds must not be negative")
        if quantum < 1:
            raise ValueError("quantum must be at least 1")
        self.max_running = max_running
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_waiting_total = max_waiting_total
        self.quantum = quantum
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        # Tenants with at least one waiting ticket, in round-robin order; the head has the turn.
        self._active: deque[str] = deque()
        self._num_waiting = 0
        self._num_running = 0
        self._seq = itertools.count()

    # ----------------------------------------------------------------------------------- state
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    def snapshot(self) -> dict[str, TenantSnapshot]:
        """Per-tenant counts: live tenants plus recently idle ones (reported with zeros)."""
        self._forget_idle_tenants()
        return {
            name: TenantSnapshot(
                len(t.queue), t.running, t.admitted_total, t.admitted_cost_total
            )
            for name, t in self._tenants.items()
        }

    # ------------------------------------------------------------------------------ operations
    def submit(self, tenant: str, cost: int = 1) -> Ticket:
        """Queue a request, or admit it at once when a slot is free and nobody waits.

        Raises ``QueueFullError`` without changing any state when a bound would be exceeded.
        """
        cost = max(1, int(cost))
        state = self._tenants.get(tenant)
        loop = asyncio.get_running_loop()
        ticket = Ticket(tenant, cost, next(self._seq), self._clock(), loop.create_future())
        if self._num_running < self.max_running and self._num_waiting == 0:
            state = self._tenant(tenant)
            self._admit(state, ticket)
            return ticket
        waiting_here = len(state.queue) if state is not None else 0
        if waiting_here >= self.max_waiting_per_tenant:
            raise QueueFullError("tenant", tenant, self.max_waiting_per_tenant)
        if self._num_waiting >= self.max_waiting_total:
            raise QueueFullError("global", tenant, self.max_waiting_total)
        state = self._tenant(tenant)
        if not state.queue:
            self._active.append(tenant)
        state.queue.append(ticket)
        state.idle_since = None
        self._num_waiting += 1
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
            if state is not None:
                state.queue.remove(ticket)
                self._num_waiting -= 1
                if not state.queue:
                    self._deactivate(ticket.tenant, state)
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
            state = self._tenants[name] = _Tenant()
        return state

    def _admit(self, state: _Tenant, ticket: Ticket) -> None:
        ticket.state = "admitted"
        ticket.admitted_at = self._clock()
        state.running += 1
        state.admitted_total += 1
        state.admitted_cost_total += ticket.cost
        state.idle_since = None
        self._num_running += 1
        if not ticket.admitted.done():
            ticket.admitted.set_result(None)

    def _deactivate(self, name: str, state: _Tenant) -> None:
        # An emptied queue loses its deficit, as in DRR: credit is not banked across idle time.
        state.deficit = 0
        state.credited = False
        if self._active and self._active[0] == name:
            self._active.popleft()
        else:
            self._active.remove(name)
        self._mark_idle_if_empty(state)

    def _mark_idle_if_empty(self, state: _Tenant) -> None:
        if not state.queue and state.running == 0:
            state.idle_since = self._clock()

    def _forget_idle_tenants(self) -> None:
        now = self._clock()
        idle = [
            (t.idle_since, name)
            for name, t in self._tenants.items()
            if t.idle_since is not None
        ]
        expired = {name for since, name in idle if now - since > _IDLE_TENANT_TTL_S}
        if len(idle) - len(expired) > _MAX_IDLE_TENANTS:
            idle.sort()
            keep = idle[-_MAX_IDLE_TENANTS:]
            expired = {name for _, name in idle} - {name for _, name in keep}
        for name in expired:
            del self._tenants[name]

    def _dispatch(self) -> None:
        stalled = 0  # turns in a row that admitted nothing
        while self._num_running < self.max_running and self._active:
            name = self._active[0]
            state = self._tenants[name]
            if not state.credited:
                state.deficit += self.quantum
                state.credited = True
            head = state.queue[0]
            if head.cost <= state.deficit:
                state.queue.popleft()
                self._num_waiting -= 1
                state.deficit -= head.cost
                self._admit(state, head)
                stalled = 0
                if not state.queue:
                    self._deactivate(name, state)
                continue
            # The turn is over: the head request costs more than the remaining credit.
            state.credited = False
            self._active.rotate(-1)
            stalled += 1
            if stalled >= len(self._active):
                self._skip_empty_rounds()
                stalled = 0

    def _skip_empty_rounds(self) -> None:
        """Credit all active tenants with the rounds in which nobody could afford its head.

        Equivalent to running those rounds one by one, without spinning through them.
        """
        rounds = min(
            -(-(self._tenants[n].queue[0].cost - self._tenants[n].deficit) // self.quantum)
            for n in self._active
        )
        if rounds > 1:
            for n in self._active:
                self._tenants[n].deficit += (rounds - 1) * self.quantum
