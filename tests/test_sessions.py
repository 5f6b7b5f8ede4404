"""Sessions: one sandbox, several commands; what is left once it ends, checked from the host."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
from conftest import PYTHON
from sessiontools import UserRunner, sleepers, user_runner, wait_until

import nsbox
from nsbox.errors import SessionClosed


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def test_file_written_by_one_command_is_read_by_the_next(as_user: UserRunner):
    out = as_user.script("""
with nsbox.Session(timeout=20) as s:
    a = s.run(["sh", "-c", "echo first > made.txt; echo done"])
    s.write_file("src/main.py", "print(open('made.txt').read().strip() + ' then second')")
    b = s.run(["python3", "src/main.py"])
    emit(a=[a.status.value, a.stdout.decode()], b=[b.status.value, b.stdout.decode()],
         back=s.read_file("made.txt").decode(), uid=s.run(["id", "-u"]).stdout.decode())
""")
    assert out["a"] == ["OK", "done\n"]
    assert out["b"] == ["OK", "first then second\n"]
    assert out["back"] == "first\n"
    assert out["uid"] == "1000\n"


def test_timeout_ends_the_command_and_what_it_started_not_the_session(as_user: UserRunner):
    marker = f"9{uuid.uuid4().int % 10**8}"
    out = as_user.script(f"""
with nsbox.Session(timeout=20) as s:
    s.run(["sh", "-c", "echo kept > state"])
    slow = s.run(["sh", "-c", "(setsid sh -c 'sleep {marker}' &); trap '' TERM; sleep {marker}"],
                 timeout=1)
    left = find({marker!r})
    loud = s.run(["sh", "-c", "yes nsbox"], output_limit=1000)
    after = s.run(["cat", "state"])
    emit(slow=[slow.status.value, slow.timed_out], left=left, loud=loud.status.value,
         after=[after.status.value, after.stdout.decode()], alive=s.alive)
""")
    assert out["slow"] == ["TO", True]
    assert out["left"] == []  # the double-forked, setsid sleep died with its command
    assert out["loud"] == "OL"
    assert out["after"] == ["OK", "kept\n"]
    assert out["alive"] is True


def test_background_processes_end_with_their_command(as_user: UserRunner):
    marker = f"8{uuid.uuid4().int % 10**8}"
    out = as_user.script(f"""
with nsbox.Session(timeout=20) as s:
    r = s.run(["sh", "-c", "(setsid sleep {marker} &); echo started"])
    emit(out=r.stdout.decode(), left=find({marker!r}))
""")
    assert out == {"out": "started\n", "left": []}


def test_close_leaves_no_process_and_no_mount_namespace():
    marker = f"7{uuid.uuid4().int % 10**8}"
    session = nsbox.Session(timeout=60)
    init = session.pid
    errors: list[BaseException] = []

    def long_command() -> None:
        try:
            session.run(["sleep", marker])
        except BaseException as exc:  # noqa: B036 - the test checks what it was
            errors.append(exc)

    worker = threading.Thread(target=long_command)
    worker.start()
    assert wait_until(lambda: sleepers(marker)), "the command did not start"
    # Read through the command: the init is not dumpable, so its /proc/PID/ns is closed to
    # anyone but root.
    mnt_ns = os.readlink(f"/proc/{sleepers(marker)[0]}/ns/mnt")
    session.close()
    worker.join(10)
    assert sleepers(marker) == []
    assert not os.path.exists(f"/proc/{init}")
    assert _pids_in_mount_namespace(mnt_ns) == []
    assert len(errors) == 1 and isinstance(errors[0], SessionClosed)
    with pytest.raises(SessionClosed, match="the session is closed"):
        session.run(["true"])


def _pids_in_mount_namespace(ns: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == ns:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_sigkill_of_the_host_program_leaves_nothing(public_tree: Path):
    marker = f"6{uuid.uuid4().int % 10**8}"
    code = (
        f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox\n"
        "s = nsbox.Session(timeout=120)\n"
        "print(s.pid, flush=True)\n"
        f"s.run(['sleep', '{marker}'])\n"
    )
    host = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE)
    try:
        assert host.stdout is not None
        init = int(host.stdout.readline())
        assert wait_until(lambda: sleepers(marker)), "the command did not start"
        own = set(_cgroup_dirs(os.getpid()))
        cgroups = [d for d in _cgroup_dirs(init) if d not in own]  # none without a cgroup
        host.send_signal(signal.SIGKILL)
        host.wait()
        assert wait_until(lambda: not sleepers(marker) and not os.path.exists(
            f"/proc/{init}")), "the session outlived its host program"
        assert wait_until(lambda: not any(os.path.exists(d) for d in cgroups)), cgroups
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_idle_session_expires(as_user: UserRunner):
    out = as_user.script("""
import time
s = nsbox.Session(idle_timeout=0.5)
first = s.run(["true"]).status.value
time.sleep(1.5)
alive = s.alive
try:
    s.run(["true"])
    again = "ran"
