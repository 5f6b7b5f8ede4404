"""Policy -> Plan for the Landlock mode: the same policy, without namespaces to build it from.

There is no mount namespace, so nothing can be placed anywhere: the sandbox sees the host's
paths, restricted by Landlock to what the policy binds (read-only where the bind is, read-write
for a writable bind), its workspace and a private temporary directory. A bind therefore
appears at its host path only (``target`` must equal ``source``), and the policy's other mount
kinds (tmpfs, file, symlink, dir) have no place to be made: such a policy is refused, as are a
project workspace (an overlayfs) and network modes other than ``none`` (no network namespace
to put a loopback or the proxy's listener in). docs/hosts.md, "The Landlock mode".

The workspace is the policy's host directory, or a fresh one the launch helper makes (with the
private temporary directory) for the sandbox's host uid and removes after the run. ``/workspace``
and ``/tmp`` in the command's working directory and environment (HOME, TMPDIR, a profile's
``/tmp/...``) are read as those two directories (nsbox/sandbox/landlocked.py).
"""

from __future__ import annotations

import os
import resource
from typing import Any

from nsbox._sys import landlock as _landlock
from nsbox.errors import PolicyError, SetupError
from nsbox.host import isolation, landlock_filter, pathrules
from nsbox.host import seccomp as seccompmod
from nsbox.plan import plan as planmod
from nsbox.policy import identity
from nsbox.policy.limits import plan_limits
from nsbox.policy.policy import Policy
from nsbox.result import Result


def _refuse(message: str, key: str, hint: str) -> PolicyError:
    return PolicyError(f"the Landlock mode (no namespaces): {message}", key=key, hint=hint)


def _check_policy(policy: Policy) -> None:
    hint = ("use a host that allows namespaces (`nsbox doctor` says what to change), or drop "
            "it from the policy")
    if policy.project is not None:
        raise _refuse("a project workspace needs a mount namespace (overlayfs)", "project",
                      "bind a copy of the project as the workspace (--workspace), or " + hint)
    mode = policy.network.effective_mode
    if mode != "none":
        raise _refuse(
            f"network mode {mode!r} needs a network namespace: without one, a proxy's port or a "
            "loopback is the host's, reachable on every address", "network.mode", hint)


def _read_and_write(policy: Policy, host: pathrules.HostView | None
                    ) -> tuple[list[str], list[str]]:
    """The host paths of the policy's binds, read-only and writable, checked by the rule book
    as for a namespace launch."""
    read: list[str] = []
    write: list[str] = []
    for i, mount in enumerate(policy.mounts):
        key = f"mounts[{i}]"
        if mount.kind != "bind":
            raise _refuse(f"a {mount.kind} mount at {mount.target} has nowhere to be made", key,
                          "remove it, or bind a host path at its own path instead")
        for op in planmod.MOUNT_OPS["bind"](mount, key, policy.allow_rules, host):
            if op["op"] == "symlink":
                continue  # the host's own link (/bin -> usr/bin): it is there, as it is
            if os.path.abspath(mount.source) != mount.target:
                raise _refuse(f"{mount.source} would appear at {mount.target}: a bind is seen "
                              "at its host path only", f"{key}.target",
                              f"bind it at its own path ({mount.source}:{mount.source}) and "
                              "use that path")
            (write if op["writable"] else read).append(op["source"])
    return read, write


# The host's own configuration that common programs give up on when it exists but cannot be read
# (EACCES, where a namespace sandbox has no such file at all, ENOENT): pip and other distribution
# probes (debian_version), git (gitconfig), node and OpenSSL (openssl.cnf), Python's mimetypes
# (its knownfiles below /etc: an unreadable one raises), and the public files a namespace
# sandbox has too (plan.PUBLIC_ETC: services, protocols, ... for getservbyname). Read-only, where
# present; nothing in them is the caller's.
HOST_CONFIG = (*planmod.PUBLIC_ETC, "/etc/debian_version", "/etc/gitconfig",
               "/etc/httpd/mime.types", "/etc/httpd/conf/mime.types", "/etc/apache/mime.types",
               "/etc/apache2/mime.types")


def _host_config(policy: Policy, host: pathrules.HostView | None) -> list[str]:
    found = []
    for path in HOST_CONFIG:
        # realpath: a link here that cannot be followed leaves the file out, as a missing one.
        real = pathrules.ruled_source(os.path.realpath(path), writable=False,
                                      allow=policy.allow_rules, key="isolation", host=host,
                                      kind="file")
        if real is not None:
            found.append(real)
    return found


def _workspace(policy: Policy, host: pathrules.HostView | None) -> str | None:
    if policy.workspace is None:
        return None
    real = pathrules.ruled_source(policy.workspace, writable=True, allow=policy.allow_rules,
                                  key="workspace", host=host, kind="dir")
    if real is None:
        raise SetupError("bind /workspace", 2, f"workspace {policy.workspace} is not a directory",
                         hint="create it first, or leave the workspace out for a fresh one")
    return real


