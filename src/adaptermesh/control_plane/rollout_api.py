"""The rollout RPCs of ``adaptermesh.v1.ControlPlane`` (StartRollout, ControlRollout,
ListRollouts), mixed into ``ControlPlaneServicer``; the work is ``RolloutController``'s."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from adaptermesh.assignment_rules import RuleError
from adaptermesh.control_plane.rollout import RolloutController, RolloutError
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
            return call(self.rollouts)
        except RolloutError as exc:
            await context.abort(exc.code, str(exc))
        except RuleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            await self._fail(context, exc)

    async def StartRollout(
        self, request: control_plane_pb2.StartRolloutRequest, context: Any
    ) -> control_plane_pb2.Rollout:
        out: control_plane_pb2.Rollout = await self._rollout_call(
            context, lambda c: c.start(request.spec, request.reason)
        )
        return out

    async def ControlRollout(
        self, request: control_plane_pb2.ControlRolloutRequest, context: Any
    ) -> control_plane_pb2.Rollout:
        out: control_plane_pb2.Rollout = await self._rollout_call(
            context, lambda c: c.control(request.adapter, request.action, request.reason)
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
