import datetime

from adaptermesh.proto.adaptermesh.v1 import assignment_pb2 as _assignment_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATE_UNSPECIFIED: _ClassVar[RolloutState]
    ROLLOUT_STATE_RUNNING: _ClassVar[RolloutState]
    ROLLOUT_STATE_PAUSED: _ClassVar[RolloutState]
    ROLLOUT_STATE_COMPLETED: _ClassVar[RolloutState]
    ROLLOUT_STATE_ROLLED_BACK: _ClassVar[RolloutState]
    ROLLOUT_STATE_ABORTED: _ClassVar[RolloutState]
ROLLOUT_STATE_UNSPECIFIED: RolloutState
ROLLOUT_STATE_RUNNING: RolloutState
ROLLOUT_STATE_PAUSED: RolloutState
ROLLOUT_STATE_COMPLETED: RolloutState
ROLLOUT_STATE_ROLLED_BACK: RolloutState
ROLLOUT_STATE_ABORTED: RolloutState

class UpsertShardRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: _assignment_pb2.Shard
    def __init__(self, shard: _Optional[_Union[_assignment_pb2.Shard, _Mapping]] = ...) -> None: ...

class DeleteShardRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteShardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[_assignment_pb2.Shard]
    def __init__(self, shards: _Optional[_Iterable[_Union[_assignment_pb2.Shard, _Mapping]]] = ...) -> None: ...

