"""Another id is forbidden, not invalid: EPERM for set*id and chown to an id the sandbox is not.

The sandbox's user namespace maps one uid and one gid, its own. The kernel checks that an id is
mapped before it checks permission, so ``setuid(65534)`` or ``chown(f, 0, -1)`` fail inside
with EINVAL ("Invalid argument"), where an unprivileged process on a host gets EPERM: a program
that expects only EPERM (CPython's own test suite among them) takes EINVAL for a bug
(setuid(2), chown(2): EINVAL "the ID is not valid in this user namespace").

So a short classic BPF program answers EPERM first, for exactly those calls: ``setuid``,
``setgid``, ``setreuid``, ``setregid``, ``setresuid``, ``setresgid``, ``chown``, ``fchown``,
``lchown`` and ``fchownat`` with an id argument that is neither the sandbox's own nor -1 (keep).
The kernel would refuse each of them anyway (no capability, an unmapped id); only the errno
changes. Nothing else is decided here: every other call, another architecture's (a 32-bit
process) and an id with any of its upper 32 bits set (which the kernel reads as 32-bit) go on
to the set-id filter it is put in front of (``prefix(...) + set-id program``, one filter: classic
BPF jumps only forward, so this part ends where the next begins). Not a security boundary: the
kernel's own check stays behind it.
"""

from __future__ import annotations

import os
import struct
from functools import lru_cache

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
_LD_W_ABS, _JEQ_K, _JA, _RET_K = 0x20, 0x15, 0x05, 0x06
_RET_ERRNO_EPERM = 0x00050000 | 1
_NR, _ARCH, _ARGS = 0, 4, 16  # struct seccomp_data offsets; args are 8 bytes each (LE)
_KEEP = 0xFFFFFFFF  # (uid_t) -1: leave this id as it is

# name -> (the id arguments, each "uid" or "gid", in argument order)
_CALLS = {
    "setuid": ("uid",), "setgid": ("gid",),
    "setreuid": ("uid", "uid"), "setregid": ("gid", "gid"),
    "setresuid": ("uid", "uid", "uid"), "setresgid": ("gid", "gid", "gid"),
    "chown": (None, "uid", "gid"), "lchown": (None, "uid", "gid"),
    "fchown": (None, "uid", "gid"), "fchownat": (None, None, "uid", "gid"),
}
# The system call numbers (the architecture's unistd.h) and AUDIT_ARCH values of the
# architectures this knows; elsewhere nothing is put in front (the EINVAL stays).
_ARCHES = {
    "x86_64": (0xC000003E, {"setuid": 105, "setgid": 106, "setreuid": 113, "setregid": 114,
                            "setresuid": 117, "setresgid": 119, "chown": 92, "fchown": 93,
                            "lchown": 94, "fchownat": 260}),
    "aarch64": (0xC00000B7, {"setregid": 143, "setgid": 144, "setreuid": 145, "setuid": 146,
                             "setresuid": 147, "setresgid": 149, "fchownat": 54, "fchown": 55}),
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _call_block(number: int, ids: tuple[str | None, ...], uid: int, gid: int) -> list[bytes]:
    """``A == number``: check its id arguments, then go on past the prefix; else skip this
    block with A (the number) kept."""
    body: list[bytes] = []
    for index, kind in enumerate(ids):
        if kind is None:
            continue
        own = uid if kind == "uid" else gid
        low = _ARGS + 8 * index  # little-endian: the lower half first
        body += [
            _insn(_LD_W_ABS, 0, 0, low + 4),
            _insn(_JEQ_K, 0, 4, 0),  # upper half set: the kernel's answer
            _insn(_LD_W_ABS, 0, 0, low),
            _insn(_JEQ_K, 2, 0, own),
            _insn(_JEQ_K, 1, 0, _KEEP),
            _insn(_RET_K, 0, 0, _RET_ERRNO_EPERM),
        ]
    body.append(b"END")  # ja to the end of the prefix, resolved in prefix()
    return [_insn(_JEQ_K, 0, len(body), number), *body]


@lru_cache(maxsize=16)
def prefix(uid: int, gid: int, machine: str | None = None) -> bytes:
    """The BPF instructions to put in front of the set-id filter for a sandbox whose user is
    ``uid``:``gid`` inside (empty on an architecture this does not know)."""
    # os.uname(), not the platform module: its import costs every `nsbox run` 1-2 ms.
    arch = _ARCHES.get(machine or os.uname().machine)
    if arch is None:
        return b""
    audit_arch, numbers = arch
    code: list[bytes] = [_insn(_LD_W_ABS, 0, 0, _ARCH), _insn(_JEQ_K, 1, 0, audit_arch),
                         b"END", _insn(_LD_W_ABS, 0, 0, _NR)]
    for name, ids in _CALLS.items():
        if name in numbers:
            code += _call_block(numbers[name], ids, uid, gid)
    end = len(code)
    return b"".join(_insn(_JA, 0, 0, end - i - 1) if insn == b"END" else insn
                    for i, insn in enumerate(code))
