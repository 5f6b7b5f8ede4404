"""The rule book: what a sandbox may be given, one copy for every door.

Every way a policy comes in (the Python API, profiles, ``--set`` and the other CLI options,
``run(workspace=)``, ``Session``, ``Pool``, the MCP server's ``--input``, Ray) ends in a
``Policy`` and then in a plan, and both call this module:

- ``check_policy`` runs when a ``Policy`` is made (its ``__post_init__``) and checks what the
  policy alone tells: mount targets, identity strings, environment text, and the spelling of
  every host path (so ``Bind("/run", ...)`` fails at once, where the mistake was written);
- ``check_source`` runs when the plan is built (nsbox/plan.py), on the resolved host path: it
  asks what the path *is* (which filesystem, which directory of it, after every symlink and
  through bind-mounted aliases: /proc/self/mountinfo), not how it is spelled, and looks inside
  the tree for unix sockets and FIFOs.

A refusal is a ``PolicyError`` whose ``rule`` is the rule's short name, with the key when there
is one. A trusted caller may lift one rule by naming it (``Policy(allow_rules=("bind-run",))``,
the profile key ``allow_rules``, ``nsbox run --allow-rule NAME``); rules that protect nsbox's
own setup cannot be lifted; there is no "allow everything". docs/rules.md is the reference.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nsbox.errors import PolicyError, suggest

if TYPE_CHECKING:
    from nsbox.policy import Mount, Policy


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
         "for /workspace use workspace.path; for /tmp limits.tmp_size", can_allow=False),
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
    Rule("secret-dir", "a source at or below a home's secret folder (.ssh, .gnupg, .aws, "
         ".config/gcloud, .kube, .docker, .netrc...), or a tree that holds one, even read-only",
         "credentials the sandbox's code could send out or use",
         "bind the project directory, not the home"),
    Rule("host-socket", "a bound tree (or workspace) that holds a unix socket or a FIFO",
         "connect(2) and open(2) of these work through a read-only bind (unix(7)): a way to "
         "the host process that listens", "remove it, or bind a directory without it"),
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
# Secret folders and files of a home directory, refused even read-only.
SECRET_NAMES = (".ssh", ".gnupg", ".aws", ".azure", ".config/gcloud", ".kube", ".docker",
                ".netrc", ".git-credentials", ".pgpass", ".pypirc", ".npmrc", ".config/gh",
                ".password-store", ".vault-token", ".terraform.d")
# Package-managed trees: only root writes there and packages ship no sockets, so the socket
# scan skips them (scanning /usr takes over a second).
UNSCANNED_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# Filesystem types (mountinfo's fstype field) that are kernel interfaces, wherever mounted.
KERNEL_FS = {
    "proc": "bind-proc", "nsfs": "bind-proc", "binfmt_misc": "bind-proc",
    "sysfs": "bind-sys", "cgroup": "bind-sys", "cgroup2": "bind-sys", "debugfs": "bind-sys",
    "tracefs": "bind-sys", "securityfs": "bind-sys", "bpf": "bind-sys", "configfs": "bind-sys",
    "pstore": "bind-sys", "efivarfs": "bind-sys", "fusectl": "bind-sys",
    "devtmpfs": "bind-dev", "devpts": "bind-dev", "mqueue": "bind-dev", "hugetlbfs": "bind-dev",
}

_SECRET_SPELLING = re.compile(
    rf"^(/root|/home/[^/]+)/({'|'.join(re.escape(n) for n in SECRET_NAMES)})(/|$)")
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
                              hint=suggest(str(name), RULES) or "docs/rules.md lists them")
        if not RULES[name].can_allow:
            raise PolicyError(f"rule {name} protects nsbox's own setup and cannot be lifted",
                              key=key, hint=RULES[name].remedy)
    return names


def _fire(name: str, allow: Sequence[str], detail: str, key: str | None) -> None:
    if name not in allow:
        raise refuse(name, detail, key)


# --- (a) what the policy alone tells -------------------------------------------------------------


def is_below(path: str, area: str) -> bool:
    """``path`` is ``area`` or inside it (both normalized, absolute)."""
    return path == area or area == "/" or path.startswith(area + "/")


def check_target(target: str, key: str = "target", kind: str = "bind") -> str:
    """A mount target: absolute, no "..", not the root, not nsbox's own; the normalized path."""
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
    if "\0" in source:
        raise PolicyError(f"{source!r} contains a NUL character", key=key)
    if not source.startswith("/"):
        return  # relative to the working directory: resolved when the plan is built
    path = posixpath.normpath(source).replace("//", "/")
    for name, area in BELOW_AREAS:
        if is_below(path, area):
            _fire(name, allow, f"{path} is at or below {area}", key)
    for name, area in EXACT_AREAS:
        if path == area:
            _fire(name, allow, f"{path} is {area}", key)
    secret = _SECRET_SPELLING.match(path)
    if secret:
        _fire("secret-dir", allow, f"{path} is at or below a home's {secret.group(2)}", key)
    if writable:
        _check_writable_spelling(path, allow, key)


