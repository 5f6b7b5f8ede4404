"""The cgroup backends on their own: host detection (fake /proc files for other host types) and
the real backend of this host (create, limits, usage, kill, reclaim).

The sandbox-level tests (limits seen through nsbox.run) are in test_limits.py.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require

from nsbox import cgroups
from nsbox.cgroups import naming
from nsbox.cgroups._host import Hierarchy, read_layout
from nsbox.cgroups._v2 import V2Backend, V2Run

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = """\
9:name=systemd:/user.slice/session-2.scope
8:pids:/user.slice/session-2.scope
6:freezer:/
4:memory:/user.slice/session-2.scope
2:cpu,cpuacct:/user.slice
0::/user.slice/session-2.scope
"""


def _fake(tmp_path: Path, mountinfo: str, cgroup: str) -> cgroups._host.Layout:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return read_layout(str(tmp_path / "mountinfo"), str(tmp_path / "cgroup"))


def test_layout_of_a_hybrid_host_with_comounted_cpu_and_cpuacct(tmp_path: Path) -> None:
    layout = _fake(tmp_path, HYBRID_MOUNTINFO, HYBRID_CGROUP)
    assert layout.kind == "hybrid"
    assert sorted(layout.v1) == ["cpu", "cpuacct", "freezer", "memory", "pids"]
    assert layout.v1["cpu"] == layout.v1["cpuacct"]
    assert layout.v1["cpu"].own_dir == "/sys/fs/cgroup/cpu,cpuacct/user.slice"
    assert layout.v1["memory"].own_dir == "/sys/fs/cgroup/memory/user.slice/session-2.scope"
    assert layout.v1["freezer"].own_dir == "/sys/fs/cgroup/freezer"
    assert layout.unified is not None
    assert layout.unified.own_dir == "/sys/fs/cgroup/unified/user.slice/session-2.scope"


def test_layout_of_a_pure_v2_host(tmp_path: Path) -> None:
    layout = _fake(
        tmp_path,
        "25 22 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "0::/system.slice/agent.service\n",
    )
    assert layout.kind == "v2" and not layout.v1
    assert layout.unified is not None
    assert layout.unified.own_dir == "/sys/fs/cgroup/system.slice/agent.service"


def test_layout_inside_a_container_that_mounts_only_its_subtree(tmp_path: Path) -> None:
    # The mount's root is the container's cgroup; our path below it is what is left.
    layout = _fake(
        tmp_path,
        "25 22 0:23 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "0::/docker/abc/worker\n",
    )
    assert layout.unified is not None
    assert layout.unified.own_dir == "/sys/fs/cgroup/worker"


def test_layout_without_cgroups_falls_back_to_the_null_backend(tmp_path: Path) -> None:
    layout = _fake(tmp_path, "22 1 0:21 / /proc rw - proc proc rw\n", "0::/\n")
    assert layout.kind == "none"
    backend = cgroups.detect(layout)
    assert backend.kind == "none"
    assert backend.supports() == frozenset()
    assert "no cgroup filesystem" in backend.reason
    info = cgroups.describe_host(layout)
    assert info["writable"] is False and info["missing"] == sorted(cgroups.ALL_FEATURES)


def test_names_identify_the_owner_and_only_dead_owners_count_as_dead() -> None:
    name = naming.run_name()
    ns, pid, start, kind = naming.parse(name)  # type: ignore[misc]
    assert pid == os.getpid() and kind.startswith("r")
    assert not naming.owner_is_dead(name)
    # Same pid, other start time: the pid was reused, the owner is gone.
    assert naming.owner_is_dead(f"nsbox-{ns}-{pid}-{start + 1}-r1")
    # Another pid namespace: not ours to judge.
    assert not naming.owner_is_dead(f"nsbox-{ns + 1}-{pid}-{start + 1}-r1")
    # Other naming schemes are never touched.
    assert naming.parse("nsbox-mine") is None
    assert not naming.owner_is_dead("nsbox-1-2-3")


# --- the real backend of this host ---------------------------------------------------------------


def _backend_or_skip(*features: str) -> cgroups.Backend:
    backend = cgroups.detect()
    missing = sorted(set(features) - backend.supports())
    require(not missing, f"no writable cgroup with {missing} here: {backend.reason}")
    return backend


def _spawn_into(run: cgroups.RunCgroup, code: str) -> subprocess.Popen[bytes]:
    """Start a process that waits on a pipe until it was attached (like the sandbox child)."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.read({read_end}, 1)\n{code}"],
        pass_fds=(read_end,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    os.close(read_end)
    run.attach(proc.pid)
    os.close(write_end)
    return proc


def test_usage_is_read_from_the_figures_files_and_missing_ones_on_older_kernels_are_none(
        tmp_path: Path) -> None:
    # A v2 run's directory on a kernel before 5.19 and 6.1: no memory.peak, no pids.peak.
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 1500000\n"
                                       "system_usec 1000000\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    figures = cgroups.v2_usage_figures(str(tmp_path))
    usage = cgroups.Usage(cpu_user=1.5, cpu_system=1.0, oom_kills=1)
    assert V2Run(str(tmp_path)).usage() == usage
    # The launch engine hands back the raw numbers of the same files, by field.
    raw = {"peak_memory": None, "cpu_user": 1500000, "cpu_system": 1000000, "peak_pids": None,
           "oom_kills": 1}
    assert sorted(f.field for f in figures) == sorted(raw)
    assert cgroups.usage_from(figures, raw) == usage
    assert V2Run(str(tmp_path)).cpu_seconds() == 2.5
    # v1 without cpuacct: the CPU time comes from the cgroup2 core's cpu.stat.
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "memory.max_usage_in_bytes").write_text("1048576\n")
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    v1 = cgroups.v1_usage_figures({"memory": str(memory)}, str(tmp_path))
    assert cgroups.usage_from(v1, {f.field: f.read() for f in v1}) == cgroups.Usage(
        peak_memory=1 << 20, cpu_user=1.5, cpu_system=1.0, oom_kills=2)


