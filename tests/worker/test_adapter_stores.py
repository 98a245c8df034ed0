"""Adapters from object storage and Hugging Face cache layouts, against a real S3 API server
(moto's server mode on 127.0.0.1) through boto3."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moto.server import ThreadedMotoServer

from adaptermesh.worker.adapter_stores import (
    AdapterSource,
    AdapterStoreError,
    AdapterStores,
    parse_s3_uri,
    parse_source,
)
from adaptermesh.worker.admin_endpoints import load_adapter_into_engine
from adaptermesh.worker.cli import LoraModule, build_parser, build_stores, load_lora_modules
from adaptermesh.worker.http_errors import ApiError, adapter_error
from adaptermesh.worker.peft_adapter import AdapterValidationError
from adaptermesh.worker.types import AdapterNotFoundError

from .conftest import PROMPTS, Tiny, collect, request, tokens

CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_url: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_url, **CREDENTIALS)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def upload(s3: Any, bucket: str, prefix: str, directory: Path, **extra: Any) -> None:
    for file in sorted(directory.iterdir()):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{file.name}", Body=file.read_bytes(), **extra)


class CountingClient:
    """A boto3 client whose ``get_object`` calls are counted (and their bodies optionally
    changed in transit by ``mangle``)."""

    def __init__(self, client: Any, mangle: Callable[[bytes], bytes] | None = None) -> None:
        self.client = client
        self.mangle = mangle
        self.gets = 0
        self.lock = threading.Lock()

    def list_objects_v2(self, **kw: Any) -> Any:
        return self.client.list_objects_v2(**kw)

    def get_object(self, **kw: Any) -> Any:
        with self.lock:
            self.gets += 1
        response = self.client.get_object(**kw)
        if self.mangle is not None:
            response["Body"] = _Body(self.mangle(response["Body"].read()))
        return response


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk

    def close(self) -> None:
        pass


def make_stores(s3_url: str, cache: Path, **kw: Any) -> tuple[AdapterStores, CountingClient]:
    counting = CountingClient(
        boto3.client("s3", endpoint_url=s3_url, **CREDENTIALS), kw.pop("mangle", None)
    )
    return AdapterStores(cache, client_factory=lambda: counting, **kw), counting


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


async def greedy(eng: Any, tiny: Tiny, adapter: str | None, rid: str = "r") -> list[int]:
    ids = tiny.encode(PROMPTS[1])
    return tokens(await collect(eng.submit(request(rid, ids, adapter, max_tokens=6))))


# ---- loading through lora_path, --lora-modules and the resolver --------------------------------


async def test_s3_lora_path_gives_the_same_tokens_as_the_directory(
    tiny: Tiny, make_engine: Any, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "adapters/alpha", tiny.root / "alpha")
    eng = make_engine()
    stores, counting = make_stores(s3_url, tmp_path / "cache")
    eng.adapters.stores = stores
    info = await eng.load_adapter("alpha-s3", f"s3://{bucket}/adapters/alpha")
    assert Path(info.path).is_relative_to(stores.cache_dir)
    assert await greedy(eng, tiny, "alpha-s3") == await greedy(eng, tiny, "alpha")
    assert counting.gets == 2  # adapter_config.json and adapter_model.safetensors
    # Loading it again lists the prefix and finds that version cached: nothing downloaded.
    await eng.load_adapter("alpha-s3-again", f"s3://{bucket}/adapters/alpha/")
    assert counting.gets == 2
    assert stores.counters.downloads == 1
    assert stores.counters.cache_hits == 1


async def test_changed_object_is_downloaded_again(
    tiny: Tiny, make_engine: Any, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "a", tiny.root / "alpha")
    eng = make_engine()
    eng.adapters.stores, counting = make_stores(s3_url, tmp_path / "cache")
    first = await eng.load_adapter("x", f"s3://{bucket}/a")
    upload(s3, bucket, "a", tiny.root / "beta")  # same prefix, new contents
    second = await eng.load_adapter("x", f"s3://{bucket}/a")
    assert first.path != second.path
    assert counting.gets == 4
    assert await greedy(eng, tiny, "x") == await greedy(eng, tiny, "beta")


async def test_lora_modules_flag_loads_from_s3(
    tiny: Tiny,
    make_engine: Any,
    s3_url: str,
    s3: Any,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--lora-modules name=s3://...`` with the endpoint and credentials from the standard
    environment variables (boto3's own chain, no client factory)."""
    upload(s3, bucket, "m/gamma", tiny.root / "gamma")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    args = build_parser().parse_args(
        [
            "--model",
            str(tiny.model_dir),
            "--adapter-root",
            str(tiny.root),
            "--lora-modules",
            f"g=s3://{bucket}/m/gamma",
            "--adapter-cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    assert args.lora_modules == [LoraModule("g", f"s3://{bucket}/m/gamma")]
    eng = make_engine()
    eng.adapters.stores = build_stores(args)
    await load_lora_modules(eng, args.lora_modules)
    assert eng.adapters.info("g").pinned
    assert await greedy(eng, tiny, "g") == await greedy(eng, tiny, "gamma")


async def test_resolver_loads_an_unknown_name_on_its_first_request(
    tiny: Tiny, make_engine: Any, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "lib/team/beta-remote", tiny.root / "beta")
    eng = make_engine()
    eng.adapters.stores, counting = make_stores(
        s3_url,
        tmp_path / "cache",
        resolvers=[f"s3://{bucket}/empty", f"s3://{bucket}/lib"],
    )
    assert await greedy(eng, tiny, "team/beta-remote") == await greedy(eng, tiny, "beta")
    # Resolved once, then registered under its cached copy: listed, and not looked up again.
    assert "team/beta-remote" in [a.name for a in eng.adapters.list()]
    await eng.unload_adapter("beta")
    assert await greedy(eng, tiny, "team/beta-remote", "again") == tiny.ref.greedy(
        list(tiny.encode(PROMPTS[1])), "beta", 6
    )
    assert counting.gets == 2


async def test_resolver_is_off_by_default(tiny: Tiny, make_engine: Any, tmp_path: Path) -> None:
    eng = make_engine()
    eng.adapters.stores = AdapterStores(tmp_path / "cache")  # stores, but no resolver
    with pytest.raises(AdapterNotFoundError, match="under the adapter root"):
        eng.submit(request("r", tiny.encode(PROMPTS[0]), "not-here"))


async def test_resolver_names_every_store_it_tried(
    tiny: Tiny, make_engine: Any, s3_url: str, bucket: str, tmp_path: Path
) -> None:
    eng = make_engine()
    eng.adapters.stores, _ = make_stores(
        s3_url, tmp_path / "cache", resolvers=[f"s3://{bucket}/one", f"s3://{bucket}/two"]
    )
    with pytest.raises(AdapterNotFoundError) as info:
        await collect(eng.submit(request("r", tiny.encode(PROMPTS[0]), "ghost")))
    assert f"s3://{bucket}/one/ghost/" in str(info.value)
    assert f"s3://{bucket}/two/ghost/" in str(info.value)
    with pytest.raises(AdapterNotFoundError, match="adapter stores"):  # remembered
        eng.submit(request("r2", tiny.encode(PROMPTS[0]), "ghost"))


async def test_hundred_concurrent_first_requests_share_one_download(
    tiny: Tiny, make_engine: Any, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "lib/gamma-remote", tiny.root / "gamma")
    eng = make_engine()
    stores, counting = make_stores(s3_url, tmp_path / "cache", resolvers=[f"s3://{bucket}/lib"])
    eng.adapters.stores = stores
    ids = tiny.encode(PROMPTS[0])
    streams = [eng.submit(request(f"r{i}", ids, "gamma-remote", max_tokens=2)) for i in range(100)]
    answers = await asyncio.gather(*(collect(s) for s in streams))
    want = tiny.ref.greedy(list(ids), "gamma", 2)
    assert [tokens(a) for a in answers] == [want] * 100
    assert stores.counters.downloads == 1
    assert counting.gets == 2  # one download: the config and the weights, once each


async def test_concurrent_fetches_of_one_source_share_one_download(
    tiny: Tiny, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "p", tiny.root / "gamma")
    stores, counting = make_stores(s3_url, tmp_path / "cache")
    source = parse_s3_uri(f"s3://{bucket}/p")
    paths = await asyncio.gather(*(stores.fetch(f"n{i}", source) for i in range(100)))
    assert len(set(paths)) == 1
    assert (stores.counters.fetches, stores.counters.downloads, counting.gets) == (1, 1, 2)


# ---- errors --------------------------------------------------------------------------------------


async def test_missing_key_and_bucket_name_the_store(
    tiny: Tiny, make_engine: Any, s3_url: str, bucket: str, tmp_path: Path
) -> None:
    eng = make_engine()
    eng.adapters.stores, _ = make_stores(s3_url, tmp_path / "cache")
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "m", f"s3://{bucket}/nothing/here", pinned=False)
    assert info.value.status == 404
    assert f"s3://{bucket}/nothing/here" in info.value.message
    assert info.value.param == "lora_path"
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "m", "s3://no-such-bucket-x/a", pinned=False)
    assert info.value.status == 404
    assert "s3://no-such-bucket-x/a" in info.value.message
    assert "no such bucket" in info.value.message


