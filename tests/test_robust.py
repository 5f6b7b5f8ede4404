"""One bad call never harms another: the launch helper isolates failures, every input gets a
clear error at the door, descriptors do not leak, and the wall clock has a second guard.

The scripts run as this process's user and as the unprivileged uid (sessiontools.UserRunner);
what they report is checked here.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from sessiontools import UserRunner, sleepers, user_runner

import nsbox
from nsbox.errors import PolicyError
from nsbox.launch import launcher
from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, File, Limits, Policy, Tmpfs
from nsbox.result import Status


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


# Every bad call of the hostile pass that reached the helper or the host's pipes. Each must end
# in a Result or a documented nsbox error; "raw" collects anything else.
BAD_CALLS = """
from nsbox import Policy, File
from nsbox.launch import launcher
from nsbox.policy.policy import DEFAULT_MOUNTS

def bad_calls():
    big_file = Policy(mounts=DEFAULT_MOUNTS + (File("/big", "x" * 300_000),))
    return [
        lambda: nsbox.run(["true"], env={f"V{i}": "x" * 100_000 for i in range(3)}),
        lambda: nsbox.run(["true"] + ["a"] * 100_000),
        lambda: nsbox.run(["true"], big_file),
        lambda: nsbox.run(["true"], env={f"V{i}": "1" for i in range(10_000)}),
        lambda: nsbox.run(["true"], timeout=2_200_000),
        lambda: nsbox.run(["true"], Policy().with_limits(wall_time=2_592_000.0, cpu_time=None)),
        lambda: nsbox.run(["true"], timeout="5"),
        lambda: nsbox.run(["true"], timeout=[1]),
        lambda: nsbox.run(["true"], timeout=float("nan")),
        lambda: nsbox.run(["true"], stdin=9999),
        lambda: nsbox.run(["true"], stdin=-1),
        lambda: nsbox.run(["cat"], stdin=1.5),
        lambda: nsbox.run(None),
        lambda: nsbox.run([b"true"]),
        lambda: nsbox.run(["true"], env={b"A": "b"}),
        lambda: nsbox.run(["true"], {"limits": {}}),
        lambda: nsbox.run(["true"], Policy(mounts=None)),
        lambda: nsbox.run("echo hi"),
        lambda: nsbox.run(["true"], output_limit=-1),
        lambda: nsbox.run(["/nonexistent"]),
        # Malformed plans sent to the helper as they are: its checks, not the door's.
        lambda: launcher.launch_wire(wire(wall_time=[5]), None, 1024, False),
        lambda: launcher.launch_wire(wire(mounts=None), None, 1024, False),
        lambda: launcher.launch_wire(wire(cgroup=None), None, 1024, False),
        lambda: launcher.launch_wire(wire(rlimits="x"), None, 1024, False),
    ]

def wire(**changes):
    from nsbox.plan import plan as planmod
    policy = Policy()
    w = planmod.build(policy, ["true"]).to_wire()
    w.update(host_uid=policy.host_uid, host_gid=policy.host_gid, **changes)
    return w

def attempt(call):
    try:
        call()
        return "result"
    except nsbox.NsboxError as exc:
        return type(exc).__name__
    except Exception as exc:
        return "raw " + repr(exc)[:300]
"""


def test_bad_calls_never_harm_concurrent_good_runs(as_user: UserRunner):
    out = as_user.script(BAD_CALLS + """
import threading
nsbox.run(["true"])
from nsbox.host import engine  # one-shot runs take the launch engine; bad plans the helper
helper = (launcher.helper_client.pid, engine.client.pid)
good, failed, outcomes = [], [], []

def good_runs():
    for _ in range(4):
        try:
            r = nsbox.run(["sh", "-c", "echo ok"])
            good.append((r.status.value, r.stdout.decode()))
        except Exception as exc:
            failed.append(repr(exc)[:300])

def bad_runs():
    outcomes.extend(attempt(call) for call in bad_calls())

threads = [threading.Thread(target=good_runs) for _ in range(16)]
threads.append(threading.Thread(target=bad_runs))
for t in threads:
    t.start()
for t in threads:
    t.join()
emit(good=sorted(set(map(tuple, good))), count=len(good), failed=failed, outcomes=outcomes,
     same_helper=engine.client.pid == helper[1] and helper[0] in (0, launcher.helper_client.pid))
