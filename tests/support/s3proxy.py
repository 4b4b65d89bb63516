"""A fault-injecting HTTP proxy in front of an S3-protocol server (moto in the tests).

Both S3 clients memwal uses talk to it as if it were the server (`aws_endpoint` = the proxy):
boto3 (memwal's store) and Lance's Rust object_store. Every request is forwarded unchanged
(headers, body, chunked encoding) and classified by kind, so tests can count what reached the
"server" and inject faults by kind:

- `throttle(kind, count)`: the next `count` requests of that kind are answered by the proxy
  with `503 SlowDown` and S3's XML error body, without reaching the server;
- `down()`: the listening socket is closed and every open connection is reset, exactly what a
  client sees when the server process dies (connection refused / reset); `up()` listens again
  **on the same port**, and the server behind it still has its data (unlike a restarted moto);
- `cut_after(predicate)`: forward the first request matching `predicate`, answer it, then go
  down: "the server died right after this request" at a precise point of a run;
- `cut_body(kind, count, match=..., keep=0.5)`: the next `count` matching requests are
  forwarded and answered with the full headers (Content-Length of the whole body) but only
  the first `keep` fraction of the body, then the connection is reset (RST): a connection
  dropped mid-body, which a client sees only while reading the body;
- `drop_answer(kind, count, match=...)`: the next `count` matching requests reach the server
  (which acts on them), then the connection is reset before any answer: a client cannot
  tell whether its request took effect;
- `before(predicate, action)`: run `action` (e.g. plant an object on the server) right before
  the first matching request is forwarded: another writer winning a race at an exact moment;
- `after(predicate, action, count)`: run `action(request, body, payload)` right after the
  server answered a matching request (up to `count` of them); a returned `bytes` replaces the
  answer's body (e.g. a DeleteObjects answer with per-key errors for keys put back on the server).

Kinds (path-style addressing): `list` (GET on a bucket), `get`, `head`, `put`,
`put_if_absent` (PUT with `If-None-Match`), `delete`, `delete_batch` (POST ?delete),
`multipart` (the multipart-upload calls), `other`.
"""

from __future__ import annotations