async def test_unreachable_store_is_503_naming_it(
    tiny: Tiny, make_engine: Any, tmp_path: Path
) -> None:
    eng = make_engine()
    dead = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",
        config=Config(connect_timeout=1, retries={"max_attempts": 1}),
        **CREDENTIALS,
    )
    eng.adapters.stores = AdapterStores(tmp_path / "cache", client_factory=lambda: dead)
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "m", "s3://some-bucket/a", pinned=False)
    assert info.value.status == 503
    assert "s3://some-bucket/a" in info.value.message
    assert info.value.code == "adapter_store_unavailable"


def test_access_denied_is_502_naming_the_store() -> None:
    from adaptermesh.worker.adapter_stores import _store_error

    exc = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject")
    err = _store_error("m", "s3://b/p", exc)
    assert isinstance(err, AdapterStoreError)
    api = adapter_error(err, "lora_path")
    assert (api.status, api.code) == (502, "adapter_store_error")
    assert "s3://b/p" in api.message
    assert "access denied" in api.message


async def test_oversized_file_is_refused_and_nothing_is_cached(
    tiny: Tiny, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "big", tiny.root / "gamma")
    size = (tiny.root / "gamma" / "adapter_model.safetensors").stat().st_size
    stores, counting = make_stores(s3_url, tmp_path / "cache", max_file_bytes=size - 1)
    with pytest.raises(AdapterValidationError, match="above the limit") as info:
        await stores.fetch("big", parse_s3_uri(f"s3://{bucket}/big"))
    assert f"s3://{bucket}/big/adapter_model.safetensors" in str(info.value)
    assert counting.gets == 0  # refused from the listing, before any download
    assert cached_files(tmp_path / "cache") == []
    stores.max_file_bytes, stores.max_total_bytes = size, size
    with pytest.raises(AdapterValidationError, match="above the limit"):
        await stores.fetch("big", parse_s3_uri(f"s3://{bucket}/big"))


