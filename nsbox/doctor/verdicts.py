"""The verdict per guarantee: what a run gets here, predicted from the checks and confirmed by a
real launch through the production path (``check_launch``).

A guarantee is "enforced" (namespaces, seccomp, identity), "cgroup", "rlimit" or "none" (limits),
"off" (the policy turned it off) or "refused" (the run does not start: the host cannot give what
the policy requires). docs/hosts.md shows the verdicts of each kind of host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nsbox.doctor.report import FILESYSTEM, NETWORK, PRIVILEGE, PROCESSES, SYSCALLS, Check
from nsbox.errors import CommandNotFound, HostError, NsboxError
from nsbox.policy.policy import Policy
from nsbox.result import Result

# Per failed probe step: the guarantees lost and what to do.
PROBE_ADVICE: dict[str, tuple[list[str], str]] = {
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



# What a run gets for each guarantee: "enforced" (namespaces, seccomp, identity), "cgroup",
# "rlimit" or "none" (limits), "off" (the policy turned it off), "refused" (the run does not
# start: the host cannot give what the policy requires).
GUARANTEES = ("isolation", "namespaces", "seccomp", "identity", "memory", "pids", "cpus",
              "cpu_time")
LIMITS = ("memory", "pids", "cpus", "cpu_time")
# The guarantee of each cgroup feature, and what replaces it without the cgroup
# (nsbox/policy/limits.py).
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
    rlimit replaced, nsbox/policy/limits.py) or the error it raised. ``limits``: those it asked
    for."""
    if isinstance(outcome, HostError) and outcome.feature == "cgroup":
        verdicts = {"isolation": "refused", "namespaces": "enforced", "identity": "enforced",
                    "seccomp": "enforced" if policy.seccomp.enabled else "off"}
        return verdicts | dict.fromkeys(limits, "refused")
    if isinstance(outcome, Exception):
        return dict.fromkeys(("isolation", "namespaces", "seccomp", "identity", *limits),
                             "refused")
    landlock = outcome.isolation == "landlock"  # no namespaces (nsbox/host/isolation.py)
    verdicts = {"isolation": outcome.isolation, "namespaces": "none" if landlock else "enforced",
                "identity": "enforced", "seccomp": "enforced" if policy.seccomp.enabled else "off"}
    # Each entry of Result.degraded starts with the limit's name ("memory: RLIMIT_AS ...").
    degraded = {entry.split(":", 1)[0] for entry in outcome.degraded}
    for limit in limits:
        verdicts[limit] = _WITHOUT_CGROUP[limit] if limit in degraded else "cgroup"
    return verdicts


def _trial_policy(policy: Policy) -> Policy:
    """``policy`` with every limit set, so that one run shows how each is enforced."""
    from nsbox.policy.policy import MiB

    limits = dataclasses.replace(
        policy.limits, memory=policy.limits.memory or 256 * MiB, pids=policy.limits.pids or 64,
        cpus=policy.limits.cpus or 1.0, cpu_time=policy.limits.cpu_time or 10.0,
        wall_time=10.0)
    return dataclasses.replace(policy, limits=limits)


# A launch step without a hint of its own (nsbox/launch/launcher.py gives the known ones), by the
# probe step that does the same work.
_LAUNCH_STEPS = {
    "create namespaces": "mount, pid, net, ipc, uts and cgroup namespaces",
    "make mounts private": "private mounts", "mount tmpfs root": "tmpfs root",
    "proc /proc": "mount /proc", "pivot_root": "pivot_root", "seccomp": "seccomp filter",
}


def _launch_advice(step: str) -> str:
    probe_step = _LAUNCH_STEPS.get(step)
    if probe_step is not None:
        return PROBE_ADVICE[probe_step][1]
    return "see the checks above; the step names what the kernel refused"


def check_launch(policy: Policy, predicted: dict[str, str]) -> Check:
    """A real launch through the production path (nsbox.run of ``true`` with the profile and
    every limit set): it fails at the step a run would fail at, with that run's hint, and its
    Result says which limits the cgroups enforce. Compared with the prediction."""
    from nsbox.api import run

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
