"""The policy: an immutable description of one sandbox.

A Policy is what a profile (TOML) and the caller's overrides produce; the launch turns it into a
Plan. The field defaults here are the schema defaults documented in docs/profiles.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from nsbox import identity, inputs
from nsbox.rules import SECRETS

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


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
        inputs.check_tmpfs(self)  # size 0 would be a tmpfs without a limit (tmpfs(5))


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

# The closed set of mount kinds, by their ``kind``: the policy's type check (inputs.py), the
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
        inputs.check_limits(self)  # types and ranges: NaN, 2^64 or "5" never weaken a limit


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
        from nsbox.netrules import check_network

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
    # unprivileged uid/gid; never 0 (nsbox/identity.py).
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
    # Rules of nsbox/rules.py this policy lifts, each by name (docs/rules.md); for trusted
    # callers only. Give them in the same replace() as what they allow.
    allow_rules: tuple[str, ...] = ()
    isolation: Literal["auto", "namespaces", "landlock"] = "auto"

    def __post_init__(self) -> None:
        from nsbox import rules  # a cycle otherwise: rules needs the mount classes

        inputs.check_policy(self)  # types and ranges first: the rules read the values
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
