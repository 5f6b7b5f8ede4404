"""doctor's prediction of the isolation a run gets: namespaces, the Landlock mode, or none.

It reads what the other checks found (the user namespace settings, the live probe) the way a
run decides (nsbox/host/isolation.py): under ``isolation = "auto"`` a host that refuses
namespaces gives the Landlock mode, so the checks that found the refusal are warnings then,
not failures (``settle``); the ``isolation`` check says which mode, why, and the one host change
that gives full isolation. For Ubuntu's AppArmor restriction that change is an AppArmor profile
for nsbox's launcher, as Ubuntu ships for bwrap (``apparmor_profile``, printed by
``nsbox doctor --apparmor-profile``).
"""

from __future__ import annotations

import os
import sys

from nsbox._sys import landlock as _landlock
from nsbox.doctor.hostfacts import HostFacts
from nsbox.doctor.report import FILESYSTEM, NETWORK, PROCESSES, Check
from nsbox.host import isolation
from nsbox.policy.policy import Policy

# The checks that find a refusal of namespaces, and the probe's steps that show one.
_NAMESPACE_CHECKS = ("user namespaces", "live probe", "/proc mounts")
_NAMESPACE_STEPS = ("user namespace", "uid/gid maps",
                    "mount, pid, net, ipc, uts and cgroup namespaces")
_CAPABLE_STEPS = ("private mounts", "tmpfs root")
_APPARMOR_SYSCTL = "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"
_FILE = "/etc/apparmor.d/nsbox"


def launcher_executable() -> str:
    """The program that creates nsbox's namespaces: the interpreter its launch helper runs in
    (nsbox/launch/launcher.py starts the helper with it; the command line forks it)."""
    return os.path.realpath(sys.executable or "/usr/bin/python3")


def apparmor_profile(executable: str | None = None) -> str:
    """An AppArmor profile that lets nsbox's launcher create user namespaces with capabilities
    while everything it executes gets none: the shape of Ubuntu's bwrap-userns-restrict."""
    executable = executable or launcher_executable()
    common = ("  allow file rwlkm /{**,},\n  allow network,\n  allow unix,\n  allow ptrace,\n"
              "  allow signal,\n  allow mqueue,\n  allow io_uring,\n  allow userns,\n"
              "  allow mount,\n  allow umount,\n  allow pivot_root,\n  allow dbus,\n")
    return (_launcher_profiles(executable, common) + "profile unpriv_nsbox "
            "flags=(attach_disconnected,mediate_deleted) {\n" + common
            + "  allow pix /** -> &unpriv_nsbox,\n\n  audit deny capability,\n\n"
            "  include if exists <local/unpriv_nsbox>\n}\n")


def _launcher_profiles(executable: str, common: str) -> str:
    """The launchers' profiles: the Python helper's interpreter, and the launch engine
    (nsbox/host/engine.py) where it is built, which creates the namespaces of one-shot runs."""
    from nsbox.host import engine

    text = _launcher_profile("nsbox", executable, common, (
        "# nsbox's launch helper may create user namespaces and hold capabilities in them; what\n"
        "# it executes (the sandboxed commands) is stacked with unpriv_nsbox, which holds no\n"
        f"# capability. {executable} is the Python interpreter nsbox runs in: every\n"
        "# program it runs gets the same permission. Install as root:\n"
        f"#   nsbox doctor --apparmor-profile > {_FILE} && apparmor_parser -r {_FILE}\n"
        "abi <abi/4.0>,\n\ninclude <tunables/global>\n\n"))
    if os.access(engine.PATH, os.X_OK):
        text += _launcher_profile("nsbox_engine", os.path.realpath(engine.PATH), common, (
            "# The launch engine, nsbox's C launcher of one-shot runs, the same way.\n"))
    return text


def _launcher_profile(name: str, executable: str, common: str, head: str) -> str:
    return (head + f"profile {name} {executable} flags=(attach_disconnected,mediate_deleted) {{\n"
            "  allow capability,\n" + common
            + f"  allow pix /** -> &{name}//&unpriv_nsbox,\n\n"
            f"  include if exists <local/{name}>\n}}\n\n")


