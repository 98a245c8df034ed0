"""What the bridge tests (and bench/bench_mqtt_bridge.py) run against: a real mosquitto broker
on a free port with persistence in a temp dir, a fake OpenAI-compatible mesh that counts its
concurrency, and MQTT clients that publish requests and collect replies."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from aiohttp import web
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

MOSQUITTO = "/usr/sbin/mosquitto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Mosquitto:
    """A broker process; ``restart`` keeps its port and its persisted state."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {workdir}/\n"
            "autosave_interval 1\n"
            "set_tcp_nodelay true\n"
            "max_queued_messages 100000\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.workdir / "mosquitto.log").open("ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mosquitto did not start: {(self.workdir / 'mosquitto.log').read_text()}"
                )
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@dataclass
class FakeMesh:
    """An OpenAI-compatible HTTP server. Every answer carries a fresh ``nonce``, so two
    calls for one request give two different answers: a reply published from a second call
    shows up as a second distinct answer. ``script[prompt]`` lists statuses to return before
    answering (e.g. [503, 503] then 200); ``delay`` is seconds per call."""

    delay: float = 0.0
    script: dict[str, list[int]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    current: int = 0
    peak: int = 0
    total: int = 0
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if prompt is None:
            prompt = json.dumps(body.get("messages"))
        if body.get("model") == "missing-adapter":
            return web.json_response(
                {
                    "error": {
                        "message": "model 'missing-adapter' is not loaded",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status=404,
            )
        self.current += 1
        self.peak = max(self.peak, self.current)
        self.total += 1
        self.calls[str(prompt)] += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            statuses = self.script.get(str(prompt))
            if statuses:
                status = statuses.pop(0)
                return web.json_response(
                    {"error": {"message": "busy", "type": "overloaded"}},
                    status=status,
                    headers={"Retry-After": "0"},
                )
            return web.json_response(
                {
                    "id": "cmpl-" + uuid.uuid4().hex[:8],
                    "object": "text_completion"
                    if request.path.endswith("/completions") and "chat" not in request.path
                    else "chat.completion",
                    "model": body.get("model"),
                    "nonce": uuid.uuid4().hex,
                    "choices": [{"index": 0, "text": f"echo:{prompt}", "finish_reason": "length"}],
                }
            )
        finally:
            self.current -= 1

    def start(self) -> FakeMesh:
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_post("/v1/completions", self._handle)
            app.router.add_post("/v1/chat/completions", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=main, daemon=True, name="fake-mesh")
        self._thread.start()
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def mqtt_client(port: int, client_id: str = "") -> paho.Client:
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id or uuid.uuid4().hex,
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    connected = threading.Event()

    def on_connect(c: paho.Client, u: Any, f: Any, rc: Any, p: Any) -> None:
        sock = c.socket()
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connected.set()

    client.on_connect = on_connect
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(10), "no connection to the broker"
    return client


@dataclass
class Reply:
    topic: str
    doc: dict[str, Any]
    raw: bytes
    correlation_data: bytes | None


class Replies:
    """Collects every message on ``topic_filter`` (QoS 1) from one client."""

    def __init__(self, port: int, topic_filter: str = "replies/#") -> None:
        self.items: list[Reply] = []
        self._lock = threading.Lock()
        self.client = mqtt_client(port)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda c, u, mid, rc, p: subscribed.set()
        self.client.subscribe(topic_filter, qos=1)
        assert subscribed.wait(10)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        cdata = getattr(msg.properties, "CorrelationData", None)
        try:
            doc = json.loads(msg.payload)
        except ValueError:  # a request seen by a "#" subscription
            doc = None
        with self._lock:
            self.items.append(
                Reply(msg.topic, doc if isinstance(doc, dict) else {}, bytes(msg.payload), cdata)
            )

    def snapshot(self) -> list[Reply]:
        with self._lock:
            return list(self.items)

    def by_id(self) -> dict[Any, list[Reply]]:
        out: dict[Any, list[Reply]] = {}
        for r in self.snapshot():
            out.setdefault(r.doc.get("id"), []).append(r)
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish(
    client: paho.Client,
    topic: str,
    payload: bytes | str | dict[str, Any],
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
) -> None:
    if isinstance(payload, dict):
        payload = json.dumps(payload)
    props = None
    if response_topic is not None or correlation_data is not None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if correlation_data is not None:
            props.CorrelationData = correlation_data
    info = client.publish(topic, payload, qos=1, properties=props)
    info.wait_for_publish(10)


def request(
    req_id: str, prompt: str | None = None, reply_to: str = "replies/t", **extra: Any
) -> dict[str, Any]:
    return {
        "id": req_id,
        "reply_to": reply_to,
        "endpoint": "completions",
        "body": {"model": "base", "prompt": prompt or f"p-{req_id}", "max_tokens": 4},
        **extra,
    }


@contextmanager
def running_broker(workdir: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(workdir)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
