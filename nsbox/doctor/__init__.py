"""``nsbox doctor``: check the host once, and say what each missing feature costs and how to fix it.

Every check reads the host through a HostFacts (nsbox/doctor/hostfacts.py), so the same checks
run on the real host and on a fake /proc and /sys tree; the cgroup check asks the launch's own
detection (nsbox.cgroups.describe_host) through the same root. A check is ``ok``, ``info``
(worth knowing), ``warn`` (the sandbox runs, with a weaker guarantee that the Result reports as
degraded) or ``fail`` (the profile cannot run safely). The library returns a Report (its shape:
nsbox/doctor/report.py; the verdict per guarantee: nsbox/doctor/verdicts.py); the CLI picks the
exit status from ``Report.ok``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from nsbox.cgroups import HostView, Layout, delegate_command, describe_host, read_layout
from nsbox.doctor import isolation
from nsbox.doctor.hostfacts import HostFacts, MountEntry, kernel_release
from nsbox.doctor.report import (
    CLEANUP,
    CPU,
    FILESYSTEM,
    MEMORY,
    NETWORK,
    PIDS,
    PRIVILEGE,
    PROCESSES,
    STATUSES,
    SYSCALLS,
    Check,
    Report,
)
from nsbox.doctor.verdicts import (
    GUARANTEES,
    LIMITS,
    PROBE_ADVICE,
    check_launch,
    predict,
    verdicts_of_run,
)
from nsbox.errors import HostError
from nsbox.policy import identity
from nsbox.policy.policy import Policy
from nsbox.sandbox import native

__all__ = [
    "CHECKS", "CLEANUP", "CPU", "FILESYSTEM", "GUARANTEES", "LIMITS", "MEMORY", "NETWORK", "PIDS",
    "PRIVILEGE", "PROCESSES", "STATUSES", "SYSCALLS", "Check", "Report", "predict", "run_doctor",
    "verdicts_of_run",
]


def run_doctor(facts: HostFacts | None = None, policy: Policy | None = None) -> Report:
    """Check the host (the real one unless ``facts`` points elsewhere) for ``policy`` (by
    default the shipped default profile)."""
    if policy is None:
        from nsbox.profiles import load_profile

        policy = load_profile("default")
    facts = facts or HostFacts()
    checks: list[Check] = []
    for check in CHECKS:
        checks.extend(check(facts, policy))
    checks = isolation.settle(checks, facts, policy)  # the mode a run gets (namespaces or not)
    guarantees = isolation.verdicts(checks, predict(checks, policy))
    if not facts.simulated:
        live = check_launch(policy, guarantees)
        checks.append(live)
        guarantees.update(live.facts.get("verdicts", {}))
    return Report(policy.name, checks, guarantees)


# --- the checks --------------------------------------------------------------------------------


def check_python(facts: HostFacts, policy: Policy) -> list[Check]:
    version = ".".join(map(str, facts.python))
    if facts.python < (3, 10):
        return [Check("python", "fail", f"Python {version}; nsbox needs 3.10 or later",
                      [FILESYSTEM, PROCESSES], "run nsbox with python3.10 or later")]
    checks = [Check("python", "ok", f"Python {version}")]
    if not facts.simulated:  # this installation's, not a simulated host's (docs/performance.md)
        native_core, core = native.status()
        checks.append(Check("launch core", "ok" if native_core else "info", core))
    return checks


def _version(text: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(p or 0) for p in match.groups()) if match else ()


def check_kernel(facts: HostFacts, policy: Policy) -> list[Check]:
    release = kernel_release(facts)
    version = _version(release)
    if not version:
        return [Check("kernel", "warn", f"cannot tell the kernel version ({release!r})")]
    # The launch uses pidfd_open(2) (5.3) to wait and kill without pid-reuse races,
    # close_range(2) with CLOSE_RANGE_CLOEXEC (5.11), and mount_setattr(2) (5.12) to make binds
    # read-only recursively and to map a writable workspace's owner when run as root.
    if version < (5, 12):
        return [Check("kernel", "fail", f"Linux {release}; nsbox needs 5.12 or later "
                      "(mount_setattr, close_range, pidfd)", [FILESYSTEM, CLEANUP],
                      "upgrade the kernel to 5.12 or later")]
    return [Check("kernel", "ok", f"Linux {release}")]


def _apparmor_remedy() -> str:
    python = os.path.realpath(sys.executable)
    return (f"allow user namespaces for this Python: write /etc/apparmor.d/nsbox with "
            f"'abi <abi/4.0>, include <tunables/global> profile nsbox {python} "
            f"flags=(unconfined) {{ userns, }}' and run 'apparmor_parser -r "
            f"/etc/apparmor.d/nsbox' (or, for the whole machine, 'sysctl -w "
            f"kernel.apparmor_restrict_unprivileged_userns=0')")


def check_userns(facts: HostFacts, policy: Policy) -> list[Check]:
    name = "user namespaces"
    affects = [PRIVILEGE, FILESYSTEM, PROCESSES, NETWORK]
    maximum = facts.read_int("/proc/sys/user/max_user_namespaces")
    if maximum is None:
        return [Check(name, "fail", "the kernel has no user namespaces (CONFIG_USER_NS)",
                      affects, "use a kernel built with CONFIG_USER_NS=y")]
    if maximum == 0:
        return [Check(name, "fail", "user namespaces are disabled (user.max_user_namespaces "
                      "is 0)", affects,
                      "sysctl -w user.max_user_namespaces=15000 (and set it in "
                      "/etc/sysctl.d/ to keep it)")]
    root = facts.uid == 0
    clone = facts.read_int("/proc/sys/kernel/unprivileged_userns_clone")
    if clone == 0 and not root:
        return [Check(name, "fail", "kernel.unprivileged_userns_clone is 0: only root may "
                      "create user namespaces", affects,
                      "sysctl -w kernel.unprivileged_userns_clone=1 (and set it in "
                      "/etc/sysctl.d/), or run nsbox as root")]
    restrict = facts.read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    if restrict == 1 and not root:
        return [Check(name, "fail", "AppArmor restricts unprivileged user namespaces "
                      "(kernel.apparmor_restrict_unprivileged_userns=1): they come without "
                      "capabilities, so the sandbox cannot mount", affects, _apparmor_remedy())]
    notes = [f"max {maximum}"]
    if clone == 0 or restrict == 1:
        notes.append("restricted for unprivileged users (root is not affected)")
    return [Check(name, "ok", ", ".join(notes))]


def check_identity(facts: HostFacts, policy: Policy) -> list[Check]:
    """Who the sandbox will be on the host, decided as the launch helper decides it
    (nsbox/policy/identity.py), and who will make its binds."""
    held = facts.holdings()
    if held is None:
        return [Check("identity", "info", "cannot read this process's ids and capabilities")]
    try:
        ids = identity.decide(held, policy.host_uid, policy.host_gid)
    except HostError as exc:
        detail = str(exc.args[0]).removeprefix("identity: ")
        return [Check("identity", "fail", detail, [PRIVILEGE], exc.hint)]
    if held.initial_userns:
        who = f"the sandbox's user is host uid {ids.parent_uid}, gid {ids.parent_gid}"
    else:
        who = (f"the sandbox's user is uid {ids.uid}, gid {ids.gid} of this user namespace, "
               f"{ids.parent_uid}/{ids.parent_gid} in its parent (ids further up cannot be "
               "seen from here)")
    if held.detached_binds:
        binds = ("binds are opened by the launcher; a writable bind of a user's directory is "
                 "idmapped to its owner, a root-owned one must be writable by "
                 f"uid {ids.parent_uid}")
    elif held.mapper and held.initial_userns:
        binds = ("no CAP_SYS_ADMIN: the sandbox binds each source by path with its own host "
                 f"identity (sources must be readable, writable binds writable, by uid "
                 f"{ids.parent_uid})")
    else:
        binds = "the sandbox binds each source by path with its own identity"
    return [Check("identity", "ok", f"{who}; {binds}")]


# proc(5): the kernel refuses a new proc mount in a user namespace when the existing /proc has
# files covered by other mounts (fs/namespace.c, mount_too_revealing); binfmt_misc is fine.
_HARMLESS_PROC_MOUNTS = ("/proc/sys/fs/binfmt_misc",)


def _covered_proc(mounts: list[MountEntry]) -> list[str]:
    """The mounts over parts of the /proc that is visible. mountinfo lists the mounts in the
    order they were made: a proc mounted on /proc later (a container's entrypoint mounting its
    own) hides those below the older one, and the kernel admits a new proc when any proc mount
    is fully visible (fs/namespace.c, mount_too_revealing)."""
    last = max((n for n, m in enumerate(mounts) if m.point == "/proc"
                and m.fstype == "proc"), default=-1)
    return [m.point for m in mounts[last + 1:]
            if m.point.startswith("/proc/") and m.point not in _HARMLESS_PROC_MOUNTS]


def check_container(facts: HostFacts, policy: Policy) -> list[Check]:
    evidence = []
    if facts.exists("/.dockerenv"):
        evidence.append("/.dockerenv")
    if facts.exists("/run/.containerenv"):
        evidence.append("/run/.containerenv")
    environ = facts.read("/proc/1/environ") or ""
    for item in environ.split("\0"):
        if item.startswith("container="):
            evidence.append(f"PID 1 has {item}")
    cgroup = facts.read("/proc/1/cgroup") or ""
    for word in ("docker", "kubepods", "containerd", "libpod", "lxc"):
        if word in cgroup:
            evidence.append(f"/proc/1/cgroup names {word}")
            break
    covered = _covered_proc(facts.mounts())
    checks = []
    if not evidence:
        checks.append(Check("container", "ok", "not inside a container"))
    else:
        checks.append(Check(
            "container", "info", "inside a container (" + "; ".join(evidence) + "): its "
            "seccomp profile may refuse unshare and mount, and masked /proc paths block a "
            "new /proc; the probe shows what works",
            remedy="if the probe fails: run the container with --security-opt "
                   "seccomp=unconfined --security-opt systempaths=unconfined, or nsbox on the "
                   "host"))
    if covered:
        checks.append(Check(
            "/proc mounts", "fail", "parts of /proc are covered by other mounts ("
            + ", ".join(covered[:4]) + (", ..." if len(covered) > 4 else "") + "): the kernel "
            "refuses a fresh /proc in a new user namespace", [PROCESSES],
            "unmask /proc (docker/podman: --security-opt systempaths=unconfined)"))
    return checks


def check_seccomp(facts: HostFacts, policy: Policy) -> list[Check]:
    needed = policy.seccomp.enabled
    bad = "fail" if needed else "warn"
    mode = facts.status_field("Seccomp")
    if mode is None:
        return [Check("seccomp", bad, "the kernel has no seccomp (no Seccomp field in "
                      "/proc/self/status)", [SYSCALLS],
                      "use a kernel built with CONFIG_SECCOMP_FILTER=y")]
    actions = (facts.read("/proc/sys/kernel/seccomp/actions_avail") or "").split()
    if not actions:
        return [Check("seccomp", bad, "the kernel cannot filter syscalls "
                      "(no /proc/sys/kernel/seccomp/actions_avail)", [SYSCALLS],
                      "use a kernel built with CONFIG_SECCOMP_FILTER=y")]
    missing = [a for a in ("allow", "errno", "kill_process") if a not in actions]
    # Learning mode reports denied syscalls through a user-notification listener.
    if policy.seccomp.log_denied and "user_notif" not in actions:
        missing.append("user_notif")
    checks = []
    if missing:
        checks.append(Check("seccomp", bad, f"the kernel lacks the actions {', '.join(missing)}",
                            [SYSCALLS], "upgrade the kernel (kill_process: 4.14, user_notif: 5.0)"))
    else:
        detail = "filters available"
        if mode == "2":
            detail += "; this process already runs under a filter, the sandbox's stacks on it"
        checks.append(Check("seccomp", "ok", detail))
    version = facts.libseccomp_version()
    if version is None:
        checks.append(Check("libseccomp", bad, "libseccomp.so.2 not found: the filter cannot "
                            "be built", [SYSCALLS],
                            "install libseccomp (Debian/Ubuntu: apt-get install libseccomp2)"))
    elif _version(version) < (2, 5):
        checks.append(Check("libseccomp", "warn", f"libseccomp {version}; 2.5 or later knows "
                            "the newer syscalls", [SYSCALLS], "upgrade libseccomp to 2.5+"))
    else:
        checks.append(Check("libseccomp", "ok", f"libseccomp {version}"))
    if not facts.simulated and importlib.util.find_spec("pyseccomp") is None:
        checks.append(Check("pyseccomp", bad, "the pyseccomp module is not installed",
                            [SYSCALLS], "pip install pyseccomp"))
    return checks


# What a run gets instead when the cgroup backend cannot provide a feature (docs/limits.md, per
# host type), by the feature names of nsbox.cgroups.
_FALLBACK = {
    "memory": "memory: RLIMIT_AS per process (address space, not memory; no total, no OOM "
              "report, no peak memory)",
    "pids": "pids: RLIMIT_NPROC (counts the sandbox's own tasks from Linux 5.14 on, all of "
            "the mapped uid's before)",
    "cpus": "cpus: not limited",
    "cpu_accounting": "CPU time: RLIMIT_CPU per process, rusage after exit",
    "kill": "kill: SIGKILL of the sandbox's pid 1 (ends its PID namespace)",
}
_AFFECTS = {"memory": MEMORY, "pids": PIDS, "cpus": CPU,
            "cpu_accounting": "CPU-time limit and accounting (cgroup cpu/cpuacct)",
            "kill": CLEANUP}
# The v2/v1 controller behind each limit feature.
_CONTROLLER = {"memory": "memory", "pids": "pids", "cpus": "cpu"}


def check_cgroups(facts: HostFacts, policy: Policy) -> list[Check]:
    """What the runs here would get, as nsbox.cgroups (the code a run uses) detects it: the
    backend it would pick, and whether other processes in its cgroup stop it from limiting. A
    simulated host is read by the same code, through its root and for its uid."""
    view = facts.cgroup_view()
    layout = read_layout(view=view)
    info = describe_host(layout, view)
    detail = f"{info['layout']} layout; backend {info['backend']}"
    if info["supports"]:
        detail += f": {', '.join(info['supports'])}"
    missing = [f for f in _FALLBACK if f in info["missing"]]
    if not missing:
        return [Check("cgroups", "ok", detail, facts=info)]
    for reason in (info["reason"], _absent_controllers(info)):
        if reason:
            detail += f"; {reason}"
    remedy = _cgroup_remedy_of(info, layout, view)
    check = _cgroup_fallback(policy, _as_host(view, detail), missing, _as_host(view, remedy))
    check.facts = info
    return [check]


def _as_host(view: HostView, text: str) -> str:
    """``text`` with the paths of a simulated host as that host names them."""
    return text if view.root == "/" else text.replace(view.root.rstrip("/"), "")


def _absent_controllers(info: dict[str, Any]) -> str:
    """The v2 controllers that the chosen v2 backend's cgroup does not offer its children."""
    if info["backend"] != "v2":
        return ""
    absent = [c for c in _CONTROLLER.values() if c not in info.get("controllers", [])]
    if not absent:
        return ""
    return f"{info.get('cgroup')} does not offer the controllers {', '.join(absent)}"


