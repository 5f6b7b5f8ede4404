"""Child-side network steps, run inside the sandbox's new network namespace before exec.

The sandbox child holds CAP_NET_ADMIN in its own user namespace, which owns its network
namespace, so it can bring ``lo`` up and bind a listening socket there. In ``allow`` mode that
socket is handed out over a unix socket (SCM_RIGHTS, unix(7)) and served by the proxy on the
host side; the child closes its own copy, so no process inside holds it. A socket keeps its
network namespace alive: the namespace ends when the proxy closes the listener.

Also the handoff of that descriptor from the helper to the launcher. Only modules the launch
helper has already imported are used here (the code between clone and exec imports nothing).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from nsbox._sys.wire import receive_fds  # the one SCM_RIGHTS receiver (also for session.py)

# <linux/sockios.h>, <net/if.h>; netdevice(7)
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ = "16sh22x"  # struct ifreq: name[IFNAMSIZ], short ifr_flags, rest of the 24-byte union

PROXY_HOST = "127.0.0.1"
_TAG = b"nsbox-proxy-listener"


def loopback_up() -> None:
    """Set IFF_UP on ``lo`` (netdevice(7)); the kernel then adds 127.0.0.1/8 and ::1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def proxy_listener(port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` of the current network namespace."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((PROXY_HOST, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"proxy listener on {PROXY_HOST}:{port}: {exc.strerror}") from None
    return sock


def send_listener(channel_fd: int, listener: socket.socket) -> None:
    """Pass ``listener`` over the unix socket ``channel_fd``, then close both: no process
    inside keeps the listener."""
    try:
        with socket.socket(fileno=channel_fd) as channel:
            socket.send_fds(channel, [_TAG], [listener.fileno()])
    finally:
        listener.close()


def setup_network(mode: str, port: int, channel_fd: int | None) -> None:
    """The child's network step: nothing for ``none``, lo for ``loopback``, lo plus the proxy
    listener for ``allow``. Raises OSError; the caller reports it as the failed step."""
    if mode == "none":
        return
    loopback_up()
    if mode == "allow":
        if channel_fd is None:
            raise OSError(0, "allow mode without a channel for the proxy listener")
        send_listener(channel_fd, proxy_listener(port))


def receive_listener(channel: socket.socket) -> int | None:
    """The descriptor sent by ``send_listener``, or None if the peer closed without one."""
    msg, fds = receive_fds(channel, len(_TAG), 1)
    if msg == _TAG and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    return None
