"""Who the sandbox is on the host: one decision, made from what the launching process holds.

The launch helper writes the sandbox's uid_map and gid_map, and opens bind sources for it. What
it may write and open depends on what it really holds, not on "am I uid 0": its uid and gid in
its own user namespace, its effective capabilities there, and how that namespace maps to its
parent's (user_namespaces(7), "Defining user and group ID mappings").

- A *mapper* holds CAP_SETUID and CAP_SETGID in its namespace, so it may map the sandbox's user
  to any id its own namespace maps: it uses the policy's ``host_uid``/``host_gid`` (65534 by
  default), which must be mapped here and must not be 0 here or in the parent.
- Anyone else may map only their own euid and egid (after denying setgroups); that id must not
  be 0 here or in the parent either.
- Bind sources are copied as detached mounts by the helper (``open_tree(2)``, idmapped when
  writable) only with CAP_SYS_ADMIN in the *initial* user namespace: open_tree needs it over
  the helper's mount namespace, and an idmapped mount needs it in the user namespace that owns
  the filesystem, the initial one for the host's disks (mount_setattr(2)). Otherwise the
  sandbox binds each source by path itself, with its own (unprivileged) host identity.

The sandbox's user therefore never maps to an id that is 0 in the launcher's namespace or in its
parent: when every id the launcher could hand out is 0 (``unshare -Ur`` as root maps only 0 to
0), the launch is refused with the reason and the remedy, never run as root. A namespace's map
shows one level up only; deeper ancestors are out of sight (docs/threat-model.md).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from nsbox.errors import HostError, PolicyError

# <linux/capability.h>
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SYS_ADMIN = 21

# The identity map of the initial user namespace as uid_map shows it (user_namespaces(7)).
_INITIAL_MAP = ((0, 0, 4294967295),)
_SUBID_REMEDY = ("map a range of unprivileged ids into this user namespace (subordinate ids "
                 "from /etc/subuid and /etc/subgid, e.g. with newuidmap/newgidmap or "
                 "'unshare --map-auto'), or run nsbox as a regular user or as root of the host")

IdMap = tuple[tuple[int, int, int], ...]  # (first id here, first id in the parent, count)


def check_host_ids(host_uid: object, host_gid: object) -> None:
    """The policy's host ids are unprivileged ids: never 0, the overflow id -1, or a non-int.

    Policy calls this at every door (API, profiles, sessions, pools): uid 0 outside would give
    the sandbox's files and any kernel bug root's power on the host.
    """
    for key, value in (("host_uid", host_uid), ("host_gid", host_gid)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise PolicyError(f"must be an integer, not {value!r}", key=key)
        if value == 0:
            raise PolicyError("0 would make the sandbox root on the host", key=key,
                              hint="use an unprivileged id such as 65534 (nobody)")
        if not 0 < value < 2**32 - 1:
            raise PolicyError(f"{value} is not a valid unprivileged id (1 to 4294967294)",
                              key=key, hint="use an unprivileged id such as 65534 (nobody)")


def parse_map(text: str) -> IdMap:
    """The lines of /proc/PID/uid_map or gid_map."""
    ranges = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3:
            inside, outside, count = (int(field) for field in fields)
            ranges.append((inside, outside, count))
    return tuple(ranges)


def to_parent(id_map: IdMap, value: int) -> int | None:
    """The id ``value`` of this namespace as the parent namespace sees it; None if unmapped."""
    for inside, outside, count in id_map:
        if inside <= value < inside + count:
            return outside + (value - inside)
    return None


@dataclass(frozen=True)
class Holdings:
    """What a process holds: ids and effective capabilities in its user namespace, and the maps
    of that namespace to its parent's."""

    euid: int
    egid: int
    cap_eff: int  # the CapEff bit mask of /proc/PID/status
    uid_map: IdMap
    gid_map: IdMap

    @classmethod
    def read(cls, proc: str = "/proc/self") -> Holdings:
        with open(f"{proc}/status") as f:
            status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        with open(f"{proc}/uid_map") as f:
            uid_map = parse_map(f.read())
        with open(f"{proc}/gid_map") as f:
            gid_map = parse_map(f.read())
        return cls(euid=int(status["Uid"].split()[1]), egid=int(status["Gid"].split()[1]),
                   cap_eff=int(status["CapEff"].strip(), 16), uid_map=uid_map,
                   gid_map=gid_map)

    def has(self, cap: int) -> bool:
        return bool(self.cap_eff >> cap & 1)

    @property
    def initial_userns(self) -> bool:
        return self.uid_map == _INITIAL_MAP

    @property
    def mapper(self) -> bool:
        """May map the sandbox to any id of this namespace (CAP_SETUID and CAP_SETGID)."""
        return self.has(CAP_SETUID) and self.has(CAP_SETGID)

    @property
    def detached_binds(self) -> bool:
        """The helper opens bind sources itself (open_tree, idmapped when writable)."""
        return self.initial_userns and self.has(CAP_SYS_ADMIN)

    @property
    def privileged(self) -> bool:
        """Root, or holding the capabilities of root, in this namespace: its groups must not
        reach a sandbox."""
        return self.euid == 0 or self.mapper