def _refusal(checks: list[Check], facts: HostFacts) -> str | None:
    """Why namespaces are refused here, from the checks (None: they work)."""
    by_name = {check.name: check for check in checks}
    userns = by_name.get("user namespaces")
    if userns is not None and userns.status == "fail":
        return userns.detail
    probe = by_name.get("live probe")
    if probe is not None and probe.status == "fail":
        step = probe.facts.get("failed")
        apparmor = facts.read_int(_APPARMOR_SYSCTL) == 1 and facts.uid != 0
        if step in _NAMESPACE_STEPS or (step in _CAPABLE_STEPS and apparmor):
            return probe.detail
    if not facts.simulated:
        return isolation.refusal_reason()  # this process's own runs have seen it
    return None


def _remedy(facts: HostFacts, reason: str) -> str:
    """The host change that gives runs namespaces."""
    if "apparmor" in reason.lower() or (facts.read_int(_APPARMOR_SYSCTL) == 1 and facts.uid):
        return (f"as root, install the AppArmor profile for nsbox's launcher: 'nsbox doctor "
                f"--apparmor-profile > {_FILE} && apparmor_parser -r {_FILE}' (or, for the "
                "whole machine, sysctl -w kernel.apparmor_restrict_unprivileged_userns=0)")
    if facts.read_int("/proc/sys/user/max_user_namespaces") == 0:
        return "sysctl -w user.max_user_namespaces=15000 (and set it in /etc/sysctl.d/)"
    if facts.read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0 and facts.uid:
        return "sysctl -w kernel.unprivileged_userns_clone=1, or run nsbox as root"
    return ("inside a container: run it with --security-opt seccomp=unconfined --security-opt "
            "systempaths=unconfined; elsewhere see the checks above")


def check_isolation(checks: list[Check], facts: HostFacts, policy: Policy) -> Check:
    """The mode a run of ``policy`` gets here, why, and the change for full isolation."""
    reason = _refusal(checks, facts)
    abi = isolation.kernel_abi()
    landlock = abi >= _landlock.MIN_ABI
    have = f"Landlock ABI {abi}" if abi else "no Landlock"
    affects = [FILESYSTEM, PROCESSES, NETWORK]
    if policy.isolation == isolation.NAMESPACES or (reason is None and policy.isolation == "auto"):
        if reason is None:
            return Check("isolation", "ok", "runs get namespaces", facts={"mode": "namespaces"})
        return Check("isolation", "fail", f"the policy asks for namespaces, which this host "
                     f"refuses ({reason})", affects, _remedy(facts, reason) + "; or isolation "
                     "= \"auto\" for the Landlock mode", {"mode": "refused", "reason": reason})
    why = reason or "the policy asks for it"
    if not landlock:
        return Check("isolation", "fail", f"runs get no isolation: {why}, and the Landlock "
                     f"mode needs Landlock ABI {_landlock.MIN_ABI} (this kernel has {have})",
                     affects, "boot Linux 6.7 or later with landlock in the lsm= list"
                     + (f"; or {_remedy(facts, reason)}" if reason else ""),
                     {"mode": "refused", "reason": why, "landlock_abi": abi})
    detail = (f"runs get the Landlock mode ({have}): {why}; what is weaker than with "
              "namespaces: the isolation_weaker of every result (nsbox run --json)")
    if reason is None:
        return Check("isolation", "info", detail, facts={"mode": "landlock", "landlock_abi": abi})
    return Check("isolation", "warn", detail, affects, _remedy(facts, reason),
                 {"mode": "landlock", "reason": reason, "landlock_abi": abi})


def settle(checks: list[Check], facts: HostFacts, policy: Policy) -> list[Check]:
    """The checks with the ``isolation`` check added; where runs get the Landlock mode, the
    refusals of namespaces found above are what it costs (warnings), not failures."""
    verdict = check_isolation(checks, facts, policy)
    if verdict.facts.get("mode") == isolation.LANDLOCK:
        for check in checks:
            if check.name in _NAMESPACE_CHECKS and check.status == "fail":
                check.status = "warn"
                check.detail += "; runs get the Landlock mode instead (see isolation)"
    return [*checks, verdict]


def verdicts(checks: list[Check], guarantees: dict[str, str]) -> dict[str, str]:
    """The guarantees with ``isolation`` (namespaces, landlock, refused) first; in the Landlock
    mode there are no namespaces."""
    mode = next((c.facts.get("mode") for c in checks if c.name == "isolation"), "namespaces")
    if mode == isolation.LANDLOCK:
        guarantees = {**guarantees, "namespaces": "none"}
    return {"isolation": str(mode), **guarantees}
