"""Start the launch helper as a fork of this process.

For a short-lived, single-threaded, small process (the command line): there, starting a second
interpreter would cost more than the launch itself. Imports nothing but os and socket, so the
command line can call it before it imports anything else.
"""

from __future__ import annotations

import os
import socket


def fork_helper() -> tuple[socket.socket, int]:
    """The host's end of the control socket, and the helper's pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            os.setsid()
            os.dup2(theirs.fileno(), 3)
            from nsbox.helper import loop as _helper

            _helper.serve(3)
        finally:
            os._exit(0)
    theirs.close()
    return ours, pid
