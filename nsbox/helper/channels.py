"""A launch's side channels from its child: learning mode's seccomp listener, served here
until the sandbox ends (nsbox/helper/seccomp_notify.py), and network allow mode's proxy
listener, passed on to the host process at once (nsbox/host/network.py).

Each is a socket pair made before the clone; the child sends its descriptor (SCM_RIGHTS) before
the exec, or closes its end without sending when it failed before (its error pipe says why).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket

from nsbox._sys import wire as _wire
from nsbox._sys.wire import WirePlan
from nsbox.helper.launch import Launch
from nsbox.helper.seccomp_notify import DeniedSyscalls
from nsbox.sandbox import netns as _netns


def open_channels(selector: selectors.BaseSelector, launch: Launch, plan: WirePlan,
                  child_ends: contextlib.ExitStack) -> tuple[int, int | None]:
    """The socket pairs the plan needs: the child's ends' fds (closed by ``child_ends``) for
    learning mode (-1 without) and allow mode (None without). Raises OSError."""
    notify_fd, net_fd = -1, None
    launch.notify_table = plan.get("seccomp_notify")
    if launch.notify_table:
        launch.notify_sock, notify_child = socket.socketpair(socket.AF_UNIX,
                                                             socket.SOCK_SEQPACKET)
        launch.cleanup.callback(close_notify, selector, launch)
        child_ends.callback(notify_child.close)
        notify_fd = notify_child.fileno()
    if plan["net"].get("mode") == "allow":
        launch.net_sock, net_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launch.cleanup.callback(close_net, selector, launch)
        # The child's end, closed here after the clone: EOF once the child sent or died.
        child_ends.callback(net_child.close)
        net_fd = net_child.fileno()
    return notify_fd, net_fd


def watch_channels(selector: selectors.BaseSelector, launch: Launch) -> None:
    if launch.notify_sock is not None:
        selector.register(launch.notify_sock, selectors.EVENT_READ,
                          lambda _f: receive_listener(selector, launch))
    if launch.net_sock is not None:
        selector.register(launch.net_sock, selectors.EVENT_READ,
                          lambda _f: pass_proxy_listener(selector, launch))


# --- learning mode: the seccomp listener ----------------------------------------------------

def receive_listener(selector: selectors.BaseSelector, launch: Launch) -> None:
    """The child sends the listener right after loading the filter, or nothing (EOF) when it
    failed before; either way this socket's work is done."""
    assert launch.notify_sock is not None
    try:
        _msg, fds = _wire.receive_fds(launch.notify_sock, 16, 1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    except OSError:
        fds = []
    selector.unregister(launch.notify_sock)
    launch.notify_sock.close()
    launch.notify_sock = None
    if fds:
        launch.denied = DeniedSyscalls(fds[0], launch.notify_table or {})
        selector.register(fds[0], selectors.EVENT_READ,
                          lambda _f: serve_listener(selector, launch))


def serve_listener(selector: selectors.BaseSelector, launch: Launch) -> None:
    if launch.denied is None or launch.denied.listener < 0:
        return
    if not launch.denied.handle():
        selector.unregister(launch.denied.listener)
        launch.denied.close()


def close_notify(selector: selectors.BaseSelector, launch: Launch) -> None:
    if launch.notify_sock is not None:
        unwatch(selector, launch.notify_sock)
        launch.notify_sock.close()
        launch.notify_sock = None
    if launch.denied is not None and launch.denied.listener >= 0:
        unwatch(selector, launch.denied.listener)
        launch.denied.close()


# --- network allow mode: the proxy listener -------------------------------------------------

def close_net(selector: selectors.BaseSelector, launch: Launch) -> None:
    if launch.net_sock is not None:
        unwatch(selector, launch.net_sock)
        launch.net_sock.close()
        launch.net_sock = None


def pass_proxy_listener(selector: selectors.BaseSelector, launch: Launch) -> None:
    """Hand the proxy listener from the sandbox child on to the host process. The child sends
    it before exec; end-of-file means it failed before (its error pipe says why)."""
    if launch.net_sock is None:
        return
    try:
        fd = _netns.receive_listener(launch.net_sock)
    except OSError:
        fd = None
    close_net(selector, launch)
    if fd is not None:
        launch.send_fd({"event": "proxy"}, fd)
        os.close(fd)


def unwatch(selector: selectors.BaseSelector, fileobj: socket.socket | int) -> None:
    """Stop watching ``fileobj`` if it is watched."""
    try:
        selector.unregister(fileobj)
    except (KeyError, ValueError):
        pass
