"""``nsbox doctor``: check the host once, and say what each missing feature costs and how to fix it.

Every check reads the host through a HostFacts (nsbox/doctor/hostfacts.py), so the same checks
run on the real host and on a fake /proc and /sys tree; on the real host the cgroup check asks
the launch's own backend (nsbox.cgroups.describe_host). A check is ``ok``, ``info`` (worth
knowing), ``warn`` (the sandbox runs, with a weaker guarantee that the Result reports as
degraded) or ``fail`` (the profile cannot run safely). The library returns a Report; the CLI
picks the exit status from ``Report.ok``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from nsbox import identity
from nsbox.doctor.hostfacts import HostFacts, kernel_release
from nsbox.errors import CommandNotFound, HostError, NsboxError
from nsbox.policy import Policy
from nsbox.result import Result
from nsbox.sandbox import native

# The guarantees of DESIGN.md's threat model, as a check names them.
FILESYSTEM = "filesystem isolation (empty root, read-only binds)"
PROCESSES = "process isolation (own PID namespace and /proc)"
NETWORK = "network isolation (own network namespace)"
PRIVILEGE = "privilege confinement (a user namespace: root inside is nobody outside)"
SYSCALLS = "syscall filter (seccomp)"
MEMORY = "memory limit and OOM detection (cgroup memory)"
PIDS = "process-count limit (cgroup pids)"
CPU = "CPU share limit (cgroup cpu)"
CLEANUP = "cleanup of everything the command started"

STATUSES = ("ok", "info", "warn", "fail")


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str
    affects: list[str] = field(default_factory=list)
    remedy: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # what the check found, for --json


@dataclass
class Report:
    profile: str
    checks: list[Check]
    # Per guarantee, what a run gets here (see GUARANTEES): the prediction, corrected by the
    # live launch where that launch ran and saw otherwise.
    guarantees: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the profile can run safely here (warnings allowed)."""
        return all(check.status != "fail" for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "ok": self.ok, "guarantees": self.guarantees,
                "checks": [asdict(check) for check in self.checks]}

    def format_table(self) -> str:
        width = max(len(check.name) for check in self.checks)
        lines = [f"{'STATUS':<6}  {'CHECK':<{width}}  DETAIL"]
        for check in self.checks:
            lines.append(f"{check.status.upper():<6}  {check.name:<{width}}  {check.detail}")
            pad = " " * (8 + width + 2)
            if check.affects and check.status in ("warn", "fail"):
                lines.append(f"{pad}affects: {'; '.join(check.affects)}")
            if check.remedy and check.status != "ok":
                lines.append(f"{pad}remedy: {check.remedy}")
        if self.guarantees:
            lines.append("\nA run here gets: " + ", ".join(
                f"{name} {verdict}" for name, verdict in self.guarantees.items()) + ".")
        failed = [c.name for c in self.checks if c.status == "fail"]
        warned = sum(c.status == "warn" for c in self.checks)
        if failed:
            lines.append(f"\nThe {self.profile!r} profile cannot run safely here: "
                         f"{', '.join(failed)}.")
        else:
            lines.append(f"\nThe {self.profile!r} profile can run here"
                         + (f", with {warned} weaker guarantee(s) (see WARN)." if warned else "."))
        return "\n".join(lines)


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
    guarantees = predict(checks, policy)
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
    (nsbox/identity.py), and who will make its binds."""
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
    covered = [m.mount_point for m in facts.mounts()
               if m.mount_point.startswith("/proc/") and m.mount_point not in
               _HARMLESS_PROC_MOUNTS]
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
    """On the real host, nsbox.cgroups says what the runs would get (the backend it would pick,
    and whether other processes in its cgroup stop it from limiting); on a simulated host the
    facts layer reads the fake tree for memory, pids and cpu."""
    if facts.simulated:
        return [_simulated_cgroups(facts, policy)]
    from nsbox.cgroups import describe_host

    info = describe_host()
    layout, backend = info["layout"], info["backend"]
    missing = list(info["missing"])
    if not missing:
        return [Check("cgroups", "ok", f"{layout} layout; backend {backend}: "
                      + ", ".join(info["supports"]), facts=info)]
    detail = f"{layout} layout; backend {backend}"
    if info["supports"]:
        detail += f": {', '.join(info['supports'])}"
    if info["reason"]:
        detail += f"; {info['reason']}"
    check = _cgroup_fallback(policy, detail, missing, _live_cgroup_remedy(info))
    check.facts = info
    return [check]


def _live_cgroup_remedy(info: dict[str, Any]) -> str:
    """The one change that gives this host's runs cgroup limits, naming the cgroup."""
    from nsbox.cgroups._v2 import delegate_command

    cgroup = info.get("cgroup")
    if info.get("read_only"):
        return ("the cgroup filesystem is mounted read-only (a container's default): give the "
                "container a writable one (docker/podman: --privileged, or inside it with "
                "CAP_SYS_ADMIN: mount -o remount,rw /sys/fs/cgroup), or accept rlimits")
    if info.get("blocking_processes"):
        return (f"the processes {info['blocking_processes'][:5]} share nsbox's cgroup "
                f"{cgroup}: start nsbox in a cgroup of its own ('{delegate_command()}', or a "
                "service with Delegate=yes), or move those processes out of it")
    from nsbox.cgroups._host import read_layout

    v1_dirs = sorted({h.own_dir for c, h in read_layout().v1.items() if c in _CONTROLLER.values()})
    return _cgroup_remedy(info["layout"], cgroup, os.geteuid(),
                          bool(info.get("systemd_user_manager")), v1_dirs)


