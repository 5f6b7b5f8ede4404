"""nsbox as the executor of a Ray cluster: a local cluster of two nodes on this machine.

The nodes are small (one CPU each, 200 MB of object store) because other test suites share the
machine. Attacks run inside jobs and are checked from the host, as in test_core.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import processes_with, require

import nsbox
from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, MiB

# Every test here starts or uses a Ray cluster: processes that the fast tier must not leave.
pytestmark = pytest.mark.sandbox

# Every Ray process of the test cluster binds and dials 127.0.0.1 only: with this switch off,
# Ray takes the loopback address as the node's address (ray._private.services) instead of the
# machine's interface address. Read when Ray is imported, and inherited by its processes.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

try:
    import ray
    from ray.cluster_utils import Cluster

    from nsbox import ray as nsray
except ImportError:  # skipped locally, a failure in CI (see require)
    ray = None

NODE = {"num_cpus": 1, "object_store_memory": 200 * 1024 * 1024}


def start_cluster() -> Cluster:
    require(ray is not None, "Ray is not installed: pip install -e '.[ray]'")
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    cluster.wait_for_nodes()
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


class LocalCluster:
    """The module's cluster: started on first use, again after a test stopped it."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    def up(self) -> LocalCluster:
        if self.cluster is None:
            self.cluster = start_cluster()
        return self

    def down(self) -> None:
        if self.cluster is not None:
            stop_cluster(self.cluster)
            self.cluster = None


@pytest.fixture(scope="module")
def local() -> Iterator[LocalCluster]:
    local = LocalCluster()
    yield local
    local.down()


@pytest.fixture
def cluster(local: LocalCluster) -> LocalCluster:
    return local.up()


@pytest.fixture
def executors(cluster: LocalCluster) -> Iterator[nsray.Executors]:
    with nsray.Executors(pool_size=2) as executors:
        yield executors


def node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


# --- without Ray -------------------------------------------------------------------------------


