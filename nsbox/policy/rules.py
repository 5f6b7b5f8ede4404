"""The rule book: what a sandbox may be given, one copy for every door.

Every way a policy comes in (the Python API, profiles, ``--set`` and the other CLI options,
``run(workspace=)``, ``Session``, ``Pool``, the MCP server's ``--input``, Ray) ends in a
``Policy`` and then in a plan, and both call this module:

- ``check_policy`` runs when a ``Policy`` is made (its ``__post_init__``) and checks what the
  policy alone tells: mount targets, identity strings, environment text, and the spelling of
  every host path (so ``Bind("/run", ...)`` fails at once, where the mistake was written);
- ``check_source`` (nsbox/host/pathrules.py) runs when the plan is built (nsbox/plan/plan.py), on
  the resolved host path: it asks what the path *is* (which filesystem, which directory of it,
  after every symlink and through bind-mounted aliases: /proc/self/mountinfo), not how it is
  spelled, and looks inside the tree for unix sockets and FIFOs.

A refusal is a ``PolicyError`` whose ``rule`` is the rule's short name, with the key when there
is one. A trusted caller may lift one rule by naming it (``Policy(allow_rules=("bind-run",))``,
the profile key ``allow_rules``, ``nsbox run --allow-rule NAME``); rules that protect nsbox's
own setup cannot be lifted; there is no "allow everything". docs/rules.md is the reference.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nsbox.errors import PolicyError, suggest

if TYPE_CHECKING:
    from nsbox.policy.policy import Mount, Policy


@dataclass(frozen=True)
class Rule:
    name: str
    refuses: str  # what the rule refuses, one line (docs/rules.md shows the same table)
    why: str
    remedy: str
    can_allow: bool = True  # whether allow_rules may lift it


RULES: dict[str, Rule] = {rule.name: rule for rule in (
    # --- targets: where things go inside the sandbox (nsbox sets these up itself) ---
    Rule("target-path", "a mount target that is relative, holds '..' or is / itself",
         "targets are paths in the sandbox's own root", 'write an absolute path such as "/data"',
         can_allow=False),
    Rule("target-reserved", "a mount target at or below /proc, /dev, /tmp or /workspace",
         "nsbox mounts these after the policy's mounts, which would hide them",
         "for /workspace use workspace.path (--workspace DIR, or --project DIR for a "
         "copy-on-write view); for /tmp limits.tmp_size", can_allow=False),
    Rule("nsbox-files", "a mount at /etc/passwd, /etc/group, /etc/hostname or /etc/hosts, "
         "or a bind or symlink at /etc (which holds them)",
         "nsbox writes these files from [identity]; through a bind it would write the host's",
         "bind the parts of /etc the sandbox needs one by one (e.g. /etc/ssl)", can_allow=False),
    # --- identity and environment text ---
    Rule("identity-text", "a user or host name with characters /etc/passwd or /etc/hosts "
         "cannot carry (newline, NUL, ':', spaces...)",
         "a newline would add lines to those files", "use letters, digits, '_', '-' ('.' in "
         "host names)", can_allow=False),
    Rule("env-text", "an environment name or value, PATH or LANG holding NUL, or a name with '='",
         "execve(2) cannot carry them; the value would be cut silently",
         "remove the character", can_allow=False),
    # --- bind sources and workspaces: what the host path is ---
    Rule("bind-root", "the host's root directory as a bind source or workspace",
         "it holds everything else this table refuses", "bind the directories the sandbox needs"),
    Rule("bind-proc", "a source at or below the host's /proc (or on any proc or nsfs "
         "filesystem)", "host processes' command lines, environments and kernel knobs",
         "nsbox gives the sandbox a /proc of its own"),
    Rule("bind-sys", "a source at or below /sys (or on sysfs, cgroup, debugfs, tracefs, "
         "securityfs, bpf, configfs, pstore, efivarfs)",
         "kernel and hardware interfaces of the host", "none needed inside a sandbox"),
    Rule("bind-dev", "a source at or below the host's /dev (or on devtmpfs, devpts, mqueue, "
         "hugetlbfs)", "device nodes, terminals, shared memory of the host",
         "nsbox gives the sandbox null, zero, full, random, urandom and its own /dev/shm"),
    Rule("bind-run", "a source at or below /run or /var/run",
         "the host's service sockets (docker.sock, dbus, systemd) live there",
         "bind the one file the sandbox needs from elsewhere"),
    Rule("shared-tmp", "/tmp or /var/tmp themselves as a source or workspace",
         "every user's temporary files and sockets (.X11-unix, ssh-agent) live there",
         "make a directory of its own below them"),
    Rule("writable-system-dir", "a writable bind or workspace at or below /etc, /usr, /boot, "
         "/bin, /sbin, /lib*, /var/lib, /var/spool, /var/log, /var/cache, /var/backups, or "
         "/home, /var, /opt, /srv, /mnt, /media themselves",
         "a write there changes what the host runs (cron, systemd units, libraries)",
         "bind it read-only, or give the sandbox a directory of its own"),
    Rule("writable-home", "a user's home directory itself (/root, /home/NAME, the homes in "
         "the user database) as a writable bind or workspace",
         "the sandbox could plant .bashrc, .profile or autostart files",
         "give it a project directory below the home"),
    Rule("nsbox-code", "a writable bind or workspace that is, is inside, or holds the code "
         "that launches sandboxes: nsbox's package, its dependencies, the site-packages and "
         "the Python installation (or venv) running it",
         "the sandbox could change what the next launch runs, outside any sandbox",
         "install nsbox outside the directory, bind it read-only, or use a project workspace "
         "(writes stay in the sandbox until applied)"),
    Rule("secret-dir", "a source that is or lies in a credential file or folder (.ssh, .gnupg, "
         ".aws, .config/gcloud, .kube, .docker, .netrc, .env*, *.key, *.pem..., at any depth "
         "and in any case), or a tree that holds a home's, even read-only",
         "credentials the sandbox's code could send out or use",
         "bind the project directory, not the home"),
    Rule("host-socket", "a bound tree (or workspace) that holds a unix socket or a FIFO",
         "connect(2) and open(2) of these work through a read-only bind (unix(7)): a way to "
         "the host process that listens", "remove it, or bind a directory without it"),
    # --- what comes out of a sandbox: refused whatever the policy says ---
    Rule("git-dir", "a project change (or a collected file) under a .git (any depth, any "
         "case), in a directory git takes for a repository (HEAD and refs or objects: a bare "
         "one, by any name), or in the directory core.hooksPath names",
         "git runs hooks and obeys its config on the host, as the user who runs git",
         "the sandbox sees .git read-only; copy a file out with `nsbox session cp` and read it "
         "before placing it yourself", can_allow=False),
    Rule("net-authority", "a proxy request whose host has an IPv6 scope id, a control, "
         "non-ASCII or other non-printable character, or is a number (an IPv4 address in "
         "another spelling)",
         "it would be shown to a person (--ask) or connected to as something else than it "
         "reads", "request the host by its name or as a dotted or bracketed address",
         can_allow=False),
)}

# --- the areas, by rule --------------------------------------------------------------------------

RESERVED_TARGETS = ("/proc", "/dev", "/tmp", "/workspace")
# The files nsbox writes (plan.py), and the one directory a bind or symlink may not replace.
NSBOX_FILES = ("/etc/passwd", "/etc/group", "/etc/hostname", "/etc/hosts")
NSBOX_FILES_DIR = "/etc"

# (rule, area): a source at or below the area is refused.
BELOW_AREAS: tuple[tuple[str, str], ...] = (
    ("bind-proc", "/proc"), ("bind-sys", "/sys"), ("bind-dev", "/dev"),
    ("bind-run", "/run"), ("bind-run", "/var/run"),
)
# (rule, area): the area itself is refused, what is below it is not.
EXACT_AREAS: tuple[tuple[str, str], ...] = (
    ("bind-root", "/"), ("shared-tmp", "/tmp"), ("shared-tmp", "/var/tmp"),
)
# Refused as writable binds or workspaces: at or below these trees, and these directories.
SYSTEM_TREES = ("/etc", "/usr", "/boot", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/var/lib", "/var/spool", "/var/log", "/var/cache", "/var/backups", "/snap")
SYSTEM_DIRS = ("/home", "/var", "/opt", "/srv", "/mnt", "/media")
# Credentials by name: one list for the rule book (secret-dir: a source that is one or lies in
# one, and a tree that holds a home's) and the masks of a project workspace
# (Policy.project_secrets). A pattern matches at any depth and in any case (a case-insensitive
# filesystem takes .ENV for .env); "*" and "?" stay within one component; a pattern with a
# slash matches those components in a row; a directory that matches stands for all it holds.
SECRETS = (
    ".ssh", ".gnupg", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".netrc",
    ".git-credentials", ".pgpass", ".pypirc", ".npmrc", ".config/gh", ".config/hub",
    ".config/rclone", ".config/doctl", ".oci", ".boto", ".s3cfg", ".password-store",
    ".vault-token", ".terraform.d", ".terraformrc", ".cargo/credentials",
    ".cargo/credentials.toml", ".gem/credentials", ".env*", "*.pem", "*.key", "*.p12", "*.pfx",
    "*.keystore", "*.jks", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
)
# Package-managed trees: only root writes there and packages ship no sockets, so the socket
# scan skips them (scanning /usr takes over a second). Not what is below them that no package
# manages (SCANNED_INSIDE): /usr/local is the local administrator's, where make install, pip
# and hand-made services put what they like, a socket too; it is scanned as any tree is.
UNSCANNED_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SCANNED_INSIDE = ("/usr/local",)

# Filesystem types (mountinfo's fstype field) that are kernel interfaces, wherever mounted.
KERNEL_FS = {
    "proc": "bind-proc", "nsfs": "bind-proc", "binfmt_misc": "bind-proc",
    "sysfs": "bind-sys", "cgroup": "bind-sys", "cgroup2": "bind-sys", "debugfs": "bind-sys",
    "tracefs": "bind-sys", "securityfs": "bind-sys", "bpf": "bind-sys", "configfs": "bind-sys",
    "pstore": "bind-sys", "efivarfs": "bind-sys", "fusectl": "bind-sys",
    "devtmpfs": "bind-dev", "devpts": "bind-dev", "mqueue": "bind-dev", "hugetlbfs": "bind-dev",
}



def _glob(pattern: str) -> str:
    return "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
                   for c in pattern)


@functools.lru_cache(maxsize=64)
def secret_matcher(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    """One expression for ``patterns`` (as SECRETS): its match is the secret a path is or
    lies in, found at any depth of a relative or absolute path, in any case."""
    if not patterns:
        return None
    alternatives = "|".join(_glob(p.strip("/")) for p in patterns)
    return re.compile(f"(?:^|/)((?:{alternatives}))(?=/|$)", re.IGNORECASE)


def secret_in(path: str, patterns: tuple[str, ...] = SECRETS) -> str | None:
    """The part of ``path`` that is a secret (``.aws`` of ``/srv/x/.AWS/config``), or None."""
    matcher = secret_matcher(patterns)
    found = matcher.search(path) if matcher is not None else None
    return path[:found.end(1)].lstrip("/") if found else None


USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --- errors and the escape -----------------------------------------------------------------------


def refuse(name: str, detail: str, key: str | None = None) -> PolicyError:
    """The error of rule ``name``: what was refused, and what to do instead."""
    rule = RULES[name]
    hint = rule.remedy
    if rule.can_allow:
        hint += (f'; a trusted caller may lift this rule: allow_rules = ["{name}"] '
                 f"(--allow-rule {name})")
    return PolicyError(f"refused by rule {name}: {detail} ({rule.why})", key=key, hint=hint,
                       rule=name)


def check_allow(names: Iterable[str], key: str = "allow_rules") -> tuple[str, ...]:
    """The names of ``allow_rules``: each an existing rule that may be lifted."""
    if isinstance(names, str):
        raise PolicyError(f"expected a list of rule names, got the string {names!r}", key=key,
                          hint=f'write ["{names}"]')
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or name not in RULES:
            raise PolicyError(f"{name!r} is not a rule of nsbox", key=key,
                              hint=suggest(str(name), RULES) or "the rules that can be lifted: "
                              + ", ".join(n for n, rule in RULES.items() if rule.can_allow))
        if not RULES[name].can_allow:
            raise PolicyError(f"rule {name} protects nsbox's own setup and cannot be lifted",
                              key=key, hint=RULES[name].remedy)
    return names


def fire(name: str, allow: Sequence[str], detail: str, key: str | None) -> None:
    if name not in allow:
        raise refuse(name, detail, key)


# --- (a) what the policy alone tells -------------------------------------------------------------


def is_below(path: str, area: str) -> bool:
    """``path`` is ``area`` or inside it (both normalized, absolute)."""
    return path == area or area == "/" or path.startswith(area + "/")


# What the spelling rules passed, by their arguments: they are pure functions of plain
# strings, asked again for the same mounts by every Policy and every plan of this process.
_targets_passed: dict[tuple[str, str], str] = {}
_spellings_passed: set[tuple[str, bool, tuple[str, ...]]] = set()
_PASSED_MAX = 4096


def _plain_strings(*values: object) -> bool:
    """Exactly str (a subclass could compare or hash unlike the text the rules read)."""
    return all(type(value) is str for value in values)


def check_target(target: str, key: str = "target", kind: str = "bind") -> str:
    """A mount target: absolute, no "..", not the root, not nsbox's own; the normalized path."""
    plain = _plain_strings(target, kind)
    norm = _targets_passed.get((target, kind)) if plain else None
    if norm is None:
        norm = _check_target(target, key, kind)
        if plain:
            if len(_targets_passed) >= _PASSED_MAX:
                _targets_passed.clear()
            _targets_passed[(target, kind)] = norm
    return norm