def _limits(policy: Policy) -> dict[str, Any]:
    """The limits' part; RLIMIT_NPROC counts every process of the host uid here (no user
    namespace of its own), so it is only the fallback of a pids cgroup, and the child adds the
    processes that uid runs already (nsbox/sandbox/landlocked.py)."""
    limits = plan_limits(policy.limits)
    nproc = [r for r in limits["rlimits"] if r[0] == resource.RLIMIT_NPROC]
    limits["rlimits"] = [r for r in limits["rlimits"] if r[0] != resource.RLIMIT_NPROC]
    if nproc:
        limits["cgroup"]["fallback_rlimits"]["pids"] = nproc
    limits["cgroup"]["host_wide_nproc"] = True
    return limits


def weaker(policy: Policy, abi: int, own_uid: bool) -> list[str]:
    """Every guarantee that is weaker than with namespaces, one "name: what" line each."""
    who = ("the caller's own uid" if own_uid
           else f"host uid {policy.host_uid} (root's sandboxes all share it)")
    lines = [
        "files: paths are the host's (the workspace and $TMPDIR are host directories, there "
        "is no /workspace); any host path can be stat'ed (existence, size, owner, times), "
        "though not read, listed, changed or removed; the host's public /etc files "
        "(services, protocols, mime.types, ssl/openssl.cnf, ...), debian_version and "
        "gitconfig can be read",
        f"identity: the sandbox runs as {who}, without a user namespace",
        "processes: no /proc at all (ps, /proc/self, /dev/fd fail); host processes are not "
        "hidden, only out of reach",
        "ipc: the host's hostname; System V IPC, message queues, /dev/shm and keyrings refused",
        "disk: the workspace and $TMPDIR have no size limit (RLIMIT_FSIZE caps each file)",
        "network: no loopback of its own; TCP refused by Landlock, every other socket by "
        "seccomp",
    ]
    owned = "the caller's own files" if own_uid else f"files of host uid {policy.host_uid}"
    lines.append(f"metadata: the mode (short of group or other write) and times of {owned} "
                 "outside the workspace can be changed (Landlock governs contents); chown by "
                 "name, and chmod to a group- or world-writable mode, are refused (EPERM), "
                 "extended attributes and ACLs cannot be changed (ENOTSUP), also in the "
                 "workspace")
    lines.append("watches: inotify and fanotify answer ENOSYS (a watch would name the host's "
                 "files, and the instances are the uid's); tail -f and the like poll")
    if abi < _landlock.SCOPES_ABI:
        lines += [
            f"signals: Landlock ABI {abi} does not scope them (ABI 6 does): the sandbox can "
            f"signal host processes of {who}",
            "cleanup: the sandbox's init ends every process left by walking its children; a "
            "command that kills its own init can leave processes behind, unless a cgroup ends "
            "them",
        ]
    return lines


def build(policy: Policy, argv: list[str], *, env: dict[str, str] | None = None,
          cwd: str | None = None, wall_time: float | None = None,
          check_sources: bool = True) -> planmod.Plan:
    """The plan of one Landlock launch (``plan.build``'s arguments)."""
    command = planmod.command_part(policy, argv, env=env, cwd=cwd, wall_time=wall_time)
    _check_policy(policy)
    host = pathrules.HostView.current() if check_sources else None
    read, write = _read_and_write(policy, host)
    read += [path for path in _host_config(policy, host) if path not in read]
    workspace = _workspace(policy, host)
    untrusted = [*write, *([workspace] if workspace else [])]
    abi = isolation.kernel_abi()
    own_uid = not identity.Holdings.read().mapper  # decided again by the helper (identity.py)
    program = (seccompmod.load(policy.seccomp, untrusted_dirs=untrusted)
               if policy.seccomp.enabled else None)
    limits = _limits(policy)
    environment = dict(command["env"])
    environment.setdefault("TMPDIR", "/tmp")
    command["env"] = sorted(environment.items())
    plan = planmod.Plan(
        **command, uid=policy.uid, gid=policy.gid, user=policy.user, hostname=policy.hostname,
        mounts=[], net={"mode": "none"},
        seccomp_bpf=program.bpf.hex() if program else None,
        seccomp_notify=program.notify if program and program.listener else None,
        setid_bpf=seccompmod.load_setid(untrusted_dirs=untrusted).bpf.hex(),
        rlimits=limits["rlimits"], cgroup=limits["cgroup"])
    plan.isolation = isolation.LANDLOCK
    plan.landlock = {
        "abi": abi, "read": read, "write": write, "workspace": workspace,
        "devices": [f"/dev/{name}" for name in planmod.DEVICES],
        "bpf": landlock_filter.load(untrusted).bpf.hex(),
        "weaker": weaker(policy, abi, own_uid),
    }
    return plan


def mark_result(result: Result, wire: dict[str, Any]) -> None:
    """A Landlock launch's Result names the mode and what is weaker in it."""
    if wire.get("isolation") == isolation.LANDLOCK:
        result.isolation = isolation.LANDLOCK
        result.isolation_weaker = list(wire["landlock"]["weaker"])
