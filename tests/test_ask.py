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
