"""Ask before the network: in allow mode, a host not on the allow-list is put to the embedding
application's callback (Session(ask=...)), once per host and port; every answer is in the
Result and the audit record, and a refused host gets no connection (checked on the server)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from netservers import HTTPServer
from sessiontools import UserRunner, user_runner

from nsbox.errors import PolicyError

CURL = shutil.which("curl", path="/usr/bin:/bin")


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nsbox-ask-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def test_ask_approves_one_host_and_refuses_another(as_user: UserRunner, shared_dir: Path):
    assert CURL, "curl is needed inside the sandbox"
    audit = shared_dir / "audit.jsonl"
    with HTTPServer(b"approved\n") as good, HTTPServer(b"never\n") as bad:
        body = f"""
asked = []
def ask(host, port):
    asked.append([host, port])
    return port == {good.port}
policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.invalid:1",)))
with nsbox.Session(policy, ask=ask, audit={str(audit)!r}) as s:
    cmd = "; ".join(["curl -sS http://127.0.0.1:{good.port}/a",
                     "curl -sS http://127.0.0.1:{good.port}/b",
                     "curl -sS -o /dev/null -w '%{{http_code}}\\n' http://127.0.0.1:{bad.port}/c",
                     "curl -sS -o /dev/null -w '%{{http_code}}\\n' http://127.0.0.1:{bad.port}/d"])
    r = s.run(["sh", "-c", cmd])
    emit(out=r.stdout.decode(), err=r.stderr.decode(), asked=asked,
         network=r.extra["network"])
"""
        out = as_user.script(body)
        # Host-side evidence: the refused server saw nothing, the approved one both requests.
        assert bad.requests == []
        assert [r["line"] for r in good.requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1"]
    assert out["out"] == "approved\napproved\n403\n403\n"
    # Asked once per host and port: the answers are remembered for the session.
    assert out["asked"] == [["127.0.0.1", good.port], ["127.0.0.1", bad.port]]
    answers = [(a["host"], a["port"], a["approved"]) for a in out["network"]["answers"]]
    assert answers == [("127.0.0.1", good.port, True), ("127.0.0.1", bad.port, False)]
    attempts = [(a["port"], a["allowed"], a["reason"]) for a in out["network"]["attempts"]]
    refused = f"127.0.0.1:{bad.port} is not in the allow-list and was refused when asked"
    assert attempts[2:] == [(bad.port, False, refused), (bad.port, False, refused)]
    assert [a[1] for a in attempts[:2]] == [True, True]
    record = json.loads(audit.read_text().splitlines()[-1])
    assert [(a["port"], a["approved"]) for a in record["network"]["answers"]] == [
        (good.port, True), (bad.port, False)]
    assert [a["allowed"] for a in record["network"]["attempts"]] == [True, True, False, False]


def test_ask_needs_allow_mode_and_a_callable() -> None:
    import nsbox

    with pytest.raises(PolicyError, match="ask needs a callable and network mode allow"):
        nsbox.Session(ask=lambda host, port: True)
    policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.org",)))
    with pytest.raises(PolicyError, match="expected a callable, got 'yes'"):
        nsbox.Session(policy, ask="yes")  # type: ignore[arg-type]


def _run_on_a_terminal(user: UserRunner, argv: list[str], answers: list[bytes]
                       ) -> tuple[int, bytes]:
    """Run the CLI with a new pseudo-terminal as its controlling terminal, answering each
    nsbox question with the next of ``answers``; its exit status and everything it showed."""
    import fcntl
    import os
    import pty
    import select
    import subprocess
    import termios
    import time

    from conftest import PYTHON

    master, slave = pty.openpty()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp"}
    proc = subprocess.Popen(
        [*user.prefix(), PYTHON, "-m", "nsbox", *argv], stdin=slave, stdout=slave,
        stderr=slave, env=env, cwd="/", start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            shown += chunk
            while answers and shown.count(b"[y/N]") > shown.count(b"<answered>"):
                os.write(master, answers.pop(0) + b"\n")
                shown += b"<answered>"
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), shown


def test_cli_ask_puts_the_question_on_the_terminal(as_user: UserRunner):
    assert CURL, "curl is needed inside the sandbox"
    with HTTPServer(b"approved\n") as good, HTTPServer(b"never\n") as bad:
        code, shown = _run_on_a_terminal(as_user, [
            "run", "--allow-host", "example.invalid:1", "--ask", "--", "sh", "-c",
            f"curl -sS http://127.0.0.1:{good.port}/a; "
            f"curl -sS -o /dev/null -w 'code %{{http_code}}\\n' http://127.0.0.1:{bad.port}/b"],
            [b"y", b"n"])
        assert bad.requests == []
        assert [r["line"] for r in good.requests] == ["GET /a HTTP/1.1"]
    text = shown.decode()
    assert code == 0, text
    assert f"asks to reach 127.0.0.1:{good.port}, which is not on the allow-list" in text
    assert f"asks to reach 127.0.0.1:{bad.port}" in text
    assert "approved" in text and "code 403" in text
