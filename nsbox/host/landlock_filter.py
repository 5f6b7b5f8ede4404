"""The seccomp filter of the Landlock mode: what Landlock does not govern, refused.

Without namespaces the sandbox shares the host's network stack, IPC, keyrings and processes;
Landlock (nsbox/_sys/landlock.py) covers files, TCP bind and connect, and (ABI 6) signals and
abstract unix sockets. These rules close the rest. Like the set-id filter they are a filter of
their own, loaded in every Landlock sandbox after the set-id filter and before the policy's: the
policy cannot lift them (stacked filters all run, the strictest answer wins, seccomp(2)).

- socket(2): only TCP (AF_INET and AF_INET6, SOCK_STREAM, protocol 0 or IPPROTO_TCP), which
  Landlock denies bind and connect on every port. Everything else (UDP, raw, netlink, packet,
  MPTCP and SCTP, which Landlock does not cover, landlock-lsm/linux#54, and AF_UNIX, so that the
  host's pathname sockets are unreachable) is EACCES. socketpair(2) stays for AF_UNIX
  SOCK_STREAM alone: a datagram pair can be aimed at any pathname socket of the host (/dev/log,
  the journal) by sendto or connect, which Landlock does not see; a stream socket of a pair
  is connected for good (EISCONN).
- bind(2): refused. Landlock refuses every TCP bind already; on a socketpair's socket it would
  take an abstract name before a host daemon does (the daemon's bind then fails, EADDRINUSE:
  Landlock's abstract scope governs connecting, not naming).
- listen(2) binds a port without bind(2) (inet_autobind), out of Landlock's sight: refused.
- sendto/sendmsg/sendmmsg with MSG_FASTOPEN connect without connect(2) (tcp_sendmsg_fastopen,
  landlock-lsm/linux#41): refused; io_uring, which could do the same, answers ENOSYS.
- inotify and fanotify (inotify_init, inotify_init1, inotify_add_watch, fanotify_init,
  fanotify_mark): ENOSYS. A watch needs only read permission, which Landlock does not check for
  it: a watch on /tmp, /etc or $HOME names every file the host makes there, another sandbox's
  workspace included; and the instances are counted per uid (128 by default), so one sandbox
  could take them all from its uid's host processes and other sandboxes. tail -f and the like
  fall back to polling.
- listmount and statmount (Linux 6.8) list the host's mount table, which /proc would show:
  ENOSYS, by number where libseccomp does not know them.
- The kernel's AIO (io_setup and the rest): ENOSYS, as in the policy's filter; its contexts
  are counted for the whole host (fs.aio-nr).
- Every call newer than these rules: a number past TABLE_END (the last of the table they were
  written against) is ENOSYS, as on a kernel without the call, unless it is named here (a rule
  by number, or _ALLOWED_PAST_TABLE). Each new kernel adds calls (lsm_set_self_attr,
  open_tree_attr, file_setattr, ...) that no rule here has weighed; they are refused until one
  has. A filter program's prefix does it (seccomp_compile.past_table_prefix, which the policy's
  filter has too): libseccomp names calls, not ranges.
- System V IPC and POSIX message queues reach the host's (there is no IPC namespace); kernel
  keyrings hold the caller's user keyring: refused.
- setpriority, ioprio_set, prlimit64 and the sched_set* calls may name another process of the
  same uid, which Landlock does not check: only the caller itself (pid/who 0) may be named.
- New namespaces (unshare, setns, clone's namespace flags, clone3), as the built-in filter.
- TIOCSTI and TIOCLINUX, as the built-in filter (the caller's terminal may be the stdin).
- File metadata. Landlock governs contents, not metadata, so a file of the sandbox's uid outside
  the workspace (as an unprivileged caller's sandbox, every file of the caller's, ~/.ssh
  included) could otherwise be handed to another group or opened to every local user for
  writing. chown by name is refused; chmod, fchmodat, fchmodat2 and fchmod to a group- or
  world-writable mode are (git, pip and tar set 0644 and 0755 modes, which stay). A descriptor
  is no safer than a name: a read-only bind of the caller's files opens them for reading.
  Every change of an extended attribute (set and remove, by name, by descriptor, and the *at
  calls of Linux 6.13) is ENOTSUP: seccomp cannot read the attribute's name, and a POSIX ACL
  (system.posix_acl_access, other::rw-) is chmod 0666 by another door. ENOTSUP is what a file
  system without xattrs answers, which cp -a and tar take for "nothing to keep".
  Times and fchown stay (docs/hosts.md lists them as weaker).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

from nsbox.host import seccomp as seccompmod
from nsbox.host import seccomp_compile as compiler
from nsbox.host.seccomp_rules import AIO, not_in, sha256_hex
from nsbox.policy.policy import SeccompArg, SeccompRule

_EACCES, _EPERM, _ENOSYS = "errno:EACCES", "errno:EPERM", "errno:ENOSYS"
_ENOTSUP = "errno:ENOTSUP"
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10
_SOCK_STREAM, _SOCK_TYPE_MASK = 1, 0xF  # the type's low bits; the rest are flags
_IPPROTO_TCP = 6
_MSG_FASTOPEN = 0x20000000
_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000)
_TIOCSTI, _TIOCLINUX, _U32 = 0x5412, 0x541C, (1 << 32) - 1
_IPC = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
        "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend",
        "mq_timedreceive", "mq_notify", "mq_getsetattr", "keyctl", "add_key", "request_key")
_CHOWN_BY_NAME = ("chown", "lchown", "fchownat")
_CHMOD_MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2}
_XATTR_CHANGES = ("setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr",
                  "lremovexattr", "fremovexattr", "removexattrat")
_WATCHES = ("inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
            "fanotify_mark")
# Calls newer than some libseccomp (2.5 knows neither): their number in the table every
# architecture but alpha and mips shares from Linux 5.1 on (scripts/syscall.tbl). The kernel
# has them from 6.13, so leaving them out would leave the door open there.
# fchmodat2 (Linux 6.6, 452) is one too for a libseccomp older than 2.5.5: its mode rule must hold
# whatever library compiled the program.
_NEWER_NUMBERS = {"setxattrat": 463, "removexattrat": 466, "statmount": 457, "listmount": 458,
                  "fchmodat2": 452}
# listmount and statmount (Linux 6.8) list the host's mount table, mount points and all, which
# /proc/self/mountinfo (out of the sandbox's reach) would show.
_MOUNT_LISTS = ("listmount", "statmount")
# The last syscall number these rules were written against (seccomp_compile.TABLE_END, 456:
# futex_requeue, Linux 6.7, the end of the table of the system's libseccomp, 2.5.4 as Debian 12
# ships it). Every number past it is ENOSYS (seccomp_compile.past_table_prefix), unless a rule
# here names it (_NEWER_NUMBERS) or it is one of the calls below, allowed on purpose: mseal
# seals the caller's own memory and nothing else's; getxattrat and listxattrat read what
# getxattr and listxattr read. Refused so: lsm_get_self_attr, lsm_set_self_attr,
# lsm_list_modules (6.8), open_tree_attr (6.15), file_getattr and file_setattr (6.17), and
# whatever a later kernel adds, until a rule here weighs it. (The policy's filter has its own
# set, seccomp_compile.POLICY_PAST_TABLE.)
TABLE_END = compiler.TABLE_END
_ALLOWED_PAST_TABLE = {"mseal": 462, "getxattrat": 464, "listxattrat": 465}
_GROUP_OR_OTHER_WRITE = (0o020, 0o002)
# The argument that names the other process, per call.
_TARGET_ARG = {"prlimit64": 0, "sched_setaffinity": 0, "sched_setscheduler": 0,
               "sched_setparam": 0, "sched_setattr": 0}


def _rule(name: str, action: str, *args: SeccompArg) -> SeccompRule:
    return SeccompRule(name, action, tuple(args))


def _socket_rules() -> list[SeccompRule]:
    rules = [SeccompRule("socket", _EACCES, c) for c in not_in(0, (_AF_INET, _AF_INET6))]
    rules += [_rule("socket", _EACCES, SeccompArg(1, "masked_eq", kind, _SOCK_TYPE_MASK))
              for kind in range(_SOCK_TYPE_MASK + 1) if kind != _SOCK_STREAM]
    rules += [SeccompRule("socket", _EACCES, c) for c in not_in(2, (0, _IPPROTO_TCP))]
    rules += [SeccompRule("socketpair", _EACCES, c) for c in not_in(0, (_AF_UNIX,))]
    rules += [_rule("socketpair", _EACCES, SeccompArg(1, "masked_eq", kind, _SOCK_TYPE_MASK))
              for kind in range(_SOCK_TYPE_MASK + 1) if kind != _SOCK_STREAM]
    rules += [_rule("bind", _EACCES), _rule("listen", _EACCES)]
    for name, flags_arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
        rules.append(_rule(name, _EACCES,
                           SeccompArg(flags_arg, "masked_eq", _MSG_FASTOPEN, _MSG_FASTOPEN)))
    return rules


def _process_rules() -> list[SeccompRule]:
    rules = [_rule(name, _EPERM, SeccompArg(index, "ne", 0))
             for name, index in _TARGET_ARG.items()]
    # setpriority(which, who, prio) and ioprio_set(which, who, ioprio): only "this process"
    # (PRIO_PROCESS 0 / IOPRIO_WHO_PROCESS 1, with who 0).
    rules += [_rule("setpriority", _EPERM, SeccompArg(0, "ne", 0)),
              _rule("setpriority", _EPERM, SeccompArg(1, "ne", 0)),
              _rule("ioprio_set", _EPERM, SeccompArg(0, "ne", 1)),
              _rule("ioprio_set", _EPERM, SeccompArg(1, "ne", 0))]
    rules += [_rule(name, _EPERM) for name in ("unshare", "setns")]
    rules += [_rule("clone", _EPERM, SeccompArg(0, "masked_eq", flag, flag))
              for flag in _CLONE_NEW_FLAGS]
    rules += [_rule(name, _ENOSYS) for name in ("clone3", "io_uring_setup", "io_uring_enter",
                                                "io_uring_register", *_WATCHES,
                                                *_MOUNT_LISTS, *AIO)]
    rules += [_rule("ioctl", _EPERM, SeccompArg(1, "masked_eq", request, _U32))
              for request in (_TIOCSTI, _TIOCLINUX)]
    return rules


def rules() -> tuple[SeccompRule, ...]:
    """The filter's rules."""
    found = _socket_rules() + _process_rules() + [_rule(name, _EPERM) for name in _IPC]
    found += [_rule(name, _EPERM) for name in _CHOWN_BY_NAME]
    found += [_rule(name, _EPERM, SeccompArg(index, "masked_eq", bit, bit))
              for name, index in _CHMOD_MODE_ARG.items() for bit in _GROUP_OR_OTHER_WRITE]
    found += [_rule(name, _ENOTSUP) for name in _XATTR_CHANGES]
    return tuple(found)


