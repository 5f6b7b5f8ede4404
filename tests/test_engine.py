"""The launch engine (nsbox/native/engine.c, nsbox/host/engine.py): real sandboxes through it.

Each test asks for the engine (NSBOX_ENGINE=1) and checks that the launch went through it
(``engine.client.sent``, or the sandbox's pid 1, a copy of the engine, named ``nsbox-engine``), then
the outcome the Python helper gives for the same launch: statuses, signals, the kills of the
deadline and of the limits with nothing left alive (pids, cgroups), the output cap, a full
/tmp, many launches at once, and that a broken request or a dead caller costs one launch only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from conftest import REPO, Runner, parent_of, processes_with, require

import nsbox
from nsbox import Policy, cgroups
from nsbox.cgroups import naming
from nsbox.errors import CommandNotFound, NsboxError
from nsbox.host import engine
from nsbox.launch import launcher
from nsbox.policy.policy import Network
from nsbox.result import Status

M = 1 << 20
PYTHON = "/usr/bin/python3"


@pytest.fixture(autouse=True)
def use_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    require(os.access(engine.PATH, os.X_OK), f"the launch engine is not built ({engine.PATH})")
    monkeypatch.setenv("NSBOX_ENGINE", "1")
    monkeypatch.delenv("NSBOX_NATIVE", raising=False)


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _bases() -> list[str]:
    info = cgroups.describe_host()
    bases = list(info.get("cgroups", {}).values()) + [info.get("unified"), info.get("cgroup")]
    return sorted({b for b in bases if b})


def _engine_cgroups() -> list[str]:
    """Run cgroups whose owner is an engine of this test process."""
    found = []
    for base in _bases():
        for name in os.listdir(base):
            parsed = naming.parse(name)
            path = os.path.join(base, name)
            # Not the Python helper's spares (made ahead, holding nothing but their spawner).
            if (parsed and parent_of(parsed[1]) == os.getpid()
                    and not naming.is_idle_spare(name, cgroups._fs.procs(path))):
                found.append(path)
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique word on the sandbox's command line; afterwards no process may carry it and no
    run cgroup the engine made during the test may be left. One an earlier test of another
    file left (a busy cgroup is reclaimed by name by a later launch) is not this test's."""
    word = f"7{uuid.uuid4().int % 10**8}"
    before = set(_engine_cgroups())
    yield word
    assert _wait(lambda: processes_with(word) == []), processes_with(word)
    assert _wait(lambda: set(_engine_cgroups()) <= before, timeout=5), _engine_cgroups()


def run(argv: list[str], policy: Policy | None = None, **kwargs: object) -> nsbox.Result:
    before = engine.client.sent
    result = nsbox.run(argv, policy, **kwargs)  # type: ignore[arg-type]
    assert engine.client.sent == before + 1, "the launch did not go through the engine"
    return result


def py(code: str, *args: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code), *args]


@pytest.mark.cgroup2
def test_exit_codes_output_and_stdin() -> None:
    assert run(["/bin/true"]).status is Status.OK
    result = run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"in\n")
    assert (result.status, result.exit_code) == (Status.RE, 3)
    assert (result.stdout, result.stderr) == (b"in\n", b"err\n")
    assert result.extra["core"] == "native"
    assert result.accounting in ("cgroup", "rusage")


def test_the_sandbox_runs_as_the_python_helper_makes_it(sandbox: Runner) -> None:
    # Also as an unprivileged uid (through tests/_driver.py, which passes NSBOX_ENGINE on):
    # pid 1 is a copy of the engine, named as its argv says, never a host path.
    result = sandbox.run(["sh", "-c", "tr '\\0' ' ' < /proc/1/cmdline; echo; id -u; "
                          "grep SigIgn /proc/self/status; cat /proc/self/uid_map"])
    assert result.status is Status.OK, result
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "nsbox-engine 3 "
    assert lines[1] == "1000"
    # Nothing the engine ignores (SIGINT, SIGPIPE) reaches the command.
    assert lines[2].split() == ["SigIgn:", "0000000000000000"]
    assert lines[3].split()[:1] == ["1000"]


