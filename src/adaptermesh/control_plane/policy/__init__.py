"""The rebalancing policy: observations in, shard and endpoint weights out. Pure.

The package reads in the order the data flows (each module imports only the ones above it):

- ``types``: configuration, observations, the carried state and the decision (dataclasses);
- ``columns``: the observation as numpy columns, and the mappings a decision returns;
- ``apportion``: integer weights from shares (largest remainder, water-filling, the budget check);
- ``decide``: the decision itself (``decide``, ``desired``) and its capacity model.

Callers import from the package: ``from adaptermesh.control_plane.policy import decide``.
"""

from adaptermesh.control_plane.policy.apportion import apportion, validate_weights
from adaptermesh.control_plane.policy.columns import (
    ColumnLayout,
    EndpointWeights,
    Estimates,
    ObservationColumns,
)
from adaptermesh.control_plane.policy.decide import decide, desired
from adaptermesh.control_plane.policy.types import (
    BUDGET,
    Decision,
    Observation,
    OverrideSpec,
    PolicyConfig,
    PolicyState,
    ShardEstimate,
    ShardObservation,
    WorkerObservation,
    endpoint_key,
)

__all__ = [
    "BUDGET",
    "ColumnLayout",
    "Decision",
    "EndpointWeights",
    "Estimates",
    "Observation",
    "ObservationColumns",
    "OverrideSpec",
    "PolicyConfig",
    "PolicyState",
    "ShardEstimate",
    "ShardObservation",
    "WorkerObservation",
    "apportion",
    "decide",
    "desired",
    "endpoint_key",
    "validate_weights",
]