async def test_corrupted_download_is_refused_and_nothing_is_cached(
    tiny: Tiny, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "c", tiny.root / "alpha")

    def flip(data: bytes) -> bytes:
        return data[:-1] + bytes([data[-1] ^ 1])

    stores, _ = make_stores(s3_url, tmp_path / "cache", mangle=flip)
    with pytest.raises(AdapterStoreError, match="checksum mismatch") as info:
        await stores.fetch("c", parse_s3_uri(f"s3://{bucket}/c"))
    assert info.value.status == 502
    assert f"s3://{bucket}/c/" in str(info.value)
    assert cached_files(tmp_path / "cache") == []


async def test_sha256_metadata_is_checked(
    tiny: Tiny, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    for file in (tiny.root / "alpha").iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        s3.put_object(
            Bucket=bucket,
            Key=f"ok/{file.name}",
            Body=file.read_bytes(),
            Metadata={"sha256": digest},
        )
    upload(s3, bucket, "bad", tiny.root / "alpha", Metadata={"sha256": "0" * 64})
    stores, _ = make_stores(s3_url, tmp_path / "cache")
    assert (await stores.fetch("ok", parse_s3_uri(f"s3://{bucket}/ok"))).is_dir()
    with pytest.raises(AdapterStoreError, match="SHA-256"):
        await stores.fetch("bad", parse_s3_uri(f"s3://{bucket}/bad"))


async def test_only_adapter_files_are_downloaded(
    tiny: Tiny, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, "x", tiny.root / "alpha")
    s3.put_object(Bucket=bucket, Key="x/run.sh", Body=b"rm -rf /")
    s3.put_object(Bucket=bucket, Key="x/nested/adapter_config.json", Body=b"{}")
    stores, counting = make_stores(s3_url, tmp_path / "cache")
    path = await stores.fetch("x", parse_s3_uri(f"s3://{bucket}/x"))
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert counting.gets == 2


@pytest.mark.parametrize(
    "path",
    [
        "s3://bucket/../etc",
        "s3://bucket/a/../../b",
        "s3://bucket//a",
        "s3://bucket/./a",
        "s3://../x",
        "s3://Bucket_With_Caps/a",
        "s3://bucket/a\\b",
        "s3://bucket/a\nb",
        "hf://org/../name",
        "hf://org/name@../../x",
        "hf://org",
    ],
)
async def test_hostile_paths_are_refused(
    tiny: Tiny, make_engine: Any, tmp_path: Path, path: str
) -> None:
    eng = make_engine()
    eng.adapters.stores = AdapterStores(tmp_path / "cache", hf_cache_dir=tmp_path / "hf")
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "m", path, pinned=False)
    assert info.value.status == 400
    assert info.value.param == "lora_path"
    assert cached_files(tmp_path / "cache") == []


