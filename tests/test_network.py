"""Network modes of a real sandbox: probes run inside, evidence is checked on the host side.

Every target is on 127.0.0.1 — servers this test starts on the host's loopback, which the
sandbox must reach only through the proxy, and only when the allow-list names them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from netservers import EchoServer, HTTPServer, TCPSink, UDPSink

from nsbox import _netns
from nsbox.netproxy import NetworkProxy, ProxyLimits
from nsbox.netrules import parse_allow_list
from nsbox.policy import Network

PYTHON = "/usr/bin/python3"  # the system's; /usr is what a sandbox sees of the host
CURL = shutil.which("curl", path="/usr/bin:/bin")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require(condition: object, reason: str) -> None:
    """Skip locally, fail in CI (CI=true), when the host lacks what a test needs."""
    if condition:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must provide this: {reason}")
    pytest.skip(reason)


# --- a minimal launch, until the core's nsbox.run() lands --------------------------------------
# It runs the same child-side step (nsbox._netns.setup_network) in a new user + network
# namespace, receives the listener the same way and serves it with the same proxy.

_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from nsbox import _libc, _netns
mode, port, channel = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
_libc.unshare(_libc.CLONE_NEWUSER | _libc.CLONE_NEWNET)
_netns.setup_network(mode, port, channel if channel >= 0 else None)
os.execve(sys.argv[5], sys.argv[5:], json.loads(os.environ["NSBOX_ENV"]))
"""


@dataclass
class Outcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    extra: dict[str, Any] = field(default_factory=dict)


def run(argv: list[str], network: Network) -> Outcome:
    mode = network.effective_mode
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    host_end = child_end = None
    if mode == "allow":
        env.update(_netns.proxy_env(network.proxy_port))
        host_end, child_end = socket.socketpair()
    child_fd = child_end.fileno() if child_end else -1
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _CHILD, REPO, mode, str(network.proxy_port),
         str(child_fd), *argv],
        env={"NSBOX_ENV": json.dumps(env)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=[child_fd] if child_end else [],
    )
    proxy = None
    if host_end is not None and child_end is not None:
        child_end.close()
        listener = _netns.receive_listener(host_end)
        host_end.close()
        assert listener is not None, "the child sent no proxy listener"
        limits = ProxyLimits(
            max_connections=network.max_connections, max_bytes=network.max_bytes,
            connect_timeout=network.connect_timeout, idle_timeout=network.idle_timeout,
        )
        proxy = NetworkProxy(listener, parse_allow_list(network.allow), limits).start()
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proxy is not None:
            proxy.close()
    extra = {"network": {"mode": mode, **proxy.report()}} if proxy else {"network": {"mode": mode}}
    return Outcome(proc.returncode, out, err, extra)


# --- probes ------------------------------------------------------------------------------------


def py(code: str) -> list[str]:
    return [PYTHON, "-I", "-S", "-c", code]


def allow(*entries: str) -> Network:
    return Network(mode="allow", allow=entries)


