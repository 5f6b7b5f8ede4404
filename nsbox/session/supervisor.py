"""A published session: its supervisor (the server) and the client of ``nsbox session ...``.

A Session is published in the user's private runtime directory: a unix socket ``ID.sock`` that
the supervisor serves, and a record ``ID.json`` (``_wire.SessionRecord``). ``nsbox session
start`` runs the supervisor as a detached process (``python -m nsbox.cli.supervisor``); ``nsbox
mcp --project`` serves one from a thread of its own process (nsbox/mcp/review.py). It serves
requests until ``stop``, the idle timeout, or the end of the session's sandbox. If it is killed,
its launch helper sees end-of-file and kills the sandbox; the next client removes the stale
socket and record.

Requests (SOCK_SEQPACKET, one ``_wire.SupervisorRequest`` per connection, one
``_wire.SupervisorReply``, each of any size (nsbox/_sys/wire.py); only the same uid is served,
checked with SO_PEERCRED on top of the directory's 0700):

  {"op": "exec", argv, env, timeout, output_limit, cwd}  fds [stdin, stdout, stderr]
                                                   -> {"result": {...}}
  {"op": "put", "path", "mode"}  fds [memfd]      -> {"ok": true}
  {"op": "get", "path"}          fds [memfd]      -> {"size", "sha256"} (data in the memfd)
  {"op": "files", "patterns"}                     -> {"files": [...], "skipped": [...]}
  {"op": "collect", "dest", "patterns"}           -> the same, copied into dest (absolute)
  {"op": "changes", "paths", "diff"}              -> {"changes": [...], "review": token}
                                                     (a project session)
  {"op": "apply", "paths", "reviewed"}            -> {"applied", "conflicts", "refused"}
  {"op": "discard", "paths"}                      -> {"discarded": [...]}
  {"op": "info"}                                  -> {"id", "pid", "commands", "idle"}
  {"op": "stop"}                                  -> {"ok": true}, then the session ends
  any op that fails                               -> {"error": errors.to_wire(...)}
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import cast

from nsbox import errors
from nsbox._sys import wire as _wire
from nsbox._sys.wire import SessionRecord, SupervisorReply, SupervisorRequest
from nsbox.errors import NsboxError, PolicyError
from nsbox.host import output
from nsbox.session import review
from nsbox.session.run import run_command
from nsbox.session.session import Session

MAX_FDS = 4
# The command lines a supervisor process was started with, the current one first: a record
# whose pid runs none of them is stale. An older nsbox ran it as `python -m nsbox._supervisor`.
TITLES = (b"nsbox.cli.supervisor", b"nsbox._supervisor")

# --- the user's private runtime directory ----------------------------------------------------


RUN_USER = "/run/user"  # the login manager's runtime directories (pam_systemd)
_SOCKET_ROOM = 100  # sun_path holds 108 bytes (unix(7)): the directory, "/", ID.sock


def runtime_dir() -> str:
    """The invoking user's private directory for session sockets, created if missing.

    $XDG_RUNTIME_DIR/nsbox or /run/user/UID/nsbox when that base is the user's own 0700
    directory; else ~/.local/state/nsbox when the home is the user's own and no one else may
    write in it; else /tmp/nsbox-UID, a name any local user could take first (the command then
    says so). An existing directory is used only if it is a real directory (not a symlink)
    owned by the user with no access for group or others.
    """
    uid = os.getuid()
    for base in (os.environ.get("XDG_RUNTIME_DIR"), f"{RUN_USER}/{uid}"):
        if base and _private_dir(base, uid):
            return _ensure_private(os.path.join(base, "nsbox"), uid)
    home = os.path.expanduser("~")
    state = os.path.join(home, ".local", "state")
    if _own_home(home, uid) and len(state) + len("/nsbox/") + 20 < _SOCKET_ROOM:
        try:
            os.makedirs(state, mode=0o700, exist_ok=True)
        except OSError:
            pass  # a read-only home: /tmp then
        else:
            return _ensure_private(os.path.join(state, "nsbox"), uid)
    return _ensure_private(f"/tmp/nsbox-{uid}", uid)


def _own_home(path: str, uid: int) -> bool:
    """A home that is the user's own directory, in which no one else may make a name (a
    symlink to plant where the runtime directory goes)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


