"""nsbox doctor: on this real host, and on simulated hosts (fake /proc and /sys trees)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import PYTHON, require

from nsbox.cgroups import describe_host
from nsbox.cgroups._host import read_layout
from nsbox.doctor import Check, Report, run_doctor
from nsbox.doctor.hostfacts import HostFacts
from nsbox.profiles import load_profile

ACTIONS = "kill_process kill_thread trap errno user_notif trace log allow"
UID = 1000  # the simulated unprivileged user


def fake_host(
    tmp: Path, *, release: str = "6.8.0-45-generic", max_userns: str | None = "63000",
    userns_clone: str | None = None, apparmor: str | None = None, seccomp: bool = True,
    actions: str = ACTIONS, cgroups: str = "v2", writable: bool = True,
    controllers: str = "cpuset cpu io memory pids", extra_mounts: list[str] | None = None,
    container: bool = False,
) -> Path:
    """A /proc and /sys tree for one imagined host; the simulated user is uid 1000."""
    root = tmp / "host"

    def put(name: str, text: str) -> None:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    put("proc/sys/kernel/osrelease", release + "\n")
    if max_userns is not None:
        put("proc/sys/user/max_user_namespaces", max_userns + "\n")
    if userns_clone is not None:
        put("proc/sys/kernel/unprivileged_userns_clone", userns_clone + "\n")
    if apparmor is not None:
        put("proc/sys/kernel/apparmor_restrict_unprivileged_userns", apparmor + "\n")
    put("proc/self/status", "Name:\tpython3\n" + ("Seccomp:\t0\nSeccomp_filters:\t0\n"
                                                  if seccomp else "")
        + f"Uid:\t{UID}\t{UID}\t{UID}\t{UID}\nGid:\t{UID}\t{UID}\t{UID}\t{UID}\n"
        "CapEff:\t0000000000000000\n")
    for name in ("uid_map", "gid_map"):  # the initial user namespace
        put(f"proc/self/{name}", "         0          0 4294967295\n")
    if seccomp and actions:
        put("proc/sys/kernel/seccomp/actions_avail", actions + "\n")
    mountinfo = ["22 27 0:21 / /proc rw,relatime - proc proc rw",
                 "23 27 0:22 / /sys rw,relatime - sysfs sysfs rw"]
    own = "/user.slice/user-1000.slice/user@1000.service/app.slice/nsbox.scope"
    lines = []
    if cgroups in ("v2", "hybrid"):
        where = "/sys/fs/cgroup" if cgroups == "v2" else "/sys/fs/cgroup/unified"
        mountinfo.append(f"31 23 0:28 / {where} rw - cgroup2 cgroup2 rw,nsdelegate")
        lines.append(f"0::{own}")
        put(f"{where.lstrip('/')}{own}/cgroup.controllers",
            (controllers if cgroups == "v2" else "") + "\n")
        put(f"{where.lstrip('/')}{own}/cgroup.procs", "")
        put(f"{where.lstrip('/')}{own}/cgroup.subtree_control", "")
    if cgroups in ("v1", "hybrid"):
        for number, controller in enumerate(("memory", "pids", "cpu,cpuacct", "name=systemd")):
            mountinfo.append(f"{40 + number} 23 0:{40 + number} / /sys/fs/cgroup/{controller} "
                             f"rw - cgroup cgroup rw,{controller}")
            lines.append(f"{9 - number}:{controller}:/nsbox")
            put(f"sys/fs/cgroup/{controller}/nsbox/cgroup.procs", "")
    mountinfo += extra_mounts or []
    put("proc/self/mountinfo", "\n".join(mountinfo) + "\n")
    put("proc/self/cgroup", "\n".join(lines) + "\n")
    # Owned by whoever runs the test; the simulated uid 1000 writes only where others may.
    for directory in (root / "sys/fs/cgroup").rglob("*"):
        if directory.is_dir():
            directory.chmod(0o777 if writable else 0o755)
            for name in ("cgroup.procs", "cgroup.subtree_control"):
                if (directory / name).exists():
                    (directory / name).chmod(0o666 if writable else 0o644)
    if container:
        put(".dockerenv", "")
        put("proc/1/cgroup", "0::/docker/4f1c\n")
    return root


def facts(root: Path, uid: int = UID) -> HostFacts:
    return HostFacts(str(root), uid=uid, python=(3, 11, 7), libseccomp="2.5.4")


def by_name(report: Report) -> dict[str, Check]:
    return {check.name: check for check in report.checks}


def test_a_well_equipped_v2_host(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path)))
    checks = by_name(report)
    assert report.ok
    assert {c.name: c.status for c in report.checks} == {
        "python": "ok", "kernel": "ok", "user namespaces": "ok", "identity": "ok",
        "container": "ok", "seccomp": "ok", "libseccomp": "ok", "cgroups": "ok",
        "project workspace": "ok", "live probe": "info", "isolation": "ok"}
    assert checks["isolation"].detail == "runs get namespaces"
    assert report.guarantees["isolation"] == "namespaces"
    assert checks["identity"].detail.startswith(f"the sandbox's user is host uid {UID}, ")
    assert checks["kernel"].detail == "Linux 6.8.0-45-generic"
    # The backend that nsbox.cgroups picks for the simulated host and uid, as a run would.
    assert checks["cgroups"].detail == (
        "v2 layout; backend v2: cpu_accounting, cpus, kill, memory, pids")
    assert checks["live probe"].detail == "not run (simulated host)"


# A policy that takes namespaces only: the checks that find them refused fail. (The default
# policy, "auto", gets the Landlock mode there: test_landlock.py.)
NAMESPACES = load_profile("default", {"isolation": "namespaces"})


def test_user_namespaces_disabled(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path, max_userns="0")), NAMESPACES)
    check = by_name(report)["user namespaces"]
    assert not report.ok
    assert check.status == "fail"
    assert check.detail == "user namespaces are disabled (user.max_user_namespaces is 0)"
    assert (check.remedy or "").startswith(
        "sysctl -w user.max_user_namespaces=15000")
    assert any("privilege confinement" in a for a in check.affects)


def test_kernel_without_user_namespaces(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, max_userns=None)), NAMESPACES))[
        "user namespaces"]
    assert check.status == "fail"
    assert "CONFIG_USER_NS" in check.detail


def test_debian_sysctl_blocks_unprivileged_but_not_root(tmp_path: Path) -> None:
    root = fake_host(tmp_path, userns_clone="0")
    check = by_name(run_doctor(facts(root), NAMESPACES))["user namespaces"]
    assert check.status == "fail"
    assert (check.remedy or "").startswith(
        "sysctl -w kernel.unprivileged_userns_clone=1")
    as_root = by_name(run_doctor(facts(root, uid=0)))["user namespaces"]
    assert as_root.status == "ok"
    assert "root is not affected" in as_root.detail


def test_apparmor_restriction(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path, apparmor="1")), NAMESPACES)
    check = by_name(report)["user namespaces"]
    assert not report.ok
    assert check.status == "fail"
    assert "apparmor_restrict_unprivileged_userns=1" in check.detail
    assert "userns," in (check.remedy or "")
    assert os.path.realpath(sys.executable) in (check.remedy or "")
    assert "apparmor_parser -r /etc/apparmor.d/nsbox" in (check.remedy or "")


def test_no_seccomp(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path, seccomp=False)))
    check = by_name(report)["seccomp"]
    assert not report.ok
    assert check.status == "fail"
    assert "no Seccomp field" in check.detail
    assert check.affects == ["syscall filter (seccomp)"]
    # A profile that turns seccomp off can still run: the loss is a warning then.
    relaxed = load_profile("default", {"seccomp.enabled": False})
    assert run_doctor(facts(fake_host(tmp_path / "b", seccomp=False)), relaxed).ok


def test_seccomp_without_filters_or_actions(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, actions=""))))["seccomp"]
    assert (check.status, "actions_avail" in check.detail) == ("fail", True)
    old = fake_host(tmp_path / "b", actions="kill trap errno trace allow")
    check = by_name(run_doctor(facts(old)))["seccomp"]
    assert check.status == "fail"
    assert check.detail == "the kernel lacks the actions kill_process"


def test_learning_mode_needs_user_notification(tmp_path: Path) -> None:
    root = fake_host(tmp_path, actions="kill_process kill_thread trap errno trace log allow")
    assert by_name(run_doctor(facts(root)))["seccomp"].status == "ok"
    learning = load_profile("default", {"seccomp.log_denied": True})
    check = by_name(run_doctor(facts(root), learning))["seccomp"]
    assert (check.status, check.detail) == ("fail", "the kernel lacks the actions user_notif")


def test_missing_libseccomp(tmp_path: Path) -> None:
    host = HostFacts(str(fake_host(tmp_path)), uid=UID, python=(3, 11, 7), libseccomp=None)
    check = by_name(run_doctor(host))["libseccomp"]
    assert check.status == "fail"
    assert "apt-get install libseccomp2" in (check.remedy or "")


def test_cgroup_v1_only_not_writable(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path, cgroups="v1", writable=False)))
    check = by_name(report)["cgroups"]
    assert report.ok  # rlimits are the fallback; the default profile does not require cgroups
    assert check.status == "warn"
    assert check.detail.startswith(
        "v1 layout; backend none; the v1 cgroups of this process (cpu, cpuacct, memory, pids) "
        "are not writable by uid 1000; instead: memory: RLIMIT_AS per process")
    assert "; cpus: not limited; CPU time: RLIMIT_CPU per process" in check.detail
    assert check.detail.endswith("; kill: SIGKILL of the sandbox's pid 1 (ends its PID namespace)")
    # The remedy names the cgroup directories of this process that root must delegate.
    remedy = check.remedy or ""
    assert remedy.startswith("run as root, or have root create a cgroup owned by uid 1000 in "
                             "each of /sys/fs/cgroup/")
    assert "'mkdir DIR/nsbox && chown 1000 DIR/nsbox DIR/nsbox/tasks" in remedy
    strict = load_profile("default", {"limits.require_cgroup": True})
    assert not run_doctor(facts(fake_host(tmp_path / "b", cgroups="v1", writable=False)),
                          strict).ok


def test_cgroup_v1_writable(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, cgroups="v1"))))["cgroups"]
    assert check.status == "ok"
    assert check.detail == "v1 layout; backend v1: cpu_accounting, cpus, kill, memory, pids"


def test_hybrid_layout_uses_v1_controllers(tmp_path: Path) -> None:
    root = fake_host(tmp_path, cgroups="hybrid")
    host = facts(root)
    # The production layout reader, pointed at the simulated tree.
    layout = read_layout(view=host.cgroup_view())
    assert layout.kind == "hybrid"
    assert layout.v1["memory"].own_dir == f"{root}/sys/fs/cgroup/memory/nsbox"
    check = by_name(run_doctor(host))["cgroups"]
    assert (check.status, check.detail) == (
        "ok", "hybrid layout; backend v1: cpu_accounting, cpus, kill, memory, pids")
    # The cgroup2 mount has no controllers here; it still gives cgroup.kill to the v1 backend.
    assert check.facts["unified"] == (f"{root}/sys/fs/cgroup/unified/user.slice/user-1000.slice/"
                                      "user@1000.service/app.slice/nsbox.scope")


def test_pure_v2_without_delegation(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, writable=False))))["cgroups"]
    assert check.status == "warn"
    assert check.detail.startswith("v2 layout; backend none; cgroup /sys/fs/cgroup/user.slice/")
    assert "nsbox.scope is not writable by uid 1000 (no delegation)" in check.detail
    # No systemd user manager on this fake host: root must delegate the cgroup, named in full.
    remedy = check.remedy or ""
    assert remedy.startswith("no systemd user manager runs here (systemd-run --user --scope")
    (procs,) = tmp_path.rglob("cgroup.procs")
    base = "/" + str(procs.parent.relative_to(tmp_path / "host"))
    assert f"mkdir {base}/nsbox && chown 1000 {base}/nsbox" in remedy


def test_pure_v2_with_a_systemd_user_manager(tmp_path: Path) -> None:
    root = fake_host(tmp_path, writable=False)
    socket = root / "run/user/1000/systemd/private"
    socket.parent.mkdir(parents=True)
    socket.write_text("")
    check = by_name(run_doctor(facts(root)))["cgroups"]
    assert check.status == "warn"
    assert check.remedy == ("a systemd user manager runs here: 'systemd-run --user --scope -p "
                            "Delegate=yes nsbox ...' gives nsbox a delegated cgroup with memory, "
                            "pids and cpu")


def test_pure_v2_delegation_needs_subtree_control(tmp_path: Path) -> None:
    root = fake_host(tmp_path)
    (control,) = root.rglob("cgroup.subtree_control")
    control.chmod(0o644)  # the directory and cgroup.procs stay writable
    check = by_name(run_doctor(facts(root)))["cgroups"]
    assert check.status == "warn"
    assert "nsbox.scope is not writable by uid 1000 (no delegation)" in check.detail
    assert check.facts["missing"] == ["cpu_accounting", "cpus", "kill", "memory", "pids"]


def test_pure_v2_with_missing_controllers(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, controllers="memory"))))["cgroups"]
    assert check.status == "warn"
    scope = "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/nsbox.scope"
    assert check.detail == (f"v2 layout; backend v2: cpu_accounting, kill, memory; {scope} does "
                            "not offer the controllers pids, cpu; instead: pids: RLIMIT_NPROC "
                            "(counts the sandbox's own tasks from Linux 5.14 on, all of the "
                            "mapped uid's before); cpus: not limited")
    parent = scope.rsplit("/", 1)[0]
    assert check.remedy == (f"have the owner of {parent} enable the controllers for it: 'echo "
                            f"+memory +pids +cpu > {parent}/cgroup.subtree_control' (each must "
                            "be enabled in every ancestor)")
    assert check.affects == ["process-count limit (cgroup pids)",
                             "CPU share limit (cgroup cpu)"]


def test_container_with_masked_proc(tmp_path: Path) -> None:
    root = fake_host(tmp_path, container=True, extra_mounts=[
        "60 22 0:50 / /proc/kcore rw - tmpfs tmpfs rw",
        "61 22 0:51 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw",
    ])
    report = run_doctor(facts(root))
    checks = by_name(report)
    assert checks["container"].status == "info"
    assert "/.dockerenv; /proc/1/cgroup names docker" in checks["container"].detail
    masked = checks["/proc mounts"]
    assert masked.status == "fail"
    assert "(/proc/kcore)" in masked.detail
    assert "systempaths=unconfined" in (masked.remedy or "")
    assert not report.ok


def test_a_fresh_proc_over_a_masked_one_is_visible(tmp_path: Path) -> None:
    """A container's entrypoint that mounts its own proc on /proc hides the masks below the
    older one: the kernel admits a new proc then (a fully visible proc mount exists)."""
    root = fake_host(tmp_path, container=True, extra_mounts=[
        "60 22 0:50 / /proc/bus ro - proc proc rw",
        "61 22 0:50 / /proc/irq ro - proc proc rw",
        "62 27 0:52 / /proc rw,relatime - proc proc rw",
    ])
    checks = by_name(run_doctor(facts(root)))
    assert "/proc mounts" not in checks
    # A mask made after the fresh proc covers it again.
    root = fake_host(tmp_path / "b", container=True, extra_mounts=[
        "62 27 0:52 / /proc rw,relatime - proc proc rw",
        "63 62 0:53 / /proc/kcore rw - tmpfs tmpfs rw",
    ])
    masked = by_name(run_doctor(facts(root)))["/proc mounts"]
    assert masked.status == "fail" and "(/proc/kcore)" in masked.detail


def test_old_kernel(tmp_path: Path) -> None:
    check = by_name(run_doctor(facts(fake_host(tmp_path, release="5.10.0-28-amd64"))))["kernel"]
    assert check.status == "fail"
    assert check.detail == ("Linux 5.10.0-28-amd64; nsbox needs 5.12 or later (mount_setattr, "
                            "close_range, pidfd)")
    check = by_name(run_doctor(facts(fake_host(tmp_path / "b", release="5.15.0"))))["kernel"]
    assert (check.status, check.detail) == ("ok", "Linux 5.15.0")


def test_project_workspace_needs_overlay_with_user_xattrs_on_tmpfs(tmp_path: Path) -> None:
    old = by_name(run_doctor(facts(fake_host(tmp_path, release="5.15.0"))))["project workspace"]
    assert old.status == "info"
    assert old.detail == ("--project is not available: Linux 5.15.0: overlayfs in a user "
                          "namespace needs user xattrs on tmpfs (6.6)")
    new = by_name(run_doctor(facts(fake_host(tmp_path / "b", release="6.8.0"))))
    assert new["project workspace"].status == "ok"


def test_failed_probe_step_gives_its_remedy(tmp_path: Path) -> None:
    probe = {"done": ["user namespace", "uid/gid maps"], "failed": "mount /proc", "errno": 1,
             "error": "mount('proc', '/tmp/proc', 'proc', '0xe', None): Operation not permitted"}
    host = HostFacts(str(fake_host(tmp_path)), uid=UID, python=(3, 11, 7), libseccomp="2.5.4",
                     probe=probe)
    report = run_doctor(host)
    check = by_name(report)["live probe"]
    assert not report.ok
    assert check.detail.startswith("mount /proc failed: mount('proc'")
    assert "systempaths=unconfined" in (check.remedy or "")


def test_report_as_json_and_table(tmp_path: Path) -> None:
    report = run_doctor(facts(fake_host(tmp_path, cgroups="v1", writable=False)))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is True and data["profile"] == "default"
    assert [c["name"] for c in data["checks"]][:3] == ["python", "kernel", "user namespaces"]
    table = report.format_table()
    assert table.splitlines()[0].split() == ["STATUS", "CHECK", "DETAIL"]
    assert "WARN    cgroups" in table
    assert "remedy: run as root" in table
    assert table.endswith("with 1 weaker guarantee(s) (see WARN).")


# --- the real host -----------------------------------------------------------------------------


def _unshare_works(*prefix: str) -> bool:
    unshare = shutil.which("unshare")
    if not unshare:
        return False
    done = subprocess.run([*prefix, unshare, "-Urmpf", "--mount-proc", "true"],
                          capture_output=True, check=False)
    return done.returncode == 0


def test_doctor_on_this_host() -> None:
    report = run_doctor()
    checks = by_name(report)
    assert checks["kernel"].detail == f"Linux {os.uname().release}"
    # The live probe really ran: it agrees with unshare(1) doing the same.
    works = _unshare_works()
    require(works, "this host cannot create user, mount and PID namespaces")
    assert checks["live probe"].status == "ok", checks["live probe"]
    # On the real host the cgroup check is the launch's own backend choice (nsbox.cgroups).
    info = describe_host()
    assert checks["cgroups"].status == ("warn" if info["missing"] else "ok")
    assert checks["cgroups"].detail.startswith(f"{info['layout']} layout; backend "
                                               f"{info['backend']}")
    require(report.ok, f"this host cannot run the default profile safely:\n"
            f"{report.format_table()}")


def test_doctor_on_this_host_unprivileged(public_tree: Path) -> None:
    setpriv = shutil.which("setpriv")
    require(os.geteuid() == 0 and bool(setpriv), "needs root and setpriv to drop to uid 65534")
    assert setpriv
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    # The package copy that uid 65534 can read, run by the host's python3 (see conftest).
    code = (f"import json, sys; sys.path.insert(0, {str(public_tree)!r}); "
            "from nsbox.doctor import run_doctor; print(json.dumps(run_doctor().to_dict()))")
    done = subprocess.run([*drop, PYTHON, "-I", "-c", code], capture_output=True, text=True,
                          check=False, cwd="/")
    assert done.returncode == 0, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["live probe"]["status"] == ("ok" if _unshare_works(*drop) else "fail")
    # Where uid 65534 cannot write its cgroups (test(1) says so), doctor must not say "ok".
    layout = read_layout()
    dirs = [layout.v1[c].own_dir for c in ("memory", "pids", "cpu") if c in layout.v1]
    if layout.kind == "v2" and layout.unified:
        dirs = [layout.unified.own_dir]
    can_write = all(subprocess.run([*drop, "test", "-w", d], check=False).returncode == 0
                    for d in dirs) and bool(dirs)
    if not can_write:
        assert checks["cgroups"]["status"] == "warn"
        assert "not writable by uid 65534" in checks["cgroups"]["detail"]


def test_a_profile_that_does_not_load_is_its_error_not_a_host_verdict(tmp_path: Path) -> None:
    """pids = 1 cannot run (the sandbox's init is one process): the profile is refused with
    its file, line and key; doctor judges no host for it (no FAIL), exit 125 as nsbox run."""
    profile = tmp_path / "one.toml"
    profile.write_text("[limits]\npids = 1\n")
    message = (f"{profile}:2: limits.pids: 1 is out of range (must be at least 2; the "
               "sandbox's own init is one of its processes")
    for args in ([], ["--json"]):
        proc = subprocess.run([sys.executable, "-m", "nsbox", "doctor", *args, "-p",
                               str(profile)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 125, proc.stderr
        assert proc.stderr.startswith(f"nsbox: {message}"), proc.stderr
        assert "FAIL" not in proc.stdout
        if args:
            shown = json.loads(proc.stdout)
            assert shown["ok"] is False and shown["error"].startswith(message)
