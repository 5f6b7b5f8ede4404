"""Policy -> Plan: the ordered, typed setup operations of one launch.

The plan is plain data (JSON-able) because it crosses into the launch helper. Host paths are
resolved here, once, by the host side; the sandbox side never resolves a host path itself: the
helper opens every bind source and the child mounts it through the open descriptor.

Mount order is part of the contract: the structure first (tmpfs root), then the policy's mounts
in the order given, then /etc's synthetic files, /dev, /proc, /tmp and /workspace, so that the
policy cannot hide or replace those.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nsbox import rules
from nsbox._wire import WirePlan
from nsbox.errors import PolicyError, SetupError
from nsbox.host import idfilter, pathrules
from nsbox.host import network as netmod
from nsbox.host import seccomp as seccompmod
from nsbox.limits import plan_limits
from nsbox.policy import Bind, Mount, Policy

WORKSPACE = "/workspace"
# Devices a program expects; no console, nothing that reaches hardware. /dev/tty is only ever
# the opener's own controlling terminal: after setsid none (ENXIO), or a pty of the sandbox's
# own devpts instance (sandbox/mounts.py, mount_devpts).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass
class Plan:
    """Everything the helper and the sandbox child need, as plain data."""

    argv: list[str]
    env: list[tuple[str, str]]
    cwd: str
    uid: int
    gid: int
    user: str
    hostname: str
    mounts: list[dict[str, Any]]
    wall_time: float | None
    rlimits: list[tuple[int, int, int]] = field(default_factory=list)
    seccomp_bpf: str | None = None  # hex of the compiled BPF program
    # Learning mode: how the helper answers the filter's notifications (nsbox/host/seccomp.py).
    seccomp_notify: dict[str, Any] | None = None
    # The set-id filter (seccomp_rules.SETID_RULES), hex: loaded into every sandbox, policy or not.
    setid_bpf: str = ""
    net: dict[str, Any] = field(default_factory=dict)
    cgroup: dict[str, Any] = field(default_factory=dict)
    # "landlock": no namespaces, the rules in ``landlock`` (nsbox/landlockplan.py) instead.
    isolation: str = "namespaces"
    landlock: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire: WirePlan = {
            "argv": self.argv, "env": self.env, "cwd": self.cwd, "uid": self.uid,
            "gid": self.gid, "user": self.user, "hostname": self.hostname,
            "mounts": self.mounts, "wall_time": self.wall_time, "rlimits": self.rlimits,
            "seccomp_bpf": self.seccomp_bpf, "seccomp_notify": self.seccomp_notify,
            "setid_bpf": self.setid_bpf,
            "net": self.net, "cgroup": self.cgroup,
        }
        if self.isolation != "namespaces":
            wire["isolation"] = self.isolation
            wire["landlock"] = self.landlock
        return dict(wire)  # typed above; each door adds its keys (WirePlan) before sending


def _bind_ops(mount: Bind, key: str, allow: tuple[str, ...],
              host: pathrules.HostView | None) -> list[dict[str, Any]]:
    target = rules.check_target(mount.target, f"{key}.target", mount.kind)
    source = os.path.abspath(mount.source)
    if os.path.islink(source) and not mount.writable and mount.source == mount.target:
        # Reproduce the host's link (e.g. the merged-usr /bin -> usr/bin) instead of binding
        # what it points to twice.
        return [{"op": "symlink", "target": target, "points_to": os.readlink(source)}]
    real = rules.resolve(source, f"{key}.source")
    # A refused place is refused whether or not it exists here (a link to /root/.ssh).
    rules.check_spelling(real, mount.writable, allow, f"{key}.source")
    if not os.path.exists(real):
        if mount.optional:
            return []
        raise SetupError(
            f"bind {target}", 2, f"source {mount.source} does not exist on the host",
            hint="check the path, or mark the mount optional in the profile",
        )
    # What the resolved source is, after every symlink and through any alias (host/pathrules.py).
    if host is not None:
        real = pathrules.check_source(real, writable=mount.writable, allow=allow,
                                  key=f"{key}.source", host=host)
    return [{
        "op": "bind", "source": real, "target": target, "writable": mount.writable,
        "is_dir": os.path.isdir(real),
    }]


def _plain_op(mount: Mount, key: str, _allow: tuple[str, ...],
              _host: pathrules.HostView | None) -> list[dict[str, Any]]:
    """A kind whose operation is its own fields, the target checked: tmpfs, file, symlink, dir
    (nsbox/sandbox/mounts.py has a handler for each)."""
    target = rules.check_target(mount.target, f"{key}.target", mount.kind)
    fields = {spec.name: getattr(mount, spec.name) for spec in dataclasses.fields(mount)
              if spec.name != "kind"}
    return [{"op": mount.kind, **fields, "target": target}]


# The plan's operations of each kind of policy.MOUNT_KINDS, in the order the policy gives them.
MOUNT_OPS: dict[str, Callable[[Any, str, tuple[str, ...], pathrules.HostView | None],
                              list[dict[str, Any]]]] = {
    "bind": _bind_ops, "tmpfs": _plain_op, "file": _plain_op, "symlink": _plain_op,
    "dir": _plain_op,
}


def _mount_ops(mount: Mount, key: str, allow: tuple[str, ...],
               host: pathrules.HostView | None) -> list[dict[str, Any]]:
    ops = MOUNT_OPS.get(str(getattr(mount, "kind", "")))
    if ops is None:
        raise PolicyError(f"unknown mount kind {type(mount).__name__}", key="mounts")
    return ops(mount, key, allow, host)


# Programs look up uid 0 and nobody by number (tarfile, shutil.chown, ls -l, id): a normal
# host always has them. Homes and shells are paths that exist inside (there is no /root and no
# host home): root's home is the read-only "/", the sandbox's user is at home in /workspace
# (as $HOME says), nobody gets the usual nologin from the bound /usr.
_ROOT_ENTRY = ("root", 0, 0, "/", "/bin/sh")
_NOBODY_ENTRY = ("nobody", 65534, 65534, "/", "/usr/sbin/nologin")
_NOGROUP_ENTRY = ("nogroup", 65534)


def _passwd(policy: Policy) -> str:
    entries = [(policy.user, policy.uid, policy.gid, WORKSPACE, "/bin/sh")]
    taken_names, taken_ids = {policy.user}, {policy.uid}
    for name, uid, gid, home, shell in (_ROOT_ENTRY, _NOBODY_ENTRY):
        if name not in taken_names and uid not in taken_ids:
            entries.append((name, uid, gid, home, shell))
    return "".join(f"{name}:x:{uid}:{gid}:{name}:{home}:{shell}\n"
                   for name, uid, gid, home, shell in entries)


def _group(policy: Policy) -> str:
    entries = [(policy.user, policy.gid)]
    for name, gid in (("root", 0), _NOGROUP_ENTRY):
        if all(name != taken and gid != taken_gid for taken, taken_gid in entries):
            entries.append((name, gid))
    return "".join(f"{name}:x:{gid}:\n" for name, gid in entries)


def _environment(policy: Policy, extra_env: dict[str, str] | None) -> list[tuple[str, str]]:
    """The caller's environment never passes, except the names the policy lists."""
    env: dict[str, str] = {"PATH": policy.path, "HOME": WORKSPACE, "LANG": policy.lang}
    for name in policy.env_passthrough:
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(dict(policy.env))
    env.update(extra_env or {})
    env.update(netmod.proxy_env(policy.network))
    return sorted(env.items())