@pytest.mark.cgroup2
def test_memory_hog_is_oom_killed_at_the_limit_and_counted() -> None:
    backend = _backend_or_skip(cgroups.MEMORY)
    run = backend.create(cgroups.Request(memory=48 << 20, pids=32))
    try:
        proc = _spawn_into(run, "x = bytearray(200 << 20); print('survived')")
        out, _ = proc.communicate(timeout=60)
        usage = run.usage()
    finally:
        run.destroy()
    assert proc.returncode == -signal.SIGKILL and b"survived" not in out
    assert usage.oom_kills >= 1
    assert usage.peak_memory is not None and usage.peak_memory <= 48 << 20


@pytest.mark.cgroup2
def test_destroy_kills_everything_inside_and_removes_the_cgroup() -> None:
    backend = _backend_or_skip(cgroups.KILL)
    run = backend.create(cgroups.Request(pids=32))
    # A process that forks a grandchild which leaves its session: only the cgroup still knows it.
    proc = _spawn_into(run, textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(300)
        time.sleep(300)
    """))
    assert cgroups._fs.wait_until(lambda: len(run.pids()) == 2)
    pids = run.pids()
    run.destroy()
    proc.wait(timeout=10)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    assert not [d for d in _run_dirs(backend, run.name) if os.path.exists(d)]
    run.destroy()  # idempotent


def test_v1_without_the_cgroup2_core_kills_through_the_freezer() -> None:
    """A v1-only host has no cgroup.kill: the same backend, told there is no cgroup2 mount,
    freezes the run, SIGKILLs every pid and thaws it."""
    from nsbox.cgroups._v1 import V1Backend

    layout = read_layout()
    backend = V1Backend(layout.v1, None)
    require({cgroups.PIDS, cgroups.KILL} <= backend.supports() and "freezer" in backend.bases,
            f"no writable v1 pids and freezer cgroups here: {backend.reason or layout.kind}")
    run = backend.create(cgroups.Request(pids=32))
    proc = _spawn_into(run, textwrap.dedent("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                break
        time.sleep(300)
    """))
    assert cgroups._fs.wait_until(lambda: len(run.pids()) == 4)
    pids = run.pids()
    run.destroy()
    proc.wait(timeout=10)
    assert all(_zombie(pid) for pid in pids)
    assert not [d for d in run._all if os.path.exists(d)]  # type: ignore[attr-defined]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _run_dirs(backend: cgroups.Backend, name: str) -> list[str]:
    info = backend.describe()
    bases = list(info.get("cgroups", {}).values()) + [info.get("unified"), info.get("cgroup")]
    return [os.path.join(b, name) for b in bases if b]


