"""Landlock (landlock(7)): the three system calls of the Landlock isolation mode, and its rights.

A Landlock ruleset names the access rights it *handles*; once a process restricts itself with it
(``restrict_self``), every handled right is denied except where a rule grants it beneath a path.
Restrictions stack: each call adds a layer, inherited by every child, never removed. The mode
(docs/hosts.md, "The Landlock mode") handles every right the kernel knows, so what a rule does not
grant is denied.

Rights by ABI version (landlock(7), "Landlock ABI versions"): 1 files, 2 REFER (link and rename
across directories), 3 TRUNCATE, 4 TCP bind and connect, 5 IOCTL_DEV, 6 scopes (signals and
abstract unix sockets stay inside the domain), 7 audit flags only. Like nsbox/_sys/libc.py, this
module is imported by the launch helper and used in its children before exec: the prototypes
are typed once, here.
"""

from __future__ import annotations

import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)

# The same numbers on every architecture (asm-generic/unistd.h).
NR_CREATE_RULESET = 444
NR_ADD_RULE = 445
NR_RESTRICT_SELF = 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1

# <linux/landlock.h>
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

# The oldest ABI the mode accepts: the first that handles TCP, without which the sandbox could
# connect to any host's port (docs/hosts.md).
MIN_ABI = 4
SCOPES_ABI = 6

# The rights that a rule on a file (not a directory) may grant (landlock_add_rule(2), EINVAL).
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

_long, _int = ctypes.c_long, ctypes.c_int
_create = _libc["syscall"]
_create.restype, _create.argtypes = _long, (_long, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint)
_add = _libc["syscall"]
_add.restype, _add.argtypes = _long, (_long, _int, _int, ctypes.c_char_p, ctypes.c_uint)
_restrict = _libc["syscall"]
_restrict.restype, _restrict.argtypes = _long, (_long, _int, ctypes.c_uint)

# struct landlock_ruleset_attr: handled_access_fs, handled_access_net (ABI 4), scoped (ABI 6);
# struct landlock_path_beneath_attr: allowed_access (u64), parent_fd (s32), packed.
_RULESET = struct.Struct("=3Q")
_PATH_BENEATH = struct.Struct("=Qi")


def _fail(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


def abi_version() -> int:
    """The kernel's Landlock ABI: 0 when it has none (not built, or not in the ``lsm=`` list)."""
    version = _create(NR_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    return max(0, int(version))


def fs_rights(abi: int) -> int:
    """Every filesystem right the ABI knows: what the mode's rulesets handle."""
    rights = (FS_MAKE_SYM << 1) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
# Writable trees get everything but making device nodes (which also needs CAP_MKNOD).
WRITABLE = ((FS_IOCTL_DEV << 1) - 1) & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)


def create_ruleset(abi: int, fs: bool, net: bool, scoped: bool) -> int:
    """A ruleset that handles every filesystem right (``fs``), TCP bind and connect (``net``)
    and both scopes (``scoped``, ABI 6) the ABI knows: a descriptor."""
    handled_fs = fs_rights(abi) if fs else 0
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if net else 0
    scopes = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if scoped else 0
    # The size tells the kernel which fields this caller knows (copy_struct_from_user).
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = _RULESET.pack(handled_fs, handled_net, scopes)[:size]
    fd = _create(NR_CREATE_RULESET, attr, size, 0)
    if fd < 0:
        raise _fail("landlock_create_ruleset")
    return int(fd)


def add_path_rule(ruleset: int, parent_fd: int, rights: int, abi: int, is_dir: bool) -> None:
    """Grant ``rights`` beneath the file or directory ``parent_fd`` (an O_PATH descriptor); the
    rights the ABI does not know are left out, a file's to those a file can have."""
    rights &= fs_rights(abi)
    if not is_dir:
        rights &= _FILE_RIGHTS
    if _add(NR_ADD_RULE, ruleset, RULE_PATH_BENEATH, _PATH_BENEATH.pack(rights, parent_fd),
            0) != 0:
        raise _fail("landlock_add_rule")


def restrict_self(ruleset: int) -> None:
    """Enforce the ruleset on this thread (the launch's children are single-threaded) and all
    it starts from now on. Needs no_new_privs (landlock_restrict_self(2))."""
    if _restrict(NR_RESTRICT_SELF, ruleset, 0) != 0:
        raise _fail("landlock_restrict_self")
