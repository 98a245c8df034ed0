"""Wiring: store + load source + rebalancer + gRPC server (API, health, reflection)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from adaptermesh.clock import Clock
from adaptermesh.control_plane.api import ApiLimits, ControlPlaneServicer, add_to_server
from adaptermesh.control_plane.audit import AuditLog
from adaptermesh.control_plane.auth import (
    Authenticator,
    AuthInterceptor,
    CertIdentity,
    Denied,
    TokenFile,
    TokenTable,
    server_credentials,
)
from adaptermesh.control_plane.metrics import serve_metrics
from adaptermesh.control_plane.metrics_source import LoadSource, PrometheusSource, ScrapeSource
from adaptermesh.control_plane.policy import PolicyConfig
from adaptermesh.control_plane.preloader import HttpWorkerAdmin, Preloader, PreloaderConfig
from adaptermesh.control_plane.rebalancer import Rebalancer, RebalancerConfig
from adaptermesh.control_plane.rollout import RolloutController
from adaptermesh.control_plane.sa_tokens import (
    JwksFile,
    ServiceAccountPolicy,
    ServiceAccountVerifier,
)
from adaptermesh.control_plane.store import AUDIT_LIMIT, Store
from adaptermesh.proto.adaptermesh.v1 import control_plane_pb2

__all__ = ["CONTROL_PLANE_SERVICE", "ControlPlaneServer", "ServerConfig"]

CONTROL_PLANE_SERVICE = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
DB_NAME = "control-plane.sqlite3"


@dataclass
class ServerConfig:
    state_dir: Path
    listen: str = "127.0.0.1:7400"
    # The static tokens (a TokenFile re-reads its file when it changes). None, with neither
    # of the two below: no authentication (--no-auth).
    tokens: TokenTable | TokenFile | None = None
    # Projected ServiceAccount tokens as node credentials: the issuer's JWKS file and what
    # the tokens must say (docs/control-plane.md, "Credentials").
    sa_jwks: Path | None = None
    service_accounts: ServiceAccountPolicy | None = None
    # mTLS client certificates with a SAN "<node><suffix>" as node credentials (needs
    # tls_client_ca); None: certificates name no caller.
    node_cert_suffix: str | None = None
    # Audit rows kept (the newest).
    audit_limit: int = AUDIT_LIMIT
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    interval_s: float = 5.0
    scrape_timeout_s: float = 2.0
    prometheus_url: str | None = None
    synchronous: str = "FULL"
    index_quarantine_s: float = 300.0
    # Requests above this size are refused by the transport (RESOURCE_EXHAUSTED) before any
    # handler runs; the API's own limits name the field for anything smaller.
    max_message_bytes: int = 4 * 1024 * 1024
    rebalance: bool = True
    # How often running rollouts read worker metrics and decide (docs/rollout.md).
    rollout_tick_s: float = 1.0
    # Prometheus /metrics on this port, on the host of ``listen``; 0: off.
    metrics_port: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # The placement loop (preload, pinned shards, replicas; docs/adapter-instance.md) and the
    # token it sends to the workers' load endpoint (their --admin-token-file).
    placement: PreloaderConfig = field(default_factory=PreloaderConfig)
    worker_admin_token: str | None = None
    # Automatic homes: every AdapterInstance naming no shards is placed on one shard, weighted
    # by the shards' adapter slots (docs/adapter-instance.md, "Automatic homes").
    auto_placement: bool = False
    limits: ApiLimits = field(default_factory=ApiLimits)


class ControlPlaneServer:
    def __init__(
        self,
        config: ServerConfig,
        *,
        source: LoadSource | None = None,
        clock: Clock | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.log = logger or logging.getLogger("adaptermesh.control_plane")
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(
            config.state_dir / DB_NAME,
            synchronous=config.synchronous,
            index_quarantine_s=config.index_quarantine_s,
            audit_limit=config.audit_limit,
        )
        if source is None:
            source = (
                PrometheusSource(config.prometheus_url, interval_s=config.interval_s)
                if config.prometheus_url
                else ScrapeSource(interval_s=config.interval_s, timeout_s=config.scrape_timeout_s)
            )
        self.rebalancer = Rebalancer(
            self.store,
            source,
            clock=clock,
            config=RebalancerConfig(interval_s=config.interval_s, policy=config.policy),
            logger=self.log,
        )
        if config.auto_placement:
            self.rebalancer.resume_homes()
        self.servicer = ControlPlaneServicer(self.rebalancer, config.limits, self.log)
        self.authenticator = self._authenticator()
        self.audit = AuditLog(self.store, self.rebalancer.clock.time, self.log)
        self.servicer.count_denied = self.rebalancer.metrics.count_denied
        self.rollouts = RolloutController(
            self.rebalancer, tick_s=config.rollout_tick_s, logger=self.log
        )
        self.servicer.rollouts = self.rollouts
        self._rollout_task: asyncio.Task[None] | None = None
        self.worker_admin = HttpWorkerAdmin(config.worker_admin_token)
        self.preloader = Preloader(
            self.store,
            self.worker_admin,
            clock=clock,
            config=config.placement,
            logger=self.log,
            auto_placement=config.auto_placement,
            on_homes=self.rebalancer.set_homes if config.auto_placement else None,
        )
        self._placement_task: asyncio.Task[None] | None = None
        self.health = health_aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def _authenticator(self) -> Authenticator | None:
        cfg = self.config
        verifier = None
        if (cfg.sa_jwks is None) != (cfg.service_accounts is None):
            raise ValueError("ServiceAccount tokens need both the JWKS file and the policy")
        if cfg.sa_jwks is not None and cfg.service_accounts is not None:
            verifier = ServiceAccountVerifier(
                JwksFile(cfg.sa_jwks, self.log), cfg.service_accounts, self.rebalancer.clock.time
            )
        certs = None
        if cfg.node_cert_suffix is not None:
            if cfg.tls_client_ca is None:
                raise ValueError("node certificates need --tls-client-ca (mTLS)")
            certs = CertIdentity(cfg.node_cert_suffix)
        if cfg.tokens is None and verifier is None and certs is None:
            return None
        return Authenticator(cfg.tokens, verifier, certs)

    def _denied(self, method: str, refusal: Denied) -> None:
        self.rebalancer.metrics.count_denied(method, refusal.reason)
        self.log.debug("refused %s from %s: %s", method, refusal.caller, refusal.message)
        self.audit.denied(method, refusal)

    async def start(self) -> int:
        cfg = self.config
        interceptors = (
            [AuthInterceptor(self.authenticator, self._denied)]
            if self.authenticator is not None
            else []
        )
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
            # Watch streams are long-lived: keepalives find dead agents.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        add_to_server(self.servicer, server, self.audit)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (CONTROL_PLANE_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            creds = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
            self.port = server.add_secure_port(cfg.listen, creds)
        else:
            if cfg.tls_client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            self.port = server.add_insecure_port(cfg.listen)
        if not self.port:
            raise OSError(f"cannot listen on {cfg.listen}")
        await server.start()
        self._server = server
        if cfg.metrics_port:
            host = cfg.listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
            try:
                self._metrics_runner = await serve_metrics(
                    self.rebalancer.metrics, host, cfg.metrics_port
                )
            except OSError as exc:
                await server.stop(None)
                raise OSError(f"cannot serve metrics on {host}:{cfg.metrics_port}: {exc}") from exc
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set(CONTROL_PLANE_SERVICE, serving)
        if cfg.rebalance:
            self._loop_task = asyncio.create_task(self.rebalancer.run(self._stop))
            self._rollout_task = asyncio.create_task(self.rollouts.run(self._stop))
            self._placement_task = asyncio.create_task(self.preloader.run(self._stop))
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", not_serving)
        await self.health.set(CONTROL_PLANE_SERVICE, not_serving)
        for task in (self._rollout_task, self._placement_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._server is not None:
            await self._server.stop(grace)
        await self.worker_admin.aclose()
        for source in (self.rebalancer.source, self.rollouts.source):
            # The scrape sources keep one HTTP client across rounds; a test's fake has none.
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
        self.store.close()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
