"""The rollout RPCs of ``adaptermesh.v1.ControlPlane`` (StartRollout, ControlRollout,
ListRollouts), mixed into ``ControlPlaneServicer``; the work is ``RolloutController``'s."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, NoReturn

import grpc
import httpx

from adaptermesh.assignment_rules import (
    VERSION_SEPARATOR,
    RuleError,
    bounded_message,
    check_adapter_name,
    quote,
)
from adaptermesh.control_plane.http_client import plain_http_client_options
from adaptermesh.control_plane.loadable import Finds, ask_worker, refusing_shards
from adaptermesh.control_plane.rollout import RolloutController, RolloutError
from adaptermesh.control_plane.rollout_state import check_spec
from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2

__all__ = ["RolloutApi"]


class RolloutApi:
    # Set by the server (ControlPlaneServer) once the controller exists.
    rollouts: RolloutController | None = None

    async def _fail(self, context: Any, exc: Exception) -> NoReturn:
        raise NotImplementedError  # ControlPlaneServicer's

    async def _rollout_call(self, context: Any, call: Any) -> Any:
        try:
            if self.rollouts is None:
                raise RolloutError(
                    grpc.StatusCode.UNAVAILABLE,
                    "",
                    "rollouts are not enabled on this control plane",
                )
            result = call(self.rollouts)
            return await result if inspect.isawaitable(result) else result
        except RolloutError as exc:
            await context.abort(exc.code, bounded_message(str(exc)))
        except RuleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(str(exc)))
        except Exception as exc:
            await self._fail(context, exc)

    async def _require_known_adapter(self, controller: RolloutController, adapter: str) -> None:
        """A rollout needs an adapter the mesh knows: an AdapterInstance of that name, a worker
        that reports it (or a version of it, ``adapter@v``) resident in the Assignment last
        published, or resident, requested or served in its latest scrape, or an earlier rollout
        of it. Otherwise its splits would steer traffic to names no worker serves, and a typo
        would start a rollout that can only fail.

        A worker may have loaded the adapter since the last scrape (a hot load, or a request
        that loaded it on demand just before the rollout): before refusing, wait for up to two
        more steps of the rebalancing loop (the first may have scraped before the load), each
        at most two intervals."""
        rebalancer = controller.rb
        for _ in range(2):
            if self._knows_adapter(controller, adapter):
                return
            if not await rebalancer.next_step(2 * rebalancer.config.interval_s):
                break
        if self._knows_adapter(controller, adapter):
            return
        raise RolloutError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "spec.adapter",
            f"{quote(adapter)} is not known: no AdapterInstance names it and no worker reports "
            "it (or a version of it) resident; create the AdapterInstance or load the adapter "
            "on a worker first",
        )

    @staticmethod
    def _knows_adapter(controller: RolloutController, adapter: str) -> bool:
        store = controller.store
        if any(inst.name == adapter for inst in store.list_adapter_instances()):
            return True
        latest = controller.rb.hub.latest
        versioned = adapter + VERSION_SEPARATOR
        if latest is not None:
            for shard in latest.shards:
                for endpoint in shard.endpoints:
                    for name in endpoint.adapters:
                        if name == adapter or name.startswith(versioned):
                            return True
        # What the workers said in their latest scrape: resident, requested, or served in the
        # interval (the published Assignment lags a scrape, and an adapter that loads on
        # demand may be out of its slot right now).
        for seen in controller.rb.workers.values():
            names = seen.resident_adapters | seen.requested_adapters | frozenset(seen.adapter_ttft)
            if any(name == adapter or name.startswith(versioned) for name in names):
                return True
        return bool(store.rollouts(adapter))

    @staticmethod
    def _reached_shards(
        controller: RolloutController, adapter: str, latest: Any
    ) -> set[str] | None:
        """The shards requests for ``adapter`` reach: its AdapterInstance's shard routes and
        pinned shards, else its placement's shards (the edge's), else (None) every shard."""
        inst = next(
            (i for i in controller.store.list_adapter_instances() if i.name == adapter), None
        )
        if inst is not None:
            named = {r.shard_id for r in inst.routes if r.shard_id}
            named |= set(inst.placement.pinned_shards)
            if named:
                return named
        edge = next((e for e in latest.adapters if e.name == adapter), None)
        return set(edge.shards) if edge is not None and edge.shards else None

    async def _require_loadable_version(
        self, controller: RolloutController, spec: control_plane_pb2.RolloutSpec
    ) -> None:
        """The target version must be one the workers of the shards the adapter's routes
        reach can serve (control_plane/loadable.py); otherwise its canary share would get
        404s until the rollback. Nothing is stored when it is refused."""
        latest = controller.rb.hub.latest
        if latest is None:
            return
        adapter = spec.adapter
        name = f"{adapter}{VERSION_SEPARATOR}{spec.to_version}" if spec.to_version else adapter
        placed = self._reached_shards(controller, adapter, latest)
        seen: dict[tuple[str, int], bool] = {}
        for w in controller.rb.workers.values():
            names = w.resident_adapters | w.requested_adapters | frozenset(w.adapter_ttft)
            seen[(w.address, w.port)] = name in names
        shards = [s for s in latest.shards if placed is None or s.id in placed]
        known: dict[str, list[Finds]] = {}
        asked: list[tuple[str, Any]] = []
        async with httpx.AsyncClient(**plain_http_client_options(16)) as client:
            for shard in shards:
                known[shard.id] = []
                for e in shard.endpoints:
                    if name in e.adapters or seen.get((e.address, e.port)):
                        known[shard.id].append(True)
                    else:
                        asked.append((shard.id, ask_worker(client, e.address, e.port, name)))
            answers = await asyncio.gather(*(ask for _, ask in asked))
        for (shard_id, _), finds in zip(asked, answers, strict=True):
            known[shard_id].append(finds)
        refusing = refusing_shards(known)
        if refusing:
            raise RolloutError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "spec.to_version",
                f"{quote(name)} cannot be served on shard {', '.join(refusing)}: no worker "
                "there has it loaded, under its adapter root or in an adapter store; put "
                f"{quote(name)} there first, or fix the version",
            )

    async def _start(
        self, controller: RolloutController, request: control_plane_pb2.StartRolloutRequest
    ) -> control_plane_pb2.Rollout:
        check_spec(request.spec)  # field errors first, as the controller words them
        await self._require_known_adapter(controller, request.spec.adapter)
        await self._require_loadable_version(controller, request.spec)
        return controller.start(request.spec, request.reason)

    @staticmethod
    def _control(
        controller: RolloutController, request: control_plane_pb2.ControlRolloutRequest
    ) -> control_plane_pb2.Rollout:
        if request.adapter:
            # A name no rollout could have: refused by its own rule, not looked up.
            check_adapter_name(request.adapter, "adapter")
        return controller.control(request.adapter, request.action, request.reason)

    async def StartRollout(
        self, request: control_plane_pb2.StartRolloutRequest, context: Any
    ) -> control_plane_pb2.Rollout:
        out: control_plane_pb2.Rollout = await self._rollout_call(
            context, lambda c: self._start(c, request)
        )
        return out

    async def ControlRollout(
        self, request: control_plane_pb2.ControlRolloutRequest, context: Any
    ) -> control_plane_pb2.Rollout:
        out: control_plane_pb2.Rollout = await self._rollout_call(
            context, lambda c: self._control(c, request)
        )
        return out

    async def ListRollouts(
        self, request: control_plane_pb2.ListRolloutsRequest, context: Any
    ) -> control_plane_pb2.ListRolloutsResponse:
        out: control_plane_pb2.ListRolloutsResponse = await self._rollout_call(
            context, lambda c: self._list(c, request)
        )
        return out

    def _list(
        self, controller: RolloutController, request: control_plane_pb2.ListRolloutsRequest
    ) -> control_plane_pb2.ListRolloutsResponse:
        rollouts = controller.listing(request.adapter, request.history)
        if request.adapter and not rollouts:
            check_adapter_name(request.adapter, "adapter")
            if not self._knows_adapter(controller, request.adapter):
                # A typo would otherwise look like an adapter that never had a rollout.
                raise RolloutError(
                    grpc.StatusCode.NOT_FOUND,
                    "adapter",
                    f"{quote(request.adapter)}: no rollout of it, and no AdapterInstance "
                    "or worker names it",
                )
        return control_plane_pb2.ListRolloutsResponse(rollouts=rollouts)
