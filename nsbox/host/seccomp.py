"""The seccomp filter: the default deny policy plus a profile's rules, compiled to BPF and cached.

The host process builds the program once (libseccomp through pyseccomp) and caches the bytes,
keyed by the seccomp policy, the built-in rules, the architecture, the libseccomp version and the
nsbox version: in memory, and on disk under ``$XDG_CACHE_HOME/nsbox/seccomp`` (or
``~/.cache/nsbox/seccomp``). A hit only reads bytes; pyseccomp is imported on a miss alone,
because its import runs ldconfig (about 35 ms). The child applies the program as the last step
before execve (nsbox/sandbox/child.py). docs/seccomp.md explains every rule.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nsbox.errors import HostError, PolicyError
from nsbox.policy import Seccomp, SeccompArg, SeccompRule

# Return values of a seccomp filter, <linux/seccomp.h>.
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
RET_ALLOW = 0x7FFF0000

# The comparison operators of libseccomp's enum scmp_compare, by the names profiles use.
OPS = {"ne": 1, "lt": 2, "le": 3, "eq": 4, "ge": 5, "gt": 6, "masked_eq": 7}

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
# A filter longer than this is refused by the kernel (BPF_MAXINSNS, <linux/bpf_common.h>).
_MAX_INSNS = 4096
_FORMAT = 1  # of the cache entries; bump when their layout changes

# --- the default policy -----------------------------------------------------------------------
# Each entry: (syscall, action, conditions). Conditions of one entry are ANDed; entries for the
# same syscall are ORed. Why each group is here: docs/seccomp.md.

_EPERM = "errno:EPERM"
_ENOSYS = "errno:ENOSYS"

_DENY_EPERM = (
    # Kernel keyrings are not namespaced and have a history of refcount bugs (CVE-2016-0728).
    "keyctl", "add_key", "request_key",
    # eBPF verifier and perf events: the most exploited unprivileged interfaces
    # (CVE-2017-16995, CVE-2021-3490, CVE-2013-2094, CVE-2023-2235).
    "bpf", "perf_event_open",
    # userfaultfd stalls kernel copies at will: the standard tool to win kernel races.
    "userfaultfd",
    # Loading code into the kernel.
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    # Mounts: the sandbox's mount tree is fixed; the new mount API is reachable with
    # CAP_SYS_ADMIN of a user namespace (CVE-2022-0185 in fsconfig).
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # Host-wide state: swap, reboot, accounting, clocks, quotas, the kernel log.
    "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "quotactl", "quotactl_fd", "syslog",
    # File handles bypass the mount namespace (the 2014 "shocker" container escape).
    "open_by_handle_at", "name_to_handle_at",
    "lookup_dcookie",
    # Raw port I/O and legacy x86 interfaces; 16-bit segments from modify_ldt were the way
    # into the espfix/NMI entry bugs (CVE-2015-3290).
    "ioperm", "iopl", "vm86", "vm86old", "uselib", "modify_ldt",
    # No nested namespaces: a new user namespace hands out capabilities over new namespaces,
    # the entry point of many kernel exploits (CVE-2022-0185, CVE-2023-32233).
    "setns", "unshare",
)

# Runtimes (glibc, libuv, tokio, Go) fall back when these answer ENOSYS, not when EPERM.
# io_uring: CVE-2022-29582, CVE-2023-2598. clone3 takes its flags in a struct that a filter
# cannot read, so it must go to make the flag check on clone effective; glibc falls back to clone.
_DENY_ENOSYS = ("io_uring_setup", "io_uring_enter", "io_uring_register", "clone3")

# <linux/sched.h>: the namespace flags of clone(2). CLONE_NEWTIME shares its bit with CSIGNAL in
# clone() and is reachable only through unshare and clone3, both denied.
_CLONE_NEW_FLAGS = (
    0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
)
# personality(2): PER_LINUX, PER_LINUX32, with UNAME26, and 0xffffffff (query). Everything else
# sets flags like ADDR_NO_RANDOMIZE (no ASLR for the next exec), READ_IMPLIES_EXEC or
# MMAP_PAGE_ZERO (null-dereference exploits, CVE-2009-2692).
_PERSONALITY_OK = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
# <asm-generic/ioctls.h>: pushing bytes into a terminal's input (CVE-2017-5226) and the Linux
# console's selection paste (the same attack through TIOCLINUX, CVE-2023-1523).
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
# <sys/socket.h>: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK. Netlink stays for NETLINK_ROUTE
# (protocol 0): glibc's getaddrinfo(AI_ADDRCONFIG) and getifaddrs read it; it shows only the
# sandbox's own network namespace, and changing it needs CAP_NET_ADMIN, which is dropped.
_SOCKET_FAMILIES_OK = (1, 2, 10, 16)
_AF_NETLINK = 16
_AF_UNIX = 1

# Where clone(2) takes its flags: arg 0, but arg 1 on s390 (CLONE_BACKWARDS2).
_CLONE_FLAGS_ARG = {"s390x": 1, "s390": 1}.get(platform.machine(), 0)


def _not_in(index: int, allowed: Iterable[int]) -> list[tuple[SeccompArg, ...]]:
    """Conditions whose union is "arg[index] is none of ``allowed``", for the full 64 bits.

    libseccomp accepts one comparison per argument in a rule, so the gaps between the allowed
    values are cut into aligned power-of-two blocks (each one masked_eq) plus "gt the largest".
    A value with any of the upper 32 bits set counts as not allowed, also where the kernel reads
    only the lower half: a caller never needs that, and it closes sign-extension tricks.
    """
    values = sorted(set(allowed))
    conditions: list[tuple[SeccompArg, ...]] = []
    low = 0
    for value in values:
        while low < value:  # cover [low, value - 1]
            size = low & -low if low else 1 << 63
            while low + size > value:
                size >>= 1
            mask = _U64 & ~(size - 1)
            conditions.append((SeccompArg(index, "masked_eq", low, mask),))
            low += size
        low = value + 1
    conditions.append((SeccompArg(index, "gt", values[-1]),))
    return conditions


def _builtin_rules() -> tuple[SeccompRule, ...]:
    rules = [SeccompRule(name, _EPERM) for name in _DENY_EPERM]
    rules += [SeccompRule(name, _ENOSYS) for name in _DENY_ENOSYS]
    rules += [
        SeccompRule("clone", _EPERM, (SeccompArg(_CLONE_FLAGS_ARG, "masked_eq", flag, flag),))
        for flag in _CLONE_NEW_FLAGS
    ]
    rules += [SeccompRule("personality", _EPERM, c) for c in _not_in(0, _PERSONALITY_OK)]
    # The request of ioctl(2) is an unsigned int: the kernel ignores the upper 32 bits, so
    # compare the lower half alone (CVE-2019-10063 passed TIOCSTI with the upper bits set).
    rules += [
        SeccompRule("ioctl", _EPERM, (SeccompArg(1, "masked_eq", request, _U32),))
        for request in (_TIOCSTI, _TIOCLINUX)
    ]
    rules += [
        SeccompRule("socket", "errno:EAFNOSUPPORT", c)
        for c in _not_in(0, _SOCKET_FAMILIES_OK)
    ]
    # socketpair(2) works for AF_UNIX alone, but would create sockets of any family first.
    rules += [
        SeccompRule("socketpair", "errno:EAFNOSUPPORT", c) for c in _not_in(0, (_AF_UNIX,))
    ]
    rules.append(
        SeccompRule(
            "socket",
            "errno:EPROTONOSUPPORT",
            (SeccompArg(0, "eq", _AF_NETLINK), SeccompArg(2, "ne", 0)),
        )
    )
    return tuple(rules)


BUILTIN_RULES: tuple[SeccompRule, ...] = _builtin_rules()
_BUILTIN_DIGEST = hashlib.sha256(repr(BUILTIN_RULES).encode()).hexdigest()

# --- the set-id filter: loaded into every sandbox, whatever the policy says ---------------------
# Nothing the sandbox writes may act with more rights than the sandbox: no set-id bit may reach a
# file through any writable mount (a setuid program left in a bound directory runs as its owner
# for whoever starts it on the host). The mount's nosuid flag protects only the sandbox's view of
# the file. These rules are a filter of their own, loaded before the policy's: stacked filters
# all run and the strictest action wins (seccomp(2), "Filter return values"), so a policy that
# disables seccomp or allows chmod cannot lift them. Capabilities are dropped, so the other route,
# a security.capability xattr, needs CAP_SETFCAP the sandbox does not have (capabilities(7)).

_S_ISUID, _S_ISGID = 0o4000, 0o2000
_SETID_BITS = (_S_ISUID, _S_ISGID)
_S_IFMT, _S_IFCHR, _S_IFBLK = 0o170000, 0o020000, 0o060000
# O_TMPFILE includes O_DIRECTORY; its own bit is what marks an unnamed file (open(2)).
_O_TMPFILE_BIT = os.O_TMPFILE & ~os.O_DIRECTORY
# The generic syscall table's number of fchmodat2 (Linux 6.6), for a libseccomp that predates it.
_NR_FCHMODAT2 = 452


def _mode_rules(name: str, index: int, bits: Iterable[int]) -> list[SeccompRule]:
    return [SeccompRule(name, _EPERM, (SeccompArg(index, "masked_eq", bit, bit),))
            for bit in bits]


def _setid_rules() -> tuple[SeccompRule, ...]:
    rules: list[SeccompRule] = []
    for name, mode_arg in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
                           ("creat", 1)):
        rules += _mode_rules(name, mode_arg, _SETID_BITS)
    # open(2) uses the mode only when it creates: with O_CREAT or O_TMPFILE.
    for name, flags_arg, mode_arg in (("open", 1, 2), ("openat", 2, 3)):
        rules += [
            SeccompRule(name, _EPERM, (SeccompArg(flags_arg, "masked_eq", flag, flag),
                                       SeccompArg(mode_arg, "masked_eq", bit, bit)))
            for flag in (os.O_CREAT, _O_TMPFILE_BIT) for bit in _SETID_BITS
        ]
    # mknod(2) makes regular files too; devices are useless behind nodev, and denied here.
    for name, mode_arg in (("mknod", 1), ("mknodat", 2)):
        rules += _mode_rules(name, mode_arg, _SETID_BITS)
        rules += [SeccompRule(name, _EPERM, (SeccompArg(mode_arg, "masked_eq", kind, _S_IFMT),))
                  for kind in (_S_IFCHR, _S_IFBLK)]
    # A setgid directory hands its group to every file made in it.
    for name, mode_arg in (("mkdir", 1), ("mkdirat", 2)):
        rules += _mode_rules(name, mode_arg, _SETID_BITS)
    # openat2 takes its flags and mode in a struct a filter cannot read; glibc and Python fall
    # back to openat on ENOSYS.
    rules.append(SeccompRule("openat2", _ENOSYS))
    return tuple(rules)


SETID_RULES: tuple[SeccompRule, ...] = _setid_rules()
_SETID_DIGEST = hashlib.sha256(repr(SETID_RULES).encode()).hexdigest()


def effective_rules(seccomp: Seccomp) -> tuple[SeccompRule, ...]:
    """The built-in rules, less those for syscalls the profile names, plus the profile's rules.

    A profile rule for a syscall replaces every built-in rule for that syscall: that is how a
    profile lifts a restriction (``socket = allow``) or changes its errno.
    """
    named = {rule.syscall for rule in seccomp.rules}
    kept = tuple(rule for rule in BUILTIN_RULES if rule.syscall not in named)
    return kept + tuple(seccomp.rules)


# --- the compiled program ---------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """A compiled filter. ``bpf`` is an array of struct sock_filter (8 bytes each).

    With ``listener`` (learning mode) every errno action is a user notification instead: the
    child loads the filter with SECCOMP_FILTER_FLAG_NEW_LISTENER and hands the listener to the
    helper, which answers each notification with ``notify``'s errno (never lets the syscall
    run) and records the syscall (nsbox/helper/seccomp_notify.py).
    """

    bpf: bytes
    key: str
    listener: bool = False
    # Learning mode: {"rules": {nr: [[conditions, errno], ...]}, "default": errno or null,
    # "names": {nr: name}}; conditions as [index, op, value, mask].
    notify: dict[str, Any] | None = None


@dataclass
class Stats:
    """What the cache did in this process; tests read it to see a hit."""

    compiled: int = 0  # policy programs
    setid_compiled: int = 0  # the set-id filter
    memory_hits: int = 0
    disk_hits: int = 0
    disk_errors: int = 0  # entries that could not be written or were corrupt


stats = Stats()
_memory: dict[str, Program] = {}
_MEMORY_MAX = 64


def clear_memory_cache() -> None:
    _memory.clear()


def load(seccomp: Seccomp, *, untrusted_dirs: Iterable[str] = ()) -> Program:
    """The compiled program for ``seccomp``, from the cache when possible.

    ``untrusted_dirs`` are host directories the sandbox can write (its workspace, writable
    binds): a disk cache inside one of them is neither read nor written, since the sandbox
    could plant a weaker program there for the next run.
    """
    key = cache_key(seccomp)
    return _cached(key, untrusted_dirs, lambda: compile_program(seccomp, key))


def load_setid(*, untrusted_dirs: Iterable[str] = ()) -> Program:
    """The set-id filter (SETID_RULES), compiled once and cached like the policy's program."""
    key = _setid_key()
    return _cached(key, untrusted_dirs, lambda: compile_setid(key))