def _cgroup_remedy_of(info: dict[str, Any], layout: Layout, view: HostView) -> str:
    """The one change that gives this host's runs cgroup limits, naming the cgroup."""

    unified = layout.unified.own_dir if layout.unified else None
    cgroup = info.get("cgroup") or unified
    if info.get("read_only"):
        return ("the cgroup filesystem is mounted read-only (a container's default): give the "
                "container a writable one (docker/podman: --privileged, or inside it with "
                "CAP_SYS_ADMIN: mount -o remount,rw /sys/fs/cgroup), or accept rlimits")
    if info.get("blocking_processes"):
        return (f"the processes {info['blocking_processes'][:5]} share nsbox's cgroup "
                f"{cgroup}: start nsbox in a cgroup of its own ('{delegate_command()}', or a "
                "service with Delegate=yes), or move those processes out of it")
    absent = _absent_controllers(info)
    if absent and cgroup:
        # cgroup-v2.rst, "Enabling and Disabling": a cgroup's children get the controllers
        # that its own parent enables for it, so the parent's owner enables them first.
        parent = os.path.dirname(cgroup)
        wanted = " ".join(f"+{c}" for c in _CONTROLLER.values())
        return (f"have the owner of {parent} enable the controllers for it: 'echo {wanted} > "
                f"{parent}/cgroup.subtree_control' (each must be enabled in every ancestor)")
    v1_dirs = sorted({h.own_dir for c, h in layout.v1.items() if c in _CONTROLLER.values()})
    return _cgroup_remedy(layout.kind, cgroup, view.euid, bool(info.get("systemd_user_manager")),
                          v1_dirs)


