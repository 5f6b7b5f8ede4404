"""JSON messages of any size over a SOCK_SEQPACKET socket, with descriptors.

A datagram cannot be larger than the socket's send buffer (about 208 KB by default,
net.core.wmem_default; socket(7)), and a plan can be: an environment of a few 100 KB variables,
100,000 arguments, a large File mount. Such a message is written to a memfd instead, and the
datagram carries only its length, with the memfd as the last descriptor. The receiver reads it
back; the sender is always nsbox itself (host -> helper -> spawner), never a sandbox.

Plain os and socket calls only: the helper imports this before it clones.
"""

from __future__ import annotations

import array
import json
import os
import socket
from typing import Any, TypedDict

# --- the messages, typed (their order and meaning: nsbox/helper/loop.py's docstring) -----------


class SetupErrorInfo(TypedDict):
    """A named step that failed: sandbox child -> helper (error pipe) -> host (exit report),
    raised on the host as a SetupError (launcher._setup_error)."""

    step: str
    errno: int
    message: str


class HostErrorInfo(TypedDict):
    """What the helper's host cannot do (identity, cgroups), raised on the host as HostError."""

    feature: str
    message: str
    hint: str | None


class WirePlan(TypedDict, total=False):
    """The plan as the helper and the sandbox child get it: plan.Plan.to_wire(), plus what
    the door that launches adds (host ids, session, trace) and what the helper adds itself
    (pooled, degraded)."""

    argv: list[str]
    env: list[tuple[str, str]]  # JSON lists of two strings on the way
    cwd: str
    uid: int
    gid: int
    user: str
    hostname: str
    mounts: list[dict[str, Any]]  # mount operations in order: {"op": kind, "target": ...}
    wall_time: float | None
    rlimits: list[Any]  # [resource, soft, hard] each
    seccomp_bpf: str | None
    seccomp_notify: dict[str, Any] | None
    setid_bpf: str
    net: dict[str, Any]
    cgroup: dict[str, Any]
    host_uid: int
    host_gid: int
    session: dict[str, Any] | None  # a session's init instead of a command
    trace: bool
    pooled: bool
    degraded: list[str]
    native: bool  # False: NSBOX_NATIVE=0, the Python child (nsbox/sandbox/native.py)


class ExitReport(TypedDict, total=False):
    """helper -> host, the launch socket's last message: how the sandbox ended."""

    event: str  # "exit"
    wait_status: int
    wall_time: float
    cpu_user: float
    cpu_system: float
    maxrss_kib: int
    timed_out: bool
    kill_reason: str | None
    setup_error: SetupErrorInfo | None
    host_error: HostErrorInfo
    core: str  # "native" or "python": the core that ran the sandbox child
    seccomp_denied: list[str] | None
    limits: dict[str, Any]
    trace: list[Any]


INLINE_MAX = 64 * 1024  # bytes sent in the datagram itself
MAX_MESSAGE = 256 * 1024 * 1024  # larger is refused: the launch fails with a LaunchError
_TAG = b'{"memfd": '


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()
         ) -> None:
    """Send ``message`` and ``fds``; raises OSError like sendmsg (EPIPE: the peer is gone)."""
    send_bytes(sock, json.dumps(message).encode(), fds)


def send_bytes(sock: socket.socket, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """``send`` of bytes that are not JSON (the native core's flat plan, to a spawner); they
    must not begin like the memfd's tag. ``receive`` gives them back as they are."""
    if len(data) <= INLINE_MAX:
        _sendmsg(sock, data, list(fds))
        return
    if len(data) > MAX_MESSAGE:
        raise OSError(0, f"the message is too large ({len(data)} bytes, at most {MAX_MESSAGE})")
    fd = os.memfd_create("nsbox-message", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        _sendmsg(sock, _TAG + str(len(data)).encode() + b"}", [*fds, fd])
    finally:
        os.close(fd)


def _sendmsg(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancdata)


def receive_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0
                ) -> tuple[bytes, list[int]]:
    """recvmsg with SCM_RIGHTS (unix(7)): the one receiver of descriptors in nsbox. They arrive
    close-on-exec, so that no program the receiver starts inherits them (unlike
    socket.recv_fds without the flag)."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(
        bufsize, socket.CMSG_SPACE(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC | flags)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, list(fds)


def receive(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]]:
    """One message (its JSON bytes, b"" at end-of-file) and the descriptors sent with it, all
    close-on-exec. A message that came in a memfd is read back here."""
    msg, received = receive_fds(sock, INLINE_MAX, maxfds + 1)
    if not msg.startswith(_TAG) or not received:
        return msg, received
    fd = received.pop()
    try:
        size = int(json.loads(msg)["memfd"])
        if not 0 <= size <= MAX_MESSAGE:
            raise ValueError(f"a message of {size} bytes")
        return _read_exactly(fd, size), received
    except BaseException:
        for other in received:
            os.close(other)
        raise
    finally:
        os.close(fd)


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 20), offset)
        if not chunk:
            raise ValueError("the message's memfd is shorter than announced")
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
