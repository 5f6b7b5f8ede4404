"""The proxy's bounds against a hostile sandbox: the host's own addresses, the questions of
``ask``, a log that cannot be blinded, and request heads trickled a byte at a time.

Like tests/test_netproxy.py, the proxy runs here on a listener of the test process. The test of
the host's own addresses runs in a network namespace it creates, with an address it adds there
(11.0.0.1, outside every fixed range the rules refuse): the machine's own network is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import require
from netservers import EchoServer
from test_netproxy import connect_tunnel, proxy, request

from nsbox.host.netlog import ProxyLog, summary
from nsbox.host.netproxy import NetworkProxy, ProxyLimits
from nsbox.host.network import RunNetwork
from nsbox.policy.policy import Network

REPO = Path(__file__).resolve().parent.parent

# Run in a new network namespace: lo up with 11.0.0.1 and 2a00:1::1 on it, standing for the
# public IPv4 and global IPv6 of a host's interface, and a service listening on [::] (every
# address, both families) that should only ever be reached through loopback.
OWN_ADDRESS_PROBE = r"""
import json, socket, subprocess, threading
from nsbox.host.netproxy import NetworkProxy
from nsbox.policy.netrules import parse_allow_list

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "11.0.0.1/32", "dev", "lo"], check=True)
six = subprocess.run(["ip", "-6", "addr", "add", "2a00:1::1/128", "dev", "lo", "nodad"])
six = six.returncode == 0
service = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
target = service.getsockname()[1]
hits = []

def serve():
    while True:
        try:
            conn, peer = service.accept()
        except OSError:
            return
        hits.append(peer[0])
        conn.close()

threading.Thread(target=serve, daemon=True).start()
ADDRESSES = {"own": "11.0.0.1", "six": "2a00:1::1", "other": "11.0.0.2"}

def resolve(host, port, **kwargs):
    return socket.getaddrinfo(ADDRESSES[host.split(".")[0]], port, **kwargs)

def attempt(allow, host, ask=None):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with NetworkProxy(listener, parse_allow_list(allow), resolve=resolve, ask=ask) as p:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(f"CONNECT {host}:{target} HTTP/1.1\r\n\r\n".encode())
            status = client.recv(4096).split(b"\r\n")[0].decode()
    return [status, p.report()["attempts"][0]["reason"]]

asked = []
def ask(host, port):
    asked.append(host)
    return True

out = {
    "listed": attempt([f"*.nsbox-test.invalid:{target}"], "own.nsbox-test.invalid"),
    "approved": attempt([], "own.nsbox-test.invalid", ask=ask),
    "literal asked": attempt([], "11.0.0.1", ask=ask),
    "mapped asked": attempt([], "[::ffff:11.0.0.1]", ask=ask),
    "other": attempt([f"other.nsbox-test.invalid:{target}"], "other.nsbox-test.invalid"),
}
if six:
    out["six"] = attempt([f"six.nsbox-test.invalid:{target}"], "six.nsbox-test.invalid")
out["hits before listing"] = list(hits)
out["literal listed"] = attempt([f"own.nsbox-test.invalid:{target}", f"11.0.0.1:{target}"],
                                "own.nsbox-test.invalid")
out["asked"] = asked
out["hits"] = hits
out["six available"] = six
print(json.dumps(out))
"""


def _in_new_netns() -> list[str] | None:
    """The command prefix that runs a program in a network namespace of its own."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return None
    for prefix in (["unshare", "--net"], ["unshare", "--net", "--map-root-user"]):
        if subprocess.run([*prefix, "ip", "link", "set", "lo", "up"],
                          capture_output=True).returncode == 0:
            return prefix
    return None


