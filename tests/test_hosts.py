"""The host matrix: on each kind of host CI can build, doctor's verdict per guarantee equals what
real runs with a memory, a pids and a CPU-time limit then report, and every refusal has a hint.

Each row runs one fresh Python process (the package copy every uid can read, see conftest) with
a prefix that makes the host: another uid, a private mount namespace with the cgroup mounts
read-only, a bounding set without CAP_SYS_ADMIN. The host's own mounts and settings never change.
The pure cgroup v2 rows run in the VM (marker cgroup2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import require

from nsbox.cgroups import _fs, describe_host, get_backend
from nsbox.cgroups._host import read_layout
from nsbox.cgroups._v2 import V2Backend

# Runs doctor, then one run per limit, and prints what each reported as one JSON object.
ROW = r"""
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import nsbox
from nsbox.doctor import run_doctor, verdicts_of_run
from nsbox.errors import NsboxError
from nsbox.policy.policy import MiB
from nsbox.profiles import load_profile

policy = load_profile("default")
out = {"doctor": run_doctor(policy=policy).to_dict(), "runs": {}}
cases = {
    "memory": (["python3", "-c", "b = bytearray(200 * 2**20)"], {"memory": 64 * MiB}),
    # More children than the limit allows: the shell's fork fails.
    "pids": (["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do sleep 3 & done; wait"],
             {"pids": 6}),
    "cpu_time": (["python3", "-c", "while True: pass"], {"cpu_time": 1.0}),
}
for limit, (argv, change) in cases.items():
    fields = {"memory": None, "pids": None, "cpu_time": None, "wall_time": 20.0, **change}
    limits = dataclasses.replace(policy.limits, **fields)
    trial = dataclasses.replace(policy, limits=limits)
    try:
        result = nsbox.run(argv, trial)
    except NsboxError as exc:
        out["runs"][limit] = {"error": type(exc).__name__, "message": str(exc),
                              "hint": exc.hint, "verdicts": verdicts_of_run(exc, trial, (limit,))}
        continue
    out["runs"][limit] = {"status": result.status.value, "degraded": result.degraded,
                          "stderr": result.stderr.decode(errors="replace")[-300:],
                          "verdicts": verdicts_of_run(result, trial, (limit,))}
print(json.dumps(out))
"""

SETPRIV = shutil.which("setpriv")
UNSHARE = shutil.which("unshare")
# Inside a private mount namespace only: every cgroup mount read-only, as in a container.
READ_ONLY_CGROUPS = r"""
set -e
mount --make-rprivate /
for m in $(awk '$9 == "cgroup" || $9 == "cgroup2" {print $5}' /proc/self/mountinfo); do
    mount -o remount,bind,ro "$m"
