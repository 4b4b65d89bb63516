"""Object stores under a table root: local disk and S3 (or any S3-protocol server); `gs://` and
`az://` tables are `cloud_store.CloudStore`s, opened here too.

Keys are '/'-separated and relative to the table root. Every manifest commit goes through
`put_if_absent`, the only primitive that makes concurrent committers safe, so both stores
implement it atomically (a hard link on local disk, `IfNoneMatch='*'` on S3).
Both count their requests by kind in `stats`, which benchmarks and the "a tick over unchanged
regions must not list" tests read. Every error either raises, other than "not found", is a
`StoreError` naming the operation and the object (local path, or s3://bucket/key).
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Protocol
from urllib.parse import unquote, urlparse

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from memwal_core import faults
from memwal_core.state import layout
from memwal_core.state.cloud_store import SECRET_ALIASES as CLOUD_SECRET_ALIASES
from memwal_core.state.cloud_store import CloudStore
from memwal_core.state.objects import (  # noqa: F401 - the store vocabulary, imported from here too
    BODY_RETRY_BACKOFF_S,
    BODY_RETRY_MAX_BACKOFF_S,
    BrokeOff,
    NotFound,
    ObjectInfo,
    StoreError,
    _clean,
    resend,
)


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


@contextlib.contextmanager
def _local_errors(kind: str, path: str):
    """An OS error of a local-disk operation as a `StoreError` naming the operation and path
    (the handlers inside take the ones they expect first: not found, already exists)."""
    try:
        yield
    except StoreError:
        raise
    except OSError as e:
        raise StoreError(f"local {kind} {path} failed: {type(e).__name__}: {e.strerror or e}") from e


class SymlinkRefused(StoreError):
    """A path under a local table root goes through a symbolic link: memwal never follows one."""


class LocalStore:
    """A directory on local disk.

    No symbolic link below the root is ever followed: every key is resolved component by
    component with `lstat`, and a key that passes a link is refused (`SymlinkRefused`), for
    reads, listings and deletes alike. A region directory (or a generation, WAL or manifest
    directory inside one) planted as a link to elsewhere is thus a refused region, never a
    way for GC to delete files outside the table. The root itself may be a link.
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.uri = self.root
        self.stats: collections.Counter = collections.Counter()

    def _path(self, key: str) -> str:
        parts = _clean(key).rstrip("/").split("/")
        path = self.root
        for p in parts:
            path = os.path.join(path, p)
            try:
                mode = os.lstat(path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                # The rest does not exist (yet): nothing to follow.
                return os.path.join(self.root, *parts)
            if stat.S_ISLNK(mode):
                raise SymlinkRefused(f"{path} is a symbolic link (to {os.readlink(path)!r}): memwal never "
                                     f"follows links under a table root; refusing {key!r}")
        return path

    def get(self, key: str) -> bytes:
        self.stats["get"] += 1
        path = self._path(key)
        try:
            with _local_errors("get", path), open(path, "rb") as f:
                return f.read()
        except StoreError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise NotFound(key) from None
            raise

    def head(self, key: str) -> ObjectInfo | None:
        self.stats["head"] += 1
        path = self._path(key)
        try:
            with _local_errors("head", path):
                st = os.stat(path)
        except StoreError as e:
            if isinstance(e.__cause__, (FileNotFoundError, NotADirectoryError)):
                return None
            raise
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def _write_temp(self, path: str, data: bytes) -> str:
        def make() -> tuple[int, str]:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return tempfile.mkstemp(dir=os.path.dirname(path), prefix=".memwal-tmp-")

        # Another process's delete_many pruned the directory while it was being made (or made
        # it again in between): make it again, at once (a race between two calls, not a load).
        fd, tmp = Retrying(stop=stop_after_attempt(20), reraise=True,
                           retry=retry_if_exception_type((FileNotFoundError, FileExistsError)))(make)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        self.stats["put"] += 1
        path = self._path(key)
        with _local_errors("put", path):
            os.replace(self._write_temp(path, data), path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomic across processes: the complete file is linked into place or not at all."""
        self.stats["put_if_absent"] += 1
        path = self._path(key)
        with _local_errors("put_if_absent", path):
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

        def unreadable(e: OSError) -> None:  # os.walk skips what it cannot read: a listing with holes
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)):  # gone, never there, a file: nothing
                raise StoreError(f"local list {e.filename or base} failed: {type(e).__name__}: {e.strerror or e}")

        root = self.root.rstrip(os.sep) + os.sep
        for dirpath, dirs, files in os.walk(base, onerror=unreadable, followlinks=False):
            # Keys relative to the root: a prefix cut (os.walk joins below `base`, under the root),
            # `relpath` otherwise; a listing of thousands of versions spent most of its time there.
            rel_dir = dirpath[len(root):] + os.sep if dirpath.startswith(root) else None
            for name in dirs + files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    raise SymlinkRefused(f"{full} is a symbolic link (to {os.readlink(full)!r}): memwal never "
                                         f"follows links under a table root; refusing to list {prefix!r}")
                if name in dirs:
                    continue
                rel = (rel_dir + name if rel_dir is not None else os.path.relpath(full, self.root)).replace(os.sep, "/")
                yield ObjectInfo(rel, st.st_size, st.st_mtime)

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-"directories" under `prefix`."""
        self.stats["list"] += 1
        path = self._path(prefix) if prefix else self.root
        try:
            with _local_errors("list", path), os.scandir(path) as it:
                return sorted(e.name for e in it if e.is_dir())
        except StoreError as e:
            if isinstance(e.__cause__, (FileNotFoundError, NotADirectoryError)):
                return []
            raise

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        dirs: set[str] = set()
        keys = list(keys)
        paths = [self._path(k) for k in keys]  # every key checked before the first delete
        real_root = os.path.realpath(self.root)
        for key, path in zip(keys, paths):
            if not os.path.realpath(path).startswith(real_root + os.sep):
                raise SymlinkRefused(f"refusing to delete {key!r}: it resolves to {os.path.realpath(path)}, "
                                     f"outside the table root {real_root}")
        for key, path in zip(keys, paths):
            self.stats["delete"] += 1
            try:
                with _local_errors("delete", path):
                    os.unlink(path)
                n += 1
                dirs.add(os.path.dirname(path))
            except StoreError as e:
                if not isinstance(e.__cause__, FileNotFoundError):
                    raise
        # Remove directories left empty, deepest first, never above the root.
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)
        return n


def refuse_links(store: ObjectStore, key: str) -> None:
    """Raise `SymlinkRefused` when `key` passes a symbolic link on a local store (for what
    memwal hands to Lance by URI, such as a generation directory: Lance would follow it)."""
    if isinstance(store, LocalStore):
        store._path(key)


class S3Store:
    """A prefix in an S3 bucket, through boto3.

    Retries: botocore's "standard" mode retries a request (throttling, 5xx, a connection
    dropped before the answer was read) with exponential backoff and jitter, `attempts` times
    in all (the `s3_max_attempts` storage option). It does not cover an object's body, which
    is streamed after the request returned: `get` retries the whole GET when its body read
    fails (a connection reset mid-body), `attempts` times with backoff from
    `BODY_RETRY_BACKOFF_S`, doubling up to `BODY_RETRY_MAX_BACKOFF_S`.
    Deletes go out in `delete_objects` batches of up to 1,000 keys.
    """

    def __init__(self, bucket: str, prefix: str, client, uri: str, attempts: int = 8):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client
        self.uri = uri
        self.attempts = max(1, int(attempts))
        self.stats: collections.Counter = collections.Counter()

    def _key(self, key: str) -> str:
        key = _clean(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _call(self, kind: str, fn, target: str | None = None, **kw):
        """One request (botocore retries it); a failure other than an S3 error answer becomes a
        `StoreError` naming the operation and the object (`target`: the key, if not `Key`/`Prefix`)."""
        from botocore.exceptions import BotoCoreError, ClientError

        self.stats[kind] += 1
        try:
            return fn(**kw)
        except ClientError:
            raise
        except BotoCoreError as e:  # connection refused, timeouts after retries, ...
            what = target if target is not None else kw.get("Key", kw.get("Prefix", ""))
            raise StoreError(f"S3 {kind} s3://{self.bucket}/{what} failed: {e}") from None

    @staticmethod
    def _code(e) -> str:
        return str(e.response.get("Error", {}).get("Code", ""))

    def _raise(self, kind: str, key: str, e) -> None:
        code = self._code(e)
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        hint = " (access denied: check the credentials and the bucket policy)" if status == 403 else ""
        raise StoreError(f"S3 {kind} s3://{self.bucket}/{key} failed: {code or status}{hint}") from None

    def get(self, key: str) -> bytes:
        """The object's bytes; a body whose read fails (a connection reset mid-body, a short
        body) is fetched again, up to `attempts` GETs with backoff."""
        from botocore.exceptions import BotoCoreError, ClientError

        k = self._key(key)

        def once() -> bytes:
            try:
                body = self._call("get", self.client.get_object, Bucket=self.bucket, Key=k)["Body"]
            except ClientError as e:
                if self._code(e) in ("NoSuchKey", "404"):
                    raise NotFound(key) from None
                self._raise("get", k, e)
            try:
                with contextlib.closing(body):
                    return body.read()
            except (BotoCoreError, OSError) as e:  # mid-body: botocore does not retry a streamed body
                raise BrokeOff() from e

        try:
            return resend(self.attempts, self.stats, "get_body_retry")(once)
        except BrokeOff as e:
            c = e.__cause__
            raise StoreError(f"S3 get s3://{self.bucket}/{k} failed: reading the body broke off "
                             f"{max(1, self.attempts)} times, last: {type(c).__name__}: {c}") from None

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
        """True when `key` now holds `data` written by this call; False when another writer's
        object was there first.

        A conditional PUT whose answer was lost (the connection dropped after the server stored
        it) is retried by botocore and then answered 412 by our own object: after a retried
        412 the object is read back, and holding exactly `data` counts as written."""
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            self._call("put_if_absent", self.client.put_object, Bucket=self.bucket, Key=k,
                       Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            if self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                if e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0:
                    try:
                        return self.get(key) == data
                    except NotFound:  # deleted meanwhile: it was not ours to keep
                        return False
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
            target = f"{batch[0]['Key']} (and {len(batch) - 1} more keys)" if len(batch) > 1 else batch[0]["Key"]
            try:
                r = self._call("delete_batch", self.client.delete_objects, target, Bucket=self.bucket,
                               Delete={"Objects": batch, "Quiet": True})
            except ClientError as e:
                self._raise("delete_objects", target, e)
            errors = r.get("Errors", [])
            if errors:
                first = errors[0]
                raise StoreError(f"S3 delete_objects failed for {len(errors)} keys, first "
                                 f"s3://{self.bucket}/{first.get('Key')}: {first.get('Code')} "
                                 f"{first.get('Message', '')}")
            n += len(batch)
        return n


DEFAULT_S3_MAX_ATTEMPTS = 8

# Lance storage-option names (object_store's) -> what boto3 needs.
_S3_OPTION_ALIASES = {
    "aws_access_key_id": ("access_key_id", "aws_access_key_id"),
    "aws_secret_access_key": ("secret_access_key", "aws_secret_access_key"),
    "aws_session_token": ("session_token", "aws_session_token", "token"),
    "aws_region": ("region", "aws_region", "aws_default_region"),
    "aws_endpoint": ("endpoint", "aws_endpoint", "aws_endpoint_url", "endpoint_url"),
    **CLOUD_SECRET_ALIASES,  # the secret options of gs:// and az:// tables
}


def _opt(options: Mapping[str, str], name: str) -> str | None:
    for alias in _S3_OPTION_ALIASES[name]:
        for k, v in options.items():
            if k.lower() == alias and v not in (None, ""):
                return str(v)
    return None


def s3_attempts(storage_options: Mapping[str, str]) -> int:
    """Attempts per S3 request (botocore's) and per object body (`S3Store.get`)."""
    return max(1, int(storage_options.get("s3_max_attempts", DEFAULT_S3_MAX_ATTEMPTS)))


def make_s3_client(storage_options: Mapping[str, str]):
    """A boto3 S3 client configured from Lance-style storage options."""
    import boto3
    from botocore.config import Config

    attempts = s3_attempts(storage_options)
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
    """`file://` URIs, plain paths, `s3://bucket/prefix`, `gs://bucket/prefix` and
    `az://container/prefix`; anything else is refused clearly.

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
        store = S3Store(parsed.netloc, prefix, make_s3_client(options), lance_uri, s3_attempts(options))
        return TableLocation(store, lance_uri, lance_options)
    if parsed.scheme in ("gs", "az"):
        return _open_cloud(uri, parsed, options)
    raise ValueError(f"unsupported table URI scheme {parsed.scheme!r} in {uri} "
                     "(use a local path, file://, s3://, gs:// or az://)")


def _open_cloud(uri: str, parsed, options: dict[str, str]) -> TableLocation:
    """`gs://bucket/prefix` and `az://container/prefix` (the Azure account is the storage
    option `azure_storage_account_name`, or the environment's AZURE_STORAGE_ACCOUNT_NAME)."""
    if not parsed.netloc:
        raise ValueError(f"{parsed.scheme}:// URI without a {'bucket' if parsed.scheme == 'gs' else 'container'}: {uri}")
    if "@" in parsed.netloc:
        raise ValueError(f"{uri}: write the table as az://CONTAINER/PREFIX and give the account as the "
                         "storage option azure_storage_account_name")
    scheme = parsed.scheme
    # As for S3: Lance percent-decodes the path; the store decodes it the same way.
    raw_prefix = parsed.path.strip("/")
    prefix = unquote(raw_prefix).strip("/")
    lance_uri = f"{scheme}://{parsed.netloc}/{raw_prefix}".rstrip("/")
    store = CloudStore(scheme, parsed.netloc, prefix, options, lance_uri)
    return TableLocation(store, lance_uri, dict(options))

