"""Object stores under a table root: local disk and S3 (or any S3-protocol server).

Keys are '/'-separated and relative to the table root. Every manifest commit goes through
`put_if_absent`, the only primitive that makes concurrent committers safe, so both stores
implement it atomically (a hard link on local disk, `IfNoneMatch='*'` on S3).
Both count their requests by kind in `stats`, which benchmarks and the "a tick over unchanged
regions must not list" tests read.
"""

from __future__ import annotations

import collections
import os
import tempfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Protocol
from urllib.parse import unquote, urlparse

from memwal_core import faults
from memwal_core.errors import MemwalError
from memwal_core.state import layout


class StoreError(MemwalError, OSError):
    """An object-store request failed for a reason other than "not found"."""


class NotFound(MemwalError, KeyError):
    """The object does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


class ObjectStore(Protocol):
    uri: str
    stats: collections.Counter

    def get(self, key: str) -> bytes: ...
    def head(self, key: str) -> ObjectInfo | None: ...
    def exists(self, key: str) -> bool: ...
    def put(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...
    def list_dirs(self, prefix: str) -> list[str]: ...
    def delete_many(self, keys: Iterable[str]) -> int: ...


def _clean(key: str) -> str:
    if key.startswith("/") or any(p in ("", ".", "..") for p in key.rstrip("/").split("/")):
        raise ValueError(f"unsafe object key {key!r}")
    return key


class LocalStore:
    """A directory on local disk."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.uri = self.root
        self.stats: collections.Counter = collections.Counter()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_clean(key).rstrip("/").split("/"))

    def get(self, key: str) -> bytes:
        self.stats["get"] += 1
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(key) from None

    def head(self, key: str) -> ObjectInfo | None:
        self.stats["head"] += 1
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def _write_temp(self, path: str, data: bytes) -> str:
        for attempt in range(20):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".memwal-tmp-")
                break
            except (FileNotFoundError, FileExistsError):
                # Another process's delete_many pruned the directory while it was being made
                # (or made it again in between): make it again.
                if attempt == 19:
                    raise
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        self.stats["put"] += 1
        path = self._path(key)
        os.replace(self._write_temp(path, data), path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomic across processes: the complete file is linked into place or not at all."""
        self.stats["put_if_absent"] += 1
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.stats["list"] += 1
        base = self._path(prefix) if prefix else self.root
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-"directories" under `prefix`."""
        self.stats["list"] += 1
        try:
            with os.scandir(self._path(prefix) if prefix else self.root) as it:
                return sorted(e.name for e in it if e.is_dir())
        except FileNotFoundError:
            return []

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        dirs: set[str] = set()
        for key in keys:
            self.stats["delete"] += 1
            path = self._path(key)
            try:
                os.unlink(path)
                n += 1
                dirs.add(os.path.dirname(path))
            except FileNotFoundError:
                pass
        # Remove directories left empty, deepest first, never above the root.
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)
        return n