def _private_dir(path: str, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


def _ensure_private(path: str, uid: int) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NsboxError(f"cannot create the session directory {path}: {exc.strerror}") from None
    if not _private_dir(path, uid):
        error = NsboxError(f"{path} is not a private directory of this user (it must be a "
                           f"directory owned by uid {uid} with mode 0700, not a symlink)")
        error.hint = "remove it, or set XDG_RUNTIME_DIR to a private directory of yours"
        raise error
    return path


# --- the server ------------------------------------------------------------------------------


def error_reply(exc: NsboxError) -> SupervisorReply:
    return {"error": errors.to_wire(exc)}


# A handler answers one request; it gets the request, its descriptors and the connection.
Handler = Callable[[SupervisorRequest, list[int], socket.socket], SupervisorReply]


class Supervisor:
    def __init__(self, session: Session, listener: socket.socket, paths: list[str],
                 idle_timeout: float | None) -> None:
        self.session = session
        self.listener = listener
        self.paths = paths
        self.idle_timeout = idle_timeout
        self.last_active = time.monotonic()
        self.busy = 0
        self.lock = threading.Lock()
        self.stopping = False  # a stop request is being served
        self.stopped = False  # ... and has its reply: the process may exit
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC)
        # op -> its handler and the number of descriptors it takes (None: any, unused).
        self.handlers: dict[str, tuple[Handler, int | None]] = {
            "exec": (self.exec_, 3),
            "put": (self.put, 1),
            "get": (self.get, 1),
            "files": (self.files, None),
            "collect": (self.collect, None),
            "changes": (self.changes, None),
            "apply": (self.apply, None),
            "discard": (self.discard, None),
            "info": (self.info, None),
            "stop": (self.stop, None),
        }

    def serve(self) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self.listener, selectors.EVENT_READ, "accept")
                selector.register(self.wake_r, selectors.EVENT_READ, "wake")
                while not self.stopped:
                    for key, _mask in selector.select(1.0):
                        if key.data == "accept":
                            conn, _addr = self.listener.accept()
                            threading.Thread(target=self.handle, args=(conn,),
                                             daemon=True).start()
                    if self._should_end():
                        break
        finally:
            self.session.close()
            for path in self.paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _should_end(self) -> bool:
        """Idle for too long, or the session's sandbox is gone (and no request is served)."""
        with self.lock:
            idle = (self.busy == 0 and self.idle_timeout is not None
                    and time.monotonic() - self.last_active > self.idle_timeout)
            gone = self.busy == 0 and not self.stopping and not self.session.alive
        return idle or gone

    def handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        stop = False
        with conn:
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid != os.getuid():
                    return
                msg, fds = _wire.receive(conn, MAX_FDS)  # any size (nsbox/_sys/wire.py)
                if not msg:
                    return
                request: SupervisorRequest = json.loads(msg)
                stop = request.get("op") == "stop"
                # Any size: a project's diffs can be larger than one datagram (nsbox/_sys/wire.py).
                _wire.send(conn, self._answer(request, fds, conn))
            except (OSError, ValueError, KeyError, TypeError):
                return
            finally:
                for fd in fds:
                    os.close(fd)
                if stop:
                    self.stopped = True  # after the reply: the process exits next
                    os.write(self.wake_w, b"x")

    def _answer(self, request: SupervisorRequest, fds: list[int], conn: socket.socket
                ) -> SupervisorReply:
        with self.lock:
            self.busy += 1
        try:
            return self.dispatch(request, fds, conn)
        except NsboxError as exc:
            return error_reply(exc)
        finally:
            with self.lock:
                self.busy -= 1
                self.last_active = time.monotonic()

    def dispatch(self, request: SupervisorRequest, fds: list[int],
                 conn: socket.socket) -> SupervisorReply:
        op = request.get("op")
        handler, nfds = self.handlers.get(str(op), (None, None))
        if handler is None or (nfds is not None and len(fds) != nfds):
            raise PolicyError(f"unknown request {op!r}", key="op")
        return handler(request, fds, conn)

    # --- the handlers, one per op ---

    def exec_(self, request: SupervisorRequest, fds: list[int], conn: socket.socket
              ) -> SupervisorReply:
        done = threading.Event()
        # Written when the run returns: the watcher wakes at once, and the reply does not wait
        # for a poll interval to pass.
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        watcher = threading.Thread(target=self.watch_client, args=(conn, done, done_r),
                                   daemon=True)
        watcher.start()
        try:
            # Session.run's own arguments (input, text, check) are not in a request.
            result = run_command(
                self.session, request["argv"], stdin=fds[0], timeout=request.get("timeout"),
                output_limit=request.get("output_limit"), env=request.get("env") or {},
                cwd=request.get("cwd"), sinks=(fds[1], fds[2]), tty=request.get("tty"))
        finally:
            done.set()
            os.write(done_w, b"x")
            watcher.join()
            os.close(done_r)
            os.close(done_w)
            controlled = output.TERMINAL_HOLD.take_controlled((fds[1], fds[2]))
        return {"result": result.to_dict(),
                "controlled": [n for n, fd in ((1, fds[1]), (2, fds[2])) if fd in controlled]}

    def watch_client(self, conn: socket.socket, done: threading.Event, done_r: int) -> None:
        """A client that goes away (^C on `nsbox session exec`) cancels its command: the
        client sends nothing after its request, so anything readable is end-of-file."""
        poller = select.poll()
        poller.register(conn, select.POLLIN | select.POLLHUP)
        poller.register(done_r, select.POLLIN)
        events = dict(poller.poll())
        if conn.fileno() in events and not done.is_set():
            # Until the run returns: the command may not have started yet.
            while not done.wait(0.1):
                self.session.cancel()

    def put(self, request: SupervisorRequest, fds: list[int], _conn: socket.socket
            ) -> SupervisorReply:
        os.lseek(fds[0], 0, os.SEEK_SET)
        with os.fdopen(os.dup(fds[0]), "rb") as f:
            data = f.read()
        self.session.write_file(request["path"], data, mode=int(request.get("mode", 0o644)))
        return {"ok": True}

    def get(self, request: SupervisorRequest, fds: list[int], _conn: socket.socket
            ) -> SupervisorReply:
        data = self.session.read_file(request["path"])
        view = memoryview(data)
        while view:
            view = view[os.write(fds[0], view):]
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def files(self, request: SupervisorRequest, _fds: list[int], _conn: socket.socket
              ) -> SupervisorReply:
        skipped: list[tuple[str, str]] = []
        found = self.session.files(request.get("patterns") or ["*"], skipped=skipped)
        return {"files": [f.to_dict() for f in found],
                "skipped": [{"path": p, "reason": r} for p, r in skipped]}

    def collect(self, request: SupervisorRequest, _fds: list[int], _conn: socket.socket
                ) -> SupervisorReply:
        skipped: list[tuple[str, str]] = []
        found = self.session.copy_out(request["dest"], request.get("patterns") or ["*"],
                                      skipped=skipped)
        return {"files": [f.to_dict() for f in found],
                "skipped": [{"path": p, "reason": r} for p, r in skipped]}

    def changes(self, request: SupervisorRequest, _fds: list[int], _conn: socket.socket
                ) -> SupervisorReply:
        changes = review.changes_at(self.session, request.get("paths") or None,
                                    diff=request.get("diff") is not False)
        return {"changes": [c.to_dict() for c in changes],
                "review": review.review_token(changes)}

    def apply(self, request: SupervisorRequest, _fds: list[int], _conn: socket.socket
              ) -> SupervisorReply:
        return cast(SupervisorReply, self.session.apply(
            request.get("paths"), reviewed=request.get("reviewed")).to_dict())

    def discard(self, request: SupervisorRequest, _fds: list[int], _conn: socket.socket
                ) -> SupervisorReply:
        return {"discarded": self.session.discard(request.get("paths"))}

    def info(self, _request: SupervisorRequest, _fds: list[int], _conn: socket.socket
             ) -> SupervisorReply:
        return {"id": self.session.id, "pid": os.getpid(), "commands": self.session.commands,
                "idle": time.monotonic() - self.last_active,
                "output_limit": self.session.output_limit}

    def stop(self, _request: SupervisorRequest, _fds: list[int], _conn: socket.socket
             ) -> SupervisorReply:
        # Everything of the sandbox is gone before the reply: stop means stopped.
        self.stopping = True
        self.session.close()
        return {"ok": True}


