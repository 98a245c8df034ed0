"""The placement loop: AdapterInstances' ``preload``, ``pinnedShards`` and ``replicas`` made
real on the workers (docs/adapter-instance.md).

``Preloader.step()`` is one read -> decide -> act: it reads the instances and shards from the
store, scrapes the ``/metrics`` of the workers of every shard some instance wants residency
on, asks ``placement.plan`` (pure) for the loads that close the gap and sends each as
``POST /v1/load_lora_adapter {lora_name, lora_path, pinned}`` to its worker. ``run()`` only
repeats it every ``interval_s``; a failed step is logged, counted and retried with backoff.

It is idempotent and bounded: a worker that already holds what is wanted gets no call, at
most ``max_actions`` loads go out per round (``concurrency`` at a time, each with a timeout),
and a (worker, adapter) pair whose load failed waits out an exponential backoff before it is
tried again. A preloaded (unpinned) adapter that the worker evicted is loaded again no sooner
than ``reload_interval_s`` after its last load, so a worker short of slots is not churned.
Every failure is kept, naming the worker, the shard, the adapter and what the worker said
(``problems()``), and logged when it first appears.

With ``auto_placement`` every instance that names no shards gets a home shard each round
(``placement.homes``, weighted by the adapter slots the workers report: the ``max_lora`` of
``vllm:lora_requests_info``, which the scrape remembers per worker). The loop scrapes every
shard's workers for it, hands changed homes to ``on_homes`` (the rebalancer, which publishes
them in the Assignment's edges) and preloads each adapter on its home.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from adaptermesh.backoff import Backoff
from adaptermesh.clock import Clock, SystemClock, sleep_or_stop
from adaptermesh.control_plane.placement import (
    PRELOAD,
    Action,
    Plan,
    Want,
    WorkerView,
    homed,
    homes,
    plan,
    shard_capacities,
    wants_home,
    wants_of,
)
from adaptermesh.control_plane.policy import endpoint_key
from adaptermesh.control_plane.store import Store
from adaptermesh.control_plane.tables import keep_only
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2
from adaptermesh.worker_scrape import parse_metrics

__all__ = [
    "HttpWorkerAdmin",
    "Preloader",
    "PreloaderConfig",
    "StepReport",
    "WorkerAdmin",
    "WorkerAdminError",
]

_ACTIVE = assignment_pb2.SHARD_STATE_ACTIVE


class WorkerAdminError(Exception):
    """A worker refused or could not be reached; the message says which and why."""


class WorkerAdmin(Protocol):
    async def residency(self, address: str, port: int) -> tuple[frozenset[str], frozenset[str]]:
        """(resident, pinned) adapters of the worker; raises WorkerAdminError."""
        ...

    async def load(self, address: str, port: int, adapter: str, path: str, pinned: bool) -> None:
        """Load (or reload) ``adapter``; raises WorkerAdminError."""
        ...


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


@dataclass
class HttpWorkerAdmin:
    """The workers' own HTTP API: ``GET /metrics`` and ``POST /v1/load_lora_adapter``."""

    admin_token: str | None = None
    timeout_s: float = 30.0
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(trust_env=False))
    # Worker key -> the adapter GPU slots its last readable /metrics reported (``max_lora``).
    slots_seen: dict[str, float] = field(default_factory=dict)

    async def residency(self, address: str, port: int) -> tuple[frozenset[str], frozenset[str]]:
        url = f"http://{_host(address)}:{port}/metrics"
        try:
            resp = await self.client.get(url, timeout=min(self.timeout_s, 5.0))
        except httpx.HTTPError as exc:
            raise WorkerAdminError(f"GET {url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise WorkerAdminError(f"GET {url}: HTTP {resp.status_code}")
        try:
            raw = parse_metrics(resp.text)
        except Exception as exc:  # a malformed exposition is the worker's fault, not ours
            raise WorkerAdminError(f"GET {url}: unreadable metrics: {exc}") from None
        if raw.max_lora is not None and raw.max_lora > 0:
            self.slots_seen[endpoint_key(address, port)] = raw.max_lora
        return raw.resident_adapters, raw.pinned_adapters

    async def load(self, address: str, port: int, adapter: str, path: str, pinned: bool) -> None:
        url = f"http://{_host(address)}:{port}/v1/load_lora_adapter"
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        body = {"lora_name": adapter, "lora_path": path, "pinned": pinned}
        try:
            resp = await self.client.post(url, json=body, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise WorkerAdminError(f"POST {url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 300:
            raise WorkerAdminError(f"POST {url}: HTTP {resp.status_code}: {_error_text(resp)}")

    async def aclose(self) -> None:
        await self.client.aclose()


def _error_text(resp: httpx.Response) -> str:
    """The worker's OpenAI-style error as ``param: message``, else the body's start."""
    try:
        err = resp.json().get("error", {})
        message, param = str(err.get("message", "")), err.get("param")
    except (ValueError, AttributeError):
        return resp.text[:200]
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return message or resp.text[:200]


@dataclass(frozen=True, slots=True)
class PreloaderConfig:
    interval_s: float = 5.0
    max_actions: int = 16  # loads sent per round
    concurrency: int = 4  # loads in flight at once
    retry_initial_s: float = 5.0  # backoff of a (worker, adapter) pair after a failed load
    retry_max_s: float = 300.0
    reload_interval_s: float = 60.0  # a preload evicted again waits this long after its load

    def validate(self) -> None:
        if self.interval_s <= 0 or self.max_actions < 1 or self.concurrency < 1:
            raise ValueError("placement: need interval_s > 0, max_actions >= 1, concurrency >= 1")
        if not 0 < self.retry_initial_s <= self.retry_max_s or self.reload_interval_s < 0:
            raise ValueError(
                "placement: need 0 < retry_initial_s <= retry_max_s and reload_interval_s >= 0"
            )


@dataclass(frozen=True, slots=True)
class StepReport:
    done: tuple[Action, ...]
    failed: tuple[tuple[Action, str], ...]
    unreachable: tuple[tuple[str, str], ...]  # (worker key, why)
    deferred: int
    short: tuple[tuple[str, str, int, int], ...]


class Preloader:
    def __init__(
        self,
        store: Store,
        admin: WorkerAdmin,
        *,
        clock: Clock | None = None,
        config: PreloaderConfig | None = None,
        logger: logging.Logger | None = None,
        auto_placement: bool = False,
        on_homes: Callable[[Mapping[str, str]], None] | None = None,
    ) -> None:
        self.store = store
        # Automatic homes: every instance naming no shards gets one (placement.homes);
        # ``on_homes`` receives each changed set (the rebalancer publishes it).
        self.auto_placement = auto_placement
        self.on_homes = on_homes
        self.homes: dict[str, str] = {}
        self._homes_delivered: dict[str, str] | None = None
        # Worker key -> adapter slots it reported last (kept while it is unreachable, so a
        # missed scrape does not move homes).
        self.slots: dict[str, float] = {}
        self.admin = admin
        self.clock = clock or SystemClock()
        self.config = config or PreloaderConfig()
        self.config.validate()
        self.log = logger or logging.getLogger("adaptermesh.control_plane.placement")
        # Pins this loop made: (worker key, adapter) -> path, so it can undo them when the
        # instance goes (lost on restart: docs/adapter-instance.md).
        self.managed: dict[tuple[str, str], str] = {}
        self._not_before: dict[tuple[str, str], float] = {}
        self._backoff: dict[tuple[str, str], Backoff] = {}
        self._problems: dict[str, str] = {}
        self.steps = 0
        self.failed_steps = 0

    def problems(self) -> dict[str, str]:
        """What stands between the instances and the workers now: key -> message."""
        return dict(self._problems)

    async def _observe(
        self, shards: Sequence[assignment_pb2.Shard], wanted: set[str]
    ) -> tuple[list[WorkerView], list[tuple[str, str]]]:
        managed_workers = {k[0] for k in self.managed}
        targets = [
            (s.id, ep, ep.draining or s.state != _ACTIVE)
            for s in shards
            for ep in s.endpoints
            if s.id in wanted or endpoint_key(ep.address, ep.port) in managed_workers
        ]
        limit = asyncio.Semaphore(max(self.config.concurrency, 8))

        async def one(
            shard_id: str, ep: assignment_pb2.Endpoint, draining: bool
        ) -> WorkerView | tuple[str, str]:
            async with limit:
                try:
                    resident, pinned = await self.admin.residency(ep.address, ep.port)
                except WorkerAdminError as exc:
                    return endpoint_key(ep.address, ep.port), str(exc)
            return WorkerView(shard_id, ep.address, ep.port, True, draining, resident, pinned)

        views: list[WorkerView] = []
        down: list[tuple[str, str]] = []
        for result in await asyncio.gather(*(one(*t) for t in targets)):
            if isinstance(result, WorkerView):
                views.append(result)
            else:
                down.append(result)
        return views, down

    def _decide(self, wants: Sequence[Want], views: Sequence[WorkerView]) -> Plan:
        now = self.clock.monotonic()
        held = frozenset(k for k, t in self._not_before.items() if t > now)
        return plan(
            wants, views, managed=self.managed, held=held, max_actions=self.config.max_actions
        )

    def _place(
        self,
        shards: Sequence[assignment_pb2.Shard],
        instances: Sequence[control_plane_pb2.AdapterInstance],
    ) -> None:
        """This round's homes from the slots seen so far; changed ones go to ``on_homes``."""
        seen = getattr(self.admin, "slots_seen", None)
        listed = {endpoint_key(ep.address, ep.port) for s in shards for ep in s.endpoints}
        if isinstance(seen, Mapping):
            self.slots.update({k: float(v) for k, v in seen.items() if k in listed})
        keep_only(self.slots, listed)
        names = [inst.name for inst in instances if wants_home(inst)]
        self.homes = homes(names, shard_capacities(shards, self.slots))
        if self.on_homes is not None and self.homes != self._homes_delivered:
            try:
                self.on_homes(dict(self.homes))
            except Exception as exc:  # not delivered: the next round tries again
                self._problems["homes"] = f"adapter homes not published: {exc}"
                self.log.warning("placement: adapter homes not published: %s", exc)
                return
            self._problems.pop("homes", None)
            self._homes_delivered = dict(self.homes)

    async def step(self) -> StepReport:
        """One round: read, scrape, plan, load. Worker failures are reported, not raised."""
        shards = self.store.list_shards()
        instances = self.store.list_adapter_instances()
        seen = getattr(self.admin, "slots_seen", None)
        if isinstance(seen, MutableMapping):
            # The admin keeps a reading per worker it ever scraped: those of workers no
            # longer listed go.
            listed = {endpoint_key(ep.address, ep.port) for s in shards for ep in s.endpoints}
            keep_only(seen, listed)
        if self.auto_placement:
            # Every shard's workers: their slots weigh the homes.
            views, down = await self._observe(shards, {s.id for s in shards})
            self._place(shards, instances)
            wants = wants_of(homed(instances, self.homes), shards)
        else:
            wants = wants_of(instances, shards)
            wanted = {s for w in wants for s in w.shards}
            views, down = await self._observe(shards, wanted)
        decided = self._decide(wants, views)
        limit = asyncio.Semaphore(self.config.concurrency)

        async def act(action: Action) -> str | None:
            async with limit:
                try:
                    await self.admin.load(
                        action.address, action.port, action.adapter, action.path, action.pinned
                    )
                except WorkerAdminError as exc:
                    return str(exc)
            return None

        outcomes = await asyncio.gather(*(act(a) for a in decided.actions))
        now = self.clock.monotonic()
        done: list[Action] = []
        failed: list[tuple[Action, str]] = []
        for action, error in zip(decided.actions, outcomes, strict=True):
            self._record(action, error, now)
            if error is None:
                done.append(action)
            else:
                failed.append((action, error))
        self._note_state(decided, down, views, {w.adapter for w in wants})
        self.steps += 1
        return StepReport(tuple(done), tuple(failed), tuple(down), decided.deferred, decided.short)

    def _record(self, action: Action, error: str | None, now: float) -> None:
        key = action.key
        where = f"worker {key[0]} (shard {action.shard_id})"
        problem = f"{action.why} {action.adapter!r}"
        if error is None:
            self._backoff.pop(key, None)
            self._problems.pop(f"{key[0]}/{action.adapter}", None)
            if action.pinned:
                self.managed[key] = action.path
            else:
                self.managed.pop(key, None)
            if action.why == PRELOAD:
                self._not_before[key] = now + self.config.reload_interval_s
            else:
                self._not_before.pop(key, None)
            self.log.info("placement: %s on %s", problem, where)
            return
        backoff = self._backoff.setdefault(
            key, Backoff(self.config.retry_initial_s, self.config.retry_max_s, jitter=0.0)
        )
        delay = backoff.next()
        self._not_before[key] = now + delay
        message = f"cannot {problem} on {where}: {error} (next try in {delay:.0f} s)"
        if f"{key[0]}/{action.adapter}" not in self._problems:
            self.log.warning("placement: %s", message)
        self._problems[f"{key[0]}/{action.adapter}"] = message

    def _note_state(
        self,
        decided: Plan,
        down: Sequence[tuple[str, str]],
        views: Sequence[WorkerView],
        named: set[str],
    ) -> None:
        for name in [k for k in self._problems if k.startswith(("unreachable ", "short "))]:
            del self._problems[name]
        for worker, why in down:
            self._problems[f"unreachable {worker}"] = f"worker {worker} not scraped: {why}"
        for adapter, shard_id, held, wanted in decided.short:
            self._problems[f"short {adapter}/{shard_id}"] = (
                f"{adapter!r} on shard {shard_id}: {held} of {wanted} replicas (the shard has "
                f"{held} serving worker{'s' if held != 1 else ''} that answered)"
            )
        # Pins the plan no longer wants and a worker that answered no longer holds are
        # forgotten (an unreachable worker's are kept, to be undone when it is back).
        seen = {v.key for v in views}
        holds = {(v.key, a) for v in views for a in v.pinned}
        for key in [
            k for k in self.managed if k[0] in seen and k not in decided.pins and k not in holds
        ]:
            del self.managed[key]
        # Retry state of adapters no instance names any more goes with them.
        for key in [k for k in self._backoff if k[1] not in named]:
            del self._backoff[key]
        now = self.clock.monotonic()
        for key in [
            k
            for k, t in self._not_before.items()
            if k not in self._backoff and (t <= now or k[1] not in named)
        ]:
            del self._not_before[key]
        for name in [
            k
            for k in self._problems
            if "/" in k
            and not k.startswith(("unreachable ", "short "))
            and k.rsplit("/", 1)[1] not in named
        ]:
            del self._problems[name]

    async def run(self, stop: asyncio.Event) -> None:
        """Repeat ``step()`` until ``stop`` is set; a failed step backs off, the loop lives."""
        backoff = Backoff(self.config.interval_s, max(self.config.interval_s, 60.0), jitter=0.0)
        while not stop.is_set():
            delay = self.config.interval_s
            try:
                await self.step()
                backoff.reset()
            except Exception:
                self.failed_steps += 1
                delay = backoff.next()
                self.log.exception("placement step failed; next in %.1f s", delay)
            await sleep_or_stop(self.clock, delay, stop)
