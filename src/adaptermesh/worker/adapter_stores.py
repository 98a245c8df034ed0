"""Adapters from object storage and Hugging Face cache layouts, fetched into a local cache.

An adapter source (``parse_source``) is one of:

* a plain directory under the adapter root (as before: ``resolve_in_root`` keeps it inside);
* ``s3://bucket/prefix``: the adapter's files are the objects ``prefix/adapter_config.json``
  and ``prefix/adapter_model.safetensors`` (or ``adapter_model.bin``). Only those names are
  ever downloaded; other objects under the prefix are left in the store;
* a Hugging Face cache layout: ``hf://org/name[@rev]``, looked up in a configured local cache
  directory (``models--org--name/refs/<rev>`` -> ``snapshots/<commit>/``), or a local
  ``models--org--name`` directory under the adapter root (its ``refs/main`` snapshot). Nothing
  is ever fetched from the Hub.

``AdapterStores.fetch`` downloads an S3 source with boto3 in a worker thread (never on the event
loop), streaming each object into a temporary directory inside the cache directory under a
per-file and a total size limit, verifying each object's MD5 against its ETag (single-part
uploads), its SHA-256 against an ``x-amz-meta-sha256`` header or an S3 ``ChecksumSHA256`` when
present, then renames the directory into place in one step. The cache is content-addressed
(``s3/<hash of the URI>/<hash of the objects' ETags and sizes>/``), so a changed adapter lands
beside the old copy and an unchanged one is never downloaded twice: a fetch lists the prefix
(one request) and downloads only when that version is not cached yet. Concurrent fetches of
one source share one download.

With resolvers configured (``--adapter-resolver s3://bucket/prefix``, off by default), an
adapter name that the adapter root does not hold is looked up as ``prefix/<name>/`` in each
store in order (vLLM's LoRA resolver semantics); names are checked by ``validate_name`` first.

Errors name the store: a missing bucket or object is ``AdapterNotFoundError`` (404); an
unreachable store is ``AdapterStoreError`` with status 503, one that refuses access or sends
bytes that fail their checksum 502; an oversized or unexpected object is
``AdapterValidationError`` on ``lora_path`` (400).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptermesh.worker.peft_adapter import AdapterValidationError, resolve_in_root, validate_name
from adaptermesh.worker.types import AdapterNotFoundError

__all__ = [
    "ADAPTER_FILES",
    "AdapterSource",
    "AdapterStoreError",
    "AdapterStores",
    "StoreCounters",
    "default_cache_dir",
    "hf_local_snapshot",
    "is_store_uri",
    "parse_s3_uri",
    "parse_source",
]

# The objects an S3 adapter may consist of: the config (required) and one weights file.
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_FILES = (CONFIG_FILE, *WEIGHT_FILES)
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_FILE_BYTES = 4 << 30
DEFAULT_MAX_TOTAL_BYTES = 4 << 30
DEFAULT_TIMEOUT_S = 10.0  # connect and read timeout of each S3 request
_CHUNK = 1 << 20
_MARKER = ".adaptermesh-source.json"

# S3 bucket names (the DNS-compatible rules): 3-63 of [a-z0-9.-], starting and ending with a
# letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# One key component of a prefix: printable, no backslash; "." and ".." are refused separately.
_KEY_PART_RE = re.compile(r"^[A-Za-z0-9._\-@=+,!*'()~ ]{1,255}$")
_HF_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,95}$")
_HF_REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,99}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_MAX_PREFIX_CHARS = 900  # S3 keys are at most 1024 bytes; the file name and a name follow


class AdapterStoreError(AdapterNotFoundError):
    """The store holding an adapter could not be used: unreachable (``status`` 503), access
    refused or a download that failed its checksum (502). The message names the store."""

    def __init__(self, name: str, store: str, message: str, status: int) -> None:
        super().__init__(name, f"{store}: {message}")
        self.store = store
        self.status = status


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """Where an adapter comes from: ``kind`` "dir" (``path``), "s3" (``bucket``, ``prefix``)
    or "hf" (``repo`` as org/name and ``revision``)."""

    kind: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""
    repo: str = ""
    revision: str = "main"

    @property
    def uri(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        if self.kind == "hf":
            return f"hf://{self.repo}@{self.revision}"
        return self.path

    def child(self, name: str) -> AdapterSource:
        """The S3 source ``prefix/<name>`` of a resolver store (``name`` is validated)."""
        validate_name(name)
        prefix = f"{self.prefix}/{name}" if self.prefix else name
        return AdapterSource("s3", bucket=self.bucket, prefix=prefix)


def is_store_uri(path: str) -> bool:
    """Whether ``path`` names a store (``s3://`` or ``hf://``) rather than a local directory."""
    return path.startswith(("s3://", "hf://"))


def _refuse(name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(name, "lora_path", message)


def parse_s3_uri(uri: str, name: str = "-") -> AdapterSource:
    """``s3://bucket/prefix`` (a trailing slash is dropped). Every prefix component is checked:
    no empty, ``.`` or ``..`` component, no backslash, control or unusual characters, so the
    key never means anything but the adapter's own directory."""
    if not uri.startswith("s3://"):
        raise _refuse(name, f"{uri!r} is not an s3:// URI")
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise _refuse(name, f"s3 bucket {bucket!r} is not a valid bucket name")
    prefix = prefix[:-1] if prefix.endswith("/") else prefix
    if len(prefix) > _MAX_PREFIX_CHARS:
        raise _refuse(name, f"s3 prefix has more than {_MAX_PREFIX_CHARS} characters")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", "..") or not _KEY_PART_RE.match(part):
                raise _refuse(
                    name,
                    f"s3 prefix component {part!r} is not allowed (empty, '.', '..' or "
                    "characters outside [A-Za-z0-9._-@=+,!*'()~ ])",
                )
    return AdapterSource("s3", bucket=bucket, prefix=prefix)


def _parse_hf(uri: str, name: str) -> AdapterSource:
    rest = uri[len("hf://") :]
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HF_PART_RE.match(p) and ".." not in p for p in parts):
        raise _refuse(name, f"{uri!r}: expected hf://org/name[@revision]")
    if at and (not _HF_REV_RE.match(revision) or ".." in revision):
        raise _refuse(name, f"{uri!r}: revision {revision!r} is not allowed")
    return AdapterSource("hf", repo=repo, revision=revision if at else "main")


def parse_source(path: str, name: str = "-") -> AdapterSource:
    """The source a ``lora_path`` names: s3://, hf:// or a local directory (checked later,
    against the adapter root, by ``resolve_in_root``)."""
    if path.startswith("s3://"):
        return parse_s3_uri(path, name)
    if path.startswith("hf://"):
        return _parse_hf(path, name)
    if "://" in path:
        raise _refuse(name, f"{path!r}: only s3:// and hf:// stores are supported")
    return AdapterSource("dir", path=path)


def _snapshot_of(repo_dir: Path, revision: str) -> Path | None:
    """``repo_dir/snapshots/<commit>`` for a revision (a commit, or a ref under refs/)."""
    if _COMMIT_RE.match(revision):
        commit = revision
    else:
        ref = repo_dir / "refs" / revision
        try:
            commit = ref.read_text().strip()
        except OSError:
            return None
        if not _COMMIT_RE.match(commit):
            return None
    return repo_dir / "snapshots" / commit


def hf_local_snapshot(path: Path) -> Path:
    """A local ``models--org--name`` directory (a Hugging Face cache entry) stands for its
    ``refs/main`` snapshot; any other path is returned as it is."""
    if path.name.startswith("models--") and not (path / CONFIG_FILE).exists():
        snapshot = _snapshot_of(path, "main")
        if snapshot is not None:
            return snapshot
    return path


def default_cache_dir() -> Path:
    """``<temp dir>/adaptermesh-adapter-cache-<uid>``: the download cache when none is given."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"adaptermesh-adapter-cache-{uid}"


@dataclass(slots=True)
class StoreCounters:
    fetches: int = 0  # fetch calls that ran (a shared fetch counts once)
    downloads: int = 0  # fetches that downloaded a new version
    cache_hits: int = 0  # fetches whose version was already in the local cache
    objects: int = 0  # objects downloaded (GETs)
    bytes: int = 0
    failures: int = 0
    seconds: list[float] = field(default_factory=list)


def _hash(text: str, chars: int = 32) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


class AdapterStores:
    """The worker's adapter stores: S3 fetches into ``cache_dir``, the local Hugging Face cache
    (``hf_cache_dir``) and the name resolvers.

    ``client_factory`` builds the boto3 S3 client (default: ``boto3.client("s3",
    endpoint_url=...)`` with the standard credential chain; ``endpoint_url`` None lets boto3
    read ``AWS_ENDPOINT_URL``). It is called once, in a worker thread.
    """

    def __init__(
        self,
        cache_dir: Path | None = None,
        *,
        endpoint_url: str | None = None,
        resolvers: Sequence[str] = (),
        hf_cache_dir: Path | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        client_factory: Callable[[], Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.cache_dir = (cache_dir or default_cache_dir()).resolve()
        self.endpoint_url = endpoint_url
        self.resolvers = [parse_s3_uri(uri, "--adapter-resolver") for uri in resolvers]
        self.hf_cache_dir = hf_cache_dir
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self._client_factory = client_factory or self._default_client
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self.counters = StoreCounters()

    # ---- the client -----------------------------------------------------------------------------

    def _default_client(self) -> Any:
        import boto3
        from botocore.config import Config

        # A store that accepts and never answers fails each attempt after ``timeout_s``.
        config = Config(
            connect_timeout=self.timeout_s,
            read_timeout=self.timeout_s,
            retries={"mode": "standard", "max_attempts": 3},
        )
        return boto3.client("s3", endpoint_url=self.endpoint_url, config=config)

    def prepare(self) -> bool:
        """Build the S3 client now when a store is configured (a resolver or an endpoint), so
        the first request for a store's adapter does not pay for it (importing boto3 and
        building a client take a few hundred milliseconds of CPU, and the interpreter, from the
        engine's steps). Returns whether it built one; a bad endpoint raises ValueError."""
        if not self.resolvers and self.endpoint_url is None:
            return False
        try:
            self.client()
        except ValueError as exc:
            raise ValueError(f"--s3-endpoint-url: {exc}") from None
        return True

    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    # ---- paths ---------------------------------------------------------------------------------

    async def local_path(self, name: str, path: str) -> Path:
        """The local directory for a store ``lora_path`` (``is_store_uri``): fetched from S3 or
        found in the Hugging Face cache. A local path is the caller's to resolve."""
        source = parse_source(path, name)
        if source.kind == "s3":
            return await self.fetch(name, source)
        if source.kind == "hf":
            return self.hf_snapshot(name, source)
        raise _refuse(name, f"{path!r} is not a store URI")

    def hf_snapshot(self, name: str, source: AdapterSource) -> Path:
        """The snapshot directory of an ``hf://`` source in the local cache (never the Hub)."""
        if self.hf_cache_dir is None:
            raise _refuse(
                name,
                f"{source.uri}: no Hugging Face cache directory is configured (--hf-cache-dir)",
            )
        repo_dir = f"models--{source.repo.replace('/', '--')}"
        snapshot = _snapshot_of(self.hf_cache_dir / repo_dir, source.revision)
        if snapshot is None:
            raise AdapterNotFoundError(
                name,
                f"{source.uri}: revision {source.revision!r} is not in the Hugging Face "
                f"cache {self.hf_cache_dir}",
            )
        rel = snapshot.relative_to(self.hf_cache_dir)
        resolved = resolve_in_root(self.hf_cache_dir, name, str(rel))
        if not (resolved / CONFIG_FILE).is_file():
            raise AdapterNotFoundError(
                name, f"{source.uri}: snapshot {resolved} has no {CONFIG_FILE}"
            )
        return resolved

    async def resolve(self, name: str) -> Path | None:
        """The first resolver store holding ``prefix/<name>/``, fetched; None without resolvers.
        A store that does not hold it is skipped; every other error is raised."""
        validate_name(name)
        if not self.resolvers:
            return None
        missing: list[str] = []
        for store in self.resolvers:
            source = store.child(name)
            try:
                return await self.fetch(name, source)
            except (AdapterStoreError, AdapterValidationError):
                raise  # the store failed, or holds something unusable: not "absent"
            except AdapterNotFoundError:
                missing.append(source.uri + "/")
        raise AdapterNotFoundError(
            name, f"not under the adapter root nor in the adapter stores ({', '.join(missing)})"
        )

    # ---- fetching -------------------------------------------------------------------------------

    async def fetch(self, name: str, source: AdapterSource) -> Path:
        """The local directory holding ``source``'s files, downloaded when not cached. One
        download per source at a time: concurrent callers share it (a caller that is cancelled
        does not cancel it for the others)."""
        key = source.uri
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self._fetch_sync, name, source)
            )
            self._inflight[key] = task

            def done(t: asyncio.Task[Path], key: str = key) -> None:
                if self._inflight.get(key) is t:
                    del self._inflight[key]
                if not t.cancelled() and t.exception() is not None:
                    self.counters.failures += 1

            task.add_done_callback(done)
        return await asyncio.shield(task)

    def cache_entry(self, source: AdapterSource, version: str) -> Path:
        """Where one version of ``source`` is cached: hashed names only, so no URI or adapter
        name can place a file outside ``cache_dir``."""
        return self.cache_dir / "s3" / _hash(source.uri) / _hash(version, 16)

    def _fetch_sync(self, name: str, source: AdapterSource) -> Path:
        t0 = time.perf_counter()
        self.counters.fetches += 1
        store = source.uri
        client = self.client()
        objects = self._list(client, name, source)
        version = json.dumps(sorted((k, o["ETag"], o["Size"]) for k, o in objects.items()))
        entry = self.cache_entry(source, version)
        if (entry / _MARKER).is_file():
            self.counters.cache_hits += 1
            self.counters.seconds.append(time.perf_counter() - t0)
            return entry
        self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # private to the worker
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        try:
            for file_name, obj in objects.items():
                self._download(client, name, source, file_name, obj, tmp / file_name)
            (tmp / _MARKER).write_text(
                json.dumps({"uri": store, "objects": {k: o["ETag"] for k, o in objects.items()}})
            )
            try:
                tmp.rename(entry)
            except OSError:
                if not (entry / _MARKER).is_file():  # not another process's identical copy
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.counters.downloads += 1
        self.counters.seconds.append(time.perf_counter() - t0)
        return entry

    def _list(self, client: Any, name: str, source: AdapterSource) -> dict[str, dict[str, Any]]:
        """The adapter's objects under the prefix (``file name -> {"ETag", "Size", "Key"}``),
        with their sizes checked against the limits before anything is downloaded."""
        store = source.uri
        prefix = f"{source.prefix}/" if source.prefix else ""
        try:
            listing = client.list_objects_v2(
                Bucket=source.bucket, Prefix=prefix, Delimiter="/", MaxKeys=1000
            )
        except Exception as exc:
            raise _store_error(name, store, exc) from None
        found: dict[str, dict[str, Any]] = {}
        for obj in listing.get("Contents", []):
            file_name = str(obj["Key"])[len(prefix) :]
            if file_name in ADAPTER_FILES:
                found[file_name] = {
                    "Key": obj["Key"],
                    "ETag": str(obj.get("ETag", "")),
                    "Size": int(obj.get("Size", 0)),
                }
        if CONFIG_FILE not in found:
            raise AdapterNotFoundError(name, f"no {CONFIG_FILE} at {store}/")
        weights = [f for f in WEIGHT_FILES if f in found]
        if not weights:
            raise AdapterNotFoundError(name, f"no {' or '.join(WEIGHT_FILES)} at {store}/")
        for extra in weights[1:]:  # one weights file; safetensors wins, as on disk
            del found[extra]
        total = 0
        for file_name, obj in found.items():
            limit = MAX_CONFIG_BYTES if file_name == CONFIG_FILE else self.max_file_bytes
            if obj["Size"] > limit:
                raise _refuse(
                    name, f"{store}/{file_name} has {obj['Size']} bytes, above the limit of {limit}"
                )
            total += obj["Size"]
        if total > self.max_total_bytes:
            raise _refuse(
                name, f"{store}/ holds {total} bytes, above the limit of {self.max_total_bytes}"
            )
        return found

    def _download(
        self,
        client: Any,
        name: str,
        source: AdapterSource,
        file_name: str,
        obj: dict[str, Any],
        dest: Path,
    ) -> None:
        """Stream one object to ``dest``, enforcing its size limit and verifying its checksums."""
        where = f"{source.uri}/{file_name}"
        limit = MAX_CONFIG_BYTES if file_name == CONFIG_FILE else self.max_file_bytes
        try:
            response = client.get_object(
                Bucket=source.bucket, Key=obj["Key"], IfMatch=obj["ETag"], ChecksumMode="ENABLED"
            )
        except Exception as exc:
            raise _store_error(name, where, exc) from None
        self.counters.objects += 1
        md5 = hashlib.md5(usedforsecurity=False)
        sha256 = hashlib.sha256()
        size = 0
        body = response["Body"]
        try:
            with dest.open("wb") as out:
                while True:
                    try:
                        chunk = body.read(_CHUNK)
                    except Exception as exc:
                        raise _store_error(name, where, exc) from None
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > limit:
                        raise _refuse(name, f"{where} sent more than its limit of {limit} bytes")
                    md5.update(chunk)
                    sha256.update(chunk)
                    out.write(chunk)
        finally:
            body.close()
        self.counters.bytes += size
        if size != obj["Size"]:
            raise AdapterStoreError(
                name, where, f"sent {size} bytes, the listing says {obj['Size']}", 502
            )
        etag = str(response.get("ETag", obj["ETag"])).strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag) and md5.hexdigest() != etag:
            raise AdapterStoreError(
                name, where, f"checksum mismatch: MD5 {md5.hexdigest()} != ETag {etag}", 502
            )
        wanted = response.get("Metadata", {}).get("sha256")
        if wanted and sha256.hexdigest() != str(wanted).lower():
            raise AdapterStoreError(
                name, where, f"checksum mismatch: SHA-256 {sha256.hexdigest()} != {wanted}", 502
            )
        s3_sha = response.get("ChecksumSHA256")
        if s3_sha and "-" not in str(s3_sha):
            got = base64.b64encode(sha256.digest()).decode()
            if got != s3_sha:
                raise AdapterStoreError(
                    name, where, f"checksum mismatch: SHA-256 {got} != {s3_sha}", 502
                )


_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_DENIED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidToken",
}


def _store_error(name: str, store: str, exc: Exception) -> AdapterNotFoundError:
    """What a boto3 error means for the adapter: not found (404), access refused (502) or the
    store unreachable or failing (503); the message names the store."""
    from botocore.exceptions import (
        ClientError,
        FlexibleChecksumError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, FlexibleChecksumError):
        return AdapterStoreError(name, store, f"checksum mismatch ({exc})", 502)

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code in _NOT_FOUND:
            what = "bucket" if code == "NoSuchBucket" else "object"
            return AdapterNotFoundError(name, f"{store}: no such {what}")
        if code in _DENIED:
            return AdapterStoreError(name, store, f"access denied ({code})", 502)
        if code in ("PreconditionFailed", "412"):
            return AdapterStoreError(name, store, "changed while it was downloaded", 503)
        return AdapterStoreError(name, store, f"the store answered {code or 'an error'}", 503)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return AdapterStoreError(name, store, f"no usable credentials ({exc})", 502)
    return AdapterStoreError(name, store, f"unreachable ({type(exc).__name__}: {exc})", 503)
