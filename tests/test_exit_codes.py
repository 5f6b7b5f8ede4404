"""Every exit code of `nsbox run` that docs/cli.md lists, through both doors of the command line:
the fast path (the installed `nsbox` script) and click (nsbox.cli)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from nsbox import cgroups

DOORS = {
    "fast": [str(Path(sys.executable).with_name("nsbox"))],
    "click": [sys.executable, "-c", "import sys; from nsbox.cli.commands import main; main()"],
}

# (name, the arguments of `nsbox run`, the exit code docs/cli.md promises)
CASES = [
    ("command's own", ["--", "sh", "-c", "exit 3"], 3),
    ("success", ["--", "true"], 0),
    ("usage: unknown option", ["--no-such-option", "--", "true"], 2),
    ("usage: bad value", ["--memory", "lots", "--", "true"], 2),
    ("output limit", ["--output-limit", "1K", "--", "sh", "-c", "yes"], 123),
    ("time limit", ["--time", "1", "--", "sleep", "30"], 124),
    ("setup failed", ["--workspace", "/nonexistent/nsbox-test", "--", "true"], 125),
    ("not executable", ["--", "/etc/passwd"], 126),
    ("not found", ["--", "no-such-program"], 127),
]


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize(("name", "args", "code"), CASES, ids=[c[0] for c in CASES])
def test_exit_code(door: str, name: str, args: list[str], code: int, tmp_path: Path):
    proc = subprocess.run([*DOORS[door], "run", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == code, f"{name}: {proc.stderr}"
    if code in (2, 123, 124, 125, 126, 127):
        assert proc.stderr.strip(), "an nsbox exit code comes with a message"


@pytest.mark.parametrize("door", sorted(DOORS))
def test_memory_limit_is_the_oom_kill_signal(door: str, tmp_path: Path):
    # ML: the kernel's OOM killer ends the run with SIGKILL, so 128 + 9. Only a cgroup limit
    # is enforced this way; the rlimit fallback of a host without one fails the allocation.
    require(cgroups.MEMORY in cgroups.get_backend().supports(),
            "no writable cgroup with a memory controller for this user")
    proc = subprocess.run([*DOORS[door], "run", "--memory", "32M", "--", "python3", "-c",
                           "b = bytearray(256 << 20)"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 137, proc.stderr
    assert "ML" in proc.stderr


# (name, the command, its signal, what the line on stderr says beyond the signal's name)
SIGNAL_CASES = [
    ("kill -9", ["sh", "-c", "kill -9 $$"], 9, ""),
    ("SIGSEGV", ["sh", "-c", "kill -SEGV $$"], 11, ""),
    ("SIGTERM", ["sh", "-c", "kill -TERM $$"], 15, ""),
    ("SIGXFSZ", ["--file-size", "1K", "--", "dd", "if=/dev/zero", "of=/tmp/f", "bs=4096",
                 "count=1"], 25, ": a file reached the file-size limit; raise it with "
     "--file-size"),
    ("SIGSYS", ["--set", "seccomp.default_action=kill", "--set",
                'seccomp.rules=[{syscall="getppid",action="kill"}]', "--", "python3", "-c",
                "import os; os.getppid()"], 31, ": a system call the seccomp filter kills"),
]


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize(("name", "args", "signum", "reason"), SIGNAL_CASES,
                         ids=[c[0] for c in SIGNAL_CASES])
def test_a_command_killed_by_a_signal_is_128_plus_n_with_a_line(
        door: str, name: str, args: list[str], signum: int, reason: str, tmp_path: Path):
    import signal

    command = args if "--" in args else ["--", *args]
    proc = subprocess.run([*DOORS[door], "run", *command], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 128 + signum, f"{name}: {proc.stderr}"
    line = (f"nsbox: SG: the command was killed by {signal.Signals(signum).name} ({signum})"
            f"{reason}")
    assert line in proc.stderr, proc.stderr
