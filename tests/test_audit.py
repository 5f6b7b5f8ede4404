"""The audit record: one JSON line per command, with what ran, under what, and what came of it."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from pathlib import Path

import pytest
from sessiontools import UserRunner, user_runner

import nsbox
from nsbox.policy.policy import Policy

FIELDS = {"time", "session", "argv", "env", "stdin", "files_written", "profile", "policy_digest",
          "limits", "network_mode", "result", "output", "network", "seccomp_denied",
          "files_produced"}


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_session_audit_has_one_line_per_command(as_user: UserRunner, unprivileged_tmp: Path):
    secret = "tok-" + uuid.uuid4().hex
    log = unprivileged_tmp / "audit.jsonl"
    code = "import os, sys\nprint(sys.stdin.read().upper())\nopen('result.txt','w').write('42')\n"
    out = as_user.script(f"""
with nsbox.Session(audit={str(log)!r}, env={{"API_TOKEN": {secret!r}}}, timeout=20) as s:
    s.write_file("main.py", {code!r})
    first = s.run(["python3", "main.py"], stdin=b"hello")
    second = s.run(["sh", "-c", "echo token=$API_TOKEN; echo oops >&2; exit 3"])
    try:
        s.run(["no-such-program"])
        missing = "ran"
    except nsbox.CommandNotFound:
        missing = "CommandNotFound"
    emit(session=s.id, digest=s.policy.digest(), missing=missing)
""")
    assert out["missing"] == "CommandNotFound"
    records = lines(log)
    assert len(records) == 3
    assert secret not in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    first, second, third = records
    for record in records:
        assert set(record) >= FIELDS - {"result", "output", "network", "seccomp_denied"}
        assert record["session"] == out["session"]
        assert record["policy_digest"] == out["digest"]
        assert record["profile"] == "default"
        assert record["env"] == {"API_TOKEN": "<redacted>"}
        assert record["limits"]["timeout"] == 20
    assert set(first) == FIELDS
    assert first["argv"] == ["python3", "main.py"]
    assert first["stdin"] == {"size": 5, "sha256": hashlib.sha256(b"hello").hexdigest(),
                              "head": "hello"}
    assert first["files_written"] == [{
        "path": "main.py", "size": len(code), "sha256": hashlib.sha256(code.encode()).hexdigest(),
        "head": code}]
    assert first["result"]["status"] == "OK"
    assert first["output"]["stdout"] == {"size": 6, "truncated": False, "head": "HELLO\n"}
    assert first["files_produced"] == [{"path": "result.txt", "size": 2,
                                        "sha256": hashlib.sha256(b"42").hexdigest()}]
    assert second["files_written"] == []
    assert second["files_produced"] == []  # nothing new or changed
    assert second["result"]["status"] == "RE" and second["result"]["exit_code"] == 3
    assert second["output"]["stdout"]["head"] == "token=<redacted>\n"
    assert second["output"]["stderr"]["head"] == "oops\n"
    assert third["error"]["type"] == "CommandNotFound"
    assert third["error"]["step"] == "exec"
    assert "result" not in third


def test_run_with_audit_records_the_run(tmp_path: Path):
    log = tmp_path / "audit.jsonl"
    result = nsbox.run(["sh", "-c", "echo made > out.txt; echo hi"], audit=str(log),
                       env={"PASSWORD": "hunter22"}, timeout=10)
    assert result.stdout == b"hi\n"
    (record,) = lines(log)
    assert set(record) == FIELDS
    assert record["argv"] == ["sh", "-c", "echo made > out.txt; echo hi"]
    assert record["env"] == {"PASSWORD": "<redacted>"}
    assert record["files_produced"] == [
        {"path": "out.txt", "size": 5, "sha256": hashlib.sha256(b"made\n").hexdigest()}]
    assert record["policy_digest"] == Policy().digest()
    assert "hunter22" not in log.read_text()


def test_audit_file_that_is_a_symlink_is_refused(tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "audit.jsonl").symlink_to(target)
    with pytest.raises(nsbox.NsboxError, match="cannot open the audit file"):
        nsbox.Session(audit=str(tmp_path / "audit.jsonl"))
    assert target.read_text() == ""
    assert not os.path.islink(target)


def test_network_attempts_are_recorded_per_command(tmp_path: Path):
    from netservers import HTTPServer

    log = tmp_path / "audit.jsonl"
    fetch = ("import urllib.request, sys\n"
             "try:\n"
             "    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(), end='')\n"
             "except Exception as exc: print(type(exc).__name__)\n")
    with HTTPServer() as listed, HTTPServer() as other:
        policy = Policy().replace(network=nsbox.Network(
            mode="allow", allow=(f"127.0.0.1:{listed.port}",)))
        with nsbox.Session(policy, audit=str(log), timeout=20) as s:
            s.write_file("fetch.py", fetch)
            first = s.run(["python3", "fetch.py", f"http://127.0.0.1:{listed.port}/a"])
            second = s.run(["python3", "fetch.py", f"http://127.0.0.1:{other.port}/b"])
    assert first.stdout == b"hello from the host\n"
    assert second.stdout == b"HTTPError\n"
    assert other.requests == []
    (allowed,) = first.extra["network"]["attempts"]
    (denied,) = second.extra["network"]["attempts"]
    assert (allowed["allowed"], allowed["port"]) == (True, listed.port)
    assert (denied["allowed"], denied["port"]) == (False, other.port)
    records = lines(log)
    assert [r["network"]["attempts"] for r in records] == [[allowed], [denied]]
    assert [r["network_mode"] for r in records] == ["allow", "allow"]


def test_run_in_seccomp_learning_mode_records_the_denied_syscalls(tmp_path: Path):
    log = tmp_path / "audit.jsonl"
    policy = Policy().replace(seccomp=nsbox.Seccomp(log_denied=True))
    result = nsbox.run(["sh", "-c", "unshare --user true || echo refused"], policy,
                       audit=str(log))
    assert result.stdout == b"refused\n"
    assert "unshare" in result.extra["seccomp_denied"]
    (record,) = lines(log)
    assert record["seccomp_denied"] == result.extra["seccomp_denied"]
    assert record["files_produced"] is None
    assert record["session"] is None


MANY_FILES = r"""
import os
for i in range(1000):
    name = f"{i:04d}-" + "\x01" * 200
    open(name, "w").write(str(i))