@pytest.mark.parametrize("name", ["../escape", "a/../../b", "/abs", ".hidden", "a/./b", ""])
async def test_path_traversal_names_are_refused_by_the_resolver(tmp_path: Path, name: str) -> None:
    stores = AdapterStores(tmp_path / "cache", resolvers=["s3://bucket/lib"])
    with pytest.raises(AdapterValidationError, match="name"):
        await stores.resolve(name)


async def test_store_paths_without_stores_are_refused(tiny: Tiny, make_engine: Any) -> None:
    eng = make_engine()
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "m", "s3://bucket/a", pinned=False)
    assert info.value.status == 400
    assert "adapter stores" in info.value.message


_hostile_text = st.lists(
    st.sampled_from([*"ab./\\\x00\n @:%~*-_Z9", "..", "//", "../", "s3://"]), max_size=20
).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rest=_hostile_text, name=_hostile_text)
def test_hostile_uris_and_names_never_escape_the_cache(
    tmp_path: Path, rest: str, name: str
) -> None:
    stores = AdapterStores(tmp_path / "cache")
    for uri in (f"s3://{rest}", f"s3://bucket/{rest}", f"hf://{rest}", rest):
        try:
            source = parse_source(uri, "n")
        except AdapterValidationError as exc:
            refused = exc.field
            assert refused == "lora_path"
            continue
        if source.kind == "dir":
            assert "://" not in uri
            continue
        if source.kind == "hf":
            assert ".." not in source.repo
            assert ".." not in source.revision
            continue
        assert not any(p in ("", ".", "..") for p in source.prefix.split("/") if source.prefix)
        assert "\\" not in source.prefix
        assert "\x00" not in source.prefix
        candidates = [source]
        try:
            candidates.append(source.child(name))
        except AdapterValidationError as exc:
            refused = exc.field
            assert refused == "name"
        for candidate in candidates:
            assert ".." not in candidate.prefix.split("/")
            entry = stores.cache_entry(candidate, rest + name)
            assert entry.resolve().is_relative_to(stores.cache_dir)


# ---- Hugging Face cache layouts ------------------------------------------------------------------


