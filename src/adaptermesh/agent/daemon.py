"""The node agent: datapath + control-plane watch + load reports + xDS + its own HTTP.

Start-up order matters for a restart that loses no traffic:

1. open the datapath (the loader reuses the pinned maps and the attached filter, so the
   classifier never stops steering);
2. start the xDS server and reconcile with the cached Assignment, so an Envoy that reconnects
   gets the same configuration it had, not an empty one;
3. only then watch the control plane, resuming from the applied version.

A datapath that can be lost (the real one: its interface, filter and pins) is watched by
``agent/liveness.py``: ``/healthz`` fails and names what is missing, Assignments are held,
and when the interface is back the agent replays the current Assignment and attaches again.

A graceful stop leaves the filter and the pinned maps in place unless ``detach`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from adaptermesh.agent.applier import Applier
from adaptermesh.agent.extproc import ExtProcConfig, ExtProcServer, MetricsPoller
from adaptermesh.agent.flowlog import FlowEventMode, FlowExporter
from adaptermesh.agent.http import build_app
from adaptermesh.agent.liveness import DatapathMonitor
from adaptermesh.agent.load import LoadTracker
from adaptermesh.agent.metrics import AgentMetrics
from adaptermesh.agent.picker import EndpointBook
from adaptermesh.agent.ports import Datapath, FlowEvent, XdsSink
from adaptermesh.agent.rulesync import RuleSync
from adaptermesh.agent.state import AssignmentStore
from adaptermesh.agent.watch import AssignmentWatcher, BearerFile, LoadReporter, Token
from adaptermesh.backoff import Backoff
from adaptermesh.bpf.table import Attachable, FlowLookup
from adaptermesh.clock import Clock, SystemClock
from adaptermesh.httpserve import serve_app
from adaptermesh.proto.adaptermesh.v1 import assignment_pb2, control_plane_pb2_grpc
from adaptermesh.tracing import Tracing

__all__ = ["Agent", "AgentConfig"]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class AgentConfig:
    node_id: str
    control_plane: str  # HOST:PORT
    token: str | None = None
    # Where ``token`` came from: re-read when it changes (a projected ServiceAccount token the
    # kubelet rotates). None: ``token`` is fixed.
    token_file: Path | None = None
    iface: str = "eth0"
    pin_dir: Path = Path("/sys/fs/bpf/adaptermesh")
    vxlan_dev: str | None = None
    xds_host: str = "127.0.0.1"
    xds_port: int = 18000
    # "shard": one snapshot per shard, Envoys name their shard in node.cluster; "node": one
    # snapshot with every shard for all Envoys (see agent/backends.py).
    xds_group: str = "shard"
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    state_file: Path | None = Path("/var/lib/adaptermesh/agent/assignment.pb")
    report_interval_s: float = 2.0
    detach: bool = False
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    # Adapter by body (agent/extproc.py): the ext_proc server's port, None to run none. Shard
    # listeners then get the ext_proc filter (agent/backends.py), and Envoy's bootstrap needs
    # the adaptermesh_extproc cluster pointing here.
    ext_proc_port: int | None = None
    ext_proc_host: str = "127.0.0.1"
    base_model: str | None = None
    ext_proc_max_body_bytes: int = 4 << 20
    picker_scrape_interval_s: float = 1.0
    # Route by the body's model inside Envoy (json_to_metadata), without the processor hop.
    route_by_body: bool = False
    # Bearer-token checks for adapters with scopes (mesh/edge.py): the JWT issuer and a
    # JWKS document with the keys that sign the tokens (public keys).
    edge_issuer: str | None = None
    edge_jwks: str | None = None
    edge_audiences: tuple[str, ...] = ()
    # TLS beside plaintext on every shard listener (certificate chain and key files, as the
    # Envoy process reads them); adapters with security.tls need it.
    edge_tls_cert: str | None = None
    edge_tls_key: str | None = None
    # The workers' KServe v2 gRPC port relative to their HTTP port (None: no gRPC clusters).
    grpc_port_offset: int | None = None
    # Percent of requests the shard listeners' Envoy tracer samples (docs/tracing.md); None:
    # no tracing. Envoy's bootstrap then needs the adaptermesh_otlp collector cluster.
    envoy_trace_percent: float | None = None
    # The agent's own spans (the ext_proc decisions) to this OTLP/gRPC collector; None: off.
    otlp_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    # Each new-flow ring-buffer event exported keyed by the flow (agent/flowlog.py): "log" (a
    # JSON line on the adaptermesh.flows logger), "span" (needs otlp_endpoint), "both", "off".
    flow_events: FlowEventMode = "off"
    # Longest time between two looks at the datapath's interface, filter and pins (netlink
    # events about links and filters wake the look at once; an unpinned map sends none).
    liveness_interval_s: float = 1.0


DatapathFactory = Callable[[AgentConfig], Datapath]
# Receives the agent's registry, so the xDS server's series appear on the agent's /metrics.
XdsFactory = Callable[[AgentConfig, CollectorRegistry], Awaitable[XdsSink]]


def _channel(config: AgentConfig) -> grpc.aio.Channel:
    # Keepalives notice a dead control plane (or a dropped NAT entry) within seconds instead of
    # waiting for TCP to time out, so the reconnect starts promptly.
    options = [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if config.tls_ca is None:
        return grpc.aio.insecure_channel(config.control_plane, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=config.tls_ca.read_bytes(),
        private_key=config.tls_key.read_bytes() if config.tls_key else None,
        certificate_chain=config.tls_cert.read_bytes() if config.tls_cert else None,
    )
    return grpc.aio.secure_channel(config.control_plane, creds, options=options)


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        datapath_factory: DatapathFactory,
        xds_factory: XdsFactory,
        metrics: AgentMetrics | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        # The one clock of the agent's loops: the applier, the watch, the load reports.
        self.clock: Clock = clock or SystemClock()
        self._datapath_factory = datapath_factory
        self._xds_factory = xds_factory
        self.metrics = metrics or AgentMetrics()
        self.tracker = LoadTracker()
        self.datapath: Datapath | None = None
        self.xds: XdsSink | None = None
        self.applier: Applier | None = None
        self.watcher: AssignmentWatcher | None = None
        self.reporter: LoadReporter | None = None
        self.monitor: DatapathMonitor | None = None
        self.http_port: int | None = None
        self.ext_proc: ExtProcServer | None = None
        # The Assignment's routing rules, compiled and installed into the ext_proc server.
        self.rule_sync = RuleSync()
        self.tracing = Tracing.off()
        self.flow_exporter: FlowExporter | None = None
        self._names_of: tuple[assignment_pb2.Assignment, dict[int, str]] | None = None
        self._poll_stop = threading.Event()
        self._poll_error = ""
        self.started = asyncio.Event()

    # -- event thread ---------------------------------------------------------------------

    def _on_event(self, event: FlowEvent) -> None:
        self.tracker.on_event(event, self.clock.monotonic())
        self.metrics.events.labels(event.reason).inc()
        exporter = self.flow_exporter
        if exporter is not None:
            try:
                exporter(event)
            except Exception:  # exporting is best effort; the flow is counted either way
                _log.exception("could not export flow event")

    def _poll_events(self, datapath: Datapath) -> None:
        # bcc's ring-buffer poll blocks in the kernel; a thread keeps the event loop free.
        while not self._poll_stop.is_set():
            try:
                datapath.poll_events(self._on_event, 200)
            except Exception as exc:
                self._poll_error = str(exc)
                _log.exception("ring buffer poll failed; retrying")
                self._poll_stop.wait(1.0)

    def _watch_links(self, datapath: Attachable, monitor: DatapathMonitor) -> None:
        # Netlink events only make the monitor look sooner; its periodic look stays.
        try:
            datapath.watch_links(monitor.wake, self._poll_stop)
        except Exception:
            _log.exception("netlink watch failed; the datapath is checked every %.1fs",
                           monitor.interval_s)  # fmt: skip

    def _shard_names(self) -> dict[int, str]:
        current = self.applier.current if self.applier else None
        if current is None:
            return {}
        names = self._names_of
        if names is None or names[0] is not current:
            names = self._names_of = (current, {s.index: s.id for s in current.shards})
        return names[1]

    # -- HTTP views -----------------------------------------------------------------------

    def _datapath_view(self) -> dict[str, Any]:
        monitor = self.monitor
        if monitor is None:
            return {"attached": self.datapath is not None, "missing": []}
        return {
            "attached": monitor.attached,
            "missing": list(monitor.missing),
            "detaches": monitor.detaches,
            "reattaches": monitor.reattaches,
            "error": monitor.last_error,
        }

    def _health(self) -> tuple[bool, dict[str, Any]]:
        applier = self.applier
        datapath = self._datapath_view()
        ok = (
            self.datapath is not None
            and datapath["attached"]
            and self.xds is not None
            and not self._poll_error
        )
        error = self._poll_error
        if datapath["missing"]:
            error = f"datapath: {', '.join(datapath['missing'])} missing"
        return ok, {
            "applied_version": applier.applied_version if applier else 0,
            "control_plane_connected": bool(self.watcher and self.watcher.connected),
            "datapath": datapath,
            "error": error,
        }

    def _ready(self) -> bool:
        return self.applier is not None and self.applier.applied_version > 0

    def status(self) -> dict[str, Any]:
        applier = self.applier
        current = applier.current if applier else None
        rates = self.tracker.last()
        shards = []
        if current is not None:
            for s in current.shards:
                r = rates.get(s.index)
                shards.append(
                    {
                        "id": s.id,
                        "index": s.index,
                        "weight": s.weight,
                        "state": assignment_pb2.ShardState.Name(s.state),
                        "endpoints": [
                            {
                                "address": f"{e.address}:{e.port}",
                                "weight": e.weight,
                                "draining": e.draining,
                            }
                            for e in s.endpoints
                        ],
                        "packets_per_s": r.packets_per_s if r else 0.0,
                        "bytes_per_s": r.bytes_per_s if r else 0.0,
                        "new_flows_per_s": r.new_flows_per_s if r else 0.0,
                        "active_flows": r.active_flows if r else 0,
                        "packets_total": r.packets_total if r else 0,
                        "new_flows_total": r.new_flows_total if r else 0,
                    }
                )
        return {
            "node_id": self.config.node_id,
            "applied_version": applier.applied_version if applier else 0,
            "received_version": applier.received_version if applier else 0,
            "apply_error": applier.last_error if applier else "",
            "datapath": self._datapath_view(),
            "routing_rules": {"version": self.rule_sync.version, "error": self.rule_sync.error},
            "reason": current.reason if current else "",
            "control_plane_connected": bool(self.watcher and self.watcher.connected),
            "watch_error": self.watcher.last_error if self.watcher else "",
            "report_error": self.reporter.last_error if self.reporter else "",
            "events_total": self.tracker.events_total,
            "datapath_counters": dict(self.tracker.counters),
            "shards": shards,
            "pins": [{"cidr": p.cidr, "shard_id": p.shard_id} for p in current.pins]
            if current
            else [],
            "overrides": [
                {"shard_id": o.shard_id, "weight": o.weight, "reason": o.reason}
                for o in current.overrides
            ]
            if current
            else [],
        }

    def flows(self, source: str | None) -> dict[str, Any]:
        current = self.applier.current if self.applier else None
        names = {s.index: s.id for s in current.shards} if current else {}
        rows = [
            {
                "source": src,
                "shard_index": index,
                "shard_id": names.get(index, ""),
                "age_s": round(age, 3),
            }
            for src, index, age in sorted(self.tracker.flows(self.clock.monotonic()))
            if source is None or src == source
        ]
        # A flow that stays sticky sends no new-flow event, so one older than the window is
        # not in the tracker; for one source, the datapath's flow table still says where it
        # goes (age unknown: null).
        if source is not None and not rows and isinstance(self.datapath, FlowLookup):
            index = self.datapath.lookup_flow(source)
            if index is not None:
                rows = [{"source": source, "shard_index": index,
                         "shard_id": names.get(index, ""), "age_s": None}]  # fmt: skip
        return {"window_s": self.tracker.active_window_s, "flows": rows}

    # -- lifecycle ------------------------------------------------------------------------

    async def _start_ext_proc(self, applier: Applier) -> None:
        """Serve ext_proc and keep its picker's workers and loads fresh (until cancelled)."""
        config = self.config
        book = EndpointBook()
        if applier.current is not None:
            book.set_assignment(applier.current)
        server = ExtProcServer(
            book,
            ExtProcConfig(
                base_model=config.base_model, max_body_bytes=config.ext_proc_max_body_bytes
            ),
            host=config.ext_proc_host,
            port=config.ext_proc_port or 0,
            # A GIE gateway should not pick this agent before it knows any worker.
            ready=applier.current is not None,
            # Read per request: a new split applies with the Assignment, not a poll later.
            assignment=lambda: applier.current,
            tracing=self.tracing,
        )
        await asyncio.to_thread(server.start)
        self.rule_sync.attach(server.set_rules)
        self.ext_proc = server
        await MetricsPoller(
            book,
            interval_s=config.picker_scrape_interval_s,
            assignment=lambda: applier.current,
            on_assignment=lambda _a: server.set_ready(True),
        ).run()

    async def run(self, stop: asyncio.Event) -> None:
        config = self.config
        self.metrics.bind_rates(self.tracker.last, lambda: dict(self.tracker.counters))
        # The datapath runs off the event loop: pyroute2's synchronous API (used by the loader
        # to attach and resolve interfaces) refuses to run inside a running event loop.
        self.tracing = Tracing.from_config(
            config.otlp_endpoint, config.trace_sample_ratio, "adaptermesh-agent"
        )
        if config.flow_events != "off":
            self.flow_exporter = FlowExporter(
                config.flow_events,
                self.tracing,
                config.node_id,
                self._shard_names,
                sample_ratio=config.trace_sample_ratio,
            )
        datapath = await asyncio.to_thread(self._datapath_factory, config)
        self.datapath = datapath
        self.metrics.datapath_attached.set(1)
        tasks: list[asyncio.Task[None]] = []
        runner: web.AppRunner | None = None
        channel: grpc.aio.Channel | None = None
        poller: threading.Thread | None = None
        try:
            self.xds = await self._xds_factory(config, self.metrics.registry)
            applier = Applier(
                datapath,
                self.xds,
                self.metrics,
                AssignmentStore(config.state_file),
                clock=self.clock,
            )
            self.applier = applier
            applier.listeners.append(self.rule_sync.on_assignment)
            await asyncio.to_thread(applier.reconcile)

            # The listener guards every HTTP listener shares (httpserve.py): header and body
            # deadlines, header caps (431), a connection cap, the fd limit raised.
            runner, self.http_port = await serve_app(
                build_app(self.metrics, self._health, self._ready, self.status, self.flows),
                config.metrics_host,
                config.metrics_port,
            )

            self._poll_stop.clear()
            poller = threading.Thread(
                target=self._poll_events, args=(datapath,), name="am-ringbuf", daemon=True
            )
            poller.start()

            if isinstance(datapath, Attachable):
                self.monitor = DatapathMonitor(
                    datapath,
                    applier,
                    self.metrics,
                    config.iface,
                    str(config.pin_dir),
                    interval_s=config.liveness_interval_s,
                )
                tasks.append(asyncio.create_task(self.monitor.run(), name="am-liveness"))
                threading.Thread(
                    target=self._watch_links,
                    args=(datapath, self.monitor),
                    name="am-netlink",
                    daemon=True,
                ).start()

            channel = _channel(config)
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            bearer: Token = (
                BearerFile(config.token_file, config.token)
                if config.token_file is not None and config.token
                else config.token
            )
            self.reporter = LoadReporter(
                stub,
                config.node_id,
                applier,
                datapath,
                self.tracker,
                self.metrics,
                token=bearer,
                interval_s=config.report_interval_s,
                clock=self.clock,
                extra_error=lambda: self.rule_sync.error,
            )
            self.watcher = AssignmentWatcher(
                stub,
                config.node_id,
                applier,
                self.metrics,
                token=bearer,
                backoff=Backoff(config.backoff_initial_s, config.backoff_max_s),
                on_applied=self.reporter.poke,
                clock=self.clock,
            )
            tasks += [
                asyncio.create_task(self.watcher.run(), name="am-watch"),
                asyncio.create_task(self.reporter.run(), name="am-report"),
            ]
            if config.ext_proc_port is not None:
                tasks.append(asyncio.create_task(self._start_ext_proc(applier), name="am-picker"))
            self.started.set()
            _log.info(
                "agent %s up: iface=%s xds=%s:%d http=%s:%s control-plane=%s",
                config.node_id,
                config.iface,
                config.xds_host,
                config.xds_port,
                config.metrics_host,
                self.http_port,
                config.control_plane,
            )
            stop_wait = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            for task in done:
                if task is not stop_wait and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if channel is not None:
                await channel.close()
            self._poll_stop.set()
            if poller is not None:
                await asyncio.to_thread(poller.join, 2.0)
            if self.ext_proc is not None:
                await asyncio.to_thread(self.ext_proc.stop)
                self.ext_proc = None
            if runner is not None:
                await runner.cleanup()
            if self.xds is not None:
                await self.xds.close()
            await asyncio.to_thread(datapath.close, config.detach)
            await asyncio.to_thread(self.tracing.shutdown)
            self.metrics.datapath_attached.set(0)
            _log.info(
                "agent %s stopped (%s)",
                config.node_id,
                "datapath detached" if config.detach else "datapath left in place",
            )