""")
    assert out["failed"] == []
    assert out["count"] == 64 and out["good"] == [["OK", "ok\n"]]
    assert out["same_helper"] is True
    outcomes = out["outcomes"]
    assert [o for o in outcomes if o.startswith("raw")] == []
    # The big plans run (over the socket's 208 KB, they travel in a memfd).
    assert outcomes[:6] == ["result"] * 6
    assert outcomes[6:19] == ["PolicyError"] * 13
    assert outcomes[19] == "CommandNotFound"
    assert outcomes[20:] == ["SetupError"] * 4


def test_plans_of_any_size_arrive_whole():
    env = {f"V{i}": str(i) * 100_000 for i in range(3)}
    big_file = Policy(mounts=DEFAULT_MOUNTS + (File("/big", "x" * 300_000),))
    r = nsbox.run(["sh", "-c", 'echo ${#V0} ${#V2}; wc -c < /big; echo "$#"'],
                  big_file, env=env)
    assert r.status is Status.OK, r
    assert r.stdout.split() == [b"100000", b"100000", b"300000", b"0"]
    r = nsbox.run(["sh", "-c", 'echo "$#"', "sh", *["a"] * 100_000])
    assert r.stdout == b"100000\n"


@pytest.mark.parametrize(("kwargs", "key", "message", "hint"), [
    ({"argv": "echo hi"}, "argv", "not one string", "did you mean ['echo', 'hi']?"),
    ({"argv": None}, "argv", "expected a list of str, got NoneType", None),
    ({"argv": [b"echo"]}, "argv[0]", "expected a string, got bytes", None),
    ({"argv": []}, "argv", "no command given", None),
    ({"timeout": "5"}, "timeout", "expected a number of seconds, got str '5'", None),
    ({"timeout": [1]}, "timeout", "got list [1]", None),
    ({"timeout": float("nan")}, "timeout", "got NaN", None),
    ({"timeout": float("inf")}, "timeout", "out of range", None),
    ({"timeout": 0}, "timeout", "out of range (more than 0", None),
    ({"stdin": 9999}, "stdin", "descriptor 9999 is not open", None),
    ({"stdin": -1}, "stdin", "-1 is not a descriptor", None),
    ({"stdin": 1.5}, "stdin", "expected bytes, str, a descriptor", None),
    ({"stdin": 2**40}, "stdin", "1099511627776 is not a descriptor", None),
    ({"output_limit": -1}, "output_limit", "-1 is out of range", None),
    ({"env": {b"A": "b"}}, "env name", "got bytes", None),
    ({"env": {"A": 1}}, "env['A']", "got int 1", None),
    ({"env": {"A=B": "c"}}, "env", "contains '='", None),
    ({"env": ["A=b"]}, "env", "expected a dict", None),
    ({"cwd": 5}, "cwd", "expected a string", None),
    ({"passthrough": "yes"}, "passthrough", "expected True or False", None),
    ({"policy": {"limits": {}}}, "policy", "expected a nsbox.Policy, got dict",
     "nsbox.Policy(...)"),
])
def test_wrong_inputs_get_an_error_naming_the_parameter(kwargs: dict[str, Any], key: str,
                                                        message: str, hint: str | None):
    kwargs = dict(kwargs)
    argv = kwargs.pop("argv", ["true"])
    policy = kwargs.pop("policy", None)
    with pytest.raises(PolicyError) as info:
        nsbox.run(argv, policy, **kwargs)
    assert info.value.key == key
    assert message in info.value.message
    if hint is not None:
        assert hint in (info.value.hint or "")


@pytest.mark.parametrize(("make", "key", "message", "hint"), [
    (lambda: Limits(memory=10), "limits.memory", "too little memory", "did you mean 10M?"),
    (lambda: Limits(tmp_size=2**64), "limits.tmp_size", "out of range", None),
    (lambda: Limits(memory=16777216 * 2**40), "limits.memory", "out of range", None),
    (lambda: Limits(wall_time=float("nan")), "limits.wall_time", "NaN", None),
    (lambda: Limits(output=-1), "limits.output", "out of range", None),
    (lambda: Limits(cpus=float("inf")), "limits.cpus", "out of range", None),
    (lambda: Tmpfs("/scratch", size=0), "tmpfs '/scratch' size", "without a size limit",
     "give its size"),
    (lambda: Policy(mounts=None), "mounts", "expected a tuple of mounts", None),
    (lambda: Policy(limits={}), "limits", "expected a nsbox.Limits", None),
    (lambda: Policy(env=(("A", 1),)), "env['A']", "got int", None),
    (lambda: nsbox.Pool(size=0), "size", "out of range", None),
    (lambda: nsbox.Pool(size="2"), "size", "expected a number of sandboxes", None),
    (lambda: nsbox.Session(timeout=float("inf")), "timeout", "out of range", None),
    (lambda: nsbox.Session(idle_timeout=1e10), "idle_timeout", "out of range", None),
    (lambda: nsbox.Session(timeout=float("nan")), "timeout", "NaN", None),
])
def test_wrong_policy_values_get_an_error_naming_the_field(make: Any, key: str, message: str,
                                                           hint: str | None):
    with pytest.raises(PolicyError) as info:
        make()
    assert info.value.key == key
    assert message in info.value.message
    if hint is not None:
        assert hint in (info.value.hint or "")


def test_error_messages_quote_at_most_200_characters_of_a_value():
    with pytest.raises(PolicyError) as info:
        nsbox.run(["true"], timeout="x" * 1_000_000)
    assert len(str(info.value)) < 400
    assert "(1000002 characters)" in str(info.value)


def test_descriptors_and_memory_stay_the_same_after_1000_failing_calls():
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def failing_calls(n: int) -> None:
        for i in range(n):
            with pytest.raises(nsbox.NsboxError):
                if i % 10 == 0:  # a real launch that fails inside the sandbox
                    nsbox.run(["/nonexistent"])
                elif i % 10 == 1:
                    nsbox.run(["cat"], stdin=1.5)
                elif i % 10 == 2:
                    nsbox.run(["cat"], stdin=9999)
                elif i % 10 == 3:
                    launcher.launch_wire({"plan": "not a plan"}, b"text", 1024, False)
                else:
                    nsbox.run("echo hi", timeout=float("nan"))

    failing_calls(100)  # the helper started, caches warm
    helper = launcher.helper_client.pid
    fds, helper_fds, memory = (len(os.listdir("/proc/self/fd")),
                               len(os.listdir(f"/proc/{helper}/fd")), rss())
    failing_calls(1000)
    assert launcher.helper_client.pid == helper
    assert len(os.listdir("/proc/self/fd")) == fds
    # The helper's count moves by the spare spawners it keeps (cgroup v1): one socket each.
    assert len(os.listdir(f"/proc/{helper}/fd")) <= helper_fds + 2
    assert rss() - memory < 4 * 1024 * 1024
    assert nsbox.run(["cat"], stdin="text").stdout == b"text"


def test_overload_under_a_descriptor_limit_of_64_gives_clean_errors(as_user: UserRunner):
    out = as_user.script("""
