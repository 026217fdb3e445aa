"""A fault-injecting HTTP proxy on loopback, in front of an S3-protocol server (moto), for tests.

Every request goes to the upstream server unless a fault is due. Faults come from a schedule the
test sets (``proxy.schedule("503", "reset", methods=("PUT",), path="payload")``: the next
matching requests get those faults, in order) and, once it is spent, from a seeded random draw at ``fault_rate``:

- ``"500"``: HTTP 500 ``InternalError``; ``"503"``: HTTP 503 ``SlowDown`` (S3's throttling answer);
  ``"403"``: HTTP 403 ``AccessDenied`` (credentials without that permission: not retried);
- ``"drop"``: the connection closes with no answer;
- ``"truncate"``: half the response body, then the connection closes (a short body);
- ``"reset"``: half the response body, then a TCP reset (``SO_LINGER`` 0: ``ECONNRESET`` mid-body);
- ``"slow"``: the answer comes after ``slow_s`` seconds (a slow server: read timeouts).

``counts`` says how many of each happened and ``log`` lists (method, path, fault) in order, so
tests can check both that faults were met and that retries were bounded.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import urlparse

FAULTS = ("500", "503", "403", "drop", "truncate", "reset", "slow")


class FaultProxy:
    """See the module docstring. ``upstream`` is the server's URL or its loopback port."""

    def __init__(self, upstream: str | int, fault_rate: float = 0.0, methods: tuple[str, ...] = ("GET",),
                 seed: int = 0, slow_s: float = 2.0, random_faults: tuple[str, ...] | None = None) -> None:
        self.upstream_port = upstream if isinstance(upstream, int) else int(urlparse(upstream).port or 80)
        self.fault_rate, self.methods, self.slow_s = fault_rate, methods, slow_s
        self.random_faults = random_faults
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.counts = {"ok": 0, **dict.fromkeys(FAULTS, 0)}
        self.faulted_methods: dict[str, int] = {}
        self.log: list[tuple[str, str, str]] = []
        self._queue: deque[tuple[str, tuple[str, ...], str]] = deque()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def schedule(self, *faults: str, methods: tuple[str, ...] | None = None, path: str = "") -> None:
        """The next requests whose method is in ``methods`` (default: the proxy's) and whose path
        contains ``path`` get ``faults``, in order."""
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        with self.lock:
            self._queue.extend((f, methods or self.methods, path) for f in faults)

    def draw(self, method: str, path: str) -> str:
        with self.lock:
            kind = "ok"
            for i, (fault, methods, part) in enumerate(self._queue):
                if method in methods and part in path:
                    kind = fault
                    del self._queue[i]
                    break
            else:
                if method in self.methods and self.fault_rate and self.rng.random() < self.fault_rate:
                    default = ("500", "503", "drop", "truncate") if method == "GET" else ("500", "503", "drop")
                    kind = self.rng.choice(self.random_faults or default)
            self.counts[kind] += 1
            self.log.append((method, path, kind))
            if kind != "ok":
                self.faulted_methods[method] = self.faulted_methods.get(method, 0) + 1
            return kind

    @property
    def faults(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "ok")

    @property
    def pending(self) -> int:
        """Scheduled faults not yet met."""
        return len(self._queue)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as boto3 and the AWS SDK use it
        disable_nagle_algorithm = True  # else headers+body writes stall ~40 ms on delayed ACKs

        def log_message(self, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _handle(self) -> None:
            chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
            body = self._body()
            fault = proxy.draw(self.command, self.path)
            if fault == "drop":
                self.close_connection = True
                return
            if fault in ("500", "503", "403"):
                code, err = {"500": (500, "InternalError"), "503": (503, "SlowDown"), "403": (403, "AccessDenied")}[fault]
                msg = f"<Error><Code>{err}</Code><Message>injected</Message></Error>".encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            if fault == "slow":
                time.sleep(proxy.slow_s)
            skip = {"expect", "connection", "transfer-encoding", "content-length"}
            headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
            if chunked or body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                    self.send_header(k, v)
            if self.command == "HEAD":  # no body: pass the object's length through
                self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
                self.end_headers()
                return
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if fault in ("truncate", "reset") and len(data) > 1:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if fault == "reset":  # RST instead of FIN: the client sees ECONNRESET mid-body
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    return Handler