def test_a_name_resolving_to_the_hosts_own_address_is_refused_as_this_host() -> None:
    prefix = _in_new_netns()
    require(prefix is not None, "unshare --net and ip, to own an address in a namespace")
    assert prefix is not None
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([*prefix, sys.executable, "-c", OWN_ADDRESS_PROBE], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    this_host = "this host address 11.0.0.1"
    # An allow-listed name, and a name a person approved, still may not lead to the host.
    for case in ("listed", "approved"):
        status, reason = out[case]
        assert status.startswith("HTTP/1.1 403"), (case, out[case])
        assert f"resolves to {this_host}" in reason, (case, reason)
    # The host's own address as a literal, in any form, is never put to a person.
    for case in ("literal asked", "mapped asked"):
        assert out[case][0].startswith("HTTP/1.1 403"), (case, out[case])
        assert this_host in out[case][1], (case, out[case])
    assert out["asked"] == ["own.nsbox-test.invalid"]
    if out["six available"]:
        assert out["six"][0].startswith("HTTP/1.1 403"), out["six"]
        assert "this host address 2a00:1::1" in out["six"][1]
    # An address that is not the host's own is not refused by this rule (nothing routes it).
    assert out["other"][0].startswith("HTTP/1.1 502"), out["other"]
    assert out["hits before listing"] == []
    # Listed literally, with its port, the address is the user's choice, as for loopback.
    assert out["literal listed"][0] == "HTTP/1.1 200 Connection established"
    assert out["hits"] == ["::ffff:11.0.0.1"]


def test_questions_are_capped_and_the_rest_refused_without_asking() -> None:
    asked: list[str] = []

    def ask(host: str, port: int) -> bool:
        asked.append(host)
        return False

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    limits = ProxyLimits(max_questions=20, max_records=8)
    with NetworkProxy(listener, (), limits, ask=ask) as p:
        for i in range(30):
            request(port, f"CONNECT h{i}.nsbox-test.invalid:443 HTTP/1.1\r\n\r\n".encode())
        first = p.report(reset=True)
        # The next command of the session: an answer given is still remembered, and the
        # limit is the proxy's, not the command's.
        again = request(port, b"CONNECT h0.nsbox-test.invalid:443 HTTP/1.1\r\n\r\n")
        new = request(port, b"CONNECT new.nsbox-test.invalid:443 HTTP/1.1\r\n\r\n")
        second = p.report()
    assert len(asked) == 20
    assert len(first["answers"]) == 8 and first["answers_dropped"] == 12
    assert first["not_asked"] == 10
    reasons = [a["reason"] for a in first["attempts"]]
    assert ("h0.nsbox-test.invalid:443 is not in the allow-list and was refused when asked"
            in reasons)
    assert b"refused when asked" in again
    assert b"was not asked: the limit of 20 questions of this run or session was reached" in new
    assert second["answers"] == [] and second["not_asked"] == 1
    assert len(asked) == 20


def test_refused_requests_cannot_push_an_allowed_connection_out_of_the_log() -> None:
    with EchoServer() as echo, proxy([f"127.0.0.1:{echo.port}"], max_records=10) as (p, port):
        for _ in range(30):
            request(port, b"CONNECT junk.nsbox-test.invalid:443 HTTP/1.1\r\n\r\n")
        for _ in range(12):
            sock, reply = connect_tunnel(port, f"127.0.0.1:{echo.port}")
            with sock:
                assert reply.startswith(b"HTTP/1.1 200")
                sock.sendall(b"THE-REAL-UPLOAD")
                assert sock.recv(100) == b"THE-REAL-UPLOAD"
        p.close()
        report = p.report()
    allowed = [a for a in report["attempts"] if a["allowed"]]
    refused = [a for a in report["attempts"] if not a["allowed"]]
    assert len(allowed) == 10 and len(refused) == 10
    assert report["refused_dropped"] == 20
    assert report["attempts_dropped"] == 22
    # Every admitted connection is in the sums, whatever was dropped from the list.
    assert report["destinations"] == [{
        "host": "127.0.0.1", "port": echo.port, "addresses": ["127.0.0.1"],
        "connections": 12, "bytes_up": 12 * 15, "bytes_down": 12 * 15,
    }]


def test_the_summary_for_a_person_is_bounded_and_escaped() -> None:
    """What `nsbox run` and the MCP text show of a log: the first refused attempts, then how
    many more, those the log dropped included; the destinations reached, the rest summed; every
    name the sandbox made escaped (nsbox/visible.py)."""
    log = ProxyLog(max_records=3, asking=False)
    started = time.time()
    for i in range(5):  # the log keeps 3 of them
        log.attempt("G\x1b[2JET" if i == 0 else "CONNECT", f"r{i}.example", 443, False,
                    f"r{i}.example:443 \u202eis not in the allow-list", 0, 0, started + i)
    for host, up in [("a.example", 1), ("a.example", 2), ("evil\x1b]0;t\x07.example", 4),
                     ("c.example", 8), ("d.example", 16), ("e.example", 32)]:
        log.attempt("CONNECT", host, 443, True, "closed", up, 2 * up, started)
    report = log.report()
    assert summary(report, refused=2, destinations=2) == [
        "refused G\\x1b[2JET r0.example:443: r0.example:443 \\u202eis not in the allow-list",
        "refused CONNECT r1.example:443: r1.example:443 \\u202eis not in the allow-list",
        "... and 3 more refused (not listed)",
        "reached a.example:443: 2 connections, 3 bytes sent, 6 bytes received",
        "reached evil\\x1b]0;t\\x07.example:443: 1 connection, 4 bytes sent, 8 bytes received",
        "... and 1 more destinations reached (not listed): 1 connection, 8 bytes sent, "
        "16 bytes received",
        "reached more destinations than the log names, summed: 2 connections, 48 bytes sent, "
        "96 bytes received",
    ]
    assert summary(ProxyLog(max_records=3, asking=False).report()) == []
    # With the defaults: the 3 refused kept, "2 more", the 3 destinations named, their sum.
    assert summary(report)[3:5] == ["... and 2 more refused (not listed)",
                                    "reached a.example:443: 2 connections, 3 bytes sent, "
                                    "6 bytes received"]
    assert len(summary(report)) == 8


def test_each_command_of_a_session_has_its_own_log_and_bounds() -> None:
    with EchoServer() as echo:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        net = RunNetwork(Network(mode="allow", allow=(f"127.0.0.1:{echo.port}",)))
        net.serve([listener.detach()])
        try:
            for _ in range(1001):  # the first command fills its log with refusals
                request(port, b"CONNECT junk.nsbox-test.invalid:443 HTTP/1.1\r\n\r\n")
            first = net.report_since()
            sock, reply = connect_tunnel(port, f"127.0.0.1:{echo.port}")
            with sock:
                sock.sendall(b"upload")
                assert sock.recv(100) == b"upload"
            # The proxy logs the tunnel once it has seen it close.
            deadline = time.monotonic() + 10
            while (net.proxy is not None and not net.proxy.report()["attempts"]
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            second = net.report_since()
        finally:
            net.close()
    assert first is not None and second is not None
    assert len(first["attempts"]) == 1000 and first["refused_dropped"] == 1
    (attempt,) = second["attempts"]
    assert attempt["allowed"] and attempt["bytes_up"] == 6
    assert second["attempts_dropped"] == 0
    assert [d["connections"] for d in second["destinations"]] == [1]


class _Trickle:
    """A client that sends its head ``size`` bytes per recv, always readable."""

    def __init__(self, data: bytes, size: int = 1) -> None:
        self._ready, self._other = socket.socketpair()
        self._other.send(b"x")
        self._data, self._pos, self._size = data, 0, size

    def fileno(self) -> int:
        return self._ready.fileno()

    def setblocking(self, flag: bool) -> None:
        pass

    def recv(self, n: int) -> bytes:
        self._pos += self._size
        return self._data[self._pos - self._size:self._pos]

    def close(self) -> None:
        self._ready.close()
        self._other.close()


def _head_cpu(p: NetworkProxy, size: int) -> float:
    head = b"GET http://a.nsbox-test.invalid/ HTTP/1.1\r\nX: " + b"a" * size + b"\r\n\r\n"
    best = float("inf")
    for _ in range(3):
        client = _Trickle(head)
        started = time.thread_time()
        got, rest = p._read_head(client)  # type: ignore[arg-type]
        best = min(best, time.thread_time() - started)
        client.close()
        assert got == head[:-4] and rest == b""
    return best


def test_a_trickled_head_costs_the_proxy_linear_time() -> None:
    # A head sent a byte at a time was scanned and copied whole on every recv: 64 KiB of it
    # took about 80 times the CPU of 4 KiB. Linear work takes 16 times.
    with proxy(["pypi.org"]) as (p, _):
        small, large = _head_cpu(p, 4000), _head_cpu(p, 64000)
    assert large / small < 32, (small, large)


def test_the_head_ends_at_the_first_blank_line_whatever_the_segments() -> None:
    with proxy(["pypi.org"]) as (p, _):
        for data, head in [
            (b"A\r\n\r\nB\r\n\r\nC", b"A"),
            (b"\r\n\r\n", b""),
            (b"A\r\n\r\r\n\r\nB", b"A\r\n\r"),
        ]:
            for size in range(1, len(data) + 1):
                client = _Trickle(data, size)
                got, rest = p._read_head(client)  # type: ignore[arg-type]
                client.close()
                assert got == head, (data, size)
                assert data.startswith(head + b"\r\n\r\n" + rest), (data, size)
