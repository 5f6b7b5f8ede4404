"""The seccomp compiler: rules checked and turned into a BPF program with libseccomp.

pyseccomp is imported here alone, and only when a program is compiled: its import runs
ldconfig (about 35 ms). Callers get programs through the cache (nsbox/host/seccomp.py); the
rules themselves are in nsbox/host/seccomp_rules.py. docs/seccomp.md explains the choices.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nsbox.errors import HostError, PolicyError
from nsbox.host.seccomp_rules import SETID_RULES, U64, effective_rules
from nsbox.policy.policy import Seccomp, SeccompArg, SeccompRule

# Return values of a seccomp filter, <linux/seccomp.h>.
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
RET_ALLOW = 0x7FFF0000

# The comparison operators of libseccomp's enum scmp_compare, by the names profiles use.
OPS = {"ne": 1, "lt": 2, "le": 3, "eq": 4, "ge": 5, "gt": 6, "masked_eq": 7}

# A filter longer than this is refused by the kernel (BPF_MAXINSNS, <linux/bpf_common.h>).
MAX_INSNS = 4096
# The generic syscall table's number of fchmodat2 (Linux 6.6), for a libseccomp that predates it.
_NR_FCHMODAT2 = 452

# --- calls newer than the rules (past_table_prefix) -------------------------------------------
# The last syscall number the rules (seccomp_rules.py's and landlock_filter.py's) were written
# against: futex_requeue (Linux 6.7), the end of the table of the system's libseccomp (2.5.4 as
# Debian 12 ships it). libseccomp names calls, and cannot name one it does not know, so under an
# allow-by-default filter every later call would reach the kernel unweighed (lsm_set_self_attr,
# open_tree_attr, file_setattr, ...): past_table_prefix answers them before libseccomp's program.
TABLE_END = 456
# Where the numbers the shared table will not reach begin: ARM's private calls (__ARM_NR_BASE:
# set_tls, which glibc's start needs, cacheflush); above them x86_64's x32 numbers
# (__X32_SYSCALL_BIT, 0x40000000) and -1 (0xffffffff, how a tracer skips a call, seccomp(2)).
# From here on a number goes on to libseccomp's program: it kills an x32 number, as every
# filter of the sandbox does; on x86_64 the kernel has nothing else there (ENOSYS anyway).
_ARCH_PRIVATE = 0x000F0000
# The calls past TABLE_END this code knows (the table every architecture but alpha and mips
# shares, Linux 6.8 to 6.17), for learning mode's report where libseccomp has no name.
NEWER_NAMES = {457: "statmount", 458: "listmount", 459: "lsm_get_self_attr",
               460: "lsm_set_self_attr", 461: "lsm_list_modules", 462: "mseal",
               463: "setxattrat", 464: "getxattrat", 465: "listxattrat", 466: "removexattrat",
               467: "open_tree_attr", 468: "file_getattr", 469: "file_setattr"}
# The policy's filter (allow by default): past the table, allowed on purpose, each because its
# older sibling is allowed by the policy's rules, which refuse no xattr call and no mount listing:
# mseal seals the caller's own memory and nothing else's; getxattrat, listxattrat, setxattrat
# and removexattrat do what getxattr, listxattr, setxattr and removexattr do (security.* and
# trusted.* names need capabilities the sandbox does not have; the set-id route,
# security.capability, needs CAP_SETFCAP); statmount and listmount list the sandbox's own mount
# namespace, which its /proc/self/mountinfo shows too (another one needs CAP_SYS_ADMIN over it:
# ENOENT). Refused (ENOSYS): lsm_get_self_attr, lsm_set_self_attr, lsm_list_modules (6.8),
# open_tree_attr (6.15: open_tree is refused), file_getattr and file_setattr (6.17), and
# whatever a later kernel adds, until a rule weighs it. The Landlock mode's filter has its own
# set (landlock_filter._ALLOWED_PAST_TABLE).
POLICY_PAST_TABLE = {"statmount": 457, "listmount": 458, "mseal": 462, "setxattrat": 463,
                     "getxattrat": 464, "listxattrat": 465, "removexattrat": 466}
# What the prefix is made of; every key of a program that has it includes this (a change here
# is a new program): nsbox/host/seccomp.py cache_key, landlock_filter.filter_key.
PAST_TABLE_KEY = repr(("past-table", 1, TABLE_END, _ARCH_PRIVATE))
RET_ERRNO_ENOSYS = RET_ERRNO | errno.ENOSYS
# <linux/filter.h>, <linux/bpf_common.h>: the prefix's instructions; struct seccomp_data offsets.
_LD_W_ABS, _JEQ_K, _JGT_K, _JGE_K, _RET_K = 0x20, 0x15, 0x25, 0x35, 0x06
_NR, _ARCH = 0, 4


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
        if not 0 <= number <= U64:
            raise PolicyError(
                f"{what} {number} is not an unsigned 64-bit number",
                key=key,
                hint="write negative numbers as their unsigned value (-1 is 0xffffffffffffffff)",
            )
    if arg.op != "masked_eq" and arg.mask:
        raise PolicyError(f"a mask is only for masked_eq, not {arg.op!r}", key=key)


def action_value(kind: str, number: int, listener: bool) -> int:
    if kind == "allow":
        return RET_ALLOW
    if kind == "kill":
        return RET_KILL_PROCESS
    return RET_USER_NOTIF if listener else RET_ERRNO | (number & 0xFFFF)


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def past_table_prefix(audit_arch: int, named: Iterable[int], refuse: int) -> bytes:
    """The instructions in front of libseccomp's program: a native number past TABLE_END (and
    below _ARCH_PRIVATE) that is not in ``named`` answers ``refuse`` (ENOSYS, as on a kernel
    without the call: programs fall back); every other call goes on to the program, unchanged.

    ``named``: the numbers a rule of the filter names (its rule decides) and those allowed on
    purpose. Another architecture (i386's int 0x80, whose AUDIT_ARCH_I386 is not the native
    one) and a number with the x32 bit (x86_64's: x32 calls carry AUDIT_ARCH_X86_64 too, and
    only __X32_SYSCALL_BIT in the number tells the two ABIs apart, seccomp(2)) go on too:
    libseccomp's program kills both (ACT_BADARCH, and its own check of the bit), so that every
    filter of the sandbox answers them alike. Every number from _ARCH_PRIVATE on goes on as
    well: the x32 ones, ARM's private calls, -1 (a tracer's skipped call)."""
    passing = sorted({nr for nr in named if TABLE_END < nr < _ARCH_PRIVATE})
    if len(passing) > 200:  # a jump's offset is one byte
        raise ValueError(f"{len(passing)} numbers past the table: too many for the prefix")
    # 0 ld arch; 1 native?; 2 ld nr; 3 past the table?; 4 private (x32, -1)?; named; refuse
    end = 6 + len(passing)  # the first instruction of libseccomp's program
    code = [_insn(_LD_W_ABS, 0, 0, _ARCH), _insn(_JEQ_K, 0, end - 2, audit_arch),
            _insn(_LD_W_ABS, 0, 0, _NR), _insn(_JGT_K, 0, end - 4, TABLE_END),
            _insn(_JGE_K, end - 5, 0, _ARCH_PRIVATE)]
    code += [_insn(_JEQ_K, end - 6 - i, 0, nr) for i, nr in enumerate(passing)]
    code.append(_insn(_RET_K, 0, 0, refuse))
    return b"".join(code)


def with_past_table_prefix(pyseccomp: Any, bpf: bytes, named: Iterable[int],
                           refuse: int = RET_ERRNO_ENOSYS) -> bytes:
    """``bpf`` (libseccomp's program) behind past_table_prefix; unchanged on alpha and mips,
    whose numbers are not the shared table's."""
    if os.uname().machine.startswith(("alpha", "mips")):
        return bpf
    return past_table_prefix(pyseccomp.system_arch(), named, refuse) + bpf


def compile_program(seccomp: Seccomp, key: str = "") -> Program:
    """Compile with libseccomp. Raises PolicyError naming a bad rule. ``key`` is the cache's
    (nsbox/host/seccomp.py), kept with the program.

    A deny list (default ``allow``) gets past_table_prefix: a call newer than the rules answers
    ENOSYS unless POLICY_PAST_TABLE or a rule names it (a profile's rule of a newer libseccomp
    than TABLE_END's, which knows the name: the rule decides)."""
    pyseccomp = import_pyseccomp()
    listener = seccomp.log_denied
    default_kind, default_errno = parse_action(seccomp.default_action, "seccomp.default_action")
    default = action_value(default_kind, default_errno, listener)
    notify_rules: dict[str, list[Any]] = {}
    named: set[int] = set()  # the numbers the rules name

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
        named.add(nr)
        action = action_value(kind, number, listener)
        if action == default:
            continue  # libseccomp refuses a rule that repeats the default; it changes nothing
        conditions = [
            pyseccomp.Arg(a.index, OPS[a.op], *((a.mask, a.value) if a.op == "masked_eq"
                                                else (a.value,)))
            for a in rule.args
        ]
        try:
            flt.add_rule(action, nr, *conditions)
        except (OSError, ValueError) as exc:  # ValueError: pyseccomp's own check of the args
            raise PolicyError(
                f"libseccomp refuses the rule for {rule.syscall!r}: "
                f"{getattr(exc, 'strerror', None) or exc}",
                key=where,
                hint="one comparison per argument in a rule; two rules for the same syscall "
                "must not differ only in the action",
            ) from None
        if action == RET_USER_NOTIF:
            conds = [[a.index, a.op, a.value, a.mask] for a in rule.args]
            notify_rules.setdefault(str(nr), []).append([conds, number])

    bpf = export_program(flt)
    # With an errno or kill default nothing past the table is allowed anyway, and with a user
    # notification default (learning mode's errno default) the listener already answers and
    # records every call no rule allows, those past the table too. A deny list in learning mode
    # refuses them through the listener as well (RET_USER_NOTIF; the helper answers ENOSYS,
    # notify's "default" below), so that learning shows what a program tried.
    past_table = default == RET_ALLOW
    if past_table:
        refuse = RET_USER_NOTIF if listener else RET_ERRNO_ENOSYS
        bpf = with_past_table_prefix(pyseccomp, bpf, named | set(POLICY_PAST_TABLE.values()),
                                     refuse)
    if len(bpf) // 8 > MAX_INSNS:
        raise PolicyError(
            f"the seccomp program has {len(bpf) // 8} instructions; the kernel takes at most "
            f"{MAX_INSNS}",
            key="seccomp.rules",
        )
    notify = None
    if listener:
        # With an allow default the listener hears only the rules' errnos (each in "rules")
        # and the prefix's calls past the table: for those the default is ENOSYS.
        notify = {
            "rules": notify_rules,
            "default": (default_errno if default == RET_USER_NOTIF
                        else errno.ENOSYS if past_table else None),
            "names": _syscall_names(pyseccomp),
        }
    return Program(bpf, key, listener, notify)


def compile_setid(key: str = "") -> Program:
    """Compile SETID_RULES: allow by default, the native architecture only (as the policy's
    program: another architecture's syscalls are killed, they would bypass the numbers here)."""
    pyseccomp = import_pyseccomp()
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
        flt.add_rule(action_value(kind, number, False), nr, *conditions)
    return Program(export_program(flt), key)


def import_pyseccomp() -> Any:
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


def export_program(flt: Any) -> bytes:
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
    names = {str(nr): name for nr, name in NEWER_NAMES.items()}  # libseccomp's name first
    for nr in range(1024):
        try:
            names[str(nr)] = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr).decode()
        except ValueError:
            continue
    return names