@dataclass(frozen=True)
class SandboxIds:
    """The sandbox user's uid and gid in the launcher's namespace and in its parent's."""

    uid: int
    gid: int
    parent_uid: int
    parent_gid: int
    mapper: bool  # written with CAP_SETUID/CAP_SETGID; otherwise setgroups is denied first


def decide(held: Holdings, host_uid: int, host_gid: int) -> SandboxIds:
    """The sandbox's identity for a launcher holding ``held``, or HostError saying why there is
    none that is safe. ``host_uid``/``host_gid`` are the policy's (used by a mapper)."""
    if held.mapper:
        uid, gid, how = host_uid, host_gid, "the policy's host_uid/host_gid"
    else:
        uid, gid, how = held.euid, held.egid, "this process's own uid/gid"
    parent_uid = _unprivileged("uid", uid, held.uid_map, held, how)
    parent_gid = _unprivileged("gid", gid, held.gid_map, held, how)
    return SandboxIds(uid, gid, parent_uid, parent_gid, held.mapper)


def _unprivileged(kind: str, value: int, id_map: IdMap, held: Holdings, how: str) -> int:
    parent = to_parent(id_map, value)
    if value != 0 and parent is not None and parent != 0:
        return parent
    where = "" if held.initial_userns else " in this user namespace"
    if value == 0 and not held.mapper:
        problem = (f"this process is {kind} 0{where} without CAP_SETUID and CAP_SETGID, so "
                   f"the only {kind} it may give the sandbox is its own: root's")
        remedy = ("run nsbox as a regular user, or give it CAP_SETUID and CAP_SETGID "
                  "(a container's default capabilities include both)")
    elif value == 0:
        problem = f"{how} is {kind} 0"
        remedy = "set host_uid/host_gid to an unprivileged id such as 65534"
    elif parent is None:
        problem = (f"{kind} {value} ({how}) is not mapped{where}: it maps only "
                   f"{_describe(id_map)}")
        remedy = _SUBID_REMEDY if held.mapper else "run nsbox with a mapped uid and gid"
    else:
        problem = (f"{kind} {value} ({how}) is {kind} 0 of the parent user namespace "
                   f"({_describe(id_map)})")
        remedy = _SUBID_REMEDY if held.mapper else "run nsbox as a regular user"
    raise HostError(f"identity: no unprivileged host identity for the sandbox: {problem}",
                    feature="identity", hint=remedy)


def _describe(id_map: IdMap) -> str:
    return ", ".join(f"{inside}-{inside + count - 1} to {outside}-{outside + count - 1}"
                     if count > 1 else f"{inside} to {outside}"
                     for inside, outside, count in id_map) or "nothing"


# --- writable binds -----------------------------------------------------------------------------


