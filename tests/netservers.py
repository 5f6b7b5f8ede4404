"""Small loopback servers for the network tests: an HTTP server and a TCP echo server.

They bind 127.0.0.1 on a random port and record what they saw, so a test can check from the
host side that a request arrived (or that nothing did).
"""

from __future__ import annotations

import http.server
import socket
import threading
from typing import Any


class HTTPServer:
    """Answers every GET with ``body`` and records the request line and headers."""

    def __init__(self, body: bytes = b"hello from the host\n") -> None:
        self.body = body
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                outer.requests.append(
                    {"line": self.requestline, "headers": dict(self.headers.items())}
                )
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HTTPServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class EchoServer:
    """A TCP echo server (no TLS): what a CONNECT tunnel carries, it sends back."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.host = host
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self._workers: list[threading.Thread] = []

    def _loop(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self._stop:
                conn.close()
                return
            self.connections += 1
            worker = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            worker.start()
            self._workers.append(worker)

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def __enter__(self) -> EchoServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        # Wake accept() with a last connection, then close.
        with socket.create_connection((self.host, self.port), timeout=2):
            pass
        self.thread.join(5)
        self.sock.close()
        for worker in self._workers:
            worker.join(5)


class UDPSink:
    """A UDP socket on 127.0.0.1 that records every datagram it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.setblocking(False)

    def received(self) -> list[bytes]:
        got = []
        while True:
            try:
                got.append(self.sock.recv(65536))
            except BlockingIOError:
                return got

    def close(self) -> None:
        self.sock.close()


class TCPSink:
    """A TCP listener on 127.0.0.1 that never accepts; tells whether anyone connected."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.sock.setblocking(False)

    def connections(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.sock.close()
