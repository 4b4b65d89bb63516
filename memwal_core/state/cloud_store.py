"""Google Cloud Storage (`gs://`) and Azure Blob Storage (`az://`) tables, through obstore.

obstore wraps the Rust `object_store` crate that Lance itself uses, so a table's storage
options are ONE dict under Lance's own names, read by both: `google_*` / `azure_*` keys configure
the service (account, key, endpoint, service account), the HTTP client keys (`allow_http`,
`timeout`, `connect_timeout`, ...) the client, and Lance's `client_max_retries` /
`client_retry_timeout` the retries. Credentials may equally come from the environment
(`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, `GOOGLE_SERVICE_ACCOUNT`, ...),
which both Lance and obstore read; memwal never prints an option's value.

The guarantees match `S3Store`: `put_if_absent` is the server's conditional create
(`If-None-Match: *` on Azure, `x-goog-if-generation-match: 0` on GCS); listings follow the server's
pagination (object_store pages through them); deletes go out in batches (Azure's blob batch,
256 keys a request; GCS has no batch delete: object_store sends them concurrently); each request is
retried with exponential backoff by object_store (which also resumes a body cut off mid-read);
on top of that memwal sends a GET again when the body keeps breaking off, like `S3Store.get`, and
a conditional create whose connection broke (see `CloudStore.put_if_absent`). Every failure other than "not found" is a `StoreError`
naming the operation and the object (`az://container/key`).
"""

from __future__ import annotations

import collections
import re
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping

from memwal_core.state.objects import (
    BrokeOff,
    NotFound,
    ObjectInfo,
    StoreError,
    _clean,
    resend,
)

# URI scheme -> (object_store's config-key prefix, a name for messages).
SCHEMES = {"gs": ("google_", "GCS"), "az": ("azure_", "Azure")}
# object_store's HTTP client options (the same names in Lance's storage options).
CLIENT_OPTIONS = ("allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
                  "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate",
                  "proxy_excludes", "randomize_addresses", "read_timeout", "timeout", "user_agent")
_BOOL_CLIENT_OPTIONS = ("allow_http", "allow_invalid_certificates", "randomize_addresses")
# Keys per delete call: one Azure blob batch request (at most 256 sub-requests; a longer list
# object_store would send as concurrent batches, which a slow server answers past the client
# timeout); GCS has no batch delete, object_store sends the deletes of a call concurrently.
DELETE_BATCH = {"az": 256, "gs": 1000}
# The secret options of gs:// and az:// tables, each with every spelling object_store accepts
# (for the config's `secrets:`, the refusal of a secret written into `storage_options`, and
# the redaction of error messages).
SECRET_ALIASES = {
    "azure_storage_account_key": ("azure_storage_account_key", "azure_storage_access_key",
                                  "azure_storage_master_key", "master_key", "account_key", "access_key"),
    "azure_storage_sas_key": ("azure_storage_sas_key", "azure_storage_sas_token", "sas_key", "sas_token"),
    "azure_client_secret": ("azure_client_secret", "azure_storage_client_secret", "client_secret"),
    "google_service_account_key": ("google_service_account_key", "service_account_key"),
}
CREATE_SENDS = 3  # sends of one conditional create whose connection broke (`put_if_absent`)
DEFAULT_MAX_RETRIES = 10  # object_store's own default: Lance's `client_max_retries`
DEFAULT_RETRY_TIMEOUT_S = 180  # object_store's own default: Lance's `client_retry_timeout`


def _not_found() -> tuple[type[BaseException], ...]:
    from obstore.exceptions import NotFoundError

    return (FileNotFoundError, NotFoundError)  # obstore raises either, depending on the call


try:
    _NOT_FOUND = _not_found()