def _cgroup_remedy(layout: str, v2_path: str | None, uid: int, systemd_user: bool,
                   v1_dirs: list[str] | None = None) -> str:
    from nsbox.cgroups._v2 import delegate_command

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


def _simulated_cgroups(facts: HostFacts, policy: Policy) -> Check:
    info = facts.cgroups()
    if info.layout == "none":
        return _cgroup_fallback(policy, "no cgroup hierarchy is mounted", list(_CONTROLLER),
                                _cgroup_remedy("none", None, facts.uid, False))
    usable: dict[str, str] = {}
    found: set[str] = set()  # controllers the host has (named v1 hierarchies are not ones)
    if info.v2_path is not None:
        found.update(info.v2_controllers)
        for controller in _CONTROLLER.values():
            if controller in info.v2_controllers and info.v2_writable:
                usable[controller] = "v2"
    for controller, (_directory, writable) in info.v1.items():
        if controller.startswith("name="):
            continue
        found.add(controller)
        if writable and controller not in usable:
            usable[controller] = "v1"
    detail = f"{info.layout} layout; controllers: {', '.join(sorted(found)) or 'none'}"
    missing = [f for f, c in _CONTROLLER.items() if c not in usable]
    if not missing:
        via = ", ".join(f"{c} ({usable[c]})" for c in _CONTROLLER.values())
        return Check("cgroups", "ok", f"{detail}; writable here: {via}", facts={"missing": []})
    unwritable = [_CONTROLLER[f] for f in missing if _CONTROLLER[f] in found]
    absent = [_CONTROLLER[f] for f in missing if _CONTROLLER[f] not in found]
    if unwritable:
        detail += f"; not writable by uid {facts.uid}: {', '.join(unwritable)}"
    if absent:
        detail += f"; not available: {', '.join(absent)}"
    layout = "v2" if info.v2_path and not info.v1 else info.layout
    # A systemd user manager listens on this socket (systemd-run(1) --user connects to it).
    systemd_user = facts.exists(f"/run/user/{facts.uid}/systemd/private")
    v1_dirs = sorted({d for c, (d, _w) in info.v1.items() if c in _CONTROLLER.values()})
    return _cgroup_fallback(policy, detail, missing,
                            _cgroup_remedy(layout, info.v2_path, facts.uid, systemd_user, v1_dirs))


