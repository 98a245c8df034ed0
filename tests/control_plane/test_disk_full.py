"""The control plane's store on a full disk: a write fails with RESOURCE_EXHAUSTED naming the
cause, nothing acknowledged is lost, reads go on, and writes succeed again once space returns.

The disk fills two ways: SQLite's own size limit (``PRAGMA max_page_count``: the same
``SQLITE_FULL`` a full disk gives, deterministic and without root), and, in the ``root`` test,
a real 1 MiB tmpfs under the state directory filled to the last byte by another file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.control_plane.store import Store, StoreWriteError
from adaptermesh.proto import control_plane_pb2 as cp_pb2

from .conftest import RW_TOKEN, Harness, creds, shard, write_tokens
from .test_durability import Proc


def _fill(store: Store, spare_pages: int = 0) -> None:
    """Let the database grow by at most ``spare_pages`` more pages."""
    pages = int(store._db.execute("PRAGMA page_count").fetchone()[0])
    store._db.execute(f"PRAGMA max_page_count={pages + spare_pages}")


def _free(store: Store) -> None:
    store._db.execute("PRAGMA max_page_count=1073741823")


def _pin_until_full(store: Store, first_octet: int) -> None:
    """Pins until a write fails (the page in hand fills up too)."""
    for i in range(1, 4000):
        store.add_pin(f"{first_octet}.{i // 256}.{i % 256}.0/24", "s0", 2.0)


def _pins(store: Store) -> set[str]:
    return {cidr for cidr, _ in store.list_pins()}


def test_full_store_refuses_the_write_whole_and_recovers(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db", synchronous="NORMAL")
    store.add_pin("10.0.0.0/24", "s0", 1.0)
    _fill(store)
    with pytest.raises(StoreWriteError) as info:
        _pin_until_full(store, 10)
    assert info.value.full
    assert "out of space" in str(info.value)
    assert "database or disk is full" in str(info.value)
    assert str(tmp_path / "state.db") in str(info.value)
    acknowledged = _pins(store)
    assert "10.0.0.0/24" in acknowledged
    # Reads go on; a later write on the full store fails the same way and changes nothing.
    assert store.list_pins()
    with pytest.raises(StoreWriteError):
        _pin_until_full(store, 11)
    assert _pins(store) >= acknowledged
    _free(store)
    store.add_pin("12.0.0.0/24", "s1", 4.0)
    assert _pins(store) >= acknowledged | {"12.0.0.0/24"}
    # Nothing was left half-open: a reopened store sees the same rows.
    store.close()
    again = Store(tmp_path / "state.db")
    assert _pins(again) >= acknowledged | {"12.0.0.0/24"}
    again.close()


@settings(max_examples=40, deadline=None)
@given(
    spare=st.integers(min_value=0, max_value=6),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("pin"), st.integers(0, 4000)),
            st.tuples(st.just("unpin"), st.integers(0, 4000)),
            st.tuples(st.just("free"), st.just(0)),
            st.tuples(st.just("fill"), st.integers(0, 3)),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_acknowledged_writes_are_exactly_what_is_stored(
    tmp_path_factory: pytest.TempPathFactory, spare: int, ops: list[tuple[str, int]]
) -> None:
    """Whatever the order of writes, fills and frees: the store holds exactly the writes that
    returned, and every refused write is a StoreWriteError for a full store."""
    path = tmp_path_factory.mktemp("full") / "state.db"
    store = Store(path, synchronous="OFF")
    _fill(store, spare)
    model: set[str] = set()
    refusals: list[bool] = []
    for op, n in ops:
        cidr = f"10.{n // 256}.{n % 256}.0/24"
        if op == "free":
            _free(store)
        elif op == "fill":
            _fill(store, n)
        elif op == "pin" and cidr not in model:
            try:
                store.add_pin(cidr, "s0", 1.0)
                model.add(cidr)
            except StoreWriteError as exc:
                refusals.append(exc.full)
        elif op == "unpin":
            try:
                if store.remove_pin(cidr):
                    model.discard(cidr)
            except StoreWriteError as exc:
                refusals.append(exc.full)
        assert _pins(store) == model
    assert all(refusals)
    store.close()
    assert _pins(Store(path)) == model


async def test_api_write_on_a_full_store_is_resource_exhausted_and_reads_go_on(
    cp: Harness,
) -> None:
    store = cp.server.store
    await cp.stub.UpsertShard(
        cp_pb2.UpsertShardRequest(shard=shard("s0", ("10.0.0.1", 8000))), metadata=cp.md
    )
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.9.0.0/24", shard_id="s0"), metadata=cp.md
    )
    version = (await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)).version
    _fill(store)
    refused: list[grpc.aio.AioRpcError] = []
    acked = {"10.9.0.0/24"}
    for i in range(200):
        cidr = f"10.10.{i}.0/24"
        try:
            await cp.stub.PinTenant(
                cp_pb2.PinTenantRequest(cidr=cidr, shard_id="s0"), metadata=cp.md
            )
            acked.add(cidr)
        except grpc.aio.AioRpcError as exc:
            refused.append(exc)
            break
    assert len(refused) == 1
    assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of space" in (refused[0].details() or "")
    # Reads are served from the full store; the Assignment is the last acknowledged one.
    listed = await cp.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=cp.md)
    assert {p.cidr for p in listed.pins} == acked
    got = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert got.version == version + len(acked) - 1
    assert {p.cidr for p in got.pins} == acked
    # Space returns: the same write goes through and publishes.
    _free(store)
    await cp.stub.PinTenant(
        cp_pb2.PinTenantRequest(cidr="10.11.0.0/24", shard_id="s0"), metadata=cp.md
    )
    got = await cp.stub.GetAssignment(cp_pb2.GetAssignmentRequest(), metadata=cp.md)
    assert "10.11.0.0/24" in {p.cidr for p in got.pins}


# ---- a real full filesystem (root) ---------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a tmpfs)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill_disk(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s filesystem."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


@pytest.mark.root
@pytest.mark.slow
def test_control_plane_on_a_full_filesystem(small_fs: Path, tmp_path: Path) -> None:
    state = small_fs / "state"
    tokens = write_tokens(tmp_path / "tokens")
    md = creds(RW_TOKEN)
    proc = Proc(state, tokens)
    try:
        proc.stub.UpsertShard(
            cp_pb2.UpsertShardRequest(shard=shard("s0", ("10.0.0.1", 8000))), metadata=md
        )
        acked: set[str] = set()
        for i in range(5):
            cidr = f"10.1.{i}.0/24"
            proc.stub.PinTenant(cp_pb2.PinTenantRequest(cidr=cidr, shard_id="s0"), metadata=md)
            acked.add(cidr)
        filler = _fill_disk(small_fs)
        refused: list[grpc.RpcError] = []
        for i in range(5, 400):
            cidr = f"10.1.{i % 256}.{i // 256}/32"
            try:
                proc.stub.PinTenant(
                    cp_pb2.PinTenantRequest(cidr=cidr, shard_id="s0"), metadata=md, timeout=10
                )
                acked.add(cidr)
            except grpc.RpcError as exc:
                refused.append(exc)
                if len(refused) >= 3:
                    break
        assert refused, "the full filesystem refused no write"
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            assert "out of space" in (exc.details() or "")
        # Reads go on while the disk is full.
        listed = proc.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=md)
        assert {p.cidr for p in listed.pins} == acked
        assert proc.p.poll() is None
        # Space returns: writes succeed again.
        filler.unlink()
        proc.stub.PinTenant(
            cp_pb2.PinTenantRequest(cidr="10.2.0.0/24", shard_id="s0"), metadata=md, timeout=10
        )
        acked.add("10.2.0.0/24")
        proc.kill9()
        again = Proc(state, tokens)
        try:
            listed = again.stub.ListPins(cp_pb2.ListPinsRequest(), metadata=md)
            assert {p.cidr for p in listed.pins} == acked
        finally:
            again.stop()
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)
