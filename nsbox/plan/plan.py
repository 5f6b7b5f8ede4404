"""Policy -> Plan: the ordered, typed setup operations of one launch.

The plan is plain data (JSON-able) because it crosses into the launch helper. Host paths are
resolved here, once, by the host side; the sandbox side never resolves a host path itself: the
helper opens every bind source and the child mounts it through the open descriptor.

Mount order is part of the contract: the structure first (tmpfs root), then the policy's mounts
in the order given, then the host's public /etc files (where the policy mounts nothing of its
own there), /etc's synthetic files, /dev, /proc, /tmp and /workspace, so that the policy cannot
hide or replace those.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nsbox._sys.wire import WirePlan
from nsbox.errors import PolicyError, SetupError
from nsbox.host import idfilter, pathrules
from nsbox.host import network as netmod
from nsbox.host import seccomp as seccompmod
from nsbox.policy import rules
from nsbox.policy.limits import plan_limits
from nsbox.policy.policy import Bind, Mount, Policy

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
    # "landlock": no namespaces, the rules in ``landlock`` (nsbox/plan/landlock.py) instead.
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
    # What the resolved source is, after every symlink and through any alias (host/pathrules.py).
    real = pathrules.ruled_source(source, writable=mount.writable, allow=allow,
                                  key=f"{key}.source", host=host)
    if real is None:
        if mount.optional:
            return []
        raise SetupError(
            f"bind {target}", 2, f"source {mount.source} does not exist on the host",
            hint="check the path, or mark the mount optional in the profile",
        )
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


# The host's public system files that the programs and libraries of its /usr read: the network
# databases (getservbyname, getaddrinfo(host, "http"); netbase), the resolver's settings,
# media types (Python's mimetypes), readline's settings, the time zone's name, the
# distribution's release (platform, pip), OpenSSL's configuration (the openssl command fails
# without it). Bound read-only, where the host has them readable by every user, for a policy
# that binds the host's /usr; each costs the launch a bind. Left out: what few read (rpc,
# locale.alias, debian_version, shells), the host's secrets (shadow, gshadow, ssh/,
# ssl/private/), its identity (machine-id "should be considered confidential", machine-id(5)),
# and the settings of its users, services and network (profile, bash.bashrc, environment,
# pip.conf, gitconfig, resolv.conf): docs/compatibility.md says why, one by one.
PUBLIC_ETC = ("/etc/services", "/etc/protocols", "/etc/host.conf", "/etc/gai.conf",
              "/etc/mime.types", "/etc/inputrc", "/etc/timezone", "/etc/os-release",
              "/etc/ssl/openssl.cnf")
# The system's CA store, wherever the network is allowed: curl, git, Python's ssl (through
# /usr/lib/ssl/cert.pem) and Debian's pip and requests read /etc/ssl/certs/ca-certificates.crt;
# OpenSSL's hashed names are there too. (/etc/ca-certificates.conf is read only by
# update-ca-certificates.) Its links lead to /usr/share/ca-certificates, below /usr.
CA_STORE = ("/etc/ssl/certs",)
# glibc's lookups in the files nsbox writes (passwd, group, hosts) and binds, and no host
# module (systemd, sss, ldap) that would look elsewhere (nsswitch.conf(5)).
NSSWITCH = ("passwd: files\ngroup: files\nshadow: files\ngshadow: files\nhosts: files dns\n"
            "networks: files\nprotocols: files\nservices: files\nethers: files\nrpc: files\n")


def _system_etc(policy: Policy, host: pathrules.HostView | None) -> list[dict[str, Any]]:
    """What a normal /etc holds that programs read, beyond the files of [identity]; the
    policy's own mounts win: nothing here goes at, above or below one of their targets."""
    taken = [m.target for m in policy.mounts]

    def free(target: str) -> bool:
        return not any(target == t or target.startswith(t + "/") or t.startswith(target + "/")
                       for t in taken)

    ops: list[dict[str, Any]] = []
    if any(m.kind == "bind" and m.target == "/usr" for m in policy.mounts):
        ops += [op for op in _public_etc(host) if free(op["target"])]
        if free("/etc/nsswitch.conf"):
            ops.append({"op": "file", "target": "/etc/nsswitch.conf", "content": NSSWITCH,
                        "mode": 0o644})
    if free("/etc/mtab"):  # mount(8) and older programs read the mount table there
        ops.append({"op": "symlink", "target": "/etc/mtab", "points_to": "../proc/self/mounts"})
    if policy.network.effective_mode == "allow":
        for path in CA_STORE:
            if free(path) and _public(path):
                ops += _bind_ops(Bind(path, path, optional=True), "network", (), host)
    return ops


# The binds of PUBLIC_ETC, worked out once while the host view (its mount table and homes) and
# each file (what lstat says of it) stay the same: the rules would answer the same, and each
# bind's checks cost a launch about 40 us here.
_public_etc_memo: list[Any] = [None, None, []]


def _public_etc(host: pathrules.HostView | None) -> list[dict[str, Any]]:
    view = host or pathrules.HostView.current()
    stamps = tuple(_lstamp(path) for path in PUBLIC_ETC)
    memo_view, memo_stamps, ops = _public_etc_memo
    if memo_view is not view or memo_stamps != stamps:
        ops = []
        for path in PUBLIC_ETC:
            if _public(path):
                ops += _bind_ops(Bind(path, path, optional=True), "etc", (), view)
        _public_etc_memo[:] = [view, stamps, ops]
    return [dict(op) for op in ops]


def _lstamp(path: str) -> tuple[int, ...] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_mtime_ns, st.st_ctime_ns)


def _public(path: str) -> bool:
    """Readable by every user of the host (a directory: and searchable)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    need = 0o005 if stat.S_ISDIR(st.st_mode) else 0o004
    return st.st_mode & need == need


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
    makes, and all that a pool's sandbox, built ahead, still needs (nsbox/launch/pool.py)."""
    if not argv or not argv[0]:
        raise PolicyError("no command given", key="argv")
    return {
        "argv": list(argv),
        "env": _environment(policy, env),
        # A relative cwd is under /workspace, where the command starts (as write_file's paths
        # are): resolved at "/" it named a directory the user never meant.
        "cwd": posixpath.join(WORKSPACE, cwd) if cwd else WORKSPACE,
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
    mounts += _system_etc(policy, host)
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
        real = pathrules.ruled_source(policy.workspace, writable=True, allow=allow,
                                      key="workspace", host=host, kind="dir")
        if real is None:
            raise SetupError(
                f"bind {WORKSPACE}", 2, f"workspace {policy.workspace} is not a directory",
                hint="create it first, or leave the workspace out for a fresh tmpfs",
            )
        mounts.append({"op": "bind", "source": real, "target": WORKSPACE, "writable": True,
                       "is_dir": True})
    program = None
    # Compiled (or loaded from the cache) here, in the host process; the child only loads
    # the bytes. A cache inside a directory the sandbox can write is not used.
    writable = [op["source"] for op in mounts if op["op"] == "bind" and op["writable"]]
    if policy.seccomp.enabled:
        program = seccompmod.load(policy.seccomp, untrusted_dirs=writable)
    # In front of the set-id filter, as one program: EPERM, not EINVAL, for another id.
    setid_bpf = (idfilter.prefix(policy.uid, policy.gid)
                 + seccompmod.load_setid(untrusted_dirs=writable).bpf).hex()
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
        setid_bpf=setid_bpf,
        rlimits=limits["rlimits"],
        cgroup=limits["cgroup"],
    )
