"""The sandbox child's mounts: the staging root, mount targets reached by descriptor, and one
handler per kind of mount operation (``HANDLERS``, the closed set the plan may use: bind, tmpfs,
file, symlink, dir, dev, proc), applied in the plan's order by ``apply_mount``.

Runs in the sandbox child between clone and exec, like nsbox/sandbox/child.py: it uses only
modules the helper has already imported.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

from nsbox._sys import libc as _libc
from nsbox._sys import paths as _paths
from nsbox.sandbox import projectfs

# The staging tmpfs is mounted over /tmp (privately, in the new mount namespace) and becomes the
# root; the host's root stays reachable under /oldroot until the final pivot, and the sandbox's
# root is built under /newroot.
STAGING = "/tmp"
OLDROOT = "/oldroot"
NEWROOT = "/newroot"
# New mounts (tmpfs, /dev, /proc) are made here, where nothing but this process can reach, then
# moved onto their target's descriptor: no name below the new root is looked up for them.
BUILD = "/build"
EMPTY = "/empty"  # an empty directory, bound read-only over parts of /proc (mask_host_files)

# --- mount targets ---------------------------------------------------------------------------
#
# A target may lie below a bind whose host directory another sandbox writes to at this very
# moment, swapping a directory for a symlink in a loop. Looked up by name, such a target could
# lead anywhere on the host. So every target is reached from a descriptor of the new root, one
# directory descriptor at a time, and no symlink is followed at any component (openat2(2) with
# RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH; a walk with O_NOFOLLOW where openat2 is missing).
# Directories and files are made relative to their parent's descriptor, and mounts go onto the
# descriptor itself (move_mount(2) with MOVE_MOUNT_T_EMPTY_PATH). A concurrent rename can then
# only fail the launch, never redirect it.

_RESOLVE = _libc.RESOLVE_NO_SYMLINKS | _libc.RESOLVE_BENEATH
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NODE = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def stage() -> int:
    """The staging root, with the host's root under /oldroot; a descriptor of the new root."""
    mount_tmpfs(STAGING, 1024 * 1024, 0o755)
    os.mkdir(STAGING + OLDROOT)
    os.mkdir(STAGING + NEWROOT)
    os.mkdir(STAGING + BUILD)
    os.mkdir(STAGING + EMPTY, 0o555)
    _libc.pivot_root(STAGING, STAGING + OLDROOT)
    os.chdir("/")
    mount_tmpfs(NEWROOT, 4 * 1024 * 1024, 0o755)
    return os.open(NEWROOT, _DIR)


def mount_tmpfs(target: str, size: int, mode: int) -> None:
    # ``target``: a fixed place of the staging tmpfs (never below the new root).
    _libc.mount("tmpfs", target, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV,
                f"size={size},mode={mode:o}")


PATH_MAX = 4096  # the longest target the native core takes (nsbox/native/mounts.c)


def _components(path: str) -> list[str]:
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise OSError(36, f"mount target {path} is longer than PATH_MAX (4096 bytes)")
    parts = path[1:].split("/")
    # The plan normalizes targets (plan.check_target); this is the child's own guard.
    if path[:1] != "/" or "" in parts or "." in parts or ".." in parts:
        raise OSError(22, f"mount target {path} is not a normalized absolute path")
    return parts


def _not_a_directory(fd: int, name: str, path: str) -> OSError:
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        what = "a symlink"
    elif mode and not stat.S_ISDIR(mode):
        what = "not a directory"
    else:
        what = "a symlink or not a directory (it changed meanwhile)"
    return OSError(20, f"{name} in mount target {path} is {what}: nsbox follows no symlink "
                       "in a mount target and makes no directory in place of a file")


def _open_dir(fd: int, name: str, path: str) -> int:
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (20, 40):  # ENOTDIR, ELOOP
            raise _not_a_directory(fd, name, path) from None
        raise


def open_dir(root: int, path: str, mode: int = 0o777, target: str = "") -> int:
    """An O_PATH descriptor of directory ``path`` of the new root, made (with its parents)
    where missing, with no symlink followed on the way. Errors name ``target`` (the mount
    target ``path`` leads to) or ``path``."""
    parts = _components(path)
    shown = target or path
    if _libc.HAS_OPENAT2 and len(parts) > 1:
        # A deep directory that is there: one call for the whole path. (One level down,
        # openat with O_NOFOLLOW is the same thing.) Otherwise the walk below makes what is
        # missing, or names the component that is in the way.
        fd = _libc.try_openat2(root, path[1:], _DIR, _RESOLVE)
        if fd >= 0:
            return fd

    def open_next(fd: int, index: int, name: str) -> int:
        try:
            return _open_dir(fd, name, shown)
        except FileNotFoundError:
            try:
                os.mkdir(name, mode if index == len(parts) - 1 else 0o777, dir_fd=fd)
            except FileExistsError:
                pass  # made meanwhile: opened below like any other
            return _open_dir(fd, name, shown)

    return _paths.walk(root, parts, open_next)