# Per failed probe step: the guarantees lost and what to do.
_PROBE_ADVICE: dict[str, tuple[list[str], str]] = {
    "user namespace": ([PRIVILEGE, FILESYSTEM, PROCESSES, NETWORK],
                       "see the user namespaces and container checks above"),
    "uid/gid maps": ([PRIVILEGE], "check /proc/self/uid_map is writable (a security module "
                     "may refuse it)"),
    "mount, pid, net, ipc, uts and cgroup namespaces": (
        [FILESYSTEM, PROCESSES, NETWORK], "a container or a security module refuses "
        "unshare(2); run with seccomp=unconfined or on the host"),
    "private mounts": ([FILESYSTEM], "a security module refuses mount(2) in the namespace"),
    "tmpfs root": ([FILESYSTEM], "a security module refuses mounting tmpfs"),
    "mount /proc": ([PROCESSES], "unmask /proc (containers: --security-opt "
                    "systempaths=unconfined)"),
    "pivot_root": ([FILESYSTEM], "the root is on rootfs/initramfs, where pivot_root(2) fails: "
                   "boot with a real root filesystem"),
    "detach the old root": ([FILESYSTEM], "a security module refuses umount2(2)"),
    "seccomp filter": ([SYSCALLS], "a container may refuse seccomp(2); run with "
                       "seccomp=unconfined"),
}


def check_probe(facts: HostFacts, policy: Policy) -> list[Check]:
    outcome = facts.probe()
    if outcome is None:
        return [Check("live probe", "info", "not run (simulated host)")]
    failed = outcome.get("failed")
    if not failed:
        return [Check("live probe", "ok", "namespaces, tmpfs root, /proc, pivot_root and a "
                      "seccomp filter all worked in a child process")]
    affects, remedy = _PROBE_ADVICE.get(str(failed), ([FILESYSTEM], "see the checks above"))
    if str(failed) in ("user namespace", "mount, pid, net, ipc, uts and cgroup namespaces"):
        from nsbox.launcher import namespace_hint

        # The cause a run would name for the same errno (disabled, or a seccomp filter).
        remedy = namespace_hint(int(str(outcome.get("errno") or 0))) or remedy
    return [Check("live probe", "fail", f"{failed} failed: {outcome.get('error')}", affects,
                  remedy)]


# --- the verdict per guarantee ------------------------------------------------------------------

# What a run gets for each guarantee: "enforced" (namespaces, seccomp, identity), "cgroup",
# "rlimit" or "none" (limits), "off" (the policy turned it off), "refused" (the run does not
# start: the host cannot give what the policy requires).
GUARANTEES = ("namespaces", "seccomp", "identity", "memory", "pids", "cpus", "cpu_time")
LIMITS = ("memory", "pids", "cpus", "cpu_time")
# The guarantee of each cgroup feature, and what replaces it without the cgroup (nsbox/limits.py).
_LIMIT_OF = {"memory": "memory", "pids": "pids", "cpus": "cpus", "cpu_accounting": "cpu_time"}
_WITHOUT_CGROUP = {"memory": "rlimit", "pids": "rlimit", "cpus": "none", "cpu_time": "rlimit"}
# The checks whose failure stops every run; a failed cgroups check stops only runs with limits.
_LAUNCH_CHECKS = ("python", "kernel", "user namespaces", "identity", "/proc mounts",
                  "live probe")


def predict(checks: list[Check], policy: Policy) -> dict[str, str]:
    """What a run of ``policy`` gets here per guarantee, by the checks alone."""
    failed = {c.name for c in checks if c.status == "fail"}
    if failed & set(_LAUNCH_CHECKS):
        return dict.fromkeys(GUARANTEES, "refused")
    verdicts = {"namespaces": "enforced", "identity": "enforced"}
    if not policy.seccomp.enabled:
        verdicts["seccomp"] = "off"
    else:
        verdicts["seccomp"] = ("refused" if failed & {"seccomp", "libseccomp", "pyseccomp"}
                               else "enforced")
    cgroups = next((c for c in checks if c.name == "cgroups"), None)
    missing = {_LIMIT_OF[f] for f in (cgroups.facts.get("missing", []) if cgroups else [])
               if f in _LIMIT_OF}
    for limit in LIMITS:
        if cgroups is not None and cgroups.status == "fail":
            verdicts[limit] = "refused"  # require_cgroup: a run with this limit does not start
        else:
            verdicts[limit] = _WITHOUT_CGROUP[limit] if limit in missing else "cgroup"
    return verdicts