done
exec "$@"
"""

# Root of a new user namespace that maps host ids 0-65535 and allows no nested one: user
# namespaces disabled for everything started in it, the host's own setting untouched (the
# limit is per user namespace, user_namespaces(7)). argv: the package tree, then the command.
USERNS_DISABLED = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from nsbox._sys import libc as _libc
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    _libc.unshare(_libc.CLONE_NEWUSER)
    os.read(read, 1)  # the maps are written
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.execv(sys.argv[2], sys.argv[2:])
for _ in range(100):  # until the child is in its own user namespace
    if os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"):
        break
    time.sleep(0.01)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write("0 0 65536")
os.write(write, b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""

# A seccomp filter around nsbox that refuses new user namespaces, as a container's default
# profile does: unshare and clone with CLONE_NEWUSER get EPERM, clone3 ENOSYS (its flags cannot
# be inspected). argv: the package tree (for pyseccomp), then the command.
SECCOMP_NO_USERNS = r"""
import errno, os, sys
sys.path.insert(0, sys.argv[1])
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
f.add_rule(sc.ERRNO(errno.EPERM), "unshare")
f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
f.load()
os.execv(sys.argv[2], sys.argv[2:])
"""


def run_row(prefix: list[str], tree: Path) -> dict[str, Any]:
    done = subprocess.run([*prefix, "/usr/bin/python3", "-I", "-c", ROW, str(tree)],
                          capture_output=True, text=True, timeout=300, cwd="/",
                          env={"PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return data


def check_row(data: dict[str, Any]) -> dict[str, str]:
    """Doctor's verdicts equal the runs'; each limit does what its verdict says; every refusal
    and every failed check carries a remedy. Returns doctor's verdicts."""
    doctor = data["doctor"]
    guarantees: dict[str, str] = doctor["guarantees"]
    checks = {c["name"]: c for c in doctor["checks"]}
    for check in doctor["checks"]:
        if check["status"] in ("warn", "fail"):
            assert check["remedy"], check
    # The live launch agreed with the prediction of the checks.
    assert checks["live launch"]["status"] in ("ok", "fail"), checks["live launch"]
    for limit, run in data["runs"].items():
        for name, verdict in run["verdicts"].items():
            assert guarantees[name] == verdict, (limit, name, guarantees, run)
        if "error" in run:
            assert run["hint"], run
            continue
        if run["verdicts"][limit] == "cgroup":
            assert not run["degraded"], run
        else:
            assert run["degraded"] and run["degraded"][0].startswith(f"{limit}:"), run
    memory, pids, cpu = (data["runs"][k] for k in ("memory", "pids", "cpu_time"))
    if "status" in memory:
        # A cgroup memory limit is ML; RLIMIT_AS makes the allocation fail inside (RE).
        assert memory["status"] == ("ML" if guarantees["memory"] == "cgroup" else "RE"), memory
    if "status" in pids:
        assert pids["status"] == "RE" and "fork" in pids["stderr"].lower(), pids
    if "status" in cpu:
        assert cpu["status"] == "TO", cpu
    return guarantees


def test_this_host_as_caller(public_tree: Path) -> None:
    guarantees = check_row(run_row([], public_tree))
    assert guarantees["namespaces"] == "enforced"
    info = describe_host()
    assert (guarantees["memory"] == "cgroup") == ("memory" in info["supports"])


