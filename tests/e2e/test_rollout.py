"""Gray release of an adapter version on the local mesh: tenant -> classifier -> Envoy -> the
agent's ext_proc (the version split) -> CPU workers serving both versions side by side, with
the control plane's rollout controller judging the new version from the workers' metrics.

One rollout promotes step by step to 100%; at every step the observed split over fresh
sessions matches the share within binomial error, sessions are sticky, and no request fails.
Another rolls back on an error rate injected into the new version, with the reason recorded,
and no request fails but the injected ones.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from waiting import wait_until

from adaptermesh.proto import control_plane_pb2
from adaptermesh_testkit.localmesh import SERVICE_PORT, LocalMesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.slow]

S = control_plane_pb2
PROMPT = "The quick brown fox"
SESSIONS_PER_STEP = 60


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    m = LocalMesh(
        MeshConfig(
            prefix=f"amr{secrets.token_hex(2)}",
            shards=1,
            workers_per_shard=2,
            tenants=2,
            adapters=("credit-risk", "fraud"),
            extra_adapters=("credit-risk@2.0.0", "fraud@3.0.0"),
            interval_s=2.0,
            report_interval_s=0.5,
            max_running=8,
            ext_proc=True,
        ),
        progress=lambda msg: print(f"[e2e] {msg}", flush=True),
    )
    try:
        m.start()
        yield m
    finally:
        m.stop()


def _post(source: str, base: str, adapter: str, session: str) -> tuple[int, str, str]:
    """(status, served model or error code, body head) of one completion."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as client:
        r = client.post(
            f"{base}/v1/completions",
            json={"model": adapter, "prompt": PROMPT, "max_tokens": 1},
            headers={"x-session-id": session},
        )
    if r.status_code == 200:
        return 200, str(r.json()["model"]), ""
    try:
        code = str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = ""
    return r.status_code, code, r.text[:200]


class Client:
    """Sends completions from the tenant namespace, each session on its own request."""

    def __init__(self, mesh: LocalMesh) -> None:
        self.mesh = mesh
        self.base = f"http://{mesh.vip}:{SERVICE_PORT}"
        self.pool = mesh.ns.pool(mesh.tenant_ns)

    def many(self, adapter: str, sessions: list[str]) -> list[tuple[int, str, str]]:
        """In waves of 8: within the workers' tenant queues, so nothing is refused for load."""
        src = self.mesh.tenants
        out: list[tuple[int, str, str]] = []
        for start in range(0, len(sessions), 8):
            wave = sessions[start : start + 8]
            futures = [
                self.pool.submit(_post, src[(start + i) % len(src)], self.base, adapter, s)
                for i, s in enumerate(wave)
            ]
            out += [f.result() for f in futures]
        return out