@pytest.mark.cgroup2
def test_a_dead_owners_cgroup_is_reclaimed_with_its_processes() -> None:
    backend = _backend_or_skip(cgroups.KILL)
    # The owner creates a run cgroup, puts a sleeper into it, reports both, and is SIGKILLed.
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import subprocess, sys, time
            from nsbox import cgroups
            run = cgroups.detect().create(cgroups.Request(pids=8))
            sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
            run.attach(sleeper.pid)
            print(run.name, sleeper.pid, flush=True)
            time.sleep(300)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    assert owner.stdout is not None
    name, sleeper = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    dirs = _run_dirs(backend, name)
    assert any(os.path.isdir(d) for d in dirs)
    # Another live owner's cgroup must survive the reclaim.
    mine = backend.create(cgroups.Request(pids=8))
    try:
        reclaimed = backend.reclaim()
        assert name in reclaimed and mine.name not in reclaimed
        assert all(os.path.isdir(d) for d in _run_dirs(backend, mine.name))
    finally:
        mine.destroy()
    assert not any(os.path.exists(d) for d in dirs)
    time.sleep(0)  # the sleeper was reparented to init, which reaps it
    assert cgroups._fs.wait_until(lambda: _zombie(int(sleeper)))


def _exhausting_descriptors() -> list[int]:
    """Descriptors opened until this process may open no more (under a soft limit of 256,
    put back by the caller); the caller closes them."""
    held = []
    while True:
        try:
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
            return held


@pytest.mark.cgroup2
def test_a_process_out_of_descriptors_reclaims_no_live_owners_cgroup() -> None:
    # Unreadable is not gone: a first run that found /proc/PID/stat unopenable (EMFILE) took
    # every live owner for dead and SIGKILLed the sandboxes of other threads and processes.
    backend = _backend_or_skip(cgroups.KILL)
    mine = backend.create(cgroups.Request(pids=8))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = _exhausting_descriptors()
    try:
        dead_while_full = naming.owner_is_dead(mine.name)
        reclaimed = backend.reclaim()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert dead_while_full is False
        assert mine.name not in reclaimed
        assert all(os.path.isdir(d) for d in _run_dirs(backend, mine.name))
    finally:
        mine.destroy()


def test_unprivileged_user_without_delegation_gets_the_null_backend_and_a_reason(
        public_tree: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged uid")
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
         "from nsbox import cgroups; print(json.dumps(cgroups.describe_host()))",
         str(public_tree)],
        user=65534, group=65534, extra_groups=[], capture_output=True, text=True, check=True,
        cwd="/",
    ).stdout
    import json

    info = json.loads(out)
    backend = cgroups.detect()
    if info["writable"]:
        pytest.skip(f"uid 65534 can write cgroups here: {info}")
    assert backend.kind != "none"  # root can, so the host has cgroups
    assert info["backend"] == "none" and info["supports"] == []
    assert "65534" in info["reason"]


@pytest.fixture
def app() -> Iterator[str]:
    """An application's own cgroup, below this process's base (cgroup v2 with controllers), as
    a service's; removed with what nsbox made in it once every process in it ended (the
    launch processes end at their sockets' end-of-file, when the process that started them
    exited)."""
    backend = cgroups.detect()
    if backend.kind != "v2":
        pytest.skip(f"needs cgroup v2 with controllers (this host: {backend.kind})")
    app = os.path.join(backend.describe()["cgroup"], f"nsbox-test-app-{os.getpid()}")
    os.mkdir(app)
    try:
        yield app
    finally:
        for name in os.listdir(app):
            if name.startswith("nsbox-") and os.path.isdir(os.path.join(app, name)):
                assert cgroups._fs.wait_until(lambda n=name: not cgroups._fs.procs(
                    os.path.join(app, n)))
                os.rmdir(os.path.join(app, name))
        assert cgroups._fs.wait_until(lambda: not cgroups._fs.procs(app))
        os.rmdir(app)


@pytest.mark.cgroup2
@pytest.mark.needs_host("cgroup v2 with controllers (runs in the VM)")
def test_v2_moves_only_its_own_processes_into_a_leaf_to_enable_controllers(app: str) -> None:
    owner_code = textwrap.dedent("""
        import os, sys
        from nsbox import cgroups
        os.read(0, 1)  # wait until the test moved us into the app cgroup
        try:
            run = cgroups.detect().create(cgroups.Request(memory=32 << 20, pids=8))
        except OSError as exc:
            print("refused", exc, flush=True)
            sys.exit(0)
        print("created", run.name, open("/proc/self/cgroup").read().strip(), flush=True)
        run.destroy()
    """)
    other = subprocess.Popen(["sleep", "60"])
    try:
        # 1. The app cgroup holds a process that is not nsbox's: nothing is moved, a clear error.
        cgroups._fs.write(os.path.join(app, "cgroup.procs"), other.pid)
        unified = read_layout().unified
        assert unified is not None
        seen_from_app = V2Backend(Hierarchy(2, (), unified.mount_point,
                                            "/" + os.path.relpath(app, unified.mount_point)))
        assert seen_from_app.describe()["blocking_processes"] == [other.pid]  # for doctor
        owner = subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        cgroups._fs.write(os.path.join(app, "cgroup.procs"), owner.pid)
        out, _ = owner.communicate("x", timeout=60)
        assert out.startswith("refused") and "no-internal-processes" in out, out
        assert str(other.pid) in out
        assert cgroups._fs.procs(app) == [other.pid]
        # 2. Only the owner (and its parent, not in there) in the app cgroup: it moves into a leaf.
        other.kill()
        other.wait()
        owner = subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        cgroups._fs.write(os.path.join(app, "cgroup.procs"), owner.pid)
        out, _ = owner.communicate("x", timeout=60)
        assert out.startswith("created"), out
        assert out.strip().endswith("-leaf"), out  # /proc/self/cgroup of the owner
        assert "memory" in cgroups._fs.read(os.path.join(app, "cgroup.subtree_control"))
    finally:
        other.kill()
        other.wait()


