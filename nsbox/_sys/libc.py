"""The project's ctypes bindings to the system calls the standard library lacks.

Every call raises ``OSError`` naming the call and its arguments, so a failing step can say what
the kernel refused. It imports only what the launch helper has loaded already (ctypes loads
struct): this module is loaded by the launch helper and used between clone and exec.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from typing import Any

from nsbox._sys import paths as _paths

_libc = ctypes.CDLL(None, use_errno=True)

_MACHINE = os.uname().machine  # not the platform module: it costs the helper 1 ms to import
# Numbers of the old syscalls differ per architecture; those from 424 on are the same everywhere.
_NR = {
    "x86_64": {"clone": 56, "pivot_root": 155, "capset": 126, "capget": 125, "seccomp": 317,
               "rt_sigaction": 13},
    "aarch64": {"clone": 220, "pivot_root": 41, "capset": 91, "capget": 90, "seccomp": 277,
                "rt_sigaction": 134},
}.get(_MACHINE, {})
NR_OPEN_TREE = 428
NR_MOVE_MOUNT = 429
NR_CLOSE_RANGE = 436
NR_OPENAT2 = 437
NR_MOUNT_SETATTR = 442
NR_CLONE3 = 435  # the same number on every architecture (asm-generic/unistd.h)

# <linux/sched.h>
CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_VFORK = 0x4000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# <sys/mount.h>
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
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
MOVE_MOUNT_T_EMPTY_PATH = 0x40

# <linux/openat2.h>
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# <linux/seccomp.h>
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

AT_FDCWD = -100

# Prototypes are looked up and typed once, here, at import in the launch helper. Looked up in
# the sandbox child instead (CDLL's lazy attributes), each first call would cost a dlsym and new
# objects in memory the child shares copy-on-write with the helper, on every launch.
_int, _uint, _long, _ulong = ctypes.c_int, ctypes.c_uint, ctypes.c_long, ctypes.c_ulong
_ptr, _str = ctypes.c_void_p, ctypes.c_char_p


def _proto(name: str, restype: type, *argtypes: type) -> Any:
    # _libc[name] is a new function object each time: one per prototype, so that the typed
    # syscall() variants below do not share (and overwrite) each other's argtypes.
    func = _libc[name]
    func.restype = restype
    func.argtypes = argtypes
    return func


_mount = _proto("mount", _int, _str, _str, _str, _ulong, _str)
_umount2 = _proto("umount2", _int, _str, _int)
_sethostname = _proto("sethostname", _int, _str, ctypes.c_size_t)
_prctl = _proto("prctl", _int, _int, _ulong, _ulong, _ulong, _ulong)
_prctl_str = _proto("prctl", _int, _int, _str, _ulong, _ulong, _ulong)
_unshare = _proto("unshare", _int, _int)
# syscall(2) with the arguments of one system call each.
_sys_path2 = _proto("syscall", _long, _long, _str, _str)  # pivot_root
_sys_mount_setattr = _proto("syscall", _long, _long, _int, _str, _uint, _str, ctypes.c_size_t)
_sys_open_tree = _proto("syscall", _long, _long, _int, _str, _uint)
_sys_move_mount = _proto("syscall", _long, _long, _int, _str, _int, _str, _uint)
_sys_openat2 = _proto("syscall", _long, _long, _int, _str, _str, ctypes.c_size_t)
_sys_close_range = _proto("syscall", _long, _long, _uint, _uint, _uint)
_sys_ptr2 = _proto("syscall", _long, _long, _ptr, _ptr)  # capset
_sys_seccomp = _proto("syscall", _long, _long, _uint, _uint, _ptr)
_sys_clone = _proto("syscall", _long, _long, _ulong, _ptr, _ptr, _ptr, _ptr)
_sys_clone3 = _proto("syscall", _long, _long, _ptr, ctypes.c_size_t)
_sys_sigaction = _proto("syscall", _long, _long, _int, _str, _ptr, ctypes.c_size_t)

# The filesystem encoding, as os.fsencode uses it (that function is Python code; this is a
# single C method call per path).
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()


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
    return None if path is None else path.encode(_FS_ENCODING, _FS_ERRORS)


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    if _mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        raise _fail("mount", source, target, fstype, hex(flags), data)


def umount2(target: str, flags: int) -> None:
    if _umount2(_b(target), flags) != 0:
        raise _fail("umount2", target, flags)


def pivot_root(new_root: str, put_old: str) -> None:
    if _sys_path2(_syscall("pivot_root"), _b(new_root), _b(put_old)) != 0:
        raise _fail("pivot_root", new_root, put_old)


def sethostname(name: str) -> None:
    raw = name.encode()
    if _sethostname(raw, len(raw)) != 0:
        raise _fail("sethostname", name)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    result = _prctl(option, arg2, arg3, arg4, arg5)
    if result < 0:
        raise _fail("prctl", option, arg2, arg3)
    return int(result)


def set_name(name: bytes) -> None:
    """The calling thread's name (comm: ps, top), at most 15 bytes (prctl(2), PR_SET_NAME)."""
    if _prctl_str(PR_SET_NAME, name, 0, 0, 0) < 0:
        raise _fail("prctl", PR_SET_NAME, name)


