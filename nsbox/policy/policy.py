"""The policy: an immutable description of one sandbox.

A Policy is what a profile (TOML) and the caller's overrides produce; the launch turns it into a
Plan. The field defaults here are the schema defaults documented in docs/profiles.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from nsbox.errors import PolicyError
from nsbox.policy import identity, rules
from nsbox.policy.checks import (
    flag,
    memory,
    number,
    optional_path,
    quote,
    seconds,
    size,
    text,
    type_name,
    whole,
)
from nsbox.policy.limittable import COUNT, DURATION, FLAG, LIMITS, SHARE, SIZE
from nsbox.policy.rules import SECRETS

KiB = 1024
MiB = 1024 * KiB


# --- filesystem: mounts are data, applied in order -------------------------------------------


@dataclass(frozen=True)
class Bind:
    """Bind a host path into the sandbox; read-only unless ``writable``.

    A source that is a symlink on the host is reproduced as the same symlink (so the merged-usr
    links /bin -> usr/bin come out right on every host).
    """

    source: str
    target: str
    writable: bool = False
    optional: bool = False
    kind: Literal["bind"] = "bind"


@dataclass(frozen=True)
class Tmpfs:
    """A size-capped tmpfs."""

    target: str
    size: int = 16 * MiB
    mode: int = 0o755
    kind: Literal["tmpfs"] = "tmpfs"

    def __post_init__(self) -> None:
        _check_tmpfs(self)  # size 0 would be a tmpfs without a limit (tmpfs(5))


@dataclass(frozen=True)
class File:
    """A file with the given content, created read-only inside the sandbox."""

    target: str
    content: str
    mode: int = 0o644
    kind: Literal["file"] = "file"


@dataclass(frozen=True)
class Symlink:
    target: str
    points_to: str
    kind: Literal["symlink"] = "symlink"


@dataclass(frozen=True)
class Dir:
    target: str
    mode: int = 0o755
    kind: Literal["dir"] = "dir"


Mount = Bind | Tmpfs | File | Symlink | Dir

# The closed set of mount kinds, by their ``kind``: the policy's type check (_check_policy), the
# profile's TOML form (profiles/schema.py reads, profiles/writers.py writes a kind from its
# fields) and the plan's operation (plan.py, MOUNT_OPS) all come from here.
MOUNT_KINDS: dict[str, type[Mount]] = {cls.kind: cls for cls in (Bind, Tmpfs, File, Symlink, Dir)}

# What programs on the host need to run: /usr and the merged-usr links, and the dynamic
# linker's cache. Nothing else of the host's /etc.
DEFAULT_MOUNTS: tuple[Mount, ...] = (
    Bind("/usr", "/usr"),
    Bind("/bin", "/bin", optional=True),
    Bind("/sbin", "/sbin", optional=True),
    Bind("/lib", "/lib", optional=True),
    Bind("/lib64", "/lib64", optional=True),
    Bind("/lib32", "/lib32", optional=True),
    Bind("/etc/ld.so.cache", "/etc/ld.so.cache", optional=True),
    Bind("/etc/alternatives", "/etc/alternatives", optional=True),
    # The host's time zone, so that local times inside match the host's.
    Bind("/etc/localtime", "/etc/localtime", optional=True),
)


# --- limits ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``None`` means "no limit of this kind".

    The defaults are the shipped ``default`` profile's (``nsbox profiles show default``): the API
    and the command line start from the same sandbox.
    """

    wall_time: float | None = 60.0  # seconds
    output: int = 1 * MiB  # bytes of stdout + stderr kept
    memory: int | None = 512 * MiB
    pids: int | None = 128
    cpus: float | None = None  # share of cores, e.g. 0.5
    cpu_time: float | None = 60.0  # seconds of CPU
    open_files: int = 1024
    file_size: int | None = 256 * MiB  # bytes; RLIMIT_FSIZE
    tmp_size: int = 64 * MiB
    workspace_size: int | None = 256 * MiB  # None: only with a host-directory workspace
    shm_size: int = 16 * MiB
    require_cgroup: bool = False  # fail instead of falling back to rlimits

    def __post_init__(self) -> None:
        _check_limits(self)  # NaN, 2^64, 0 or "5" never weaken a limit, None only where allowed


