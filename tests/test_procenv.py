"""Programs behave inside as on a normal Linux host: users, arguments, terminals, an init.

Each case runs the same command on the host and inside a sandbox and expects the same output
and exit status (docs/compatibility.md lists what differs, and why).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, Runner, parent_of, processes_with, require
from sessiontools import UserRunner, user_runner

import nsbox
from nsbox.result import Result, Status


def host(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """The command run on the host, as the test runs it inside: no stdin, output captured."""
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)


# --- users and groups --------------------------------------------------------------------------


LOOKUPS = """
import grp, os, pwd
for uid in (0, 65534, os.getuid()):
    e = pwd.getpwuid(uid)
    print(e.pw_name, e.pw_uid, e.pw_gid, os.path.isdir(e.pw_dir), os.access(e.pw_shell, os.X_OK))
for gid in (0, 65534, os.getgid()):
    print(grp.getgrgid(gid).gr_name)
print(pwd.getpwnam("root").pw_uid, pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid)
"""


def test_root_nobody_and_the_user_are_known(sandbox: Runner):
    result = sandbox.run([PYTHON, "-c", LOOKUPS])
    assert result.status is Status.OK, result.stderr
    # Every home is a directory inside; every shell but nobody's nologin runs.
    assert result.stdout.decode().splitlines() == [
        "root 0 0 True True",
        "nobody 65534 65534 True True",
        "sandbox 1000 1000 True True",
        "root", "nogroup", "sandbox",
        "0 65534 65534",
    ]


def test_id_and_getent_answer_as_on_a_host(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "id -un; id -gn; getent passwd 0; getent group 0; "
                                      "getent passwd nobody | cut -d: -f1,3"])
    assert result.status is Status.OK, result.stderr
    assert result.stdout.decode().splitlines() == [
        "sandbox", "sandbox", "root:x:0:0:root:/:/bin/sh", "root:x:0:", "nobody:65534"]


def test_files_of_unmapped_owners_belong_to_nobody(sandbox: Runner):
    # The host's files (owned by ids the sandbox's user namespace does not map) appear as the
    # overflow uid 65534, which now has a name, as tarfile and ls record it.
    code = ("import tarfile; t = tarfile.open('/tmp/a.tar', 'w'); t.add('/usr/bin/true'); "
            "t.add('/etc/hostname'); t.close(); "
            "print([m.uname for m in tarfile.open('/tmp/a.tar').getmembers()])")
    result = sandbox.run(["sh", "-c", f"{PYTHON} -c \"{code}\"; stat -c %U /usr/bin/true"])
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"['nobody', 'sandbox']\nnobody\n"


# --- arguments: options stop at the command ----------------------------------------------------


# The fast path (python3 -m nsbox: nsbox/cli/fast.py) and click (nsbox/cli/commands.py) directly.
DOORS = {
    "fast": ["-m", "nsbox"],
    "click": ["-c",
              "import sys; from nsbox.cli.commands import main; sys.argv[0] = 'nsbox'; main()"],
}


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def nsbox_cli(user: UserRunner, door: str, args: list[str],
              cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp"}
    return subprocess.run([*user.prefix(), PYTHON, *DOORS[door], *args], capture_output=True,
                          stdin=subprocess.DEVNULL, env=env, cwd=cwd, timeout=60)


@pytest.mark.parametrize("door", DOORS)
def test_options_after_the_command_are_the_commands(as_user: UserRunner, door: str,
                                                     unprivileged_tmp: Path):
    # ./data exists: had nsbox taken "-w data", it would have become the workspace.
    (unprivileged_tmp / "data").mkdir()
    on_host = host(["ls", "-w", "data"])
    # --quiet: as a user without a cgroup, nsbox would add its line on approximated limits.
    inside = nsbox_cli(as_user, door, ["run", "--quiet", "ls", "-w", "data"], unprivileged_tmp)
    assert (inside.returncode, inside.stdout, inside.stderr) == (
        on_host.returncode, on_host.stdout, on_host.stderr)
    assert b"invalid line width" in inside.stderr
    printed = nsbox_cli(as_user, door, ["run", "--time", "10", "python3", "-c", "print(1)"],
                        unprivileged_tmp)
    assert (printed.returncode, printed.stdout) == (0, b"1\n"), printed.stderr
    # After the command, even "--" and nsbox's own option names are the command's.
    echoed = nsbox_cli(as_user, door, ["run", "--", "echo", "--json", "--", "-t", "5"],
                       unprivileged_tmp)
    assert (echoed.returncode, echoed.stdout) == (0, b"--json -- -t 5\n"), echoed.stderr


@pytest.mark.parametrize("door", DOORS)
def test_help_says_where_options_stop(door: str, public_tree: Path, tmp_path: Path):
    helped = nsbox_cli(UserRunner("caller", public_tree), door, ["run", "--help"], tmp_path)
    assert helped.returncode == 0
    assert "Options go before COMMAND" in " ".join(helped.stdout.decode().split())


# --- terminals ---------------------------------------------------------------------------------


OPENPTY = """
import os, pty
main, sub = pty.openpty()
os.write(sub, b"through the pty\\n")
print(os.read(main, 100), os.isatty(sub), os.ttyname(sub).startswith("/dev/pts/"))
"""


def test_a_program_opens_its_own_pty(sandbox: Runner):
    on_host = host([PYTHON, "-c", OPENPTY])
    inside = sandbox.run([PYTHON, "-c", OPENPTY])
    assert (inside.exit_code, inside.stdout) == (on_host.returncode, on_host.stdout)
    assert inside.stdout == b"b'through the pty\\r\\n' True True\n"


def test_script_runs_a_command_on_a_pty(sandbox: Runner):
    # script(1) needs a pty of its own; /dev/tty inside it is that pty.
    argv = ["script", "-qec", "tty; echo hi > /dev/tty; stty size", "/dev/null"]
    on_host = host(argv)
    inside = sandbox.run(argv)
    # The host's pty has whatever number is free there; the sandbox's devpts is its own.
    host_out = re.sub(rb"^/dev/pts/[0-9]+", b"/dev/pts/0", on_host.stdout)
    assert (inside.exit_code, inside.stdout) == (on_host.returncode, host_out)
    assert inside.stdout == b"/dev/pts/0\r\nhi\r\n0 0\r\n"


def test_host_terminals_are_not_reachable(sandbox: Runner):
    # A pty of the host's own devpts: its number is not in the sandbox's instance, and no
    # controlling terminal is reachable through /dev/tty (setsid).
    main, sub = os.openpty()
    try:
        number = os.ttyname(sub).rsplit("/", 1)[1]
        result = sandbox.run(["sh", "-c", f"ls /dev/pts; test -e /dev/pts/{number}; echo $?; "
                                          "echo x > /dev/tty"])
    finally:
        os.close(main)
        os.close(sub)
    assert result.stdout == b"ptmx\n1\n"
    assert b"/dev/tty: No such device or address" in result.stderr


# --- the init: pid 1 reaps orphans, passes signals on, ends with the command's status ----------


def same_as_host(sandbox: Runner, argv: list[str], **kwargs: object) -> Result:
    """Run ``argv`` on the host (in a session of its own, as inside) and in a sandbox; the exit
    status (-N for signal N) and stdout must be the same."""
    on_host = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                             start_new_session=True)
    inside = sandbox.run(argv, **kwargs)
    code = inside.exit_code if inside.signal is None else -inside.signal
    assert (code, inside.stdout) == (on_host.returncode, on_host.stdout), inside.stderr
    return inside


def test_orphans_are_reaped_under_a_small_pids_limit(sandbox: Runner):
    # Each "true &" outlives its shell: an orphan that only pid 1 can reap. Unreaped, 200 of
    # them would exhaust a pids limit of 64 ("sh: 0: Cannot fork").
    loop = ("import subprocess\n"
            "codes = {subprocess.run(['sh', '-c', 'true & exit 0']).returncode "
            "for _ in range(200)}\n"
            "print(codes)")
    result = same_as_host(sandbox, [PYTHON, "-c", loop], limit_changes={"pids": 64})
    assert result.stdout == b"{0}\n"
    assert result.stderr == b""


def test_a_signal_the_command_sends_itself_ends_it(sandbox: Runner):
    result = same_as_host(sandbox, [PYTHON, "-c", "import os, signal\n"
                                    "os.kill(os.getpid(), signal.SIGTERM)\nprint('survived')"])
    assert (result.status, result.signal, result.stdout) == (Status.SG, signal.SIGTERM, b"")


def test_abort_is_sigabrt(sandbox: Runner):
    result = same_as_host(sandbox, [PYTHON, "-c", "import os; os.abort()"])
    assert (result.status, result.signal) == (Status.SG, signal.SIGABRT)


def test_sigint_handlers_run(sandbox: Runner):
    # A handler of its own, then Python's default one, which ends the program with SIGINT.
    code = ("import os, signal\n"
            "signal.signal(signal.SIGINT, lambda *_: print('handled', flush=True))\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "print('not reached')")
    result = same_as_host(sandbox, [PYTHON, "-c", code])
    assert (result.signal, result.stdout) == (signal.SIGINT, b"handled\n")
    assert b"KeyboardInterrupt" in result.stderr


def test_background_jobs_and_wait(sandbox: Runner):
    script = ("sleep 0.2 & (exit 7) & wait $!; echo \"last $?\"; wait; echo \"all $?\"; "
              "sleep 30 & kill $!; wait $!; echo \"killed $?\"")
    result = same_as_host(sandbox, ["sh", "-c", script])
    assert result.stdout == b"last 7\nall 0\nkilled 143\n"


def test_kill_0_ends_the_process_group(sandbox: Runner):
    # The shell, its background jobs: one process group, pid 1 not in it.
    result = same_as_host(sandbox, ["sh", "-c", "sleep 30 & sleep 30 & kill 0; echo survived"])
    assert (result.signal, result.stdout) == (signal.SIGTERM, b"")


def test_signals_to_pid_1_reach_the_command(sandbox: Runner):
    # What a supervisor sends pid 1 (docker stop, a terminal's ^C or resize) is passed on.
    code = ("import os, signal, sys\n"
            "for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGWINCH):\n"
            "    signal.signal(sig, lambda s, _f: print(signal.Signals(s).name, flush=True))\n"
            "for sig in ('USR1', 'HUP', 'WINCH', 'TERM'):\n"
            "    os.kill(1, getattr(signal, 'SIG' + sig))\n"
            "    signal.sigtimedwait([], 0.05)  # let the handler run\n"
            "    sys.stdout.flush()\n"
            "signal.pause()")
    result = sandbox.run([PYTHON, "-c", code], timeout=20)
    assert (result.status, result.signal) == (Status.SG, signal.SIGTERM), result.stderr
    assert result.stdout == b"SIGUSR1\nSIGHUP\nSIGWINCH\n"


def test_a_signal_from_the_host_to_pid_1_reaches_the_command(sandbox: Runner):
    marker = f"{time.time():.6f}"
    outcome: list[Result] = []
    code = f"import signal, sys\nsys.argv.append({marker!r})\nsignal.pause()"
    runner = threading.Thread(target=lambda: outcome.append(
        sandbox.run([PYTHON, "-c", code, marker], timeout=30)))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not (found := processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        command = [pid for pid in found if parent_of(pid) not in found]
        assert len(command) == 1, found
        init = parent_of(command[0])
        assert init is not None
        with open(f"/proc/{init}/comm") as f:
            assert f.read() == "nsbox-init\n"
        os.kill(init, signal.SIGQUIT)
    finally:
        runner.join()
    assert (outcome[0].status, outcome[0].signal) == (Status.SG, signal.SIGQUIT)


def test_init_is_out_of_the_commands_reach(sandbox: Runner):
    # pid 1 is outside the seccomp filter and holds a copy of the launch helper's memory: the
    # command may neither trace it, nor read its memory or descriptors, nor kill it (signals
    # without a handler are dropped at pid 1, pid_namespaces(7)).
    code = ("import ctypes, errno, os, signal\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "r = libc.ptrace(16, 1, 0, 0)\n"  # PTRACE_ATTACH
            "print('attach', errno.errorcode[ctypes.get_errno()] if r else 'attached')\n"
            "for path in ('/proc/1/fd', '/proc/1/mem', '/proc/1/environ'):\n"
            "    try:\n"
            "        open(path, 'rb').close() if path[-2:] != 'fd' else os.listdir(path)\n"
            "        print(path, 'opened')\n"
            "    except PermissionError:\n"
            "        print(path, 'denied')\n"
            "for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV):\n"
            "    os.kill(1, sig)\n"
            "print('pid 1', open('/proc/1/stat').read().split()[2])\n"
            "print(open('/proc/1/status').read().split('CapEff:')[1].split()[0])")
    result = sandbox.run([PYTHON, "-c", code])
    assert result.status is Status.OK, result.stderr
    assert result.stdout.decode().splitlines() == [
        "attach EPERM", "/proc/1/fd denied", "/proc/1/mem denied", "/proc/1/environ denied",
        "pid 1 S", "0000000000000000"]


@pytest.fixture(scope="module")
def probe_dir() -> Iterator[Path]:
    """tests/probes/seccomp_probe.c built, in a directory every uid can read."""
    require(shutil.which("gcc") is not None, "gcc is needed to build the probe")
    out = Path(tempfile.mkdtemp(prefix="nsbox-probe-", dir="/tmp"))
    out.chmod(0o755)
    source = Path(__file__).with_name("probes") / "seccomp_probe.c"
    subprocess.run(["gcc", "-O1", "-o", str(out / "probe"), str(source)], check=True)
    yield out
    shutil.rmtree(out)


def test_init_is_never_readable_even_at_the_commands_first_instruction(
        as_user: UserRunner, probe_dir: Path):
    # A compiled probe reads pid 1's memory right after its exec: pid 1 must be out of reach
    # from the very start (launched unprivileged, the uid change leaves the process dumpable;
    # the init clears the flag before the fork, not after). Without the flag this fails every
    # time; with it set late (after the fork), some of the runs of a loop like this one.
    out = as_user.script(f"""