def test_this_host_as_uid_65534(public_tree: Path) -> None:
    require(os.geteuid() == 0 and bool(SETPRIV), "needs root and setpriv to drop to uid 65534")
    assert SETPRIV
    check_row(run_row([SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups"],
                      public_tree))


def test_read_only_cgroupfs(public_tree: Path, tmp_path: Path) -> None:
    require(os.geteuid() == 0 and bool(UNSHARE), "needs root and unshare for a mount namespace")
    assert UNSHARE
    script = tmp_path / "ro.sh"
    script.write_text(READ_ONLY_CGROUPS)
    data = run_row([UNSHARE, "-m", "sh", str(script)], public_tree)
    guarantees = check_row(data)
    assert [guarantees[k] for k in ("memory", "pids", "cpus", "cpu_time")] == [
        "rlimit", "rlimit", "none", "rlimit"]
    cgroups = {c["name"]: c for c in data["doctor"]["checks"]}["cgroups"]
    assert cgroups["status"] == "warn"
    assert "read-only" in cgroups["detail"]
    assert cgroups["remedy"].startswith("the cgroup filesystem is mounted read-only")
    assert cgroups["facts"]["read_only"] is True


def test_without_cap_sys_admin(public_tree: Path) -> None:
    require(os.geteuid() == 0 and bool(SETPRIV), "needs root and setpriv to drop a capability")
    assert SETPRIV
    # Dropped from the bounding set, root's exec gets no CAP_SYS_ADMIN (capabilities(7)).
    prefix = [SETPRIV, "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"]
    probe = subprocess.run([*prefix, "grep", "CapEff", "/proc/self/status"],
                           capture_output=True, text=True, check=True)
    assert not int(probe.stdout.split()[1], 16) & (1 << 21)  # CAP_SYS_ADMIN is bit 21
    guarantees = check_row(run_row(prefix, public_tree))
    assert guarantees["namespaces"] in ("enforced", "refused")


def test_root_of_a_user_namespace_that_maps_only_itself(public_tree: Path) -> None:
    """`unshare -Ur`: uid 0 that maps only to the caller's uid has no unprivileged id for the
    sandbox (nsbox/policy/identity.py): doctor and every run refuse, each with a hint."""
    require(bool(UNSHARE), "needs unshare(1)")
    assert UNSHARE
    data = run_row([UNSHARE, "-Ur"], public_tree)
    guarantees = check_row(data)
    assert set(guarantees.values()) == {"refused"}, guarantees
    checks = {c["name"]: c for c in data["doctor"]["checks"]}
    assert checks["identity"]["status"] == "fail" and checks["identity"]["remedy"]
    assert checks["live launch"]["status"] == "fail" and checks["live launch"]["remedy"]
    assert {run["error"] for run in data["runs"].values()} == {"HostError"}


def test_user_namespaces_disabled(public_tree: Path, tmp_path: Path) -> None:
    require(os.geteuid() == 0, "needs root to map a range of ids into a user namespace")
    script = tmp_path / "userns.py"
    script.write_text(USERNS_DISABLED)
    data = run_row(["/usr/bin/python3", "-I", str(script), str(public_tree)], public_tree)
    guarantees = check_row(data)
    # The default policy's isolation is "auto": the runs get the Landlock mode, and doctor
    # says so, with the setting that gives them namespaces (tests/test_landlock.py).
    assert (guarantees["isolation"], guarantees["namespaces"]) == ("landlock", "none")
    checks = {c["name"]: c for c in data["doctor"]["checks"]}
    assert checks["user namespaces"]["status"] == "warn"
    assert checks["user namespaces"]["detail"].startswith(
        "user namespaces are disabled (user.max_user_namespaces is 0)")
    assert checks["isolation"]["remedy"].startswith("sysctl -w user.max_user_namespaces=15000")
    assert checks["live launch"]["status"] == "ok"


def test_seccomp_refusing_namespaces(public_tree: Path, tmp_path: Path) -> None:
    require(os.geteuid() == 0, "the hint names the filter only for root, who may unshare")
    script = tmp_path / "seccomp.py"
    script.write_text(SECCOMP_NO_USERNS)
    data = run_row(["/usr/bin/python3", "-I", str(script), str(public_tree)], public_tree)
    guarantees = check_row(data)
    # "auto": the Landlock mode, as in a container (tests/test_landlock.py).
    assert (guarantees["isolation"], guarantees["namespaces"]) == ("landlock", "none")
    checks = {c["name"]: c for c in data["doctor"]["checks"]}
    assert checks["live launch"]["status"] == "ok"
    assert checks["live probe"]["remedy"].endswith(
        "refuses unshare(2): run the container with --security-opt seccomp=unconfined")
    assert "--security-opt seccomp=unconfined" in checks["isolation"]["remedy"]


def test_masked_proc(public_tree: Path) -> None:
    """Parts of /proc covered, as a container masks them, in a private mount namespace only."""
    require(os.geteuid() == 0 and bool(UNSHARE), "needs root and unshare for a mount namespace")
    assert UNSHARE
    masked = [p for p in ("/proc/keys", "/proc/timer_list", "/proc/kcore") if os.path.isfile(p)]
    require(bool(masked), "this /proc has none of the files a container masks")
    mask = ("mount --make-rprivate / && mount --bind /dev/null " + masked[0]
            + ' && exec "$@"')
    data = run_row([UNSHARE, "-m", "sh", "-c", mask, "sh"], public_tree)
    guarantees = check_row(data)
    assert set(guarantees.values()) == {"refused"}, guarantees
    checks = {c["name"]: c for c in data["doctor"]["checks"]}
    assert checks["/proc mounts"]["status"] == "fail"
    assert checks["live launch"]["facts"]["step"] == "proc /proc"
    for hint in [checks["live launch"]["remedy"], *(r["hint"] for r in data["runs"].values())]:
        assert hint.startswith("the kernel refuses a new /proc while parts of this /proc are "
                               "covered"), hint
        assert hint.endswith("--security-opt systempaths=unconfined"), hint


def test_a_fresh_proc_over_a_masked_one(public_tree: Path) -> None:
    """A container's entrypoint that mounts a proc of its own on /proc (over one with masked
    parts): doctor agrees with the kernel, which admits a new proc in a user namespace then."""
    require(os.geteuid() == 0 and bool(UNSHARE), "needs root and unshare for a mount namespace")
    assert UNSHARE
    masked = [p for p in ("/proc/keys", "/proc/timer_list", "/proc/kcore") if os.path.isfile(p)]
    require(bool(masked), "this /proc has none of the files a container masks")
    stacked = ("mount --make-rprivate / && mount --bind /dev/null " + masked[0]
               + ' && mount -t proc proc /proc && exec "$@"')
    data = run_row([UNSHARE, "-m", "sh", "-c", stacked, "sh"], public_tree)
    check_row(data)
    checks = {c["name"]: c for c in data["doctor"]["checks"]}
    assert "/proc mounts" not in checks
    assert checks["live launch"]["status"] == "ok", checks["live launch"]
    assert data["doctor"]["ok"]


@pytest.mark.cgroup2
@pytest.mark.needs_host("a pure cgroup v2 host as root (runs in the VM)")
def test_v2_cgroup_shared_with_other_processes(public_tree: Path) -> None:
    """A service-like cgroup that also holds a process that is not nsbox's: doctor says every
    limit is an rlimit, names the process, and the runs agree."""
    info = describe_host()
    if info["layout"] != "v2" or os.geteuid() != 0:
        pytest.skip(f"needs a pure cgroup v2 host as root (this host: {info['layout']}, "
                    f"uid {os.geteuid()}); .ci/run runs it in the VM")
    # The controllers enabled in this process's base, as a first run would (moving this process
    # into a leaf when its cgroup is not the root), so the test cgroup below it has them.
    backend = get_backend()
    assert isinstance(backend, V2Backend), backend.reason
    backend.prepare()
    base = Path(backend.base) / "nsbox-test-svc"
    base.mkdir()
    other = subprocess.Popen(["sleep", "300"])
    try:
        (base / "cgroup.procs").write_text(str(other.pid))
        enter = f'echo $$ > {base}/cgroup.procs && exec "$@"'
        data = run_row(["sh", "-c", enter, "sh"], public_tree)
        guarantees = check_row(data)
        assert [guarantees[k] for k in ("memory", "pids", "cpus", "cpu_time")] == [
            "rlimit", "rlimit", "none", "rlimit"]
        cgroups = {c["name"]: c for c in data["doctor"]["checks"]}["cgroups"]
        assert cgroups["status"] == "warn"
        assert other.pid in cgroups["facts"]["blocking_processes"]
        assert f"share nsbox's cgroup {base}" in cgroups["remedy"]
    finally:
        other.kill()
        other.wait()

        # An exited process leaves its cgroup a moment after it was reaped.
        def empty() -> bool:
            return "populated 0" in (base / "cgroup.events").read_text()

        assert _fs.wait_until(empty), (base / "cgroup.procs").read_text()
        for leaf in base.iterdir():
            if leaf.is_dir():
                leaf.rmdir()
        base.rmdir()


DROP_TO_65534 = [SETPRIV or "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
LIMIT_GUARANTEES = ("memory", "pids", "cpus", "cpu_time")


def _require_pure_v2_root() -> V2Backend:
    """This process's backend on a pure cgroup v2 host as root, its controllers enabled for the
    children of its base (as a first run would enable them); skips elsewhere."""
    info = describe_host()
    if info["layout"] != "v2" or os.geteuid() != 0 or not SETPRIV:
        pytest.skip(f"needs a pure cgroup v2 host as root, and setpriv (this host: "
                    f"{info['layout']}, uid {os.geteuid()}); .ci/run runs it in the VM")
    backend = get_backend()
    assert isinstance(backend, V2Backend), backend.reason
    backend.prepare()
    return backend


def _remove_tree(top: Path) -> None:
    """Remove a test cgroup and the cgroups nsbox left below it (an emptied leaf), deepest
    first, once their last process has left (a moment after it was reaped)."""
    def empty() -> bool:
        return "populated 0" in (top / "cgroup.events").read_text()

    assert _fs.wait_until(empty), (top / "cgroup.procs").read_text()
    for directory in sorted((p for p in top.rglob("*") if p.is_dir()),
                            key=lambda p: len(p.parts), reverse=True):
        directory.rmdir()
    top.rmdir()


@pytest.mark.cgroup2
@pytest.mark.needs_host("a pure cgroup v2 host as root (runs in the VM)")
def test_v2_user_without_delegation(public_tree: Path) -> None:
    """uid 65534 in a cgroup it cannot write: every limit is an rlimit, the runs agree, and
    doctor names the cgroup that root would delegate."""
    _require_pure_v2_root()
    layout = read_layout()
    assert layout.unified is not None
    own = layout.unified.own_dir  # the row's process starts in this process's cgroup
    data = run_row(DROP_TO_65534, public_tree)
    guarantees = check_row(data)
    assert [guarantees[k] for k in LIMIT_GUARANTEES] == ["rlimit", "rlimit", "none", "rlimit"]
    cgroups = {c["name"]: c for c in data["doctor"]["checks"]}["cgroups"]
    assert cgroups["status"] == "warn"
    assert "not writable by uid 65534 (no delegation)" in cgroups["detail"]
    # No systemd user manager in the VM: root delegates by hand, the commands name the cgroup.
    assert cgroups["remedy"].startswith("no systemd user manager runs here")
    assert f"mkdir {own}/nsbox && chown 65534 {own}/nsbox {own}/nsbox/cgroup.procs" in (
        cgroups["remedy"])


@pytest.mark.cgroup2
@pytest.mark.needs_host("a pure cgroup v2 host as root (runs in the VM)")
def test_v2_user_with_delegation(public_tree: Path) -> None:
    """root delegates a cgroup to uid 65534 (cgroup-v2.rst, "Delegation": the directory, its
    cgroup.procs, cgroup.subtree_control and cgroup.threads), and the user starts from a shell
    moved into it: doctor says cgroup for every limit, and the runs are limited by it."""
    backend = _require_pure_v2_root()
    delegated = Path(backend.base) / "nsbox-test-delegated"
    delegated.mkdir()
    try:
        for name in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
            os.chown(delegated / name, 65534, 65534)
        enter = f'echo $$ > {delegated}/cgroup.procs && exec "$@"'
        data = run_row(["sh", "-c", enter, "sh", *DROP_TO_65534], public_tree)
        guarantees = check_row(data)
        assert [guarantees[k] for k in LIMIT_GUARANTEES] == ["cgroup"] * 4
        cgroups = {c["name"]: c for c in data["doctor"]["checks"]}["cgroups"]
        assert (cgroups["status"], cgroups["detail"]) == (
            "ok", "v2 layout; backend v2: cpu_accounting, cpus, kill, memory, pids")
        assert cgroups["facts"]["cgroup"] == str(delegated)
        runs = data["runs"]
        assert [runs[k]["status"] for k in ("memory", "pids", "cpu_time")] == ["ML", "RE", "TO"]
    finally:
        _remove_tree(delegated)