def _cgroup_remedy(layout: str, v2_path: str | None, uid: int, systemd_user: bool,
                   v1_dirs: list[str] | None = None) -> str:

    if layout == "none":
        return "mount cgroup2 on /sys/fs/cgroup (systemd does by default)"
    if layout == "v2" and uid != 0 and systemd_user:
        return (f"a systemd user manager runs here: '{delegate_command(uid)}' gives nsbox a "
                "delegated cgroup with memory, pids and cpu")
    if layout == "v2":
        base = v2_path or "/sys/fs/cgroup"
        # cgroup-v2.rst, "Delegation": the delegatee owns the directory, its cgroup.procs,
        # cgroup.subtree_control and cgroup.threads; the parent enables the controllers.
        return (f"no systemd user manager runs here ({delegate_command(uid)} needs one): have "
                f"root delegate a cgroup: 'mkdir {base}/nsbox && chown {uid} {base}/nsbox "
                f"{base}/nsbox/cgroup.procs {base}/nsbox/cgroup.subtree_control "
                f"{base}/nsbox/cgroup.threads', with +memory +pids +cpu in "
                f"{base}/cgroup.subtree_control, then start nsbox from a shell moved into "
                f"{base}/nsbox")
    where = ", ".join(v1_dirs) if v1_dirs else "the memory, pids and cpu hierarchies"
    return (f"run as root, or have root create a cgroup owned by uid {uid} in each of {where} "
            f"('mkdir DIR/nsbox && chown {uid} DIR/nsbox DIR/nsbox/tasks DIR/nsbox/cgroup.procs'"
            ") and start nsbox from a shell moved into them")