def make_hf_entry(cache: Path, repo: str, adapter: Path, commit: str = "a" * 40) -> Path:
    """A Hugging Face cache entry: blobs, a snapshot of links to them, refs/main."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in adapter.iterdir():
        blob = repo_dir / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return repo_dir


async def test_hf_uri_is_found_in_the_local_cache(
    tiny: Tiny, make_engine: Any, tmp_path: Path
) -> None:
    hf = tmp_path / "hf"
    make_hf_entry(hf, "org/delta-lora", tiny.root / "delta")
    eng = make_engine()
    eng.adapters.stores = AdapterStores(tmp_path / "cache", hf_cache_dir=hf)
    await eng.load_adapter("d1", "hf://org/delta-lora")
    await eng.load_adapter("d2", f"hf://org/delta-lora@{'a' * 40}")
    want = await greedy(eng, tiny, "delta")
    assert await greedy(eng, tiny, "d1") == want
    assert await greedy(eng, tiny, "d2") == want
    with pytest.raises(ApiError) as info:
        await load_adapter_into_engine(eng, "d3", "hf://org/delta-lora@v2", pinned=False)
    assert info.value.status == 404
    assert "hf://org/delta-lora@v2" in info.value.message


async def test_local_hf_layout_under_the_adapter_root(
    tiny: Tiny, make_engine: Any, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    shutil.copytree(tiny.root, root)
    make_hf_entry(root, "org/alpha-lora", tiny.root / "alpha")
    eng = make_engine(root=root)
    await eng.load_adapter("a1", "models--org--alpha-lora")
    await eng.load_adapter("a2", f"models--org--alpha-lora/snapshots/{'a' * 40}")
    want = await greedy(eng, tiny, "alpha")
    assert await greedy(eng, tiny, "a1") == want
    assert await greedy(eng, tiny, "a2") == want


def test_source_uris_round_trip() -> None:
    assert parse_source("s3://b-1/x/y/") == AdapterSource("s3", bucket="b-1", prefix="x/y")
    assert parse_source("s3://b-1") == AdapterSource("s3", bucket="b-1", prefix="")
    assert parse_source("hf://o/n@v1").uri == "hf://o/n@v1"
    assert parse_source("hf://o/n").revision == "main"
    assert parse_source("dir/sub").kind == "dir"
    assert AdapterSource("s3", bucket="b", prefix="lib").child("x@2").uri == "s3://b/lib/x@2"


# ---- over HTTP ------------------------------------------------------------------------------------


async def test_http_load_and_resolve_from_s3(
    tiny: Tiny, make_engine: Any, s3_url: str, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """``POST /v1/load_lora_adapter`` with an s3:// ``lora_path``, a completion through the
    resolver, and the statuses of a missing object and an unreachable store."""
    import httpx

    from adaptermesh.worker.service import ServiceConfig, WorkerService, serve

    upload(s3, bucket, "lib/alpha", tiny.root / "alpha")
    upload(s3, bucket, "lib/team/alpha-remote", tiny.root / "alpha")
    eng = make_engine()
    eng.adapters.stores, _ = make_stores(
        s3_url, tmp_path / "cache", resolvers=[f"s3://{bucket}/lib"]
    )
    runner, port = await serve(WorkerService(eng, ServiceConfig()), "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            loaded = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "alpha-http", "lora_path": f"s3://{bucket}/lib/alpha"},
            )
            assert loaded.status_code == 200, loaded.text
            body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
            texts = []
            # From the adapter root, from the explicit s3 load, and by the resolver (a name
            # that only the store holds, under lib/).
            for model in ("alpha", "alpha-http", "team/alpha-remote"):
                answer = await client.post("/v1/completions", json={**body, "model": model})
                assert answer.status_code == 200, answer.text
                texts.append(answer.json()["choices"][0]["text"])
            assert texts == [texts[0]] * 3
            missing = await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "m", "lora_path": f"s3://{bucket}/lib/none"},
            )
            assert missing.status_code == 404
            assert f"s3://{bucket}/lib/none" in missing.json()["error"]["message"]
            assert missing.json()["error"]["param"] == "lora_path"
            unknown = await client.post("/v1/completions", json={**body, "model": "ghost"})
            assert unknown.status_code == 404
            assert f"s3://{bucket}/lib/ghost/" in unknown.json()["error"]["message"]
            # A store that cannot be reached (a closed port).
            eng.adapters.stores = AdapterStores(
                tmp_path / "cache2",
                client_factory=lambda: boto3.client(
                    "s3",
                    endpoint_url="http://127.0.0.1:9",
                    config=Config(connect_timeout=1, retries={"max_attempts": 1}),
                    **CREDENTIALS,
                ),
            )
            down = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "s3://b-down/x"}
            )
            assert down.status_code == 503
            assert down.json()["error"]["code"] == "adapter_store_unavailable"
            assert "s3://b-down/x" in down.json()["error"]["message"]
    finally:
        await runner.cleanup()


def test_resolver_flag_refuses_hostile_uris(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "m", "--adapter-root", "r"]
    args = build_parser().parse_args([*base, "--adapter-resolver", "s3://bucket/lib"])
    assert args.adapter_resolver == ["s3://bucket/lib"]
    for bad in ("s3://bucket/../x", "http://host/x", "s3://B/x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--adapter-resolver", bad])
    assert "--adapter-resolver" in capsys.readouterr().err


def test_prepare_builds_the_client_once_and_only_with_a_store(tmp_path: Path) -> None:
    built: list[object] = []

    def factory() -> object:
        built.append(object())
        return built[-1]

    assert AdapterStores(tmp_path, client_factory=factory).prepare() is False
    assert built == []  # no resolver, no endpoint: nothing to build (and no boto3 import)
    stores = AdapterStores(tmp_path, resolvers=["s3://bucket/lib"], client_factory=factory)
    assert stores.prepare() is True
    assert len(built) == 1
    assert stores.client() is built[0]  # the first fetch uses it, builds no other
    stores = AdapterStores(tmp_path, endpoint_url="http://127.0.0.1:9", client_factory=factory)
    assert stores.prepare() is True
    assert len(built) == 2


def test_a_bad_endpoint_fails_the_start_in_one_line(tmp_path: Path) -> None:
    stores = AdapterStores(tmp_path, endpoint_url="not a url")
    with pytest.raises(ValueError, match=r"^--s3-endpoint-url: Invalid endpoint: not a url$"):
        stores.prepare()
    model = tmp_path / "m"
    model.mkdir()
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "adaptermesh"),
            "worker",
            "--model",
            str(model),
            "--adapter-root",
            str(tmp_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--s3-endpoint-url",
            "not a url",
            "--log-level",
            "WARNING",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "adaptermesh worker: cannot start the engine: --s3-endpoint-url: Invalid endpoint: "
        "not a url"
    ]
