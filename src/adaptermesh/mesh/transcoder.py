"""Envoy's gRPC-JSON transcoder for ``grpc-json`` AdapterInstances.

A JSON client POSTs a KServe v2 ``ModelInferRequest`` in proto3 JSON to the adapter's path
(``/v1/evaluate``); the transcoder turns it into a gRPC ``ModelInfer`` call and the answer
back into JSON. Its descriptor is the v2 service's set, which the proto generation writes
with grpcio-tools (``proto/adaptermesh/v1/open_inference.desc``), plus ``google.api.http``
rules binding each grpc-json path to ``ModelInfer`` (built here, per set of paths).

The transcoder keeps the route that the incoming path matched
(``match_incoming_request_route``), so the adapter's path route picks the gRPC cluster, sets
the adapter header and carries the adapter's token checks (mesh/edge.py).
"""

from __future__ import annotations

import functools
from importlib import resources

from envoy.extensions.filters.http.grpc_json_transcoder.v3 import transcoder_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.api import annotations_pb2, http_pb2
from google.protobuf import any_pb2, descriptor_pb2

__all__ = ["SERVICE", "TRANSCODER_FILTER", "descriptor_set", "transcoder_filter"]

TRANSCODER_FILTER = "envoy.filters.http.grpc_json_transcoder"
SERVICE = "inference.GRPCInferenceService"
_V2_FILE = "adaptermesh/v1/open_inference.proto"
_DESCRIPTOR_SET = "open_inference.desc"  # must stay in sync with proto/generate.py
# The JSON body of one request; a prompt of 1 MiB of text is far inside it.
MAX_BODY_BYTES = 4 << 20


def _v2_set() -> descriptor_pb2.FileDescriptorSet:
    data = resources.files("adaptermesh.proto") / "adaptermesh" / "v1" / _DESCRIPTOR_SET
    return descriptor_pb2.FileDescriptorSet.FromString(data.read_bytes())


def _file_proto(module_descriptor: object) -> descriptor_pb2.FileDescriptorProto:
    out = descriptor_pb2.FileDescriptorProto()
    module_descriptor.CopyToProto(out)  # type: ignore[attr-defined]
    return out


@functools.lru_cache(maxsize=64)
def descriptor_set(paths: tuple[str, ...]) -> bytes:
    """The v2 descriptor set with ``POST <path>`` (body ``*``) bound to ``ModelInfer`` for
    each of ``paths`` (at least one)."""
    if not paths:
        raise ValueError("descriptor_set: at least one path")
    v2 = _v2_set()
    # Dependencies first: Envoy builds the files into its pool in order.
    files = [
        _file_proto(descriptor_pb2.DESCRIPTOR),
        _file_proto(http_pb2.DESCRIPTOR),
        _file_proto(annotations_pb2.DESCRIPTOR),
    ]
    names = {f.name for f in files}
    for file in v2.file:
        if file.name in names:
            continue
        if file.name == _V2_FILE:
            file.dependency.append("google/api/annotations.proto")
            (service,) = [s for s in file.service if f"{file.package}.{s.name}" == SERVICE]
            (method,) = [m for m in service.method if m.name == "ModelInfer"]
            rule = http_pb2.HttpRule(
                post=paths[0],
                body="*",
                additional_bindings=[http_pb2.HttpRule(post=p, body="*") for p in paths[1:]],
            )
            method.options.Extensions[annotations_pb2.http].CopyFrom(rule)
        files.append(file)
    return descriptor_pb2.FileDescriptorSet(file=files).SerializeToString(deterministic=True)


def transcoder_filter(paths: tuple[str, ...]) -> hcm_pb2.HttpFilter:
    """The listener's transcoder for the grpc-json ``paths`` (sorted, not empty)."""
    config = transcoder_pb2.GrpcJsonTranscoder(
        proto_descriptor_bin=descriptor_set(paths),
        services=[SERVICE],
        match_incoming_request_route=True,
        convert_grpc_status=True,
        max_request_body_size={"value": MAX_BODY_BYTES},
        print_options=transcoder_pb2.GrpcJsonTranscoder.PrintOptions(
            preserve_proto_field_names=True, always_print_primitive_fields=True
        ),
    )
    packed = any_pb2.Any()
    packed.Pack(config)
    return hcm_pb2.HttpFilter(name=TRANSCODER_FILTER, typed_config=packed)
