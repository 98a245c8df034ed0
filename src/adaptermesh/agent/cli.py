"""``adaptermesh agent``: run the node agent.

Example::

    adaptermesh agent --node-id node-a --control-plane 10.0.0.5:50051 \\
        --token-file /etc/adaptermesh/agent.token --iface eth0 \\
        --pin-dir /sys/fs/bpf/adaptermesh --xds-port 18000 --metrics-port 9464

SIGTERM and SIGINT stop it gracefully: the classifier stays attached and keeps steering with
the last Assignment, so a restart (an upgrade, a crash loop) loses no traffic. ``--detach``
removes the filter and the pinned maps on the way out, for uninstalling.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from adaptermesh.agent.daemon import Agent, AgentConfig
from adaptermesh.agent.flowlog import FLOW_EVENT_MODES
from adaptermesh.cliargs import fraction, percent, port, positive_float, read_secret
from adaptermesh.clisetup import DefaultsHelpFormatter, setup_logging

__all__ = ["build_parser", "config_from_args", "main"]

_log = logging.getLogger("adaptermesh.agent")


def _host_port(text: str) -> str:
    if text.startswith("unix:") and len(text) > len("unix:"):
        return text  # a control plane on this host's unix socket (gRPC target syntax)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adaptermesh agent",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--node-id", required=True, help="this node's name, as the control plane sees it"
    )
    p.add_argument(
        "--control-plane",
        required=True,
        type=_host_port,
        metavar="HOST:PORT",
        help="the control plane's gRPC address (or unix:/PATH)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        help="file holding the bearer token for the control plane (re-read when it changes: a "
        "projected ServiceAccount token works); it needs the read and report scopes (the agent "
        "calls WatchAssignments and ReportLoad, for its own node only)",
    )
    p.add_argument("--iface", required=True, help="interface whose ingress the classifier steers")
    p.add_argument(
        "--pin-dir",
        type=Path,
        default=Path("/sys/fs/bpf/adaptermesh"),
        help="bpffs directory the classifier's maps are pinned in (kept across restarts)",
    )
    p.add_argument("--vxlan-dev", help="collect-metadata VXLAN device for tunnel steering")
    p.add_argument("--xds-host", default="127.0.0.1", help="address the xDS server binds")
    p.add_argument("--xds-port", type=port, default=18000, help="port of the xDS server")
    p.add_argument(
        "--xds-group",
        choices=["shard", "node"],
        default="shard",
        help="shard: one snapshot per shard, picked by the Envoy's node.cluster 'shard-<id>'; "
        "node: every Envoy gets all shards",
    )
    p.add_argument(
        "--ext-proc-port",
        type=port,
        default=None,
        help="serve Envoy ext_proc here (adapter by body, GIE endpoint picker); shard "
        "listeners then read the request's model; off when not given",
    )
    p.add_argument("--ext-proc-host", default="127.0.0.1", help="address ext_proc binds")
    p.add_argument(
        "--route-by-body",
        action="store_true",
        help="shard listeners route by the request's model inside Envoy (json_to_metadata), "
        "without the ext_proc hop: no scoring, no GIE",
    )
    p.add_argument(
        "--edge-jwks",
        type=Path,
        help="JWKS file with the keys that sign callers' bearer tokens, for "
        "AdapterInstances with security scopes (docs/adapter-instance.md)",
    )
    p.add_argument("--edge-issuer", help="the tokens' issuer (iss); needed with --edge-jwks")
    p.add_argument(
        "--edge-audience",
        action="append",
        default=[],
        help="an accepted audience (aud); repeat; none: any",
    )
    p.add_argument(
        "--edge-tls-cert",
        help="certificate chain file (as Envoy reads it) for TLS "
        "beside plaintext on the shard listeners",
    )
    p.add_argument("--edge-tls-key", help="the private key file of --edge-tls-cert")
    p.add_argument(
        "--grpc-port-offset",
        type=int,
        default=None,
        help="workers serve KServe v2 gRPC at their HTTP port plus this (1 for "
        "8000/8001): shard listeners then route gRPC to them",
    )
    p.add_argument(
        "--base-model",
        help="the served base model's name: requests naming it get no adapter header",
    )
    p.add_argument(
        "--ext-proc-max-body-bytes",
        type=int,
        default=4 << 20,
        metavar="BYTES",
        help="largest request body read for its model (Envoy answers 413 above it)",
    )
    p.add_argument(
        "--envoy-trace-percent",
        type=percent,
        default=None,
        help="shard listeners trace this percent of requests with Envoy's OpenTelemetry "
        "tracer, to the bootstrap's adaptermesh_otlp collector (off when not given)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export the ext_proc decisions' spans to this OTLP/gRPC collector",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=fraction,
        default=1.0,
        help="share of new traces the agent samples (a sampled parent is followed)",
    )
    p.add_argument(
        "--flow-events",
        choices=FLOW_EVENT_MODES,
        default="off",
        help="export each new-flow classifier decision keyed by the flow: a JSON "
        "log line (log), a span in the flow's trace (span, needs --otlp-endpoint), "
        "or both",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address /metrics binds")
    p.add_argument(
        "--metrics-port",
        type=port,
        default=9464,
        help="port of /metrics, /healthz, /readyz, /status and /flows",
    )
    p.add_argument(
        "--state-file",
        type=Path,
        default=Path("/var/lib/adaptermesh/agent/assignment.pb"),
        help="cache of the last applied Assignment, served at once after a restart",
    )
    p.add_argument(
        "--report-interval",
        type=positive_float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between load reports to the control plane",
    )
    p.add_argument("--tls-ca", type=Path, help="CA bundle: connect to the control plane with TLS")
    p.add_argument("--tls-cert", type=Path, help="client certificate for mTLS")
    p.add_argument("--tls-key", type=Path, help="client key for mTLS")
    p.add_argument(
        "--detach", action="store_true", help="on exit, remove the filter and pinned maps"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="DEBUG adds one line per worker scrape",
    )
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    token = None
    if args.token_file is not None:
        try:
            token = read_secret(args.token_file, "--token-file")
        except ValueError as exc:
            raise SystemExit(f"adaptermesh agent: {exc}") from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("adaptermesh agent: --tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        raise SystemExit("adaptermesh agent: --tls-cert needs --tls-ca")
    if (args.edge_jwks is None) != (args.edge_issuer is None):
        raise SystemExit("adaptermesh agent: --edge-jwks and --edge-issuer go together")
    if (args.edge_tls_cert is None) != (args.edge_tls_key is None):
        raise SystemExit("adaptermesh agent: --edge-tls-cert and --edge-tls-key go together")
    if args.flow_events in ("span", "both") and args.otlp_endpoint is None:
        raise SystemExit(
            f"adaptermesh agent: --flow-events {args.flow_events} needs --otlp-endpoint"
        )
    return AgentConfig(
        edge_tls_cert=args.edge_tls_cert,
        edge_tls_key=args.edge_tls_key,
        grpc_port_offset=args.grpc_port_offset,
        edge_jwks=None if args.edge_jwks is None else args.edge_jwks.read_text(),
        edge_issuer=args.edge_issuer,
        edge_audiences=tuple(args.edge_audience),
        node_id=args.node_id,
        control_plane=args.control_plane,
        token=token,
        token_file=args.token_file,
        iface=args.iface,
        pin_dir=args.pin_dir,
        vxlan_dev=args.vxlan_dev,
        xds_host=args.xds_host,
        xds_port=args.xds_port,
        xds_group=args.xds_group,
        ext_proc_port=args.ext_proc_port,
        ext_proc_host=args.ext_proc_host,
        base_model=args.base_model,
        ext_proc_max_body_bytes=args.ext_proc_max_body_bytes,
        route_by_body=args.route_by_body,
        envoy_trace_percent=args.envoy_trace_percent,
        otlp_endpoint=args.otlp_endpoint,
        trace_sample_ratio=args.trace_sample_ratio,
        flow_events=args.flow_events,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        state_file=args.state_file,
        report_interval_s=args.report_interval,
        detach=args.detach,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


async def _run(config: AgentConfig) -> None:
    from adaptermesh.agent.backends import bpf_datapath, mesh_xds

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Agent(config, bpf_datapath, mesh_xds).run(stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level)
    config = config_from_args(args)
    try:
        socket.if_nametoindex(config.iface)
    except OSError:
        # Checked before anything is compiled, pinned or bound: a wrong --iface leaves nothing.
        print(
            f"adaptermesh agent: --iface {config.iface}: no such network interface", file=sys.stderr
        )
        return 1
    try:
        asyncio.run(_run(config))
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:
        # A start that cannot proceed (an interface, a port in use, a file): one line; the
        # traceback only with --log-level DEBUG.
        _log.debug("agent failed", exc_info=True)
        print(f"adaptermesh agent: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        _log.exception("agent failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
