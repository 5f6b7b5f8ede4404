"""The native launch core (nsbox._native) against the Python child: the same sandbox.

Each probe runs once with each core (NSBOX_NATIVE=0 selects the Python child), as the caller
and as an unprivileged uid, and the two results must be the same: environment, mounts and ids
seen from inside, exit statuses, signals, and setup errors with the same step. CI also requires
that the native core is built and actually runs (Result.extra["core"]).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import pytest
from conftest import IN_CI, Runner, require

from nsbox import Policy, Pool
from nsbox.errors import SetupError
from nsbox.result import Result, Status
from nsbox.sandbox import native


def native_wanted() -> bool:
    return os.environ.get("NSBOX_NATIVE") != "0"


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    require(native.MISSING == "", native.MISSING or "the native core")
    monkeypatch.delenv("NSBOX_NATIVE", raising=False)
    yield monkeypatch


def with_core(monkeypatch: pytest.MonkeyPatch, sandbox: Runner, core: str, argv: list[str],
              **kwargs: object) -> Result:
    if core == "python":
        monkeypatch.setenv("NSBOX_NATIVE", "0")
    else:
        monkeypatch.delenv("NSBOX_NATIVE", raising=False)
    result = sandbox.run(argv, **kwargs)
    assert result.extra["core"] == core, result.extra
    return result


def on_both(monkeypatch: pytest.MonkeyPatch, sandbox: Runner, argv: list[str],
            **kwargs: object) -> tuple[Result, Result]:
    return (with_core(monkeypatch, sandbox, "native", argv, **kwargs),
            with_core(monkeypatch, sandbox, "python", argv, **kwargs))


def test_the_chosen_core_runs(sandbox: Runner):
    # CI builds the extension (the README's set-up installs gcc and python3-dev): a missing
    # native core there fails here instead of passing silently on the fallback.
    if IN_CI and native_wanted():
        assert native.MISSING == "", native.MISSING
    result = sandbox.run(["/bin/true"])
    assert result.status is Status.OK
    expected = "native" if native_wanted() and native.MISSING == "" else "python"
    assert result.extra["core"] == expected


def test_environment_and_identity_are_the_same(both: pytest.MonkeyPatch, sandbox: Runner):
    probe = ("env | sort; id; umask; hostname; cat /etc/hosts; pwd; "
             "grep -E '^(Uid|Gid|Groups|Cap|NoNewPrivs|Seccomp)' /proc/self/status; ulimit -a")
    fast, reference = on_both(both, sandbox, ["sh", "-c", probe], env={"PROBE": "a b'\"c"})
    assert fast.stdout == reference.stdout
    assert b"PROBE=a b'\"c\n" in fast.stdout
    assert re.search(rb"CapEff:\s+0+\n", fast.stdout)
    assert re.search(rb"NoNewPrivs:\s+1\n", fast.stdout)
    assert re.search(rb"Seccomp:\s+2\n", fast.stdout)


def mount_table(stdout: bytes) -> list[tuple[str, ...]]:
    """mountinfo without what differs between any two sandboxes: mount ids and devices."""
    rows = []
    for line in stdout.decode().splitlines():
        fields = line.split()
        sep = fields.index("-")
        rows.append((fields[4], fields[5], *fields[sep + 1:]))
    return rows


def test_mounts_seen_from_inside_are_the_same(both: pytest.MonkeyPatch, sandbox: Runner):
    probe = ("cat /proc/self/mountinfo; ls -a / /dev /etc /proc/fs; "
             "stat -c '%n %a %F %U' / /tmp /workspace /dev /dev/shm /dev/ptmx /etc/passwd")
    fast, reference = on_both(both, sandbox, ["sh", "-c", probe])
    assert fast.status is Status.OK, fast.stderr
    table = mount_table(fast.stdout.split(b"\n/:\n")[0])
    assert table == mount_table(reference.stdout.split(b"\n/:\n")[0])
    assert ("/", "ro,nosuid,nodev,relatime") in [row[:2] for row in table]
    assert fast.stdout.split(b"\n/:\n")[1] == reference.stdout.split(b"\n/:\n")[1]


@pytest.mark.parametrize("script, status, code, sig", [
    ("exit 0", Status.OK, 0, None),
    ("exit 3", Status.RE, 3, None),
    ("kill -TERM $$", Status.SG, None, signal.SIGTERM),
    ("kill -KILL $$", Status.SG, None, signal.SIGKILL),
])
def test_exit_statuses_are_the_same(both: pytest.MonkeyPatch, sandbox: Runner, script: str,
                                    status: Status, code: int | None, sig: int | None):
    for result in on_both(both, sandbox, ["sh", "-c", script]):
        assert (result.status, result.exit_code, result.signal) == (status, code, sig)


def test_init_forwards_signals_and_reaps(both: pytest.MonkeyPatch, sandbox: Runner):
    # pid 1 is the init in both cores: a signal sent to it reaches the command, and an orphan
    # is reaped (no zombie left in the listing).
    probe = ("trap 'echo got USR1; exit 7' USR1; (sleep 0 &); sleep 0.2; "
             "ps -o stat= -e 2>/dev/null | grep -c Z; cat /proc/1/comm; kill -USR1 1; "
             "sleep 5 & wait")
    for result in on_both(both, sandbox, ["sh", "-c", probe], timeout=20):
        assert result.exit_code == 7, result.stderr
        assert result.stdout.endswith(b"nsbox-init\ngot USR1\n"), result.stdout


@pytest.mark.parametrize("argv, cwd, step, errno, message", [
    (["/bin/true"], "/nowhere", "working directory", 2, "No such file or directory"),
    (["no-such-command"], None, "exec", 2,
     "command not found inside the sandbox: no-such-command"),
    (["/etc/passwd"], None, "exec", 13, "Permission denied"),
])
def test_setup_errors_name_the_same_step(both: pytest.MonkeyPatch, sandbox: Runner,
                                         argv: list[str], cwd: str | None, step: str,
                                         errno: int, message: str):
    for core in ("native", "python"):
        if core == "python":
            both.setenv("NSBOX_NATIVE", "0")
        with pytest.raises(SetupError) as caught:
            sandbox.run(argv, cwd=cwd)
        assert (caught.value.step, caught.value.errno) == (step, errno), core
        assert message in caught.value.message, (core, caught.value.message)


def test_file_target_refusal_is_the_same(both: pytest.MonkeyPatch, sandbox: Runner):
    # A bind of a file onto a directory of the new root: refused by the mount step, by name.
    binds = [["/etc/hostname", "/usr", False]]
    for core in ("native", "python"):
        if core == "python":
            both.setenv("NSBOX_NATIVE", "0")
        with pytest.raises(SetupError) as caught:
            sandbox.run(["/bin/true"], binds=binds)
        assert caught.value.step == "bind /usr", core
        assert caught.value.errno == 21, core
        assert "mount target /usr is a directory where a file is bound" in caught.value.message


def test_a_pooled_sandbox_is_the_same(both: pytest.MonkeyPatch, sandbox: Runner):
    # Built ahead, then one command: the command's part of the native core runs after the
    # wait (nsbox/native/child.c, await_command). The pool lives in this process.
    if sandbox.unprivileged and os.geteuid() == 0:
        pytest.skip("the pool is made in this process; the caller run covers it")
    probe = ("echo $PROBE; ls /proc/self/fd; "
             "grep -E '^(Uid|CapEff|NoNewPrivs|Seccomp):' /proc/self/status; exit 5")
    outputs = {}
    for core in ("native", "python"):
        if core == "python":
            both.setenv("NSBOX_NATIVE", "0")
        with Pool(Policy(), size=1) as pool:
            result = pool.run(["sh", "-c", probe], env={"PROBE": core})
        assert result.extra["core"] == core
        assert result.exit_code == 5, result.stderr
        outputs[core] = result.stdout.replace(core.encode(), b"CORE")
    assert outputs["native"] == outputs["python"]
    # Only the standard streams and the directory ls reads reach the command.
    assert outputs["native"].startswith(b"CORE\n0\n1\n2\n3\n"), outputs["native"]


def test_a_pooled_command_larger_than_a_datagram_arrives_whole(both: pytest.MonkeyPatch):
    # Over 64 KiB the command travels in a memfd (nsbox/_sys/wire.py), which the native core maps
    # (nsbox/native/report.c, map_memfd_message).
    env = {f"V{i}": str(i) * 100_000 for i in range(3)}
    for core in ("native", "python"):
        if core == "python":
            both.setenv("NSBOX_NATIVE", "0")
        with Pool(Policy(), size=1) as pool:
            result = pool.run(["sh", "-c", "echo ${#V0} ${#V2}"], env=env)
        assert result.extra["core"] == core
        assert result.stdout == b"100000 100000\n", result


def test_a_plan_the_native_core_cannot_carry_takes_the_python_child(both: pytest.MonkeyPatch,
                                                                    sandbox: Runner):
    # A value that is not UTF-8 (an undecodable byte, as os.environb would give it): the
    # native core writes names into its JSON report as they are, so this launch falls back to
    # the reference, with the same sandbox.
    result = sandbox.run(["sh", "-c", "printf %s \"$ODD\" | od -An -tx1"], env={"ODD": "a\udcff"})
    assert result.extra["core"] == "python"
    assert result.stdout.split() == [b"61", b"ff"]


def test_a_pooled_native_sandbox_refuses_a_command_it_cannot_carry(both: pytest.MonkeyPatch):
    with Pool(Policy(), size=1) as pool:
        with pytest.raises(SetupError) as caught:
            pool.run(["/bin/echo", "a\udcff"])
        assert caught.value.step == "wait for command"
        assert "NSBOX_NATIVE=0" in caught.value.message
        assert pool.run(["/bin/echo", "next"]).stdout == b"next\n"