"""


def test_the_record_stays_small_whatever_the_sandbox_makes(tmp_path: Path):
    """A sandbox chooses how many files it makes and how long their names are: 1000 names of
    control characters (each 6 bytes as JSON) made a line of 15 MB per command. The record
    lists the first 100, paths cut, with how many more and a digest of the whole list."""
    log = tmp_path / "audit.jsonl"
    result = nsbox.run(["python3", "-c", MANY_FILES], audit=str(log), timeout=30)
    assert result.status == nsbox.Status.OK, result.stderr
    (record,) = lines(log)
    produced = record["files_produced"]
    assert len(produced) == 100 and record["files_produced_more"] == 900
    assert all(len(entry["path"]) <= 512 for entry in produced)
    assert produced[0]["path"] == "0000-" + "\x01" * 200
    assert len(record["files_produced_digest"]) == 64
    assert log.stat().st_size < 200_000


def test_a_long_path_is_cut_and_the_list_keeps_its_digest():
    from nsbox.host import audit

    files = [{"path": "d/" * 400 + "f", "size": 1, "sha256": "0" * 64}]
    out = audit.produced_files(files)
    assert out["files_produced"] == [{"path": ("d/" * 400)[:512], "size": 1,
                                      "sha256": "0" * 64, "path_truncated": True}]
    assert out["files_produced_more"] == 0
    whole = json.dumps(files, sort_keys=True).encode()
    assert out["files_produced_digest"] == hashlib.sha256(whole).hexdigest()
    assert audit.produced_files(files[:0]) == {"files_produced": []}
