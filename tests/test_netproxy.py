"""The proxy on a listening socket bound here in the test process (no sandbox: fast).

Every target is a server this test starts on 127.0.0.1, which is allowed by listing the address
literally, as the rules require for loopback.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import require
from netservers import EchoServer, HTTPServer

from nsbox.host.netproxy import NetworkProxy, ProxyLimits
from nsbox.policy.netrules import parse_allow_list


def open_fds() -> set[str]:
    """What each open descriptor refers to (socket:[inode] for sockets): a new socket shows up
    as a new entry even if its number was used before."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        # The descriptor of the listing itself is gone by now.
        with contextlib.suppress(FileNotFoundError):
            found.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
    return found


@contextmanager
def proxy(
    allow: list[str], resolve: Any = socket.getaddrinfo, **limits: object
) -> Iterator[tuple[NetworkProxy, int]]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    rules = parse_allow_list(allow)
    with NetworkProxy(listener, rules, ProxyLimits(**limits), resolve) as p:  # type: ignore[arg-type]
        yield p, port


def request(port: int, head: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def connect_tunnel(port: int, target: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    return sock, reply


def test_plain_http_to_listed_server_is_forwarded_with_rewritten_head() -> None:
    with HTTPServer() as server, proxy([f"127.0.0.1:{server.port}"]) as (p, port):
        reply = request(
            port,
            f"GET http://127.0.0.1:{server.port}/data?x=1 HTTP/1.1\r\n"
            "Host: elsewhere.invalid\r\nProxy-Authorization: Basic c2VjcmV0\r\n"
            "Connection: keep-alive, X-Drop\r\nX-Drop: 1\r\nX-Keep: 2\r\n\r\n".encode(),
        )
    assert reply.startswith(b"HTTP/1.0 200") or reply.startswith(b"HTTP/1.1 200"), reply
    assert reply.endswith(b"hello from the host\n")
    seen = server.requests[0]
    assert seen["line"] == "GET /data?x=1 HTTP/1.1"
    assert seen["headers"]["Host"] == f"127.0.0.1:{server.port}"
    assert seen["headers"]["Connection"] == "close"
    assert seen["headers"]["X-Keep"] == "2"
    assert "Proxy-Authorization" not in seen["headers"]
    assert "X-Drop" not in seen["headers"]
    (record,) = p.report()["attempts"]
    assert record["allowed"] is True
    assert (record["method"], record["host"], record["port"]) == ("GET", "127.0.0.1", server.port)
    assert record["address"] == "127.0.0.1"
    assert record["bytes_up"] > 0 and record["bytes_down"] == len(reply)


def test_unlisted_port_gets_403_and_is_logged() -> None:
    with HTTPServer() as listed, HTTPServer() as other, proxy([f"127.0.0.1:{listed.port}"]) as (
        p,
        port,
    ):
        reply = request(port, f"GET http://127.0.0.1:{other.port}/ HTTP/1.1\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 403 Forbidden")
    assert f"127.0.0.1:{other.port} is not in the allow-list".encode() in reply
    assert other.requests == []
    (record,) = p.report()["attempts"]
    assert record["allowed"] is False
    assert record["port"] == other.port
    assert "not in the allow-list" in record["reason"]


def test_connect_tunnel_to_echo_server() -> None:
    with EchoServer() as echo, proxy([f"127.0.0.1:{echo.port}"]) as (p, port):
        sock, reply = connect_tunnel(port, f"127.0.0.1:{echo.port}")
        with sock:
            assert reply == b"HTTP/1.1 200 Connection established\r\n\r\n"
            sock.sendall(b"ping through the tunnel")
            assert sock.recv(100) == b"ping through the tunnel"
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(100) == b""  # the echo server closed its side in turn
        p.close()
        (record,) = p.report()["attempts"]
    assert record["method"] == "CONNECT" and record["allowed"] is True
    assert record["bytes_up"] == record["bytes_down"] == len(b"ping through the tunnel")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_connect_to_an_ipv6_literal() -> None:
    require(_has_ipv6_loopback(), "no IPv6 loopback (::1) on this host")
    with EchoServer("::1") as echo, proxy([f"[::1]:{echo.port}"]) as (p, port):
        sock, reply = connect_tunnel(port, f"[::1]:{echo.port}")
        with sock:
            assert reply.startswith(b"HTTP/1.1 200")
            sock.sendall(b"over v6")
            assert sock.recv(100) == b"over v6"
        refused, denial = connect_tunnel(port, f"[::2]:{echo.port}")
        refused.close()
    assert denial.startswith(b"HTTP/1.1 403")
    assert p.report()["attempts"][0]["address"] == "::1"


def test_ipv4_mapped_literal_counts_as_the_ipv4_address() -> None:
    with EchoServer() as echo:
        with proxy([f"127.0.0.1:{echo.port}"]) as (p, port):
            sock, reply = connect_tunnel(port, f"[::ffff:127.0.0.1]:{echo.port}")
            sock.close()
        assert reply.startswith(b"HTTP/1.1 200")
        assert p.report()["attempts"][0]["address"] == "127.0.0.1"
        # Not listed: the mapped form of a loopback address is refused like the address.
        with proxy([f"localhost:{echo.port}"]) as (p, port):
            sock, reply = connect_tunnel(port, f"[::ffff:127.0.0.1]:{echo.port}")
            sock.close()
        assert reply.startswith(b"HTTP/1.1 403")


def test_connect_without_port_means_443() -> None:
    with EchoServer() as echo, proxy([f"127.0.0.1:{echo.port}"]) as (p, port):
        sock, reply = connect_tunnel(port, "127.0.0.1")
        sock.close()
    assert reply.startswith(b"HTTP/1.1 403")
    assert p.report()["attempts"][0]["port"] == 443


def loopback_name(host: str, port: int, **kwargs: Any) -> list[Any]:
    """A resolver that maps every name to 127.0.0.1, whatever this host's /etc/hosts says
    (a minimal system may have none)."""
    return socket.getaddrinfo("127.0.0.1", port, **kwargs)


def test_name_resolving_to_loopback_is_refused_unless_the_address_is_listed() -> None:
    name = "loop.nsbox-test.invalid"
    with HTTPServer() as server:
        with proxy([f"{name}:{server.port}"], resolve=loopback_name) as (p, port):
            reply = request(port, f"GET http://{name}:{server.port}/ HTTP/1.1\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 403")
        assert b"loopback address 127.0.0.1" in reply
        assert server.requests == []
        assert "resolves to loopback" in p.report()["attempts"][0]["reason"]

        with proxy([f"{name}:{server.port}", f"127.0.0.1:{server.port}"],
                   resolve=loopback_name) as (p, port):
            reply = request(port, f"GET http://{name}:{server.port}/ HTTP/1.1\r\n\r\n".encode())
        assert reply.endswith(b"hello from the host\n")
        assert len(server.requests) == 1
        assert p.report()["attempts"][0]["address"] == "127.0.0.1"


def test_the_proxy_connects_to_the_address_it_checked() -> None:
    # A rebinding name server: the first answer is an address the rules admit, every later
    # one the metadata service. The proxy must look the name up once and use that answer.
    with EchoServer() as echo:
        answers: list[str] = []

        def rebinding(host: str, port: int, **kwargs: Any) -> list[Any]:
            address = "127.0.0.1" if not answers else "169.254.169.254"
            answers.append(address)
            return socket.getaddrinfo(address, port, **kwargs)

        allow = [f"rebind.nsbox-test.invalid:{echo.port}", f"127.0.0.1:{echo.port}"]
        with proxy(allow, resolve=rebinding) as (p, port):
            sock, reply = connect_tunnel(port, f"rebind.nsbox-test.invalid:{echo.port}")
            with sock:
                assert reply.startswith(b"HTTP/1.1 200")
                sock.sendall(b"rebound?")
                assert sock.recv(100) == b"rebound?"
    assert answers == ["127.0.0.1"]
    assert echo.connections == 1
    assert p.report()["attempts"][0]["address"] == "127.0.0.1"


def test_wildcard_matches_subdomains_only() -> None:
    # Names under .invalid never resolve (RFC 6761), so an admitted request ends in 502.
    with proxy(["*.nsbox-test.invalid"]) as (p, port):
        sub = request(port, b"GET http://a.nsbox-test.invalid/ HTTP/1.1\r\n\r\n")
        apex = request(port, b"GET http://nsbox-test.invalid/ HTTP/1.1\r\n\r\n")
    assert sub.startswith(b"HTTP/1.1 502") and b"cannot resolve" in sub
    assert apex.startswith(b"HTTP/1.1 403") and b"not in the allow-list" in apex


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"405"),
        (b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n", b"403"),
        (b"GET ftp://127.0.0.1/ HTTP/1.1\r\n\r\n", b"403"),
        (b"HELLO\r\n\r\n", b"400"),
        (b"CONNECT user@127.0.0.1:1 HTTP/1.1\r\n\r\n", b"400"),
        (b"CONNECT 127.0.0.1:99999 HTTP/1.1\r\n\r\n", b"400"),
    ],
)
def test_malformed_or_unsupported_requests_are_refused(head: bytes, status: bytes) -> None:
    with proxy(["127.0.0.1:1"]) as (p, port):
        reply = request(port, head)
    assert reply.split(b" ")[1] == status, reply
    assert p.report()["attempts"][0]["allowed"] is False