import resource, threading, traceback
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
outcomes = []
def burst():
    try:
        r = nsbox.run(["sh", "-c", "sleep 0.3; echo ok"], stdin=b"x" * 10)
        outcomes.append(r.status.value)
    except nsbox.NsboxError as exc:
        outcomes.append(type(exc).__name__ + ": " + str(exc).splitlines()[0][:120])
    except Exception:
        outcomes.append("raw " + traceback.format_exc()[-800:])
threads = [threading.Thread(target=burst) for _ in range(40)]
for t in threads:
    t.start()
for t in threads:
    t.join()
after = [nsbox.run(["echo", "again"]).stdout.decode() for _ in range(3)]
emit(outcomes=outcomes, after=after, fds=len(os.listdir("/proc/self/fd")))
""")
    outcomes = out["outcomes"]
    assert [o for o in outcomes if o.startswith("raw")] == []
    assert "OK" in outcomes
    errors = [o for o in outcomes if o != "OK"]
    assert errors, "40 runs at once under 64 descriptors should have overloaded"
    # Each says why: this process or the helper ran out (a request the helper could not
    # receive whole is dropped, and the run says so).
    unclear = [o for o in errors
               if "Too many open files" not in o and "out of descriptors" not in o]
    assert unclear == []
    assert out["after"] == ["again\n"] * 3
    assert out["fds"] < 16


def test_a_first_run_with_no_descriptor_left_is_a_clean_error(as_user: UserRunner):
    # The first run reads this process's ids and cgroups; with no descriptor left, each read's
    # OSError must come out as the run's error with the hint, and the next run, with room, works.
    out = as_user.script("""
import errno, resource
# What a run imports: no room for it later.
import nsbox.api, nsbox.launch.launcher, nsbox.host.engine
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
while True:
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
        break
try:
    nsbox.run(["true"])
    outcome = "ran"
except nsbox.NsboxError as exc:
    outcome = "error: " + str(exc)