def _cached(key: str, untrusted_dirs: Iterable[str], compile_: Callable[[], Program]) -> Program:
    """The program of ``key``: from memory, else from the disk cache (unless it lies in a
    directory the sandbox can write), else compiled and written to both."""
    program = _memory.get(key)
    if program is not None:
        stats.memory_hits += 1
        return program
    directory = cache_dir()
    if directory is not None and _inside_any(directory, untrusted_dirs):
        directory = None
    program = _read_entry(directory, key) if directory else None
    if program is not None:
        stats.disk_hits += 1
    else:
        program = compile_()
        if directory:
            _write_entry(directory, program)
    if len(_memory) >= _MEMORY_MAX:  # an embedder with ever new policies: forget the oldest
        del _memory[next(iter(_memory))]
    _memory[key] = program
    return program


def program_for(seccomp: Seccomp) -> bytes:
    """The BPF program (bytes of struct sock_filter) for ``seccomp``, cached."""
    return load(seccomp).bpf


# --- the cache key, without pyseccomp ---------------------------------------------------------


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


_libseccomp_version: str | None = None


def libseccomp_version() -> str:
    """The system libseccomp's version, read with dlopen (ldconfig is what makes pyseccomp's
    import slow; the dynamic linker's cache finds the library directly)."""
    global _libseccomp_version
    if _libseccomp_version is None:
        try:
            lib = ctypes.CDLL("libseccomp.so.2")
            lib.seccomp_version.restype = ctypes.POINTER(_Version)
            v = lib.seccomp_version().contents
            _libseccomp_version = f"{v.major}.{v.minor}.{v.micro}"
        except (OSError, AttributeError):
            _libseccomp_version = "unknown"
    return _libseccomp_version


