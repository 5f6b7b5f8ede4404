"""Resource limits: the option parsers, the Plan's rlimits, the fallback decision, and (through
real sandboxes) every limit enforced on this host."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import _driver
import pytest
from conftest import (
    PYTHON,
    UNPRIVILEGED_UID,
    Runner,
    decode_result,
    parent_of,
    processes_with,
    require,
    run_as,
)

import nsbox
from nsbox import cgroups
from nsbox.cgroups import naming
from nsbox.cgroups._null import NullBackend
from nsbox.errors import CommandNotFound, HostError, PolicyError
from nsbox.helper import spawner
from nsbox.launch import launcher
from nsbox.policy import limits, limittable
from nsbox.policy.policy import Limits, Policy
from nsbox.result import Result, Status

M = 1 << 20


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("64K", 64 << 10), ("256M", 256 * M), ("256MiB", 256 * M),
     ("1.5G", 3 << 29), ("2g", 2 << 30)],
)
def test_parse_size(text: str, value: int) -> None:
    assert limittable.parse_size(text) == value


@pytest.mark.parametrize(("text", "problem"), [("0", "more than zero"), ("lots", "not a size"),
                                               ("-5M", "is negative"), ("12X", "not a size"),
                                               ("", "not a size")])
def test_parse_size_rejects_bad_input_naming_the_option(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        limittable.parse_size(text, key="--memory")
    assert info.value.key == "--memory" and problem in str(info.value)
    assert "e.g." in str(info.value) or "leave the option out" in str(info.value)


@pytest.mark.parametrize(("text", "value"), [("10", 10.0), ("10s", 10.0), ("500ms", 0.5),
                                             ("2m", 120.0), ("1h", 3600.0), ("0.25s", 0.25)])
def test_parse_duration(text: str, value: float) -> None:
    assert limittable.parse_duration(text) == value


@pytest.mark.parametrize("text", ["0s", "soon", "10 days", "-1"])
def test_parse_duration_rejects_bad_input(text: str) -> None:
    with pytest.raises(PolicyError, match="--cpu-time"):
        limittable.parse_duration(text, key="--cpu-time")


@pytest.mark.parametrize("text", ["0", "-1", "half", "inf", "nan"])
def test_parse_cpus_and_counts_reject_bad_input(text: str) -> None:
    with pytest.raises(PolicyError, match="--cpus"):
        limittable.parse_cpus(text, key="--cpus")
    with pytest.raises(PolicyError, match="--pids"):
        limittable.parse_count(text, key="--pids")


@pytest.mark.parametrize(("field", "value"), [("memory", 0), ("pids", -1), ("cpus", 0.0),
                                              ("cpu_time", float("inf")), ("open_files", 1.5),
                                              ("tmp_size", "64M"), ("memory", True)])
def test_bad_limits_from_the_api_are_policy_errors(field: str, value: object) -> None:
    with pytest.raises(PolicyError) as info:
        nsbox.run(["true"], Policy().with_limits(**{field: value}))
    assert info.value.key == f"limits.{field}"


def test_plan_carries_the_rlimits_every_run_gets() -> None:
    plan = limits.plan_limits(Limits(open_files=100, file_size=M, pids=64, cpu_time=2.5))
    by_resource = {r: (soft, hard) for r, soft, hard in plan["rlimits"]}
    assert by_resource[resource.RLIMIT_CORE] == (0, 0)
    assert by_resource[resource.RLIMIT_NOFILE] == (100, 100)
    assert by_resource[resource.RLIMIT_FSIZE] == (M, M)
    assert by_resource[resource.RLIMIT_NPROC] == (64, 64)
    assert by_resource[resource.RLIMIT_CPU] == (3, 3)  # whole seconds, SIGKILL at the limit
    # Charged to the launching user as well (docs/limits.md, "Shared kernel resources").
    assert by_resource[resource.RLIMIT_MSGQUEUE] == (256 * 1024, 256 * 1024)
    assert by_resource[resource.RLIMIT_SIGPENDING] == (4096, 4096)
    assert resource.RLIMIT_AS not in by_resource  # only a fallback: see below
    assert plan["cgroup"]["memory"] == 512 * M


def test_plan_never_asks_for_more_than_the_hard_limit_allows() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = limits.plan_limits(Limits(open_files=hard + 1000 if hard > 0 else 1 << 30))
    nofile = [r for r in plan["rlimits"] if r[0] == resource.RLIMIT_NOFILE][0]
    if hard != resource.RLIM_INFINITY:
        assert nofile[1:] == [hard, hard]


def test_a_cpu_share_above_the_cpus_this_process_may_use_is_refused_by_name() -> None:
    available = len(os.sched_getaffinity(0))
    assert limits.plan_limits(Limits(cpus=available))["cgroup"]["cpus"] == available
    with pytest.raises(PolicyError, match=f"is more than the {available} CPU") as raised:
        limits.plan_limits(Limits(cpus=available + 0.5))
    assert raised.value.key == "limits.cpus" and f"at most {available}" in str(raised.value.hint)
    # On the command line the option is named, and nothing is launched.
    cli = subprocess.run([sys.executable, "-m", "nsbox", "run", "--cpus", str(available + 1),
                          "--", "true"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 125, cli.stderr
    assert cli.stderr.startswith(f"nsbox: --cpus: {available + 1} is more than"), cli.stderr


def test_without_cgroups_the_run_falls_back_to_rlimits_and_says_so() -> None:
    plan = limits.plan_limits(Limits(memory=64 * M, pids=16, cpus=0.5, cpu_time=3))
    run = limits.RunLimits(plan["cgroup"], plan["rlimits"], NullBackend("no cgroup here"))
    try:
        assert run.cgroup is None and run.poll_interval() is None
        assert [resource.RLIMIT_AS, 64 * M, 64 * M] in run.rlimits
        text = "\n".join(run.degraded)
        for word in ("memory: RLIMIT_AS", "pids: RLIMIT_NPROC", "cpus: not limited",
                     "cpu_time: RLIMIT_CPU", "no cgroup here"):
            assert word in text
        assert run.finish()["accounting"] == "rusage"
    finally:
        run.close()


def test_require_cgroup_makes_a_host_without_cgroups_an_error() -> None:
    plan = limits.plan_limits(Limits(memory=64 * M, require_cgroup=True))
    with pytest.raises(HostError) as info:
        limits.RunLimits(plan["cgroup"], plan["rlimits"], NullBackend("no cgroup here"))
    assert info.value.feature == "cgroup"
    assert "memory" in str(info.value) and "no cgroup here" in str(info.value)


def test_with_this_hosts_cgroups_no_fallback_is_added() -> None:
    backend = cgroups.detect()
    if not {cgroups.MEMORY, cgroups.PIDS} <= backend.supports():
        pytest.skip(f"no writable memory+pids cgroup here: {backend.reason}")
    plan = limits.plan_limits(Limits(memory=64 * M, pids=16))
    run = limits.RunLimits(plan["cgroup"], plan["rlimits"], backend)
    try:
        assert run.cgroup is not None and not run.degraded
        assert all(r[0] != resource.RLIMIT_AS for r in run.rlimits)
    finally:
        run.close()


# --- through real sandboxes ----------------------------------------------------------------------
# The tests marked cgroup2 also run on a pure cgroup v2 host (the qemu VM of .ci/run).


def py(code: str, *args: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code), *args]


def _bases() -> list[str]:
    info = cgroups.describe_host()
    bases = list(info.get("cgroups", {}).values()) + [info.get("unified"), info.get("cgroup")]
    return sorted({b for b in bases if b})


def _our_run_cgroups() -> list[str]:
    """Run cgroups whose owner (the launch helper) is a child of this test process.

    A spare (made ahead, nsbox/helper/spawner.py) counts as one unless it holds nothing but its
    waiting spawner: a run that took it and left anything behind is found."""
    found = []
    for base in _bases():
        for name in os.listdir(base):
            parsed = naming.parse(name)
            if not parsed or parsed[3] == "leaf" or parent_of(parsed[1]) != os.getpid():
                continue
            path = os.path.join(base, name)
            if naming.is_idle_spare(name, cgroups._fs.procs(path)):
                continue
            found.append(path)
    return found


def _spawners_ready() -> bool:
    """Each hierarchy holds the helper's spares (nsbox/helper/spawner.py, READY of them), each
    with its spawner moved in: what a spawner does just before it tells the helper "ready"."""
    for base in _bases():
        ready = 0
        for name in os.listdir(base):
            parsed = naming.parse(name)
            if not parsed or not parsed[3].startswith("s") or parent_of(parsed[1]) != os.getpid():
                continue
            procs = cgroups._fs.procs(os.path.join(base, name))
            ready += len(procs) == 1 and naming.is_spawner(procs[0])
        if ready < spawner.READY:
            return False
    return True


def _cgroup_dirs(name: str) -> list[str]:
    return [os.path.join(b, name) for b in _bases() if os.path.isdir(os.path.join(b, name))]


def _sandbox_pid(marker: str) -> int | None:
    """The sandbox's ``sleep MARKER`` (not a launcher that has the marker in its argv)."""
    for pid in processes_with(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                return pid
        except OSError:
            continue
    return None


def _run_cgroup_of(pid: int) -> str:
    """The name of the run cgroup ``pid`` is in, read from the host side."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        name = os.path.basename(line.split(":", 2)[2])
        if naming.parse(name):
            return name
    raise AssertionError(f"process {pid} is in no nsbox cgroup")


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _cgroup_backend(*features: str) -> cgroups.Backend:
    backend = cgroups.detect()
    missing = sorted(set(features) - backend.supports())
    require(not missing, f"no writable cgroup with {missing} here: {backend.reason}")
    return backend


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique word put on the sandbox's command lines; afterwards no process may carry it and
    no run cgroup of ours may be left."""
    word = f"6{uuid.uuid4().int % 10**8}"
    yield word
    assert _wait(lambda: processes_with(word) == [], timeout=30), processes_with(word)
    # A spare made just now gets its spawner within about an RCU grace period.
    assert _wait(lambda: _our_run_cgroups() == [], timeout=2), _our_run_cgroups()


@pytest.mark.cgroup2
def test_memory_hog_is_stopped_at_its_limit_and_reported_ml(marker: str) -> None:
    _cgroup_backend(cgroups.MEMORY)
    result = nsbox.run(py("b = bytearray(256 << 20); print('survived')", marker),
                       Policy().with_limits(memory=48 * M), timeout=60)
    assert result.status is Status.ML and result.oom_killed
    assert result.signal == signal.SIGKILL and b"survived" not in result.stdout
    assert result.accounting == "cgroup" and result.degraded == []
    assert 16 * M < result.peak_memory <= 48 * M


@pytest.mark.cgroup2
def test_an_ordinary_sigkill_is_not_mistaken_for_an_oom_kill(marker: str) -> None:
    _cgroup_backend(cgroups.MEMORY)
    results: list[nsbox.Result] = []
    thread = threading.Thread(target=lambda: results.append(nsbox.run(
        ["sleep", marker], Policy().with_limits(memory=64 * M), timeout=60)))
    thread.start()
    assert _wait(lambda: _sandbox_pid(marker) is not None)
    os.kill(_sandbox_pid(marker), signal.SIGKILL)  # type: ignore[arg-type]
    thread.join(60)
    assert results[0].status is Status.SG and results[0].signal == signal.SIGKILL
    assert not results[0].oom_killed


BOMB = """
    import os, sys, time
    first = os.getpid()  # the command, the child of the sandbox's init
    deadline = time.monotonic() + 1.5
    refused = 0
    while time.monotonic() < deadline:  # every process forks, children too
        try:
            os.fork()
        except BlockingIOError:
            refused += 1
            time.sleep(0.01)
    if os.getpid() == first:
        print("refused", refused > 0)
    else:
        time.sleep(60)  # held until the command and its init exit and the pid namespace ends
"""


@pytest.mark.cgroup2
def test_fork_bomb_is_held_at_the_pids_limit_and_the_run_ends_cleanly(marker: str) -> None:
    _cgroup_backend(cgroups.PIDS)
    result = nsbox.run(py(BOMB, marker), Policy().with_limits(pids=16), timeout=30)
    assert result.status is Status.OK, result
    assert result.stdout == b"refused True\n"
    assert result.peak_pids == 16
    # The host was never short of processes: this one can still start one.
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.cgroup2
def test_a_sandbox_is_born_in_its_cgroup_alone_with_its_exact_limits(
        marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No migration into the cgroup after the clone (it waits for an RCU grace period): on v2
    the child is cloned into it, on v1 a spawner made ahead clones it there and then leaves."""
    backend = _cgroup_backend(cgroups.PIDS)
    monkeypatch.setenv("NSBOX_ENGINE", "0")  # the Python helper's; the engine attaches on v1
    nsbox.run(["true"])  # the helper is up; its spawners (v1) get ready meanwhile
    if backend.kind == "v1":
        assert _wait(_spawners_ready), "the helper's spawners did not get ready"
    monkeypatch.setenv("NSBOX_TRACE", "1")
    outcome: dict[str, Result] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=nsbox.run(
        ["sleep", f"0.{marker}"], Policy().with_limits(pids=5), timeout=30)))
    runner.start()
    try:
        assert _wait(lambda: _sandbox_pid(marker) is not None)
        pid = _sandbox_pid(marker)
        assert pid is not None
        dirs = _cgroup_dirs(_run_cgroup_of(pid))
        assert dirs
        init = parent_of(pid)
        for directory in dirs:
            # The spawner has gone: the sandbox (its init and the command) is alone in every
            # hierarchy's run cgroup.
            assert cgroups._fs.procs(directory) == [init, pid], directory
            if os.path.exists(os.path.join(directory, "pids.max")):
                assert cgroups._fs.read(os.path.join(directory, "pids.max")).strip() == "5"
    finally:
        runner.join()
    steps = [step["step"] for step in outcome["result"].extra["trace"]]
    assert outcome["result"].status is Status.OK
    assert "helper: attach to cgroup" not in steps
    assert ("helper: spawner exits" in steps) == (backend.kind == "v1")


def test_spawners_killed_while_waiting_are_cleaned_up_and_runs_keep_their_cgroup(
        marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _cgroup_backend(cgroups.MEMORY)
    monkeypatch.setenv("NSBOX_ENGINE", "0")  # the Python helper's spawners
    require(backend.kind == "v1", "spawners exist on v1 hosts only (v2 clones into the cgroup)")
    nsbox.run(["true"])
    helper = launcher.helper_client.pid

    def spawners() -> list[int]:
        # Every process; the helper's spawners are picked out.
        return [pid for pid in processes_with("")
                if naming.is_spawner(pid) and parent_of(pid) == helper]

    def in_run_cgroup(pid: int) -> bool:
        # A spawner names itself, then moves into its cgroup (nsbox/helper/spawner.py, serve).
        try:
            _run_cgroup_of(pid)
        except (AssertionError, OSError):
            return False
        return True

    assert _wait(lambda: len(spawners()) == 2 and all(map(in_run_cgroup, spawners())))
    victims = spawners()
    spares = {_run_cgroup_of(pid) for pid in victims}
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    result = nsbox.run(["sh", "-c", f"echo {marker}"], Policy().with_limits(memory=64 * M))
    assert result.status is Status.OK and result.stdout == f"{marker}\n".encode()
    assert result.accounting == "cgroup" and result.degraded == []
    # The helper noticed, reaped them and removed their cgroups; new ones take their place.
    assert _wait(lambda: not any(_cgroup_dirs(name) for name in spares))
    assert _wait(lambda: len(spawners()) == 2 and not set(spawners()) & set(victims))


SPIN = """
    import os, time
    os.fork()  # two spinners: the limit is for the whole run, not per process
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        pass
"""


@pytest.mark.cgroup2
def test_cpu_spinner_under_a_quarter_core_gets_about_a_quarter(marker: str) -> None:
    _cgroup_backend(cgroups.CPUS, cgroups.CPU_ACCOUNTING)
    result = nsbox.run(py(SPIN.format(seconds=2.0), marker),
                       Policy().with_limits(cpus=0.25), timeout=30)
    assert result.status is Status.OK and result.accounting == "cgroup"
    share = (result.cpu_user + result.cpu_system) / result.wall_time
    # Unlimited, two spinners take up to 2 cores (at least 1 on a busy machine).
    assert 0.08 < share < 0.45, share


@pytest.mark.cgroup2
def test_cpu_time_limit_counts_the_whole_run_and_ends_it_with_to(marker: str) -> None:
    _cgroup_backend(cgroups.CPU_ACCOUNTING)
    result = nsbox.run(py(SPIN.format(seconds=60), marker),
                       Policy().with_limits(cpu_time=1.0), timeout=30)
    assert result.status is Status.TO and result.timed_out
    assert result.extra["limit"] == "cpu_time" and result.accounting == "cgroup"
    used = result.cpu_user + result.cpu_system
    # Two spinners: RLIMIT_CPU (per process) alone would have let them use 2 s or more. The
    # limit reads the cgroup's total (cpuacct.usage, cpu.stat usage_usec); the Result adds its
    # user and system parts, read after the kill: seen 20 us under the total once, so the
    # lower bound says "not ended early" with a margin of 1%.
    assert 0.99 <= used < 1.9, used


FILL = """
    import errno, os, sys
    written = 0
    chunk = b"x" * 65536
    try:
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
        while True:
            written += os.write(fd, chunk)
    except OSError as exc:
        print(errno.errorcode[exc.errno], written)
"""


@pytest.mark.cgroup2
@pytest.mark.parametrize(("path", "field"), [("/tmp/fill", "tmp_size"),
                                             ("/workspace/fill", "workspace_size"),
                                             ("/dev/shm/fill", "shm_size")])
def test_disk_filler_is_stopped_at_the_tmpfs_size(path: str, field: str, marker: str) -> None:
    size = 2 * M
    result = nsbox.run([PYTHON, "-c", textwrap.dedent(FILL), path, marker],
                       Policy().with_limits(**{field: size}), timeout=30)
    name, written = result.stdout.split()
    assert name == b"ENOSPC"
    assert size - 128 * 1024 <= int(written) <= size


@pytest.mark.cgroup2
def test_tmpfs_files_count_against_the_memory_limit(marker: str) -> None:
    _cgroup_backend(cgroups.MEMORY)
    result = nsbox.run([PYTHON, "-c", textwrap.dedent(FILL), "/tmp/fill", marker],
                       Policy().with_limits(memory=48 * M, tmp_size=256 * M), timeout=30)
    assert result.status is Status.ML and result.stdout == b""
    assert result.peak_memory <= 48 * M


def test_open_files_and_file_size_rlimits(sandbox: Runner) -> None:
    code = """
        import errno, os
        fds = []
        try:
            while True:
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            print(errno.errorcode[exc.errno], len(fds))
        for fd in fds:
            os.close(fd)
        try:
            with open("/tmp/big", "wb") as f:
                f.write(b"x" * (2 << 20))
        except OSError as exc:
            print(errno.errorcode[exc.errno], os.path.getsize("/tmp/big"))
    """
    result = sandbox.run(py(code), limit_changes={"open_files": 20, "file_size": M})
    lines = result.stdout.decode().split("\n")
    assert lines[0] == "EMFILE 17", result  # 0, 1, 2 are open already
    assert lines[1] == f"EFBIG {M}"


def test_no_core_dumps(sandbox: Runner) -> None:
    result = sandbox.run(py("import resource; print(resource.getrlimit(resource.RLIMIT_CORE))"))
    assert result.stdout == b"(0, 0)\n"


@pytest.mark.cgroup2
def test_sandbox_sees_only_its_own_cgroup_and_cannot_mount_cgroupfs(sandbox: Runner) -> None:
    code = """
        import ctypes, errno, os
        print(open("/proc/self/cgroup").read().strip())
        print("sys visible:", os.path.exists("/sys/fs/cgroup"))
        libc = ctypes.CDLL(None, use_errno=True)
        os.makedirs("/tmp/cg")
        for fstype, data in ((b"cgroup2", None), (b"cgroup", b"pids")):
            if libc.mount(b"none", b"/tmp/cg", fstype, 0, data) == 0:
                print("mounted", fstype)
            else:
                print("mount", fstype.decode(), errno.errorcode[ctypes.get_errno()])
    """
    result = sandbox.run(py(code))
    lines = result.stdout.decode().splitlines()
    hierarchies = [line for line in lines if line.count(":") >= 2]
    assert hierarchies and all(line.endswith(":/") for line in hierarchies), lines
    assert "sys visible: False" in lines
    assert "mount cgroup2 EPERM" in lines and "mount cgroup EPERM" in lines, lines


@pytest.mark.cgroup2
def test_the_cgroup_is_removed_when_the_sandbox_fails_to_start(marker: str) -> None:
    _cgroup_backend(cgroups.MEMORY)
    with pytest.raises(CommandNotFound):
        nsbox.run([f"/no/such/command-{marker}"], Policy().with_limits(memory=64 * M))
    # (the marker fixture checks that no run cgroup of ours is left)


# --- cleanup after the launcher or the helper is killed -------------------------------------------

LAUNCHER = """
    import sys
    import nsbox
    from nsbox import Policy
    nsbox.run(["sleep", sys.argv[1]], Policy().with_limits(memory=64 << 20, pids=8),
              timeout=120)
"""


def _start_launcher(marker: str) -> tuple[subprocess.Popen[bytes], int, str]:
    """A host process that runs a sleeping sandbox; returns it, the sandbox's pid and the name
    of its run cgroup."""
    with tempfile.TemporaryFile() as err:
        launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER), marker],
                                    stderr=err)
        # A new Python that imports nsbox and starts its launch process: seconds in the cgroup
        # v2 VM's software emulation (10 s was too short there once, with the host busy).
        if not _wait(lambda: _sandbox_pid(marker) is not None, timeout=90):
            launcher.kill()
            launcher.wait()
            err.seek(0)
            raise AssertionError(f"the sandbox did not start: {err.read()!r}")
    pid = _sandbox_pid(marker)
    assert pid is not None
    return launcher, pid, _run_cgroup_of(pid)


@pytest.mark.cgroup2
def test_nothing_is_left_after_the_launcher_is_sigkilled(marker: str) -> None:
    _cgroup_backend(cgroups.KILL)
    launcher, _pid, name = _start_launcher(marker)
    launcher.kill()
    launcher.wait()
    # The helper sees its launcher go, kills the sandbox and removes the cgroup.
    assert _wait(lambda: processes_with(marker) == [] and _cgroup_dirs(name) == [], timeout=30)


@pytest.mark.cgroup2
def test_cgroup_of_a_killed_helper_is_reclaimed_by_the_next_run(marker: str) -> None:
    _cgroup_backend(cgroups.KILL)
    launcher, _pid, name = _start_launcher(marker)
    helper = naming.parse(name)[1]  # type: ignore[index]
    try:
        os.kill(helper, signal.SIGKILL)  # nobody is left to clean up: the cgroup stays behind
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    assert _wait(lambda: processes_with(marker) == [], timeout=30)
    assert _cgroup_dirs(name), "expected the dead helper's cgroup to be left over"
    subprocess.run([sys.executable, "-c", "import nsbox; nsbox.run(['true'])"], check=True,
                   timeout=60)
    assert _cgroup_dirs(name) == []


# --- an unprivileged user without a writable cgroup: the rlimit fallback -------------------------


FallbackRun = Callable[..., nsbox.Result]


@pytest.fixture(scope="module")
def fallback(public_tree: Path) -> FallbackRun:
    """Runs sandboxes as a user without a writable cgroup: uid 65534 when we are root, else
    ourselves. Skips (fails in CI) if that user can write cgroups here."""
    if os.geteuid() != 0:
        info = cgroups.describe_host()
        require(not info["writable"], f"this uid can write cgroups here: {info}")
        return lambda argv, **kwargs: _driver.invoke(argv, kwargs)
    out = subprocess.run(
        ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
         "--clear-groups", "--", PYTHON, "-I", "-c",
         "import json, sys; sys.path.insert(0, sys.argv[1]); from nsbox import cgroups; "
         "print(json.dumps(cgroups.describe_host()))", str(public_tree)],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout
    info = json.loads(out)
    require(not info["writable"], f"uid {UNPRIVILEGED_UID} can write cgroups here: {info}")
    return lambda argv, **kwargs: run_as(UNPRIVILEGED_UID, public_tree, argv, **kwargs)


@pytest.mark.cgroup2
def test_fallback_memory_limit_is_rlimit_as_and_the_result_says_so(
        fallback: FallbackRun) -> None:
    result = fallback(py("b = bytearray(256 << 20)"), limit_changes={"memory": 64 * M})
    # Without a cgroup the allocation fails instead of being OOM-killed: RE, not ML.
    assert result.status is Status.RE and b"MemoryError" in result.stderr
    assert not result.oom_killed and result.accounting == "rusage"
    assert any(line.startswith("memory: RLIMIT_AS") for line in result.degraded)


@pytest.mark.cgroup2
def test_fallback_pids_limit_is_rlimit_nproc(fallback: FallbackRun) -> None:
    result = fallback(py(BOMB), limit_changes={"pids": 16}, timeout=30)
    assert result.status is Status.OK and result.stdout == b"refused True\n"
    assert result.peak_pids is None  # no cgroup to count them
    assert any(line.startswith("pids: RLIMIT_NPROC") for line in result.degraded)


@pytest.mark.cgroup2
def test_fallback_cpu_time_limit_is_rlimit_cpu(fallback: FallbackRun) -> None:
    result = fallback(py("while True: pass"), limit_changes={"cpu_time": 1.0}, timeout=30)
    assert result.status is Status.TO and result.extra["limit"] == "cpu_time"
    assert result.signal == signal.SIGKILL and result.accounting == "rusage"
    assert 0.5 <= result.cpu_user + result.cpu_system < 2.0
    assert any(line.startswith("cpu_time: RLIMIT_CPU") for line in result.degraded)


@pytest.mark.cgroup2
def test_require_cgroup_without_one_is_a_host_error(fallback: FallbackRun) -> None:
    with pytest.raises(HostError) as info:
        fallback(["true"], limit_changes={"require_cgroup": True})
    assert info.value.feature == "cgroup"
    assert f"not writable by uid {os.geteuid() or UNPRIVILEGED_UID}" in str(info.value)


# --- an unprivileged user with a delegated cgroup v2 subtree -------------------------------------


@pytest.mark.cgroup2
@pytest.mark.needs_host("cgroup v2 with controllers (runs in the VM)")
def test_unprivileged_user_with_a_delegated_v2_cgroup_gets_real_limits(public_tree: Path) -> None:
    """What systemd's user delegation (``Delegate=yes``) gives a user: a cgroup it owns. Here
    root makes one and hands it over the same way (cgroup-v2.rst, "Delegation Containment")."""
    backend = cgroups.detect()
    if backend.kind != "v2" or os.geteuid() != 0:
        pytest.skip(f"needs root on cgroup v2 with controllers (here: {backend.kind})")
    backend.prepare()  # type: ignore[attr-defined]  # the controllers enabled below our base
    delegated = os.path.join(backend.describe()["cgroup"], f"nsbox-test-user-{os.getpid()}")
    os.mkdir(delegated)
    try:
        for path in (delegated, *(os.path.join(delegated, f) for f in
                                  ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"))):
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        request = json.dumps({"argv": py("b = bytearray(256 << 20)"),
                              "kwargs": {"limit_changes": {"memory": 48 * M}}})
        # Root moves the shell into the delegated cgroup, then it becomes the unprivileged user.
        proc = subprocess.run(
            ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec setpriv --reuid=65534 '
             '--regid=65534 --clear-groups -- /usr/bin/python3 -I "$2"', "sh", delegated,
             str(public_tree / "_driver.py")],
            input=request, capture_output=True, text=True, timeout=120, cwd="/",
        )
        assert proc.returncode == 0, proc.stderr
        result = decode_result(json.loads(proc.stdout))
        assert result.status is Status.ML and result.oom_killed
        assert result.accounting == "cgroup" and result.degraded == []
    finally:
        for name in os.listdir(delegated):
            path = os.path.join(delegated, name)
            if os.path.isdir(path):
                assert _wait(lambda p=path: cgroups._fs.procs(p) == [])
                os.rmdir(path)
        os.rmdir(delegated)


@pytest.mark.parametrize("quiet", [False, True])
def test_cli_says_which_limits_were_approximated(public_tree: Path, fallback: FallbackRun,
                                                 quiet: bool) -> None:
    # A user without a writable cgroup (the fallback fixture makes sure uid 65534 is one):
    # without this line, a MemoryError from RLIMIT_AS looks like the program's own bug.
    require(os.geteuid() == 0, "needs root to drop to an unprivileged uid without a cgroup")
    def nsbox_run(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
             "--clear-groups", "--", PYTHON, "-I", "-c",
             "import sys; sys.path.insert(0, sys.argv.pop(1)); from nsbox.cli.fast import main; "
             "main()", str(public_tree), "run", *options,
             "--memory", "64M", "--", "python3", "-c", "b = bytearray(256 << 20)"],
            capture_output=True, text=True, cwd="/", timeout=60)

    proc = nsbox_run(*(["--quiet"] if quiet else []))
    assert proc.returncode == 1 and "MemoryError" in proc.stderr
    notices = [line for line in proc.stderr.splitlines()
               if line.startswith("nsbox: limits approximated on this host: ")]
    if quiet:
        assert notices == []
    else:
        # One short line naming each weaker limit once; the detail stays in the Result.
        (notice,) = notices
        assert notice == ("nsbox: limits approximated on this host: cpu_time, memory, pids "
                          "(`nsbox doctor` says why and how to enforce them; --quiet hides "
                          "this line)")
        assert len(notice) < 160
        # The JSON keeps each limit's fallback and reason.
        detail = json.loads(nsbox_run("--json").stdout)["degraded"]
        assert [entry.split(":", 1)[0] for entry in detail] == ["cpu_time", "memory", "pids"]
        assert detail[1].startswith("memory: RLIMIT_AS per process only (address space")


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--time", "-1", "'-1' is negative: a duration is more than 0"),
    ("--memory", "-64M", "'-64M' is negative: a size is 0 or more"),
])
def test_cli_says_a_negative_value_is_negative(option: str, value: str, said: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "nsbox", "run", option, value, "--", "true"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 2
    assert said in proc.stderr
