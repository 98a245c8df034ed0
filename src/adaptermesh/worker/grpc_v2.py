"""The KServe Open Inference Protocol v2 over gRPC on the worker (``inference.GRPCInferenceService``).

Models are the base model and every loaded adapter, as in ``GET /v1/models``. Text generation
uses one tensor convention (``docs/grpc-inference.md``)::

    inputs      text_input   BYTES [1]    the prompt (UTF-8)
    parameters  max_tokens (int), temperature, top_p, min_p, presence_penalty,
                frequency_penalty, repetition_penalty (float), top_k, seed (int), stop (string)
    outputs     text_output  BYTES [1]    the generated text (of this chunk, when streaming)
                token_ids    INT32 [n]    its token ids
    response parameters: finish_reason, prompt_tokens, completion_tokens (on the last response)

``ModelInfer`` answers once. ``ModelStreamInfer`` answers each request of the stream with one
response per token event, the last flagged ``triton_final_response`` (with
``triton_enable_empty_final_response`` the flag comes on an extra empty response instead).

Every request runs through ``WorkerService.build_job`` / ``job_events``: the same validation,
tenant queue (tenant from ``authorization`` / ``x-tenant-id`` metadata), deadlines (the gRPC
deadline, else ``x-request-timeout``), metrics, drain and cancellation as HTTP. Errors become
gRPC statuses whose message names the field; a request that fails never ends a stream.
``RepositoryModelLoad`` / ``Unload`` load and unload adapters with the HTTP admin token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, cast

import grpc
from aiohttp import web
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import CIMultiDict, CIMultiDictProxy

from adaptermesh.assignment_rules import quote
from adaptermesh.proto.adaptermesh.v1 import open_inference_pb2 as pb
from adaptermesh.proto.adaptermesh.v1 import open_inference_pb2_grpc as pb_grpc
from adaptermesh.worker.admin_endpoints import admin_token_verdict
from adaptermesh.worker.service import ADAPTER_HEADER, ApiError, WorkerService

__all__ = [
    "INPUT_NAME",
    "OUTPUT_NAMES",
    "PARAMETERS",
    "GrpcV2Limits",
    "GrpcV2Server",
    "GrpcV2Servicer",
]

log = logging.getLogger(__name__)

INPUT_NAME = "text_input"
OUTPUT_NAMES = ("text_output", "token_ids")
# Sampling parameters a request may carry, and the kind of value each takes.
PARAMETERS: dict[str, str] = {
    "max_tokens": "int",
    "top_k": "int",
    "seed": "int",
    "temperature": "float",
    "top_p": "float",
    "min_p": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
    "stop": "string",
}
# Parameters v2 clients send about the exchange itself rather than about sampling.
_ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"
_FINAL = "triton_final_response"
_TIMEOUT = "timeout"  # microseconds, as v2 clients send it
_VERSIONS = ("", "1")
_PLATFORM = "adaptermesh"

# HTTP statuses of ApiError and the gRPC status each one is answered with.
_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Where an HTTP body field sits in a v2 request.
_FIELD = {"prompt": f"inputs[{INPUT_NAME}]", "model": "model_name", "lora_name": "model_name"}


@dataclass(frozen=True, slots=True)
class GrpcV2Limits:
    """Limits of the gRPC listener. Message size is the service's ``max_body_bytes``."""

    # Requests in flight on one ModelStreamInfer stream; one more is answered with an error.
    max_stream_inflight: int = 16
    # Seconds a stop waits for running RPCs before cancelling them.
    stop_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_stream_inflight < 1:
            raise ValueError(
                f"max_stream_inflight must be at least 1, got {self.max_stream_inflight}"
            )
        if not self.stop_grace_s >= 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {self.stop_grace_s}")


