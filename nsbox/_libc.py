"""The project's ctypes bindings to the system calls the standard library lacks.

Every call raises ``OSError`` naming the call and its arguments, so a failing step can say what
the kernel refused. Only os and ctypes are imported: this module is loaded by the
launch helper and used between clone and exec.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_MACHINE = os.uname().machine  # not the platform module: it costs the helper 1 ms to import
# Numbers of the old syscalls differ per architecture; those from 424 on are the same everywhere.
_NR = {
    "x86_64": {"clone": 56, "pivot_root": 155, "capset": 126, "capget": 125, "seccomp": 317},
    "aarch64": {"clone": 220, "pivot_root": 41, "capset": 91, "capget": 90, "seccomp": 277},
}.get(_MACHINE, {})
NR_OPEN_TREE = 428
NR_MOVE_MOUNT = 429
NR_CLOSE_RANGE = 436
NR_MOUNT_SETATTR = 442
NR_CLONE3 = 435  # the same number on every architecture (asm-generic/unistd.h)

# <linux/sched.h>
CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# <sys/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_SILENT = 32768
MS_PRIVATE = 1 << 18
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2

# <linux/mount.h>, mount_setattr(2)
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_IDMAP = 0x100000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# <linux/seccomp.h>
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

AT_FDCWD = -100


def _fail(call: str, *args: object) -> OSError:
    err = ctypes.get_errno()
    shown = ", ".join(repr(a) for a in args)
    return OSError(err, f"{call}({shown}): {os.strerror(err)}")


def _syscall(name: str) -> int:
    try:
        return _NR[name]
    except KeyError:
        raise OSError(0, f"{name}: unsupported architecture {_MACHINE}") from None


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    if _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)) != 0:
        raise _fail("mount", source, target, fstype, hex(flags), data)


def umount2(target: str, flags: int) -> None:
    if _libc.umount2(_b(target), flags) != 0:
        raise _fail("umount2", target, flags)


def pivot_root(new_root: str, put_old: str) -> None:
    if _libc.syscall(_syscall("pivot_root"), _b(new_root), _b(put_old)) != 0:
        raise _fail("pivot_root", new_root, put_old)


def sethostname(name: str) -> None:
    raw = name.encode()
    if _libc.sethostname(raw, len(raw)) != 0:
        raise _fail("sethostname", name)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    result = _libc.prctl(
        option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(arg4),
        ctypes.c_ulong(arg5),
    )
    if result < 0:
        raise _fail("prctl", option, arg2, arg3)
    return int(result)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def mount_setattr(path: str, attr_set: int, recursive: bool = True, userns_fd: int = 0,
                  dirfd: int = AT_FDCWD, empty_path: bool = False) -> None:
    """Set mount attributes; only adds flags, so flags the kernel locked stay as they are."""
    attr = _MountAttr(attr_set, 0, 0, userns_fd)
    flags = (AT_RECURSIVE if recursive else 0) | (AT_EMPTY_PATH if empty_path else 0)
    if _libc.syscall(NR_MOUNT_SETATTR, dirfd, _b(path), flags, ctypes.byref(attr),
                     ctypes.sizeof(attr)) != 0:
        raise _fail("mount_setattr", path, hex(attr_set))


def open_tree(path: str, flags: int) -> int:
    fd = _libc.syscall(NR_OPEN_TREE, AT_FDCWD, _b(path), flags)
    if fd < 0:
        raise _fail("open_tree", path, hex(flags))
    return int(fd)


def move_mount_fd(fd: int, target: str) -> None:
    if _libc.syscall(NR_MOVE_MOUNT, fd, b"", AT_FDCWD, _b(target), MOVE_MOUNT_F_EMPTY_PATH) != 0:
        raise _fail("move_mount", fd, target)


def close_range(first: int, last: int = 0xFFFFFFFF, flags: int = 0) -> None:
    if _libc.syscall(NR_CLOSE_RANGE, first, ctypes.c_uint(last), flags) != 0:
        raise _fail("close_range", first, last)


def setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        raise _fail("setns", fd, hex(nstype))


def unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        raise _fail("unshare", hex(flags))


def raw_clone(flags: int) -> int:
    """clone(2) without a new stack: returns 0 in the child, like fork.

    Python's at-fork handlers do not run, so this is only safe in a single-threaded process
    (the launch helper); the child must not rely on Python threads or locks.
    """
    pid = _libc.syscall(_syscall("clone"), ctypes.c_ulong(flags), 0, 0, 0, 0)
    if pid < 0:
        raise _fail("clone", hex(flags))
    return int(pid)


class _CloneArgs(ctypes.Structure):
    # struct clone_args, clone3(2); CLONE_ARGS_SIZE_VER2 (with the cgroup field) is 88 bytes.
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size",
        "tls", "set_tid", "set_tid_size", "cgroup")]


CLONE_INTO_CGROUP = 0x200000000


def clone_into_cgroup(flags: int, exit_signal: int, cgroup_fd: int) -> int:
    """clone3(2) with CLONE_INTO_CGROUP: the child is born in the cgroup v2 directory
    ``cgroup_fd`` (Linux 5.7), with no migration afterwards. No new stack: returns 0 in the
    child, like fork; the same single-thread rule as ``raw_clone`` holds."""
    args = _CloneArgs(flags=flags | CLONE_INTO_CGROUP, exit_signal=exit_signal,
                      cgroup=cgroup_fd)
    pid = _libc.syscall(NR_CLONE3, ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if pid < 0:
        raise _fail("clone3", hex(flags), f"cgroup fd {cgroup_fd}")
    return int(pid)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def drop_all_capabilities(cap_last: int) -> None:
    """Empty the bounding and ambient sets, then effective, permitted and inheritable.

    The bounding set goes first: dropping from it needs CAP_SETPCAP, which capset removes.
    """
    for cap in range(cap_last + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.syscall(_syscall("capset"), ctypes.byref(header), ctypes.byref(data)) != 0:
        raise _fail("capset", 0)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_set_filter(bpf: bytes, flags: int = 0) -> int:
    """Load a compiled BPF program (an array of struct sock_filter, 8 bytes each).

    Needs no_new_privs (or CAP_SYS_ADMIN). Returns the syscall's result (a listener fd when
    SECCOMP_FILTER_FLAG_NEW_LISTENER is in ``flags``).
    """
    if len(bpf) % 8 or not bpf:
        raise OSError(22, f"seccomp: BPF program of {len(bpf)} bytes is not whole instructions")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    result = _libc.syscall(_syscall("seccomp"), SECCOMP_SET_MODE_FILTER, flags,
                           ctypes.byref(prog))
    if result < 0:
        raise _fail("seccomp", "SECCOMP_SET_MODE_FILTER", flags)
    return int(result)


def keep_only_capabilities(keep: tuple[int, ...], cap_last: int) -> None:
    """Reduce every capability set to ``keep`` (bounding set first, which needs CAP_SETPCAP)."""
    for cap in range(cap_last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for cap in keep:
        word, bit = divmod(cap, 32)
        data[word].effective |= 1 << bit
        data[word].permitted |= 1 << bit
    if _libc.syscall(_syscall("capset"), ctypes.byref(header), ctypes.byref(data)) != 0:
        raise _fail("capset", keep)
