"""The supervisor of one command-line session: a detached process that holds the Session.

``nsbox session start`` starts it (``python -m nsbox.cli.supervisor``) with the session's Policy
and settings pickled on stdin (not in argv, which every user can read in /proc), and reads one
line back:
``ok ID`` or ``error MESSAGE``. The supervisor then serves requests on a unix socket in the
user's private runtime directory until ``nsbox session stop``, the idle timeout, or the end of
the session's sandbox. If it is killed, its launch helper sees end-of-file and kills the
sandbox; the next ``nsbox session`` command removes the stale socket and record.

Requests (SOCK_SEQPACKET, one JSON object each, one reply each; only the same uid is served,
checked with SO_PEERCRED on top of the directory's 0700):

  {"op": "exec", argv, env, timeout, output_limit, cwd}  fds [stdin, stdout, stderr]
                                                   -> {"result": {...}} | {"error": {...}}
  {"op": "put", "path", "mode"}  fds [memfd]      -> {"ok": true}
  {"op": "get", "path"}          fds [memfd]      -> {"size", "sha256"} (data in the memfd)
  {"op": "files", "patterns"}                     -> {"files": [...], "skipped": [...]}
  {"op": "collect", "dest", "patterns"}           -> the same, copied into dest (absolute)
  {"op": "info"}                                  -> the session's record
  {"op": "stop"}                                  -> {"ok": true}, then the session ends
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import select
import selectors
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any

from nsbox import _wire, errors
from nsbox.errors import NsboxError, PolicyError
from nsbox.session import Session

MAX_REQUEST = 1024 * 1024
MAX_FDS = 4


def runtime_dir() -> str:
    """The invoking user's private directory for session sockets, created if missing.

    $XDG_RUNTIME_DIR/nsbox or /run/user/UID/nsbox when that base is the user's own 0700
    directory, else /tmp/nsbox-UID. An existing directory is used only if it is a real
    directory (not a symlink) owned by the user with no access for group or others.
    """
    uid = os.getuid()
    for base in (os.environ.get("XDG_RUNTIME_DIR"), f"/run/user/{uid}"):
        if base and _private_dir(base, uid):
            return _ensure_private(os.path.join(base, "nsbox"), uid)
    return _ensure_private(f"/tmp/nsbox-{uid}", uid)


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


def recv_request(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    msg, fds = _wire.receive_fds(conn, MAX_REQUEST, MAX_FDS)
    if not msg:
        return None, fds
    return json.loads(msg), fds


def error_reply(exc: NsboxError) -> dict[str, Any]:
    return {"error": errors.to_wire(exc)}


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
                    with self.lock:
                        idle = (self.busy == 0 and self.idle_timeout is not None
                                and time.monotonic() - self.last_active > self.idle_timeout)
                        gone = self.busy == 0 and not self.stopping and not self.session.alive
                    if idle or gone:
                        break
        finally:
            self.session.close()
            for path in self.paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass

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
                request, fds = recv_request(conn)
                if request is None:
                    return
                stop = request.get("op") == "stop"
                with self.lock:
                    self.busy += 1
                try:
                    reply = self.dispatch(request, fds, conn)
                except NsboxError as exc:
                    reply = error_reply(exc)
                finally:
                    with self.lock:
                        self.busy -= 1
                        self.last_active = time.monotonic()
                conn.send(json.dumps(reply).encode())
            except (OSError, ValueError, KeyError, TypeError):
                return
            finally:
                for fd in fds:
                    os.close(fd)
                if stop:
                    self.stopped = True  # after the reply: the process exits next
                    os.write(self.wake_w, b"x")

    def watch_client(self, conn: socket.socket, done: threading.Event) -> None:
        """A client that goes away (^C on `nsbox session exec`) cancels its command: the
        client sends nothing after its request, so anything readable is end-of-file."""
        poller = select.poll()
        poller.register(conn, select.POLLIN | select.POLLHUP)
        while not done.is_set():
            if poller.poll(200):
                # Until the run returns: the command may not have started yet.
                while not done.wait(0.1):
                    self.session.cancel()
                return

    def dispatch(self, request: dict[str, Any], fds: list[int],
                 conn: socket.socket) -> dict[str, Any]:
        op = request.get("op")
        if op == "exec" and len(fds) == 3:
            done = threading.Event()
            watcher = threading.Thread(target=self.watch_client, args=(conn, done), daemon=True)
            watcher.start()
            try:
                result = self.session.run(
                    request["argv"], stdin=fds[0], timeout=request.get("timeout"),
                    output_limit=request.get("output_limit"), env=request.get("env") or {},
                    cwd=request.get("cwd"), _sinks=(fds[1], fds[2]))
            finally:
                done.set()
                watcher.join()
            return {"result": result.to_dict()}
        if op == "put" and len(fds) == 1:
            os.lseek(fds[0], 0, os.SEEK_SET)
            with os.fdopen(os.dup(fds[0]), "rb") as f:
                data = f.read()
            self.session.write_file(request["path"], data, mode=int(request.get("mode", 0o644)))
            return {"ok": True}
        if op == "get" and len(fds) == 1:
            data = self.session.read_file(request["path"])
            view = memoryview(data)
            while view:
                view = view[os.write(fds[0], view):]
            return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if op == "files":
            skipped: list[tuple[str, str]] = []
            found = self.session.files(request.get("patterns") or ["*"], skipped=skipped)
            return {"files": [f.to_dict() for f in found],
                    "skipped": [{"path": p, "reason": r} for p, r in skipped]}
        if op == "collect":
            skipped = []
            found = self.session.copy_out(request["dest"], request.get("patterns") or ["*"],
                                          skipped=skipped)
            return {"files": [f.to_dict() for f in found],
                    "skipped": [{"path": p, "reason": r} for p, r in skipped]}
        if op == "changes":
            wanted = request.get("paths")
            changes = self.session.changes()
            if wanted:
                changes = [c for c in changes if any(c.path == w or c.path.startswith(w + "/")
                                                     for w in wanted)]
            return {"changes": [c.to_dict() for c in changes]}
        if op == "apply":
            return self.session.apply(request.get("paths")).to_dict()
        if op == "discard":
            return {"discarded": self.session.discard(request.get("paths"))}
        if op == "info":
            return {"id": self.session.id, "pid": os.getpid(), "commands": self.session.commands,
                    "idle": time.monotonic() - self.last_active}
        if op == "stop":
            # Everything of the sandbox is gone before the reply: stop means stopped.
            self.stopping = True
            self.session.close()
            return {"ok": True}
        raise PolicyError(f"unknown request {op!r}", key="op")


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
        record = {"id": session.id, "pid": os.getpid(), "started": time.time(),
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


def main() -> int:
    # From `nsbox session start`, this user's own process, through a private pipe.
    spec = pickle.loads(sys.stdin.buffer.read())
    try:
        session = Session(spec["policy"], idle_timeout=spec["idle_timeout"],
                          audit=spec["audit"])
    except NsboxError as exc:
        print("error " + json.dumps(error_reply(exc)), flush=True)
        return 1
    try:
        supervisor = publish(session, spec["idle_timeout"])
    except NsboxError as exc:
        session.close()
        print("error " + json.dumps(error_reply(exc)), flush=True)
        return 1
    print("ok " + session.id, flush=True)
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.close(null)
    supervisor.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