def open_parent(root: int, path: str) -> tuple[int, str]:
    """A descriptor of the directory that holds ``path`` (made if missing), and its name.

    The descriptor is ``root`` itself for a target at the top: close it with ``release``."""
    parent, _, name = path.rpartition("/")
    _components(path)
    return (root if not parent else open_dir(root, parent, target=path)), name


def release(fd: int, root: int) -> None:
    if fd != root:
        os.close(fd)


def open_mountpoint(root: int, path: str, is_dir: bool) -> int:
    """An O_PATH descriptor of the place a mount goes: a directory, or a file for a file bind,
    made if missing. A symlink there is refused, never followed."""
    if is_dir:
        return open_dir(root, path)
    parent, name = open_parent(root, path)
    try:
        try:
            # A new file: its own descriptor is the mount's target.
            return os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                           | os.O_CLOEXEC, 0o644, dir_fd=parent)
        except FileExistsError:
            pass
        fd = os.open(name, _NODE, dir_fd=parent)
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
            os.close(fd)
            what = "directory" if stat.S_ISDIR(mode) else "symlink"
            raise OSError(21 if stat.S_ISDIR(mode) else 40,
                          f"mount target {path} is a {what} where a file is bound")
        return fd
    finally:
        release(parent, root)


def write_file(root: int, path: str, content: str, mode: int) -> None:
    """``File``: made new, or an existing regular file rewritten, always through its descriptor."""
    parent, name = open_parent(root, path)
    try:
        try:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode, dir_fd=parent)
        except FileExistsError:
            fd = _open_existing_file(parent, name, path)
    finally:
        release(parent, root)
    try:
        data = memoryview(content.encode())
        while data:
            data = data[os.write(fd, data):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_existing_file(parent: int, name: str, path: str) -> int:
    refused = OSError(17, f"{path} exists and is not a plain file of its own (a directory, a "
                          "device, a FIFO, a socket or a hard link): not written")
    try:
        # O_NONBLOCK: a FIFO put here must not hang the launch; it is refused below.
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError as exc:
        if exc.errno in (6, 21):  # ENXIO: a FIFO without a reader, a socket; EISDIR
            raise refused from None
        raise
    st = os.fstat(fd)
    # A second name of the file (a hard link) could lead the write out of the tree.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise refused
    os.ftruncate(fd, 0)
    return fd


def apply_mount(root: int, op: dict[str, Any], source: int | None) -> None:
    """One mount operation of the plan onto the new root (``root``, a descriptor);
    ``source``: the bind source the helper opened, if it did."""
    handler = HANDLERS.get(op["op"])
    if handler is None:
        raise OSError(22, f"unknown mount operation {op['op']!r}")
    handler(root, op, source)


def _tmpfs(root: int, op: dict[str, Any], _source: int | None) -> None:
    target = open_dir(root, op["target"])
    mount_tmpfs(BUILD, op["size"], op["mode"])
    move_into_place(BUILD, target)


def _file(root: int, op: dict[str, Any], _source: int | None) -> None:
    write_file(root, op["target"], op["content"], op["mode"])


def _symlink(root: int, op: dict[str, Any], _source: int | None) -> None:
    parent, name = open_parent(root, op["target"])
    try:
        os.symlink(op["points_to"], name, dir_fd=parent)
    finally:
        release(parent, root)


def _dir(root: int, op: dict[str, Any], _source: int | None) -> None:
    os.close(open_dir(root, op["target"], op["mode"]))


def _dev(root: int, op: dict[str, Any], _source: int | None) -> None:
    mount_dev(open_dir(root, op["target"]), op["devices"], op["shm_size"])


def _proc(root: int, op: dict[str, Any], _source: int | None) -> None:
    mount_proc(open_dir(root, op["target"]))


def _overlay(root: int, op: dict[str, Any], source: int | None) -> None:
    # A project workspace (nsbox/sandbox/projectfs.py): overlayfs over the project, writes on
    # a tmpfs of the sandbox.
    tree = source if source is not None else _open_source(op["source"])
    projectfs.mount_project(root, op, tree, BUILD, open_dir, attach, move_into_place)


def attach(tree: int, target: int) -> None:
    """Move the detached mount ``tree`` onto the descriptor ``target``; both are closed."""
    try:
        _libc.move_mount(tree, target)
    finally:
        os.close(tree)
        os.close(target)


def bind(root: int, op: dict[str, Any], tree: int | None) -> None:
    target = open_mountpoint(root, op["target"], op["is_dir"])
    if tree is None:
        # Unprivileged: the source is reached with the caller's own permissions. The plan
        # resolved it; a symlink put in its path since then is refused, not followed.
        tree = _open_source(op["source"])
    # Otherwise a detached copy made by the helper when it runs as root (idmapped when
    # writable): the sandbox's unprivileged uid need not be able to reach the source itself.
    attrs = _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NODEV
    if not op["writable"]:
        attrs |= _libc.MOUNT_ATTR_RDONLY
    try:
        _libc.mount_setattr("", attrs, recursive=True, dirfd=tree, empty_path=True)
    except BaseException as exc:
        os.close(tree)
        os.close(target)
        if isinstance(exc, OSError) and exc.errno:  # named by its source, as the native core
            raise OSError(exc.errno, f"mount_setattr({op['source']!r}): "
                                     f"{os.strerror(exc.errno)}") from None
        raise
    attach(tree, target)


def _open_source(source: str) -> int:
    try:
        return _libc.open_tree_nofollow(
            OLDROOT + source, _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC | _libc.AT_RECURSIVE)
    except OSError as exc:  # named as the policy names it, as the helper and the native core do
        raise OSError(exc.errno, str(exc.strerror).replace(OLDROOT + source, source)) from None


def mount_dev(target: int, devices: list[str], shm_size: int) -> None:
    path = BUILD
    _libc.mount("tmpfs", path, "tmpfs", _libc.MS_NOSUID | _libc.MS_NOEXEC, "size=64k,mode=755")
    for name in devices:
        node = path + "/" + name
        os.close(os.open(node, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        _libc.mount(f"{OLDROOT}/dev/{name}", node, None, _libc.MS_BIND)
        _libc.mount_setattr(node, _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NOEXEC,
                            recursive=False)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(link, path + "/" + name)
    shm = path + "/shm"
    os.mkdir(shm)
    mount_tmpfs(shm, shm_size, 0o1777)
    mount_devpts(path)
    _libc.mount_setattr(path, _libc.MOUNT_ATTR_RDONLY, recursive=False)
    move_into_place(path, target)


# The ptys of one sandbox (its --tty terminal among them): nsbox/native/devproc.c, PTY_MAX.
PTY_MAX = 64


def mount_devpts(dev: str) -> None:
    """The sandbox's own terminals: a new devpts instance at /dev/pts, /dev/ptmx leading to it.

    ``newinstance`` makes a private set of ptys: the host's terminals are not in it, and the
    sandbox's are not visible outside (devpts in the kernel's Documentation/filesystems). No
    ``gid=tty``: gid 5 is not mapped in the sandbox's user namespace, so a pty belongs to the
    group of the process that opens it.

    ``max`` caps the instance at PTY_MAX ptys. The kernel's own limit is one count for every
    instance of the host (kernel.pty.max, of which kernel.pty.reserve is kept for the host's
    initial devpts; Documentation/filesystems/devpts.rst): without a ``max``, one sandbox
    opening /dev/ptmx in a loop took all 3,071 others, and every other sandbox's terminal
    (``--tty``) failed with ENOSPC.
    """
    pts = dev + "/pts"
    os.mkdir(pts)
    _libc.mount("devpts", pts, "devpts", _libc.MS_NOSUID | _libc.MS_NOEXEC,
                f"newinstance,ptmxmode=0666,mode=0620,max={PTY_MAX}")
    os.symlink("pts/ptmx", dev + "/ptmx")


# The limits of the sandbox's user namespace on what the kernel counts per user of every user
# namespace (ucounts; /proc/sys/user, the "user" sysctls in the kernel's
# Documentation/admin-guide/sysctl/user.rst), the same in nsbox/native/devproc.c. The kernel
# charges each inotify instance, watch, fanotify group and mark to the user that made it in its
# own namespace and again to the owner of each namespace above it, against that namespace's
# limit: a sandbox's are charged to the user who launched it (host root for a root helper),
# and a sandbox without limits of its own could take all of that user's 128 inotify
# instances, so that its inotify_init failed with EMFILE during the run. The sandbox's
# namespace maps one uid, so these are the sandbox's totals (docs/limits.md, "Shared kernel
# resources"). The namespaces' own limits (max_*_namespaces) are left alone: the seccomp
# filter refuses new namespaces, and a session's commands need pid and mount namespaces.
USER_NAMESPACE_LIMITS = (
    ("max_inotify_instances", 32), ("max_inotify_watches", 8192),
    ("max_fanotify_groups", 32), ("max_fanotify_marks", 8192),
)


def limit_user_namespace(proc: str) -> None:
    """Write USER_NAMESPACE_LIMITS through the new ``proc``, before its /proc/sys is read-only.

    The kernel shows the writer the limits of its own user namespace, and lets it write them
    with CAP_SYS_RESOURCE there (set_permissions in kernel/ucount.c), which the sandbox holds
    until just before exec: afterwards nothing in the sandbox can raise them. A kernel without
    one of them (built without fanotify; Linux 5.12 has no fanotify limits) has nothing to
    limit there.
    """
    for name, value in USER_NAMESPACE_LIMITS:
        try:
            fd = os.open(f"{proc}/sys/user/{name}", os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _limit_failed(name, exc) from None
        try:
            os.write(fd, str(value).encode())
        except OSError as exc:
            raise _limit_failed(name, exc) from None
        finally:
            os.close(fd)


def _limit_failed(name: str, exc: OSError) -> OSError:
    err = exc.errno or 0
    return OSError(err, f"write('/proc/sys/user/{name}'): {os.strerror(err)}")


def mount_proc(target: int) -> None:
    # Mounted before pivot_root: once the host's /proc is detached, the kernel refuses a new
    # proc mount in a user namespace (mount_too_revealing in fs/namespace.c).
    path = BUILD
    _libc.mount("proc", path, "proc", _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC)
    limit_user_namespace(path)
    protect_proc(path, OLDROOT + "/dev/null", EMPTY)
    move_into_place(path, target)


def mount_command_proc() -> None:
    """A /proc of its own for a command of a session, which has a pid namespace of its own
    (nsbox/sandbox/sessioninit.py): a process reads the /proc of the pid namespace that mounted
    it, so with the session's, /proc/<getpid()> would be another process and ``ps`` fails
    ("fatal library error, lookup self"), as every reader of /proc/self/stat by pid.

    Called as pid 1 of the command's pid namespace, in a mount namespace of the command's own,
    in the finished sandbox (no staging place: the new proc goes straight over the session's,
    which the kernel allows as that one is fully visible, mount_too_revealing in
    fs/namespace.c). The same parts are read-only and masked as in mount_proc: the empty
    directory comes from the session's own mask of /proc/fs, /dev/null from the sandbox's.
    """
    try:
        empty: int | None = os.open("/proc/fs", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        empty = None  # nothing was masked: the kernel has no /proc/fs
    try:
        _libc.mount("proc", "/proc", "proc", _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC)
        protect_proc("/proc", "/dev/null", None if empty is None else f"/proc/self/fd/{empty}")
    finally:
        if empty is not None:
            os.close(empty)


def protect_proc(path: str, null: str, empty: str | None) -> None:
    """Kernel knobs read-only, the host's files masked: ``null`` goes over files, the empty
    read-only directory ``empty`` over directories."""
    # Kernel knobs stay read-only even where the namespace would allow a write.
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        sub_path = path + "/" + sub
        try:
            _libc.mount(sub_path, sub_path, None, _libc.MS_BIND | _libc.MS_REC)
        except FileNotFoundError:
            continue
        _libc.mount_setattr(sub_path, _libc.MOUNT_ATTR_RDONLY, recursive=True)
    mask_host_files(path, null, empty)


def move_into_place(path: str, target: int) -> None:
    """Move the mount built at ``path`` (with what is mounted below it) onto ``target``."""
    try:
        _libc.move_mount_path(path, target)
    finally:
        os.close(target)


# Parts of /proc that show the whole host, not the sandbox: the host's block devices, swap
# devices or files, the kernel's boot arguments (which name the root device), and per
# filesystem and device, /proc/fs (ext4/vda...). /dev/null goes over each file and an empty
# read-only directory over the directory, as container runtimes mask /proc/kcore. What the
# kernel shows per process (mountinfo, mountstats) cannot be covered so (docs/threat-model.md).
PROC_MASKED = ("cmdline", "partitions", "diskstats", "swaps")
PROC_MASKED_DIRS = ("fs",)


def mask_host_files(proc: str, null: str, empty: str | None) -> None:
    for name in PROC_MASKED:
        try:
            _libc.mount(null, proc + "/" + name, None, _libc.MS_BIND)
        except FileNotFoundError:
            pass  # a kernel without it (swaps without CONFIG_SWAP): nothing to cover
    for name in PROC_MASKED_DIRS if empty is not None else ():
        path = proc + "/" + name
        try:
            _libc.mount(empty, path, None, _libc.MS_BIND)
        except FileNotFoundError:
            continue
        _libc.mount_setattr(path, _libc.MOUNT_ATTR_RDONLY | _libc.MOUNT_ATTR_NOSUID
                            | _libc.MOUNT_ATTR_NODEV | _libc.MOUNT_ATTR_NOEXEC, recursive=False)


# The mount kinds and their handlers: a new kind is its plan operation (nsbox/plan/plan.py) and a
# handler here.
HANDLERS: dict[str, Callable[[int, dict[str, Any], int | None], None]] = {
    "bind": bind, "tmpfs": _tmpfs, "file": _file, "symlink": _symlink, "dir": _dir,
    "dev": _dev, "proc": _proc, "overlay": _overlay,
}