def test_a_signal_death_is_reported_as_such() -> None:
    result = run(["sh", "-c", "kill -TERM $$"])
    assert (result.status, result.signal, result.exit_code) == (Status.SG, signal.SIGTERM, None)


def test_a_missing_command_is_a_setup_error() -> None:
    with pytest.raises(CommandNotFound) as caught:
        run(["no-such-command-here"])
    assert caught.value.step == "exec"


@pytest.mark.cgroup2
def test_the_deadline_kills_every_process(marker: str) -> None:
    started = time.monotonic()
    result = run(["sh", "-c", f"sleep {marker} & sleep {marker}; echo late"], timeout=0.5)
    assert result.status is Status.TO and result.timed_out
    assert result.stdout == b""
    assert time.monotonic() - started < 30
    assert parent_of(result.extra["pid"]) is None  # pid 1 reaped; the marker fixture: the rest


@pytest.mark.cgroup2
def test_the_memory_limit_ends_the_run_ml(marker: str) -> None:
    backend = cgroups.detect()
    require(cgroups.MEMORY in backend.supports(), f"no memory cgroup here: {backend.reason}")
    result = run(py("b = bytearray(256 << 20); print('survived')", marker),
                 Policy().with_limits(memory=48 * M), timeout=60)
    assert result.status is Status.ML and result.oom_killed
    assert result.signal == signal.SIGKILL and b"survived" not in result.stdout
    assert result.accounting == "cgroup" and result.degraded == []
    assert 16 * M < result.peak_memory <= 48 * M


@pytest.mark.cgroup2
def test_the_cpu_time_limit_ends_the_run_to(marker: str) -> None:
    backend = cgroups.detect()
    require(cgroups.CPU_ACCOUNTING in backend.supports(), f"no cpu accounting: {backend.reason}")
    result = run(py("while True: pass", marker), Policy().with_limits(cpu_time=0.5),
                 timeout=60)
    assert result.status is Status.TO and result.extra["limit"] == "cpu_time"
    assert result.accounting == "cgroup" and result.signal == signal.SIGKILL


@pytest.mark.cgroup2
def test_the_pids_limit_holds(marker: str) -> None:
    backend = cgroups.detect()
    require(cgroups.PIDS in backend.supports(), f"no pids cgroup here: {backend.reason}")
    result = run(["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do sleep {marker} & done; wait"],
                 Policy().with_limits(pids=4), timeout=5)
    assert b"fork" in result.stderr.lower() or b"resource" in result.stderr.lower(), result
    assert result.peak_pids is not None and result.peak_pids <= 4


def test_the_output_limit_kills_the_run_ol() -> None:
    result = run(["yes"], output_limit=10_000, timeout=30)
    assert result.status is Status.OL and result.stdout_truncated
    assert len(result.stdout) == 10_000


def test_a_full_tmp_is_named() -> None:
    fill = "dd if=/dev/zero of=/tmp/fill bs=64K count=4000 status=none"
    result = run(["sh", "-c", fill])
    assert (result.status, result.exit_code, result.disk_full) == (Status.RE, 1, ["/tmp"])
    assert run(["sh", "-c", "head -c 1M /dev/zero > /tmp/x"]).disk_full == []