def cache_key(seccomp: Seccomp) -> str:
    from nsbox.version import VERSION as __version__

    blob = json.dumps(
        {
            "format": _FORMAT,
            "seccomp": dataclasses.asdict(seccomp),
            "builtin": _BUILTIN_DIGEST,
            "arch": platform.machine(),
            "libseccomp": libseccomp_version(),
            "nsbox": __version__,
        },
        sort_keys=True,
        default=repr,  # a malformed value still gets a key; compiling names the problem
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _setid_key() -> str:
    from nsbox.version import VERSION as __version__

    # "compiler" changes with compile_setid's options (a program of the same rules, built anew)
    blob = json.dumps({"format": _FORMAT, "setid": _SETID_DIGEST, "compiler": 2,
                       "arch": platform.machine(),
                       "libseccomp": libseccomp_version(), "nsbox": __version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# --- the disk cache ---------------------------------------------------------------------------


def cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/nsbox/seccomp`` (an absolute XDG_CACHE_HOME only, as the XDG spec says)
    or ``~/.cache/nsbox/seccomp``; None when there is no home to put it in."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "nsbox", "seccomp")


def _inside_any(path: str, dirs: Iterable[str]) -> bool:
    real = os.path.realpath(path)
    for d in dirs:
        top = os.path.realpath(d)
        if real == top or real.startswith(top.rstrip("/") + "/"):
            return True
    return False


def _trusted_dir(directory: str) -> bool:
    """Ours and writable by us alone: another user must not be able to swap entries."""
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022 and os.path.isdir(directory)


def _read_entry(directory: str, key: str) -> Program | None:
    path = os.path.join(directory, key + ".json")
    if not _trusted_dir(directory):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            entry = json.loads(f.read(4 * 1024 * 1024))
        bpf = bytes.fromhex(entry["bpf"])
        if (
            entry.get("format") != _FORMAT
            or entry.get("key") != key
            or hashlib.sha256(bpf).hexdigest() != entry.get("sha256")
            or not bpf
            or len(bpf) % 8
            or len(bpf) // 8 > _MAX_INSNS
        ):
            raise ValueError("entry does not match")
        notify = entry.get("notify")
        return Program(bpf, key, bool(entry.get("listener")), notify)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        stats.disk_errors += 1  # a corrupt entry is a miss; the new one replaces it
        return None


def _write_entry(directory: str, program: Program) -> None:
    """Atomically (a temporary file renamed over the entry); a failure is only a miss."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted_dir(directory):
            raise OSError(errno.EPERM, f"{directory}: not owned by us or writable by others")
        entry = {
            "format": _FORMAT,
            "key": program.key,
            "sha256": hashlib.sha256(program.bpf).hexdigest(),
            "bpf": program.bpf.hex(),
            "listener": program.listener,
            "notify": program.notify,
        }
        import tempfile  # only when writing: launches that hit the cache do not need it

        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, os.path.join(directory, program.key + ".json"))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        stats.disk_errors += 1


# --- validation and compilation ---------------------------------------------------------------


def parse_action(text: str, key: str) -> tuple[str, int]:
    """``allow``, ``kill`` or ``errno:NAME`` -> (kind, errno); kind is allow, kill or errno."""
    if text == "allow":
        return "allow", 0
    if text == "kill":
        return "kill", 0
    kind, _, name = text.partition(":")
    if kind == "errno":
        number = getattr(errno, name, None) if name.isupper() else None
        if isinstance(number, int):
            return "errno", number
        raise PolicyError(
            f"unknown errno {name!r} in action {text!r}",
            key=key,
            hint="write an errno name from errno(3), e.g. errno:EPERM",
        )
    raise PolicyError(
        f"unknown action {text!r}", key=key, hint="use allow, kill or errno:NAME (errno:EPERM)"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_rule(rule: SeccompRule, key: str) -> None:
    if not isinstance(rule.syscall, str) or not rule.syscall:
        raise PolicyError(f"syscall must be a name, not {rule.syscall!r}", key=key,
                          hint="use the syscall's name as in syscalls(2), e.g. ptrace")
    if not isinstance(rule.action, str):
        raise PolicyError(f"action must be a string, not {rule.action!r}", key=key,
                          hint="use allow, kill or errno:NAME (errno:EPERM)")
    for arg in rule.args:
        if not isinstance(arg, SeccompArg):
            raise PolicyError(f"argument condition {arg!r} is not a SeccompArg", key=key)
        _check_arg(arg, key)


def _check_arg(arg: SeccompArg, key: str) -> None:
    if not all(_is_int(n) for n in (arg.index, arg.value, arg.mask)):
        raise PolicyError(f"index, value and mask must be integers: {arg!r}", key=key)
    if not 0 <= arg.index <= 5:
        raise PolicyError(f"argument index {arg.index} is not 0..5", key=key)
    if arg.op not in OPS:
        raise PolicyError(
            f"unknown comparison {arg.op!r}", key=key, hint=f"use one of {', '.join(OPS)}"
        )
    for what, number in (("value", arg.value), ("mask", arg.mask)):
        if not 0 <= number <= _U64:
            raise PolicyError(
                f"{what} {number} is not an unsigned 64-bit number",
                key=key,
                hint="write negative numbers as their unsigned value (-1 is 0xffffffffffffffff)",
            )
    if arg.op != "masked_eq" and arg.mask:
        raise PolicyError(f"a mask is only for masked_eq, not {arg.op!r}", key=key)


def _action_value(kind: str, number: int, listener: bool) -> int:
    if kind == "allow":
        return RET_ALLOW
    if kind == "kill":
        return RET_KILL_PROCESS
    return RET_USER_NOTIF if listener else RET_ERRNO | (number & 0xFFFF)


def compile_program(seccomp: Seccomp, key: str | None = None) -> Program:
    """Compile with libseccomp. Raises PolicyError naming a bad rule."""
    pyseccomp = _import_pyseccomp()
    stats.compiled += 1
    key = key or cache_key(seccomp)
    listener = seccomp.log_denied
    default_kind, default_errno = parse_action(seccomp.default_action, "seccomp.default_action")
    default = _action_value(default_kind, default_errno, listener)
    notify_rules: dict[str, list[Any]] = {}

    flt = pyseccomp.SyscallFilter(default)
    # Only the native architecture is in the filter (libseccomp's default; no x86 or x32 is
    # added), so the bad-arch action catches int 0x80 from a 64-bit process (the kernel reports
    # AUDIT_ARCH_I386) and, on x86_64, x32 numbers (__X32_SYSCALL_BIT): kill, never fall through.
    flt.set_attr(pyseccomp.Attr.ACT_BADARCH, RET_KILL_PROCESS)
    flt.set_attr(pyseccomp.Attr.CTL_NNP, 0)  # the child sets no_new_privs itself, as a step
    # A binary tree over syscall numbers instead of a linear chain (libseccomp >= 2.5).
    with contextlib.suppress(OSError):
        flt.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)

    rules = effective_rules(seccomp)
    builtin_count = len(rules) - len(seccomp.rules)
    for position, rule in enumerate(rules):
        where = f"seccomp.rules[{position - builtin_count}]"
        if position < builtin_count:
            where = f"built-in seccomp rule for {rule.syscall}"
        _check_rule(rule, where)
        nr = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, rule.syscall)
        if nr == -1:  # __NR_SCMP_ERROR: no architecture has it
            raise PolicyError(
                f"unknown syscall {rule.syscall!r}",
                key=where,
                hint="use the syscall's name as in syscalls(2), e.g. ptrace",
            )
        kind, number = parse_action(rule.action, where)
        if nr < 0:
            continue  # a syscall of another architecture (vm86 on x86_64): nothing to filter
        action = _action_value(kind, number, listener)
        if action == default:
            continue  # libseccomp refuses a rule that repeats the default; it changes nothing
        conditions = [
            pyseccomp.Arg(a.index, OPS[a.op], *((a.mask, a.value) if a.op == "masked_eq"
                                                else (a.value,)))
            for a in rule.args
        ]
        try:
            flt.add_rule(action, nr, *conditions)
        except OSError as exc:
            raise PolicyError(
                f"libseccomp refuses the rule for {rule.syscall!r}: {exc.strerror}",
                key=where,
                hint="one comparison per argument in a rule; two rules for the same syscall "
                "must not differ only in the action",
            ) from None
        if action == RET_USER_NOTIF:
            conds = [[a.index, a.op, a.value, a.mask] for a in rule.args]
            notify_rules.setdefault(str(nr), []).append([conds, number])

    bpf = _export(flt)
    if len(bpf) // 8 > _MAX_INSNS:
        raise PolicyError(
            f"the seccomp program has {len(bpf) // 8} instructions; the kernel takes at most "
            f"{_MAX_INSNS}",
            key="seccomp.rules",
        )
    notify = None
    if listener:
        notify = {
            "rules": notify_rules,
            "default": default_errno if default == RET_USER_NOTIF else None,
            "names": _syscall_names(pyseccomp),
        }
    return Program(bpf, key, listener, notify)


def compile_setid(key: str | None = None) -> Program:
    """Compile SETID_RULES: allow by default, the native architecture only (as the policy's
    program: another architecture's syscalls are killed, they would bypass the numbers here)."""
    pyseccomp = _import_pyseccomp()
    stats.setid_compiled += 1
    flt = pyseccomp.SyscallFilter(RET_ALLOW)
    flt.set_attr(pyseccomp.Attr.ACT_BADARCH, RET_KILL_PROCESS)
    flt.set_attr(pyseccomp.Attr.CTL_NNP, 0)
    with contextlib.suppress(OSError):
        flt.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)  # every syscall passes this filter too
    for rule in SETID_RULES:
        nr = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, rule.syscall)
        if nr == -1 and rule.syscall == "fchmodat2":
            nr = _NR_FCHMODAT2  # a libseccomp older than the syscall: the number is the same
        if nr < 0:
            continue  # not a syscall of this architecture (open on aarch64)
        kind, number = parse_action(rule.action, "set-id rule")
        conditions = [pyseccomp.Arg(a.index, OPS[a.op], a.mask, a.value) for a in rule.args]
        flt.add_rule(_action_value(kind, number, False), nr, *conditions)
    return Program(_export(flt), key or _setid_key())


def _import_pyseccomp() -> Any:
    """Here alone: its import runs ldconfig. Missing pieces fail closed, with what to install."""
    try:
        import pyseccomp
    except ImportError:
        raise HostError(
            "seccomp: the Python package pyseccomp is not installed",
            feature="seccomp",
            hint="pip install pyseccomp (it is a dependency of nsbox)",
        ) from None
    except RuntimeError as exc:  # pyseccomp's "Unable to find libseccomp"
        raise HostError(
            f"seccomp: {exc}",
            feature="seccomp",
            hint="install the system's libseccomp (Debian: apt-get install libseccomp2)",
        ) from None
    return pyseccomp


def _export(flt: Any) -> bytes:
    fd = os.memfd_create("nsbox-seccomp", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as f:
            flt.export_bpf(f)
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _syscall_names(pyseccomp: Any) -> dict[str, str]:
    """Number -> name for the native architecture, so the host can name what was denied
    without loading libseccomp again."""
    names = {}
    for nr in range(1024):
        try:
            names[str(nr)] = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr).decode()
        except ValueError:
            continue
    return names