# --- network -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """``none``: a new network namespace, nothing up. ``loopback``: the same with lo up.
    ``allow``: loopback plus a proxy to the allow-listed hosts (an empty list means ``none``)."""

    mode: Literal["none", "loopback", "allow"] = "none"
    allow: tuple[str, ...] = ()
    # allow mode: where the proxy listens inside, and its limits (docs/network.md)
    proxy_port: int = 3128
    max_connections: int = 32
    max_bytes: int = 256 * MiB
    connect_timeout: float = 10.0
    idle_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.mode == "none" and not self.allow:
            return  # the default; the rules load ipaddress (1.5 ms), only when needed
        from nsbox.policy.netrules import check_network

        check_network(self)

    @property
    def effective_mode(self) -> str:
        """``allow`` with an empty allow-list is ``none``: never "everything"."""
        return "none" if self.mode == "allow" and not self.allow else self.mode


# --- seccomp -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeccompArg:
    """A condition on one syscall argument: ``arg[index] <op> value`` (op as in libseccomp:
    eq, ne, lt, le, gt, ge, masked_eq; ``mask`` only for masked_eq)."""

    index: int
    op: str
    value: int
    mask: int = 0


@dataclass(frozen=True)
class SeccompRule:
    """``action`` is ``allow``, ``kill`` or ``errno:NAME`` (e.g. ``errno:EPERM``)."""

    syscall: str
    action: str
    args: tuple[SeccompArg, ...] = ()


@dataclass(frozen=True)
class Seccomp:
    """The filter: nsbox's built-in deny rules plus ``rules``. A rule for a syscall replaces
    every built-in rule for that syscall (docs/seccomp.md)."""

    enabled: bool = True
    default_action: str = "allow"  # for syscalls neither the built-in policy nor rules name
    rules: tuple[SeccompRule, ...] = ()
    log_denied: bool = False  # learning mode: report denied syscalls, still deny them


# Masked in a project workspace: the rule book's list of credentials (rules.SECRETS: matched at
# any depth, in any case), and any config under a .git that holds credentials
# (nsbox/host/projectmasks.py).
DEFAULT_PROJECT_SECRETS = SECRETS


# --- the types and ranges of the fields (Limits, Tmpfs, Policy check them in __post_init__) ---

def _check_share(value: Any, key: str) -> None:
    cpus = number(value, key, "a share of cores")
    if not 0 < cpus <= 1 << 20:
        raise PolicyError(f"{quote(cpus)} is out of range (more than 0, at most {1 << 20})",
                          key=key)


# How a limit of each kind of the table is checked (its range is the kernel's; a profile's is
# the table's own, nsbox/profiles/schema.py).
_LIMIT_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    DURATION: seconds,
    SIZE: size,
    COUNT: lambda value, key: whole(value, key, 1, 2**31 - 1),
    SHARE: _check_share,
    FLAG: flag,
}


def _check_limits(limits: Any) -> None:
    """Types and ranges of Limits, each by its kind in the table of limits
    (nsbox/policy/limittable.py): None only where the table allows no limit; zero only where its
    range starts at zero."""
    for spec in LIMITS:
        value, key = getattr(limits, spec.name), f"limits.{spec.name}"
        if value is None and spec.nullable:
            continue
        if spec.name == "memory":
            memory(value, key)  # a bare number under a page is a missing unit
        elif spec.kind == SIZE and spec.low == 0:
            size(value, key, low=0)
        elif spec.kind == COUNT:  # the table's low (pids: 2, init counts), the kernel's high
            whole(value, key, spec.low, 2**31 - 1)
        else:
            _LIMIT_CHECKS[spec.kind](value, key)


def _check_tmpfs(mount: Any) -> None:
    key = f"tmpfs {quote(mount.target)} size"
    if mount.size == 0 and not isinstance(mount.size, bool):
        # tmpfs(5): size=0 means no limit at all; a sandbox's tmpfs always has one.
        raise PolicyError("0 would be a tmpfs without a size limit", key=key,
                          hint="give its size in bytes, e.g. 64 * 1024 * 1024")
    size(mount.size, key)
    whole(mount.mode, f"tmpfs {quote(mount.target)} mode", 0, 0o7777,
          "a mode (an int, e.g. 0o755)")


def _one_of(kinds: tuple[type, ...]) -> str:
    """The mount classes a policy takes, as in "a Bind, Tmpfs or Dir"."""
    names = [kind.__name__ for kind in kinds]
    return "a " + (", ".join(names[:-1]) + " or " if len(names) > 1 else "") + names[-1]


def _check_policy(value: Any) -> None:
    """The types of a Policy's fields (the path rules are nsbox.policy.rules')."""
    if not isinstance(value.mounts, (tuple, list)):
        raise PolicyError(f"expected a tuple of mounts, got {type_name(value.mounts)} "
                          f"{quote(value.mounts)}", key="mounts")
    kinds = tuple(MOUNT_KINDS.values())
    for i, mount in enumerate(value.mounts):
        if not isinstance(mount, kinds):
            raise PolicyError(f"expected {_one_of(kinds)}, got {type_name(mount)} {quote(mount)}",
                              key=f"mounts[{i}]")
    if not isinstance(value.env, (tuple, list)):
        raise PolicyError(f"expected (name, value) pairs, got {type_name(value.env)}", key="env")
    for i, pair in enumerate(value.env):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise PolicyError(f"expected a (name, value) pair, got {quote(pair)}",
                              key=f"env[{i}]")
        # Types here; names and values (NUL, '=') are the rule book's "env-text".
        text(pair[0], f"env[{i}] name", empty=False, nul=False)
        text(pair[1], f"env[{quote(pair[0])}]", nul=False)
    if isinstance(value.env_passthrough, str) or not isinstance(value.env_passthrough,
                                                                 (tuple, list)):
        raise PolicyError(f"expected a tuple of names, got {quote(value.env_passthrough)}",
                          key="env_passthrough")
    for name in value.env_passthrough:
        text(name, "env_passthrough", empty=False)
    for name in ("name", "description"):
        text(getattr(value, name), name)
    for name in ("path", "lang", "user", "hostname"):  # their content: the rule book's
        text(getattr(value, name), name, nul=False)
    for name in ("uid", "gid", "host_uid", "host_gid"):
        whole(getattr(value, name), name, 0, 2**32 - 2)
    optional_path(value.workspace, "workspace")
    if value.isolation not in ISOLATION_MODES:
        raise PolicyError(f"{quote(value.isolation)} is not one of "
                          f"{', '.join(ISOLATION_MODES)}", key="isolation")
    for name, kind in (("limits", Limits), ("network", Network), ("seccomp", Seccomp)):
        if not isinstance(getattr(value, name), kind):
            raise PolicyError(f"expected a nsbox.{kind.__name__}, got "
                              f"{type_name(getattr(value, name))} {quote(getattr(value, name))}",
                              key=name)


# --- the whole policy --------------------------------------------------------------------------

# How the sandbox is isolated (nsbox/host/isolation.py): namespaces where the host allows them,
# else the Landlock mode ("auto"); or only the one named.
ISOLATION_MODES = ("auto", "namespaces", "landlock")


@dataclass(frozen=True)
class Policy:
    name: str = "default"
    description: str = ""  # one line first, as `nsbox profiles` lists it
    mounts: tuple[Mount, ...] = DEFAULT_MOUNTS
    env: tuple[tuple[str, str], ...] = ()
    env_passthrough: tuple[str, ...] = ()
    path: str = "/usr/local/bin:/usr/bin:/bin"
    lang: str = "C.UTF-8"
    uid: int = 1000  # inside the sandbox
    gid: int = 1000
    user: str = "sandbox"
    hostname: str = "nsbox"
    # When the launcher holds CAP_SETUID/CAP_SETGID (root), the sandbox user maps to this
    # unprivileged uid/gid; never 0 (nsbox/policy/identity.py).
    host_uid: int = 65534
    host_gid: int = 65534
    workspace: str | None = None  # host directory bound read-write at /workspace; None: tmpfs
    # A host directory seen copy-on-write at /workspace: its changes are reviewed and applied
    # by the host (nsbox/host/project.py); files matching project_secrets are masked.
    project: str | None = None
    project_secrets: tuple[str, ...] = DEFAULT_PROJECT_SECRETS
    limits: Limits = field(default_factory=Limits)
    network: Network = field(default_factory=Network)
    seccomp: Seccomp = field(default_factory=Seccomp)
    # Rules of nsbox/policy/rules.py this policy lifts, each by name (docs/rules.md); for trusted
    # callers only. Give them in the same replace() as what they allow.
    allow_rules: tuple[str, ...] = ()
    isolation: Literal["auto", "namespaces", "landlock"] = "auto"

    def __post_init__(self) -> None:
        _check_policy(self)  # types and ranges first: the rules read the values
        identity.check_host_ids(self.host_uid, self.host_gid)  # never host root, at every door
        rules.check_policy(self)

    def replace(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, **changes)

    def with_limits(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, limits=dataclasses.replace(self.limits, **changes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A stable hash of the policy (for caches and the audit record)."""
        import hashlib  # not at import: `nsbox run` has no use for it (docs/performance.md)

        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()