p = nsbox.Policy()
p = p.replace(mounts=p.mounts + (nsbox.Bind({str(probe_dir)!r}, "/probe"),))
emit(seen=sorted({{nsbox.run(["/probe/probe", "vm-read", "1"], p).stdout.decode().strip()
                   for _ in range(40)}}))
""")
    assert out["seen"] == [f"process_vm_readv -1 {errno.EPERM}"]


def test_cli_exit_code_of_a_signal_death_is_128_plus_n(public_tree: Path, tmp_path: Path):
    user = UserRunner("caller", public_tree)
    for door in DOORS:
        killed = nsbox_cli(user, door, ["run", "python3", "-c",
                                        "import os; os.kill(os.getpid(), 15)"], tmp_path)
        aborted = nsbox_cli(user, door, ["run", "python3", "-c", "import os; os.abort()"],
                            tmp_path)
        assert (killed.returncode, aborted.returncode) == (143, 134), door


def test_session_commands_have_an_init_too(tmp_path: Path):
    with nsbox.Session(timeout=60) as session:
        loop = ("import subprocess\n"
                "print({subprocess.run(['sh', '-c', 'true & exit 0']).returncode "
                "for _ in range(200)})")
        reaped = session.run([PYTHON, "-c", loop])
        aborted = session.run([PYTHON, "-c", "import os; os.abort()"])
        grouped = session.run(["sh", "-c", "sleep 30 & kill 0; echo survived"])
    assert (reaped.status, reaped.stdout) == (Status.OK, b"{0}\n"), reaped.stderr
    assert (aborted.status, aborted.signal) == (Status.SG, signal.SIGABRT)
    assert (grouped.signal, grouped.stdout) == (signal.SIGTERM, b"")
