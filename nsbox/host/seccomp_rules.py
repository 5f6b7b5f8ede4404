"""The seccomp rules nsbox brings: the default deny policy, and the set-id filter.

These are data (``SeccompRule`` tuples); nsbox/host/seccomp_compile.py turns them into BPF and
nsbox/host/seccomp.py caches the program, keyed among others by the digests below, so that a
changed rule is never served from an old cache entry. docs/seccomp.md explains every rule.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from nsbox.policy.policy import Seccomp, SeccompArg, SeccompRule

try:  # CPython's own SHA-256: hashlib would load OpenSSL's _hashlib, 3 ms of every `nsbox run`
    from _sha256 import sha256 as _sha256  # Python 3.11
except ImportError:  # pragma: no cover - depends on the interpreter
    try:
        from _sha2 import sha256 as _sha256  # type: ignore[import-not-found,no-redef]  # 3.12+
    except ImportError:
        from hashlib import sha256 as _sha256  # type: ignore[assignment]


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex: the digests of the rules and the programs' keys."""
    return _sha256(data).hexdigest()


U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1

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
# The kernel's AIO contexts are counted for the whole host (fs.aio-nr against fs.aio-max-nr,
# 65536 by default), in no namespace or cgroup: one sandbox's io_setup(65536) made every other
# io_setup on the host fail with EAGAIN while it ran. glibc's POSIX AIO (aio_read) uses threads,
# not these calls; libaio users (databases) fall back or report ENOSYS.
AIO = ("io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents")
_DENY_ENOSYS = ("io_uring_setup", "io_uring_enter", "io_uring_register", "clone3", *AIO)

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
_CLONE_FLAGS_ARG = {"s390x": 1, "s390": 1}.get(os.uname().machine, 0)


def not_in(index: int, allowed: Iterable[int]) -> list[tuple[SeccompArg, ...]]:
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
            mask = U64 & ~(size - 1)
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
    rules += [SeccompRule("personality", _EPERM, c) for c in not_in(0, _PERSONALITY_OK)]
    # The request of ioctl(2) is an unsigned int: the kernel ignores the upper 32 bits, so
    # compare the lower half alone (CVE-2019-10063 passed TIOCSTI with the upper bits set).
    rules += [
        SeccompRule("ioctl", _EPERM, (SeccompArg(1, "masked_eq", request, _U32),))
        for request in (_TIOCSTI, _TIOCLINUX)
    ]
    rules += [
        SeccompRule("socket", "errno:EAFNOSUPPORT", c)
        for c in not_in(0, _SOCKET_FAMILIES_OK)
    ]
    # socketpair(2) works for AF_UNIX alone, but would create sockets of any family first.
    rules += [
        SeccompRule("socketpair", "errno:EAFNOSUPPORT", c) for c in not_in(0, (_AF_UNIX,))
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
BUILTIN_DIGEST = sha256_hex(repr(BUILTIN_RULES).encode())

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
SETID_DIGEST = sha256_hex(repr(SETID_RULES).encode())


def effective_rules(seccomp: Seccomp) -> tuple[SeccompRule, ...]:
    """The built-in rules, less those for syscalls the profile names, plus the profile's rules.

    A profile rule for a syscall replaces every built-in rule for that syscall: that is how a
    profile lifts a restriction (``socket = allow``) or changes its errno.
    """
    named = {rule.syscall for rule in seccomp.rules}
    kept = tuple(rule for rule in BUILTIN_RULES if rule.syscall not in named)
    return kept + tuple(seccomp.rules)