except Exception as exc:
    outcome = "raw " + type(exc).__name__ + ": " + str(exc)
for fd in held:
    os.close(fd)
emit(outcome=outcome, after=nsbox.run(["echo", "again"]).stdout.decode())
""")
    assert out["outcome"].startswith("error: ")
    assert "Too many open files" in out["outcome"] and "ulimit -n" in out["outcome"]
    assert out["after"] == "again\n"


def test_a_stopped_helper_does_not_stretch_the_wall_clock(as_user: UserRunner):
    marker = f"9{uuid.uuid4().int % 10**8}"
    out = as_user.script(f"""
import signal, threading, time
results = []
nsbox.run(["true"])
from nsbox.host import engine  # the launch process: the engine's where it runs the launch
helper = nsbox.launch.launcher.helper_client.pid or engine.client.pid
assert helper > 0
started = time.monotonic()
t = threading.Thread(target=lambda: results.append(nsbox.run(["sleep", "{marker}"], timeout=2)))
t.start()
pid = None
while pid is None and time.monotonic() - started < 10:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{{entry}}/cmdline", "rb") as f:
                    if f.read() == b"sleep\\0{marker}\\0":
                        pid = int(entry)
            except OSError:
                pass
os.kill(helper, signal.SIGSTOP)
try:
    while time.monotonic() - started < 10:
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            break
        time.sleep(0.02)
    ended = time.monotonic() - started
finally:
    os.kill(helper, signal.SIGCONT)
t.join(20)
r = results[0]
emit(ended=ended, status=r.status.value, timed_out=r.timed_out)
""")
    assert out["ended"] < 2.5, out
    assert out["status"] == "TO" and out["timed_out"] is True
    assert sleepers(marker) == []


def test_a_session_survives_bad_per_command_values(as_user: UserRunner):
    out = as_user.script("""
outcomes = []
with nsbox.Session(timeout=3_000_000) as s:
    s.write_file("keep.txt", "kept")
    for kwargs in ({"timeout": 2_200_000}, {"timeout": float("nan")}, {"timeout": "5"},
                   {"stdin": -1}, {"env": {"A": None}}, {"output_limit": -1},
                   {"env": {f"V{i}": "x" * 100_000 for i in range(3)}}):
        try:
            outcomes.append(s.run(["true"], **kwargs).status.value)
        except nsbox.NsboxError as exc:
            outcomes.append(type(exc).__name__)
    try:
        s.read_file("keep.txt", max_size=2)
    except nsbox.errors.FileTransferError as exc:
        too_large = exc.reason
    emit(outcomes=outcomes, kept=s.read_file("keep.txt").decode(), too_large=too_large)
""")
    assert out["outcomes"] == ["OK", "PolicyError", "PolicyError", "PolicyError",
                               "PolicyError", "PolicyError", "OK"]
    assert out["kept"] == "kept"
    assert out["too_large"] == "too large: 4 bytes, the limit is 2"


def test_a_pool_takes_a_long_timeout():
    with nsbox.Pool(size=1) as pool:
        r = pool.run(["echo", "pooled"], timeout=3e6)
    assert (r.status, r.stdout) == (Status.OK, b"pooled\n")


def test_the_helper_survives_a_failing_launch_and_reports_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NSBOX_ENGINE", "0")  # the helper's; tests/test_engine.py: the engine's
    nsbox.run(["true"])
    helper = launcher.helper_client.pid
    policy = Policy()
    from nsbox.plan import plan as planmod

    wire = planmod.build(policy, ["true"]).to_wire()
    wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid, cgroup=None)
    with pytest.raises(nsbox.SetupError) as info:
        launcher.launch_wire(wire, None, 1024, False)
    assert info.value.step == "helper"
    assert "could not carry out this launch" in info.value.message
    assert nsbox.run(["echo", "fine"]).stdout == b"fine\n"
    assert launcher.helper_client.pid == helper


def test_a_launch_that_fails_after_pinning_its_binds_lets_go_of_them(unprivileged_tmp: Path):
    """A writable bind's directory is pinned (an O_PATH descriptor) early in the launch; a
    launch that fails later in the helper must not leave it held by the helper."""
    out = unprivileged_tmp / "out"
    out.mkdir()
    if os.geteuid() == 0:
        os.chown(out, 1234, 1234)  # an owner the sandbox may be idmapped to as root
    nsbox.run(["true"])
    helper = launcher.helper_client.pid
    policy = Policy(mounts=DEFAULT_MOUNTS + (Bind(str(out), "/out", writable=True),))
    from nsbox.plan import plan as planmod

    wire = planmod.build(policy, ["true"]).to_wire()
    wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid)
    del wire["net"]  # the launch breaks after its sources are open (its side channels)
    with pytest.raises(nsbox.SetupError) as info:
        launcher.launch_wire(wire, None, 1024, False)
    assert info.value.step == "helper"
    assert info.value.message.endswith("KeyError: 'net'"), info.value.message
    assert str(out) not in open_files(helper)
    assert launcher.helper_client.pid == helper


def open_files(pid: int) -> list[str]:
    """What ``pid``'s descriptors point to; one closed while this reads is left out."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return found