def _cgroup_fallback(policy: Policy, detail: str, missing: list[str], remedy: str) -> Check:
    bad = "fail" if policy.limits.require_cgroup else "warn"
    detail += "; instead: " + "; ".join(_FALLBACK[f] for f in missing)
    return Check("cgroups", bad, detail, [_AFFECTS[f] for f in missing], remedy,
                 facts={"missing": sorted(missing)})


def check_probe(facts: HostFacts, policy: Policy) -> list[Check]:
    outcome = facts.probe()
    if outcome is None:
        return [Check("live probe", "info", "not run (simulated host)")]
    failed = outcome.get("failed")
    if not failed:
        return [Check("live probe", "ok", "namespaces, tmpfs root, /proc, pivot_root and a "
                      "seccomp filter all worked in a child process")]
    affects, remedy = PROBE_ADVICE.get(str(failed), ([FILESYSTEM], "see the checks above"))
    if str(failed) in ("user namespace", "mount, pid, net, ipc, uts and cgroup namespaces"):
        from nsbox.launch.launcher import namespace_hint

        # The cause a run would name for the same errno (disabled, or a seccomp filter).
        remedy = namespace_hint(int(str(outcome.get("errno") or 0))) or remedy
    return [Check("live probe", "fail", f"{failed} failed: {outcome.get('error')}", affects,
                  remedy, {"failed": failed, "errno": outcome.get("errno")})]


