"""A host that refuses namespaces, as a container's default seccomp profile does: run a command
under a seccomp filter that denies what Docker's default profile (moby's
profiles/seccomp/default.json) denies a container without CAP_SYS_ADMIN.

    python3 containerhost.py COMMAND [ARG...]

unshare, setns, the mount calls, clone with a namespace flag and keyrings get EPERM, clone3
ENOSYS (so that glibc falls back to clone, whose flags the filter can read), as in that profile.
Landlock's three calls are allowed, as there. As root, the command also gets a container's
capabilities (no CAP_SYS_ADMIN). The filter stays on the command and everything it
starts (nsbox, its launch helper, the sandboxes), which is the point. Needs pyseccomp.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import pyseccomp

EPERM_CALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "name_to_handle_at", "open_by_handle_at", "reboot", "swapon",
    "swapoff", "syslog", "acct", "settimeofday", "clock_settime", "quotactl", "iopl", "ioperm",
)
# What Docker gives a container's root by default: no CAP_SYS_ADMIN, no CAP_SYS_PTRACE.
DOCKER_CAPABILITIES = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31)  # chown ... setfcap
PR_CAPBSET_DROP = 24
# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID |
# CLONE_NEWNET: the profile allows clone only when (flags & this) == 0.
CLONE_NAMESPACES = 0x7E020000


def apply() -> None:
    flt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in EPERM_CALLS:
        flt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    for bit in range(32):
        flag = 1 << bit
        if CLONE_NAMESPACES & flag:
            flt.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone",
                         pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    flt.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    if os.geteuid() != 0:
        flt.set_attr(pyseccomp.Attr.CTL_NNP, 1)  # an unprivileged process needs no_new_privs
    else:
        flt.set_attr(pyseccomp.Attr.CTL_NNP, 0)  # as runc: root loads it with CAP_SYS_ADMIN
    flt.load()


def drop_capabilities() -> None:
    """As root, a container's capability set: the bounding set is what root gets at exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if cap not in DOCKER_CAPABILITIES and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")


def main() -> None:
    if os.geteuid() == 0:
        drop_capabilities()
    apply()
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
