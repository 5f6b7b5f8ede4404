"""What differs inside nsbox from a normal host, one test per difference in
docs/compatibility.md; and a test that the document and these tests stay in step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, UNPRIVILEGED_UID, Runner, decode_result, processes_with, require

from nsbox.result import Status
from nsbox.sandbox import native

DOC = REPO / "docs" / "compatibility.md"


def lines(sandbox: Runner, script: str) -> list[str]:
    result = sandbox.run(["sh", "-c", script])
    return result.stdout.decode().splitlines() + result.stderr.decode().splitlines()


def test_every_listed_difference_has_its_test():
    # Each row of the table names the test that shows the difference (``test_...``).
    named = re.findall(r"^\|.*`(test_\w+)`\s*\|\s*$", DOC.read_text(), re.MULTILINE)
    assert len(named) >= 10
    module = sys.modules[__name__]
    missing = [name for name in named if not callable(getattr(module, name, None))]
    assert missing == []
    # ... and no test here is left out of the document.
    tests = {name for name in dir(module) if name.startswith("test_")}
    assert tests - set(named) == {"test_every_listed_difference_has_its_test"}


def test_host_files_belong_to_nobody(sandbox: Runner):
    assert lines(sandbox, "stat -c '%U %G' /usr/bin/env /workspace") == [
        "nobody nogroup", "sandbox sandbox"]


def test_another_id_is_forbidden_before_the_path_is_looked_at(sandbox: Runner):
    python = f"{PYTHON} -c 'import os; os.%s' 2>&1 | tail -1"
    out = lines(sandbox, "exec 2>&1; touch /tmp/f; chown 0 /tmp/f; chgrp 0 /tmp/f; "
                         "chown sandbox:sandbox /tmp/f && chgrp sandbox /tmp/f && echo own; "
                         + "; ".join(python % call for call in (
                             "chown(\"/tmp/missing\", 0, -1)", "setuid(65534)",
                             "setresgid(-1, -1, 0)")))
    assert out == ["chown: changing ownership of '/tmp/f': Operation not permitted",
                   "chgrp: changing group of '/tmp/f': Operation not permitted",
                   "own",
                   # a host would say "No such file or directory" first
                   "PermissionError: [Errno 1] Operation not permitted: '/tmp/missing'",
                   "PermissionError: [Errno 1] Operation not permitted",
                   "PermissionError: [Errno 1] Operation not permitted"]


def test_no_capabilities_and_no_new_privileges(sandbox: Runner):
    out = lines(sandbox, "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; "
                         "hostname other; echo $?")
    assert out[:3] == ["CapEff:\t0000000000000000", "CapBnd:\t0000000000000000",
                       "NoNewPrivs:\t1"]
    assert out[3] == "1"
    assert out[4].startswith("hostname: ")


def test_only_workspace_and_temporary_directories_are_writable(sandbox: Runner):
    out = lines(sandbox, "for d in /workspace /tmp /dev/shm /usr /etc /; do "
                         "touch $d/x 2>/dev/null && echo $d yes || echo $d no; done")
    assert out == ["/workspace yes", "/tmp yes", "/dev/shm yes", "/usr no", "/etc no", "/ no"]


def test_no_network_not_even_loopback(sandbox: Runner):
    code = ("import socket\n"
            "for address in (('192.0.2.1', 80), ('127.0.0.1', 80)):\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=5)\n"
            "    except OSError as e:\n"
            "        print(e.strerror)\n")
    result = sandbox.run([PYTHON, "-c", code])
    assert result.stdout == b"Network is unreachable\nNetwork is unreachable\n"


def test_etc_holds_only_what_nsbox_writes_or_binds(sandbox: Runner):
    out = lines(sandbox, "ls /etc; ls /etc/resolv.conf")
    assert set(out[:-1]) <= {"passwd", "group", "hostname", "hosts", "nsswitch.conf", "mtab",
                             "ld.so.cache", "alternatives", "localtime", "services",
                             "protocols", "mime.types", "inputrc", "os-release", "ssl",
                             "host.conf", "gai.conf", "timezone"}
    assert out[-1] == "ls: cannot access '/etc/resolv.conf': No such file or directory"


def test_no_home_no_root_no_sys(sandbox: Runner):
    out = lines(sandbox, "echo $HOME; ls -d /root /home /sys 2>&1 | cut -d: -f2")
    assert out == ["/workspace", " cannot access '/root'", " cannot access '/home'",
                   " cannot access '/sys'"]


def test_environment_is_reduced(sandbox: Runner):
    result = sandbox.run([PYTHON, "-c", "import os; print(sorted(os.environ))"])
    assert result.stdout == b"['HOME', 'LANG', 'PATH']\n"


def test_pid_1_is_the_sandbox_init(sandbox: Runner):
    assert lines(sandbox, "echo $$; cat /proc/1/comm; kill -9 1; cat /proc/1/environ") == [
        "2", "nsbox-init", "cat: /proc/1/environ: Permission denied"]


def test_processes_end_with_the_command(sandbox: Runner):
    marker = f"4{uuid.uuid4().int % 10**8}"
    started = time.monotonic()
    result = sandbox.run(["sh", "-c", f"sleep {marker} & echo started"], timeout=30)
    assert result.stdout == b"started\n"
    assert time.monotonic() - started < 20
    assert processes_with(f"sleep {marker}") == []


def test_denied_system_calls(sandbox: Runner):
    # Two of the filter's rules (docs/seccomp.md): the kernel keyring, and TIOCSTI even on a
    # pty of the sandbox's own.
    code = ("import ctypes, fcntl, os, termios\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall(250, 0, 0, 0, 0, 0)\n"  # keyctl(KEYCTL_GET_KEYRING_ID), x86-64
            "print(os.strerror(ctypes.get_errno()))\n"
            "main, sub = os.openpty()\n"
            "try:\n"
            "    fcntl.ioctl(sub, termios.TIOCSTI, b'x')\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n")
    result = sandbox.run([PYTHON, "-c", code])
    assert result.stdout == b"Operation not permitted\nOperation not permitted\n"


def test_limits_are_lower_than_a_hosts(sandbox: Runner):
    assert lines(sandbox, "ulimit -c; ulimit -n") == ["0", "1024"]


def test_dev_holds_a_few_devices(sandbox: Runner):
    assert set(lines(sandbox, "ls /dev")) == {
        "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
        "tty", "urandom", "zero"}


def test_no_terminal_unless_the_command_opens_one(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "tty; test -t 0 || echo no tty"])
    assert (result.exit_code, result.stdout) == (0, b"not a tty\nno tty\n")


# A launcher that leaves signals ignored and blocked, as a shell's background job (SIGINT,
# SIGQUIT), nohup (SIGHUP) and glibc <= 2.36's posix_spawn (its internal signals 32 and 33) do,
# then execs argv[1:]. SIG_IGN through the raw system call: glibc's sigaction refuses 32 and 33.
IGNORING_LAUNCHER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
number = {"x86_64": 13, "aarch64": 134}[os.uname().machine]
ignore = (1).to_bytes(8, "little") + bytes(24)  # handler SIG_IGN, flags, restorer, mask
for sig in (1, 2, 3, 13, 15, 32, 33):
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(sig), ignore, None,
                    ctypes.c_long(8)) != 0:
        sys.exit("rt_sigaction: errno %d" % ctypes.get_errno())
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT})
os.execv(sys.argv[1], sys.argv[1:])
"""
IGNORED = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 12) | (1 << 14) | (1 << 31) | (1 << 32)