def _check_target(target: str, key: str, kind: str) -> str:
    if not target.startswith("/"):
        raise refuse("target-path", f"{target!r} is a relative path", key)
    if ".." in target.split("/"):
        raise refuse("target-path", f"{target!r} contains \"..\"", key)
    if "\0" in target:
        raise refuse("target-path", f"{target!r} contains a NUL character", key)
    norm = posixpath.normpath(target).replace("//", "/")
    if norm == "/":
        raise refuse("target-path", "the root itself cannot be a mount target", key)
    for reserved in RESERVED_TARGETS:
        if is_below(norm, reserved):
            raise refuse("target-reserved", f"{norm} is set up by nsbox itself", key)
    if norm in NSBOX_FILES:
        raise refuse("nsbox-files", f"{norm} is written by nsbox itself (from [identity])", key)
    if norm == NSBOX_FILES_DIR and kind in ("bind", "symlink"):
        raise refuse("nsbox-files", f"a {kind} at {norm} would receive nsbox's passwd, group, "
                     "hostname and hosts", key)
    return norm


def check_spelling(source: str, writable: bool, allow: Sequence[str], key: str) -> None:
    """The rules that the spelling of an absolute host path already settles (a symlink or an
    alias is caught by ``check_source`` when the plan is built)."""
    allowed = tuple(allow)
    memo = (source, writable, allowed)
    plain = _plain_strings(source, *allowed) and type(writable) is bool
    if plain and memo in _spellings_passed:
        return
    _check_spelling(source, writable, allow, key)
    if plain:
        if len(_spellings_passed) >= _PASSED_MAX:
            _spellings_passed.clear()
        _spellings_passed.add(memo)


