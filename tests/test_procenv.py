"""Programs behave inside as on a normal Linux host: users, arguments, terminals, an init.

Each case runs the same command on the host and inside a sandbox and expects the same output
and exit status (docs/compatibility.md lists what differs, and why).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, Runner
from sessiontools import UserRunner, user_runner

from nsbox.result import Status


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


# The fast path (python3 -m nsbox: nsbox/_fastcli.py) and click (nsbox/cli.py) directly.
DOORS = {
    "fast": ["-m", "nsbox"],
    "click": ["-c", "import sys; from nsbox.cli import main; sys.argv[0] = 'nsbox'; main()"],
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
    inside = nsbox_cli(as_user, door, ["run", "ls", "-w", "data"], unprivileged_tmp)
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
    assert (inside.exit_code, inside.stdout) == (on_host.returncode, on_host.stdout)
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