@pytest.mark.parametrize(("signame", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_to_nsbox_run_ends_the_sandbox_and_reaps_the_helper(as_user: UserRunner,
                                                                       signame: str, code: int):
    marker = f"6{uuid.uuid4().int % 10**8}"
    # This script is a child subreaper (prctl(2)): a helper the command line left unreaped
    # would become its zombie child here, where it can be seen.
    out = as_user.script(f"""
import ctypes, signal, subprocess, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
cli = subprocess.Popen([sys.executable, "-m", "nsbox", "run", "--", "sleep", "{marker}"],
                       env={{"PYTHONPATH": {str(as_user.tree)!r}, "PATH": "/usr/bin:/bin"}},
                       stderr=subprocess.PIPE)
def sandboxed():
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{{entry}}/cmdline", "rb") as f:
                if f.read() == b"sleep\\x00{marker}\\x00":
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found
deadline = time.monotonic() + 20
while not sandboxed() and time.monotonic() < deadline:
    time.sleep(0.05)
started = bool(sandboxed())
cli.send_signal(signal.{signame})
stderr = cli.communicate(timeout=20)[1].decode()
time.sleep(0.2)
zombies = []
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            with open(f"/proc/{{entry}}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] == "Z":
            zombies.append(int(entry))
for pid in zombies:
    os.waitpid(pid, 0)
emit(started=started, code=cli.returncode, stderr=stderr, zombies=zombies,
     left=sandboxed())
""")
    assert out["started"] is True
    assert out["code"] == code
    assert out["stderr"] == f"nsbox: stopped by {signame}: the sandbox was killed\n"
    assert out["zombies"] == []
    assert out["left"] == []


def test_each_nsbox_run_reaps_its_helper(as_user: UserRunner):
    out = as_user.script(f"""
import ctypes, subprocess, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
codes = [subprocess.run([sys.executable, "-m", "nsbox", "run", "--", "true"],
                        env={{"PYTHONPATH": {str(as_user.tree)!r}, "PATH": "/usr/bin:/bin"}}
                        ).returncode for _ in range(3)]
time.sleep(0.2)
try:
    reaped = os.waitpid(-1, os.WNOHANG)
except ChildProcessError:
    reaped = None
emit(codes=codes, reaped=reaped)
""")
    assert out["codes"] == [0, 0, 0]
    assert out["reaped"] is None  # no child left to reap: each command line waited for its own


def test_profiles_that_are_not_regular_small_files_are_refused(tmp_path: Path):
    fifo = tmp_path / "profile.toml"
    os.mkfifo(fifo)
    extends = tmp_path / "child.toml"
    extends.write_text(f'extends = "{fifo}"\n')
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1024 * 1024) + "\n")
    deep = tmp_path / "deep.toml"
    deep.write_text("description = " + "[" * 5000 + "]" * 5000 + "\n")
    nested = tmp_path / "nested.toml"
    nested.write_text("description = " + "[" * 40 + "]" * 40 + "\n")
    from nsbox.profiles import load_profile

    for path, message in [(fifo, "must be a regular file"), (extends, "must be a regular file"),
                          ("/dev/zero", "must be a regular file"), (big, "too large"),
                          (deep, "nested more than 32 levels"),
                          (nested, "nested more than 32 levels")]:
        with pytest.raises(PolicyError, match=message):
            load_profile(str(path))


def test_an_audit_file_that_is_a_device_is_refused_before_the_run(tmp_path: Path):
    marker = tmp_path / "ran"
    with pytest.raises(nsbox.NsboxError, match="/dev/full is not a regular file"):
        nsbox.run(["sh", "-c", f"touch {marker}"], audit="/dev/full")
    assert not marker.exists()