def _check_spelling(source: str, writable: bool, allow: Sequence[str], key: str) -> None:
    if "\0" in source:
        raise PolicyError(f"{source!r} contains a NUL character", key=key)
    if not source.startswith("/"):
        return  # relative to the working directory: resolved when the plan is built
    path = posixpath.normpath(source).replace("//", "/")
    for name, area in BELOW_AREAS:
        if is_below(path, area):
            fire(name, allow, f"{path} is at or below {area}", key)
    for name, area in EXACT_AREAS:
        if path == area:
            fire(name, allow, f"{path} is {area}", key)
    secret = secret_in(path)
    if secret:
        fire("secret-dir", allow, f"{path} is /{secret} or inside it", key)
    if writable:
        _check_writable_spelling(path, allow, key)


def _check_writable_spelling(path: str, allow: Sequence[str], key: str) -> None:
    for tree in SYSTEM_TREES:
        if is_below(path, tree):
            fire("writable-system-dir", allow, f"{path} is at or below {tree}", key)
    if path in SYSTEM_DIRS:
        fire("writable-system-dir", allow, f"{path} is a system directory", key)
    if path == "/root" or re.match(r"^/home/[^/]+$", path):
        fire("writable-home", allow, f"{path} is a home directory", key)


def check_policy(policy: Policy) -> None:
    """Every rule the policy alone can decide; raises the first refusal."""
    allow = check_allow(policy.allow_rules)
    for i, mount in enumerate(policy.mounts):
        check_mount(mount, allow, f"mounts[{i}]")
    if policy.workspace is not None:
        check_spelling(policy.workspace, True, allow, "workspace")
    if policy.project is not None:
        check_spelling(policy.project, False, allow, "project")
    check_identity(policy.user, policy.hostname)
    check_env(policy.env, policy.env_passthrough, policy.path, policy.lang)