def _check_writable_spelling(path: str, allow: Sequence[str], key: str) -> None:
    for tree in SYSTEM_TREES:
        if is_below(path, tree):
            _fire("writable-system-dir", allow, f"{path} is at or below {tree}", key)
    if path in SYSTEM_DIRS:
        _fire("writable-system-dir", allow, f"{path} is a system directory", key)
    if path == "/root" or re.match(r"^/home/[^/]+$", path):
        _fire("writable-home", allow, f"{path} is a home directory", key)


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
    from nsbox.policy import Bind

    check_target(mount.target, f"{key}.target", mount.kind)
    if isinstance(mount, Bind):
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


# --- (b) what the resolved host path is ----------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5)): ``root`` is the directory of the filesystem
    that appears at ``point``."""

    dev: str  # "major:minor"
    root: str
    point: str
    fstype: str


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def read_mountinfo() -> str:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def parse_mounts(text: str) -> list[MountEntry]:
    """The mount table, in mount order (a later entry covers an earlier one)."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        sep = fields.index("-")
        entries.append(MountEntry(fields[2], _unescape(fields[3]), _unescape(fields[4]),
                                  fields[sep + 1]))
    return entries


@dataclass(frozen=True)
class Where:
    """What a resolved path is: a directory ``fspath`` of the filesystem ``dev``."""

    dev: str
    fspath: str
    fstype: str

    def within(self, other: Where) -> bool:
        return self.dev == other.dev and is_below(self.fspath, other.fspath)


def _dev_string(st_dev: int) -> str:
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def where(real: str, mounts: Sequence[MountEntry]) -> Where | None:
    """Which filesystem ``real`` (a resolved path) is on and where in it; None if missing.

    The mount is the one with the longest mount point above the path whose device is the
    path's own (stat), so a covered mount is never mistaken for the one that is seen."""
    try:
        dev = _dev_string(os.stat(real).st_dev)
    except OSError:
        return None
    best: MountEntry | None = None
    for entry in mounts:
        if entry.dev == dev and is_below(real, entry.point) and (
                best is None or len(entry.point) >= len(best.point)):
            best = entry
    if best is None:  # not in this table (another namespace's path): the spelling must do
        return Where(dev, real, "")
    rest = real[len(best.point):] if best.point != "/" else real
    return Where(dev, posixpath.normpath(best.root + "/" + rest).replace("//", "/"),
                 best.fstype)