def verdicts_of_run(outcome: Result | Exception, policy: Policy,
                    limits: tuple[str, ...] = LIMITS) -> dict[str, str]:
    """What one run reported per guarantee: its Result (``degraded`` names each limit that an
    rlimit replaced, nsbox/limits.py) or the error it raised. ``limits``: those it asked for."""
    if isinstance(outcome, HostError) and outcome.feature == "cgroup":
        verdicts = {"namespaces": "enforced", "identity": "enforced",
                    "seccomp": "enforced" if policy.seccomp.enabled else "off"}
        return verdicts | dict.fromkeys(limits, "refused")
    if isinstance(outcome, Exception):
        return dict.fromkeys(("namespaces", "seccomp", "identity", *limits), "refused")
    verdicts = {"namespaces": "enforced", "identity": "enforced",
                "seccomp": "enforced" if policy.seccomp.enabled else "off"}
    # Each entry of Result.degraded starts with the limit's name ("memory: RLIMIT_AS ...").
    degraded = {entry.split(":", 1)[0] for entry in outcome.degraded}
    for limit in limits:
        verdicts[limit] = _WITHOUT_CGROUP[limit] if limit in degraded else "cgroup"
    return verdicts


def _trial_policy(policy: Policy) -> Policy:
    """``policy`` with every limit set, so that one run shows how each is enforced."""
    from nsbox.policy import MiB

    limits = dataclasses.replace(
        policy.limits, memory=policy.limits.memory or 256 * MiB, pids=policy.limits.pids or 64,
        cpus=policy.limits.cpus or 1.0, cpu_time=policy.limits.cpu_time or 10.0,
        wall_time=10.0)
    return dataclasses.replace(policy, limits=limits)


# A launch step without a hint of its own (nsbox/launcher.py gives the known ones), by the probe
# step that does the same work.
_LAUNCH_STEPS = {
    "create namespaces": "mount, pid, net, ipc, uts and cgroup namespaces",
    "make mounts private": "private mounts", "mount tmpfs root": "tmpfs root",
    "proc /proc": "mount /proc", "pivot_root": "pivot_root", "seccomp": "seccomp filter",
}


def _launch_advice(step: str) -> str:
    probe_step = _LAUNCH_STEPS.get(step)
    if probe_step is not None:
        return _PROBE_ADVICE[probe_step][1]
    return "see the checks above; the step names what the kernel refused"


def check_launch(policy: Policy, predicted: dict[str, str]) -> Check:
    """A real launch through the production path (nsbox.run of ``true`` with the profile and
    every limit set): it fails at the step a run would fail at, with that run's hint, and its
    Result says which limits the cgroups enforce. Compared with the prediction."""
    from nsbox.launcher import run

    trial = _trial_policy(policy)
    outcome: Result | Exception
    try:
        outcome = run(["true"], trial)
    except NsboxError as exc:
        outcome = exc
    if isinstance(outcome, CommandNotFound):
        # Every step but the exec worked; the profile's sandbox just has no `true`.
        return Check("live launch", "info", "the sandbox was built, but has no 'true' to run: "
                     f"{outcome.message}")
    verdicts = verdicts_of_run(outcome, trial)
    facts: dict[str, Any] = {"verdicts": verdicts}
    if isinstance(outcome, Exception):
        step = getattr(outcome, "step", getattr(outcome, "feature", "launch"))
        message = getattr(outcome, "message", str(outcome.args[0] if outcome.args else outcome))
        facts["step"] = step
        return Check("live launch", "fail", f"nsbox.run(['true']) failed at {step}: {message}",
                     [FILESYSTEM, PROCESSES], outcome.hint or _launch_advice(str(step)), facts)
    facts["degraded"] = list(outcome.degraded)
    wrong = [f"{k}: predicted {predicted.get(k)}, the run got {v}" for k, v in verdicts.items()
             if predicted.get(k) != v]
    if wrong:
        return Check("live launch", "warn", "nsbox.run(['true']) disagrees with the checks "
                     "above (" + "; ".join(wrong) + "): " + "; ".join(outcome.degraded),
                     [], "the run's verdict is the true one; please report this host", facts)
    return Check("live launch", "ok", f"nsbox.run(['true']) {outcome.status.name} with "
                 + ", ".join(f"{k} {v}" for k, v in verdicts.items()), facts=facts)


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
