"""A GCS emulator on 127.0.0.1 that serves the requests of the Rust `object_store` crate (the
client of Lance, LanceDB and obstore), run in-process by the tests.

It is `gcp-storage-emulator` (a dev dependency: its JSON API, buckets, and its in-memory object
storage) with the part of the XML API that `object_store` speaks and the emulator lacks, added
here: the emulator answers an XML `PUT` without the `ETag` header `object_store` requires, and has
no `HEAD`, no XML `DELETE`, no `list-type=2` listing, no copy (`x-goog-copy-source`), no XML
multipart upload and no preconditions. So this module serves, for `/{bucket}/{object}`:

- `PUT` (with `ETag` and `x-goog-generation`), copy by `x-goog-copy-source`, and
  `x-goog-if-generation-match` on both: `0` refuses an existing object with 412 (the
  conditional create memwal's put-if-absent relies on), `N` refuses with 412 unless the object's
  generation is N. The emulator ignores preconditions; they are implemented here, and every
  check-then-write holds one lock, so of racing creates exactly one wins (a test asserts it);
- `GET` / `HEAD` with `ETag`, `Last-Modified`, `x-goog-generation`, `Range` (206 and
  `Content-Range`), `If-Match` / `If-None-Match`, and `?generation=`;
- `DELETE`, and the multipart upload (`?uploads`, `?partNumber=&uploadId=`, `?uploadId=`);
- `GET /{bucket}?list-type=2`: prefix, delimiter, `start-after`, `max-keys` (at most 1,000 a page,
  as GCS), `continuation-token`.

A precondition this module does not implement (`x-goog-if-metageneration-match`,
`If-Modified-Since`, ...) is answered 501 rather than ignored. Everything else (`/storage/v1/...`,
`/upload/...`, `/download/...`, `/batch/...`, `/b/...`: so no bucket may be named `storage`,
`upload`, `download`, `batch` or `b`) is the emulator's own router. Object bodies and metadata
live in the emulator's `Storage`; the server keeps nothing on disk.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from email.utils import formatdate
from http import server as http_server
from xml.sax.saxutils import escape

import google_crc32c
from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.storage import Storage

_EMULATOR_PREFIXES = ("/storage/", "/upload/", "/download/", "/batch/", "/b/")
_PAGE = 1000  # GCS's XML listing answers at most 1,000 entries a page
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_IMPLEMENTED_CONDITIONS = {"x-goog-if-generation-match", "if-match", "if-none-match"}


class _MemoryStorage(Storage):
    """The emulator's storage, in memory: nothing to persist, and deletes are final (GCS's
    soft delete keeps a copy the XML API never shows)."""

    def __init__(self) -> None:
        super().__init__(use_memory_fs=True)

    def _write_config_to_file(self) -> None:  # the emulator rewrites all metadata per write
        pass

    def delete_object(self, bucket: str, name: str) -> None:
        self._hard_delete_file(bucket, name)


class _Handler(emulator_server.RequestHandler):
    protocol_version = "HTTP/1.1"  # object_store keeps connections open

    # -------------------------------------------------------------- dispatch

    def _split(self) -> tuple[str, str | None, dict[str, list[str]]] | None:
        """(bucket, object or None, query) of an XML-API request; None for the emulator's routes."""
        raw_path, _, raw_query = self.path.partition("?")
        if raw_path in ("/", "/b", "/wipe") or raw_path.startswith(_EMULATOR_PREFIXES):
            return None
        bucket, _, obj = raw_path[1:].partition("/")
        query = urllib.parse.parse_qs(raw_query, keep_blank_values=True)
        return urllib.parse.unquote(bucket), (urllib.parse.unquote(obj) if obj else None), query

    def _dispatch(self, method: str) -> None:
        parts = self._split()
        if parts is None:
            self._closing = True  # the emulator's handlers may leave a body unread: one request a connection
            with self.server.lock:
                emulator_server.Router(self).handle(method)
            return
        self._closing = False
        bucket, name, query = parts
        body = self._body() if method in ("PUT", "POST") else b""
        with self.server.lock:
            status, headers, payload = self._xml(method, bucket, name, query, body)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(headers.pop("_length", len(payload))))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload)

    def end_headers(self) -> None:
        if getattr(self, "_closing", False):
            self.send_header("Connection", "close")
        super().end_headers()

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    # -------------------------------------------------------------- the XML API

    def _xml(self, method: str, bucket: str, name: str | None, query: dict, body: bytes):
        storage: _MemoryStorage = self.storage
        unknown = sorted(h.lower() for h in self.headers if (h.lower().startswith(("x-goog-if-", "if-"))
                                                             and h.lower() not in _IMPLEMENTED_CONDITIONS))
        if unknown:
            return _error(501, "NotImplemented", f"preconditions {unknown} are not implemented by this emulator")
        if storage.get_bucket(bucket) is None:
            return _error(404, "NoSuchBucket", f"bucket {bucket} does not exist")
        if name is None:
            if method == "GET":
                return self._list(bucket, query)
            return _error(405, "MethodNotAllowed", f"{method} on a bucket")
        if method in ("GET", "HEAD"):
            return self._get(bucket, name, query, head=method == "HEAD")
        if method == "PUT" and "uploadId" in query:
            return self._put_part(query, body)
        if method == "PUT":
            return self._put(bucket, name, body)
        if method == "POST" and "uploads" in query:
            upload_id = uuid.uuid4().hex
            self.server.uploads[upload_id] = (bucket, name, {})
            return 200, {"Content-Type": "application/xml"}, _xml_doc(
                "InitiateMultipartUploadResult",
                f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(name)}</Key><UploadId>{upload_id}</UploadId>")
        if method == "POST" and "uploadId" in query:
            return self._complete(bucket, name, query["uploadId"][0], body)
        if method == "DELETE" and "uploadId" in query:
            self.server.uploads.pop(query["uploadId"][0], None)
            return 204, {}, b""
        if method == "DELETE":
            try:
                storage.delete_object(bucket, name)
            except NotFound:
                return _error(404, "NoSuchKey", f"no object {name}")
            return 204, {}, b""
        return _error(405, "MethodNotAllowed", f"{method} {name}")

    def _current(self, bucket: str, name: str) -> dict | None:
        try:
            return self.storage.get_file_obj(bucket, name)
        except NotFound:
            return None

    def _precondition(self, existing: dict | None) -> tuple | None:
        """A 412 answer when `x-goog-if-generation-match` does not hold (0: no object)."""
        want = self.headers.get("x-goog-if-generation-match")
        if want is None:
            return None
        have = existing["generation"] if existing is not None else "0"
        if str(want).strip() != have:
            return _error(412, "PreconditionFailed", f"generation is {have}, not {want}")
        return None

    def _store(self, bucket: str, name: str, data: bytes, content_type: str) -> dict:
        self.server.clock = max(self.server.clock + 1, time.time_ns())  # generations only grow
        md5 = hashlib.md5(data)
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(now))
        # The emulator's JSON API reads the same resource: its fields, with the XML API's ETag.
        obj = {"kind": "storage#object", "id": f"{bucket}/{name}/{self.server.clock}", "name": name, "bucket": bucket,
               "generation": str(self.server.clock), "metageneration": "1", "contentType": content_type,
               "size": str(len(data)), "storageClass": "STANDARD", "timeCreated": stamp, "updated": stamp,
               "md5Hash": base64.b64encode(md5.digest()).decode(),
               "crc32c": base64.b64encode(google_crc32c.Checksum(data).digest()).decode(),
               "etag": f'"{md5.hexdigest()}"', "updatedEpoch": now, "acl": []}
        self.storage.create_file(bucket, name, data, obj)
        return obj

    def _put(self, bucket: str, name: str, body: bytes):
        refused = self._precondition(self._current(bucket, name))
        if refused:
            return refused
        source = self.headers.get("x-goog-copy-source")
        content_type = self.headers.get("Content-Type") or "application/octet-stream"
        if source is not None:
            src_bucket, _, src_name = source.lstrip("/").partition("/")
            src_bucket, src_name = urllib.parse.unquote(src_bucket), urllib.parse.unquote(src_name)
            src = self._current(src_bucket, src_name)
            if src is None:
                return _error(404, "NoSuchKey", f"no object {src_name}")
            body, content_type = self.storage.get_file(src_bucket, src_name), src.get("contentType") or content_type
        obj = self._store(bucket, name, body, content_type)
        return 200, {"ETag": obj["etag"], "x-goog-generation": obj["generation"]}, b""

    def _put_part(self, query: dict, body: bytes):
        upload = self.server.uploads.get(query["uploadId"][0])
        if upload is None:
            return _error(404, "NoSuchUpload", "no such upload")
        etag = f'"{hashlib.md5(body).hexdigest()}"'
        upload[2][int(query["partNumber"][0])] = (etag, body)
        return 200, {"ETag": etag}, b""

    def _complete(self, bucket: str, name: str, upload_id: str, body: bytes):
        upload = self.server.uploads.get(upload_id)
        if upload is None or upload[:2] != (bucket, name):
            return _error(404, "NoSuchUpload", "no such upload")
        parts = upload[2]
        data = b""
        for part in ET.fromstring(body).iter():
            if not part.tag.endswith("Part"):
                continue
            number = int(next(c.text for c in part if c.tag.endswith("PartNumber")))
            etag = next(c.text for c in part if c.tag.endswith("ETag")).strip()
            if number not in parts or parts[number][0].strip('"') != etag.strip('"'):
                return _error(400, "InvalidPart", f"part {number} was not uploaded")
            data += parts[number][1]
        del self.server.uploads[upload_id]
        obj = self._store(bucket, name, data, "application/octet-stream")
        return 200, {"Content-Type": "application/xml", "x-goog-generation": obj["generation"]}, _xml_doc(
            "CompleteMultipartUploadResult",
            f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(name)}</Key><ETag>{escape(obj['etag'])}</ETag>")

    def _get(self, bucket: str, name: str, query: dict, head: bool):
        obj = self._current(bucket, name)
        if obj is None or ("generation" in query and query["generation"][0] != obj["generation"]):
            return _error(404, "NoSuchKey", f"no object {name}")
        if_match, if_none = self.headers.get("If-Match"), self.headers.get("If-None-Match")
        if if_match is not None and if_match.strip() not in (obj["etag"], "*"):
            return _error(412, "PreconditionFailed", "If-Match")
        if if_none is not None and if_none.strip() in (obj["etag"], "*"):
            return 304, {"ETag": obj["etag"]}, b""
        data = self.storage.get_file(bucket, name)
        headers = {"ETag": obj["etag"], "x-goog-generation": obj["generation"],
                   "Last-Modified": formatdate(obj["updatedEpoch"], usegmt=True),
                   "Content-Type": obj.get("contentType") or "application/octet-stream", "Accept-Ranges": "bytes"}
        status, total = 200, len(data)
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (m.group(1) == "" and m.group(2) == ""):
                return _error(400, "InvalidArgument", f"range {rng}")
            if m.group(1) == "":  # the last N bytes
                start, end = max(0, total - int(m.group(2))), total - 1
            else:
                start = int(m.group(1))
                end = min(total - 1, int(m.group(2))) if m.group(2) else total - 1
            if start >= total or start > end:
                return _error(416, "InvalidRange", f"range {rng} of {total} bytes")
            data, status = data[start:end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        if head:
            headers["_length"] = len(data)
            return status, headers, b""
        return status, headers, data

    def _list(self, bucket: str, query: dict):
        first = lambda k, d=None: query.get(k, [d])[0]  # noqa: E731
        prefix, delimiter = first("prefix", ""), first("delimiter")
        after = max(first("start-after", "") or "", first("continuation-token", "") or "")
        max_keys = min(_PAGE, int(first("max-keys", _PAGE)))
        entries: list[tuple[str, dict | None]] = []  # (key or common prefix, object or None)
        seen_prefixes: set[str] = set()
        for key, obj in sorted(self.storage.objects.get(bucket, {}).items()):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                if common not in seen_prefixes:
                    seen_prefixes.add(common)
                    entries.append((common, None))
            else:
                entries.append((key, obj))
        entries = [e for e in entries if e[0] > after]
        page, truncated = entries[:max_keys], len(entries) > max_keys
        body = [f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
                f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        for key, obj in page:
            if obj is None:
                body.append(f"<CommonPrefixes><Prefix>{escape(key)}</Prefix></CommonPrefixes>")
            else:
                modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(obj["updatedEpoch"]))
                body.append(f"<Contents><Key>{escape(key)}</Key><Generation>{obj['generation']}</Generation>"
                            f"<LastModified>{modified}</LastModified><ETag>{escape(obj['etag'])}</ETag>"
                            f"<Size>{obj['size']}</Size></Contents>")
        if truncated:
            body.append(f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>")
        return 200, {"Content-Type": "application/xml"}, _xml_doc("ListBucketResult", "".join(body))


def _xml_doc(root: str, inner: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><{root} xmlns="http://doc.s3.amazonaws.com/2006-03-01">'
            f"{inner}</{root}>").encode()


def _error(status: int, code: str, message: str):
    return status, {"Content-Type": "application/xml"}, (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{escape(message)}</Message></Error>").encode()


class _Server(http_server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.storage = _MemoryStorage()
        self.lock = threading.Lock()  # every check-then-write (and every emulator call) under it
        self.clock = 0
        self.uploads: dict[str, tuple[str, str, dict]] = {}
        super().__init__(address, lambda *a: _Handler(self.storage, *a))


def main(argv: list[str] | None = None) -> None:
    """`python gcs_server.py PORT`: serve on 127.0.0.1:PORT until terminated. The tests run it
    as a subprocess, so a test's own Python threads never wait on the server's (or the other
    way round, under the GIL)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    _Server(("127.0.0.1", int(args[0]))).serve_forever()


if __name__ == "__main__":
    main()
