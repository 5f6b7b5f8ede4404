"""The host-side HTTP/HTTPS proxy of ``allow`` mode.

It serves a socket that is already listening — in the sandbox's own network namespace, created
there by the sandbox's setup and passed out as a file descriptor — so the sandbox reaches it at
127.0.0.1:<port> and nothing else. Every accepted connection carries one request:

- ``CONNECT host:port`` (HTTPS and other TLS: the proxy only relays bytes), or
- a plain HTTP request with an absolute URI (``GET http://host[:port]/path``), forwarded with
  ``Connection: close`` so one client connection is one upstream request.

The request's head is parsed by nsbox/host/httphead.py. The host must match the allow-list
(nsbox.policy.netrules). The proxy resolves the name itself and connects to an address it has
checked, never to the name again, so a DNS answer that changes between check and connect
(rebinding) cannot steer it elsewhere, nor to an address of the host's own interfaces
(nsbox/host/ownaddress.py). Denials get an HTTP error with a short reason; every attempt is
recorded, within bounds (nsbox/host/netlog.py). One accept thread plus one thread per
connection, all ended by ``close()``.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nsbox.host.httphead import MAX_HEAD, Denied, error_response, parse_head
from nsbox.host.netlog import ProxyLog
from nsbox.host.ownaddress import is_this_host
from nsbox.policy.netrules import (
    AllowEntry,
    IPAddress,
    forbidden_reason,
    literally_listed,
    parse_address,
    parse_entry,
    unmap,
)

CHUNK = 64 * 1024


@dataclass(frozen=True)
class ProxyLimits:
    max_connections: int = 32  # served at once; more wait in the listen queue
    max_bytes: int = 256 * 1024 * 1024  # both directions, all connections of the run
    connect_timeout: float = 10.0  # seconds, to the upstream server
    idle_timeout: float = 60.0  # seconds without a byte either way
    max_records: int = 1000  # allowed and refused attempts each, kept in the log per report
    max_questions: int = 256  # distinct hosts put to ``ask`` in the proxy's life; then refused


class _Stopped(Exception):
    """The proxy is closing (or the peer went idle): end this connection quietly."""


class NetworkProxy:
    """Serve ``listener`` until ``close()``. Use as a context manager, or start()/close()."""

    def __init__(
        self,
        listener: socket.socket,
        allow: tuple[AllowEntry, ...],
        limits: ProxyLimits | None = None,
        resolve: Callable[..., list[Any]] = socket.getaddrinfo,
        ask: Callable[[str, int], bool] | None = None,
    ) -> None:
        self._listener = listener
        self._allow = allow
        # Hosts not on the list are put to ``ask`` (one question at a time); each answer is
        # remembered for the proxy's life (up to ``max_questions`` of them) and logged. The
        # approved are admitted like entries, but never count as listed literally.
        self._ask = ask
        self._ask_lock = threading.Lock()
        self._answers: dict[tuple[str, int], bool] = {}
        self._approved: tuple[AllowEntry, ...] = ()
        self._limits = limits or ProxyLimits()
        self._log = ProxyLog(self._limits.max_records, asking=ask is not None)
        self._getaddrinfo = resolve  # the host's resolver; replaceable to test rebinding
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._stopping = threading.Event()
        # Readable once close() begins; every thread polls it next to its sockets.
        self._wake_r, self._wake_w = socket.socketpair()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self._bytes = 0
        self._active = 0
        self._closed = False

    # --- lifetime ------------------------------------------------------------------------------

    def start(self) -> NetworkProxy:
        self._listener.setblocking(False)
        thread = threading.Thread(target=self._accept_loop, name="nsbox-proxy", daemon=True)
        self._accept_thread = thread
        thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, end every connection, join the threads and close every socket."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake_w.send(b"x")
        with self._lock:
            self._slot_free.notify_all()
            for sock in self._sockets:
                # shutdown, not close: the owning thread closes its fd, so no fd is reused
                # under a thread still polling it.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        else:
            self._listener.close()
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                break
            threads[0].join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                break
        accepting = self._accept_thread is not None and self._accept_thread.is_alive()
        with self._lock:
            if self._threads or accepting:
                # A thread is stuck past the timeout (in a name lookup, which nothing can
                # interrupt): it still polls the wake socket, whose number must not be reused.
                return
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> NetworkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def report(self, reset: bool = False) -> dict[str, Any]:
        """The log since the start, or since the last ``reset`` (each command of a session):
        the attempts in order, the sums per destination, and totals (for Result.extra)."""
        data = self._log.report(reset)
        with self._lock:
            data.update(bytes_total=self._bytes, threads_left=len(self._threads))
        return data

    # --- accepting -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while self._wait_for_slot():
                poller.poll()
                if self._stopping.is_set():
                    break
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue  # nothing there, or the client gave up before accept (accept(2))
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        time.sleep(0.05)  # out of fds: back off instead of spinning
                        continue
                    raise
                self._admit(conn)
        except Exception as exc:  # fail closed and say so; never a traceback on the host
            self._log.attempt(None, None, None, False, f"proxy stopped: {exc}", 0, 0, time.time())
        finally:
            self._listener.close()

    def _wait_for_slot(self) -> bool:
        """Block while ``max_connections`` are open: further clients wait in the listen queue
        (and past its length the kernel drops their SYNs), which is back-pressure, not an error.
        False once the proxy is closing."""
        with self._slot_free:
            while self._active >= self._limits.max_connections and not self._stopping.is_set():
                self._slot_free.wait()
        return not self._stopping.is_set()

    def _admit(self, conn: socket.socket) -> None:
        thread = threading.Thread(
            target=self._serve, args=(conn,), name="nsbox-proxy-conn", daemon=True
        )
        # Started under the lock: close() must never see (and join) a thread not yet started.
        with self._lock:
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: this client gets nothing
                conn.close()
                return
            self._active += 1
            self._sockets.add(conn)
            self._threads.add(thread)

    # --- one connection ------------------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        started = time.time()
        upstream: socket.socket | None = None
        method = host = None
        port: int | None = None
        address: str | None = None
        admitted = False
        up = down = 0
        try:
            head, rest = self._read_head(client)
            method, host, port, default_port, new_head = parse_head(head)
            if not any(e.matches(host, port, default_port)
                       for e in (*self._allow, *self._approved)):
                if self._ask is None:
                    raise Denied(403, f"{host}:{port} is not in the allow-list")
                self._never_asked(host, port, default_port)
                if not self._asked(host, port):
                    raise Denied(403, f"{host}:{port} is not in the allow-list and was "
                                       "refused when asked")
            addrs = self._resolve(host, port, default_port)
            upstream, address = self._connect_any(addrs, port)
            admitted = True
            if method == "CONNECT":
                self._send(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = rest
            else:
                first = new_head + rest
            if first:
                self._charge(len(first))
                self._send(upstream, first)
                up += len(first)
            up, down, end = self._relay(client, upstream, up, down)
            self._log.attempt(method, host, port, True, end, up, down, started, address)
        except Denied as denied:
            self._log.attempt(method, host, port, False, denied.reason, up, down, started, address)
            with contextlib.suppress(OSError, _Stopped):
                self._send(client, error_response(denied.status, denied.reason))
        except _Stopped as stopped:
            reason = str(stopped) or "proxy closed"
            self._log.attempt(method, host, port, admitted, reason, up, down, started, address)
        except OSError as exc:
            reason = f"error: {exc}"
            self._log.attempt(method, host, port, admitted, reason, up, down, started, address)
        except Exception as exc:  # a bug here must not print a traceback into the host's stderr
            reason = f"internal error: {type(exc).__name__}: {exc}"
            self._log.attempt(method, host, port, admitted, reason, up, down, started, address)
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    sock.close()
            with self._lock:
                self._active -= 1
                self._threads.discard(threading.current_thread())
                self._slot_free.notify()

    def _wait(
        self, sock: socket.socket, events: int, timeout: float, on_timeout: Exception
    ) -> None:
        """Wait until ``sock`` is ready; raise _Stopped when closing, ``on_timeout`` on timeout."""
        poller = select.poll()
        poller.register(sock, events)
        poller.register(self._wake_r, select.POLLIN)
        ready = poller.poll(timeout * 1000)
        if self._stopping.is_set():
            raise _Stopped("proxy closed")
        if not ready:
            raise on_timeout

    def _read_head(self, client: socket.socket) -> tuple[bytes, bytes]:
        client.setblocking(False)
        data = bytearray()
        end = -1
        while end < 0:
            if len(data) > MAX_HEAD:
                raise Denied(431, f"request head larger than {MAX_HEAD} bytes")
            self._wait(
                client, select.POLLIN, self._limits.idle_timeout, _Stopped("idle: no request")
            )
            try:
                chunk = client.recv(CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                raise _Stopped("client closed before a request")
            # Only the new bytes (and the 3 before them) can complete the blank line: a head
            # trickled a byte at a time must not be scanned and copied whole on every recv.
            start = max(0, len(data) - 3)
            data += chunk
            end = data.find(b"\r\n\r\n", start)
        return bytes(data[:end]), bytes(data[end + 4:])

    def _never_asked(self, host: str, port: int, default_port: int) -> None:
        """An address the rules refuse is refused as it would be if it were listed, never put
        to a person: a loopback, private or link-local address, also in an IPv4-mapped,
        IPv4-compatible, NAT64, 6to4 or Teredo form, or a name of the host itself
        (localhost), is no host to approve."""
        if host == "localhost" or host.endswith(".localhost"):
            # RFC 6761 6.3: such a name is the host itself, whatever a resolver says.
            raise Denied(403, f"{host} is the host itself (loopback); list that address "
                              "itself to allow it")
        literal = parse_address(host)
        if literal is None or literally_listed(self._allow, literal, port, default_port):
            return
        why = self._forbidden(literal)
        if why is not None:
            raise Denied(403, f"{host} resolves to {why}; list that address itself to allow it")

    def _asked(self, host: str, port: int) -> bool:
        """The embedding application's answer for ``host:port``: asked once, then remembered.
        ``host`` is the checked, canonical form (httphead.authority): a lower-case DNS name
        or an IP address as ``ipaddress`` writes it, printable ASCII only.
        An approved name is then treated as listed (its addresses still pass the rules of
        ``_resolve``); an approved IP literal as listed literally, since that very address was
        put to the user. A callback that fails or answers anything but True refuses. Past
        ``max_questions`` distinct hosts, a new one is refused without a question: the answers
        are kept for the proxy's life, and a sandbox can name hosts without end."""
        with self._ask_lock:
            key = (host, port)
            if key in self._answers:
                return self._answers[key]
            if len(self._answers) >= self._limits.max_questions:
                self._log.not_asked()
                raise Denied(403, f"{host}:{port} is not in the allow-list and was not asked: "
                                  f"the limit of {self._limits.max_questions} questions of this "
                                  "run or session was reached")
            assert self._ask is not None
            try:
                answer = self._ask(host, port) is True
                if answer:
                    entry = parse_entry(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            except Exception:
                answer = False
            self._answers[key] = answer
            self._log.answer(host, port, answer, time.time())
            if answer:
                self._approved = (*self._approved, entry)
            return answer

    def _forbidden(self, addr: IPAddress) -> str | None:
        """forbidden_reason, with the host's own addresses; fails closed."""
        try:
            return forbidden_reason(addr, is_this_host)
        except OSError as exc:
            return f"address {addr}, which could not be told apart from this host's own ({exc})"

    def _resolve(self, host: str, port: int, default_port: int) -> list[IPAddress]:
        """The addresses of ``host`` the rules allow, in the resolver's order. The proxy
        connects to these and never looks the name up again (DNS rebinding)."""
        literal = parse_address(host)
        if literal is not None:
            candidates = [literal]
        else:
            try:
                infos = self._getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise Denied(502, f"cannot resolve {host}: {exc.strerror}") from None
            candidates = []
            for info in infos:
                addr = parse_address(str(info[4][0]).split("%")[0])
                if addr is not None and addr not in candidates:
                    candidates.append(addr)
        allowed: list[IPAddress] = []
        reasons = []
        for addr in candidates:
            why = self._forbidden(addr)
            if why is None or literally_listed(self._allow, addr, port, default_port):
                if unmap(addr) not in allowed:
                    allowed.append(unmap(addr))
            else:
                reasons.append(why)
        if not allowed:
            raise Denied(
                403,
                f"{host} resolves to {', '.join(reasons) or 'no address'}; "
                "list that address itself to allow it",
            )
        return allowed

    def _connect_any(self, addrs: list[IPAddress], port: int) -> tuple[socket.socket, str]:
        """Connect to the first of ``addrs`` that answers, all within the connect timeout."""
        deadline = time.monotonic() + self._limits.connect_timeout
        failure: Denied | None = None
        for addr in addrs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                return self._connect(addr, port, remaining), str(addr)
            except Denied as exc:
                failure = exc
        raise failure or Denied(504, f"connect to port {port}: timed out")

    def _connect(self, addr: IPAddress, port: int, timeout: float) -> socket.socket:
        family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        with self._lock:
            self._sockets.add(sock)
        try:
            sock.setblocking(False)
            err = sock.connect_ex((str(addr), port))
            if err not in (0, errno.EINPROGRESS):
                raise Denied(502, f"connect to {addr}:{port}: {errno.errorcode.get(err, err)}")
            on_timeout = Denied(504, f"connect to {addr}:{port}: timed out")
            self._wait(sock, select.POLLOUT, timeout, on_timeout)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise Denied(502, f"connect to {addr}:{port}: {errno.errorcode.get(err, err)}")
        except BaseException:
            with self._lock:
                self._sockets.discard(sock)
            sock.close()
            raise
        return sock

    def _send(self, sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                idle = _Stopped("idle: peer not reading")
                self._wait(sock, select.POLLOUT, self._limits.idle_timeout, idle)
                continue
            view = view[sent:]

    def _charge(self, n: int) -> None:
        with self._lock:
            if self._bytes + n > self._limits.max_bytes:
                raise _Stopped(f"byte limit of the run ({self._limits.max_bytes}) reached")
            self._bytes += n

    def _relay(
        self, client: socket.socket, upstream: socket.socket, up: int, down: int
    ) -> tuple[int, int, str]:
        """Copy bytes both ways until one side closes; returns the byte counts and why it ended."""
        poller = select.poll()
        poller.register(client, select.POLLIN)
        poller.register(upstream, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        peer = {client.fileno(): upstream, upstream.fileno(): client}
        open_reads = 2
        while open_reads:
            ready = poller.poll(self._limits.idle_timeout * 1000)
            if self._stopping.is_set():
                return up, down, "proxy closed"
            if not ready:
                return up, down, "idle timeout"
            for fd, _ in ready:
                if fd not in peer:
                    continue
                src, dst = (client, upstream) if fd == client.fileno() else (upstream, client)
                try:
                    data = src.recv(CHUNK)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                if not data:
                    # Half-close: pass the end of this direction on, keep the other open.
                    poller.unregister(fd)
                    del peer[fd]
                    open_reads -= 1
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    continue
                try:
                    self._charge(len(data))
                except _Stopped as limit:
                    return up, down, str(limit)
                self._send(dst, data)
                if src is client:
                    up += len(data)
                else:
                    down += len(data)
        return up, down, "closed"