def test_core_imports_without_ray_and_the_error_names_the_extra():
    code = (
        "import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
        "import nsbox; assert nsbox.run(['true']).ok\n"
        "try:\n"
        "    import nsbox.ray\n"
        "except ImportError as e: print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "nsbox.ray needs Ray, which is not installed: pip install 'nsbox[ray]'")


def test_job_arguments_are_checked_on_the_callers_side():
    require(ray is not None, "Ray is not installed: pip install -e '.[ray]'")
    with pytest.raises(ValueError, match="either argv or code"):
        nsray.Job.make(["true"], code="pass")
    with pytest.raises(ValueError, match="plain relative path"):
        nsray.Job.make(["true"], files={"../escape": b""})
    with pytest.raises(ValueError, match="no such limit memroy"):
        nsray.Job.make(["true"], limits={"memroy": 1})
    with pytest.raises(ValueError, match="longer than"):
        nsray.Job.make(code="#" * (200 * 1024))


# --- many jobs, both nodes ---------------------------------------------------------------------


def cgroup_memory() -> bool:
    """Whether this user's sandboxes get a memory cgroup here (else RLIMIT_AS stands in)."""
    probe = nsbox.run(["true"], nsbox.Policy().with_limits(memory=64 * MiB))
    return not any(entry.startswith("memory:") for entry in probe.degraded)


def mixed_jobs(n: int, oom_status: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(job, what its result must be) pairs: mostly OK, with RE, TO, SG, OL and ML mixed in."""
    jobs = []
    for i in range(n):
        if i % 45 == 44:  # 200 MB under a limit of 64 MiB
            jobs.append(({"code": "x = bytearray(200 * 2**20)", "limits": {"memory": 64 * MiB}},
                         {"status": oom_status, "stdout": b""}))
        elif i % 50 == 49:
            jobs.append(({"argv": ["sleep", "30"], "timeout": 0.3},
                         {"status": "TO", "timed_out": True, "stdout": b""}))
        elif i % 97 == 96:
            jobs.append(({"argv": ["yes", str(i)], "output_limit": 1000},
                         {"status": "OL", "stdout_truncated": True,
                          "stdout": (f"{i}\n" * 1000).encode()[:1000]}))
        elif i % 61 == 60:  # a fault ends the command with its signal
            jobs.append(({"code": "import ctypes; ctypes.string_at(0)"},
                         {"status": "SG", "signal": signal.SIGSEGV}))
        elif i % 7 == 6:
            jobs.append(({"argv": ["sh", "-c", f"echo {i} >&2; exit {i % 100 + 1}"]},
                         {"status": "RE", "exit_code": i % 100 + 1, "stderr": f"{i}\n".encode()}))
        elif i % 5 == 0:
            jobs.append(({"code": f"print({i} * 2)"},
                         {"status": "OK", "stdout": f"{i * 2}\n".encode()}))
        else:
            jobs.append(({"argv": ["echo", f"job {i}"]},
                         {"status": "OK", "exit_code": 0, "stdout": f"job {i}\n".encode()}))
    return jobs


def test_500_jobs_complete_with_their_results_on_both_nodes(executors: nsray.Executors):
    # Without a memory cgroup the allocation fails with MemoryError instead of an OOM kill.
    oom_status = "ML" if cgroup_memory() else "RE"
    jobs = mixed_jobs(500, oom_status)
    results = list(executors.map((job for job, _ in jobs), max_in_flight=32))
    assert len(results) == 500
    for (job, expected), result in zip(jobs, results, strict=True):
        assert {k: result[k] for k in expected} == expected, (job, result)
        assert result["attempts"] == 1
    statuses = collections.Counter(r["status"] for r in results)
    assert statuses == collections.Counter(expected["status"] for _, expected in jobs)
    assert set(statuses) == {"OK", "RE", "TO", "SG", "OL", oom_status}
    assert {r["node"] for r in results} == node_ids()
    assert len({r["job"] for r in results}) == 500
    # The plain jobs ran in each node's warm sandboxes.
    assert [e["pool"] for e in executors.executors] == [2, 2]


def test_several_executors_per_node(cluster: LocalCluster):
    with nsray.Executors(pool_size=1, per_node=2) as executors:
        per_node = collections.Counter(e["node"] for e in executors.executors)
        assert per_node == {node: 2 for node in node_ids()}
        assert executors.slots == 4
        results = list(executors.map([["echo", str(i)] for i in range(40)], max_in_flight=8))
    assert [r["stdout"] for r in results] == [f"{i}\n".encode() for i in range(40)]
    assert {r["executor"] for r in results} == {e["name"] for e in executors.executors}


def test_map_unordered_yields_each_result_once_as_it_finishes(executors: nsray.Executors):
    # The first job is the slowest: in finishing order it cannot come first.
    jobs = [{"argv": ["sh", "-c", "sleep 1; echo slow"], "id": "slow"}] + [
        {"argv": ["echo", str(i)], "id": f"fast-{i}"} for i in range(20)]
    results = list(executors.map(jobs, ordered=False, max_in_flight=6))
    assert sorted(r["job"] for r in results) == sorted(j["id"] for j in jobs)
    assert results[0]["job"] != "slow"
    assert {r["job"]: r["stdout"] for r in results}["slow"] == b"slow\n"


def test_executor_arguments_are_checked(cluster: LocalCluster):
    with pytest.raises(ValueError, match="per_node must be a positive number or 'cpus', not 0"):
        nsray.Executors(per_node=0)
    with pytest.raises(ValueError, match="pool_size must be at least 1"):
        nsray.Executors(pool_size=0)


def test_results_are_plain_data(executors: nsray.Executors):
    result = ray.get(executors.submit(["sh", "-c", "echo out; echo err >&2; exit 3"]))
    plain = (str, bytes, int, float, bool, type(None))

    def check(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                assert isinstance(key, str)
                check(item)
        elif isinstance(value, list):
            for item in value:
                check(item)
        else:
            assert isinstance(value, plain), (type(value), value)

    check(result)
    assert (result["status"], result["exit_code"]) == ("RE", 3)
    assert (result["stdout"], result["stderr"]) == (b"out\n", b"err\n")


def test_a_job_whose_sandbox_cannot_start_is_an_XX_result(executors: nsray.Executors):
    result = ray.get(executors.submit(["no-such-program-here"]))
    assert result["status"] == "XX"
    assert result["error_type"] == "CommandNotFound"
    assert result["step"] == "exec"
    assert "command not found inside the sandbox: no-such-program-here" in result["error"]


# --- files in and out --------------------------------------------------------------------------


def test_files_in_and_out_as_bytes_with_hashes(executors: nsray.Executors, tmp_path: Path):
    secret = tmp_path / "host-secret"
    secret.write_text("host-" + uuid.uuid4().hex)
    code = (
        "import os\n"
        "data = open('input/data.txt').read()\n"
        "os.makedirs('out', exist_ok=True)\n"
        "open('out/upper.txt', 'w').write(data.upper())\n"
        "open('out/big.bin', 'wb').write(b'x' * 3000)\n"
        f"os.symlink({str(secret)!r}, 'out/link.txt')\n"
        "os.mkfifo('out/fifo.txt')\n"
        "os.link('out/upper.txt', 'out/hard.txt')\n"
        "print('done')\n"
    )
    result = ray.get(executors.submit(code=code, files={"input/data.txt": b"hello"},
                                      collect=["out/*"]))
    assert result["status"] == "OK", result["stderr"]
    assert result["stdout"] == b"done\n"
    files = {f["path"]: f for f in result["files"]}
    assert set(files) == {"out/big.bin"}
    assert files["out/big.bin"]["data"] == b"x" * 3000
    assert files["out/big.bin"]["sha256"] == hashlib.sha256(b"x" * 3000).hexdigest()
    skipped = {s["path"]: s["reason"] for s in result["skipped_files"]}
    assert skipped == {
        "out/fifo.txt": "a FIFO, not a regular file",
        "out/link.txt": "a symlink (not followed)",
        "out/hard.txt": "a hard link (2 names)",
        "out/upper.txt": "a hard link (2 names)",
    }


def test_a_job_with_files_has_a_capped_workspace_and_no_way_out(executors: nsray.Executors,
                                                                 tmp_path: Path):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "file").write_text("host data")
    code = (
        "import errno, os\n"
        f"os.symlink({str(keep / 'file')!r}, 'link')\n"  # a link out: not followed
        "try:\n"
        "    open('fill', 'wb').write(b'x' * 2_000_000)\n"
        "except OSError as e: print(errno.errorcode[e.errno])\n"
    )
    result = ray.get(executors.submit(code=code, collect=["*"], files={"in.txt": b"input"},
                                      limits={"workspace_size": 1024 * 1024}))
    assert result["stdout"] == b"ENOSPC\n", result["stderr"]
    assert result["degraded"] == [] or all("workspace" not in d for d in result["degraded"])
    assert {f["path"] for f in result["files"]} == {"in.txt", "fill"}
    assert {s["path"]: s["reason"] for s in result["skipped_files"]} == {
        "link": "a symlink (not followed)"}
    assert (keep / "file").read_text() == "host data"


def test_collect_caps_size_and_count(cluster: LocalCluster):
    caps = nsray.CopyLimits(max_file_size=100, max_files=3, max_total=150)
    code = ("open('big', 'wb').truncate(10**12)\n"  # sparse: 1 TB that takes no disk
            "for i in range(4): open(f'f{i}', 'wb').write(b'y' * 60)\n"
            "for i in range(2): open(f'g{i}', 'wb').write(b'z')\n")
    # No file-size limit: the 1 TB sparse file must exist, to be refused when collected.
    policy = nsbox.Policy().with_limits(file_size=None)
    with nsray.Executors(policy, copy_limits=caps, per_node=1) as executors:
        result = ray.get(executors.submit(code=code, collect=["*"]))
    assert result["status"] == "OK", result["stderr"]
    assert [(f["path"], f["size"]) for f in result["files"]] == [
        ("f0", 60), ("f1", 60), ("g0", 1)]
    assert {s["path"]: s["reason"] for s in result["skipped_files"]} == {
        "big": "too large: 1000000000000 bytes, the limit is 100",
        "f2": "over the limit of 150 bytes in all", "f3": "over the limit of 150 bytes in all",
        "g1": "over the limit of 3 files"}


# --- the seed attacks, inside jobs -------------------------------------------------------------


def test_seed_attacks_fail_inside_jobs_as_they_do_locally(cluster: LocalCluster, tmp_path: Path):
    canary_env = "canary-" + uuid.uuid4().hex
    canary_dir = tmp_path / "outside"
    canary_dir.mkdir()
    canary_dir.chmod(0o777)
    canary = canary_dir / "canary.txt"
    canary.write_text("original")
    canary.chmod(0o666)
    policy = nsbox.Policy(mounts=(*DEFAULT_MOUNTS, Bind(str(canary_dir), "/ro")))
    with socket.socket() as listener, nsray.Executors(
            policy, actor_options={"runtime_env": {"env_vars": {"NSBOX_CANARY": canary_env}}}
    ) as executors:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # The secret is in every executor's own environment: the jobs run below it.
        for info in executors.executors:
            assert canary_env.encode() in Path(f"/proc/{info['pid']}/environ").read_bytes()
        connect = (
            "import socket,errno\n"
            "s=socket.socket()\n"
            "try:\n"
            f"  s.connect(('127.0.0.1',{port})); print('connected')\n"
            "except OSError as e: print(errno.errorcode[e.errno])\n"
        )
        tamper = (f"echo changed > /ro/canary.txt; rm -f /ro/canary.txt; touch /ro/new; "
                  f"echo changed > {canary}; echo done")
        jobs = []
        for _ in range(4):  # enough to reach both nodes
            # pid 1 (the sandbox's init) is not readable from inside: its denial is no leak.
            jobs += [["sh", "-c", "env; cat /proc/self/environ; cat /proc/1/environ; true"],
                     {"code": connect}, ["sh", "-c", tamper]]
        results = list(executors.map(jobs))
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert {r["node"] for r in results} == node_ids()
    for env, net, files in zip(results[0::3], results[1::3], results[2::3], strict=True):
        assert env["status"] == "OK"
        assert canary_env.encode() not in env["stdout"]
        assert net["stdout"].strip() in (b"ENETUNREACH", b"ECONNREFUSED"), net
        assert files["stdout"] == b"done\n"
        assert b"Read-only file system" in files["stderr"]
    assert canary.read_text() == "original"
    assert sorted(p.name for p in canary_dir.iterdir()) == ["canary.txt"]


def test_jobs_run_in_the_landlock_mode_when_the_policy_asks(cluster: LocalCluster):
    # Without a pool (the mode has none): each job by nsbox.run, or a session to collect files.
    policy = nsbox.Policy(isolation="landlock")
    with nsray.Executors(policy, per_node=1) as executors:
        plain, collected = ray.get([
            executors.submit(code="import os; print(os.getcwd() != '/workspace')"),
            executors.submit(code="open('out.txt', 'w').write('made')", collect=["*.txt"])])
    assert plain["status"] == "OK" and plain["isolation"] == "landlock", plain
    assert plain["stdout"] == b"True\n"
    assert collected["status"] == "OK" and collected["isolation"] == "landlock", collected
    assert [f["path"] for f in collected["files"]] == ["out.txt"]


# --- executors that fail -----------------------------------------------------------------------


def test_killing_an_executor_mid_run_loses_no_job(executors: nsray.Executors):
    jobs = [{"argv": ["sh", "-c", f"sleep 0.2; echo {i}"]} for i in range(60)]
    victim = executors._actors[0]
    victim_pid = executors.executors[0]["pid"]
    results = []
    for i, result in enumerate(executors.map(jobs, max_in_flight=8)):
        results.append(result)
        if i == 10:
            ray.kill(victim, no_restart=False)  # Ray restarts it on its node
    wrong = [(i, {k: r.get(k) for k in ("status", "error", "attempts", "executor", "stderr")})
             for i, r in enumerate(results) if r["stdout"] != f"{i}\n".encode()]
    assert len(results) == 60
    assert wrong == []
    assert all(r["status"] == "OK" for r in results)
    retried = [r for r in results if r["attempts"] == 2]
    assert retried, "no job was running on the killed executor"
    assert {r["executor"] for r in retried} == {executors.executors[0]["name"]}
    assert max(r["attempts"] for r in results) == 2
    info = ray.get(victim.info.remote())
    assert info["pid"] != victim_pid and info["node"] == executors.executors[0]["node"]


def test_jobs_of_an_executor_gone_for_good_run_once_more_elsewhere(executors: nsray.Executors):
    jobs = [{"argv": ["sh", "-c", f"sleep 0.2; echo {i}"]} for i in range(40)]
    victim, survivor = executors.executors
    results = []
    for i, result in enumerate(executors.map(jobs, max_in_flight=8)):
        results.append(result)
        if i == 10:  # as if its node were lost: Ray does not restart it
            ray.kill(executors._actors[0], no_restart=True)
    assert [r["stdout"] for r in results] == [f"{i}\n".encode() for i in range(40)]
    assert all(r["status"] == "OK" for r in results)
    retried = [r for r in results if r["attempts"] == 2]
    assert retried, "no job was running on the lost executor"
    assert {r["executor"] for r in retried} == {survivor["name"]}
    assert {r["executor"] for r in results[20:]} == {survivor["name"]}
    assert [e["name"] for e in executors.executors] == [survivor["name"]]
    assert victim["name"] in {r["executor"] for r in results[:10]}


def test_limits_of_one_job(executors: nsray.Executors):
    fill = ["sh", "-c", "head -c 2000000 /dev/zero > /tmp/fill && echo written"]
    small, default = ray.get([executors.submit(fill, limits={"tmp_size": 1024 * 1024}),
                              executors.submit(fill)])
    assert small["status"] == "RE"
    assert b"No space left on device" in small["stderr"]
    assert (default["status"], default["stdout"]) == ("OK", b"written\n")


def test_a_bad_value_of_one_job_is_its_XX_result_and_the_map_goes_on(
        executors: nsray.Executors):
    """A limit value (or a stdin) the executor refuses is that job's XX result: the other
    jobs of the map still come back, in order."""
    jobs: list[dict[str, Any]] = [{"argv": ["echo", str(n)]} for n in range(4)]
    jobs.insert(1, {"argv": ["true"], "limits": {"pids": 0}})
    jobs.insert(3, {"argv": ["cat"], "stdin": "\ud800"})
    results = list(executors.map(jobs))
    assert [r["status"] for r in results] == ["OK", "XX", "OK", "XX", "OK", "OK"]
    assert [r["stdout"] for r in results if r["status"] == "OK"] == [b"0\n", b"1\n", b"2\n",
                                                                     b"3\n"]
    assert (results[1]["error_type"], results[3]["error_type"]) == ("PolicyError",
                                                                    "PolicyError")
    assert "limits.pids" in results[1]["error"] and "stdin" in results[3]["error"]


def test_ps_and_proc_self_in_every_kind_of_job(executors: nsray.Executors):
    require(os.path.exists("/usr/bin/ps"), "ps is not installed (Debian package procps)")
    # A plain job runs in the warm pool, one with limits by nsbox.run, one with files in a
    # session: in each, /proc is the job's own pid namespace's (ps reads /proc/<its pid>).
    probe = ["sh", "-c", "ps -e -o comm= && python3 -c 'import os; "
             "print(os.readlink(\"/proc/self\") == str(os.getpid()))'"]
    results = ray.get([executors.submit(probe), executors.submit(probe, limits={"pids": 64}),
                       executors.submit(probe, files={"in.txt": b"x"})])
    for result in results:
        assert result["status"] == "OK", result["stderr"]
        assert result["stdout"].split() == [b"nsbox-init", b"sh", b"ps", b"True"], result


def test_a_node_that_cannot_run_the_policy_refuses_to_serve(cluster: LocalCluster):
    policy = nsbox.Policy(mounts=(*DEFAULT_MOUNTS, Bind("/no/such/dir", "/data")))
    with pytest.raises(nsray.NodeRefused) as info:
        nsray.Executors(policy)
    assert "cannot run the sandbox policy 'default'" in str(info.value)
    assert "bind /data: source /no/such/dir does not exist on the host" in str(info.value)
    assert info.value.feature == "sandbox"
    assert str(info.value).startswith(f"node {os.uname().nodename} cannot run")


def test_a_node_whose_doctor_fails_refuses_with_the_doctors_message(cluster: LocalCluster):
    # limits.require_cgroup: no falling back to rlimits; without a writable cgroup (a regular
    # user without delegation) the doctor fails the policy.
    if os.geteuid() == 0:
        pytest.skip("root has writable cgroups on this host: the doctor passes the policy")
    policy = nsbox.Policy().with_limits(require_cgroup=True)
    with pytest.raises(nsray.NodeRefused) as info:
        nsray.Executors(policy)
    assert f"node {os.uname().nodename} cannot run the sandbox policy 'default' safely " \
           "(nsbox doctor): cgroups: " in str(info.value)
    assert f"not writable by uid {os.geteuid()}" in str(info.value)


def test_a_planted_state_directory_makes_the_node_refuse(cluster: LocalCluster,
                                                         tmp_path: Path):
    # Another user of the node could have made the path first, as a link to a place of theirs.
    base = Path(tempfile.gettempdir()) / f"nsbox-ray-{os.geteuid()}"
    if base.is_dir() and not base.is_symlink():
        assert list(base.iterdir()) == [], (
            f"executors left state behind in {base} (or an earlier run was cut short)")
        base.rmdir()
    base.symlink_to(tmp_path)
    try:
        with pytest.raises(nsray.NodeRefused) as info:
            nsray.Executors()
    finally:
        base.unlink()
    assert f"{base} is not a private directory of uid {os.geteuid()}" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_skip_refused_serves_from_the_nodes_that_can(local: LocalCluster, tmp_path: Path):
    # A third node whose temporary directory holds a planted link where the state goes.
    planted = tmp_path / "third-tmp"
    planted.mkdir()
    (planted / f"nsbox-ray-{os.geteuid()}").symlink_to(tmp_path)
    assert local.up().cluster is not None
    try:
        third = local.cluster.add_node(**NODE, env_vars={"TMPDIR": str(planted)}).node_id
        local.cluster.wait_for_nodes()
        with pytest.raises(nsray.NodeRefused, match="is not a private directory"):
            nsray.Executors()  # by default every node must serve
        with nsray.Executors(skip_refused=True) as executors:
            assert list(executors.refused) == [third]
            assert f"{planted}/nsbox-ray-{os.geteuid()} is not a private directory" in \
                executors.refused[third]
            assert {e["node"] for e in executors.executors} == node_ids() - {third}
            results = list(executors.map([["echo", str(i)] for i in range(10)]))
        assert [r["stdout"] for r in results] == [f"{i}\n".encode() for i in range(10)]
        assert third not in {r["node"] for r in results}
        assert [p.name for p in tmp_path.iterdir()] == ["third-tmp"]  # nothing went through
    finally:
        local.down()  # the next test gets the two nodes again


# --- nothing left behind -----------------------------------------------------------------------


def namespaces_in_use(kind: str) -> set[str]:
    """The ``kind`` namespaces (e.g. "mnt") some host process is in, as readlink shows them."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.readlink(f"/proc/{entry}/ns/{kind}"))
            except OSError:
                continue
    return found


def run_cgroup_dirs(pid: int) -> list[str]:
    """The directories of the nsbox run cgroups ``pid`` is in (v1: one per controller)."""
    dirs = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if not os.path.basename(path).startswith("nsbox-"):
            continue
        roots = [f"/sys/fs/cgroup/{c}" for c in controllers.split(",") if c] or [
            "/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        dirs += [root + path for root in roots if os.path.isdir(root + path)]
    return dirs


def sleepers(marker: str) -> list[int]:
    """The sandboxed ``sleep MARKER`` processes (not a process that only names the marker)."""
    found = []
    for pid in processes_with(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def start_sleepers(executors: nsray.Executors, marker: str) -> tuple[set[str], list[str]]:
    """Four jobs that sleep until stopped; their mount namespaces and run cgroup directories."""
    for _ in range(4):
        executors.submit(["sleep", marker], files={"f": b"x"})
    deadline = time.monotonic() + 30
    while len(sleepers(marker)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    sandboxes = sleepers(marker)
    assert len(sandboxes) == 4, "the jobs did not start"
    # Each sandbox's mounts live in its own mount namespace, its limits in run cgroups.
    mount_namespaces = {os.readlink(f"/proc/{pid}/ns/mnt") for pid in sandboxes}
    cgroup_dirs = [d for pid in sandboxes for d in run_cgroup_dirs(pid)]
    assert len(mount_namespaces) == 4
    assert os.readlink("/proc/self/ns/mnt") not in mount_namespaces
    if cgroup_memory():
        assert cgroup_dirs, "the sandboxes run in no cgroup of their own"
    return mount_namespaces, cgroup_dirs


def wait_until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def existing(paths: list[str]) -> list[str]:
    return [path for path in paths if os.path.isdir(path)]


def test_shutdown_in_the_middle_of_jobs_leaves_nothing(cluster: LocalCluster):
    marker = f"4{uuid.uuid4().int % 10**8}"
    executors = nsray.Executors(pool_size=2)
    group = Path(executors.executors[0]["state_dir"]).parent
    mount_namespaces, cgroup_dirs = start_sleepers(executors, marker)
    executors.shutdown()
    wait_until(lambda: not processes_with(marker))
    assert processes_with(marker) == []
    # The namespaces end with the last process in them (a session's init outlives its command).
    wait_until(lambda: not mount_namespaces & namespaces_in_use("mnt"))
    assert not mount_namespaces & namespaces_in_use("mnt")
    assert existing(cgroup_dirs) == []
    assert not group.exists()


def test_nothing_is_left_after_the_cluster_stops_under_the_executors(local: LocalCluster):
    local.up()
    try:
        marker = f"6{uuid.uuid4().int % 10**8}"
        executors = nsray.Executors(pool_size=2)
        group = Path(executors.executors[0]["state_dir"]).parent
        mount_namespaces, cgroup_dirs = start_sleepers(executors, marker)
    finally:
        local.down()  # without a word to the executors
    executors.shutdown()  # nothing left to stop: no error either
    wait_until(lambda: not processes_with(marker))
    assert processes_with(marker) == []
    # The namespaces end with the last process in them (a session's init outlives its command).
    wait_until(lambda: not mount_namespaces & namespaces_in_use("mnt"))
    assert not mount_namespaces & namespaces_in_use("mnt")
    # Ray kills an executor's launch helper with it, maybe before it removed the run cgroups;
    # the next launch on the node reclaims the cgroups of dead owners.
    subprocess.run([sys.executable, "-c", "import nsbox; nsbox.run(['true'])"], check=True,
                   timeout=60)
    assert existing(cgroup_dirs) == []
    # What is left: the group's small state directory, with at most the markers of the jobs
    # cut short (docs/scale-out.md).
    left = [p for p in group.rglob("*") if not p.is_dir()]
    assert len(left) <= 4 and all(p.parent.name == "jobs" for p in left), left
    shutil.rmtree(group)
