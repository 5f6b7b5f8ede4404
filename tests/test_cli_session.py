"""`nsbox session ...` and the session options of `nsbox run`, through the real command line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import PYTHON
from sessiontools import UserRunner, sleepers, user_runner, wait_until

from nsbox.session.supervisor import _ensure_private, runtime_dir


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


class Cli:
    def __init__(self, user: UserRunner, runtime: Path) -> None:
        self.user = user
        self.runtime = runtime

    def __call__(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(self.user.tree),
               "XDG_RUNTIME_DIR": str(self.runtime), "HOME": "/tmp"}
        return subprocess.run([*self.user.prefix(), PYTHON, "-m", "nsbox", *args],
                              capture_output=True, input=input, env=env, cwd=self.runtime,
                              timeout=60)

    def record(self, session_id: str) -> dict:
        return json.loads((self.runtime / "nsbox" / f"{session_id}.json").read_text())


@pytest.fixture
def cli(as_user: UserRunner, unprivileged_tmp: Path) -> Cli:
    runtime = unprivileged_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, as_user.uid, as_user.uid)
    return Cli(as_user, runtime)


def test_session_commands_end_to_end(cli: Cli, unprivileged_tmp: Path):
    start = cli("session", "start", "--time", "5", "--env", "TOKEN=abcd1234")
    assert start.returncode == 0, start.stderr
    sid = start.stdout.decode().strip()
    supervisor = cli.record(sid)["pid"]
    src = unprivileged_tmp / "main.py"
    src.write_text("import os\nprint('token', os.environ['TOKEN'])\nopen('out.txt','w').write('x')")
    src.chmod(0o644)
    assert cli("session", "cp", str(src), f"{sid}:main.py").returncode == 0
    ran = cli("session", "exec", sid, "--", "python3", "main.py")
    assert (ran.returncode, ran.stdout) == (0, b"token abcd1234\n")
    failed = cli("session", "exec", sid, "--", "sh", "-c", "cat; exit 3", input=b"fed\n")
    assert (failed.returncode, failed.stdout) == (3, b"fed\n")
    slow = cli("session", "exec", "--time", "1", sid, "--", "sleep", "30")
    assert slow.returncode == 124
    assert b"wall-clock limit reached" in slow.stderr
    killed = cli("session", "exec", sid, "--", "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 143
    assert b"nsbox: SG: the command was killed by SIGTERM (15)" in killed.stderr.splitlines()
    listed = cli("session", "ls", sid)
    assert [line.split()[-1] for line in listed.stdout.decode().splitlines()] == [
        '"main.py"', '"out.txt"']
    dest = cli.runtime / "copied.txt"
    assert cli("session", "cp", f"{sid}:out.txt", str(dest)).returncode == 0
    assert dest.read_text() == "x"
    assert sid in cli("session", "ls").stdout.decode()
    cli("session", "exec", sid, "--", "sh", "-c", "mkdir -p r/s; echo 1 > r/s/a.csv; ln -s / r/l")
    collected = cli("session", "collect", sid, "r/*", "--dest", "got")
    assert collected.returncode == 0, collected.stderr
    assert collected.stderr == b'nsbox: not collected: "r/l": a symlink (not followed)\n'
    assert (cli.runtime / "got/r/s/a.csv").read_text() == "1\n"
    assert sorted(p.name for p in (cli.runtime / "got").rglob("*")) == ["a.csv", "r", "s"]
    stopped = cli("session", "stop", sid)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until(lambda: not os.path.exists(f"/proc/{supervisor}"))
    assert cli("session", "ls").stdout == b""
    gone = cli("session", "exec", sid, "--", "true")
    assert gone.returncode == 125
    assert f"no session {sid}".encode() in gone.stderr


def test_killed_supervisor_leaves_nothing(cli: Cli):
    marker = f"5{uuid.uuid4().int % 10**8}"
    sid = cli("session", "start").stdout.decode().strip()
    supervisor = cli.record(sid)["pid"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cli.user.tree),
           "XDG_RUNTIME_DIR": str(cli.runtime)}
    client = subprocess.Popen([*cli.user.prefix(), PYTHON, "-m", "nsbox", "session",
                               "exec", sid, "--", "sleep", marker], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: sleepers(marker)), "the command did not start"
        os.kill(supervisor, signal.SIGKILL)
        assert wait_until(lambda: not sleepers(marker))
        client.wait(10)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert cli("session", "ls").stdout == b""  # which removes what the supervisor left
    assert list((cli.runtime / "nsbox").iterdir()) == []


def test_session_ls_keeps_an_older_supervisor_and_drops_a_stale_record(cli: Cli):
    # A supervisor is recognized by its command line, also one an older nsbox started as
    # `python -m nsbox._supervisor`; a record whose pid runs something else is stale.
    assert cli("session", "ls").returncode == 0  # makes the private directory
    directory = cli.runtime / "nsbox"
    old = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)", "-m",
                            "nsbox._supervisor"])
    other = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        for sid, pid in (("0123456789ab", old.pid), ("ba9876543210", other.pid)):
            record = {"id": sid, "pid": pid, "started": 0.0, "workspace": None}
            (directory / f"{sid}.json").write_text(json.dumps(record))
            (directory / f"{sid}.sock").write_text("")
            for name in (f"{sid}.json", f"{sid}.sock"):
                os.chown(directory / name, cli.user.uid, cli.user.uid)
        listed = cli("session", "ls")
        assert listed.returncode == 0, listed.stderr
        assert [line.split()[0] for line in listed.stdout.decode().splitlines()] == [
            "0123456789ab"]
        assert sorted(p.name for p in directory.iterdir()) == [
            "0123456789ab.json", "0123456789ab.sock"]
    finally:
        for proc in (old, other):
            proc.kill()
            proc.wait()


def test_run_with_input_collect_and_audit(cli: Cli, unprivileged_tmp: Path):
    data = unprivileged_tmp / "data.csv"
    data.write_text("1\n2\n3\n")
    data.chmod(0o644)
    collect_dir = cli.runtime / "results"
    audit = cli.runtime / "audit.jsonl"
    script = ("wc -l < /input/rows.csv > count.txt; ln -s /input/rows.csv link.txt; "
              "echo changed > /input/rows.csv; echo secret=$KEY")
    done = cli("run", "--input", f"{data}:rows.csv", "--collect", "*.txt", "--collect-dir",
               str(collect_dir), "--audit", str(audit), "--env", "KEY=s3cr3t-value", "--",
               "sh", "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"secret=s3cr3t-value\n"
    assert b"Read-only file system" in done.stderr
    assert b'not collected: "link.txt": a symlink (not followed)' in done.stderr
    assert data.read_text() == "1\n2\n3\n"
    assert sorted(p.name for p in collect_dir.iterdir()) == ["count.txt"]
    assert (collect_dir / "count.txt").read_text() == "3\n"
    (record,) = [json.loads(line) for line in audit.read_text().splitlines()]
    assert record["output"]["stdout"]["head"] == "secret=<redacted>\n"
    assert [f["path"] for f in record["files_produced"]] == ["count.txt"]
    assert "s3cr3t-value" not in audit.read_text()


def test_other_users_cannot_reach_a_session(public_tree: Path, unprivileged_tmp: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root to act as two users")
    runtime = unprivileged_tmp / "root-runtime"
    runtime.mkdir(mode=0o700)
    cli = Cli(UserRunner("caller", public_tree), runtime)
    sid = cli("session", "start").stdout.decode().strip()
    try:
        sock = runtime / "nsbox" / f"{sid}.sock"
        probe = ("import socket, errno\ns = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
                 f"try:\n  s.connect({str(sock)!r}); print('connected')\n"
                 "except OSError as e: print(errno.errorcode[e.errno])\n")
        other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                "--", "/usr/bin/python3", "-I", "-c", probe],
                               capture_output=True, timeout=30)
        assert other.stdout == b"EACCES\n", other.stderr
    finally:
        cli("session", "stop", sid)


def test_runtime_directory_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    private = tmp_path / "xdg"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(private))
    made = Path(runtime_dir())
    assert made == private / "nsbox"
    assert made.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    link = tmp_path / "link"
    link.symlink_to(private)
    for path in (open_dir, link):
        with pytest.raises(Exception, match="is not a private directory of this user"):
            _ensure_private(str(path), os.getuid())
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(Exception, match="owned by uid 0 with mode 0700"):
            _ensure_private(str(foreign), 0)


def test_idle_session_ends_and_leaves_nothing(cli: Cli):
    sid = cli("session", "start", "--idle-timeout", "1").stdout.decode().strip()
    supervisor = cli.record(sid)["pid"]
    assert wait_until(lambda: not os.path.exists(f"/proc/{supervisor}"), timeout=15)
    assert list((cli.runtime / "nsbox").iterdir()) == []
    assert cli("session", "ls").stdout == b""


def test_interrupted_exec_cancels_its_command(cli: Cli):
    marker = f"3{uuid.uuid4().int % 10**8}"
    sid = cli("session", "start", "--time", "120").stdout.decode().strip()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cli.user.tree),
           "XDG_RUNTIME_DIR": str(cli.runtime)}
    client = subprocess.Popen([*cli.user.prefix(), PYTHON, "-m", "nsbox", "session",
                               "exec", sid, "--", "sleep", marker], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: sleepers(marker)), "the command did not start"
        client.kill()
        client.wait()
        assert wait_until(lambda: not sleepers(marker))
        assert cli("session", "exec", sid, "--", "echo", "ok").stdout == b"ok\n"
    finally:
        cli("session", "stop", sid)


def test_session_exec_options_stop_at_the_id(cli: Cli):
    sid = cli("session", "start", "--time", "30").stdout.decode().strip()
    try:
        plain = cli("session", "exec", "--time", "10", sid, "python3", "-c", "print(1)")
        assert (plain.returncode, plain.stdout) == (0, b"1\n"), plain.stderr
        # The separator after ID is still accepted; after the command's name it is the command's.
        dashed = cli("session", "exec", sid, "--", "echo", "-t", "--", "--json")
        assert (dashed.returncode, dashed.stdout) == (0, b"-t -- --json\n"), dashed.stderr
        missing = cli("session", "exec", sid, "--")
        assert missing.returncode == 2
        assert b"Missing argument 'COMMAND...'" in missing.stderr
    finally:
        cli("session", "stop", sid)


def test_without_a_runtime_directory_the_home_is_used_before_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Without $XDG_RUNTIME_DIR or /run/user/UID (root here), /tmp/nsbox-UID is a name any
    local user could make first, and every session command would then refuse: a private home
    comes before it. A home others may write in does not."""
    import nsbox.session.supervisor as supervisor

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(supervisor, "RUN_USER", str(tmp_path / "no-run-user"))
    home = Path(tempfile.mkdtemp(prefix="nsbox-home-", dir="/tmp"))  # short: a socket's path
    try:
        os.chmod(home, 0o755)
        monkeypatch.setenv("HOME", str(home))
        made = Path(runtime_dir())
        assert made == home / ".local" / "state" / "nsbox"
        assert made.stat().st_mode & 0o777 == 0o700
        os.chmod(home, 0o777)
        assert runtime_dir() == f"/tmp/nsbox-{os.getuid()}"
    finally:
        shutil.rmtree(home)