class HostView:
    """The host as the rules see it: the mount table, the places of the refused areas, the
    homes and their secret folders, each worked out when first needed.

    ``current()`` keeps one view while the mount table and the user database are unchanged
    (the text of /proc/self/mountinfo, the mtimes of /etc/passwd and /home), so a launch pays
    for one read of mountinfo, not for resolving every area again. Only host paths that
    root manages are remembered (the areas, the homes); a caller's bind source is looked at
    afresh every time. A home's secrets are looked for again when the home or its .config
    changes (creating an entry changes a directory's ctime)."""

    def __init__(self, text: str | None = None, homes_stamp: tuple[int, ...] = ()) -> None:
        self.text = read_mountinfo() if text is None else text
        self.mounts = parse_mounts(self.text)
        self.homes_stamp = homes_stamp
        self._areas: dict[str, list[Where]] = {}
        self._homes: list[str] | None = None
        self._where: dict[str, Where | None] = {}
        self._secrets: dict[str, tuple[tuple[int, int], list[tuple[str, Where]]]] = {}

    @classmethod
    def current(cls) -> HostView:
        global _view
        text = read_mountinfo()
        stamp = _homes_stamp()
        view = _view
        if view is None or view.text != text or view.homes_stamp != stamp:
            view = _view = cls(text, stamp)
        return view

    def where(self, path: str) -> Where | None:
        if path not in self._where:
            self._where[path] = where(os.path.realpath(path), self.mounts)
        return self._where[path]

    def area(self, path: str) -> list[Where]:
        """Everything at or below ``path``: the path's own place, and every filesystem mounted
        below it (a bind-mounted alias of any of them elsewhere is the same place)."""
        if path not in self._areas:
            real = os.path.realpath(path)
            own = where(real, self.mounts)
            places = [] if own is None else [own, *self.below(real)]
            self._areas[path] = places
        return self._areas[path]

    def below(self, real: str) -> list[Where]:
        return [Where(e.dev, e.root, e.fstype) for e in self.mounts
                if e.point != real and is_below(e.point, real)]

    def homes(self) -> list[str]:
        if self._homes is None:
            self._homes = home_dirs()
        return self._homes

    def secrets_near(self, here: Where) -> list[tuple[str, Where]]:
        """The secret folders that ``here`` could be in or hold: those of the homes that lie
        above or below it (a home's place is one stat; its secrets are looked at only then)."""
        found = []
        for home in self.homes():
            place = self.where(home)
            if place is None or not (here.within(place) or place.within(here)):
                continue
            found += self._secrets_of(home)
        return found

    def _secrets_of(self, home: str) -> list[tuple[str, Where]]:
        stamp = (_ctime(home), _ctime(home + "/.config"))
        cached = self._secrets.get(home)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        places = []
        for name in SECRET_NAMES:
            secret = home + "/" + name
            place = where(os.path.realpath(secret), self.mounts) if os.path.lexists(
                secret) else None
            if place is not None:
                places.append((secret, place))
        self._secrets[home] = (stamp, places)
        return places


_view: HostView | None = None


def _ctime(path: str) -> int:
    try:
        return os.stat(path).st_ctime_ns
    except OSError:
        return -1


def _homes_stamp() -> tuple[int, ...]:
    stamps = []
    for path in ("/etc/passwd", "/home"):
        try:
            stamps.append(os.stat(path).st_mtime_ns)
        except OSError:
            stamps.append(-1)
    return tuple(stamps)


def home_dirs() -> list[str]:
    """The host's home directories: /root, /home/*, and every home in the user database."""
    import pwd

    homes = {"/root"}
    try:
        homes.update(os.path.join("/home", n) for n in os.listdir("/home"))
    except OSError:
        pass
    homes.update(p.pw_dir for p in pwd.getpwall() if p.pw_dir.startswith("/"))
    return sorted(h for h in homes if posixpath.normpath(h) != "/" and os.path.isdir(h))


def resolve(path: str, key: str) -> str:
    """``os.path.realpath``, with a link that cannot be read (/proc/1/root: EACCES) reported
    as the policy's problem rather than a traceback."""
    try:
        return os.path.realpath(path)
    except OSError as exc:
        raise PolicyError(f"cannot resolve {path}: {exc.strerror}", key=key,
                          hint="give a path that this user can resolve") from None


def check_source(source: str, *, writable: bool, allow: Sequence[str], key: str,
                 host: HostView | None = None) -> str:
    """The rules for a bind source or a workspace, on what the path is; its resolved path.

    ``source`` must exist (plan.py says so otherwise). Submounts below the source come along
    with a recursive bind (nsbox binds with AT_RECURSIVE), so they are checked as well."""
    real = resolve(source, key)
    check_spelling(real, writable, allow, key)
    host = host or HostView.current()
    here = where(real, host.mounts)
    if here is None:
        return real
    places = [here, *host.below(real)]
    for place in places:
        name = KERNEL_FS.get(place.fstype)
        if name:
            _fire(name, allow, f"{real} is on a {place.fstype} filesystem", key)
    for name, area in BELOW_AREAS:
        if any(p.within(a) for p in places for a in host.area(area)):
            _fire(name, allow, f"{real} is (or holds) {area} or a part of it, by another "
                  "name", key)
    for name, area in EXACT_AREAS:
        if _same(here, host.where(area)):
            _fire(name, allow, f"{real} is {area}, by another name", key)
    if writable:
        _check_writable_place(real, here, allow, key, host)
    if "secret-dir" not in allow:
        for secret, place in host.secrets_near(here):
            if here.within(place):
                raise refuse("secret-dir", f"{real} is {secret} or inside it", key)
            if place.within(here):
                raise refuse("secret-dir", f"{real} holds {secret}", key)
    if "host-socket" not in allow and not _unscanned(here, host):
        found = find_host_socket(real)
        if found:
            raise refuse("host-socket", f"{found[0]} is {found[1]}", key)
    return real