# struct mount_attr: attr_set, attr_clr, propagation, userns_fd (all __u64). Packed to bytes, which
# ctypes passes as a pointer to their buffer; the kernel only reads it.
_MOUNT_ATTR = struct.Struct("=4Q")


def mount_setattr(path: str, attr_set: int, recursive: bool = True, userns_fd: int = 0,
                  dirfd: int = AT_FDCWD, empty_path: bool = False) -> None:
    """Set mount attributes; only adds flags, so flags the kernel locked stay as they are."""
    flags = (AT_RECURSIVE if recursive else 0) | (AT_EMPTY_PATH if empty_path else 0)
    if _sys_mount_setattr(NR_MOUNT_SETATTR, dirfd, _b(path), flags,
                          _MOUNT_ATTR.pack(attr_set, 0, 0, userns_fd), _MOUNT_ATTR.size) != 0:
        raise _fail("mount_setattr", path, hex(attr_set))


def open_tree(path: str, flags: int, dirfd: int = AT_FDCWD) -> int:
    fd = _sys_open_tree(NR_OPEN_TREE, dirfd, _b(path), flags)
    if fd < 0:
        raise _fail("open_tree", path, hex(flags))
    return int(fd)


def move_mount(from_fd: int, to_fd: int, to_path: str = "") -> None:
    """Attach the detached mount ``from_fd`` onto ``to_path`` relative to ``to_fd``, or onto
    ``to_fd`` itself when ``to_path`` is empty: the target is the very file the descriptor
    holds, never looked up again by name (move_mount(2))."""
    flags = MOVE_MOUNT_F_EMPTY_PATH | (0 if to_path else MOVE_MOUNT_T_EMPTY_PATH)
    if _sys_move_mount(NR_MOVE_MOUNT, from_fd, b"", to_fd, _b(to_path), flags) != 0:
        raise _fail("move_mount", from_fd, to_fd, to_path)


def move_mount_path(path: str, to_fd: int) -> None:
    """Move the mount at ``path`` (an attached one, with its submounts) onto the descriptor
    ``to_fd`` itself."""
    if _sys_move_mount(NR_MOVE_MOUNT, AT_FDCWD, _b(path), to_fd, b"",
                       MOVE_MOUNT_T_EMPTY_PATH) != 0:
        raise _fail("move_mount", path, to_fd)


# struct open_how: flags, mode, resolve (all __u64), openat2(2).
_OPEN_HOW = struct.Struct("=3Q")


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    fd = try_openat2(dirfd, path, flags, resolve, mode)
    if fd < 0:
        raise _fail("openat2", path)
    return fd