except nsbox.errors.SessionClosed as exc:
    again = str(exc)
gone = not os.path.exists(f"/proc/{s.pid}")
s.close()
emit(first=first, alive=alive, again=again, gone=gone)
""")
    assert out["first"] == "OK"
    assert out["alive"] is False
    assert "has ended" in out["again"]
    assert out["gone"] is True


def test_init_is_out_of_reach_of_commands(as_user: UserRunner):
    # A command runs (as pid 2, under an init of its own) in a pid namespace nested in the
    # session's: the session's init has no pid there, so kill(2) and ptrace(2) cannot name it,
    # and the command's /proc is that namespace's, where it does not show at all. The
    # command's own init is non-dumpable: its environment, descriptors and memory are closed
    # to the same uid.
    probe = (
        "import os, errno\n"
        "def tryit(f):\n"
        "    try:\n"
        "        f(); return 'ok'\n"
        "    except OSError as e: return errno.errorcode[e.errno]\n"
        "nspid = [l.split()[1:] for l in open('/proc/self/status') if l.startswith('NSpid')][0]\n"
        "print(len(nspid), nspid[-1], open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0],\n"
        "      sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()],\n"
        "      tryit(lambda: open('/proc/1/environ', 'rb').read()),\n"
        "      tryit(lambda: os.listdir('/proc/1/fd')),\n"
        "      tryit(lambda: open('/proc/1/mem', 'rb').read(1)))\n"
    )
    out = as_user.script(f"""
with nsbox.Session(timeout=20) as s:
    r = s.run(["python3", "-c", {probe!r}])
    emit(probe=r.stdout.decode().split(), err=r.stderr.decode(), after=s.run(["true"]).status.value)
""")
    levels, own_pid, init_name, only_its_own, environ, fds, mem = out["probe"]
    # /proc is the command's pid namespace's, where it is 2 (the run's own init is 1), and
    # where it and its init are all there is
    assert (levels, own_pid, only_its_own) == ("1", "2", "True"), out["err"]
    # and its command line is a fixed title, with no host path of the interpreter or package
    assert init_name == "b'nsbox._helper'", init_name
    assert (environ, fds, mem) == ("EACCES", "EACCES", "EACCES")
    assert out["after"] == "OK"


def test_command_not_found_does_not_end_the_session(as_user: UserRunner):
    out = as_user.script("""
with nsbox.Session() as s:
    try:
        s.run(["no-such-program-here"])
        step = None
    except nsbox.CommandNotFound as exc:
        step = exc.step
    emit(step=step, after=s.run(["echo", "ok"]).stdout.decode())
""")
    assert out == {"step": "exec", "after": "ok\n"}


def test_input_is_mounted_read_only(as_user: UserRunner, unprivileged_tmp: Path):
    data = unprivileged_tmp / "data"
    data.mkdir()
    (data / "table.csv").write_text("a,b\n1,2\n")
    (data / "table.csv").chmod(0o666)  # even a host file anyone may write is out of reach
    single = unprivileged_tmp / "notes.txt"
    single.write_text("notes")
    single.chmod(0o666)
    probe = ("cat /input/data/table.csv /input/n.txt; echo x >> /input/data/table.csv; "
             "rm -f /input/data/table.csv; mv /input/data/table.csv /input/data/t; "
             "chmod 777 /input/data/table.csv; touch /input/data/new; echo y > /input/n.txt; "
             "echo done")
    out = as_user.script(f"""
with nsbox.Session(inputs=[{str(data)!r}, {str(single) + ':n.txt'!r}]) as s:
    r = s.run(["sh", "-c", {probe!r}])
    emit(out=r.stdout.decode(), err=r.stderr.decode())
