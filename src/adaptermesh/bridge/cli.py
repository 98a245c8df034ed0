"""``adaptermesh mqtt-bridge``: answer OpenAI requests from an MQTT topic through the mesh.

    adaptermesh mqtt-bridge --broker HOST:PORT --request-topic TOPIC --base-url URL \
        --state-dir DIR [--max-in-flight 16] [--metrics-port 9100]

Prints ``subscribed to TOPIC on HOST:PORT`` once it takes requests, and stops on SIGTERM or
SIGINT after running requests finish (``--drain-seconds``); requests it did not finish are
kept in the state directory and run at the next start. Exit codes: 0 after a clean stop, 1
when it cannot start (state directory unusable, metrics port in use), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from adaptermesh.bridge.mqtt import Bridge, BridgeConfig
from adaptermesh.cliargs import port, positive_float, positive_int
from adaptermesh.clisetup import DefaultsHelpFormatter

__all__ = ["build_parser", "main"]

_DEFAULTS = BridgeConfig("", 0, "x", "", Path())


def _broker(text: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    value = port(port_text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 is not a broker port (1..65535)")
    return host.strip("[]"), value


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="adaptermesh mqtt-bridge",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--broker", type=_broker, required=True, help="MQTT broker HOST:PORT (MQTT v5)")
    p.add_argument(
        "--request-topic",
        required=True,
        help="topic filter to take requests from (wildcards allowed; $share/... too)",
    )
    p.add_argument(
        "--base-url",
        required=True,
        help="the mesh's HTTP entry, e.g. http://envoy:8080 (an Envoy listener or a worker)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="directory for the SQLite request store (keep it on a persistent volume)",
    )
    p.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=d.max_in_flight,
        help="requests submitted to the mesh at once",
    )
    p.add_argument(
        "--receive-maximum",
        type=positive_int,
        default=0,
        help="unacknowledged requests the broker may send ahead (default: --max-in-flight)",
    )
    p.add_argument(
        "--client-id",
        default=d.client_id,
        help="MQTT client id; the broker keeps this id's session while the bridge is down",
    )
    p.add_argument(
        "--session-expiry",
        type=positive_int,
        default=d.session_expiry_s,
        help="seconds the broker keeps the session (queued requests) while disconnected",
    )
    p.add_argument(
        "--keepalive", type=positive_int, default=d.keepalive_s, help="MQTT keepalive seconds"
    )
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        default=d.request_timeout_s,
        help="seconds one HTTP attempt to the mesh may take",
    )
    p.add_argument(
        "--max-attempts",
        type=positive_int,
        default=d.max_attempts,
        help="HTTP attempts per request on 429/502/503/504 or connection errors",
    )
    p.add_argument(
        "--max-payload",
        type=positive_int,
        default=d.max_payload_bytes,
        help="largest request message in bytes",
    )
    p.add_argument(
        "--retention",
        type=positive_float,
        default=d.retention_s,
        help="seconds a published answer is kept to recognise a redelivered id",
    )
    p.add_argument(
        "--drain-seconds",
        type=positive_float,
        default=d.drain_s,
        help="on stop, how long running requests may take to finish",
    )
    p.add_argument("--username", help="broker user name")
    p.add_argument("--password-file", type=Path, help="file holding the broker password")
    p.add_argument(
        "--synchronous",
        default="FULL",
        choices=["NORMAL", "FULL", "EXTRA"],
        help="SQLite synchronous mode (FULL: an acknowledged request survives a power cut)",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="serve Prometheus /metrics on this port (0: off)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port")
    p.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR: the least severe lines written",
    )
    return p


async def _serve(bridge: Bridge) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await bridge.run(stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    password = None
    if args.password_file is not None:
        try:
            password = args.password_file.read_text().strip()
        except OSError as exc:
            print(f"mqtt-bridge: cannot read --password-file: {exc}", file=sys.stderr)
            return 1
    host, port = args.broker
    try:
        config = BridgeConfig(
            broker_host=host,
            broker_port=port,
            request_topic=args.request_topic,
            base_url=args.base_url,
            state_dir=args.state_dir,
            max_in_flight=args.max_in_flight,
            receive_maximum=args.receive_maximum,
            client_id=args.client_id,
            session_expiry_s=args.session_expiry,
            keepalive_s=args.keepalive,
            request_timeout_s=args.request_timeout,
            max_attempts=args.max_attempts,
            max_payload_bytes=args.max_payload,
            retention_s=args.retention,
            drain_s=args.drain_seconds,
            username=args.username,
            password=password,
            synchronous=args.synchronous,
        )
    except ValueError as exc:
        print(f"mqtt-bridge: {exc}", file=sys.stderr)
        return 2

    def ready() -> None:
        print(f"subscribed to {args.request_topic} on {host}:{port}", flush=True)

    try:
        bridge = Bridge(config, on_ready=ready)
    except (OSError, RuntimeError) as exc:  # sqlite3 errors are neither: caught below
        print(f"mqtt-bridge: cannot open the state directory: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"mqtt-bridge: cannot start: {exc}", file=sys.stderr)
        return 1
    if args.metrics_port:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        registry.register(bridge.collector())
        try:
            start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
        except OSError as exc:
            print(f"mqtt-bridge: cannot serve metrics: {exc}", file=sys.stderr)
            return 1
    asyncio.run(_serve(bridge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
