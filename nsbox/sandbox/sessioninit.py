"""The init of a session: pid 1 of one sandbox that runs many commands.

The launch helper clones the sandbox child as for any launch; for a plan with a ``session`` key
the child builds the sandbox (``_child.build_sandbox``) and then, instead of exec, serves
commands as the sandbox's pid 1. It was handed the session's control socket as fd 0.

Protocol (SOCK_SEQPACKET, one JSON object per message), deliberately the same per-command
protocol as the helper's per-launch one, so the host side reads outcomes with the same code:

  init -> host, control socket:   {"event": "ready"}                 the sandbox is built
  host -> init, control socket:   {"cmd": "run", "command": {...}}   with SCM_RIGHTS
                                  [command socket, stdin, stdout, stderr]
                                  {"cmd": "file", "op": {...}}       a file operation, same fds
                                  end-of-file                        the session ends
  init -> host, command socket:   {"event": "pid", "pid": N}         (pid in the session)
                                  {"event": "exit", ...}             the outcome; then close
  host -> init, command socket:   {"cmd": "kill", "reason": R}       e.g. output limit
                                  end-of-file                        the caller is gone: kill

Each command is cloned into a pid namespace of its own, nested in the session's: killing its
pid 1 at the deadline ends every process the command started, also double-forked or setsid
ones, and nothing of one command is left running when the next starts (pid_namespaces(7)).
So between commands the workspace is quiescent, which file operations rely on.

The init keeps CAP_SYS_ADMIN (to create those pid namespaces, inside the sandbox's own user
namespace) and CAP_SETPCAP (so each command can empty its bounding set), and nothing else. It is
not dumpable: commands of the same uid cannot ptrace it, read its memory or its descriptors
(ptrace(2), "Ptrace access mode checking"). A signal from inside reaches pid 1 only if it
installed a handler (pid_namespaces(7)); the init handles SIGCHLD alone, to reap.

File operations (``op``) run in a forked child with no capabilities at all, as the sandbox's
uid, inside the sandbox's root: they can only reach what a command could. They never follow a
symlink (each path component is opened with O_NOFOLLOW), open with O_NONBLOCK and check with
fstat that what they opened is a regular file before reading, and read at most st_size bytes.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import resource
import selectors
import signal
import socket
import stat
import sys
import time
from typing import Any, NoReturn

from nsbox import _libc, _wire
from nsbox.sandbox import child as _child

CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21
WORKSPACE = "/workspace"
_CHUNK = 65536
_MAX_DEPTH = 64


class Job:
    def __init__(self, sock: socket.socket, pid: int, err_fd: int,
                 deadline: float | None) -> None:
        self.sock = sock
        self.pid = pid
        self.err_fd = err_fd
        self.started = time.monotonic()
        self.deadline = deadline
        self.timed_out = False
        self.kill_reason: str | None = None

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.sock.send(json.dumps(message).encode())
        except OSError:
            pass

    def kill(self, reason: str) -> None:
        if self.kill_reason is None:
            self.kill_reason = reason
            # SIGKILL to the command's own pid 1 ends its whole pid namespace.
            os.kill(self.pid, signal.SIGKILL)


def main(ctx: _child.Context) -> NoReturn:
    try:
        _child.build_sandbox(ctx)
        ctx.step = "session init"
        init = Init(ctx)
    except OSError as exc:
        _child.fail(ctx, exc.errno or 0, exc.strerror or str(exc))
    except Exception as exc:
        _child.fail(ctx, 0, f"{type(exc).__name__}: {exc}")
    try:
        init.serve()
    finally:
        os._exit(0)


class Init:
    def __init__(self, ctx: _child.Context) -> None:
        self.ctx = ctx
        session = ctx.plan.get("session") or {}
        self.idle_timeout: float | None = session.get("idle_timeout")
        self.last_active = time.monotonic()
        # The control socket moves off fd 0; 0, 1, 2 become /dev/null.
        control_fd = _dup_high(0)
        self.control = socket.socket(fileno=control_fd)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        ctx.net_fd = None  # the network step sent the proxy listener over it and closed it
        ctx.source_fds = {}
        # The clone copied every descriptor of the helper: its control socket, other launches'
        # sockets and pipes. A sandbox closes them at exec; the init never execs, and one
        # held end would keep another caller waiting for end-of-file.
        _close_all_but((0, 1, 2, control_fd, ctx.err_fd))
        _libc.prctl(_libc.PR_SET_DUMPABLE, 0)
        _libc.keep_only_capabilities((CAP_SETPCAP, CAP_SYS_ADMIN), ctx.cap_last)
        self.wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)
        signal.set_wakeup_fd(wake_w)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.control, selectors.EVENT_READ, self.on_control)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self.on_wake)
        self.jobs: dict[int, Job] = {}
        # End-of-file on the error pipe tells the helper the sandbox is up (there is no exec).
        os.close(ctx.err_fd)
        ctx.err_fd = -1
        self.control.send(json.dumps({"event": "ready", "pid": os.getpid()}).encode())

    def serve(self) -> None:
        while True:
            for key, _mask in self.selector.select(self.next_timeout()):
                key.data(key.fileobj)
            self.reap()
            now = time.monotonic()
            for job in list(self.jobs.values()):
                if job.deadline is not None and now >= job.deadline:
                    job.timed_out = True
                    job.kill("timeout")
                    job.deadline = None
            if (not self.jobs and self.idle_timeout is not None
                    and now - self.last_active >= self.idle_timeout):
                return  # idle: the session expires with its init

    def next_timeout(self) -> float | None:
        now = time.monotonic()
        times = [job.deadline for job in self.jobs.values() if job.deadline is not None]
        if not self.jobs and self.idle_timeout is not None:
            times.append(self.last_active + self.idle_timeout)
        # epoll_wait(2) takes an int of milliseconds: a far deadline is reached in steps.
        return min(max(0.0, min(times) - now), 3600.0) if times else None

    def on_wake(self, _fd: int) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def on_control(self, sock: socket.socket) -> None:
        try:
            msg, fds = _wire.receive(sock, 8)  # a command of any size (nsbox/_wire.py)
        except ValueError:
            return  # its memfd did not arrive: the request fails alone (its socket is gone)
        if not msg:
            sys.exit(0)  # the host closed the session: everything inside dies with pid 1
        self.last_active = time.monotonic()
        try:
            request = json.loads(msg)
            if len(fds) != 4 or request.get("cmd") not in ("run", "file"):
                if fds:
                    os.close(fds[0])
                return
            self.start(request, fds[0], fds[1:4])
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            pass  # a malformed request fails alone (the host sees its socket close), not pid 1
        finally:
            for fd in fds[1:]:
                os.close(fd)

    def start(self, request: dict[str, Any], sock_fd: int, stdio: list[int]) -> None:
        sock = socket.socket(fileno=sock_fd)
        command = request.get("command") or {}
        wall = command.get("wall_time") if request["cmd"] == "run" else request["op"].get(
            "wall_time", 60.0)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = _libc.raw_clone(_libc.CLONE_NEWPID | signal.SIGCHLD)
        except OSError as exc:
            os.close(err_r)
            os.close(err_w)
            sock.send(json.dumps({"event": "exit", "setup_error": {
                "step": "create pid namespace", "errno": exc.errno or 0,
                "message": str(exc)}}).encode())
            sock.close()
            return
        if pid == 0:
            self.become_command(request, stdio, err_r, err_w)
        os.close(err_w)
        job = Job(sock, pid, err_r, None if wall is None else time.monotonic() + float(wall))
        self.jobs[pid] = job
        self.selector.register(sock, selectors.EVENT_READ, lambda _s: self.on_request(job))
        job.send({"event": "pid", "pid": pid})

    def become_command(self, request: dict[str, Any], stdio: list[int], err_r: int,
                       err_w: int) -> NoReturn:
        ctx = self.ctx
        ctx.err_fd = err_w
        try:
            ctx.step = "start command"
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(err_r)
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            if request["cmd"] == "run":
                # The session's rlimits as the helper left them: with the fallbacks for what
                # its cgroup cannot limit on this host (never weaker than a single run).
                command = dict(request["command"], rlimits=ctx.plan["rlimits"])
                _child.finish_and_exec(ctx, command)
            code = run_file_op(ctx, request["op"])
            os._exit(code)
        except OSError as exc:
            _child.fail(ctx, exc.errno or 0, exc.strerror or str(exc))
        except Exception as exc:
            _child.fail(ctx, 0, f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(127)

    def on_request(self, job: Job) -> None:
        try:
            data = job.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(job.sock)
            job.kill("caller gone")
            return
        try:
            request = json.loads(data)
        except ValueError:
            return
        if request.get("cmd") == "kill":
            job.kill(str(request.get("reason", "killed")))

    def reap(self) -> None:
        while True:
            try:
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.jobs.pop(pid, None)
            if job is not None:
                self.finish(job, status, rusage)

    def finish(self, job: Job, status: int, rusage: resource.struct_rusage) -> None:
        wall = time.monotonic() - job.started
        err_data = b""
        os.set_blocking(job.err_fd, False)
        try:
            while chunk := os.read(job.err_fd, 65536):
                err_data += chunk
        except BlockingIOError:
            pass
        os.close(job.err_fd)
        try:
            _trace, setup_error, reported = _child.read_report(err_data)
        except ValueError:
            setup_error = {"step": "command", "errno": 0, "message": "garbled error report"}
            reported = None
        # The command's own status, as its init (pid 1 of its pid namespace) reported it.
        status = _child.command_status(status, reported)
        job.send({
            "event": "exit", "wait_status": status, "wall_time": wall,
            "cpu_user": rusage.ru_utime, "cpu_system": rusage.ru_stime,
            "maxrss_kib": rusage.ru_maxrss, "timed_out": job.timed_out,
            "kill_reason": job.kill_reason, "setup_error": setup_error,
            # What the session's cgroup could not limit here, as the helper found at launch.
            "limits": {"degraded": list(self.ctx.plan.get("degraded", []))},
        })
        try:
            self.selector.unregister(job.sock)
        except (KeyError, ValueError):
            pass
        job.sock.close()
        self.last_active = time.monotonic()


def _close_all_but(keep: tuple[int, ...]) -> None:
    last = -1
    for fd in sorted(keep):
        if fd > last + 1:
            _libc.close_range(last + 1, fd - 1)
        last = fd
    _libc.close_range(last + 1)


def _dup_high(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)


# --- file operations, run in a forked child without capabilities -------------------------------


class FileOpError(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.reason = path, reason


def run_file_op(ctx: _child.Context, op: dict[str, Any]) -> int:
    """Run one file operation; its data goes to stdout, a JSON error to stderr (exit 1)."""
    ctx.step = "drop capabilities"
    _libc.close_range(3)
    _libc.drop_all_capabilities(ctx.cap_last)
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    ctx.step = f"file {op.get('kind')}"
    try:
        if op["kind"] == "get":
            get_file(op["path"], op["max_size"])
        elif op["kind"] == "put":
            put_file(op["path"], op["mode"])
        elif op["kind"] == "list":
            list_files(op)
        else:
            raise FileOpError("", f"unknown file operation {op['kind']!r}")
    except FileOpError as exc:
        _write_all(2, json.dumps({"path": exc.path, "reason": exc.reason}).encode())
        return 1
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        _write_all(2, json.dumps({"path": op.get("path", ""), "reason": reason,
                                  "errno": exc.errno or 0}).encode())
        return 1
    return 0


def _components(path: str) -> list[str]:
    """The components of a sandbox path; relative paths are relative to the workspace."""
    if "\0" in path:
        raise FileOpError(path, "the path contains a NUL byte")
    full = path if path.startswith("/") else f"{WORKSPACE}/{path}"
    parts = [p for p in full.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError(path, "'..' is not allowed in a path")
    return parts


def _open_dir(parts: list[str], path: str, create: bool = False) -> int:
    """Walk from / to the directory ``parts`` without following any symlink."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                next_fd = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                next_fd = os.open(part, flags, dir_fd=fd)
            except (OSError) as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileOpError(path, f"{part} is a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_regular(name: str, dir_fd: int, path: str) -> tuple[int, os.stat_result]:
    """Open ``name`` for reading only if it is a regular file, never following a symlink and
    never blocking on a FIFO (open(2): O_NOFOLLOW, O_NONBLOCK)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileOpError(path, "a symlink (not followed)") from None
        if exc.errno in (errno.ENXIO, errno.EACCES, errno.EPERM, errno.EOPNOTSUPP):
            raise FileOpError(path, f"cannot be opened: {os.strerror(exc.errno)}") from None
        raise
    st = os.fstat(fd)
    reason = _not_copyable(st)
    if reason:
        os.close(fd)
        raise FileOpError(path, reason)
    return fd, st


def _not_copyable(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (not followed)"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO, not a regular file"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "a device node, not a regular file"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket, not a regular file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink > 1:
        return f"a hard link ({st.st_nlink} names)"
    return None


def _read_exactly(fd: int, size: int, sink: int | None) -> str:
    """Read at most ``size`` bytes (the size fstat saw), hash them, copy them to ``sink``."""
    digest = hashlib.sha256()
    left = size
    while left > 0:
        chunk = os.read(fd, min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
        if sink is not None:
            _write_all(sink, chunk)
    return digest.hexdigest()


def get_file(path: str, max_size: int) -> None:
    parts = _components(path)
    if not parts:
        raise FileOpError(path, "not a file")
    dir_fd = _open_dir(parts[:-1], path)
    try:
        fd, st = _open_regular(parts[-1], dir_fd, path)
    finally:
        os.close(dir_fd)
    try:
        if st.st_size > max_size:
            raise FileOpError(path, f"too large: {st.st_size} bytes, the limit is {max_size}")
        os.set_blocking(fd, True)
        _read_exactly(fd, st.st_size, 1)
    finally:
        os.close(fd)


def put_file(path: str, mode: int) -> None:
    parts = _components(path)
    if not parts:
        raise FileOpError(path, "not a file")
    dir_fd = _open_dir(parts[:-1], path, create=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        try:
            fd = os.open(parts[-1], flags, mode & 0o777, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileOpError(path, "a symlink is in the way (not followed)") from None
            if exc.errno == errno.ENXIO:
                raise FileOpError(path, "a FIFO is in the way") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileOpError(path, "something other than a regular file is in the way")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        os.fchmod(fd, mode & 0o777)
        while chunk := os.read(0, _CHUNK):
            _write_all(fd, chunk)
    finally:
        os.close(fd)


def list_files(op: dict[str, Any]) -> None:
    """List the regular files below ``root`` matching ``patterns``, with size and SHA-256.

    Output: one JSON object {"files": [...], "skipped": [...]}, paths relative to the root.
    """
    root = op["path"]
    patterns = op.get("patterns") or ["*"]
    limits = {"files": op["max_files"], "size": op["max_size"], "total": op["max_total"]}
    state = {"count": 0, "total": 0}
    files: list[dict[str, Any]] = []
    skipped = _Skipped(2 * op["max_files"])
    root_fd = _open_dir(_components(root), root)

    def want(rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, p) for p in patterns)

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        with os.scandir(dir_fd) as entries:
            names = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in entries)
        for name, is_dir in names:
            rel = f"{prefix}{name}"
            if is_dir:
                if depth >= _MAX_DEPTH:
                    skipped.append({"path": rel, "reason": "too deep"})
                    continue
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError as exc:
                    skipped.append({"path": rel + "/", "reason": os.strerror(exc.errno or 0)})
                    continue
                try:
                    walk(sub, rel + "/", depth + 1)
                finally:
                    os.close(sub)
                continue
            if not want(rel):
                continue
            try:
                fd, st = _open_regular(name, dir_fd, rel)
            except FileOpError as exc:
                skipped.append({"path": rel, "reason": exc.reason})
                continue
            except OSError as exc:
                skipped.append({"path": rel, "reason": os.strerror(exc.errno or 0)})
                continue
            try:
                reason = None
                if st.st_size > limits["size"]:
                    reason = f"too large: {st.st_size} bytes, the limit is {limits['size']}"
                elif state["count"] >= limits["files"]:
                    reason = f"over the limit of {limits['files']} files"
                elif state["total"] + st.st_size > limits["total"]:
                    reason = f"over the limit of {limits['total']} bytes in all"
                if reason:
                    skipped.append({"path": rel, "reason": reason})
                    continue
                os.set_blocking(fd, True)
                digest = _read_exactly(fd, st.st_size, None)
            finally:
                os.close(fd)
            state["count"] += 1
            state["total"] += st.st_size
            files.append({"path": rel, "size": st.st_size, "sha256": digest,
                          "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime})

    try:
        walk(root_fd, "", 0)
    finally:
        os.close(root_fd)
    _write_all(1, json.dumps({"files": files, "skipped": skipped}).encode())


class _Skipped(list):  # type: ignore[type-arg]
    """The list of skipped files, bounded: a workspace of a million FIFOs gives one line for
    the rest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.more = 0

    def append(self, item: Any) -> None:
        if len(self) < self.limit:
            super().append(item)
            return
        self.more += 1
        if self.more == 1:
            super().append({"path": "...", "reason": "more files skipped, not listed"})


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