def test_curl_reaches_the_listed_server_through_the_proxy() -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server:
        result = run([CURL, "-sS", f"http://127.0.0.1:{server.port}/x"],
                     allow(f"127.0.0.1:{server.port}"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"hello from the host\n"
    assert [r["line"] for r in server.requests] == ["GET /x HTTP/1.1"]
    (attempt,) = result.extra["network"]["attempts"]
    assert attempt["allowed"] and attempt["port"] == server.port


def test_curl_tunnels_with_connect() -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server:
        # --proxytunnel: CONNECT first, then the request through the tunnel (as for HTTPS).
        result = run([CURL, "-sS", "--proxytunnel", f"http://127.0.0.1:{server.port}/t"],
                     allow(f"127.0.0.1:{server.port}"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"hello from the host\n"
    (attempt,) = result.extra["network"]["attempts"]
    assert attempt["method"] == "CONNECT" and attempt["allowed"]
    assert attempt["bytes_down"] > len(b"hello from the host\n")


def test_python_urllib_reaches_the_listed_server() -> None:
    with HTTPServer() as server:
        result = run(
            py(f"import urllib.request; print(urllib.request.urlopen("
               f"'http://127.0.0.1:{server.port}/u', timeout=10).read().decode(), end='')"),
            allow(f"127.0.0.1:{server.port}"),
        )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"hello from the host\n"
    assert server.requests[0]["line"] == "GET /u HTTP/1.1"


def test_unlisted_server_gets_403_and_the_attempt_is_logged() -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as listed, HTTPServer() as other:
        result = run([CURL, "-s", "-o", "/dev/stderr", "-w", "%{http_code}",
                      f"http://127.0.0.1:{other.port}/"], allow(f"127.0.0.1:{listed.port}"))
    assert result.stdout == b"403"
    assert b"is not in the allow-list" in result.stderr
    assert other.requests == [] and listed.requests == []
    (attempt,) = result.extra["network"]["attempts"]
    assert attempt["allowed"] is False
    assert (attempt["host"], attempt["port"]) == ("127.0.0.1", other.port)
    assert attempt["reason"] == f"127.0.0.1:{other.port} is not in the allow-list"


def test_name_resolving_to_loopback_needs_the_address_listed() -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with open("/etc/hosts") as f:
        require(
            any(line.split()[:1] == ["127.0.0.1"] and "localhost" in line.split()[1:]
                for line in f),
            "/etc/hosts does not map localhost to 127.0.0.1",
        )
    fetch = [CURL, "-s", "-w", "%{http_code}"]
    with HTTPServer() as server:
        url = f"http://localhost:{server.port}/"
        refused = run([*fetch, url], allow(f"localhost:{server.port}"))
        admitted = run([*fetch, url], allow(f"localhost:{server.port}", f"127.0.0.1:{server.port}"))
    assert refused.stdout.endswith(b"403")
    assert b"resolves to loopback address 127.0.0.1" in refused.stdout
    assert admitted.stdout == b"hello from the host\n200"
    assert len(server.requests) == 1
    assert admitted.extra["network"]["attempts"][0]["address"] == "127.0.0.1"


_DIRECT_PROBE = """
import errno, json, socket
out = {}
try:
    socket.create_connection(("127.0.0.1", %(tcp)d), timeout=5)
    out["tcp"] = "connected"
except OSError as e:
    out["tcp"] = errno.errorcode.get(e.errno, str(e))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(2)
try:
    u.connect(("127.0.0.1", %(udp)d))
    u.send(b"datagram from inside")
    u.recv(100)
    out["udp"] = "answered"
except OSError as e:
    out["udp"] = errno.errorcode.get(e.errno, type(e).__name__)
try:
    socket.getaddrinfo("nsbox-probe.example.com", 80)
    out["dns"] = "resolved"
except socket.gaierror as e:
    out["dns"] = "gaierror"
try:
    out["resolv.conf"] = open("/etc/resolv.conf").read()
except OSError as e:
    out["resolv.conf"] = None
print(json.dumps(out))
"""


@contextlib.contextmanager
def host_dns_sink():
    """A UDP socket on the host's 127.0.0.1:53 when this user may bind it, else None."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("127.0.0.1", 53))
    except OSError:
        sock.close()
        yield None
        return
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize("network", [Network(), Network(mode="loopback"), allow("127.0.0.1:1")],
                         ids=["none", "loopback", "allow"])
def test_direct_tcp_udp_and_dns_fail_and_the_host_sees_nothing(network: Network) -> None:
    tcp, udp = TCPSink(), UDPSink()
    try:
        with host_dns_sink() as dns:
            result = run(py(_DIRECT_PROBE % {"tcp": tcp.port, "udp": udp.port}), network)
            dns_seen = None
            if dns is not None:
                with contextlib.suppress(BlockingIOError):
                    dns_seen = dns.recv(512)
        assert result.exit_code == 0, result.stderr
        seen = json.loads(result.stdout)
        # With lo down nothing is routable; with lo up the sandbox's own loopback answers
        # "nobody here" (TCP RST, ICMP port unreachable).
        expected = "ENETUNREACH" if network.effective_mode == "none" else "ECONNREFUSED"
        assert seen["tcp"] == expected
        assert seen["udp"] == expected
        assert seen["dns"] == "gaierror"
        assert tcp.connections() == 0
        assert udp.received() == []
        assert dns_seen is None
    finally:
        tcp.close()
        udp.close()


_LOOPBACK_PROBE = """
import errno, json, os, socket
out = {"proxy_env": os.environ.get("HTTP_PROXY")}
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=5).close()
    out["proxy"] = "connected"
except OSError as e:
    out["proxy"] = errno.errorcode.get(e.errno, str(e))
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("network", "proxy", "env"),
    [
        (Network(), "ENETUNREACH", None),
        (allow(), "ENETUNREACH", None),  # an empty allow-list is "none", never "everything"
        (Network(mode="loopback"), "ECONNREFUSED", None),
        (allow("127.0.0.1:1"), "connected", "http://127.0.0.1:3128"),
    ],
    ids=["none", "allow-empty", "loopback", "allow"],
)
def test_modes(network: Network, proxy: str, env: str | None) -> None:
    result = run(py(_LOOPBACK_PROBE), network)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["proxy"] == proxy
    assert seen["proxy_env"] == env
    assert "attempts" in result.extra["network"] or network.effective_mode != "allow"


def test_loopback_mode_serves_inside() -> None:
    code = (
        "import socket; s = socket.create_server(('127.0.0.1', 8000));"
        "c = socket.create_connection(('127.0.0.1', 8000)); a, _ = s.accept();"
        "c.sendall(b'inside'); print(a.recv(10).decode())"
    )
    result = run(py(code), Network(mode="loopback"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"inside\n"


def _proxy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nsbox-proxy")]


def _sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def test_proxy_threads_and_sockets_end_with_the_run() -> None:
    with EchoServer() as echo:
        threads, sockets = threading.active_count(), _sockets()
        # The probe leaves a tunnel open when it exits: the proxy must still end it.
        code = (
            "import socket; s = socket.create_connection(('127.0.0.1', 3128));"
            f"s.sendall(b'CONNECT 127.0.0.1:{echo.port} HTTP/1.1\\r\\n\\r\\n');"
            "print(s.recv(100).decode().splitlines()[0]); s.sendall(b'x'); s.recv(1)"
        )
        result = run(py(code), allow(f"127.0.0.1:{echo.port}"))
        assert result.stdout == b"HTTP/1.1 200 Connection established\n"
        for worker in echo._workers:
            worker.join(5)
        assert _proxy_threads() == []
        assert threading.active_count() == threads
        assert _sockets() - sockets == set()
        assert result.extra["network"]["threads_left"] == 0


def test_sandbox_cannot_take_over_the_proxy_port() -> None:
    # The listener lives in the sandbox's namespace, without SO_REUSEPORT: a second bind of
    # its address fails, so code inside cannot stand in for the proxy (socket(7)).
    code = (
        "import errno, socket\n"
        "try:\n    socket.create_server(('127.0.0.1', 3128)); print('bound')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])"
    )
    result = run(py(code), allow("127.0.0.1:1"))
    assert result.stdout == b"EADDRINUSE\n", result.stderr