class _Failure(Exception):
    """A request refused with a gRPC status (message names the field)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(field: str, message: str) -> _Failure:
    return _Failure(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def _from_api(exc: ApiError) -> _Failure:
    code = _STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
    message = exc.message
    if exc.param:
        where = _FIELD.get(exc.param)
        if where is None and exc.param in PARAMETERS:
            where = f"parameters[{exc.param}]"
        if where is not None:
            head = f"{exc.param}: "
            message = f"{where}: {message.removeprefix(head)}"
    return _Failure(code, message)


class _RequestView:
    """The parts of an HTTP request ``WorkerService.build_job`` reads, from gRPC metadata."""

    def __init__(self, headers: Mapping[str, str], remote: str | None) -> None:
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self.remote = remote


def _peer_host(peer: str) -> str | None:
    # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path"
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return rest or None


def _metadata(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            headers[key] = value
    return headers


def _param_value(field: str, param: pb.InferParameter) -> Any:
    choice = param.WhichOneof("parameter_choice")
    if choice is None:
        raise _invalid(field, "has no value")
    return getattr(param, choice), choice


def _sampling(
    parameters: Mapping[str, pb.InferParameter],
) -> tuple[dict[str, Any], bool, float | None]:
    """The body fields of ``parameters``, the empty-final-response flag, and the timeout (s)."""
    body: dict[str, Any] = {}
    empty_final = False
    timeout: float | None = None
    for name in sorted(parameters):
        field = f"parameters[{name}]"
        value, choice = _param_value(field, parameters[name])
        if name == _ENABLE_EMPTY_FINAL:
            if choice != "bool_param":
                raise _invalid(field, f"must be a bool_param, got {choice}")
            empty_final = bool(value)
            continue
        if name == _TIMEOUT:
            if choice not in ("int64_param", "uint64_param") or value <= 0:
                raise _invalid(field, "must be a positive int64_param (microseconds)")
            timeout = value / 1e6
            continue
        kind = PARAMETERS.get(name)
        if kind is None:
            raise _invalid(field, "unknown parameter; known: " + ", ".join(sorted(PARAMETERS)))
        if kind == "int":
            if choice not in ("int64_param", "uint64_param"):
                raise _invalid(field, f"must be an integer (int64_param), got {choice}")
        elif kind == "float":
            if choice not in ("double_param", "int64_param", "uint64_param"):
                raise _invalid(field, f"must be a number (double_param), got {choice}")
            value = float(value)
            if not math.isfinite(value):
                raise _invalid(field, "must be finite")
        elif choice != "string_param":
            raise _invalid(field, f"must be a string_param, got {choice}")
        body[name] = value
    return body, empty_final, timeout


def _decode_bytes_tensor(field: str, raw: bytes) -> list[bytes]:
    """Elements of a raw BYTES tensor: each a 4-byte little-endian length, then the bytes."""
    items = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise _invalid(field, "raw contents end inside an element's 4-byte length")
        (size,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + size > len(raw):
            raise _invalid(field, f"raw contents end inside an element of {size} bytes")
        items.append(raw[at : at + size])
        at += size
    return items


def _prompt(request: pb.ModelInferRequest) -> str:
    if not request.inputs:
        raise _invalid(f"inputs[{INPUT_NAME}]", "is required (BYTES, shape [1])")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise _invalid(
            "raw_input_contents",
            f"has {len(raw)} entries for {len(request.inputs)} inputs; give one per input or none",
        )
    text: str | None = None
    for i, tensor in enumerate(request.inputs):
        if tensor.name != INPUT_NAME:
            raise _invalid(
                f"inputs[{i}].name",
                f"unknown input {quote(tensor.name)}; this model takes {INPUT_NAME}",
            )
        field = f"inputs[{INPUT_NAME}]"
        if text is not None:
            raise _invalid(field, "is given twice")
        if tensor.datatype != "BYTES":
            raise _invalid(f"{field}.datatype", f"must be BYTES, got {quote(tensor.datatype)}")
        if len(tensor.shape) not in (1, 2) or any(d != 1 for d in tensor.shape):
            raise _invalid(f"{field}.shape", f"must be [1] (one prompt), got {list(tensor.shape)}")
        if tensor.parameters:
            raise _invalid(f"{field}.parameters", "are not supported (no shared memory)")
        if raw:
            items = _decode_bytes_tensor(f"{field}.contents", raw[i])
            if tensor.HasField("contents"):
                raise _invalid(f"{field}.contents", "is set beside raw_input_contents")
        else:
            items = list(tensor.contents.bytes_contents)
        if len(items) != 1:
            raise _invalid(f"{field}.contents", f"must hold 1 element, got {len(items)}")
        try:
            text = items[0].decode("utf-8")
        except UnicodeDecodeError:
            raise _invalid(f"{field}.contents", "is not UTF-8") from None
    assert text is not None
    return text


def _outputs(request: pb.ModelInferRequest) -> tuple[str, ...]:
    if not request.outputs:
        return OUTPUT_NAMES
    names: list[str] = []
    for i, out in enumerate(request.outputs):
        if out.name not in OUTPUT_NAMES:
            raise _invalid(
                f"outputs[{i}].name",
                f"unknown output {quote(out.name)}; this model gives {', '.join(OUTPUT_NAMES)}",
            )
        if out.parameters:
            raise _invalid(f"outputs[{i}].parameters", "are not supported")
        if out.name not in names:
            names.append(out.name)
    return tuple(names)


def _bytes_element(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def _response(
    model: str,
    request_id: str,
    outputs: tuple[str, ...],
    text: str,
    token_ids: list[int],
    params: Mapping[str, Any],
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version="1", id=request_id)
    for name in outputs:
        if name == "text_output":
            response.outputs.add(name=name, datatype="BYTES", shape=[1])
            response.raw_output_contents.append(_bytes_element(text.encode()))
        else:
            response.outputs.add(name=name, datatype="INT32", shape=[len(token_ids)])
            response.raw_output_contents.append(struct.pack(f"<{len(token_ids)}i", *token_ids))
    _set_params(response, params)
    return response


def _set_params(response: pb.ModelInferResponse, params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        if isinstance(value, bool):
            response.parameters[key].bool_param = value
        elif isinstance(value, int):
            response.parameters[key].int64_param = value
        else:
            response.parameters[key].string_param = str(value)


@dataclass(slots=True)
class _Parsed:
    model: str
    body: dict[str, Any]
    outputs: tuple[str, ...]
    empty_final: bool
    headers: dict[str, str]
    remote: str | None


class GrpcV2Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over a ``WorkerService``."""

    def __init__(self, service: WorkerService, limits: GrpcV2Limits | None = None) -> None:
        self.service = service
        self.limits = limits or GrpcV2Limits()

    # ------------------------------------------------------------------------------- models
    def _models(self) -> list[str]:
        engine = self.service.engine
        return [engine.model_name, *sorted(a.name for a in engine.list_adapters())]

    def _known(self, name: str, version: str) -> None:
        if not name:
            raise _invalid("name", "is required")
        if name not in self._models():
            raise _Failure(
                grpc.StatusCode.NOT_FOUND,
                f"name: no model {quote(name)} on this worker; models: {', '.join(self._models())}",
            )
        if version not in _VERSIONS:
            raise _Failure(
                grpc.StatusCode.NOT_FOUND,
                f"version: model {quote(name)} has only version 1, not {quote(version)}",
            )

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=not (self.service.draining or self.service.unready))

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        ready = (
            not (self.service.draining or self.service.unready)
            and request.name in self._models()
            and request.version in _VERSIONS
        )
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        try:
            version = metadata.version("adaptermesh")
        except metadata.PackageNotFoundError:
            version = "0"
        return pb.ServerMetadataResponse(
            name="adaptermesh", version=version, extensions=["model_repository"]
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        try:
            self._known(request.name, request.version)
        except _Failure as exc:
            await context.abort(exc.code, exc.message)
        tm = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name,
            versions=["1"],
            platform=_PLATFORM,
            inputs=[tm(name=INPUT_NAME, datatype="BYTES", shape=[1])],
            outputs=[
                tm(name="text_output", datatype="BYTES", shape=[1]),
                tm(name="token_ids", datatype="INT32", shape=[-1]),
            ],
        )

    # ---------------------------------------------------------------------------- inference
    def _parse(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> _Parsed:
        headers = _metadata(context)
        # The adapter the edge routed (and checked the caller's scopes for) by path or header
        # (mesh/edge.py): it names the model when the message does not, and a message may not
        # name another one, which the edge never checked.
        routed = headers.get(ADAPTER_HEADER, "").strip()
        model = request.model_name or routed
        if not model:
            raise _invalid("model_name", "is required (the base model or an adapter)")
        if routed and model != routed:
            raise _Failure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"model_name: {quote(model)} is not the adapter this call was routed for "
                f"({ADAPTER_HEADER}: {quote(routed)})",
            )
        if request.model_version not in _VERSIONS:
            raise _Failure(
                grpc.StatusCode.NOT_FOUND,
                f"model_version: model {quote(model)} has only version 1",
            )
        body, empty_final, timeout = _sampling(request.parameters)
        body["model"] = model
        body["prompt"] = _prompt(request)
        outputs = _outputs(request)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = remaining if timeout is None else min(timeout, remaining)
        if timeout is not None:
            headers["x-request-timeout"] = repr(max(timeout, 1e-3))
        return _Parsed(model, body, outputs, empty_final, headers, _peer_host(context.peer()))

    async def _job(self, parsed: _Parsed) -> Any:
        # An adapter not loaded yet is resolved under the adapter root, as over HTTP.
        view = _RequestView(parsed.headers, parsed.remote)
        try:
            return await self.service.build_job(cast(web.Request, view), parsed.body, "completion")
        except ApiError as exc:
            raise _from_api(exc) from None

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        try:
            parsed = self._parse(request, context)
            job = await self._job(parsed)
            text: list[str] = []
            ids: list[int] = []
            params: dict[str, Any] = {}
            try:
                async with contextlib.aclosing(self.service.job_events(job)) as events:
                    async for choice in events:
                        event = choice.event
                        text.append(event.text)
                        if event.token_id is not None:
                            ids.append(event.token_id)
                        if event.finish_reason is not None:
                            params["finish_reason"] = event.finish_reason
                        if choice.usage is not None:
                            params["prompt_tokens"] = choice.usage["prompt_tokens"]
                            params["completion_tokens"] = choice.usage["completion_tokens"]
            except ApiError as exc:
                raise _from_api(exc) from None
        except _Failure as exc:
            await context.abort(exc.code, exc.message)
        return _response(parsed.model, request.id, parsed.outputs, "".join(text), ids, params)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if len(tasks) >= self.limits.max_stream_inflight:
                        out.put_nowait(
                            _stream_error(
                                request.id,
                                _Failure(
                                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"id: {self.limits.max_stream_inflight} requests are in flight on "
                                    "this stream; wait for one to finish or open another stream",
                                ),
                            )
                        )
                        continue
                    task = asyncio.create_task(self._stream_one(request, context, out))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read(), name="grpc-v2-stream-reader")
        try:
            while (message := await out.get()) is not None:
                yield message
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _stream_one(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        out: asyncio.Queue[pb.ModelStreamInferResponse | None],
    ) -> None:
        try:
            parsed = self._parse(request, context)
            job = await self._job(parsed)
            try:
                async with contextlib.aclosing(self.service.job_events(job)) as events:
                    async for choice in events:
                        event = choice.event
                        ids = [event.token_id] if event.token_id is not None else []
                        params: dict[str, Any] = {}
                        done = event.finish_reason is not None
                        if done:
                            params["finish_reason"] = event.finish_reason
                            if choice.usage is not None:
                                params["prompt_tokens"] = choice.usage["prompt_tokens"]
                                params["completion_tokens"] = choice.usage["completion_tokens"]
                        params[_FINAL] = done and not parsed.empty_final
                        if ids or event.text or not parsed.empty_final:
                            out.put_nowait(
                                pb.ModelStreamInferResponse(
                                    infer_response=_response(
                                        parsed.model,
                                        request.id,
                                        parsed.outputs,
                                        event.text,
                                        ids,
                                        params,
                                    )
                                )
                            )
                        if done and parsed.empty_final:
                            final = pb.ModelInferResponse(
                                model_name=parsed.model, model_version="1", id=request.id
                            )
                            _set_params(final, {**params, _FINAL: True})
                            out.put_nowait(pb.ModelStreamInferResponse(infer_response=final))
            except ApiError as exc:
                raise _from_api(exc) from None
        except _Failure as exc:
            out.put_nowait(_stream_error(request.id, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one request's fault must not end the stream
            log.exception("gRPC stream request %r failed", request.id)
            out.put_nowait(
                _stream_error(
                    request.id, _Failure(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
                )
            )

    # --------------------------------------------------------------------------- repository
    def _check_admin(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        headers = _metadata(context)
        verdict = admin_token_verdict(
            headers.get("x-admin-token"),
            headers.get("authorization", ""),
            self.service.config.admin_token,
        )
        if verdict == "missing":
            raise _Failure(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization: the repository "
                "calls need the admin token (metadata authorization: Bearer ...)",
            )
        if verdict == "wrong":
            raise _Failure(
                grpc.StatusCode.PERMISSION_DENIED, "authorization: the admin token is wrong"
            )

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[index(name=name, version="1", state="READY") for name in self._models()]
        )

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RepositoryModelLoadResponse:
        async def load(name: str) -> None:
            await self.service.load_adapter(name, _load_path(request))

        await self._repository_call(context, request.model_name, "is always loaded", load)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self,
        request: pb.RepositoryModelUnloadRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.RepositoryModelUnloadResponse:
        await self._repository_call(
            context, request.model_name, "cannot be unloaded", self.service.unload_adapter
        )
        return pb.RepositoryModelUnloadResponse()

    async def _repository_call(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        name: str,
        base_model: str,
        call: Callable[[str], Awaitable[None]],
    ) -> None:
        """A load or unload of adapter ``name``: the admin token, then the name (required,
        not the base model, which ``base_model``), then ``call(name)``; a refusal aborts the
        call with its status and message."""
        try:
            self._check_admin(context)
            if not name:
                raise _invalid("model_name", "is required (the adapter's name)")
            if name == self.service.engine.model_name:
                raise _invalid("model_name", f"is the base model, which {base_model}")
            try:
                await call(name)
            except ApiError as exc:
                raise _from_api(exc) from None
        except _Failure as exc:
            await context.abort(exc.code, exc.message)


def _load_path(request: pb.RepositoryModelLoadRequest) -> str:
    """The adapter's path: ``parameters["config"]`` JSON ``{"lora_path": ...}``, or a
    ``lora_path`` string parameter, else the model name (a directory under the adapter root)."""
    path: str | None = None
    for key in sorted(request.parameters):
        param = request.parameters[key]
        choice = param.WhichOneof("parameter_choice")
        field = f"parameters[{key}]"
        if key == "config":
            if choice != "string_param":
                raise _invalid(field, "must be a JSON string_param")
            try:
                config = json.loads(param.string_param)
            except json.JSONDecodeError as exc:
                raise _invalid(field, f"is not JSON: {exc.msg}") from None
            if not isinstance(config, dict) or set(config) - {"lora_path"}:
                raise _invalid(field, 'must be a JSON object {"lora_path": "..."}')
            value = config.get("lora_path")
            if value is not None and not isinstance(value, str):
                raise _invalid(f"{field}.lora_path", "must be a string")
            path = value or path
        elif key == "lora_path":
            if choice != "string_param":
                raise _invalid(field, "must be a string_param")
            path = param.string_param
        elif key.startswith("file:"):
            raise _invalid(field, "uploading model files is not supported; give lora_path")
        else:
            raise _invalid(field, "unknown parameter; known: config, lora_path")
    return path if path else request.model_name


def _stream_error(request_id: str, exc: _Failure) -> pb.ModelStreamInferResponse:
    # The stream carries no per-message status: the code leads the message.
    return pb.ModelStreamInferResponse(
        error_message=f"{exc.code.name}: {exc.message}",
        infer_response=pb.ModelInferResponse(id=request_id),
    )


def add_to_server(servicer: GrpcV2Servicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` like the generated ``add_..._to_server``, but parse each request
    inside its handler, so bytes that are no valid message are INVALID_ARGUMENT (grpc would
    answer INTERNAL)."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        fn = getattr(servicer, method.name)
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _parsing_stream(fn, request_cls),
                response_serializer=response_cls.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsing_unary(fn, request_cls),
                response_serializer=response_cls.SerializeToString,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def _parse_message(request_cls: Any, raw: bytes) -> Any:
    try:
        return request_cls.FromString(raw)
    except DecodeError:
        raise _invalid("request", f"is not a valid {request_cls.__name__}") from None


def _parsing_unary(fn: Any, request_cls: Any) -> Any:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = _parse_message(request_cls, raw)
        except _Failure as exc:
            await context.abort(exc.code, exc.message)
        return await fn(request, context)

    return handler


def _parsing_stream(fn: Any, request_cls: Any) -> Any:
    async def handler(
        raw_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raw_iterator:
                try:
                    yield _parse_message(request_cls, raw)
                except _Failure as exc:
                    # The stream's framing is intact but its sender is broken: end it.
                    await context.abort(exc.code, exc.message)

        async for message in fn(requests(), context):
            yield message

    return handler


class GrpcV2Server:
    """The worker's gRPC listener: v2 inference plus ``grpc.health.v1`` (for Envoy)."""

    def __init__(self, service: WorkerService, limits: GrpcV2Limits | None = None) -> None:
        self.service = service
        self.limits = limits or GrpcV2Limits()
        self.servicer = GrpcV2Servicer(service, self.limits)
        self.health = health.aio.HealthServicer()
        size = service.config.max_body_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
            ]
        )
        add_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a port); returns the bound port."""
        bound = int(self.server.add_insecure_port(f"{host}:{port}"))
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        await self.server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(
            pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name, serving
        )
        return bound

    async def draining(self) -> None:
        """Report NOT_SERVING, so Envoy's health checks stop sending new streams."""
        await self.health.enter_graceful_shutdown()

    async def stop(self) -> None:
        await self.server.stop(self.limits.stop_grace_s)
