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
import errno
import json
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # names for the types only: nothing more is imported before a clone
    from nsbox.errors import ErrorWire
    from nsbox.policy.policy import Policy

# --- the messages, typed (their order and meaning: nsbox/helper/loop.py's docstring) -----------


class SetupErrorInfo(TypedDict):
    """A named step that failed: sandbox child -> helper (error pipe) -> host (exit report),
    raised on the host as a SetupError (launcher.setup_error_from)."""

    step: str
    errno: int
    message: str


class HostErrorInfo(TypedDict):
    """What the helper's host cannot do (identity, cgroups), raised on the host as HostError."""

    feature: str
    message: str
    hint: str | None


class SessionSpec(TypedDict):
    """The plan's ``session`` key: the sandbox child becomes a session's init
    (nsbox/sandbox/sessioninit.py) instead of exec'ing a command."""

    idle_timeout: float | None


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
    session: SessionSpec | None  # a session's init instead of a command
    trace: bool
    pooled: bool
    degraded: list[str]
    native: bool  # False: NSBOX_NATIVE=0, the Python child (nsbox/sandbox/native.py)
    isolation: str  # "landlock": no namespaces (nsbox/plan/landlock.py); absent: namespaces
    landlock: dict[str, Any]  # its rules; the helper adds the directories and the ids
    tty: list[int]  # --tty: [rows, columns]; stdin is a socket for the pty's master


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
    disk_full: list[str]  # the writable places pid 1 found full at the command's end


# --- sessions and pools (their protocols: nsbox/sandbox/sessioninit.py,
# nsbox/session/supervisor.py, nsbox/launch/pool.py and nsbox/helper/pool.py) ------------------


class WireCommand(TypedDict, total=False):
    """The command's part of a plan, sent to a sandbox that exists already (a session's init,
    a pooled sandbox): what a command brings; the rest of its plan is the sandbox's."""

    argv: list[str]
    env: list[tuple[str, str]]
    cwd: str
    rlimits: list[Any]
    seccomp_bpf: str | None
    seccomp_notify: dict[str, Any] | None  # a pooled sandbox only
    wall_time: float | None
    tty: list[int]  # as WirePlan's


class FileOp(TypedDict, total=False):
    """A session's file operation, run by nsbox/sandbox/fileworker.py: ``kind`` is put, get,
    getmany, list or changes; the other keys are that kind's arguments and caps."""

    kind: str
    path: str
    paths: list[str]
    mode: int
    patterns: list[str]
    max_files: int
    max_size: int
    max_total: int
    max_entries: int
    wall_time: float


class InitRequest(TypedDict, total=False):
    """host -> a session's init, on its control socket, with the command's socket and stdio:
    ``{"cmd": "run", "command": ...}`` or ``{"cmd": "file", "op": ...}``."""

    cmd: str
    command: WireCommand
    op: FileOp


class InitEvent(TypedDict, total=False):
    """A session's init -> host: ``{"event": "ready", "pid"}`` on the control socket once the
    sandbox is built; ``{"event": "pid", "pid"}`` on a command's socket (then an ExitReport).
    The launch helper sends the same ``pid`` event for a launch, and ``{"event": "proxy"}``
    with the proxy's listener in network allow mode."""

    event: str
    pid: int


class KillRequest(TypedDict):
    """host -> the helper or a session's init, on a launch's or a command's socket: end it
    (e.g. its output passed the cap)."""

    cmd: str  # "kill"
    reason: str


def kill_reason(data: bytes) -> str | None:
    """The reason of the KillRequest ``data`` is, None for another request; ValueError for one
    that is no JSON object. The one reader of the helper's and a session's init's."""
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    if request.get("cmd") != "kill":
        return None
    return str(request.get("reason", "killed"))


class PoolSpec(TypedDict):
    """host -> helper: ``{"pool": PoolSpec}`` with the pool's socket: prepare ``size``
    sandboxes of ``plan``, each waiting for one command."""

    plan: WirePlan
    size: int


class PoolMessage(TypedDict, total=False):
    """host -> helper, on a pool's socket: ``{"command": ...}`` with the launch's socket and
    stdio (a pooled sandbox runs it), or ``{"wait_ready": true}`` with a socket that gets
    ``ready`` or a SetupErrorInfo once every sandbox is prepared."""

    command: WireCommand
    wait_ready: bool


# --- a session's supervisor (nsbox/session/supervisor.py: the protocol of `nsbox session ...`) ---


class SupervisorRequest(TypedDict, total=False):
    """client -> supervisor, one per connection: ``op`` and that op's arguments."""

    op: str  # exec put get files collect changes apply discard info stop
    argv: list[str]  # exec, with fds [stdin, stdout, stderr]
    env: dict[str, str]
    timeout: float | None
    output_limit: int | None
    cwd: str | None
    tty: list[int] | None  # exec --tty: [rows, columns]; fds[0] is a socket for the master
    path: str  # put, get, with fds [memfd]
    mode: int
    patterns: list[str]  # files, collect
    dest: str  # collect: an absolute host directory
    paths: list[str] | None  # changes, apply, discard
    diff: bool  # changes: False lists them without diffs (nsbox session diff --stat)
    reviewed: str | None  # apply: the review's token (nsbox/host/project.py review_token)


