"""Learning mode, the supervisor's side: answer a seccomp listener's notifications with an errno.

In learning mode every errno action of the filter is SECCOMP_RET_USER_NOTIF instead (see
seccomp_unotify(2)). The kernel stops the calling thread and queues a notification on the
listener fd, which the child hands to the helper before exec. The helper answers each one with
the errno the rule names and records the syscall number. It never answers with
SECCOMP_USER_NOTIF_FLAG_CONTINUE, so no denied syscall ever runs: the filter is exactly as
strict as without learning mode. If the helper goes away, the kernel fails pending and later
notifications with ENOSYS: still denied.

The listener must never reach the sandbox (a process holding it could let its own syscalls
through); the kernel creates it close-on-exec, and the child closes it once sent.

Imported by the helper: os, select, struct and fcntl only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import struct
from typing import Any

# <linux/seccomp.h>: SECCOMP_IOWR(0, struct seccomp_notif), SECCOMP_IOWR(1, struct
# seccomp_notif_resp); _IOC(dir=3, type='!', nr, size).
_NOTIF = struct.Struct("=QII iIQ6Q")  # id, pid, flags, seccomp_data{nr, arch, ip, args[6]}
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
IOCTL_NOTIF_RECV = (3 << 30) | (_NOTIF.size << 16) | (ord("!") << 8) | 0
IOCTL_NOTIF_SEND = (3 << 30) | (_RESP.size << 16) | (ord("!") << 8) | 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3


def _matches(condition: list[Any], args: tuple[int, ...]) -> bool:
    index, op, value, mask = condition
    arg = args[index]
    if op == "masked_eq":
        return arg & mask == value
    return {
        "eq": arg == value,
        "ne": arg != value,
        "lt": arg < value,
        "le": arg <= value,
        "gt": arg > value,
        "ge": arg >= value,
    }[op]


class DeniedSyscalls:
    """Serves one sandbox's listener. ``table`` is the ``notify`` part of a compiled program:
    {"rules": {nr: [[conditions, errno], ...]}, "default": errno or None, "names": {...}}."""

    def __init__(self, listener: int, table: dict[str, Any]) -> None:
        self.listener = listener
        self._rules: dict[str, list[Any]] = table.get("rules", {})
        self._default: int | None = table.get("default")
        self._names: dict[str, str] = table.get("names", {})
        self.counts: dict[int, int] = {}

    def fileno(self) -> int:
        return self.listener

    def errno_for(self, nr: int, args: tuple[int, ...]) -> int:
        """The errno of the first rule for ``nr`` whose conditions all hold. Any answer is an
        error, so a rule this misreads can only change which errno the caller sees."""
        for conditions, number in self._rules.get(str(nr), ()):
            if all(_matches(c, args) for c in conditions):
                return int(number)
        if self._default is not None:
            return self._default
        return errno.EPERM

    def handle(self) -> bool:
        """Answer one pending notification, if there is one; never blocks. False when the
        listener is finished (every process of the sandbox is gone): stop polling it."""
        # RECV blocks until a notification comes, even once no process is left, so look first.
        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        events = poller.poll(0)
        if not events:
            return True
        if not events[0][1] & select.POLLIN:
            return False  # POLLHUP: the filter has no users left
        buf = bytearray(_NOTIF.size)  # the kernel insists on a zeroed buffer
        try:
            fcntl.ioctl(self.listener, IOCTL_NOTIF_RECV, buf, True)
        except OSError as exc:
            # ENOENT: the caller died or was interrupted before we read it.
            return exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN)
        ident, _pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buf)
        number = self.errno_for(nr, tuple(args))
        self.counts[nr] = self.counts.get(nr, 0) + 1
        try:
            fcntl.ioctl(self.listener, IOCTL_NOTIF_SEND, _RESP.pack(ident, 0, -number, 0))
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the caller is gone, nothing to answer
                return False
        return True

    def names(self) -> list[str]:
        """The denied syscalls by name, sorted, each once."""
        return sorted({self._names.get(str(nr), f"syscall_{nr}") for nr in self.counts})

    def close(self) -> None:
        if self.listener >= 0:
            os.close(self.listener)
            self.listener = -1
