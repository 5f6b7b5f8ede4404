"""Ask before the network: in allow mode, a host not on the allow-list is put to the embedding
application's callback (Session(ask=...)), once per host and port; every answer is in the
Result and the audit record, and a refused host gets no connection (checked on the server).

What may be asked is a host as it reads: a lower-case DNS name or an IP address in one
printable form. A request whose host carries a scope id or a character a terminal obeys is
refused (rule net-authority), and an address the proxy refuses (loopback, private,
link-local, in any IPv4-mapped, -compatible, NAT64, 6to4 or Teredo form) is refused with
the usual reason, never offered for approval: the host's loopback listener gets nothing.

An address that can be approved is a public one: the approvals run in a network namespace of
the test's own (root makes it; sessiontools.OWN_NETWORK), where 1.2.3.4 is another host behind
a veth pair (an address of the namespace itself would be refused: rule "this host")."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, require
from netservers import HTTPServer
from ptytools import lines, nsbox_argv, obeyed, run_on_terminal
from sessiontools import OWN_NETWORK, PUBLIC_ADDRESS, UserRunner, user_runner

from nsbox.errors import PolicyError

CURL = shutil.which("curl", path="/usr/bin:/bin")


@pytest.fixture(params=["caller", "unprivileged", "nested"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nsbox-ask-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def _own_network() -> list[str]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None,
            "needs root and ip(8) for a network namespace of the test's own")
    return OWN_NETWORK


# Two HTTP servers on the public address of the test's own network, started by the script on
# the sockets listening there (sessiontools.OWN_NETWORK), answering "approved" and "never".
SERVERS = f"""
import http.server, os, socket, threading
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.seen.append(self.requestline)
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
far = iter(os.environ["NSBOX_TEST_FAR_FDS"].split(","))
def serve(body):
    server = http.server.ThreadingHTTPServer(({PUBLIC_ADDRESS!r}, 0), Handler,
                                             bind_and_activate=False)
    server.socket.close()
    server.socket = socket.socket(fileno=int(next(far)))  # listening on the far host
    server.server_port = server.socket.getsockname()[1]
    server.seen, server.body = [], body
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
good, bad = serve(b"approved\\n"), serve(b"never\\n")
"""


def test_ask_approves_one_host_and_refuses_another(as_user: UserRunner, shared_dir: Path):
    require(CURL is not None, "curl is not installed (Debian package curl)")
    wrap = _own_network()
    audit = shared_dir / "audit.jsonl"
    body = SERVERS + f"""
asked = []
def ask(host, port):
    asked.append([host, port])
    return port == good.server_port
policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.invalid:1",)))
with nsbox.Session(policy, ask=ask, audit={str(audit)!r}) as s:
    g, b = good.server_port, bad.server_port
    cmd = "; ".join([f"curl -sS http://{PUBLIC_ADDRESS}:{{g}}/a",
                     f"curl -sS http://{PUBLIC_ADDRESS}:{{g}}/b",
                     f"curl -sS -o /dev/null -w '%{{{{http_code}}}}\\n' http://{PUBLIC_ADDRESS}:{{b}}/c",
                     f"curl -sS -o /dev/null -w '%{{{{http_code}}}}\\n' http://{PUBLIC_ADDRESS}:{{b}}/d"])
    r = s.run(["sh", "-c", cmd])
    emit(out=r.stdout.decode(), err=r.stderr.decode(), asked=asked, good=g, bad=b,
         network=r.extra["network"], seen=[good.seen, bad.seen])
