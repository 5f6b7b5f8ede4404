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
So between commands the workspace is quiescent, which file operations rely on. It gets a mount
namespace of its own too, only for a /proc of that pid namespace (ps reads /proc/<its pid>);
every other mount is the session's.

The init keeps CAP_SYS_ADMIN (to create those pid namespaces, inside the sandbox's own user
namespace) and CAP_SETPCAP (so each command can empty its bounding set), and nothing else. It is
not dumpable: commands of the same uid cannot ptrace it, read its memory or its descriptors
(ptrace(2), "Ptrace access mode checking"). A signal from inside reaches pid 1 only if it
installed a handler (pid_namespaces(7)); the init handles SIGCHLD alone, to reap.

File operations (``op``) run in a forked child with no capabilities at all
(nsbox/sandbox/fileworker.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
from typing import Any, NoReturn

from nsbox._sys import libc as _libc
from nsbox._sys import wire as _wire
from nsbox._sys.wire import ExitReport, InitEvent, InitRequest
from nsbox.sandbox import child as _child
from nsbox.sandbox import diskfull, mounts
from nsbox.sandbox.fileworker import run_file_op

CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21


class Job:
    def __init__(self, sock: socket.socket, pid: int, err_fd: int,
                 deadline: float | None, kill_signal: int = signal.SIGKILL) -> None:
        self.sock = sock
        self.kill_signal = kill_signal
        self.pid = pid
        self.err_fd = err_fd
        self.started = time.monotonic()
        self.deadline = deadline
        self.timed_out = False
        self.kill_reason: str | None = None

    def send(self, message: InitEvent | ExitReport) -> None:
        try:
            self.sock.send(json.dumps(message).encode())
        except OSError:
            pass

    def kill(self, reason: str) -> None:
        if self.kill_reason is None:
            self.kill_reason = reason
            # SIGKILL to the command's own pid 1 ends its whole pid namespace.
            os.kill(self.pid, self.kill_signal)


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
    # Each command is cloned into a pid namespace of its own, and ends with its pid 1. (The
    # Landlock mode's init, nsbox/sandbox/landlock_session.py, overrides what follows.)
    clone_flags = _libc.CLONE_NEWPID | signal.SIGCHLD
    kill_signal = int(signal.SIGKILL)

    def keep_privileges(self) -> None:
        _libc.keep_only_capabilities((CAP_SETPCAP, CAP_SYS_ADMIN), self.ctx.cap_last)

    def run_command(self, command: dict[str, Any]) -> NoReturn:
        _child.finish_and_exec(self.ctx, command)

    def run_file_op(self, op: dict[str, Any]) -> int:
        return run_file_op(self.ctx, op)

    def __init__(self, ctx: _child.Context) -> None:
        self.ctx = ctx
        session = ctx.plan.get("session")
        self.idle_timeout = session.get("idle_timeout") if session else None
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
        self.keep_privileges()
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
        ready: InitEvent = {"event": "ready", "pid": os.getpid()}
        self.control.send(json.dumps(ready).encode())

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
            msg, fds = _wire.receive(sock, 8)  # a command of any size (nsbox/_sys/wire.py)
        except ValueError:
            return  # its memfd did not arrive: the request fails alone (its socket is gone)
        if not msg:
            sys.exit(0)  # the host closed the session: everything inside dies with pid 1
        self.last_active = time.monotonic()
        try:
            request: InitRequest = json.loads(msg)
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

    def start(self, request: InitRequest, sock_fd: int, stdio: list[int]) -> None:
        sock = socket.socket(fileno=sock_fd)
        command = request.get("command") or {}
        wall = command.get("wall_time") if request["cmd"] == "run" else request["op"].get(
            "wall_time", 60.0)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        flags = self.clone_flags
        if flags & _libc.CLONE_NEWPID and request["cmd"] == "run":
            flags |= _libc.CLONE_NEWNS  # for a /proc of its pid namespace (become_command)
        try:
            pid = _libc.raw_clone(flags)
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
        job = Job(sock, pid, err_r, None if wall is None else time.monotonic() + float(wall),
                  self.kill_signal)
        self.jobs[pid] = job
        self.selector.register(sock, selectors.EVENT_READ, lambda _s: self.on_request(job))
        job.send({"event": "pid", "pid": pid})

    def become_command(self, request: InitRequest, stdio: list[int], err_r: int,
                       err_w: int) -> NoReturn:
        ctx = self.ctx
        ctx.err_fd = err_w
        try:
            ctx.step = "start command"
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(err_r)
            _child.take_streams(stdio)
            if request["cmd"] == "run":
                if self.clone_flags & _libc.CLONE_NEWPID:
                    ctx.step = "mount /proc"
                    mounts.mount_command_proc()
                # The session's rlimits as the helper left them: with the fallbacks for what
                # its cgroup cannot limit on this host (never weaker than a single run).
                command = dict(request["command"], rlimits=ctx.plan["rlimits"])
                self.run_command(command)
            code = self.run_file_op(dict(request["op"]))
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
            reason = _wire.kill_reason(data)
        except ValueError:
            return  # the host's end of this command is broken: the command goes on
        if reason is not None:
            job.kill(reason)

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
            "disk_full": diskfull.full_places(),  # this init shares the command's mounts
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