def test_connections_past_the_limit_wait_for_a_free_slot() -> None:
    with EchoServer() as echo, proxy([f"127.0.0.1:{echo.port}"], max_connections=1) as (p, port):
        first, reply = connect_tunnel(port, f"127.0.0.1:{echo.port}")
        assert reply.startswith(b"HTTP/1.1 200")
        second = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        with second:
            second.sendall(f"CONNECT 127.0.0.1:{echo.port} HTTP/1.1\r\n\r\n".encode())
            with pytest.raises(TimeoutError):
                second.recv(100)  # not served while the first tunnel is open
            assert echo.connections == 1
            first.close()
            second.settimeout(5)
            assert second.recv(100).startswith(b"HTTP/1.1 200")
        p.close()
    assert [r["allowed"] for r in p.report()["attempts"]] == [True, True]


def test_byte_limit_ends_the_tunnel() -> None:
    with EchoServer() as echo, proxy([f"127.0.0.1:{echo.port}"], max_bytes=1000) as (p, port):
        sock, reply = connect_tunnel(port, f"127.0.0.1:{echo.port}")
        with sock:
            assert reply.startswith(b"HTTP/1.1 200")
            got = b""
            try:
                sock.sendall(b"x" * 600)
                while chunk := sock.recv(65536):
                    got += chunk
            except ConnectionResetError:
                pass
        p.close()
        report = p.report()
    assert len(got) < 600  # the echo of all 600 bytes would pass the 1000-byte budget
    assert report["bytes_total"] <= 1000
    assert "byte limit of the run (1000) reached" in report["attempts"][0]["reason"]