@pytest.mark.cgroup2
@pytest.mark.needs_host("cgroup v2 with controllers (runs in the VM)")
def test_v2_a_helper_run_after_the_engine_started_moves_both_and_is_limited(
        app: str) -> None:
    """The engine and the helper both live, started by runs without limits (no cgroup setup),
    then a run with limits through the helper: the host moves itself and both launch processes
    into its leaf. (The helper alone would take the engine for a stranger: nothing limited.)"""
    owner_code = textwrap.dedent("""
        import json, os, sys
        import nsbox
        from nsbox.host import engine
        from nsbox.launch import launcher
        os.read(0, 1)  # wait until the test moved us into the app cgroup
        free = nsbox.Policy().with_limits(memory=None, pids=None, cpu_time=None)
        os.environ["NSBOX_ENGINE"] = "1"
        assert nsbox.run(["true"], free).ok
        os.environ["NSBOX_ENGINE"] = "0"
        assert nsbox.run(["true"], free).ok
        helper, eng = launcher.helper_client.pid, engine.client.pid
        assert helper and eng, (helper, eng)
        procs = os.path.join(sys.argv[1], "cgroup.procs")
        before = sorted(int(p) for p in open(procs).read().split())
        result = nsbox.run(["true"], nsbox.Policy().with_limits(memory=64 << 20, pids=32))
        print(json.dumps({"before": before, "ours": sorted([os.getpid(), helper, eng]),
                          "degraded": result.degraded, "accounting": result.accounting,
                          "peak_pids": result.peak_pids,
                          "cgroup": open("/proc/self/cgroup").read().strip()}), flush=True)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code, app], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        cgroups._fs.write(os.path.join(app, "cgroup.procs"), owner.pid)
        out, _ = owner.communicate("x", timeout=120)
        assert owner.returncode == 0, out
        seen = json.loads(out)
        assert seen["before"] == seen["ours"]  # all three were in the app cgroup
        assert seen["degraded"] == [] and seen["accounting"] == "cgroup", seen
        assert seen["peak_pids"], seen
        assert seen["cgroup"].endswith("-leaf"), seen
        leaf = [n for n in os.listdir(app) if n.endswith("-leaf")]
        assert len(leaf) == 1 and cgroups._fs.procs(app) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()


def test_a_spawner_that_cannot_enter_its_cgroup_stops_the_spawners_and_says_why(
        tmp_path: Path) -> None:
    """The real spawner process, on a cgroup directory that is not there: the kernel's ENOENT
    comes back as the reason, the spawner is reaped, and no more are made (launches attach)."""
    import selectors
    import socket

    from nsbox.cgroups._null import NullBackend
    from nsbox.cgroups._v1 import V1Run
    from nsbox.helper import spawner as _spawner

    cgroup = V1Run("nsbox-test", {"memory": str(tmp_path / "gone")}, None)

    class Helper:  # the part of the launch helper that Spawners uses
        selector = selectors.DefaultSelector()

    spawners = _spawner.Spawners(Helper(), NullBackend("test"), None)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        _spawner.serve(None, theirs, cgroup)  # type: ignore[arg-type]  # never returns
    theirs.close()
    spawner = _spawner.Spawner(pid, ours, cgroup)
    spawners.idle.append(spawner)
    Helper.selector.register(ours, selectors.EVENT_READ)
    spawners.on_message(spawner)
    assert "cgroup.procs" in spawners.broken and "No such file" in spawners.broken
    assert spawners.idle == []
    with pytest.raises(ChildProcessError):  # reaped already
        os.waitpid(pid, os.WNOHANG)
    spawners.fill()
    assert spawners.idle == []