def _syscall_number(pyseccomp: Any, name: str) -> int:
    """The native number of ``name``; -1 when it is not a syscall of this architecture."""
    nr: int = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    if nr < 0 and name in _NEWER_NUMBERS and not os.uname().machine.startswith(("alpha", "mips")):
        return _NEWER_NUMBERS[name]
    return nr


def compile_filter(key: str) -> compiler.Program:
    """Allow by default, the native architecture only (another's syscalls are killed), and
    ENOSYS for every native number past TABLE_END that no rule names (past_table_prefix)."""
    pyseccomp = compiler.import_pyseccomp()
    flt = pyseccomp.SyscallFilter(compiler.RET_ALLOW)
    flt.set_attr(pyseccomp.Attr.ACT_BADARCH, compiler.RET_KILL_PROCESS)
    flt.set_attr(pyseccomp.Attr.CTL_NNP, 0)
    with contextlib.suppress(OSError):
        flt.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)
    named = set(_ALLOWED_PAST_TABLE.values())  # and every rule's number: its rule decides
    for rule in rules():
        nr = _syscall_number(pyseccomp, rule.syscall)
        if nr < 0:
            continue  # not a syscall of this architecture or this libseccomp
        named.add(nr)
        kind, number = compiler.parse_action(rule.action, "Landlock mode rule")
        conditions = [pyseccomp.Arg(a.index, compiler.OPS[a.op],
                                    *((a.mask, a.value) if a.op == "masked_eq" else (a.value,)))
                      for a in rule.args]
        flt.add_rule(compiler.action_value(kind, number, False), nr, *conditions)
    return compiler.Program(
        compiler.with_past_table_prefix(pyseccomp, compiler.export_program(flt), named), key)


def filter_key() -> str:
    """The rules' digest, with the architecture and nsbox's version as every program's key
    has them (nsbox/host/seccomp.py): the filter built with the package is found by it."""
    # "compiler" changes with compile_filter's own options; "past_table" with the prefix's
    # shape (seccomp_compile.past_table_prefix).
    return seccompmod.program_key(
        {"landlock": sha256_hex(repr((rules(), _NEWER_NUMBERS,
                                      _ALLOWED_PAST_TABLE)).encode()), "compiler": 2,
         "past_table": compiler.PAST_TABLE_KEY})


_keys: list[str] = []  # worked out once: nothing in it changes in a process


def load(untrusted_dirs: Iterable[str] = ()) -> compiler.Program:
    """The compiled filter, cached like the others (nsbox/host/seccomp.py)."""
    if not _keys:
        _keys.append(filter_key())
    return seccompmod.cached(_keys[0], untrusted_dirs, lambda: compile_filter(_keys[0]))