def _same(a: Where | None, b: Where | None) -> bool:
    return a is not None and b is not None and (a.dev, a.fspath) == (b.dev, b.fspath)


def _check_writable_place(real: str, here: Where, allow: Sequence[str], key: str,
                          host: HostView) -> None:
    for tree in SYSTEM_TREES:
        if any(here.within(a) for a in host.area(tree)):
            _fire("writable-system-dir", allow, f"{real} is at or below {tree}, by another "
                  "name", key)
    for name, dirs in (("writable-system-dir", SYSTEM_DIRS), ("writable-home", host.homes())):
        for directory in dirs:
            if _same(here, host.where(directory)):
                _fire(name, allow, f"{real} is {directory}", key)


def _unscanned(here: Where, host: HostView) -> bool:
    return any(here.within(host.area(tree)[0]) for tree in UNSCANNED_TREES
               if host.area(tree))


# --- the socket scan -----------------------------------------------------------------------------

# Directories found clean: path -> (identity and change times, names of its subdirectories).
# Creating, renaming or linking an entry changes a directory's ctime, which no one can set
# back (utimensat(2) sets only atime and mtime); a mount over a subdirectory changes its
# device and inode. So a directory whose stat is unchanged holds what it held. A directory
# changed within the last seconds is not remembered: its ctime could still change within the
# same clock tick after it was read (the timestamps use a coarse clock).
_Key = tuple[int, int, int, int]
_clean: dict[str, tuple[_Key, tuple[str, ...]]] = {}
_clean_lock = threading.Lock()
_CLEAN_MAX = 500_000
_SETTLED_NS = 2_000_000_000


def _kind(mode: int) -> str | None:
    if stat.S_ISSOCK(mode):
        return "a unix socket"
    return "a FIFO" if stat.S_ISFIFO(mode) else None


def find_host_socket(root: str) -> tuple[str, str] | None:
    """The first unix socket or FIFO at or below ``root`` (not following symlinks) and what
    it is, or None.

    scandir's d_type tells directories, files and symlinks apart without a stat; only the
    remaining entries are stat'ed. Directories that cannot be listed but can be entered are
    reported, since a socket in them could still be reached by its name."""
    try:
        mode = os.lstat(root).st_mode
    except OSError:
        return None
    if _kind(mode):
        return root, str(_kind(mode))
    if not stat.S_ISDIR(mode):
        return None
    stack = [root]
    while stack:
        directory = stack.pop()
        found = _scan_dir(directory, stack)
        if found:
            return found
    return None


def _scan_dir(directory: str, stack: list[str]) -> tuple[str, str] | None:
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns)
    with _clean_lock:
        cached = _clean.get(directory)
    if cached is not None and cached[0] == key:
        stack.extend(directory + "/" + name for name in cached[1])
        return None
    subdirs: list[str] = []
    try:
        entries = os.scandir(directory)
    except PermissionError:
        if os.access(directory, os.X_OK):
            return directory, "a directory that can be entered but not listed"
        return None
    except OSError:
        return None
    with entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            elif entry.is_file(follow_symlinks=False) or entry.is_symlink():
                continue
            else:
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if _kind(mode):
                    return entry.path, str(_kind(mode))
    stack.extend(directory + "/" + name for name in subdirs)
    if time.time_ns() - st.st_ctime_ns > _SETTLED_NS:
        with _clean_lock:
            if len(_clean) >= _CLEAN_MAX:
                _clean.clear()
            _clean[directory] = (key, tuple(subdirs))
    return None