class SetOverrideRequest(_message.Message):
    __slots__ = ("shard_id", "weight", "ttl_seconds", "reason")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    weight: int
    ttl_seconds: int
    reason: str
    def __init__(self, shard_id: _Optional[str] = ..., weight: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ClearOverrideRequest(_message.Message):
    __slots__ = ("shard_id",)
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    def __init__(self, shard_id: _Optional[str] = ...) -> None: ...

class ClearOverrideResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListOverridesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListOverridesResponse(_message.Message):
    __slots__ = ("overrides",)
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    overrides: _containers.RepeatedCompositeFieldContainer[_assignment_pb2.Override]
    def __init__(self, overrides: _Optional[_Iterable[_Union[_assignment_pb2.Override, _Mapping]]] = ...) -> None: ...

class PinTenantRequest(_message.Message):
    __slots__ = ("cidr", "shard_id")
    CIDR_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    cidr: str
    shard_id: str
    def __init__(self, cidr: _Optional[str] = ..., shard_id: _Optional[str] = ...) -> None: ...

class UnpinTenantRequest(_message.Message):
    __slots__ = ("cidr",)
    CIDR_FIELD_NUMBER: _ClassVar[int]
    cidr: str
    def __init__(self, cidr: _Optional[str] = ...) -> None: ...

class UnpinTenantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[_assignment_pb2.Pin]
    def __init__(self, pins: _Optional[_Iterable[_Union[_assignment_pb2.Pin, _Mapping]]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("shards", "instances", "pins", "overrides", "reason")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[_assignment_pb2.Shard]
    instances: _containers.RepeatedCompositeFieldContainer[AdapterInstance]
    pins: _containers.RepeatedCompositeFieldContainer[_assignment_pb2.Pin]
    overrides: _containers.RepeatedCompositeFieldContainer[SetOverrideRequest]
    reason: str
    def __init__(self, shards: _Optional[_Iterable[_Union[_assignment_pb2.Shard, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[AdapterInstance, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[_assignment_pb2.Pin, _Mapping]]] = ..., overrides: _Optional[_Iterable[_Union[SetOverrideRequest, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("version", "changes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    changes: int
    def __init__(self, version: _Optional[int] = ..., changes: _Optional[int] = ...) -> None: ...

class GetAssignmentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchAssignmentsRequest(_message.Message):
    __slots__ = ("from_version", "node_id")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    node_id: str
    def __init__(self, from_version: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class ListHistoryRequest(_message.Message):
    __slots__ = ("limit", "before_version")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    limit: int
    before_version: int
    def __init__(self, limit: _Optional[int] = ..., before_version: _Optional[int] = ...) -> None: ...

class AssignmentRecord(_message.Message):
    __slots__ = ("version", "reason", "generated_at", "assignment")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    generated_at: _timestamp_pb2.Timestamp
    assignment: _assignment_pb2.Assignment
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ..., generated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., assignment: _Optional[_Union[_assignment_pb2.Assignment, _Mapping]] = ...) -> None: ...

class ListHistoryResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AssignmentRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AssignmentRecord, _Mapping]]] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("limit", "before_seq")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_SEQ_FIELD_NUMBER: _ClassVar[int]
    limit: int
    before_seq: int
    def __init__(self, limit: _Optional[int] = ..., before_seq: _Optional[int] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("seq", "at", "caller", "method", "outcome", "message", "before_json", "after_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_JSON_FIELD_NUMBER: _ClassVar[int]
    AFTER_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at: _timestamp_pb2.Timestamp
    caller: str
    method: str
    outcome: str
    message: str
    before_json: str
    after_json: str
    def __init__(self, seq: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., caller: _Optional[str] = ..., method: _Optional[str] = ..., outcome: _Optional[str] = ..., message: _Optional[str] = ..., before_json: _Optional[str] = ..., after_json: _Optional[str] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...

class ShardTraffic(_message.Message):
    __slots__ = ("shard_id", "packets_per_s", "bytes_per_s", "new_flows_per_s", "active_flows")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    PACKETS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    NEW_FLOWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FLOWS_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    packets_per_s: float
    bytes_per_s: float
    new_flows_per_s: float
    active_flows: int
    def __init__(self, shard_id: _Optional[str] = ..., packets_per_s: _Optional[float] = ..., bytes_per_s: _Optional[float] = ..., new_flows_per_s: _Optional[float] = ..., active_flows: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("node_id", "applied_version", "shards", "observed_at", "apply_error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    APPLY_ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    applied_version: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardTraffic]
    observed_at: _timestamp_pb2.Timestamp
    apply_error: str
    def __init__(self, node_id: _Optional[str] = ..., applied_version: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardTraffic, _Mapping]]] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., apply_error: _Optional[str] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "applied_version", "last_report", "apply_error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    APPLY_ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    applied_version: int
    last_report: _timestamp_pb2.Timestamp
    apply_error: str
    def __init__(self, node_id: _Optional[str] = ..., applied_version: _Optional[int] = ..., last_report: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., apply_error: _Optional[str] = ...) -> None: ...

class ShardLoad(_message.Message):
    __slots__ = ("shard_id", "weight", "queue_depth", "running", "latency_ms", "tokens_per_s", "kv_cache_usage", "free_gpu_bytes", "known", "utilization", "workers", "workers_known", "age_s")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    weight: int
    queue_depth: float
    running: float
    latency_ms: float
    tokens_per_s: float
    kv_cache_usage: float
    free_gpu_bytes: float
    known: bool
    utilization: float
    workers: int
    workers_known: int
    age_s: float
    def __init__(self, shard_id: _Optional[str] = ..., weight: _Optional[int] = ..., queue_depth: _Optional[float] = ..., running: _Optional[float] = ..., latency_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., free_gpu_bytes: _Optional[float] = ..., known: _Optional[bool] = ..., utilization: _Optional[float] = ..., workers: _Optional[int] = ..., workers_known: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("assignment", "nodes", "loads")
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    assignment: _assignment_pb2.Assignment
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    loads: _containers.RepeatedCompositeFieldContainer[ShardLoad]
    def __init__(self, assignment: _Optional[_Union[_assignment_pb2.Assignment, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[ShardLoad, _Mapping]]] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("base_model", "adapter_path", "revision")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    adapter_path: str
    revision: str
    def __init__(self, base_model: _Optional[str] = ..., adapter_path: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class AdapterRoute(_message.Message):
    __slots__ = ("shard_id", "weight", "path")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    weight: int
    path: str
    def __init__(self, shard_id: _Optional[str] = ..., weight: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class AdapterSecurity(_message.Message):
    __slots__ = ("scopes", "allowed_cidrs", "tls")
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_CIDRS_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    scopes: _containers.RepeatedScalarFieldContainer[str]
    allowed_cidrs: _containers.RepeatedScalarFieldContainer[str]
    tls: bool
    def __init__(self, scopes: _Optional[_Iterable[str]] = ..., allowed_cidrs: _Optional[_Iterable[str]] = ..., tls: _Optional[bool] = ...) -> None: ...

class AdapterPlacement(_message.Message):
    __slots__ = ("shards", "replicas", "preload", "pinned_shards")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_FIELD_NUMBER: _ClassVar[int]
    PINNED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    replicas: int
    preload: bool
    pinned_shards: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., replicas: _Optional[int] = ..., preload: _Optional[bool] = ..., pinned_shards: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterInstance(_message.Message):
    __slots__ = ("name", "model_ref", "routes", "security", "labels", "updated_at", "protocol", "placement")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_REF_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    SECURITY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_ref: ModelRef
    routes: _containers.RepeatedCompositeFieldContainer[AdapterRoute]
    security: AdapterSecurity
    labels: _containers.ScalarMap[str, str]
    updated_at: _timestamp_pb2.Timestamp
    protocol: str
    placement: AdapterPlacement
    def __init__(self, name: _Optional[str] = ..., model_ref: _Optional[_Union[ModelRef, _Mapping]] = ..., routes: _Optional[_Iterable[_Union[AdapterRoute, _Mapping]]] = ..., security: _Optional[_Union[AdapterSecurity, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., protocol: _Optional[str] = ..., placement: _Optional[_Union[AdapterPlacement, _Mapping]] = ...) -> None: ...

class UpsertAdapterInstanceRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: AdapterInstance
    def __init__(self, instance: _Optional[_Union[AdapterInstance, _Mapping]] = ...) -> None: ...

class DeleteAdapterInstanceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdapterInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdapterInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[AdapterInstance]
    def __init__(self, instances: _Optional[_Iterable[_Union[AdapterInstance, _Mapping]]] = ...) -> None: ...

class RuleSetVersion(_message.Message):
    __slots__ = ("version", "document_json", "reason", "created_at", "rules")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    version: int
    document_json: str
    reason: str
    created_at: _timestamp_pb2.Timestamp
    rules: int
    def __init__(self, version: _Optional[int] = ..., document_json: _Optional[str] = ..., reason: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., rules: _Optional[int] = ...) -> None: ...

class ApplyRulesRequest(_message.Message):
    __slots__ = ("document_json", "reason")
    DOCUMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    document_json: str
    reason: str
    def __init__(self, document_json: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ApplyRulesResponse(_message.Message):
    __slots__ = ("rule_set", "unchanged")
    RULE_SET_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    rule_set: RuleSetVersion
    unchanged: bool
    def __init__(self, rule_set: _Optional[_Union[RuleSetVersion, _Mapping]] = ..., unchanged: _Optional[bool] = ...) -> None: ...

class GetRulesRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ListRulesRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListRulesResponse(_message.Message):
    __slots__ = ("rule_sets",)
    RULE_SETS_FIELD_NUMBER: _ClassVar[int]
    rule_sets: _containers.RepeatedCompositeFieldContainer[RuleSetVersion]
    def __init__(self, rule_sets: _Optional[_Iterable[_Union[RuleSetVersion, _Mapping]]] = ...) -> None: ...

class RolloutEvent(_message.Message):
    __slots__ = ("at", "kind", "share", "reason")
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    kind: str
    share: int
    reason: str
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[str] = ..., share: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RolloutSpec(_message.Message):
    __slots__ = ("adapter", "from_version", "to_version", "steps_percent", "interval_seconds", "max_error_rate", "max_p95_ttft_ms", "min_requests")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_PERCENT_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_P95_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    from_version: str
    to_version: str
    steps_percent: _containers.RepeatedScalarFieldContainer[int]
    interval_seconds: int
    max_error_rate: float
    max_p95_ttft_ms: float
    min_requests: int
    def __init__(self, adapter: _Optional[str] = ..., from_version: _Optional[str] = ..., to_version: _Optional[str] = ..., steps_percent: _Optional[_Iterable[int]] = ..., interval_seconds: _Optional[int] = ..., max_error_rate: _Optional[float] = ..., max_p95_ttft_ms: _Optional[float] = ..., min_requests: _Optional[int] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("id", "spec", "state", "step", "share", "created_at", "step_started_at", "reason", "events", "window_requests", "window_errors", "window_p95_ttft_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_P95_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: RolloutSpec
    state: RolloutState
    step: int
    share: int
    created_at: _timestamp_pb2.Timestamp
    step_started_at: _timestamp_pb2.Timestamp
    reason: str
    events: _containers.RepeatedCompositeFieldContainer[RolloutEvent]
    window_requests: int
    window_errors: int
    window_p95_ttft_ms: float
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[RolloutSpec, _Mapping]] = ..., state: _Optional[_Union[RolloutState, str]] = ..., step: _Optional[int] = ..., share: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., step_started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., events: _Optional[_Iterable[_Union[RolloutEvent, _Mapping]]] = ..., window_requests: _Optional[int] = ..., window_errors: _Optional[int] = ..., window_p95_ttft_ms: _Optional[float] = ...) -> None: ...

class StartRolloutRequest(_message.Message):
    __slots__ = ("spec", "reason")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    spec: RolloutSpec
    reason: str
    def __init__(self, spec: _Optional[_Union[RolloutSpec, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ControlRolloutRequest(_message.Message):
    __slots__ = ("adapter", "action", "reason")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    action: str
    reason: str
    def __init__(self, adapter: _Optional[str] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListRolloutsRequest(_message.Message):
    __slots__ = ("adapter", "history")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    history: bool
    def __init__(self, adapter: _Optional[str] = ..., history: _Optional[bool] = ...) -> None: ...

class ListRolloutsResponse(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...