def check_project(facts: HostFacts, policy: Policy) -> list[Check]:
    """Project workspaces (--project): an overlayfs mounted in the sandbox's user namespace
    (5.11), over an idmapped lower layer when run as root (5.19), keeping its bookkeeping in
    user.* xattrs of the upper tmpfs (tmpfs stores them since 6.6). Without them nsbox has no
    weaker substitute: --project is refused and a plain --workspace is the alternative."""
    name = "project workspace"
    version = _version(kernel_release(facts))
    filesystems = facts.read("/proc/filesystems")
    problem = None
    if filesystems is not None and "\toverlay" not in filesystems:
        problem = "the kernel has no overlayfs (CONFIG_OVERLAY_FS; modprobe overlay)"
    elif version and version < (6, 6):
        problem = (f"Linux {'.'.join(map(str, version))}: overlayfs in a user namespace needs "
                   "user xattrs on tmpfs (6.6)")
    if problem:
        return [Check(name, "info", f"--project is not available: {problem}",
                      ["copy-on-write project workspaces (--project, Session(project=...))"],
                      "load the overlay module or upgrade the kernel to 6.6 or later; or bind "
                      "a copy of the project with --workspace")]
    return [Check(name, "ok", "overlayfs in the sandbox's user namespace (--project)")]


CHECKS: tuple[Callable[[HostFacts, Policy], list[Check]], ...] = (
    check_python, check_kernel, check_userns, check_identity, check_container, check_seccomp,
    check_cgroups, check_project, check_probe,
)