class S3Store:
    """A prefix in an S3 bucket, through boto3.

    Retries: botocore's "standard" mode already retries throttling and 5xx with exponential
    backoff and jitter; `max_attempts` comes from the storage options (`s3_max_attempts`).
    Deletes go out in `delete_objects` batches of up to 1,000 keys.
    """

    def __init__(self, bucket: str, prefix: str, client, uri: str):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client
        self.uri = uri
        self.stats: collections.Counter = collections.Counter()

    def _key(self, key: str) -> str:
        key = _clean(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _call(self, kind: str, fn, **kw):
        from botocore.exceptions import BotoCoreError, ClientError

        self.stats[kind] += 1
        try:
            return fn(**kw)
        except ClientError:
            raise
        except BotoCoreError as e:  # connection refused, timeouts after retries, ...
            raise StoreError(f"S3 {kind} on s3://{self.bucket}/{kw.get('Key', kw.get('Prefix', ''))} "
                             f"failed: {e}") from None

    @staticmethod
    def _code(e) -> str:
        return str(e.response.get("Error", {}).get("Code", ""))

    def _raise(self, kind: str, key: str, e) -> None:
        code = self._code(e)
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        hint = " (access denied: check the credentials and the bucket policy)" if status == 403 else ""
        raise StoreError(f"S3 {kind} s3://{self.bucket}/{key} failed: {code or status}{hint}") from None

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            return self._call("get", self.client.get_object, Bucket=self.bucket, Key=k)["Body"].read()
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404"):
                raise NotFound(key) from None
            self._raise("get", k, e)

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            r = self._call("head", self.client.head_object, Bucket=self.bucket, Key=k)
        except ClientError as e:
            if self._code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            self._raise("head", k, e)
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def put(self, key: str, data: bytes) -> None:
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            self._call("put", self.client.put_object, Bucket=self.bucket, Key=k, Body=data)
        except ClientError as e:
            self._raise("put", k, e)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            self._call("put_if_absent", self.client.put_object, Bucket=self.bucket, Key=k,
                       Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            if self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            self._raise("put_if_absent", k, e)

    def _pages(self, prefix: str, delimiter: str | None):
        from botocore.exceptions import ClientError

        full = self._key(prefix) if prefix else self.prefix
        full = full.rstrip("/") + "/" if full else ""
        kw = {"Bucket": self.bucket, "Prefix": full}
        if delimiter:
            kw["Delimiter"] = delimiter
        token = None
        while True:
            if token:
                kw["ContinuationToken"] = token
            try:
                page = self._call("list", self.client.list_objects_v2, **kw)
            except ClientError as e:
                self._raise("list", full, e)
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for page in self._pages(prefix, None):
            for o in page.get("Contents", []):
                yield ObjectInfo(self._rel(o["Key"]), int(o["Size"]), o["LastModified"].timestamp())

    def list_dirs(self, prefix: str) -> list[str]:
        out = []
        for page in self._pages(prefix, "/"):
            for p in page.get("CommonPrefixes", []):
                out.append(p["Prefix"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(out)

    def delete_many(self, keys: Iterable[str]) -> int:
        from botocore.exceptions import ClientError

        keys = list(keys)
        n = 0
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            try:
                r = self._call("delete_batch", self.client.delete_objects, Bucket=self.bucket,
                               Delete={"Objects": batch, "Quiet": True})
            except ClientError as e:
                self._raise("delete_objects", batch[0]["Key"], e)
            errors = r.get("Errors", [])
            if errors:
                first = errors[0]
                raise StoreError(f"S3 delete_objects failed for {len(errors)} keys, first "
                                 f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}")
            n += len(batch)
        return n


# Lance storage-option names (object_store's) -> what boto3 needs.
_S3_OPTION_ALIASES = {
    "aws_access_key_id": ("access_key_id", "aws_access_key_id"),
    "aws_secret_access_key": ("secret_access_key", "aws_secret_access_key"),
    "aws_session_token": ("session_token", "aws_session_token", "token"),
    "aws_region": ("region", "aws_region", "aws_default_region"),
    "aws_endpoint": ("endpoint", "aws_endpoint", "aws_endpoint_url", "endpoint_url"),
}


def _opt(options: Mapping[str, str], name: str) -> str | None:
    for alias in _S3_OPTION_ALIASES[name]:
        for k, v in options.items():
            if k.lower() == alias and v not in (None, ""):
                return str(v)
    return None


def make_s3_client(storage_options: Mapping[str, str]):
    """A boto3 S3 client configured from Lance-style storage options."""
    import boto3
    from botocore.config import Config

    attempts = int(storage_options.get("s3_max_attempts", 8))
    cfg = Config(
        # total_max_attempts: botocore's `max_attempts` counts retries, not attempts.
        retries={"total_max_attempts": attempts, "mode": "standard"},
        connect_timeout=float(storage_options.get("s3_connect_timeout", 5)),
        read_timeout=float(storage_options.get("s3_read_timeout", 30)),
        s3={"addressing_style": "path"} if _opt(storage_options, "aws_endpoint") else None,
        max_pool_connections=64,
    )
    return boto3.client(
        "s3",
        endpoint_url=_opt(storage_options, "aws_endpoint"),
        aws_access_key_id=_opt(storage_options, "aws_access_key_id"),
        aws_secret_access_key=_opt(storage_options, "aws_secret_access_key"),
        aws_session_token=_opt(storage_options, "aws_session_token"),
        region_name=_opt(storage_options, "aws_region") or "us-east-1",
        config=cfg,
    )


@dataclass(frozen=True)
class TableLocation:
    """Where a table lives: the store, the URI to give Lance, and Lance's storage options."""

    store: ObjectStore
    lance_uri: str
    storage_options: dict[str, str]

    def __repr__(self) -> str:  # the options hold credentials: show their names only
        return f"TableLocation({self.lance_uri!r}, storage_options={sorted(self.storage_options)})"

    def child_uri(self, key: str) -> str:
        return self.lance_uri.rstrip("/") + "/" + _clean(key)


def open_store(uri: str, storage_options: Mapping[str, str] | None = None) -> TableLocation:
    """`file://` URIs, plain paths and `s3://bucket/prefix`; anything else is refused clearly.

    With `MEMWAL_CRASH_AFTER_OPS` / `MEMWAL_COUNT_OPS` set (reliability tests only) the store
    counts its writes (`faults.CrashingStore`).
    """
    loc = _open_store(uri, storage_options)
    if faults.counting():
        loc = TableLocation(faults.CrashingStore(loc.store, uncounted=(layout.LEASE_DIR + "/",)),
                            loc.lance_uri, loc.storage_options)
    return loc


def _open_store(uri: str, storage_options: Mapping[str, str] | None) -> TableLocation:
    options = {k: str(v) for k, v in (storage_options or {}).items()}
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else uri
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI with a host is not supported: {uri}")
        path = os.path.abspath(os.path.expanduser(path))
        return TableLocation(LocalStore(path), path, {})
    if parsed.scheme in ("s3", "s3a"):
        if not parsed.netloc:
            raise ValueError(f"S3 URI without a bucket: {uri}")
        # Lance (object_store) percent-decodes the URI's path: `a%20b` is the key prefix `a b`
        # (`%2F` a `/`, `+` itself). The store decodes it the same way; Lance keeps the URI as given.
        raw_prefix = parsed.path.strip("/")
        prefix = unquote(raw_prefix).strip("/")
        lance_uri = f"s3://{parsed.netloc}/{raw_prefix}".rstrip("/")
        lance_options = dict(options)
        endpoint = _opt(options, "aws_endpoint")
        if endpoint and endpoint.startswith("http://"):
            lance_options.setdefault("allow_http", "true")
        lance_options.pop("s3_max_attempts", None)
        lance_options.pop("s3_connect_timeout", None)
        lance_options.pop("s3_read_timeout", None)
        store = S3Store(parsed.netloc, prefix, make_s3_client(options), lance_uri)
        return TableLocation(store, lance_uri, lance_options)
    raise ValueError(f"unsupported table URI scheme {parsed.scheme!r} in {uri} "
                     "(use a local path, file://, or s3://)")