"""
    out = as_user.script(body, wrap=wrap)
    good, bad = out["good"], out["bad"]
    # Server-side evidence: the refused server saw nothing, the approved one both requests.
    assert out["seen"] == [["GET /a HTTP/1.1", "GET /b HTTP/1.1"], []]
    assert out["out"] == "approved\napproved\n403\n403\n", out["err"]
    # Asked once per host and port: the answers are remembered for the session.
    assert out["asked"] == [[PUBLIC_ADDRESS, good], [PUBLIC_ADDRESS, bad]]
    answers = [(a["host"], a["port"], a["approved"]) for a in out["network"]["answers"]]
    assert answers == [(PUBLIC_ADDRESS, good, True), (PUBLIC_ADDRESS, bad, False)]
    attempts = [(a["port"], a["allowed"], a["reason"]) for a in out["network"]["attempts"]]
    refused = f"{PUBLIC_ADDRESS}:{bad} is not in the allow-list and was refused when asked"
    assert attempts[2:] == [(bad, False, refused), (bad, False, refused)]
    assert [a[1] for a in attempts[:2]] == [True, True]
    record = json.loads(audit.read_text().splitlines()[-1])
    assert [(a["port"], a["approved"]) for a in record["network"]["answers"]] == [
        (good, True), (bad, False)]
    assert [a["allowed"] for a in record["network"]["attempts"]] == [True, True, False, False]


def test_ask_needs_allow_mode_and_a_callable() -> None:
    import nsbox

    with pytest.raises(PolicyError, match="ask needs a callable and network mode allow"):
        nsbox.Session(ask=lambda host, port: True)
    policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.org",)))
    with pytest.raises(PolicyError, match="expected a callable, got 'yes'"):
        nsbox.Session(policy, ask="yes")  # type: ignore[arg-type]


def test_cli_ask_puts_the_question_on_the_terminal(as_user: UserRunner):
    require(CURL is not None, "curl is not installed (Debian package curl)")
    wrap = _own_network()
    # The servers run in the namespace too: a small script starts them, then the CLI.
    script = SERVERS + f"""
import os, subprocess, sys
g, b = good.server_port, bad.server_port
code = subprocess.call([*{as_user.prefix()!r}, sys.executable, "-m", "nsbox", "run",
    "--allow-host", "example.invalid:1", "--ask", "--", "sh", "-c",
    f"curl -sS http://{PUBLIC_ADDRESS}:{{g}}/a; "
    f"curl -sS -o /dev/null -w 'code %{{{{http_code}}}}\\n' http://{PUBLIC_ADDRESS}:{{b}}/b"])
print(f"ports {{g}} {{b}} seen {{len(good.seen)}} {{len(bad.seen)}} exit {{code}}", flush=True)
"""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": str(as_user.tree),
           "HOME": "/tmp"}
    code, shown = run_on_terminal([*wrap, PYTHON, "-c", script], env, [b"y", b"n"])
    text = shown.decode()
    assert code == 0, text
    last = [line for line in lines(shown) if line.startswith("ports ")][-1].split()
    good, bad = last[1], last[2]
    assert last[3:] == ["seen", "1", "0", "exit", "0"], text
    assert (f"nsbox: the sandbox asks to reach {PUBLIC_ADDRESS}:{good}, which is not on the "
            "allow-list. Allow it for this run? [y/N] y") in lines(shown)
    assert f"asks to reach {PUBLIC_ADDRESS}:{bad}" in text
    assert "approved" in text and "code 403" in text


# --- what is never asked ---------------------------------------------------------------------

# CONNECT targets a hostile sandbox sends to the proxy, each aimed at the host's loopback
# listener on PORT, and the refusal it gets. The first is the attack as found: a scope id
# carrying CR, "erase line" and cursor moves that redraw the question as another host's.
ATTACKS = [
    ("[::ffff:127.0.0.1%\r\x1b[2K\x1b[1Apypi.org]:{port}",
     "a control, non-ASCII or other invisible character in the request line"),
    ("[::ffff:127.0.0.1%25pypi.org]:{port}", "an IPv6 scope id (or a %-escape) in the host"),
    ("[fe80::1%eth0]:{port}", "an IPv6 scope id"),
    ("pypi.org\u202e.evil:{port}", "a control, non-ASCII or other invisible character"),
    ("2130706433:{port}", "2130706433 is a number, not a host name"),
    ("0x7f.1:{port}", "0x7f.1 is a number, not a host name"),
    ("127.0.0.1:{port}", "127.0.0.1 resolves to loopback address 127.0.0.1"),
    ("[::ffff:127.0.0.1]:{port}", "127.0.0.1 resolves to loopback address 127.0.0.1"),
    ("[::127.0.0.1]:{port}", "::7f00:1 resolves to IPv4-compatible address ::7f00:1"),
    ("[::1]:{port}", "::1 resolves to loopback address ::1"),
    ("[64:ff9b::127.0.0.1]:{port}", "64:ff9b::7f00:1 resolves to loopback address 127.0.0.1 "
                                    "(embedded 127.0.0.1)"),
    ("[64:ff9b:1::7f00:1]:{port}", "resolves to local NAT64 address"),
    ("[2002:7f00:1::]:{port}", "2002:7f00:1:: resolves to loopback address 127.0.0.1 "
                               "(embedded 127.0.0.1)"),
    ("[2001:0:4136:e378:8000:63bf:80ff:fffe]:{port}", "resolves to Teredo address"),
    ("169.254.169.254:{port}", "resolves to link-local (cloud metadata) address"),
    ("10.0.0.1:{port}", "resolves to private address 10.0.0.1"),
    ("LocalHost.:{port}", "localhost is the host itself (loopback)"),
    ("db.localhost:{port}", "db.localhost is the host itself (loopback)"),
]
PROBE = """
import json, os, socket, sys
proxy = os.environ["http_proxy"].rsplit(":", 1)
answers = []
for target in json.loads(sys.argv[1]):
    s = socket.create_connection((proxy[0][len("http://"):], int(proxy[1])))
    s.sendall(b"CONNECT " + target.encode("utf-8", "surrogateescape") + b" HTTP/1.1\\r\\n\\r\\n"
              + b"GET / HTTP/1.0\\r\\n\\r\\n")
    answers.append(s.recv(4096).decode("utf-8", "replace").split("\\r\\n", 1)[0])
    s.close()
