import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STATE_UNSPECIFIED: _ClassVar[ShardState]
    SHARD_STATE_ACTIVE: _ClassVar[ShardState]
    SHARD_STATE_DRAINING: _ClassVar[ShardState]
SHARD_STATE_UNSPECIFIED: ShardState
SHARD_STATE_ACTIVE: ShardState
SHARD_STATE_DRAINING: ShardState

class Endpoint(_message.Message):
    __slots__ = ("address", "port", "weight", "draining", "adapters")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    weight: int
    draining: bool
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., weight: _Optional[int] = ..., draining: _Optional[bool] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class TunnelSteer(_message.Message):
    __slots__ = ("remote_ipv4", "vni", "inner_dst_mac")
    REMOTE_IPV4_FIELD_NUMBER: _ClassVar[int]
    VNI_FIELD_NUMBER: _ClassVar[int]
    INNER_DST_MAC_FIELD_NUMBER: _ClassVar[int]
    remote_ipv4: str
    vni: int
    inner_dst_mac: str
    def __init__(self, remote_ipv4: _Optional[str] = ..., vni: _Optional[int] = ..., inner_dst_mac: _Optional[str] = ...) -> None: ...

class RedirectSteer(_message.Message):
    __slots__ = ("ifname", "ifindex", "dst_mac", "ingress")
    IFNAME_FIELD_NUMBER: _ClassVar[int]
    IFINDEX_FIELD_NUMBER: _ClassVar[int]
    DST_MAC_FIELD_NUMBER: _ClassVar[int]
    INGRESS_FIELD_NUMBER: _ClassVar[int]
    ifname: str
    ifindex: int
    dst_mac: str
    ingress: bool
    def __init__(self, ifname: _Optional[str] = ..., ifindex: _Optional[int] = ..., dst_mac: _Optional[str] = ..., ingress: _Optional[bool] = ...) -> None: ...

class MarkSteer(_message.Message):
    __slots__ = ("mark",)
    MARK_FIELD_NUMBER: _ClassVar[int]
    mark: int
    def __init__(self, mark: _Optional[int] = ...) -> None: ...

class Steer(_message.Message):
    __slots__ = ("tunnel", "redirect", "mark")
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    tunnel: TunnelSteer
    redirect: RedirectSteer
    mark: MarkSteer
    def __init__(self, tunnel: _Optional[_Union[TunnelSteer, _Mapping]] = ..., redirect: _Optional[_Union[RedirectSteer, _Mapping]] = ..., mark: _Optional[_Union[MarkSteer, _Mapping]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("id", "index", "weight", "endpoints", "steer", "state", "service_address", "service_port", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    STEER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_PORT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    id: str
    index: int
    weight: int
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    steer: Steer
    state: ShardState
    service_address: str
    service_port: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., index: _Optional[int] = ..., weight: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., steer: _Optional[_Union[Steer, _Mapping]] = ..., state: _Optional[_Union[ShardState, str]] = ..., service_address: _Optional[str] = ..., service_port: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Pin(_message.Message):
    __slots__ = ("cidr", "shard_id")
    CIDR_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    cidr: str
    shard_id: str
    def __init__(self, cidr: _Optional[str] = ..., shard_id: _Optional[str] = ...) -> None: ...

class Override(_message.Message):
    __slots__ = ("shard_id", "weight", "reason", "expires_at", "created_at")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    weight: int
    reason: str
    expires_at: _timestamp_pb2.Timestamp
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, shard_id: _Optional[str] = ..., weight: _Optional[int] = ..., reason: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AdapterEdge(_message.Message):
    __slots__ = ("name", "protocol", "paths", "scopes", "tls", "shards", "allowed_cidrs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_CIDRS_FIELD_NUMBER: _ClassVar[int]
    name: str
    protocol: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    scopes: _containers.RepeatedScalarFieldContainer[str]
    tls: bool
    shards: _containers.RepeatedScalarFieldContainer[str]
    allowed_cidrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., protocol: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., scopes: _Optional[_Iterable[str]] = ..., tls: _Optional[bool] = ..., shards: _Optional[_Iterable[str]] = ..., allowed_cidrs: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterSplit(_message.Message):
    __slots__ = ("adapter", "stable_version", "canary_version", "canary_share", "rollout_id")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_SHARE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    stable_version: str
    canary_version: str
    canary_share: int
    rollout_id: str
    def __init__(self, adapter: _Optional[str] = ..., stable_version: _Optional[str] = ..., canary_version: _Optional[str] = ..., canary_share: _Optional[int] = ..., rollout_id: _Optional[str] = ...) -> None: ...

class RoutingRules(_message.Message):
    __slots__ = ("version", "document_json", "digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    document_json: str
    digest: bytes
    def __init__(self, version: _Optional[int] = ..., document_json: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("version", "shards", "pins", "overrides", "generated_at", "reason", "adapters", "adapter_splits", "routing_rules")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SPLITS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_RULES_FIELD_NUMBER: _ClassVar[int]
    version: int
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    pins: _containers.RepeatedCompositeFieldContainer[Pin]
    overrides: _containers.RepeatedCompositeFieldContainer[Override]
    generated_at: _timestamp_pb2.Timestamp
    reason: str
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterEdge]
    adapter_splits: _containers.RepeatedCompositeFieldContainer[AdapterSplit]
    routing_rules: RoutingRules
    def __init__(self, version: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ..., overrides: _Optional[_Iterable[_Union[Override, _Mapping]]] = ..., generated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[AdapterEdge, _Mapping]]] = ..., adapter_splits: _Optional[_Iterable[_Union[AdapterSplit, _Mapping]]] = ..., routing_rules: _Optional[_Union[RoutingRules, _Mapping]] = ...) -> None: ...