class FileEntry(TypedDict):
    """A regular file of a session's sandbox (nsbox.FileInfo.to_dict())."""

    path: str
    size: int
    sha256: str


class Skipped(TypedDict):
    """A file left out of a listing or a copy, and why."""

    path: str
    reason: str


class SupervisorReply(TypedDict, total=False):
    """supervisor -> client: the op's answer, or ``error`` (errors.to_wire) for any op."""

    error: ErrorWire  # the client raises errors.from_wire of it
    result: dict[str, Any]  # exec: Result.to_dict()
    controlled: list[int]  # exec: of the client's stdout and stderr (1, 2), those passed a
    # control, which may have set or asked the terminal something (host/terminal.py)
    ok: bool  # put, stop
    size: int  # get (the data is in the memfd)
    sha256: str
    files: list[FileEntry]  # files, collect
    skipped: list[Skipped]
    changes: list[dict[str, Any]]  # changes: Change.to_dict() each
    review: str  # changes: the token of exactly these changes, for apply's "reviewed"
    applied: list[str]  # apply: ApplyReport.to_dict()
    conflicts: list[str]
    refused: list[Skipped]
    discarded: list[str]  # discard
    id: str  # info
    pid: int
    commands: int
    idle: float
    output_limit: int  # a command's cap by default (exec --tty holds it on the terminal)


class SessionRecord(TypedDict):
    """The record of a published session, ``ID.json`` beside its socket in the user's private
    runtime directory: what ``nsbox session ls`` lists."""

    id: str
    pid: int  # the supervisor's: alive while its command line names it (supervisor.alive)
    started: float
    workspace: str | None
    profile: str
    project: str | None
    masked: list[str]
    idle_timeout: float | None


class SupervisorStart(TypedDict):
    """``nsbox session start`` -> its new supervisor, pickled on stdin (the Policy whole, and
    no --env value in a command line). The answer is one line on stdout: ``ok ID`` or
    ``error {"error": ErrorWire}``."""

    policy: Policy
    idle_timeout: float | None
    audit: str | None


# --- Ray (nsbox/ray/__init__.py): a job goes out as an nsbox.ray.Job, its result comes back as ---


class JobFile(TypedDict):
    """A file a Ray job produced, with its content."""

    path: str
    size: int
    sha256: str
    data: bytes


class JobResult(TypedDict, total=False):
    """executor -> client: a Ray job's result, plain data. The fields of Result.to_dict(),
    the output as bytes, the files, and where and how often the job ran; for a sandbox that
    could not be built also the error's class (``error_type``) and step."""

    status: str
    exit_code: int | None
    signal: int | None
    wall_time: float
    cpu_user: float
    cpu_system: float
    peak_memory: int
    peak_pids: int | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    oom_killed: bool
    error: str | None
    degraded: list[str]
    accounting: str
    isolation: str
    isolation_weaker: list[str]
    extra: dict[str, Any]
    files: list[JobFile]
    skipped_files: list[Skipped]
    job: str
    attempts: int
    node: str | None
    executor: str | None
    error_type: str
    step: str


class ExecutorInfo(TypedDict):
    """An executor actor's ``info()``: who and where it is, and why it refuses, if it does."""

    name: str
    node: str
    pid: int
    state_dir: str
    refusal: str | None
    concurrency: int
    pool: int


INLINE_MAX = 64 * 1024  # bytes sent in the datagram itself
MAX_MESSAGE = 256 * 1024 * 1024  # larger is refused: the launch fails with a LaunchError
_TAG = b'{"memfd": '


def send(sock: socket.socket, message: Mapping[str, Any], fds: list[int] | tuple[int, ...] = ()
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


class CutMessage(ValueError):
    """A message that did not arrive whole: longer than the buffer (MSG_TRUNC), or with
    descriptors the kernel could not pass (MSG_CTRUNC: more than asked for, or none left)."""


def receive_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0
                ) -> tuple[bytes, list[int]]:
    """recvmsg with SCM_RIGHTS (unix(7)): the one receiver of descriptors in nsbox's Python
    (nsbox/native/report.c, receive_with_fds, is the C one). They arrive close-on-exec, so that
    no program the receiver starts inherits them (unlike socket.recv_fds without the flag).

    A message is taken whole or not at all: one cut short, or with more than ``maxfds``
    descriptors (in any number of SCM_RIGHTS messages), raises CutMessage, every descriptor
    that came closed; descriptors the kernel could not install here (this process out of
    them), OSError EMFILE."""
    fds = array.array("i")
    msg, ancdata, msg_flags, _addr = sock.recvmsg(
        bufsize, socket.CMSG_SPACE(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC | flags)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) > maxfds:
        for fd in fds:
            os.close(fd)
        if msg_flags & socket.MSG_CTRUNC and len(fds) < maxfds:
            # Room was left: the kernel could not install them here (unix(7), scm_detach_fds).
            raise OSError(errno.EMFILE, "Too many open files: the descriptors sent with a "
                                        "message could not be received (MSG_CTRUNC)")
        raise CutMessage(f"a message did not arrive whole ({len(msg)} bytes of at most "
                         f"{bufsize}, {len(fds)} descriptors of at most {maxfds})")
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


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``: a pipe, a socket or a terminal may take a large write in parts
    (write(2)). The one loop of every side's (the output's sinks, the --tty relay, a session's
    file operations)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