def test_a_missing_working_directory_is_named():
    with pytest.raises(nsbox.SetupError) as info:
        nsbox.run(["true"], cwd="/nope")
    assert info.value.step == "working directory"
    assert info.value.message == "'/nope': No such file or directory"


def test_a_session_backstop_needs_neither_its_init_nor_the_helper(as_user: UserRunner):
    marker = f"5{uuid.uuid4().int % 10**8}"
    out = as_user.script(f"""
import signal, threading, time
with nsbox.Session(timeout=1) as s:
    helper = nsbox.launch.launcher.helper_client.pid
    results = []
    t = threading.Thread(target=lambda: results.append(s.run(["sleep", "{marker}"])))
    started = time.monotonic()
    t.start()
    while not find("{marker}") and time.monotonic() - started < 10:
        time.sleep(0.02)
    # Neither the init (it would kill the command at its deadline) nor the helper (it would
    # kill the init) gets to run: only the host's own backstop is left.
    os.kill(s.pid, signal.SIGSTOP)
    os.kill(helper, signal.SIGSTOP)
    try:
        t.join(15)
        ended = time.monotonic() - started
    finally:
        os.kill(helper, signal.SIGCONT)
    r = results[0]
    alive = s.alive
    gone = time.monotonic() + 3
    while find("{marker}") and time.monotonic() < gone:  # SIGKILLed; let it finish exiting
        time.sleep(0.02)
    emit(ended=ended, status=r.status.value, alive=alive, left=find("{marker}"))
""")
    assert out["status"] == "TO"
    assert out["ended"] < 1 + 5 + 2  # the deadline plus the backstop's delay, and some slack
    assert out["alive"] is False
    assert out["left"] == []


def test_session_start_names_an_unwritable_runtime_directory(public_tree: Path,
                                                             unprivileged_tmp: Path):
    import subprocess

    from conftest import PYTHON, UNPRIVILEGED_UID

    if os.geteuid() != 0:
        pytest.skip("needs root to start the command line as the unprivileged uid")
    runtime = unprivileged_tmp / "runtime"
    (runtime / "nsbox").mkdir(parents=True)
    for path in (runtime, runtime / "nsbox"):
        os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    runtime.chmod(0o700)
    (runtime / "nsbox").chmod(0o500)  # private, but nothing can be created in it
    proc = subprocess.run(
        ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
         "--clear-groups", "--", PYTHON, "-m", "nsbox", "session", "start"],
        capture_output=True, timeout=60, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(public_tree),
             "XDG_RUNTIME_DIR": str(runtime), "HOME": "/tmp"})
    assert proc.returncode == 125, proc
    assert (f"cannot create the session's socket and record in {runtime}/nsbox: "
            "Permission denied") in proc.stderr.decode()
    assert os.listdir(runtime / "nsbox") == []


def test_a_path_the_user_may_not_resolve_is_a_message_not_a_traceback(public_tree: Path):
    import subprocess

    from conftest import PYTHON, UNPRIVILEGED_UID

    if os.geteuid() != 0:
        pytest.skip("needs root to start the command line as the unprivileged uid")
    proc = subprocess.run(
        ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
         "--clear-groups", "--", PYTHON, "-m", "nsbox", "run", "--ro-bind",
         "/proc/1/root/etc:/e", "--", "true"],
        capture_output=True, timeout=60, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(public_tree), "HOME": "/tmp"})
    assert proc.returncode == 125
    assert proc.stderr.decode().startswith("nsbox: ")
    assert "Permission denied" in proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()


def test_collect_into_an_unwritable_directory_fails_before_the_run(public_tree: Path,
                                                                  unprivileged_tmp: Path):
    import subprocess

    from conftest import PYTHON, UNPRIVILEGED_UID

    if os.geteuid() != 0:
        pytest.skip("needs root to start the command line as the unprivileged uid")
    dest = unprivileged_tmp / "out"
    dest.mkdir(mode=0o555)  # root's, not writable by the unprivileged uid
    proc = subprocess.run(
        ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
         "--clear-groups", "--", PYTHON, "-m", "nsbox", "run", "--collect", "*",
         "--collect-dir", str(dest), "--", "sh", "-c", "echo ran; echo x > f"],
        capture_output=True, timeout=60, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(public_tree), "HOME": "/tmp"})
    assert proc.returncode == 125
    assert proc.stdout == b""  # the command never ran
    assert proc.stderr.decode() == f"nsbox: {dest}: cannot use it for --collect: not writable\n"
    assert os.listdir(dest) == []