print(json.dumps(answers))
"""


def test_forged_and_forbidden_hosts_are_never_asked(as_user: UserRunner):
    """From inside a real sandbox: each attack is refused without a question; the callback
    never runs and the host's loopback listener gets no byte."""
    with HTTPServer(b"never\n") as listener:
        targets = [t.format(port=listener.port) for t, _ in ATTACKS]
        targets.append(f"Example.INVALID.:{listener.port}")  # asked, in its canonical form
        out = as_user.script(f"""
asked = []
def ask(host, port):
    asked.append([host, port])
    return True
policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.invalid:1",)))
with nsbox.Session(policy, ask=ask) as s:
    r = s.run(["python3", "-c", {PROBE!r}, {json.dumps(targets)!r}])
    emit(out=r.stdout.decode(), err=r.stderr.decode(), asked=asked,
         attempts=r.extra["network"]["attempts"])
""")
        assert listener.requests == []  # host-side evidence: nothing reached it
    # The callback saw one host, as the proxy checked it: lower case, no final dot.
    assert out["asked"] == [["example.invalid", listener.port]]
    answers = json.loads(out["out"])
    assert all(a.startswith(("HTTP/1.1 400", "HTTP/1.1 403")) for a in answers[:-1]), answers
    assert answers[-1].startswith("HTTP/1.1 502"), answers  # approved, but no such name
    reasons = [a["reason"] for a in out["attempts"]][:-1]
    assert len(reasons) == len(ATTACKS)
    for (target, why), reason in zip(ATTACKS, reasons, strict=True):
        assert why in reason, (target, reason)  # the record keeps the request as it came
    assert all(not a["allowed"] and a["address"] is None for a in out["attempts"])
    assert out["attempts"][-1]["host"] == "example.invalid"


def test_cli_shows_the_refusal_of_a_forged_host_escaped(as_user: UserRunner):
    """`nsbox run --ask` on a terminal: the forged request gets no question, and the line
    that reports its refusal shows the sandbox's bytes as escapes."""
    with HTTPServer(b"never\n") as listener:
        targets = [ATTACKS[0][0].format(port=listener.port), f"[::ffff:127.0.0.1]:{listener.port}"]
        code, shown = run_on_terminal(nsbox_argv(
            as_user.prefix(), "run", "--allow-host", "example.invalid:1", "--ask", "--",
            "python3", "-c", PROBE, json.dumps(targets)),
            {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(as_user.tree), "HOME": "/tmp"},
            [b"y", b"y"])
        assert listener.requests == []
    assert code == 0, shown
    assert b"[y/N]" not in shown and b"asks to reach" not in shown
    text = lines(shown)
    assert ("nsbox: network: refused request ?: a control, non-ASCII or other invisible "
            "character in the request line CONNECT [::ffff:127.0.0.1%\\r\\x1b[2K\\x1b[1Apypi.org]:"
            f"{listener.port} HTTP/1.1 (rule net-authority)") in text
    assert (f"nsbox: network: refused CONNECT 127.0.0.1:{listener.port}: 127.0.0.1 resolves to "
            "loopback address 127.0.0.1; list that address itself to allow it") in text
    assert obeyed(shown.replace(json.dumps(targets).encode(), b"")) == []