def check_mount(mount: Mount, allow: Sequence[str], key: str) -> None:
    check_target(mount.target, f"{key}.target", mount.kind)
    if mount.kind == "bind":  # by its kind, not its class: the policy module imports this one
        check_spelling(mount.source, mount.writable, allow, f"{key}.source")


def check_identity(user: str, hostname: str) -> None:
    if not isinstance(user, str) or not USER_NAME.fullmatch(user):
        raise refuse("identity-text", f"{user!r} is not a user name ([a-z_][a-z0-9_-]*, at "
                     "most 32)", "identity.user")
    if not isinstance(hostname, str) or not HOST_NAME.fullmatch(hostname):
        raise refuse("identity-text", f"{hostname!r} is not a host name (letters, digits, "
                     "'.', '-'; at most 63)", "identity.hostname")


def check_env(env: Iterable[tuple[str, str]], passthrough: Iterable[str], path: str,
              lang: str) -> None:
    for name, value in env:
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise refuse("env-text", f"{name!r} is not a variable name", "environment.set")
        if not isinstance(value, str) or "\0" in value:
            raise refuse("env-text", f"the value of {name} is not a string without NUL",
                         f"environment.set.{name}")
    for name in passthrough:
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise refuse("env-text", f"{name!r} is not a variable name",
                         "environment.passthrough")
    for key, value in (("environment.path", path), ("environment.lang", lang)):
        if not isinstance(value, str) or "\0" in value:
            raise refuse("env-text", f"{value!r} holds a NUL character", key)