""")
    assert out["out"] == "a,b\n1,2\nnotesdone\n"
    assert out["err"].count("Read-only file system") >= 5, out["err"]
    assert (data / "table.csv").read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in data.iterdir()) == ["table.csv"]
    assert single.read_text() == "notes"


def test_bad_input_spec_is_a_clear_error():
    with pytest.raises(nsbox.PolicyError, match="does not exist"):
        nsbox.Session(inputs=["/no/such/path"])
    with pytest.raises(nsbox.PolicyError, match="one path component"):
        nsbox.Session(inputs=["/usr:a/b"])


def test_command_in_session_is_isolated_like_run():
    with nsbox.Session() as s:
        caps = s.run(["cat", "/proc/self/status"])
        env = s.run(["env"])
    status = dict(line.split(":\t", 1) for line in caps.stdout.decode().splitlines()
                  if ":\t" in line)
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[field].strip() == "0000000000000000", field
    assert status["NoNewPrivs"].strip() == "1"
    names = {line.split("=", 1)[0] for line in env.stdout.decode().splitlines()}
    assert names <= {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}, names



def test_cancel_ends_the_running_command_not_the_session():
    marker = f"4{uuid.uuid4().int % 10**8}"
    with nsbox.Session(timeout=60) as s:
        results: list[nsbox.Result] = []
        worker = threading.Thread(target=lambda: results.append(s.run(["sleep", marker])))
        worker.start()
        assert wait_until(lambda: sleepers(marker)), "the command did not start"
        s.cancel()
        worker.join(10)
        assert sleepers(marker) == []
        (result,) = results
        assert (result.status, result.signal) == (nsbox.Status.SG, signal.SIGKILL)
        assert s.run(["echo", "still here"]).stdout == b"still here\n"


def test_init_holds_no_descriptor_of_the_helper_or_other_launches():
    if os.geteuid() != 0:
        pytest.skip("the init is not dumpable: only root may list its descriptors")
    with nsbox.Session() as first, nsbox.Session() as second:
        for session in (first, second):
            targets = [os.readlink(f"/proc/{session.pid}/fd/{fd}")
                       for fd in os.listdir(f"/proc/{session.pid}/fd")]
            sockets = [t for t in targets if t.startswith("socket:")]
            pipes = [t for t in targets if t.startswith("pipe:")]
            # 0-2 /dev/null; the control socket; the wake pipe (two ends); the event loop's
            # epoll descriptor. Nothing of the helper (its control socket, other launches).
            assert len(sockets) == 1, targets
            assert len(pipes) == 2 and pipes[0] == pipes[1], targets
            assert sorted(set(targets) - set(sockets) - set(pipes)) == [
                "/dev/null", "anon_inode:[eventpoll]"], targets
            assert len(targets) == 7, targets


def _cgroup_dirs(pid: int) -> list[str]:
    """The cgroup directories of ``pid`` on the host: one per v1 hierarchy, and v2's."""
    v2_root = ("/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified")
               else "/sys/fs/cgroup")
    dirs = []
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if not controllers:
                dirs.append(v2_root + path)
            else:
                hierarchy = controllers.split(",")[0].removeprefix("name=")
                dirs.append(f"/sys/fs/cgroup/{hierarchy}{path}")
    return dirs


def test_close_removes_the_sessions_cgroup():
    session = nsbox.Session()
    try:
        own = set(_cgroup_dirs(os.getpid()))
        cgroups = [d for d in _cgroup_dirs(session.pid) if d not in own]
        if not cgroups:
            pytest.skip("this launch got no cgroup of its own here (no writable cgroup)")
        assert all(os.path.isdir(d) for d in cgroups), cgroups
    finally:
        session.close()
    assert [d for d in cgroups if os.path.exists(d)] == []


def test_commands_report_the_same_weaker_guarantees_as_a_run(as_user: UserRunner):
    out = as_user.script("""
with nsbox.Session() as s:
    in_session = s.run(["true"]).degraded
emit(run=nsbox.run(["true"]).degraded, session=in_session)
""")
    assert out["session"] == out["run"]


def test_commands_get_the_same_rlimits_as_a_run(as_user: UserRunner):
    out = as_user.script("""
with nsbox.Session() as s:
    in_session = s.run(["cat", "/proc/self/limits"]).stdout.decode()
emit(run=nsbox.run(["cat", "/proc/self/limits"]).stdout.decode(), session=in_session)
""")
    assert out["session"] == out["run"]
    assert "Max core file size        0                    0" in out["session"]


def test_session_from_a_profile(tmp_path: Path):
    log = tmp_path / "audit.jsonl"
    with nsbox.Session(profile="shell", audit=str(log)) as s:
        assert s.policy.name == "shell"
        assert s.run(["sh", "-c", "echo hi"]).stdout == b"hi\n"
    assert '"profile": "shell"' in log.read_text()
    with pytest.raises(nsbox.PolicyError, match="not both"):
        nsbox.Session(nsbox.Policy(), profile="shell")


def test_host_kills_the_session_when_its_init_misses_a_deadline():
    # The init lives in the sandbox; should it ever fail to end a command at its deadline
    # (here: it is stopped), the host ends the whole session a few seconds later.
    marker = f"2{uuid.uuid4().int % 10**8}"
    session = nsbox.Session()
    try:
        results: list[nsbox.Result] = []
        worker = threading.Thread(
            target=lambda: results.append(session.run(["sleep", marker], timeout=0.5)))
        worker.start()
        assert wait_until(lambda: sleepers(marker)), "the command did not start"
        os.kill(session.pid, signal.SIGSTOP)
        worker.join(30)
        (result,) = results
        assert result.status is nsbox.Status.TO
        assert result.error is not None and "did not stop it" in result.error
        assert wait_until(lambda: not sleepers(marker) and not os.path.exists(
            f"/proc/{session.pid}"))
        with pytest.raises(SessionClosed, match="did not stop it"):
            session.run(["true"])
    finally:
        session.close()