def try_openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2): a descriptor, or -1 with the reason in ctypes.get_errno() (no exception,
    for callers to whom a failure is one of the expected outcomes)."""
    return int(_sys_openat2(NR_OPENAT2, dirfd, _b(path), _OPEN_HOW.pack(flags, mode, resolve),
                            _OPEN_HOW.size))


def _has_openat2() -> bool:
    # Linux 5.6; a container's seccomp filter may also refuse it (ENOSYS or EPERM).
    try:
        os.close(openat2(AT_FDCWD, "/", os.O_PATH | os.O_CLOEXEC, RESOLVE_NO_SYMLINKS))
    except OSError:
        return False
    return True


HAS_OPENAT2 = _has_openat2()


def open_tree_nofollow(path: str, flags: int) -> int:
    """``open_tree`` of an absolute, resolved ``path`` with no symlink followed at any component.

    A bind source was resolved when the plan was made; a symlink in its path now means that
    someone swapped a component since (a sandbox writing the directory above it, say), and it
    would lead the bind wherever they chose.
    """
    fd = _open_path_nofollow(path)
    try:
        return open_tree("", flags | AT_EMPTY_PATH, dirfd=fd)
    finally:
        os.close(fd)


def _open_path_nofollow(path: str) -> int:
    # O_DIRECTORY first: an O_PATH lookup triggers an automount (autofs homes, say) at its last
    # component only for a directory (path_resolution(7)); a file source is opened without.
    symlink = OSError(40, f"{path}: a component became a symlink since the path was resolved;"
                          " it is refused, not followed")
    if HAS_OPENAT2:
        for flags in (os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY, os.O_PATH | os.O_CLOEXEC):
            fd = try_openat2(AT_FDCWD, path, flags, RESOLVE_NO_SYMLINKS)
            if fd >= 0:
                return fd
            if ctypes.get_errno() != 20:  # ENOTDIR: a file, opened without O_DIRECTORY
                break
        if ctypes.get_errno() == 40:  # ELOOP
            raise symlink
        raise _fail("openat2", path)

    def open_next(fd: int, _index: int, name: str) -> int:
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            next_fd = os.open(name, flags | os.O_DIRECTORY, dir_fd=fd)
        except NotADirectoryError:
            # A file (a component after it fails), or a symlink, refused below.
            next_fd = os.open(name, flags, dir_fd=fd)
        if _is_symlink(next_fd):
            os.close(next_fd)
            raise symlink
        return next_fd

    names = [name for name in path.split("/") if name]
    return _paths.walk(os.open("/", os.O_PATH | os.O_CLOEXEC), names, open_next,
                       close_start=True)


open_path_nofollow = _open_path_nofollow  # an O_PATH descriptor of ``path``, as above


def _is_symlink(fd: int) -> bool:
    return (os.fstat(fd).st_mode & 0o170000) == 0o120000


def set_process_title(title: str) -> None:
    """Show ``title`` as this process's command line, and blank its environment block.

    /proc/PID/cmdline and environ are read from the process's own memory, the argument and
    environment strings it was started with (proc(5)); clones share them. The launch
    helper's would show the host's interpreter, checkout and environment to every process of
    a sandbox that does not exec (a session's init). Python keeps copies of both (sys.argv,
    os.environ), so overwriting the originals changes nothing for it.
    """
    with open("/proc/self/stat", "rb") as f:
        # proc(5): fields 48-51, counted after the command name (which may hold spaces).
        fields = f.read().rsplit(b")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    size = arg_end - arg_start
    ctypes.memset(arg_start, 0, size)
    ctypes.memset(env_start, 0, env_end - env_start)
    if size < 2:
        return
    raw = title.encode()[:size - 2]
    ctypes.memmove(arg_start, raw, len(raw))
    # A last byte that is not NUL tells the kernel the title was rewritten: it then shows the
    # area up to the first NUL, the title alone (get_mm_cmdline in fs/proc/base.c).
    ctypes.memset(arg_end - 1, 1, 1)


def close_range(first: int, last: int = 0xFFFFFFFF, flags: int = 0) -> None:
    if _sys_close_range(NR_CLOSE_RANGE, first, last, flags) != 0:
        raise _fail("close_range", first, last)


def unshare(flags: int) -> None:
    if _unshare(flags) != 0:
        raise _fail("unshare", hex(flags))


def raw_clone(flags: int) -> int:
    """clone(2) without a new stack: returns 0 in the child, like fork.

    Python's at-fork handlers do not run, so this is only safe in a single-threaded process
    (the launch helper); the child must not rely on Python threads or locks.
    """
    pid = _sys_clone(_syscall("clone"), flags, None, None, None, None)
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
    pid = _sys_clone3(NR_CLONE3, ctypes.addressof(args), ctypes.sizeof(args))
    if pid < 0:
        raise _fail("clone3", hex(flags), f"cgroup fd {cgroup_fd}")
    return int(pid)


# struct __user_cap_header_struct {version, pid}; two struct __user_cap_data_struct
# {effective, permitted, inheritable}, as bytes (the kernel only reads them in capset).
_CAP_HEADER = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
_CAP_DATA = struct.Struct("=6I")
_NO_CAPS = bytes(_CAP_DATA.size)


# The kernel's struct sigaction on x86_64 and aarch64: handler, flags, restorer, mask; all zero
# is SIG_DFL with nothing blocked during it. The raw system call: glibc's sigaction, and so the
# signal module, refuses glibc's internal signals 32 and 33, which an older glibc's posix_spawn
# left ignored.
_SIG_DFL_ACTION = bytes(32)
_SIG_IGN = 1
_SIGKILL, _SIGSTOP, _NSIG = 9, 19, 65
ALL_SIGNALS = (1 << (_NSIG - 1)) - 1  # bit N-1 for signal N, as /proc/PID/status shows them


def ignored_signals() -> int:
    """The signals this process ignores (SIG_IGN), as a mask: bit N-1 for signal N."""
    number = _syscall("rt_sigaction")
    old = ctypes.create_string_buffer(32)
    mask = 0
    for sig in range(1, _NSIG):
        if _sys_sigaction(number, sig, None, ctypes.addressof(old), 8) != 0:
            raise _fail("rt_sigaction", sig)
        if int.from_bytes(old.raw[:8], "little") == _SIG_IGN:
            mask |= 1 << (sig - 1)
    return mask


def default_signals(mask: int) -> None:
    """The signals of ``mask`` (but SIGKILL and SIGSTOP) back to SIG_DFL
    (nsbox/native/child.c, reset_signals)."""
    number = _syscall("rt_sigaction")
    for sig in range(1, _NSIG):
        if not mask >> (sig - 1) & 1 or sig in (_SIGKILL, _SIGSTOP):
            continue
        if _sys_sigaction(number, sig, _SIG_DFL_ACTION, None, 8) != 0:
            raise _fail("rt_sigaction", sig)


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
        # prctl() inlined: one call per capability, and there are about 41 of them.
        if _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            raise _fail("prctl", PR_CAPBSET_DROP, cap, 0)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if _sys_ptr2(_syscall("capset"), _CAP_HEADER, _NO_CAPS) != 0:
        raise _fail("capset", 0)


class _SockFprog(ctypes.Structure):
    # struct sock_fprog. The filter points straight into the bytes of the program, which the
    # kernel only copies: no string buffer, whose array type ctypes would create anew in every
    # sandbox child, and no ctypes.cast.
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def seccomp_set_filter(bpf: bytes, flags: int = 0) -> int:
    """Load a compiled BPF program (an array of struct sock_filter, 8 bytes each).

    Needs no_new_privs (or CAP_SYS_ADMIN). Returns the syscall's result (a listener fd when
    SECCOMP_FILTER_FLAG_NEW_LISTENER is in ``flags``).
    """
    if len(bpf) % 8 or not bpf:
        raise OSError(22, f"seccomp: BPF program of {len(bpf)} bytes is not whole instructions")
    prog = _SockFprog(len(bpf) // 8, bpf)
    result = _sys_seccomp(_syscall("seccomp"), SECCOMP_SET_MODE_FILTER, flags,
                          ctypes.byref(prog))
    if result < 0:
        raise _fail("seccomp", "SECCOMP_SET_MODE_FILTER", flags)
    return int(result)


def clear_capabilities() -> None:
    """Empty the ambient, effective, permitted and inheritable sets (the bounding set stays:
    emptying it needs CAP_SETPCAP)."""
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if _sys_ptr2(_syscall("capset"), _CAP_HEADER, _NO_CAPS) != 0:
        raise _fail("capset", 0)


def keep_only_capabilities(keep: tuple[int, ...], cap_last: int) -> None:
    """Reduce every capability set to ``keep`` (bounding set first, which needs CAP_SETPCAP)."""
    for cap in range(cap_last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    words = [0, 0]
    for cap in keep:
        word, bit = divmod(cap, 32)
        words[word] |= 1 << bit
    # effective and permitted are the kept set; inheritable stays empty.
    data = _CAP_DATA.pack(words[0], words[0], 0, words[1], words[1], 0)
    if _sys_ptr2(_syscall("capset"), _CAP_HEADER, data) != 0:
        raise _fail("capset", keep)
