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
from typing import Any

import _driver
import pytest
from conftest import PYTHON, REPO, Runner, require
from netservers import EchoServer, HTTPServer, TCPSink, UDPSink

from nsbox.result import Result, Status

CURL = shutil.which("curl", path="/usr/bin:/bin")


def run(sandbox: Runner, argv: list[str], network: dict[str, Any]) -> Result:
    result = sandbox.run(argv, policy_changes={"network": network})
    assert result.status in (Status.OK, Status.RE), (result.status, result.stderr)
    return result


# --- probes ------------------------------------------------------------------------------------


def py(code: str) -> list[str]:
    return [PYTHON, "-I", "-S", "-c", code]


def allow(*entries: str) -> dict[str, Any]:
    return {"mode": "allow", "allow": list(entries)}


NONE: dict[str, Any] = {"mode": "none"}
LOOPBACK: dict[str, Any] = {"mode": "loopback"}
HELLO = b"hello from the host\n"


def test_curl_reaches_the_listed_server_through_the_proxy(sandbox: Runner) -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server:
        result = run(sandbox, [CURL, "-sS", f"http://127.0.0.1:{server.port}/x"],
                     allow(f"127.0.0.1:{server.port}"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == HELLO
    assert [r["line"] for r in server.requests] == ["GET /x HTTP/1.1"]
    network = result.extra["network"]
    assert network["mode"] == "allow" and network["proxy"] == "127.0.0.1:3128"
    (attempt,) = network["attempts"]
    assert attempt["allowed"] and attempt["port"] == server.port
    assert attempt["bytes_down"] >= len(HELLO)


def test_curl_tunnels_with_connect(sandbox: Runner) -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server:
        # --proxytunnel: CONNECT first, then the request inside the tunnel (as for HTTPS).
        result = run(sandbox, [CURL, "-sS", "--proxytunnel", f"http://127.0.0.1:{server.port}/t"],
                     allow(f"127.0.0.1:{server.port}"))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == HELLO
    (attempt,) = result.extra["network"]["attempts"]
    assert attempt["method"] == "CONNECT" and attempt["allowed"]
    assert attempt["bytes_down"] > len(HELLO)


def test_python_urllib_reaches_the_listed_server(sandbox: Runner) -> None:
    with HTTPServer() as server:
        result = run(
            sandbox,
            py(f"import urllib.request; print(urllib.request.urlopen("
               f"'http://127.0.0.1:{server.port}/u', timeout=10).read().decode(), end='')"),
            allow(f"127.0.0.1:{server.port}"),
        )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == HELLO
    assert server.requests[0]["line"] == "GET /u HTTP/1.1"


def test_unlisted_server_gets_403_and_the_attempt_is_logged(sandbox: Runner) -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as listed, HTTPServer() as other:
        result = run(sandbox, [CURL, "-s", "-w", "%{http_code}",
                               f"http://127.0.0.1:{other.port}/"],
                     allow(f"127.0.0.1:{listed.port}"))
    # The proxy's one-line reason, then curl's status code.
    reason = f"127.0.0.1:{other.port} is not in the allow-list"
    assert result.stdout == f"nsbox proxy: {reason}\n403".encode()
    assert other.requests == [] and listed.requests == []
    (attempt,) = result.extra["network"]["attempts"]
    assert attempt["allowed"] is False
    assert (attempt["host"], attempt["port"]) == ("127.0.0.1", other.port)
    assert attempt["reason"] == reason


def test_client_ignoring_the_proxy_gets_no_network(sandbox: Runner) -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server:
        result = run(sandbox, [CURL, "-sS", "--noproxy", "*", f"http://127.0.0.1:{server.port}/"],
                     allow(f"127.0.0.1:{server.port}"))
    assert result.exit_code == 7  # curl: "Failed to connect to host"
    assert b"Couldn't connect to server" in result.stderr or b"Connection refused" in result.stderr
    assert server.requests == []
    assert result.extra["network"]["attempts"] == []


def test_name_resolving_to_loopback_needs_the_address_listed(sandbox: Runner) -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    # The proxy resolves on the host: localhost must map to 127.0.0.1 in the host's /etc/hosts.
    with open("/etc/hosts") as f:
        require(
            any(line.split()[:1] == ["127.0.0.1"] and "localhost" in line.split()[1:]
                for line in f),
            "/etc/hosts of this machine does not map localhost to 127.0.0.1",
        )
    fetch = [CURL, "-s", "-w", "%{http_code}"]
    with HTTPServer() as server:
        url = f"http://localhost:{server.port}/"
        refused = run(sandbox, [*fetch, url], allow(f"localhost:{server.port}"))
        admitted = run(sandbox, [*fetch, url],
                       allow(f"localhost:{server.port}", f"127.0.0.1:{server.port}"))
    assert refused.stdout.endswith(b"403")
    assert b"resolves to loopback address 127.0.0.1" in refused.stdout
    assert admitted.stdout == HELLO + b"200"
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
def host_dns_sink() -> Any:
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


@pytest.mark.parametrize("network", [NONE, LOOPBACK, allow("127.0.0.1:1")],
                         ids=["none", "loopback", "allow"])
def test_direct_tcp_udp_and_dns_fail_and_the_host_sees_nothing(
    sandbox: Runner, network: dict[str, Any]
) -> None:
    tcp, udp = TCPSink(), UDPSink()
    try:
        with host_dns_sink() as dns:
            result = run(sandbox, py(_DIRECT_PROBE % {"tcp": tcp.port, "udp": udp.port}),
                         network)
            dns_seen = None
            if dns is not None:
                with contextlib.suppress(BlockingIOError):
                    dns_seen = dns.recv(512)
        assert result.exit_code == 0, result.stderr
        seen = json.loads(result.stdout)
        # With lo down nothing is routable; with lo up the sandbox's own loopback answers
        # "nobody here" (TCP RST, ICMP port unreachable). Without /etc/resolv.conf, glibc
        # asks 127.0.0.1:53 — the sandbox's own loopback (resolv.conf(5)).
        expected = "ENETUNREACH" if network["mode"] == "none" else "ECONNREFUSED"
        assert seen["tcp"] == expected
        assert seen["udp"] == expected
        assert seen["dns"] == "gaierror"
        assert seen["resolv.conf"] is None
        assert tcp.connections() == 0
        assert udp.received() == []
        assert dns_seen is None
    finally:
        tcp.close()
        udp.close()


_MODE_PROBE = """
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
    ("network", "proxy", "env", "mode"),
    [
        (NONE, "ENETUNREACH", None, None),
        (allow(), "ENETUNREACH", None, "none"),  # an empty allow-list is "none", not "everything"
        (LOOPBACK, "ECONNREFUSED", None, "loopback"),
        (allow("127.0.0.1:1"), "connected", "http://127.0.0.1:3128", "allow"),
    ],
    ids=["none", "allow-empty", "loopback", "allow"],
)
def test_modes(sandbox: Runner, network: dict[str, Any], proxy: str, env: str | None,
               mode: str | None) -> None:
    result = run(sandbox, py(_MODE_PROBE), network)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["proxy"] == proxy
    assert seen["proxy_env"] == env
    assert result.extra.get("network", {}).get("mode") == mode


def test_loopback_mode_serves_inside(sandbox: Runner) -> None:
    code = (
        "import socket; s = socket.create_server(('127.0.0.1', 8000));"
        "c = socket.create_connection(('127.0.0.1', 8000)); a, _ = s.accept();"
        "c.sendall(b'inside'); print(a.recv(10).decode())"
    )
    result = run(sandbox, py(code), LOOPBACK)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == b"inside\n"


def test_sandbox_cannot_take_over_the_proxy_port(sandbox: Runner) -> None:
    # The listener lives in the sandbox's namespace, without SO_REUSEPORT: a second bind of
    # its address fails, so code inside cannot stand in for the proxy (socket(7)).
    code = (
        "import errno, socket\n"
        "try:\n    socket.create_server(('127.0.0.1', 3128)); print('bound')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])"
    )
    result = run(sandbox, py(code), allow("127.0.0.1:1"))
    assert result.stdout == b"EADDRINUSE\n", result.stderr


def test_no_process_inside_holds_the_listener(sandbox: Runner) -> None:
    # Every descriptor of the sandbox's processes, and every listening TCP socket inside:
    # the proxy's listener is there (in the namespace) but no process inside owns it.
    code = (
        "import os\n"
        "print(sorted(os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')"
        " if fd not in ('0', '1', '2') and os.path.exists(f'/proc/self/fd/{fd}')))\n"
        "print([l.split()[1] for l in open('/proc/net/tcp').readlines()[1:]"
        " if l.split()[3] == '0A'])"
    )
    result = run(sandbox, py(code), allow("127.0.0.1:1"))
    fds, listening = result.stdout.decode().splitlines()
    assert fds == "[]", result.stdout  # only 0, 1, 2 (and the listing's own, gone by now)
    assert listening == "['0100007F:0C38']"  # 127.0.0.1:3128, in the sandbox's namespace


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
    # In this process (the proxy runs in the caller of nsbox.run).
    with EchoServer() as echo:
        _driver.invoke(["true"], {})  # the launch helper's socket exists before we count
        threads, sockets = threading.active_count(), _sockets()
        # The probe exits with its tunnel open: all of it must still be gone afterwards.
        code = (
            "import socket; s = socket.create_connection(('127.0.0.1', 3128));"
            f"s.sendall(b'CONNECT 127.0.0.1:{echo.port} HTTP/1.1\\r\\n\\r\\n');"
            "print(s.recv(100).decode().splitlines()[0]); s.sendall(b'x'); s.recv(1)"
        )
        result = _driver.invoke(
            py(code), {"policy_changes": {"network": allow(f"127.0.0.1:{echo.port}")}}
        )
        assert result.stdout == b"HTTP/1.1 200 Connection established\n", result.stderr
        for worker in echo._workers:
            worker.join(5)
        assert _proxy_threads() == []
        assert threading.active_count() == threads
        assert _sockets() - sockets == set()
        assert result.extra["network"]["threads_left"] == 0
        (attempt,) = result.extra["network"]["attempts"]
        assert attempt["allowed"] and attempt["bytes_up"] == attempt["bytes_down"] == 1


# --- the command line --------------------------------------------------------------------------


def nsbox_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", "run", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("", "empty"),
        ("https://pypi.org", "no scheme"),
        ("pypi.org/simple", "without path"),
        ("pypi.org:70000", "outside 1-65535"),
        ("a.*.example.org", "wildcard is allowed only as the first label"),
    ],
)
def test_cli_rejects_bad_allow_host_naming_the_entry(entry: str, why: str) -> None:
    proc = nsbox_cli("--allow-host", "pypi.org", "--allow-host", entry, "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith(f"nsbox: --allow-host: bad allow-list entry {entry!r}: ")
    assert why in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_allow_host_needs_allow_mode() -> None:
    proc = nsbox_cli("--net", "loopback", "--allow-host", "pypi.org", "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith("nsbox: --allow-host: needs --net allow, not --net loopback")


def test_cli_allow_host_reaches_the_listed_server() -> None:
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server, HTTPServer() as other:
        listed = nsbox_cli("--allow-host", f"127.0.0.1:{server.port}", "--", CURL or "curl",
                           "-s", f"http://127.0.0.1:{server.port}/cli")
        refused = nsbox_cli("--json", "--allow-host", f"127.0.0.1:{server.port}", "--",
                            CURL or "curl", "-s", f"http://127.0.0.1:{other.port}/")
    assert (listed.returncode, listed.stdout) == (0, HELLO.decode()), listed.stderr
    assert server.requests[0]["line"] == "GET /cli HTTP/1.1"
    assert other.requests == []
    (attempt,) = json.loads(refused.stdout)["extra"]["network"]["attempts"]
    assert attempt["allowed"] is False and attempt["port"] == other.port


def test_cli_says_why_the_proxy_refused_a_connection() -> None:
    # curl prints only "CONNECT tunnel failed, response 403": the reason must reach the user.
    require(CURL, "curl is not installed (Debian package curl)")
    with HTTPServer() as server, HTTPServer() as other:
        refused = nsbox_cli("--allow-host", f"127.0.0.1:{server.port}", "--", CURL or "curl",
                            "-s", "-p", f"http://127.0.0.1:{other.port}/")
    assert other.requests == []
    assert (f"nsbox: network: refused CONNECT 127.0.0.1:{other.port}: 127.0.0.1:{other.port} "
            "is not in the allow-list") in refused.stderr, refused.stderr


# The sandbox's side of a busy run: a forged name first (an OSC title, then "clear screen"),
# one fetch from the listed server, then a flood of refused CONNECTs.
FLOOD = r"""
import os, socket, sys, urllib.request
proxy, port = os.environ["http_proxy"][len("http://"):].rsplit(":", 1)
def connect(target):
    with socket.create_connection((proxy, int(port))) as s:
        s.sendall(b"CONNECT " + target.encode() + b" HTTP/1.1\r\n\r\n")
        return s.recv(4096).split(b"\r\n")[0].decode()
print(connect("x\x1b]0;owned\x07\x1b[2J.example:80"))
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(), end="")
print(set(connect(f"h{i}.example.invalid:80") for i in range(int(sys.argv[2]))))
"""


def test_cli_summarizes_a_flood_of_refused_requests_and_the_hosts_reached() -> None:
    """`nsbox run`'s stderr: the first refused attempts (a forged name escaped), how many more
    were refused, counting those the log did not keep; each destination reached. --json keeps
    the whole log."""
    from nsbox.host.netlog import SHOWN_REFUSED

    flood = 1500
    with HTTPServer() as server:
        url = f"http://127.0.0.1:{server.port}/once"
        args = ["--allow-host", f"127.0.0.1:{server.port}", "--", *py(FLOOD), url, str(flood)]
        shown = nsbox_cli(*args)
        as_json = nsbox_cli("--json", *args)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["HTTP/1.1 400 Bad Request", HELLO.decode().strip(),
                                         "{'HTTP/1.1 403 Forbidden'}"]
    assert len(server.requests) == 2  # once per run
    lines = shown.stderr.splitlines()
    refused = [line for line in lines if line.startswith("nsbox: network: refused ")]
    assert len(refused) == SHOWN_REFUSED, shown.stderr
    assert "\x1b" not in shown.stderr and "\x07" not in shown.stderr
    assert refused[0] == (
        "nsbox: network: refused request ?: a control, non-ASCII or other invisible character "
        "in the request line CONNECT x\\x1b]0;owned\\x07\\x1b[2J.example:80 HTTP/1.1 "
        "(rule net-authority)")
    assert refused[1].startswith("nsbox: network: refused CONNECT h0.example.invalid:80: ")
    # 1 + 1500 refused, of which the log kept 1000 and this lists 20.
    more = 1 + flood - SHOWN_REFUSED
    assert f"nsbox: network: ... and {more} more refused (not listed)" in lines, shown.stderr
    (reached,) = [line for line in lines if line.startswith("nsbox: network: reached ")]
    assert reached.startswith(f"nsbox: network: reached 127.0.0.1:{server.port}: 1 connection, ")
    assert len(lines) == SHOWN_REFUSED + 2, shown.stderr  # nothing else of the network
    network = json.loads(as_json.stdout)["extra"]["network"]
    assert as_json.stderr == ""
    assert len([a for a in network["attempts"] if not a["allowed"]]) == 1000
    assert network["refused_dropped"] == flood + 1 - 1000
    (dest,) = network["destinations"]
    assert (dest["host"], dest["port"], dest["connections"]) == ("127.0.0.1", server.port, 1)
    assert f"1 connection, {dest['bytes_up']} bytes sent, {dest['bytes_down']} bytes received" \
        in reached
