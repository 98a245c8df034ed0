"""The rollout RPCs of ``adaptermesh.v1.ControlPlane`` (StartRollout, ControlRollout,
ListRollouts), mixed into ``ControlPlaneServicer``; the work is ``RolloutController``'s."""

from __future__ import annotations

import inspect
from typing import Any, NoReturn

import grpc

from adaptermesh.assignment_rules import (
    VERSION_SEPARATOR,
    RuleError,
    bounded_message,
    check_adapter_name,
    quote,
)
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

    async def _start(
        self, controller: RolloutController, request: control_plane_pb2.StartRolloutRequest
    ) -> control_plane_pb2.Rollout:
        check_spec(request.spec)  # field errors first, as the controller words them
        await self._require_known_adapter(controller, request.spec.adapter)
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
            context,
            lambda c: control_plane_pb2.ListRolloutsResponse(
                rollouts=c.listing(request.adapter, request.history)
            ),
        )
        return out
