"""The warm pool, the command line's fast path, a short leak soak and the bench's smoke run.

Counts and contents only: timings belong in bench/, never in asserts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, processes_with

import nsbox
from nsbox.errors import LaunchError, PolicyError, SetupError
from nsbox.launch import launcher
from nsbox.result import Status


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def helper_children(helper: int | None = None, sandboxes_only: bool = True) -> list[int]:
    """The live (non-zombie) children of a launch helper (default: this process's). Only those
    in a pid namespace of their own, its sandboxes, unless ``sandboxes_only`` is False: then its
    spawners too (nsbox/helper/spawner.py)."""
    from nsbox.bench.soak import children_of

    helper = helper if helper is not None else launcher.helper_client.pid
    found = []
    for pid, state in children_of({helper}):
        try:
            # NSpid in /proc/PID/status (proc(5)), one pid per nested pid namespace: readable
            # by any user, where /proc/PID/ns/pid of a sandbox that is not dumpable is not.
            if state == "Z" or sandboxes_only and _pid_depth(pid) <= _pid_depth(helper):
                continue
        except OSError:
            continue
        found.append(pid)
    return found


def _pid_depth(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return len(line.split()) - 1
    raise OSError(f"no NSpid line for {pid}")


# --- the pool ----------------------------------------------------------------------------------


def test_pool_runs_commands_with_their_own_stdio_env_and_status():
    with nsbox.Pool(size=2) as pool:
        first = pool.run(["sh", "-c", "cat; echo $GREETING; echo err >&2; exit 3"],
                         stdin=b"in\n", env={"GREETING": "hello"})
        second = pool.run(["sh", "-c", "echo $GREETING; pwd"], cwd="/tmp")
    assert (first.status, first.exit_code) == (Status.RE, 3)
    assert first.stdout == b"in\nhello\n"
    assert first.stderr == b"err\n"
    assert second.stdout == b"\n/tmp\n"  # nothing of the first command's env
    assert second.ok


def test_pooled_sandbox_is_whole_pid1_without_capabilities_under_seccomp():
    with nsbox.Pool(size=1) as pool:
        result = pool.run(["sh", "-c", "echo $$; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' "
                           "/proc/self/status; ls /"])
    lines = result.stdout.decode().split("\n")
    assert lines[0] == "2"  # the command, child of the sandbox's init
    status = dict(line.split(":\t") for line in lines[1:5])
    assert status["CapEff"] == status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"  # filter mode: the command's program is loaded
    assert "workspace" in lines[5:]


def test_no_state_passes_between_pooled_launches():
    marker = f"6{uuid.uuid4().int % 10**8}"
    with nsbox.Pool(size=1) as pool:
        first = pool.run(["sh", "-c", "echo secret > /tmp/left; echo secret > /workspace/left; "
                          f"(setsid sleep {marker} &); hostname changed 2>/dev/null; echo ok"])
        assert first.stdout == b"ok\n"
        assert processes_with(marker) == []  # dead before the next launch is even asked for
        # The processes as the shell's builtins read them from /proc (a minimal system has no
        # ps): only the new sandbox's init and this shell.
        second = pool.run(["sh", "-c", "ls -A /tmp /workspace; hostname; "
                           "for f in /proc/[0-9]*/comm; do read -r c < $f; echo $c; done"])
    assert second.stdout.decode().split() == [
        "/tmp:", "/workspace:", "nsbox", "nsbox-init", "sh"]


def test_each_pooled_launch_is_a_new_sandbox():
    with nsbox.Pool(size=2) as pool:
        namespaces = [pool.run(["readlink", "/proc/self/ns/mnt", "/proc/self/ns/pid",
                                "/proc/self/ns/net"]).stdout for _ in range(4)]
    assert len(set(namespaces)) == 4


def test_pool_timeout_counts_from_the_command_not_the_preparation():
    with nsbox.Pool(size=1) as pool:
        pool.wait_ready()
        time.sleep(1.2)  # longer than the limit below: the prepared sandbox just waits
        quick = pool.run(["true"], timeout=1.0)
        slow = pool.run(["sleep", "30"], timeout=0.5)
    assert quick.status is Status.OK
    assert slow.status is Status.TO


def test_pool_with_a_bad_policy_fails_at_once_or_on_first_use():
    with pytest.raises(PolicyError):
        nsbox.Pool(nsbox.Policy(mounts=(nsbox.Tmpfs("relative/path"),)))
    bad = nsbox.Policy(mounts=(*nsbox.Policy().mounts, nsbox.Bind("/etc/hostname", "/usr/x")))
    with nsbox.Pool(bad, size=1) as pool:
        with pytest.raises(SetupError) as info:
            pool.wait_ready()
        assert info.value.step == "bind /usr/x"
        with pytest.raises(SetupError) as again:
            pool.run(["true"])
        assert again.value.step == "bind /usr/x"


def test_closed_pool_refuses_and_leaves_no_sandbox():
    # A sandbox of an earlier test may still be on its way out of the helper (killed, not yet
    # reaped): counted as the pool's, it made 4 of 3 once. One that stays is a leak, failed here.
    assert wait_until(lambda: not launcher.helper_client.pid or helper_children() == [])
    pool = nsbox.Pool(size=3)
    pool.wait_ready()
    assert len(helper_children()) == 3
    pool.close()
    assert wait_until(lambda: helper_children() == [])
    with pytest.raises(LaunchError):
        pool.run(["true"])


def test_pooled_sandboxes_die_with_a_killed_host(public_tree: Path):
    marker = f"5{uuid.uuid4().int % 10**8}"
    code = (
        f"import sys, os; sys.path.insert(0, {str(public_tree)!r}); import nsbox\n"
        "pool = nsbox.Pool(size=3); pool.wait_ready()\n"
        "from nsbox.launch import launcher; print(launcher.helper_client.pid, flush=True)\n"
        f"pool.run(['sleep', '{marker}'])\n"
    )
    host = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True)
    helper = int(host.stdout.readline())
    assert wait_until(lambda: processes_with(marker) != [])

    # The running command and two prepared sandboxes (the pool prepares the second one after
    # the command took the first: it may still be on its way).
    assert wait_until(lambda: len(helper_children(helper)) == 3)
    host.send_signal(signal.SIGKILL)
    host.wait()
    host.stdout.close()
    assert wait_until(lambda: processes_with(marker) == []
                      and helper_children(helper, sandboxes_only=False) == [])
    assert wait_until(lambda: not os.path.exists(f"/proc/{helper}"))


def test_concurrent_commands_on_a_small_pool():
    import threading

    outputs: dict[int, bytes] = {}
    with nsbox.Pool(size=1) as pool:

        def worker(n: int) -> None:
            outputs[n] = pool.run(["echo", str(n)]).stdout

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert outputs == {n: f"{n}\n".encode() for n in range(6)}


def test_pooled_command_is_what_the_plan_would_say(monkeypatch: pytest.MonkeyPatch):
    from nsbox.launch.pool import COMMAND_KEYS
    from nsbox.plan import plan as planmod

    monkeypatch.setenv("NSBOX_TEST_PASSED", "yes")
    policy = nsbox.Policy(env_passthrough=("NSBOX_TEST_PASSED",), env=(("A", "1"),)).with_limits(
        wall_time=7.0, open_files=99, file_size=12345)
    with nsbox.Pool(policy, size=1) as pool:
        for argv, env, cwd, timeout in ((["ls", "-l"], None, None, None),
                                        (["env"], {"B": "2"}, "/tmp", 3.0)):
            wire = planmod.build(policy, argv, env=env, cwd=cwd, wall_time=timeout).to_wire()
            assert pool._command(argv, env, cwd, timeout) == {k: wire.get(k)
                                                              for k in COMMAND_KEYS}
        with pytest.raises(PolicyError):
            pool.run([])


def test_pooled_command_runs_under_the_pools_cgroup_limits():
    from nsbox import cgroups

    if not cgroups.get_backend().supports():
        pytest.skip("no writable cgroup here: the limits are rlimits only (tests/test_limits.py)")
    policy = nsbox.Policy().with_limits(memory=48 * 1024 * 1024)
    hog = "x = bytearray(200 * 1024 * 1024); x[::4096] = b'a' * len(x[::4096])"
    with nsbox.Pool(policy, size=1) as pool:
        result = pool.run([PYTHON, "-c", hog], timeout=30)
    assert result.status is Status.ML
    assert result.oom_killed
    assert result.accounting == "cgroup"


def test_pool_refuses_network_allow_mode():
    policy = nsbox.Policy(network=nsbox.Network(mode="allow", allow=("example.org",)))
    with pytest.raises(PolicyError, match="network allow mode"):
        nsbox.Pool(policy)


# --- tracing -----------------------------------------------------------------------------------


def test_trace_names_every_step_in_order(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NSBOX_TRACE", "1")
    # The Python helper's steps: the launch engine's own do not appear in a trace.
    monkeypatch.setenv("NSBOX_ENGINE", "0")
    result = nsbox.run(["true"])
    steps = [step["step"] for step in result.extra["trace"]]
    for name in ("host: build plan", "helper: clone", "mount tmpfs root", "bind /usr", "dev /dev",
                 "proc /proc", "pivot_root", "drop capabilities", "seccomp", "exec",
                 "helper: reaped", "host: done"):
        assert name in steps, name
    assert steps.index("pivot_root") < steps.index("seccomp") < steps.index("exec")
    assert all(step["ms"] >= 0 for step in result.extra["trace"])
    monkeypatch.delenv("NSBOX_TRACE")
    assert "trace" not in nsbox.run(["true"]).extra


# --- the command line (its option table: tests/test_cli_options.py) ----------------------------


def nsbox_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True,
                          text=True, timeout=60, cwd="/", env={**env, "PYTHONPATH": str(REPO)})


def test_cli_fast_path_does_not_import_click_or_pyseccomp(tmp_path: Path):
    probe = (
        "import sys, atexit\n"
        f"sys.argv = ['nsbox', 'run', '--', 'true']\n"
        "def report():\n"
        f"    open({str(tmp_path / 'mods')!r}, 'w').write(' '.join(sorted(sys.modules)))\n"
        "atexit.register(report)\n"
        "from nsbox.cli.fast import main\n"
        "main()\n"
    )
    # The default profile's seccomp programs come with the package (docs/seccomp.md), for
    # every caller: no disk cache, no compile.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr
    modules = (tmp_path / "mods").read_text().split()
    assert "nsbox.launch.launcher" in modules
    # (ctypes is on the way: the socket scan's inotify watches, nsbox/host/socketscan.py.)
    # (hashlib is on the way too: the engine's report is read with the Python child's reader,
    # whose module imports the project file code.)
    for heavy in ("click", "pyseccomp", "platform", "pathlib", "tomllib"):
        assert heavy not in modules, heavy
    assert not (tmp_path / "cache").exists()


def test_cli_launches_through_the_public_run(tmp_path: Path):
    """The command line's launch is nsbox.run's, the API's (so a new launch core serves both),
    and it starts no launch helper of its own before it."""
    probe = (
        "import sys, json\n"
        "sys.argv = ['nsbox', 'run', '--time', '7', '--', 'true']\n"
        "from nsbox.launch import launcher\n"
        "calls = []\n"
        "real = launcher.launch\n"
        "import gc\n"
        "def spy(cmd, *args, **kwargs):\n"
        "    calls.append([cmd.argv, kwargs.get('passthrough'), launcher.helper_client.pid,\n"
        "                  gc.isenabled()])\n"
        "    return real(cmd, *args, **kwargs)\n"
        "launcher.launch = spy\n"
        "from nsbox.cli.fast import main\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        f"    open({str(tmp_path / 'calls')!r}, 'w').write(json.dumps(calls))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin",
                                                    "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    # Garbage collection, off while the command line imports, is on again for the launch.
    assert json.loads((tmp_path / "calls").read_text()) == [[["true"], True, 0, True]]


def test_cli_commands_other_than_run_collect_garbage_as_usual():
    """The fast path starts with the collector off; a long-lived command (nsbox mcp) must not
    run that way: everything that goes to click has it on."""
    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('collecting', gc.isenabled()))\n"
             "sys.argv = ['nsbox', '--version']\n"
             "from nsbox.cli.fast import main\n"
             "main()\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin",
                                                    "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "collecting True"


def test_cli_both_doors_give_the_same_result():
    fast = nsbox_cli("run", "--time", "5", "--json", "-e", "A=1", "--", "sh", "-c",
                     "echo $A; exit 4")
    # The fast path does not take "-t5": the same line goes through click.
    slow = nsbox_cli("run", "-t5", "--json", "-e", "A=1", "--", "sh", "-c", "echo $A; exit 4")
    assert fast.returncode == slow.returncode == 4, (fast.stderr, slow.stderr)
    assert json.loads(fast.stdout)["stdout"] == json.loads(slow.stdout)["stdout"] == "1\n"


def test_cli_help_version_and_other_commands_go_to_click():
    helped = nsbox_cli("run", "--help")
    assert helped.returncode == 0
    assert "Usage:" in helped.stdout and "--output-limit" in helped.stdout
    version = nsbox_cli("--version")
    assert version.returncode == 0
    assert nsbox.__version__ in version.stdout


def test_cli_fast_path_errors_match_click():
    bad_env = nsbox_cli("run", "-e", "novalue", "--", "true")
    assert bad_env.returncode == 2
    assert "Invalid value for --env: 'novalue': expected KEY=VAL" in bad_env.stderr
    missing = nsbox_cli("run", "--", "no-such-program-here")
    assert missing.returncode == 127
    assert "exec: command not found inside the sandbox" in missing.stderr


# --- leaks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_size", [0, 2])
def test_short_soak_leaves_nothing_behind(pool_size: int):
    # In a process of its own, so that nothing else of the test session moves the counts.
    code = (
        "import json, sys\n"
        "from nsbox.bench.soak import soak\n"
        f"print(json.dumps(soak(['true'], 200, warmup=20, pool_size={pool_size})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["launches"] == 200
    assert report["left_behind"] == {}, report
    for key in ("host_mounts", "cgroups_below_ours", "fds_launcher", "fds_helper"):
        assert report["delta"][key] <= 0, (key, report)
    assert report["after"]["zombies"] == 0
    assert report["after"]["children_left"] == 0


def test_soak_sees_the_cgroup_of_a_running_sandbox():
    import threading

    from nsbox import cgroups
    from nsbox.bench.soak import snapshot

    if not cgroups.get_backend().supports():
        pytest.skip("no writable cgroup here: runs get none, so there is nothing to count")
    nsbox.run(["true"])
    assert snapshot()["cgroups_below_ours"] == 0
    runner = threading.Thread(target=nsbox.run, args=(["sleep", "1"],))
    runner.start()
    try:
        assert wait_until(lambda: snapshot()["cgroups_below_ours"] > 0, 5.0)
    finally:
        runner.join()
    assert wait_until(lambda: snapshot()["cgroups_below_ours"] == 0, 5.0)


# --- the bench ---------------------------------------------------------------------------------


def test_bench_quick_writes_valid_json(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--rounds", "2", "--soak", "20",
         "--seconds", "0.2", "--cpu-launches", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report_path] = tmp_path.glob("bench-*.json")
    report = json.loads(report_path.read_text())
    rows = report["latency"]["/bin/true"]
    for name in ("subprocess", "nsbox API cold", "nsbox pool", "nsbox CLI"):
        assert rows[name]["n"] == 2
        assert rows[name]["p10_ms"] <= rows[name]["median_ms"] <= rows[name]["p90_ms"]
    assert report["soak"]["launches"] == 20
    assert report["soak"]["left_behind"] == {}
    # The cold launch is the engine's: its trace has the host's and the child's steps only.
    assert {s["step"] for s in report["breakdown"]["cold"]["steps"]} >= {"host: build plan", "exec"}
    assert report["cpu"]["nsbox API cold"]["launches"] == 4
    assert set(report["throughput"]["nsbox API cold"]) >= {"1", "2", "4"}
    assert report["memory"]["launch_processes"], report["memory"]
    assert report["memory"]["run_peak"]["/bin/true"]["max_kib"] > 0
    assert set(report["targets"]) == {"api_cold_x_bwrap", "pool_x_bwrap", "cli_x_bwrap",
                                      "throughput_2_x_bwrap", "cpu_x_bwrap_seccomp", "soak"}
    assert "targets: each a ratio to the peer of the same run" in proc.stdout
    assert not re.search(r"issue|#\d", proc.stdout + json.dumps(report["targets"]), re.I)
    if "bwrap" not in report["skipped"]:
        # Each nsbox row has its ratio to the peer doing the same work, from the same run.
        assert set(rows["nsbox API cold"]["x_peers"]) >= {"bwrap+seccomp"}
        assert report["targets"]["pool_x_bwrap"]["met"] in (True, False)
        assert set(report["throughput"]["nsbox API cold"]) >= {"x_bwrap_1", "x_bwrap_2",
                                                               "x_bwrap_4"}
    if "bwrap+seccomp+cgroup" in rows:
        # The caller-made cgroups of that row are removed after every launch.
        from nsbox.bench.soak import _cgroup_dirs

        left = [name for top in _cgroup_dirs() for _root, dirs, _files in os.walk(top)
                for name in dirs if name.startswith("bench-bwrap-")]
        assert left == []


def _meter(name: str, launches: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "nsbox.bench.meter", name, str(launches), "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_cpu_meter_reaps_the_pid_1_bwrap_leaves_behind():
    """bwrap's monitor exits before the sandbox's pid 1 is reaped: the meter, a subreaper,
    gets each one and counts it; nsbox reaps its own, through the launch process it keeps."""
    import shutil

    from conftest import require

    require(shutil.which("bwrap") is not None, "bubblewrap not installed")
    bwrap = _meter("bwrap", 4)
    assert (bwrap["orphans"], bwrap["kept"]) == (4, 0), bwrap
    assert bwrap["exact"] > bwrap["host"] > 0
    ours = _meter("nsbox API cold", 4)
    assert ours["orphans"] == 0 and ours["kept"] >= 1, ours


def test_bench_cpu_splits_the_cpu_of_a_launch_by_process():
    proc = subprocess.run([sys.executable, "-m", "nsbox.bench.cpu", "60"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("nsbox")]
    assert [line.split(":")[0] for line in lines] == ["nsbox  x1", "nsbox  x2"]
    for line in lines:
        figures = dict(re.findall(r"(machine|host|helper|its children) +([0-9.]+)", line))
        assert set(figures) == {"machine", "host", "helper", "its children"}, line
        # Every launch costs the helper and its children something: a zero is a broken count.
        assert float(figures["helper"]) > 0 and float(figures["its children"]) > 0, line