def test_idle_client_is_dropped() -> None:
    with proxy(["127.0.0.1:1"], idle_timeout=0.2) as (p, port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert sock.recv(100) == b""  # closed by the proxy, no request needed
        p.close()
    assert p.report()["attempts"][0]["reason"] == "idle: no request"


def test_connect_timeout_is_a_504() -> None:
    # A listener that never accepts, with its queue full: the kernel drops further SYNs, so the
    # proxy's connect hangs until its timeout (tcp(7), listen(2) backlog).
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(0)
    target = blocker.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", target))
        fillers.append(s)
    time.sleep(0.1)
    try:
        with proxy([f"127.0.0.1:{target}"], connect_timeout=0.3) as (p, port):
            reply = request(port, f"CONNECT 127.0.0.1:{target} HTTP/1.1\r\n\r\n".encode())
    finally:
        for s in fillers:
            s.close()
        blocker.close()
    assert reply.startswith(b"HTTP/1.1 504"), reply
    assert "timed out" in p.report()["attempts"][0]["reason"]


def test_close_ends_open_tunnels_threads_and_sockets() -> None:
    with EchoServer() as echo:
        threads, fds = threading.active_count(), open_fds()
        with proxy([f"127.0.0.1:{echo.port}"]) as (p, port):
            tunnels = [connect_tunnel(port, f"127.0.0.1:{echo.port}")[0] for _ in range(3)]
            for sock in tunnels:  # a round trip each: the echo server has all three
                sock.sendall(b"x")
                assert sock.recv(1) == b"x"
            names = [t.name for t in threading.enumerate()]
            assert names.count("nsbox-proxy-conn") == 3 and "nsbox-proxy" in names
        # The proxy closed while the tunnels were open: each client sees the end.
        for sock in tunnels:
            sock.settimeout(5)
            assert sock.recv(10) == b""
            sock.close()
        for worker in echo._workers:  # the echo server's side of each tunnel ends too
            worker.join(5)
        assert not [t for t in threading.enumerate() if t.name.startswith("nsbox-proxy")]
        assert threading.active_count() == threads
        assert open_fds() - fds == set()
        assert p.report()["threads_left"] == 0
        assert [r["reason"] for r in p.report()["attempts"]] == ["proxy closed"] * 3
        assert [r["bytes_up"] for r in p.report()["attempts"]] == [1] * 3


def test_refused_connect_is_a_502_and_leaves_no_socket() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port_closed = closed.getsockname()[1]  # bound, never listening: connections are refused
    try:
        fds = open_fds()
        with proxy([f"127.0.0.1:{port_closed}"]) as (p, port):
            reply = request(port, f"CONNECT 127.0.0.1:{port_closed} HTTP/1.1\r\n\r\n".encode())
        assert open_fds() - fds == set()
    finally:
        closed.close()
    assert reply.startswith(b"HTTP/1.1 502")
    assert f"connect to 127.0.0.1:{port_closed}: ECONNREFUSED".encode() in reply
    (record,) = p.report()["attempts"]
    assert record["allowed"] is False and "ECONNREFUSED" in record["reason"]