class Background:
    """Steady traffic with fresh sessions until stopped; keeps every answer."""

    def __init__(self, client: Client, adapter: str) -> None:
        self.client = client
        self.adapter = adapter
        self.answers: list[tuple[int, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            batch = [f"bg-{self.adapter}-{n + i}" for i in range(2)]
            n += 2
            self.answers.extend(self.client.many(self.adapter, batch))
            self._stop.wait(0.1)  # a steady trickle, leaving the CPU to the measured waves

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _rollout(mesh: LocalMesh, adapter: str) -> Any:
    resp = mesh.cp.ListRollouts(
        S.ListRolloutsRequest(adapter=adapter, history=True), metadata=mesh._md(), timeout=5
    )
    return resp.rollouts[-1]


def _applied_split(mesh: LocalMesh, adapter: str) -> tuple[str, str, int] | None:
    """The split of the Assignment the agent applied (waits for it to apply the newest)."""
    a = mesh.cp.GetAssignment(S.GetAssignmentRequest(), metadata=mesh._md(), timeout=5)
    mesh.wait_agent_applied(a.version)
    for s in a.adapter_splits:
        if s.adapter == adapter:
            return s.stable_version, s.canary_version, s.canary_share
    return None


def _binomial_ok(hits: int, n: int, p: float) -> bool:
    if p in (0.0, 1.0):
        return hits == n * p
    return abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_a_rollout_promotes_to_100_percent_with_the_split_right_at_every_step(mesh: LocalMesh):
    client = Client(mesh)
    assert {a[1] for a in client.many("credit-risk", ["warm-0", "warm-1"])} == {"credit-risk"}
    start = (
        "rollout",
        "credit-risk",
        "--to",
        "2.0.0",
        "--steps",
        "20,50,100",
        "--interval",
        "5s",
        "--max-error-rate",
        "1%",
        "--max-p95-ttft",
        "60s",
        "--min-requests",
        "3",
        "--reason",
        "e2e promote",
    )
    # Refused (FAILED_PRECONDITION) until a worker's scrape shows the adapter just served.
    out = wait_until(
        lambda: (r := mesh.adapterctl(*start, check=False)).returncode == 0 and r,
        timeout=30,
        interval=1.0,
    )
    assert "started at 20%" in out.stdout
    failures: list[tuple[int, str, str]] = []
    observed: list[tuple[int, int]] = []
    with Background(client, "credit-risk") as bg:
        last = 0
        while True:
            # Catch each step: pause it, then measure the split the agent applied for it.
            wait_until(
                lambda last=last: (
                    _rollout(mesh, "credit-risk").share > last
                    or _rollout(mesh, "credit-risk").state == S.ROLLOUT_STATE_COMPLETED
                ),
                90,
                0.1,
                what=f"a step above {last}",
            )
            mesh.adapterctl("rollout", "pause", "credit-risk", check=False)
            r = _rollout(mesh, "credit-risk")
            if r.state == S.ROLLOUT_STATE_COMPLETED:
                break
            assert r.state == S.ROLLOUT_STATE_PAUSED
            share = last = r.share
            assert _applied_split(mesh, "credit-risk") == ("", "2.0.0", share)
            sessions = [f"step{share}-{i}" for i in range(SESSIONS_PER_STEP)]
            answers = client.many("credit-risk", sessions)
            failures += [a for a in answers if a[0] != 200]
            assert {a[1] for a in answers} <= {"credit-risk", "credit-risk@2.0.0"}
            hits = sum(a[1] == "credit-risk@2.0.0" for a in answers)
            observed.append((share, hits))
            assert _binomial_ok(hits, len(sessions), share / 10_000), (share, hits)
            # Sticky: the same sessions again, the same versions.
            again = client.many("credit-risk", sessions[:8])
            assert [a[1] for a in again] == [a[1] for a in answers[:8]]
            mesh.adapterctl("rollout", "resume", "credit-risk")
        failures += [a for a in bg.answers if a[0] != 200]
    # Every step but possibly the last (which may complete before it can be paused).
    assert [sh for sh, _ in observed][:2] == [2000, 5000], observed
    print(
        f"\n[e2e] promote: (share, canary of {SESSIONS_PER_STEP}) {observed}, "
        f"background {len(bg.answers)}"
    )
    assert not failures, failures[:5]
    assert _applied_split(mesh, "credit-risk") == ("2.0.0", "", 0)
    done = client.many("credit-risk", [f"after-{i}" for i in range(20)])
    assert {a[1] for a in done} == {"credit-risk@2.0.0"}
    r = _rollout(mesh, "credit-risk")
    kinds = [e.kind for e in r.events]
    assert kinds[0] == "start"
    assert kinds[-1] == "complete"
    assert kinds.count("advance") == 2
    status = mesh.adapterctl("status").stdout
    assert "credit-risk" in status
    assert "COMPLETED" in status
    history = mesh.adapterctl("history", "--limit", "50").stdout
    assert "rollout credit-risk" in history


def test_a_rollout_rolls_back_on_an_injected_error_rate(mesh: LocalMesh):
    client = Client(mesh)
    for shard_id in mesh.shard_ids:
        for j in range(mesh.config.workers_per_shard):
            assert (
                mesh.worker_post(
                    shard_id, j, "/v1/admin/faults", {"adapter": "fraud@3.0.0", "error_rate": 0.5}
                )
                == 200
            )
    start = (
        "rollout",
        "fraud",
        "--to",
        "3.0.0",
        "--steps",
        "20,100",
        "--interval",
        "1h",
        "--max-error-rate",
        "5%",
        "--min-requests",
        "6",
    )
    try:
        # A rollout needs an adapter the mesh knows: serve fraud once, so that a worker's next
        # scrape shows it, then start (refused with FAILED_PRECONDITION until then).
        client.many("fraud", ["warm-fraud"])
        wait_until(
            lambda: mesh.adapterctl(*start, check=False).returncode == 0, timeout=30, interval=1.0
        )
        with Background(client, "fraud") as bg:
            wait_until(
                lambda: _rollout(mesh, "fraud").state == S.ROLLOUT_STATE_ROLLED_BACK,
                90,
                0.2,
                what="rollback",
            )
            rolled = time.monotonic()
            assert _applied_split(mesh, "fraud") is None  # unversioned again: no split
            applied = time.monotonic()
            mark = len(bg.answers)
            wait_until(lambda: len(bg.answers) >= mark + 20, 60, 0.1, what="traffic after")
        r = _rollout(mesh, "fraud")
        assert "error rate" in r.reason, r.reason
        assert "> 5.0%" in r.reason, r.reason
        assert r.events[-1].kind == "rollback"
        assert r.events[-1].reason == r.reason
        # Every failure is an injected fault of the new version; none after the rollback.
        failed = [a for a in bg.answers if a[0] != 200]
        assert failed, "the injected faults never reached a client"
        assert all(a[:2] == (500, "injected_fault") for a in failed), failed[:5]
        after = bg.answers[mark:]
        assert all(a[0] == 200 and a[1] == "fraud" for a in after), after[:5]
        print(
            f"\n[e2e] rollback: {r.reason}; {len(failed)} injected of {len(bg.answers)}; "
            f"applied {applied - rolled:.3f}s after the rollback was seen"
        )
    finally:
        for shard_id in mesh.shard_ids:
            for j in range(mesh.config.workers_per_shard):
                mesh.worker_post(
                    shard_id, j, "/v1/admin/faults", {"adapter": "fraud@3.0.0", "error_rate": 0}
                )


def test_bad_rollouts_are_refused_by_adapterctl_naming_the_field(mesh: LocalMesh):
    bad = mesh.adapterctl(
        "rollout", "credit-risk", "--to", "9", "--steps", "50,20,100", check=False
    )
    assert bad.returncode == 2
    assert "steps_percent[1]" in bad.stdout + bad.stderr
    bad = mesh.adapterctl("rollout", "credit-risk", "--to", "9", "--interval", "soon", check=False)
    assert bad.returncode == 2
    assert "--interval" in bad.stdout + bad.stderr
