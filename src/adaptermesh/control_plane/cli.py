"""``adaptermesh control-plane``: run the control plane.

    adaptermesh control-plane --state-dir DIR --listen HOST:PORT --tokens-file F --interval 5 \
        [--metrics-port 9090] [--sa-jwks-file jwks.json --sa-issuer URL --sa-allow NS:SA]

Prints ``listening on HOST:PORT`` (the bound port, useful with ``:0``) once it serves, and
stops cleanly on SIGTERM or SIGINT. Exit codes: 0 after a clean stop, 1 when it cannot start
(unreadable tokens file, port in use, bad TLS files), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from adaptermesh.cliargs import port, positive_float, read_secret
from adaptermesh.clisetup import DefaultsHelpFormatter, setup_logging
from adaptermesh.control_plane.auth import DEFAULT_CERT_SAN_SUFFIX, AuthError, TokenFile
from adaptermesh.control_plane.policy import PolicyConfig
from adaptermesh.control_plane.sa_tokens import (
    DEFAULT_AUDIENCE,
    DEFAULT_MAX_LIFETIME_S,
    ServiceAccountPolicy,
    parse_allowed,
)
from adaptermesh.control_plane.server import ControlPlaneServer, ServerConfig
from adaptermesh.control_plane.store import AUDIT_LIMIT

__all__ = ["build_parser", "main"]

_DEFAULTS = PolicyConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adaptermesh control-plane",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--state-dir", type=Path, required=True, help="directory for the SQLite state")
    p.add_argument("--listen", default="127.0.0.1:7400", help="HOST:PORT (port 0: any free)")
    auth = p.add_mutually_exclusive_group(required=True)
    auth.add_argument(
        "--tokens-file",
        type=Path,
        help="bearer tokens: 'TOKEN SCOPES [NAME] [nodes=NODE,...]' lines, scopes from read, "
        "report, write, rollout (re-read when the file changes)",
    )
    auth.add_argument(
        "--no-auth", action="store_true", help="accept every call (local development only)"
    )
    p.add_argument(
        "--sa-jwks-file",
        type=Path,
        help="JWKS of the cluster's service-account issuer: node agents then authenticate "
        "with their pod's projected ServiceAccount token (re-read when the file changes)",
    )
    p.add_argument("--sa-issuer", help="the ServiceAccount tokens' issuer (iss)")
    p.add_argument(
        "--sa-audience", default=DEFAULT_AUDIENCE, help="the audience the tokens must carry"
    )
    p.add_argument(
        "--sa-allow",
        action="append",
        default=[],
        metavar="NAMESPACE:SERVICEACCOUNT",
        help="a service account whose tokens are node credentials (read,report bound to the "
        "token's node); repeatable, at least one with --sa-jwks-file",
    )
    p.add_argument(
        "--sa-max-lifetime",
        type=positive_float,
        default=DEFAULT_MAX_LIFETIME_S,
        help="seconds a ServiceAccount token may be valid for in all (exp - iat)",
    )
    p.add_argument(
        "--node-cert-suffix",
        help="with --tls-client-ca: a client certificate with a SAN '<node><suffix>' is a "
        f"node credential (read,report for that node), e.g. {DEFAULT_CERT_SAN_SUFFIX}",
    )
    p.add_argument(
        "--audit-limit",
        type=int,
        default=AUDIT_LIMIT,
        help="audit rows kept (the newest)",
    )
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates from this CA")
    p.add_argument(
        "--interval",
        type=positive_float,
        default=5.0,
        help="seconds between rebalancing rounds (each scrapes every worker once)",
    )
    p.add_argument(
        "--scrape-timeout",
        type=float,
        default=2.0,
        help="seconds one worker's /metrics scrape may take",
    )
    p.add_argument("--prometheus-url", help="read load from this Prometheus HTTP API instead")
    p.add_argument(
        "--synchronous",
        default="FULL",
        choices=["NORMAL", "FULL", "EXTRA"],
        help="SQLite synchronous mode (FULL: acknowledged writes survive a power cut)",
    )
    p.add_argument(
        "--min-weight",
        type=int,
        default=_DEFAULTS.min_weight,
        help=f"least weight every active shard keeps, in parts of {_DEFAULTS.budget}",
    )
    p.add_argument(
        "--max-step",
        type=int,
        default=_DEFAULTS.max_step,
        help=f"most weight one shard may gain or lose per round, in parts of {_DEFAULTS.budget}",
    )
    p.add_argument(
        "--publish-threshold",
        type=int,
        default=_DEFAULTS.publish_threshold,
        help="weight parts that must move before a rebalance publishes a new Assignment",
    )
    p.add_argument(
        "--ewma-alpha",
        type=float,
        default=_DEFAULTS.ewma_alpha,
        help="smoothing of each round's load observations, in (0, 1] (1: no smoothing)",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="serve Prometheus /metrics on this port, on the --listen host (0: off)",
    )
    p.add_argument(
        "--no-rebalance",
        action="store_true",
        help="serve the API only (no rebalancing, rollout or placement loop)",
    )
    p.add_argument(
        "--worker-admin-token-file",
        type=Path,
        default=None,
        help="file holding the token the placement loop sends to the workers' load endpoint "
        "(the workers' --admin-token-file; none: send no token)",
    )
    p.add_argument(
        "--auto-placement",
        action="store_true",
        help="give every AdapterInstance without placement.shards a home shard (rendezvous "
        "hash weighted by the shards' adapter slots): its requests are forwarded there and it "
        "is preloaded on placement.replicas workers (1 by default) of it",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (DEBUG adds one line per worker scrape)",
    )
    return p


async def _serve(config: ServerConfig) -> None:
    server = ControlPlaneServer(config)
    port = await server.start()
    host = server.config.listen.rsplit(":", 1)[0]
    print(f"listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        policy = PolicyConfig(
            min_weight=args.min_weight,
            max_step=args.max_step,
            publish_threshold=args.publish_threshold,
            ewma_alpha=args.ewma_alpha,
        )
        policy.validate()
    except ValueError as exc:
        parser.error(str(exc))
    if args.audit_limit < 1:
        parser.error(f"--audit-limit: {args.audit_limit} must be at least 1")
    try:
        tokens = TokenFile(args.tokens_file) if args.tokens_file else None
    except (OSError, AuthError) as exc:
        print(f"adaptermesh control-plane: tokens file: {exc}", file=sys.stderr)
        return 1
    service_accounts = None
    if args.sa_jwks_file is not None or args.sa_issuer or args.sa_allow:
        if args.sa_jwks_file is None or not args.sa_issuer or not args.sa_allow:
            parser.error("--sa-jwks-file, --sa-issuer and --sa-allow go together")
        try:
            service_accounts = ServiceAccountPolicy(
                issuer=args.sa_issuer,
                allowed=parse_allowed(args.sa_allow),
                audience=args.sa_audience,
                max_lifetime_s=args.sa_max_lifetime,
            )
            service_accounts.validate()
        except AuthError as exc:
            parser.error(str(exc))
    worker_token: str | None = None
    if args.worker_admin_token_file is not None:
        try:
            worker_token = read_secret(args.worker_admin_token_file, "--worker-admin-token-file")
        except ValueError as exc:
            print(f"adaptermesh control-plane: {exc}", file=sys.stderr)
            return 1
    config = ServerConfig(
        state_dir=args.state_dir,
        listen=args.listen,
        tokens=tokens,
        sa_jwks=args.sa_jwks_file,
        service_accounts=service_accounts,
        node_cert_suffix=args.node_cert_suffix,
        audit_limit=args.audit_limit,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        interval_s=args.interval,
        scrape_timeout_s=args.scrape_timeout,
        prometheus_url=args.prometheus_url,
        synchronous=args.synchronous,
        rebalance=not args.no_rebalance,
        metrics_port=args.metrics_port,
        policy=policy,
        worker_admin_token=worker_token,
        auto_placement=args.auto_placement,
    )
    try:
        asyncio.run(_serve(config))
    except (OSError, ValueError, RuntimeError) as exc:  # AuthError: a JWKS that cannot be used
        print(f"adaptermesh control-plane: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
