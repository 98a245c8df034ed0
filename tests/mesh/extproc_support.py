"""Helpers for the ext_proc tests: an OpenAI-shaped fake worker and a GIE-style Envoy bootstrap."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envoy.config.bootstrap.v3 import bootstrap_pb2

# Registers the typed configs the GIE bootstrap names, for json_format.ParseDict.
from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.set_metadata.v3 import set_metadata_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

LOOPBACK = "127.0.0.1"


class _Worker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.wfile.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, ctype.encode(), len(body), body)
        )

    def do_GET(self) -> None:
        worker: FakeWorker = self.server.worker  # type: ignore[attr-defined]
        if self.path == "/metrics":
            self._send(200, worker.metrics.encode(), "text/plain; version=0.0.4")
        else:
            self._send(200, b"{}")

    def do_POST(self) -> None:
        worker: FakeWorker = self.server.worker  # type: ignore[attr-defined]
        raw = self._read_body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        seen = {
            "worker": worker.name,
            "adapter": self.headers.get("x-adapter-id"),
            "destination": self.headers.get("x-gateway-destination-endpoint"),
            "model": body.get("model") if isinstance(body, dict) else None,
            "body_bytes": len(raw),
            "chunked": self.headers.get("transfer-encoding") == "chunked",
        }
        with worker.lock:
            worker.seen.append(seen)
        text = f"{worker.name}|{seen['adapter']}"
        chat = self.path.endswith("/chat/completions")
        model = seen["model"] or "base"
        if isinstance(body, dict) and body.get("stream"):
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
                self._chunk(_event(chat, model, piece, None))
            self._chunk(_event(chat, model, "", "stop"))
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        self._send(200, json.dumps(_completion(chat, model, text)).encode())

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("content-length") or 0))
        out = bytearray()
        while True:  # Envoy forwards a body it buffered for ext_proc chunked
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                self.rfile.readline()
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _completion(chat: bool, model: str, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def _event(chat: bool, model: str, text: str, finish: str | None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    event = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class FakeWorker:
    """An OpenAI-compatible worker on 127.0.0.1 that answers ``<name>|<x-adapter-id>`` and
    records every request's adapter and destination headers."""

    def __init__(self, name: str, metrics: str = "") -> None:
        self.name = name
        self.metrics = metrics
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((LOOPBACK, 0), _Worker)
        self.httpd.daemon_threads = True
        self.httpd.worker = self  # type: ignore[attr-defined]
        self.port = int(self.httpd.server_address[1])
        self.key = f"{LOOPBACK}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def vllm_metrics(
    *, waiting: float, kv: float, running_adapters: str = "", max_lora: int = 4
) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting {waiting}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc {kv}\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters='
        f'"{running_adapters}",waiting_lora_adapters=""}} 1\n'
    )


def gie_bootstrap(
    listen_port: int, ext_proc_port: int, access_log: str, *, subset: list[str] | None = None
) -> bootstrap_pb2.Bootstrap:
    """Envoy set up the way GIE documents for Envoy Gateway: ext_proc (full-duplex streamed
    request body, request trailers sent, fail closed) in front of a route to an ORIGINAL_DST
    cluster that takes the destination from ``x-gateway-destination-endpoint``.

    ``subset`` adds a set_metadata filter that hands the picker a subset hint."""
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": subset},
                        }
                    ],
                },
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                "failure_mode_allow": False,
                "message_timeout": "5s",
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SKIP",
                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND",
                    "response_body_mode": "NONE",
                    "response_trailer_mode": "SKIP",
                },
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
            },
        }
    )
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    h2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    config = {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": LOOPBACK, "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "gateway",
                                        "access_log": [
                                            {
                                                "name": "envoy.access_loggers.file",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.access_loggers."
                                                    "file.v3.FileAccessLog",
                                                    "path": access_log,
                                                    "log_format": {
                                                        "json_format": {
                                                            "code": "%RESPONSE_CODE%",
                                                            "upstream": "%UPSTREAM_HOST%",
                                                            "picked": "%DYNAMIC_METADATA(envoy.lb:"
                                                            "x-gateway-destination-endpoint)%",
                                                        }
                                                    },
                                                },
                                            }
                                        ],
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "pool",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "original_destination_cluster",
                                                                "timeout": "0s",
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": filters,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": h2,
                    "load_assignment": {
                        "cluster_name": "epp",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": LOOPBACK,
                                                    "port_value": ext_proc_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }
    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())