def publish(session: Session, idle_timeout: float | None) -> Supervisor:
    """Make ``session`` reachable by `nsbox session ...` of this user (its socket and record
    in the private runtime directory); serve it with the returned Supervisor's ``serve``."""
    directory = runtime_dir()
    sock_path = os.path.join(directory, f"{session.id}.sock")
    record_path = os.path.join(directory, f"{session.id}.json")
    old_umask = os.umask(0o077)
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(sock_path)
        listener.listen(16)
        record: SessionRecord = {
            "id": session.id, "pid": os.getpid(), "started": time.time(),
            "workspace": session.policy.workspace, "profile": session.policy.name,
            "project": session.policy.project, "masked": session.masked,
            "idle_timeout": idle_timeout}
        fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
    except OSError as exc:  # a full or read-only runtime directory: say so, leave nothing
        for path in (sock_path, record_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        error = NsboxError(f"cannot create the session's socket and record in {directory}: "
                           f"{exc.strerror or exc}")
        error.hint = "free space there, or set XDG_RUNTIME_DIR to a writable private directory"
        raise error from None
    finally:
        os.umask(old_umask)
    return Supervisor(session, listener, [sock_path, record_path], idle_timeout)


# --- the client ------------------------------------------------------------------------------


def is_session_id(text: str) -> bool:
    return len(text) == 12 and all(c in "0123456789abcdef" for c in text)


def _socket_path(session_id: str) -> str:
    if not is_session_id(session_id):
        raise NsboxError(f"{session_id!r} is not a session id (12 hex digits; see "
                         "`nsbox session ls`)")
    return os.path.join(runtime_dir(), f"{session_id}.sock")


def request(session_id: str, message: SupervisorRequest,
            fds: tuple[int, ...] | list[int] = (),
            sent: Callable[[socket.socket], None] | None = None) -> SupervisorReply:
    """Send ``message`` (and ``fds``) to the supervisor of session ``session_id``; its reply,
    or the error it raised there (errors.from_wire). ``sent`` gets the connection once the
    request is on it: an exec's client that shuts it down cancels the command."""
    path = _socket_path(session_id)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        try:
            conn.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            forget_stale()
            raise errors.SessionClosed(f"no session {session_id} (it may have ended or expired)"
                                       ) from None
        _wire.send(conn, message, fds)
        if sent is not None:
            sent(conn)
        data, extra = _wire.receive(conn, 0)  # any size, from this user's own supervisor
    for fd in extra:
        os.close(fd)
    if not data:
        raise errors.SessionClosed(f"session {session_id} ended during the request")
    reply: SupervisorReply = json.loads(data)
    if "error" in reply:
        raise errors.from_wire(reply["error"])
    return reply


def records() -> list[SessionRecord]:
    """The records of this user's published sessions, also of those whose supervisor is gone."""
    directory = runtime_dir()
    found = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    return found


def alive(record: SessionRecord) -> bool:
    """Whether the record's supervisor still runs: its pid's command line names a supervisor
    (TITLES), so that a pid reused by another process does not count."""
    try:
        with open(f"/proc/{int(record['pid'])}/cmdline", "rb") as f:
            cmdline = f.read()
    except (OSError, KeyError, ValueError, TypeError):
        return False
    return any(title in cmdline for title in TITLES)


def forget_stale() -> None:
    """Remove the socket and record of sessions whose supervisor is gone (killed, crashed)."""
    directory = runtime_dir()
    for record in records():
        if not alive(record) and is_session_id(str(record.get("id", ""))):
            for suffix in (".sock", ".json"):
                try:
                    os.unlink(os.path.join(directory, record["id"] + suffix))
                except OSError:
                    pass