def writable_bind(source: str, target: str, ids: SandboxIds, detached: bool) -> str:
    """How a writable bind of the directory ``source`` is made: "idmap" (its owner appears as
    the sandbox's host uid; files the sandbox makes are the owner's) or "plain" (the sandbox
    writes as its own host uid). Refused (HostError) when neither is safe or possible.

    An idmap needs the helper's detached mounts, and never maps an owner uid or gid 0 (files
    the sandbox made would be root's on the host). A root-owned directory is bound plainly
    and must then be writable by the sandbox's host uid; a setgid directory of group 0 is
    refused, since every file made in it would get group 0 (inode_init_owner in fs/inode.c).
    """
    st = os.stat(source)
    if st.st_mode & stat.S_ISGID and st.st_gid == 0:
        raise HostError(
            f"bind {target}: {source} is a setgid directory of group 0: files the sandbox made "
            "there would belong to group root on the host", feature="identity",
            hint=f"chmod g-s {source}, or bind a directory of an unprivileged user")
    own = (st.st_uid, st.st_gid) == (ids.parent_uid, ids.parent_gid)
    if detached and not own and st.st_uid != 0 and st.st_gid != 0:
        return "idmap"
    if ids.mapper and not own and not _writable_by(st, ids, source):
        raise HostError(
            f"bind {target}: {source} (owner {st.st_uid}:{st.st_gid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}) is not writable by the sandbox's host uid "
            f"{ids.parent_uid}, and files it made there must not be root's",
            feature="identity",
            hint=f"chown {ids.parent_uid}:{ids.parent_gid} {source} (the sandbox's host ids; "
                 "Policy.host_uid/host_gid), or bind a directory of an unprivileged user; to "
                 "only read it, bind it read-only (--ro-bind), or see it copy-on-write at "
                 "/workspace (--project; Policy.project)")
    return "plain"


def _writable_by(st: os.stat_result, ids: SandboxIds, source: str) -> bool:
    """Whether the sandbox's host ids may write into the directory, by its mode bits; with an
    ACL the kernel decides (the check is only there to refuse early, with the remedy)."""
    if st.st_uid == ids.parent_uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == ids.parent_gid:
        return bool(st.st_mode & stat.S_IWGRP)
    if st.st_mode & stat.S_IWOTH:
        return True
    try:
        return "system.posix_acl_access" in os.listxattr(source)
    except OSError:
        return False


# The POSIX ACLs of a directory, as the kernel keeps them: xattrs in the format of
# include/uapi/linux/posix_acl_xattr.h. A default ACL makes whatever is made in the directory
# later ignore the umask (acl(5), "OBJECT CREATION AND DEFAULT ACLs"): other::rwx there gives
# every host user the files its owner makes after the run.
ACL_XATTRS = ("system.posix_acl_access", "system.posix_acl_default")


@dataclass(frozen=True)
class Pin:
    """A writable bind's directory, held (``pin``): its O_PATH descriptor, its mode, and its
    ACLs as they were (name, raw value or None when it had none; none at all listed when its
    filesystem keeps no ACLs)."""

    fd: int
    mode: int
    acls: tuple[tuple[str, bytes | None], ...]


def pin(source: str) -> Pin:
    """An O_PATH descriptor of a writable bind's directory, with its mode and ACLs now.

    Through the bind, the sandbox may own the directory (its owner, or idmapped to it) and
    loosen its mode (chmod 777 /workspace) or give it an ACL (a default ACL with other::rwx)
    for every host user to see or change; the helper puts both back when the sandbox ends
    (``restore``). The descriptor keeps the inode, so a rename or a symlink swapped in
    meanwhile changes nothing. Only this directory: what the sandbox makes inside is its own.
    """
    fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        acls = []
        for name in ACL_XATTRS:
            try:
                acls.append((name, _acl(fd, name)))
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                # No ACLs on this filesystem: nothing to keep, none can be set.
        return Pin(fd, stat.S_IMODE(os.fstat(fd).st_mode), tuple(acls))
    except BaseException:
        os.close(fd)
        raise


def _acl(fd: int, name: str) -> bytes | None:
    """The raw xattr ``name`` of the pinned directory, None when it has none. f*xattr refuse an
    O_PATH descriptor (EBADF); its /proc link reaches the same inode, never another path's."""
    try:
        return os.getxattr(f"/proc/self/fd/{fd}", name)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            return None
        raise


def restore(held: Pin) -> bool:
    """Put back the pinned directory's ACLs, then its mode (setting an access ACL sets the
    mode's group bits; the chmod after sets the ACL's mask: acl(5)); False when something
    failed (never raises: the helper calls it while reaping)."""
    link = f"/proc/self/fd/{held.fd}"
    done = True
    for name, value in held.acls:
        try:
            now = _acl(held.fd, name)
            if now == value:
                continue
            if value is None:
                os.removexattr(link, name)
            else:
                os.setxattr(link, name, value)
        except OSError:
            done = False
    return restore_mode(held.fd, held.mode) and done


def restore_mode(fd: int, mode: int) -> bool:
    """Put back the pinned directory's mode; False when that failed (never raises)."""
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            # fchmod refuses an O_PATH descriptor; its /proc link reaches the same inode.
            os.chmod(f"/proc/self/fd/{fd}", mode)
        return True
    except OSError:
        return False