def test_many_launches_at_once_from_threads() -> None:
    results: dict[int, nsbox.Result] = {}

    def launch(n: int) -> None:
        results[n] = nsbox.run(["sh", "-c", f"sleep 0.2; echo {n}"], timeout=60)

    before, left_before = engine.client.sent, set(_engine_cgroups())
    threads = [threading.Thread(target=launch, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert engine.client.sent == before + 12
    assert {n: (r.status, r.stdout) for n, r in results.items()} == {
        n: (Status.OK, f"{n}\n".encode()) for n in range(12)}
    assert _wait(lambda: set(_engine_cgroups()) <= left_before, timeout=5), _engine_cgroups()


def _request(message: bytes, fds: list[int]) -> bytes:
    """Send ``message`` to the running engine with a launch socket first; its answer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with engine.client._lock:
            assert engine.client._sock is not None
            socket.send_fds(engine.client._sock, [message], [theirs.fileno(), *fds])
        theirs.close()
        ours.settimeout(10)
        return ours.recv(65536)


def test_malformed_requests_fail_alone() -> None:
    assert run(["/bin/true"]).status is Status.OK  # the engine is running
    pid = engine.client.pid
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        answers = [
            _request(b"garbage", [null, null, null]),
            _request(b"i" + (1).to_bytes(8, "little") + b"s\xff\xff\xff\x7f", [null] * 3),
            _request(b'{"memfd": 99999999999}', [null, null, null, null]),
            _request(b"", []),
        ]
    finally:
        os.close(null)
    for answer in answers:
        assert b'"setup_error"' in answer and b'"step": "engine"' in answer, answer
    assert run(["sh", "-c", "echo alive"]).stdout == b"alive\n"
    assert engine.client.pid == pid


def test_a_dead_caller_takes_its_sandbox_and_engine_with_it(marker: str) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import nsbox
        from nsbox.host import engine
        print("go", flush=True)
        nsbox.run(["sleep", {marker!r}], timeout=600)
    """)
    env = {**os.environ, "NSBOX_ENGINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
        assert _wait(lambda: any(
            open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sleep\0")
            for p in processes_with(marker)), timeout=30)
        engines = [p for p in processes_with("nsbox-engine") if parent_of(p) == proc.pid]
        assert len(engines) == 1
    finally:
        proc.kill()
        proc.wait()
    # End-of-file on its control socket: the engine kills the sandbox, removes its cgroup and
    # exits (the marker fixture checks the processes and cgroups).
    assert _wait(lambda: not os.path.exists(f"/proc/{engines[0]}/stat")
                 or open(f"/proc/{engines[0]}/stat").read().rsplit(")", 1)[1].split()[0] == "Z")
    # Its spares too (v1: cgroups made ahead, named for it).
    left = [os.path.join(b, n) for b in _bases() for n in os.listdir(b)
            if (naming.parse(n) or (0, 0))[1] == engines[0]]
    assert left == []


@pytest.mark.cgroup2
def test_the_run_cgroup_is_removed_and_named_for_the_engine(marker: str) -> None:
    backend = cgroups.detect()
    require(bool(backend.supports()), f"no writable cgroup here: {backend.reason}")
    seen: list[str] = []
    left_before = set(_engine_cgroups())  # by an earlier test: not this run's

    def look() -> None:
        # What the one look that found them saw: a second look may come after the run's end.
        def found() -> bool:
            seen.extend(set(_engine_cgroups()) - left_before)
            return bool(seen)

        _wait(found, timeout=30)

    watcher = threading.Thread(target=look)
    watcher.start()
    run(["sh", "-c", f"sleep 1 & exec sleep 1.{marker[:3]}"], timeout=30)
    watcher.join()
    assert seen and all(naming.parse(os.path.basename(p)) for p in seen)
    assert _wait(lambda: set(_engine_cgroups()) <= left_before, timeout=5), _engine_cgroups()


def test_on_cgroup_v1_the_sandbox_is_born_in_a_spare_with_its_limits(marker: str) -> None:
    backend = cgroups.detect()
    require(backend.kind == "v1" and cgroups.PIDS in backend.supports(),
            f"spares are for cgroup v1 with a pids controller: {backend.reason or backend.kind}")
    run(["true"])  # the engine is up; its spares get their spawners meanwhile
    assert _wait(lambda: len([p for p in processes_with("")
                              if naming.is_spawner(p)
                              and parent_of(p) == engine.client.pid]) == 2)
    outcome: dict[str, nsbox.Result] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=run(
        ["sleep", f"0.{marker}"], Policy().with_limits(pids=5), timeout=30)))
    runner.start()
    try:
        assert _wait(lambda: any(open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sleep\0")
                                 for p in processes_with(marker)), timeout=30)
        sleeper = next(p for p in processes_with(marker)
                       if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sleep\0"))
        name = next(os.path.basename(line.split(":", 2)[2])
                    for line in open(f"/proc/{sleeper}/cgroup").read().splitlines()
                    if line.split(":", 2)[1] == "pids")
        parsed = naming.parse(name)
        assert parsed is not None and parsed[1] == engine.client.pid
        assert parsed[3].startswith("s"), name  # a spare's, made ahead
        pids_dir = os.path.join(backend.describe()["cgroups"]["pids"], name)
        assert open(os.path.join(pids_dir, "pids.max")).read().strip() == "5"
        # The spawner has left: the sandbox's init and its command alone.
        assert len(cgroups._fs.procs(pids_dir)) == 2
    finally:
        runner.join()
    assert outcome["result"].status is Status.OK


@pytest.mark.cgroup2
def test_on_cgroup_v2_the_sandbox_is_born_in_its_run_cgroup_with_its_limits(marker: str) -> None:
    backend = cgroups.detect()
    need = {cgroups.MEMORY, cgroups.PIDS, cgroups.CPUS}
    if not cgroups.is_unified(backend):  # this machine is hybrid: CI runs it in the VM
        pytest.skip(f"for a cgroup v2 host (the cgroup2 VM); this one's is {backend.kind}")
    require(need <= backend.supports(), f"no memory, pids and cpu cgroup: {backend.reason}")
    hold_r, hold_w = os.pipe()
    outcome: dict[str, nsbox.Result] = {}
    policy = Policy().with_limits(memory=64 * M, pids=16, cpus=0.5)
    runner = threading.Thread(target=lambda: outcome.update(result=run(
        ["sh", "-c", "read line", marker], policy, stdin=hold_r, timeout=120)))
    runner.start()
    try:
        assert _wait(lambda: processes_with(marker) != [], timeout=60)
        shell = processes_with(marker)[0]
        path = open(f"/proc/{shell}/cgroup").read().strip().split("::", 1)[1]
        parsed = naming.parse(os.path.basename(path))
        assert parsed is not None and parsed[1] == engine.client.pid, path
        assert parsed[3].startswith("r"), path  # the run's own, not a spare (v1 alone has them)
        run_dir = os.path.join(backend.describe()["cgroup"], os.path.basename(path))

        def read(name: str) -> str:
            return open(os.path.join(run_dir, name)).read().strip()

        assert read("memory.max") == str(64 * M) and read("memory.oom.group") == "1"
        if os.path.exists(os.path.join(run_dir, "memory.swap.max")):
            assert read("memory.swap.max") == "0"
        assert (read("pids.max"), read("cpu.max")) == ("16", "50000 100000")
        assert shell in cgroups._fs.procs(run_dir)
    finally:
        os.write(hold_w, b"done\n")
        os.close(hold_w)
        runner.join(120)
        os.close(hold_r)
    result = outcome["result"]
    assert (result.status, result.accounting, result.degraded) == (Status.OK, "cgroup", [])
    assert result.peak_memory and result.peak_pids


def test_launches_the_engine_does_not_take_go_to_the_python_helper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = engine.client.sent
    allow = Policy(network=Network(mode="allow", allow=("127.0.0.1",)))
    assert engine.why_not(launcher.build_plan(allow, ["true"]).to_wire()) == (
        "the allow-list proxy is the Python helper's")
    assert nsbox.run(["/bin/true"], allow).status is Status.OK
    loopback = Policy(network=Network(mode="loopback"))
    assert engine.why_not(launcher.build_plan(loopback, ["true"]).to_wire()) is None
    monkeypatch.setenv("NSBOX_ENGINE", "0")
    assert nsbox.run(["/bin/true"]).status is Status.OK
    monkeypatch.setenv("NSBOX_NATIVE", "0")
    monkeypatch.setenv("NSBOX_ENGINE", "1")
    assert nsbox.run(["/bin/true"]).extra["core"] == "python"
    assert engine.client.sent == before


def test_the_apparmor_profile_lets_the_engine_create_namespaces() -> None:
    from nsbox.doctor.isolation import apparmor_profile

    text = apparmor_profile()
    assert f"profile nsbox_engine {os.path.realpath(engine.PATH)} flags=" in text
    assert "allow pix /** -> &nsbox_engine//&unpriv_nsbox," in text
    assert text.count("  allow userns,\n") == 3  # the helper's, the engine's, unpriv_nsbox's
    if subprocess.run(["which", "apparmor_parser"], capture_output=True).returncode == 0:
        parsed = subprocess.run(["apparmor_parser", "-Q", "-K", "/dev/stdin"], input=text,
                                capture_output=True, text=True, check=False)
        assert parsed.returncode == 0, parsed.stderr


# --- parity: the engine's report is the Python helper's ------------------------------------

SAME = ("status", "exit_code", "signal", "stdout", "stderr", "stdout_truncated",
        "stderr_truncated", "timed_out", "oom_killed", "disk_full", "degraded", "accounting",
        "isolation", "isolation_weaker")
PLANS: list[tuple[str, list[str], dict[str, object]]] = [
    ("ok", ["sh", "-c", "echo out; echo err >&2; ls / | head -3; id"], {}),
    ("exit code", ["sh", "-c", "exit 42"], {}),
    ("signal", ["sh", "-c", "kill -SEGV $$"], {}),
    ("stdin", ["cat"], {"stdin": b"abc" * 1000}),
    ("environment", ["sh", "-c", "env | sort"], {"env": {"A": "1", "B": "x y"}}),
    ("cwd", ["pwd"], {"cwd": "/tmp"}),
    ("timeout", ["sleep", "30"], {"timeout": 0.3}),
    ("output cap", ["yes"], {"output_limit": 5000}),
    ("full tmp", ["sh", "-c", "dd if=/dev/zero of=/tmp/f bs=64K count=4000 status=none"], {}),
    ("memory", [PYTHON, "-c", "b = bytearray(256 << 20)"],
     {"policy": Policy().with_limits(memory=48 * M)}),
    ("pids", ["sh", "-c", "for i in 1 2 3 4 5 6; do sleep 0.3 & done; wait; echo done"],
     {"policy": Policy().with_limits(pids=3)}),
    ("no limits", ["true"], {"policy": Policy().with_limits(memory=None, pids=None,
                                                             cpu_time=None)}),
    ("loopback", ["sh", "-c", "cat /proc/net/dev | wc -l"],
     {"policy": Policy(network=Network(mode="loopback"))}),
    ("rlimits", ["sh", "-c", "ulimit -n; ulimit -f"], {"policy": Policy().with_limits(
        open_files=77, file_size=1 << 20)}),
]


def _outcome(engine_on: str, argv: list[str], kwargs: dict[str, object],
             monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv("NSBOX_ENGINE", engine_on)
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", None)
    before = engine.client.sent
    try:
        result = nsbox.run(argv, policy, **kwargs)  # type: ignore[arg-type]
    except NsboxError as exc:
        outcome: object = (type(exc).__name__, getattr(exc, "step", None),
                           getattr(exc, "errno", None), str(exc))
    else:
        outcome = {name: getattr(result, name) for name in SAME}
        outcome["peak_pids"] = result.peak_pids is not None
        outcome["peak_memory"] = result.peak_memory > 0
        outcome["core"] = result.extra["core"]
        outcome["limit"] = result.extra.get("limit")
    assert engine.client.sent == before + (engine_on == "1")
    return outcome


@pytest.mark.parametrize("name, argv, kwargs", PLANS, ids=[p[0] for p in PLANS])
def test_the_engine_reports_what_the_python_helper_reports(
        name: str, argv: list[str], kwargs: dict[str, object],
        monkeypatch: pytest.MonkeyPatch) -> None:
    helper = _outcome("0", argv, kwargs, monkeypatch)
    assert _outcome("1", argv, kwargs, monkeypatch) == helper


@pytest.mark.parametrize("argv, cwd", [(["no-such-command"], None), (["true"], "/nowhere"),
                                       (["/etc/passwd"], None)])
def test_setup_errors_are_the_python_helpers(argv: list[str], cwd: str | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    helper = _outcome("0", argv, {"cwd": cwd}, monkeypatch)
    assert isinstance(helper, tuple)  # an error, named by its step
    assert _outcome("1", argv, {"cwd": cwd}, monkeypatch) == helper