import collections
import http.client
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, unquote, urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it (headers lower-cased)."""

    method: str
    kind: str
    bucket: str
    key: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    status: int = 0  # what the client got (0: connection cut before a response)
    injected: bool = False
    at: float = 0.0  # time.monotonic() when the request arrived


def classify(method: str, path: str, query: dict, headers: dict[str, str]) -> tuple[str, str, str]:
    """(kind, bucket, key) of a path-style S3 request."""
    parts = unquote(path).lstrip("/").split("/", 1)
    bucket = parts[0]
    key = parts[1] if len(parts) > 1 else ""
    if "uploads" in query or "uploadId" in query:
        return "multipart", bucket, key
    if method == "GET":
        return ("get" if key else "list"), bucket, key
    if method == "HEAD":
        return ("head" if key else "head_bucket"), bucket, key
    if method == "PUT":
        if not key:
            return "create_bucket", bucket, key
        return ("put_if_absent" if "if-none-match" in headers else "put"), bucket, key
    if method == "POST" and "delete" in query:
        return "delete_batch", bucket, key
    if method == "DELETE":
        return "delete", bucket, key
    return "other", bucket, key


@dataclass
class _Fault:
    kind: str
    remaining: int
    status: int
    code: str
    message: str
    match: Callable[[Request], bool] | None = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


@dataclass
class S3Proxy:
    upstream: str  # http://host:port of the real server
    port: int = 0
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        u = urlsplit(self.upstream)
        self._up_host, self._up_port = u.hostname, u.port or 80
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._cut: Callable[[Request], bool] | None = None
        self._before: list[tuple[Callable[[Request], bool], Callable[[Request], None]]] = []
        self._after: list[list] = []  # [predicate, action, remaining]
        self._body_cuts: list[list] = []  # [kind, remaining, match, keep]; keep None: no answer at all
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._down = threading.Event()
        self.cut_at: Request | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3Proxy":
        proxy = self

        class Handler(_Handler):
            pass

        Handler.proxy = proxy
        self._server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._down.clear()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"s3proxy:{self.port}", daemon=True)
        self._thread.start()
        return self

    def down(self) -> None:
        """Refuse new connections and reset open ones (the server "died")."""
        self._down.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def up(self) -> None:
        """Listen again on the same port; the data behind it is intact."""
        if self._server is None:
            deadline = time.time() + 10
            while True:
                try:
                    self.start()
                    return
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)

    @property
    def is_down(self) -> bool:
        return self._down.is_set()

    def stop(self) -> None:
        self.down()

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def throttle(self, kind: str, count: int, *, status: int = 503, code: str = "SlowDown",
                 message: str = "Please reduce your request rate.",
                 match: Callable[[Request], bool] | None = None) -> None:
        """Answer the next `count` requests of `kind` (and `match`, if given) with an S3 error."""
        with self._lock:
            self._faults.append(_Fault(kind, count, status, code, message, match))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._cut = None
            self._before.clear()
            self._after.clear()
            self._body_cuts.clear()

    def before(self, predicate: Callable[[Request], bool], action: Callable[[Request], None]) -> None:
        """Run `action(request)` once, right before forwarding the first request matching
        `predicate` (e.g. another writer's commit landing between a client's read and its write)."""
        with self._lock:
            self._before.append((predicate, action))

    def after(self, predicate: Callable[[Request], bool],
              action: Callable[[Request, bytes, bytes], bytes | None], count: int = 1) -> None:
        """Run `action(request, request body, response body)` after the server answered each of
        the next `count` requests matching `predicate`; bytes returned replace the response body."""
        with self._lock:
            self._after.append([predicate, action, count])

    def cut_body(self, kind: str, count: int, *, match: Callable[[Request], bool] | None = None,
                 keep: float = 0.5) -> None:
        """Answer the next `count` requests of `kind` (and `match`) with the real headers and
        only the first `keep` fraction of the body, then reset the connection."""
        with self._lock:
            self._body_cuts.append([kind, count, match, keep])

    def drop_answer(self, kind: str, count: int, *, match: Callable[[Request], bool] | None = None) -> None:
        """Forward the next `count` requests of `kind` (and `match`), then reset the connection
        without answering."""
        with self._lock:
            self._body_cuts.append([kind, count, match, None])

    def cut_after(self, predicate: Callable[[Request], bool]) -> None:
        """Go down right after answering the first request matching `predicate`."""
        with self._lock:
            self._cut = predicate

    # ------------------------------------------------------------------ observation
    def count(self, kind: str | None = None, *, injected: bool | None = None,
              match: Callable[[Request], bool] | None = None) -> int:
        with self._lock:
            reqs = list(self.requests)
        return sum(1 for r in reqs if (kind is None or r.kind == kind)
                   and (injected is None or r.injected == injected) and (match is None or match(r)))

    def counts(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(r.kind + (" (injected)" if r.injected else "") for r in self.requests)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()

    # ------------------------------------------------------------------ internals
    def _take_fault(self, req: Request) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.remaining > 0 and f.kind in (req.kind, "*") and (f.match is None or f.match(req)):
                    f.remaining -= 1
                    return f
        return None

    def _take_before(self, req: Request) -> Callable[[Request], None] | None:
        with self._lock:
            for i, (pred, action) in enumerate(self._before):
                if pred(req):
                    del self._before[i]
                    return action
        return None

    def _take_after(self, req: Request):
        with self._lock:
            for hook in self._after:
                if hook[2] > 0 and hook[0](req):
                    hook[2] -= 1
                    return hook[1]
        return None

    def _take_body_cut(self, req: Request, answer: bool) -> tuple[bool, float | None]:
        """(cut, fraction of the body kept: None = no answer at all) for a forwarded request."""
        with self._lock:
            for cut in self._body_cuts:
                if cut[1] > 0 and cut[0] in (req.kind, "*") and (cut[2] is None or cut[2](req)) \
                        and (cut[3] is None or answer):
                    cut[1] -= 1
                    return True, cut[3]
        return False, None

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _should_cut(self, req: Request) -> bool:
        with self._lock:
            if self._cut is not None and self._cut(req):
                self._cut = None
                self.cut_at = req
                return True
        return False


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: S3Proxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.proxy._lock:
            self.proxy._conns.add(self.connection)

    def finish(self) -> None:
        with self.proxy._lock:
            self.proxy._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _read_body(self) -> tuple[bytes, bool]:
        """The raw request body (chunked framing kept as-is) and whether it is chunked."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        t = self.rfile.readline()
                        raw += t
                        if t in (b"\r\n", b"\n", b""):
                            break
                    return bytes(raw), True
                raw += self.rfile.read(size + 2)
        n = int(self.headers.get("Content-Length") or 0)
        return (self.rfile.read(n) if n else b""), False

    def _handle(self) -> None:
        p = self.proxy
        if p.is_down:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        body, chunked = self._read_body()
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        headers = {k.lower(): v for k, v in self.headers.items()}
        kind, bucket, key = classify(self.command, url.path, query, headers)
        req = Request(self.command, kind, bucket, key, query, headers, at=time.monotonic())
        fault = p._take_fault(req)
        if fault is not None:
            rid = uuid.uuid4().hex[:16].upper()
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
                   f"<Message>{fault.message}</Message><Resource>{url.path}</Resource>"
                   f"<RequestId>{rid}</RequestId></Error>").encode()
            # Recorded before the answer leaves: the client may act on it at once.
            p._record(Request(**{**req.__dict__, "status": fault.status, "injected": True}))
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("x-amz-request-id", rid)
            self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        action = p._take_before(req)
        if action is not None:
            action(req)
        try:
            status, reason, out_headers, payload = self._forward(body, chunked)
        except OSError:
            p._record(req)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        hook = p._take_after(req)
        if hook is not None:
            replaced = hook(req, body, payload)
            if replaced is not None:
                payload = replaced
        cut, keep = p._take_body_cut(req, answer=self.command != "HEAD" and bool(payload))
        p._record(Request(**{**req.__dict__, "status": 0 if cut and keep is None else status, "injected": cut}))
        if cut and keep is None:  # the server acted on it; the client never hears
            self._reset()
            return
        self.send_response(status, reason)
        for k, v in out_headers:
            if k.lower() in HOP_BY_HOP or k.lower() in ("transfer-encoding", "content-length", "server", "date"):
                continue
            self.send_header(k, v)
        length = dict((k.lower(), v) for k, v in out_headers).get("content-length")
        self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(payload)))
        self.end_headers()
        if cut:  # part of the body, then a reset: the client's read fails mid-body
            self.wfile.write(payload[:int(len(payload) * keep)])
            self.wfile.flush()
            self._reset()
            return
        if self.command != "HEAD":
            self.wfile.write(payload)
        self.wfile.flush()
        if p._should_cut(req):
            p.down()

    def _reset(self) -> None:
        """Close the connection with a TCP reset (SO_LINGER 0), as a dying peer does."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def _forward(self, body: bytes, chunked: bool):
        p = self.proxy
        conn = http.client.HTTPConnection(p._up_host, p._up_port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() in HOP_BY_HOP:
                    continue
                conn.putheader(k, v)
            conn.endheaders()
            if body:
                conn.send(body)
            resp = conn.getresponse()
            payload = b"" if self.command == "HEAD" else resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


__all__ = ["S3Proxy", "Request", "classify"]
