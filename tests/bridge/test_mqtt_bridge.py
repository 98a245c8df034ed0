"""The MQTT bridge against a real mosquitto broker and a fake OpenAI-compatible mesh."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import wait_until

from adaptermesh.bridge.protocol import (
    FIELDS,
    Invalid,
    Request,
    error_reply,
    parse_request,
    valid_reply_topic,
)
from adaptermesh.bridge.store import Store

from .conftest import RunningBridge
from .support import FakeMesh, Replies, publish, request

StartBridge = Callable[..., RunningBridge]


def _one(replies: Replies, req_id: str, timeout: float = 10.0) -> dict[str, Any]:
    got = wait_until(lambda: replies.by_id().get(req_id), timeout, what=f"a reply to {req_id}")
    return got[0].doc


def test_request_reply_both_endpoints(
    start_bridge: StartBridge, client: Any, replies: Replies
) -> None:
    start_bridge()
    publish(client, "requests/a", request("r1", correlation={"trace": 7}))
    chat = {
        "id": "r2",
        "reply_to": "replies/chat",
        "endpoint": "chat.completions",
        "body": {"model": "sql", "messages": [{"role": "user", "content": "hi"}]},
    }
    publish(client, "requests/a", chat)
    doc = _one(replies, "r1")
    assert doc["ok"] is True
    assert doc["status"] == 200
    assert doc["endpoint"] == "completions"
    assert doc["correlation"] == {"trace": 7}
    assert doc["response"]["choices"][0]["text"] == "echo:p-r1"
    doc2 = _one(replies, "r2")
    assert doc2["endpoint"] == "chat.completions"
    assert doc2["response"]["object"] == "chat.completion"
    assert [r.topic for r in replies.by_id()["r2"]] == ["replies/chat"]


def test_mqtt5_response_topic_and_correlation_data(
    start_bridge: StartBridge, client: Any, replies: Replies
) -> None:
    start_bridge()
    req = request("r1")
    del req["reply_to"]
    publish(client, "requests/x", req, response_topic="replies/v5", correlation_data=b"\x00c1")
    wait_until(lambda: replies.by_id().get("r1"), 10)
    (reply,) = replies.by_id()["r1"]
    assert reply.topic == "replies/v5"
    assert reply.correlation_data == b"\x00c1"
    assert reply.doc["ok"] is True


def test_redelivered_id_is_answered_once(
    start_bridge: StartBridge, client: Any, replies: Replies, mesh: FakeMesh
) -> None:
    rb = start_bridge()
    for _ in range(3):  # back to back: the copies arrive while the first is in flight
        publish(client, "requests/a", request("dup"))
    _one(replies, "dup")
    publish(client, "requests/a", request("dup"))  # after it was answered and published
    publish(client, "requests/a", request("after"))
    _one(replies, "after")
    assert len(replies.by_id()["dup"]) == 1
    assert mesh.calls["p-dup"] == 1
    assert rb.bridge.stats.duplicates == 3


def test_an_id_reused_for_another_request_is_a_conflict(
    start_bridge: StartBridge, client: Any, replies: Replies
) -> None:
    start_bridge()
    publish(client, "requests/a", request("k", prompt="one"))
    first = _one(replies, "k")
    publish(client, "requests/a", request("k", prompt="two"))
    wait_until(lambda: len(replies.by_id()["k"]) == 2, 10)
    second = replies.by_id()["k"][1].doc
    assert first["ok"] is True
    assert second["ok"] is False
    assert second["status"] == 409
    assert second["error"]["type"] == "conflict"
    assert second["error"]["field"] == "id"


INVALID = [
    (b"not json", "$"),
    (b"[1, 2]", "$"),
    (b"\xff\xfe", "$"),
    (json.dumps({"reply_to": "replies/t", "endpoint": "completions", "body": {}}), "id"),
    (json.dumps({**request("x"), "id": 5}), "id"),
    (json.dumps({**request("x"), "bdy": {}}), "bdy"),
    (json.dumps({**request("x"), "endpoint": "embeddings"}), "endpoint"),
    (json.dumps({k: v for k, v in request("x").items() if k != "body"}), "body"),
    (json.dumps({**request("x"), "body": "prompt"}), "body"),
    (json.dumps({**request("x"), "body": {"prompt": "a", "stream": True}}), "body.stream"),
    (json.dumps({**request("x"), "reply_to": "replies/#"}), "reply_to"),
    # A broker closes the connection on a topic with a control character (mosquitto does).
    (json.dumps({**request("x"), "reply_to": "replies/\u0001"}), "reply_to"),
    (json.dumps({**request("x"), "reply_to": "replies/\ufffe"}), "reply_to"),
]


@pytest.mark.parametrize(("payload", "field"), INVALID)
def test_invalid_request_gets_an_error_naming_the_field(
    start_bridge: StartBridge, client: Any, replies: Replies, payload: bytes | str, field: str
) -> None:
    rb = start_bridge()
    # The Response Topic property addresses the error when the payload cannot.
    publish(client, "requests/a", payload, response_topic="replies/errors", correlation_data=b"bad")
    got = wait_until(lambda: replies.snapshot(), 10, what="an error reply")
    (reply,) = got
    assert reply.correlation_data == b"bad"
    assert reply.doc["ok"] is False
    assert reply.doc["status"] == 400
    assert reply.doc["error"]["type"] == "invalid_request"
    assert reply.doc["error"]["field"] == field
    # Acknowledged, never retried, and the bridge carries on.
    publish(client, "requests/a", request("ok"))
    assert _one(replies, "ok")["ok"] is True
    assert rb.bridge.stats.invalid == 1
    assert len(replies.snapshot()) == 2


def test_a_reply_topic_that_loops_back_gets_no_reply(
    start_bridge: StartBridge, client: Any, replies: Replies
) -> None:
    rb = start_bridge()
    publish(client, "requests/a", request("loop", reply_to="requests/echo"))
    publish(client, "requests/a", request("ok"))
    _one(replies, "ok")
    wait_until(lambda: rb.bridge.stats.unanswerable == 1, 5)
    assert rb.bridge.stats.received == 2  # its own error reply never came back


def test_mesh_4xx_is_an_error_reply(
    start_bridge: StartBridge, client: Any, replies: Replies, mesh: FakeMesh
) -> None:
    start_bridge()
    req = request("m")
    req["body"]["model"] = "missing-adapter"
    publish(client, "requests/a", req)
    doc = _one(replies, "m")
    assert doc["ok"] is False
    assert doc["status"] == 404
    assert doc["error"] == {
        "type": "mesh_error",
        "field": "body.model",
        "message": "model 'missing-adapter' is not loaded",
    }
    assert doc["response"]["error"]["code"] == "model_not_found"


def test_busy_mesh_is_retried_with_backoff(
    start_bridge: StartBridge, client: Any, replies: Replies, mesh: FakeMesh
) -> None:
    mesh.script["p-busy"] = [503, 429, 503]
    mesh.script["p-down"] = [503] * 10
    start_bridge(max_attempts=4)
    publish(client, "requests/a", request("busy"))
    publish(client, "requests/a", request("down"))
    doc = _one(replies, "busy")
    assert doc["ok"] is True
    assert mesh.calls["p-busy"] == 4
    down = _one(replies, "down")
    assert down["ok"] is False
    assert down["status"] == 503
    assert down["error"]["type"] == "mesh_unavailable"
    assert mesh.calls["p-down"] == 4


def test_mesh_unreachable_is_bounded(
    start_bridge: StartBridge, client: Any, replies: Replies
) -> None:
    from .support import free_port

    start_bridge(base_url=f"http://127.0.0.1:{free_port()}", max_attempts=3)
    publish(client, "requests/a", request("gone"))
    doc = _one(replies, "gone")
    assert doc["error"]["type"] == "mesh_unavailable"
    assert "ConnectError" in doc["error"]["message"]


def test_back_pressure_bounds_work_and_buffering(
    start_bridge: StartBridge, client: Any, replies: Replies, mesh: FakeMesh
) -> None:
    mesh.delay = 0.15
    rb = start_bridge(max_in_flight=3)
    n = 30
    for i in range(n):
        publish(client, "requests/a", request(f"bp{i}"))
    wait_until(lambda: len(replies.by_id()) == n, 30, what="every reply")
    assert mesh.peak == 3  # the bound is reached, never passed
    assert rb.bridge.stats.max_in_flight_seen == 3
    # The broker sent at most Receive Maximum (3) unacknowledged requests ahead: the rest
    # waited at the broker, not in the bridge.
    assert 1 <= rb.bridge.stats.max_waiting_seen <= 3


def test_restart_runs_unfinished_and_republishes_unconfirmed(
    start_bridge: StartBridge, replies: Replies, mesh: FakeMesh, tmp_path: Path
) -> None:
    store = Store(tmp_path / "state" / "bridge.sqlite3")
    unfinished = Request("u1", "replies/t", "completions", {"model": "b", "prompt": "p-u1"})
    store.accept(unfinished, 1.0)
    answered = Request("d1", "replies/t", "completions", {"model": "b", "prompt": "p-d1"})
    store.accept(answered, 1.0)
    store.complete("d1", b'{"id":"d1","ok":true,"stored":1}', 2.0)
    published = Request("p1", "replies/t", "completions", {"model": "b", "prompt": "p-p1"})
    store.accept(published, 1.0)
    store.complete("p1", b'{"id":"p1","ok":true}', 2.0)
    store.mark_published("p1", 3.0)
    store.close()
    rb = start_bridge()
    assert _one(replies, "u1")["ok"] is True
    assert _one(replies, "d1") == {"id": "d1", "ok": True, "stored": 1}
    wait_until(lambda: rb.bridge.store.counts()["published"] == 3, 5)
    assert "p1" not in replies.by_id()
    assert mesh.calls == {"p-u1": 1}
    assert rb.bridge.stats.recovered == 1


class BridgeProcess:
    """``adaptermesh mqtt-bridge`` as a subprocess, started and killed by the test."""

    def __init__(self, broker_port: int, base_url: str, state_dir: Path, log: Path) -> None:
        self.args = [
            sys.executable,
            "-m",
            "adaptermesh.bridge.cli",
            "--broker",
            f"127.0.0.1:{broker_port}",
            "--request-topic",
            "requests/#",
            "--base-url",
            base_url,
            "--state-dir",
            str(state_dir),
            "--max-in-flight",
            "8",
            "--client-id",
            "bridge-kill-test",
            "--log-level",
            "WARNING",
        ]
        self.log = log
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        with self.log.open("a") as err:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("subscribed to requests/#"), (line, self.log.read_text())

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.mark.slow
def test_kill_mid_load_every_request_gets_exactly_one_answer(
    broker: Any, mesh: FakeMesh, replies: Replies, client: Any, tmp_path: Path
) -> None:
    n = 200
    mesh.delay = 0.03
    bridge = BridgeProcess(broker.port, mesh.url, tmp_path / "state", tmp_path / "bridge.log")
    bridge.start()
    try:
        for i in range(n):
            publish(client, "requests/load", request(f"k{i:03d}"))
        kills = []
        for threshold in (40, 120):  # kill twice, each time with work in every stage
            wait_until(
                lambda t=threshold: len(replies.by_id()) >= t, 60, what=f"{threshold} answers"
            )
            bridge.kill()
            kills.append(len(replies.by_id()))
            bridge.start()
        wait_until(lambda: len(replies.by_id()) == n, 120, what="an answer for every request")
        assert bridge.stop() == 0
    finally:
        if bridge.proc is not None and bridge.proc.poll() is None:
            bridge.proc.kill()
    by_id = replies.by_id()
    assert all(k < n for k in kills), kills  # both kills landed mid-load
    assert sorted(by_id) == [f"k{i:03d}" for i in range(n)]  # none lost
    distinct = {k: {r.raw for r in v} for k, v in by_id.items()}
    # Each mesh call answers with a fresh nonce: two distinct payloads would mean two
    # answers for one id.
    assert all(len(v) == 1 for v in distinct.values()), {
        k: len(v) for k, v in distinct.items() if len(v) > 1
    }
    assert all(r.doc["ok"] for v in by_id.values() for r in v)
    duplicates = sum(len(v) - 1 for v in by_id.values())
    reruns = sum(c - 1 for c in mesh.calls.values())
    print(
        f"kill test: {n} requests, killed at {kills} answers, {duplicates} duplicate "
        f"deliveries of a stored answer, {reruns} mesh calls repeated after a kill"
    )


# -- malformed messages (Hypothesis) --

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)
_topics = st.sampled_from(
    ["replies/t", "", "replies/+", "replies/#", "$SYS/x", "requests/x", "a\x00b", "x" * 70000]
) | st.text(max_size=10)
_valid = request("h1")


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """A request with some fields removed, replaced or added, or bytes that are not one."""
    kind = draw(st.sampled_from(["fields", "bytes", "json"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    doc: dict[str, Any] = json.loads(json.dumps(_valid))
    for key in draw(st.sets(st.sampled_from(sorted(doc)), max_size=3)):
        if draw(st.booleans()):
            del doc[key]
        else:
            doc[key] = draw(_topics if key == "reply_to" else _json)
    if draw(st.booleans()):
        doc["body"] = (
            {**doc.get("body", {}), "stream": draw(_json)}
            if isinstance(doc.get("body"), dict)
            else doc.get("body")
        )
    if draw(st.booleans()):
        doc[draw(st.text(max_size=6))] = draw(_json)
    return json.dumps(doc).encode()


def _loops(topic: str) -> bool:
    return topic.startswith("requests/")


@given(payload=_mutated(), response_topic=st.none() | _topics)
def test_parse_never_raises_and_names_a_field(payload: bytes, response_topic: str | None) -> None:
    got = parse_request(payload, loops_back=_loops, response_topic=response_topic)
    if isinstance(got, Request):
        # Only a request that really is one passes.
        doc = json.loads(payload)
        assert set(doc) <= set(FIELDS)
        assert got.id == doc["id"]
        assert isinstance(got.id, str)
        assert got.id
        assert got.endpoint in ("completions", "chat.completions")
        assert isinstance(got.body, dict)
        assert got.body.get("stream") in (None, False)
        assert valid_reply_topic(got.reply_to, _loops) is None
        return
    assert isinstance(got, Invalid)
    assert got.message
    try:
        doc = json.loads(payload)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        assert got.field in {*FIELDS, "body.stream", "$"} or got.field in doc
    else:
        assert got.field == "$"
    if got.reply_to is not None:
        assert valid_reply_topic(got.reply_to, _loops) is None
    reply = json.loads(
        error_reply(
            got.id,
            got.correlation,
            status=400,
            kind="invalid_request",
            message=got.message,
            field=got.field,
        )
    )
    assert reply["error"]["field"] == got.field
    assert reply["ok"] is False


@pytest.fixture(scope="module")
def shared_bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Replies]]:
    from adaptermesh.bridge.mqtt import BridgeConfig

    from .support import Mosquitto, mqtt_client

    root = tmp_path_factory.mktemp("hyp")
    broker = Mosquitto(root / "broker")
    broker.start()
    mesh = FakeMesh().start()
    replies = Replies(broker.port, "#")  # error replies may go to any topic the request named
    rb = RunningBridge(
        BridgeConfig(
            "127.0.0.1", broker.port, "requests/#", mesh.url, root / "state", client_id="bridge-hyp"
        )
    )
    client = mqtt_client(broker.port)
    yield client, replies
    client.disconnect()
    client.loop_stop()
    rb.stop()
    replies.close()
    mesh.stop()
    broker.stop()


@settings(max_examples=30, deadline=None)
@given(payload=_mutated())
def test_malformed_messages_through_the_broker(
    shared_bridge: tuple[Any, Replies], payload: bytes
) -> None:
    client, replies = shared_bridge
    expected = parse_request(payload, loops_back=_loops, response_topic="replies/hyp")
    tag = uuid.uuid4().hex.encode()
    before = len(replies.snapshot())
    publish(client, "requests/h", payload, response_topic="replies/hyp", correlation_data=tag)
    if isinstance(expected, Request):
        return  # a valid (or redelivered) request: answered or deduplicated, not an error
    got = wait_until(
        lambda: [
            r
            for r in replies.snapshot()[before:]
            if r.correlation_data == tag and not r.topic.startswith("requests/")
        ],
        10,
        what="the error reply",
    )
    (reply,) = got
    assert reply.doc["ok"] is False
    assert reply.doc["error"]["field"] == expected.field
    assert reply.topic == (expected.reply_to or "replies/hyp")


def test_metrics_count_requests(start_bridge: StartBridge, client: Any, replies: Replies) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    rb = start_bridge()
    registry = CollectorRegistry()
    registry.register(rb.bridge.collector())
    publish(client, "requests/a", request("m1"))
    publish(client, "requests/a", b"{}", response_topic="replies/errors")
    _one(replies, "m1")
    wait_until(lambda: rb.bridge.stats.published == 1 and rb.bridge.stats.invalid == 1, 5)
    text = generate_latest(registry).decode()
    assert "adaptermesh_bridge_received_total 2.0" in text
    assert "adaptermesh_bridge_invalid_total 1.0" in text
    assert "adaptermesh_bridge_published_total 1.0" in text
    assert 'adaptermesh_bridge_stored_requests{state="published"} 1.0' in text


def test_through_the_worker_service(
    broker: Any, replies: Replies, client: Any, tmp_path: Path
) -> None:
    """Against the real worker HTTP service (its validation and error shapes) around the
    service tests' fake engine."""
    from worker_service.fakes import FakeEngine
    from worker_service.threaded import threaded_service

    from adaptermesh.bridge.mqtt import BridgeConfig

    with threaded_service(FakeEngine) as url:
        rb = RunningBridge(
            BridgeConfig(
                "127.0.0.1",
                broker.port,
                "requests/#",
                url,
                tmp_path / "state",
                client_id="bridge-worker",
            )
        )
        try:
            publish(
                client,
                "requests/w",
                {
                    "id": "w1",
                    "reply_to": "replies/w",
                    "endpoint": "completions",
                    "body": {"model": "tiny-base", "prompt": "hello", "max_tokens": 3},
                },
            )
            publish(
                client,
                "requests/w",
                {
                    "id": "w2",
                    "reply_to": "replies/w",
                    "endpoint": "completions",
                    "body": {"model": "tiny-base", "prompt": "hello", "max_tokens": -1},
                },
            )
            ok = _one(replies, "w1")
            assert ok["ok"] is True
            assert ok["response"]["object"] == "text_completion"
            assert ok["response"]["usage"]["completion_tokens"] == 3
            bad = _one(replies, "w2")
            assert bad["ok"] is False
            assert 400 <= bad["status"] < 500  # the service's own status, passed through
            assert bad["error"]["type"] == "mesh_error"
            assert bad["error"]["field"] == "body.max_tokens"
        finally:
            rb.stop()