def signal_masks(text: str) -> tuple[int, int]:
    fields = dict(line.split(":\t") for line in text.splitlines())
    return int(fields["SigIgn"], 16), int(fields["SigBlk"], 16)


@pytest.mark.parametrize("core", ["native", "python"])
@pytest.mark.parametrize("mode", ["caller", "unprivileged"])
def test_signals_start_at_their_defaults(public_tree: Path, mode: str, core: str):
    if mode == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'caller' run covers it")
    if core == "native":
        require(native.MISSING == "", native.MISSING or "the native core")
    setpriv = ["/usr/bin/setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
               "--clear-groups", "--"] if mode == "unprivileged" else []
    launcher = [PYTHON, "-I", "-c", IGNORING_LAUNCHER, *setpriv]
    probe = ["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"]
    # The launcher does leave them so: outside nsbox, the same probe sees them.
    direct = subprocess.run([*launcher, "/usr/bin/grep", *probe[1:]], capture_output=True,
                            check=True)
    ignored, blocked = signal_masks(direct.stdout.decode())
    assert ignored & IGNORED == IGNORED and blocked != 0, direct.stdout
    request = json.dumps({"argv": probe, "kwargs": {}})
    env = {"PATH": "/usr/bin:/bin", "NSBOX_NATIVE": "0" if core == "python" else ""}
    proc = subprocess.run([*launcher, PYTHON, "-I", str(public_tree / "_driver.py")],
                          input=request.encode(), capture_output=True, cwd="/", timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    result = decode_result(json.loads(proc.stdout))
    assert result.extra["core"] == core
    # Every signal at its default in the command, none blocked, glibc's 32 and 33 included.
    assert signal_masks(result.stdout.decode()) == (0, 0), result.stdout


def test_the_workspace_is_a_fresh_tmpfs(sandbox: Runner):
    first = sandbox.run(["sh", "-c", "ls -A /workspace | wc -l; touch /workspace/left; "
                                     "df -k /workspace | tail -1 | awk '{print $1, $2}'"])
    assert (first.status, first.stdout) == (Status.OK, b"0\ntmpfs 262144\n")
    assert sandbox.run(["ls", "-A", "/workspace"]).stdout == b""
