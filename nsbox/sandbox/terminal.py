"""The sandbox's own terminal (``nsbox run --tty``): the child's side, between clone and exec.

Why a pty made inside, and not one the host opens: a pty pair opened by the host would be a
terminal of the host's devpts, whose /dev/pts/N the sandbox cannot see (``tty`` would say "not
a tty", ttyname(3) finds no node), and its slave would be a host object handed in. Made here,
from the sandbox's own devpts instance (nsbox/sandbox/mounts.py, mount_devpts), the terminal is
/dev/pts/0 of a set of ptys nothing outside shares, and it dies with the sandbox's mounts.

The master leaves the sandbox before the command exists: the host hands in one end of a unix
socket as the stdin of the launch (nsbox/host/terminal.py), the child opens the pair, sends the
master over that socket (SCM_RIGHTS), then makes the slave its stdin, stdout and stderr, which
replace the socket and the output pipes. The command never holds the socket or the master. It
gets the slave as its controlling terminal in its own session (``take_as_controlling``, after
the init's fork; setsid(2), TIOCSCTTY in ioctl_tty(2)), so Ctrl-C, Ctrl-Z and job control act
on its foreground process group inside, as on a host's terminal.

The same steps, in C: nsbox/native/child.c (open_terminal, and the TIOCSCTTY in start_init).
Imported by the helper before it clones: os, fcntl and socket only, which it has already.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Sequence

# <asm-generic/ioctls.h>; the termios module lacks the two pty ones.
TIOCSPTLCK = 0x40045431  # _IOW('T', 0x31, int): lock or unlock the slave
TIOCGPTPEER = 0x5441  # _IO('T', 0x41), Linux 4.13: the slave opened from the master itself
TIOCSWINSZ = 0x5414
TIOCSCTTY = 0x540E
TAG = b"nsbox-tty"  # the one byte string the master travels with


def open_terminal(size: Sequence[int]) -> None:
    """Open a pty pair of the sandbox's devpts, send the master over fd 0 (a unix socket from
    the host), and make the slave fds 0, 1 and 2, at ``size`` (rows, columns) already."""
    master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, (0).to_bytes(4, "little"))
        # TIOCGPTPEER rather than open("/dev/pts/N"): no path to resolve, no race on the name
        # (ioctl_tty(2)).
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        rows, cols = int(size[0]), int(size[1])
        fcntl.ioctl(slave, TIOCSWINSZ, (rows | cols << 16).to_bytes(8, "little"))
        channel = socket.socket(fileno=0)
        try:
            socket.send_fds(channel, [TAG], [master])
        finally:
            channel.detach()
    finally:
        os.close(master)
    for fd in (0, 1, 2):
        os.dup2(slave, fd)  # inheritable: the command's streams
    os.close(slave)


def take_as_controlling() -> None:
    """In the command's process, once it leads a session of its own: the slave on fd 0
    becomes its controlling terminal (it is no other session's, so no capability is needed)."""
    fcntl.ioctl(0, TIOCSCTTY, 0)