def resolve(path: str, key: str) -> str:
    """The path with every symlink followed, with a link that cannot be read (/proc/1/root:
    EACCES) or a loop (ELOOP) reported as the policy's problem rather than a traceback."""
    try:
        return _follow(path)
    except OSError as exc:
        raise PolicyError(f"cannot resolve {path}: {exc.strerror}", key=key,
                          hint="give a path that this user can resolve") from None


# The kernel's limit of links followed in one lookup (path_resolution(7), MAXSYMLINKS).
_MAX_LINKS = 40


def _follow(path: str) -> str:
    """``os.path.realpath``, walked here one component at a time (lstat, then readlink for a
    link) so that its errors are the same on every Python: since 3.13 realpath returns a link
    it cannot read unresolved instead of raising EACCES, and it never reported a loop.

    A component that does not exist is kept as written, as realpath does: the callers say what
    is missing. One this user may not look up or a link it cannot read raises EACCES (the
    kernel would refuse the mount's lookup the same way), more than 40 links raise ELOOP."""
    if not path.startswith("/"):
        path = os.getcwd() + "/" + path
    todo = [part for part in reversed(path.split("/")) if part not in ("", ".")]
    done = "/"
    links = 0
    while todo:
        part = todo.pop()
        if part == "..":
            done = posixpath.dirname(done)
            continue
        here = posixpath.join(done, part)
        try:
            is_link = stat.S_ISLNK(os.lstat(here).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_link = False
        if not is_link:
            done = here
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        target = os.readlink(here)
        if target.startswith("/"):
            done = "/"
        todo.extend(part for part in reversed(target.split("/")) if part not in ("", "."))
    return done