def command_part(policy: Policy, argv: list[str], *, env: dict[str, str] | None = None,
                 cwd: str | None = None, wall_time: float | None = None) -> dict[str, Any]:
    """The command's part of a plan (argv, env, cwd, wall_time): in every plan ``build``
    makes, and all that a pool's sandbox, built ahead, still needs (nsbox/pool.py)."""
    if not argv or not argv[0]:
        raise PolicyError("no command given", key="argv")
    return {
        "argv": list(argv),
        "env": _environment(policy, env),
        "cwd": cwd or WORKSPACE,
        "wall_time": wall_time if wall_time is not None else policy.limits.wall_time,
    }


def build(
    policy: Policy,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    wall_time: float | None = None,
    check_sources: bool = True,
) -> Plan:
    """The plan of one launch. ``check_sources=False`` is for a command of a session, whose
    sandbox (and its binds, checked when it started) exists already: what the sandbox has
    written into its workspace since (a socket of its own) is not the host's."""
    command = command_part(policy, argv, env=env, cwd=cwd, wall_time=wall_time)
    mounts: list[dict[str, Any]] = []
    host = pathrules.HostView.current() if check_sources else None
    allow = policy.allow_rules
    for i, mount in enumerate(policy.mounts):
        mounts.extend(_mount_ops(mount, f"mounts[{i}]", allow, host))
    mounts += [
        {"op": "file", "target": "/etc/passwd", "content": _passwd(policy), "mode": 0o644},
        {"op": "file", "target": "/etc/group", "content": _group(policy), "mode": 0o644},
        {"op": "file", "target": "/etc/hostname", "content": policy.hostname + "\n",
         "mode": 0o644},
        {"op": "file", "target": "/etc/hosts",
         "content": f"127.0.0.1 localhost {policy.hostname}\n::1 localhost\n", "mode": 0o644},
        {"op": "dev", "target": "/dev", "devices": list(DEVICES),
         "shm_size": policy.limits.shm_size},
        {"op": "proc", "target": "/proc"},
        {"op": "tmpfs", "target": "/tmp", "size": policy.limits.tmp_size, "mode": 0o1777},
    ]
    if policy.workspace is None and policy.limits.workspace_size is None:
        raise PolicyError("'none' is only for a host-directory workspace: a tmpfs workspace "
                          "(or a project's copy-on-write layer) always has a size",
                          key="limits.workspace_size",
                          hint="give a size, e.g. 1G, or a host directory as the workspace "
                          "(--workspace DIR)")
    if policy.project is not None:
        from nsbox.host import project  # its copy-on-write machinery: only for a project

        mounts.append(project.plan_op(policy, allow, host))
    elif policy.workspace is None:
        mounts.append({"op": "tmpfs", "target": WORKSPACE, "size": policy.limits.workspace_size,
                       "mode": 0o755, "owned": True})
    else:
        real = rules.resolve(policy.workspace, "workspace")
        rules.check_spelling(real, True, allow, "workspace")
        if not os.path.isdir(real):
            raise SetupError(
                f"bind {WORKSPACE}", 2, f"workspace {policy.workspace} is not a directory",
                hint="create it first, or leave the workspace out for a fresh tmpfs",
            )
        if host is not None:
            real = pathrules.check_source(real, writable=True, allow=allow, key="workspace",
                                      host=host)
        mounts.append({"op": "bind", "source": real, "target": WORKSPACE, "writable": True,
                       "is_dir": True})
    program = None
    # Compiled (or loaded from the cache) here, in the host process; the child only loads
    # the bytes. A cache inside a directory the sandbox can write is not used.
    writable = [op["source"] for op in mounts if op["op"] == "bind" and op["writable"]]
    if policy.seccomp.enabled:
        program = seccompmod.load(policy.seccomp, untrusted_dirs=writable)
    limits = plan_limits(policy.limits)  # rlimits for the child, the cgroup request (limits.py)
    return Plan(
        **command,
        uid=policy.uid,
        gid=policy.gid,
        user=policy.user,
        hostname=policy.hostname,
        mounts=mounts,
        net=netmod.plan_net(policy.network),
        seccomp_bpf=program.bpf.hex() if program else None,
        seccomp_notify=program.notify if program and program.listener else None,
        # In front of the set-id filter, as one program: EPERM, not EINVAL, for another id.
        setid_bpf=(idfilter.prefix(policy.uid, policy.gid)
                   + seccompmod.load_setid(untrusted_dirs=writable).bpf).hex(),
        rlimits=limits["rlimits"],
        cgroup=limits["cgroup"],
    )