except ImportError:  # obstore missing: `CloudStore` says so when a gs:// or az:// table is opened
    _NOT_FOUND = (FileNotFoundError,)


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def obstore_arguments(scheme: str, options: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of `obstore.store.from_url` for Lance-style storage options:
    service keys (`google_*` / `azure_*`) as they are, client keys as client options, Lance's
    retry keys as a retry config. Other keys (Lance's own, memwal's) are Lance's business.
    (obstore aborts the process on a config key of another service: they are never passed.)"""
    prefix = SCHEMES[scheme][0]
    config = {k.lower(): str(v) for k, v in options.items() if k.lower().startswith(prefix)}
    client: dict[str, Any] = {}
    for k, v in options.items():
        if k.lower() in CLIENT_OPTIONS:
            client[k.lower()] = _truthy(v) if k.lower() in _BOOL_CLIENT_OPTIONS else str(v)
    retries = int(options.get("client_max_retries", DEFAULT_MAX_RETRIES))
    timeout = float(options.get("client_retry_timeout", DEFAULT_RETRY_TIMEOUT_S))
    retry = {"max_retries": max(0, retries), "retry_timeout": timedelta(seconds=timeout),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                         "base": 2}}
    return {"config": config, "client_options": client, "retry_config": retry}


# A SAS token travels in the request URL, which object_store's errors quote: its signature
# (and any other credential-like query value) is cut out of every message.
_SIGNED_QUERY = re.compile(r"(?i)([?&](?:sig|signature|x-goog-signature|x-goog-credential|token)=)[^&\s]*")


def _first_line(e: BaseException, secrets: Iterable[str] = ()) -> str:
    """The error's first line, without a secret: neither a signed URL's signature nor any
    secret option's value (however the message quotes it)."""
    lines = str(e).strip().splitlines()
    text = _SIGNED_QUERY.sub(r"\1[redacted]", lines[0] if lines else "")
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return f"{type(e).__name__}: {text}"[:500]


def secret_values(options: Mapping[str, str]) -> list[str]:
    """The values of the secret options among `options` (every spelling object_store accepts)."""
    names = {a for aliases in SECRET_ALIASES.values() for a in aliases}
    return sorted({str(v) for k, v in options.items() if k.lower() in names and len(str(v)) >= 4}, key=len,
                  reverse=True)


class CloudStore:
    """A prefix in a GCS bucket or an Azure container, through obstore (see the module docstring).

    `attempts` bounds memwal's own resends on top of object_store's retries: the GETs of an
    object whose body keeps breaking off, and a conditional create whose connection broke."""

    def __init__(self, scheme: str, bucket: str, prefix: str, options: Mapping[str, str], uri: str,
                 attempts: int = 8):
        from obstore.store import from_url

        self.scheme = scheme
        self.service = SCHEMES[scheme][1]
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = uri
        self.attempts = max(1, int(attempts))
        self.stats: collections.Counter = collections.Counter()
        self._secrets = secret_values(options)
        try:
            self._store = from_url(f"{scheme}://{bucket}", **obstore_arguments(scheme, options))
        except BaseException as e:  # obstore raises (or panics) on a bad option: name the table only
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise StoreError(f"{self.service} store for {uri} could not be configured: {_first_line(e, self._secrets)} "
                             f"(storage options given: {sorted(options)})") from None

    def _key(self, key: str) -> str:
        key = _clean(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _name(self, full: str) -> str:
        return f"{self.scheme}://{self.bucket}/{full}"

    def _fail(self, kind: str, full: str, e: BaseException) -> StoreError:
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        hint = ""
        text = str(e)
        if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or " 403 Forbidden" in text or \
                " 401 Unauthorized" in text:
            hint = " (access denied: check the credentials and the bucket's permissions)"
        return StoreError(f"{self.service} {kind} {self._name(full)} failed: {_first_line(e, self._secrets)}{hint}")

    def get(self, key: str) -> bytes:
        """The object's bytes; a body whose read fails is fetched again, up to `attempts` GETs."""
        import obstore

        full = self._key(key)

        def once() -> bytes:
            self.stats["get"] += 1
            try:
                result = obstore.get(self._store, full)
            except _NOT_FOUND:
                raise NotFound(key) from None
            except Exception as e:  # noqa: BLE001 - every other failure names the object
                raise self._fail("get", full, e) from None
            try:
                return bytes(result.bytes())
            except _NOT_FOUND:  # deleted between the answer and the body
                raise NotFound(key) from None
            except Exception as e:  # noqa: BLE001 - mid-body: GET again
                raise BrokeOff() from e

        try:
            return resend(self.attempts, self.stats, "get_body_retry")(once)
        except BrokeOff as e:
            raise StoreError(f"{self.service} get {self._name(full)} failed: reading the body broke off "
                             f"{max(1, self.attempts)} times, last: {_first_line(e.__cause__, self._secrets)}") from None

    def head(self, key: str) -> ObjectInfo | None:
        import obstore

        full = self._key(key)
        self.stats["head"] += 1
        try:
            meta = obstore.head(self._store, full)
        except _NOT_FOUND:
            return None
        except Exception as e:  # noqa: BLE001
            raise self._fail("head", full, e) from None
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp())

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def put(self, key: str, data: bytes) -> None:
        import obstore

        full = self._key(key)
        self.stats["put"] += 1
        try:
            obstore.put(self._store, full, data)
        except Exception as e:  # noqa: BLE001
            raise self._fail("put", full, e) from None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """True when `key` now holds `data` written by this call; False when another writer's
        object was there first. The server decides (a conditional create), so of racing
        writers exactly one gets True.

        object_store does not resend a conditional create whose connection broke (the server
        may have stored it): memwal does, `CREATE_SENDS` times in all, with backoff (each send
        has object_store's retries of its own: a server that is gone fails after those). The resend of a
        create the server had stored is refused by our own object, so on "already exists" the
        object is read back, and holding exactly `data` counts as written (callers that must
        tell two writers of identical bytes apart put something of their own in the bytes)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, GenericError, PreconditionError

        full = self._key(key)
        sends = min(self.attempts, CREATE_SENDS)

        def once() -> bool:
            self.stats["put_if_absent"] += 1
            try:
                obstore.put(self._store, full, data, mode="create")
                return True
            except (AlreadyExistsError, PreconditionError):
                try:
                    return self.get(key) == data
                except NotFound:  # deleted meanwhile: it was not ours to keep
                    return False
            except GenericError as e:  # the connection broke (after object_store's own retries)
                raise BrokeOff() from e
            except Exception as e:  # noqa: BLE001 - not found (no bucket), denied, ...: no resend
                raise self._fail("put_if_absent", full, e) from None

        try:
            return resend(sends, self.stats, "put_if_absent_retry")(once)
        except BrokeOff as e:
            raise self._fail("put_if_absent", full, e.__cause__) from None

    def _dir(self, prefix: str) -> str:
        full = self._key(prefix) if prefix else self.prefix
        return full.rstrip("/") + "/" if full else ""

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        import obstore

        full = self._dir(prefix)
        self.stats["list"] += 1
        try:
            for chunk in obstore.list(self._store, full or None):
                for o in chunk:
                    yield ObjectInfo(self._rel(o["path"]), int(o["size"]), o["last_modified"].timestamp())
        except _NOT_FOUND:
            return
        except Exception as e:  # noqa: BLE001
            raise self._fail("list", full, e) from None

    def list_dirs(self, prefix: str) -> list[str]:
        import obstore

        full = self._dir(prefix)
        self.stats["list"] += 1
        try:
            result = obstore.list_with_delimiter(self._store, full or None)
        except _NOT_FOUND:
            return []
        except Exception as e:  # noqa: BLE001
            raise self._fail("list", full, e) from None
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"])

    def _delete(self, paths: str | list[str]) -> None:
        """One delete request (a key or a batch), sent again while it never reached the server.
        Azurite drops idle pooled connections, and object_store does not resend the batch POST
        (nor, on Azure, a single delete, which goes out as a batch of one): deletes are
        idempotent, so memwal does. A key already gone raises object_store's not-found."""
        import obstore

        def once() -> None:
            try:
                obstore.delete(self._store, paths)
            except _NOT_FOUND:
                raise
            except Exception as e:  # noqa: BLE001
                if "error sending request" in str(e):
                    raise BrokeOff() from e
                raise

        try:
            resend(self.attempts, self.stats, "delete_batch_resent")(once)
        except BrokeOff as e:
            raise e.__cause__ from None

    def delete_many(self, keys: Iterable[str]) -> int:
        """Deletes `keys` (a key already gone counts as deleted, as on S3); returns how many."""
        keys = list(keys)
        fulls = [self._key(k) for k in keys]  # every key checked before the first delete
        size = DELETE_BATCH[self.scheme]
        for i in range(0, len(fulls), size):
            batch = fulls[i:i + size]
            target = f"{batch[0]} (and {len(batch) - 1} more keys)" if len(batch) > 1 else batch[0]
            self.stats["delete_batch"] += 1
            try:
                self._delete(batch)
            except _NOT_FOUND:
                # Azure's batch answers 404 for a key already gone and stops there: delete the
                # batch one by one, passing over the missing ones.
                for full in batch:
                    self.stats["delete"] += 1
                    try:
                        self._delete(full)
                    except _NOT_FOUND:
                        pass
                    except Exception as e:  # noqa: BLE001
                        raise self._fail("delete", full, e) from None
            except Exception as e:  # noqa: BLE001
                raise self._fail("delete_many", target, e) from None
        return len(keys)
