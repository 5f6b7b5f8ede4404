"""The launch helper: a small, thread-free process that clones and supervises sandboxes.

The host process starts it once (``python3 -I -S``) and keeps a control socket to it. Cloning
from here instead of from the host process is what makes launches fast (a small process has few
page tables to copy) and safe (the host may have threads; this process never does).

Here is the event loop; a launch's steps up to a released sandbox are in nsbox/helper/start.py,
the ways to clone it in clone.py, its end in report.py.

Protocol (SOCK_SEQPACKET, one JSON object per message; one too large for a datagram travels in
a memfd, nsbox/_sys/wire.py):

  host -> helper, control socket:  {"plan": {...}}  with SCM_RIGHTS
                                   [launch socket, stdin, stdout, stderr]
  host -> helper, control socket:  {"pool": {"plan": {...}, "size": N}} with SCM_RIGHTS
                                   [pool socket]: a warm pool (nsbox/helper/pool.py);
                                   commands then come over the pool socket
  helper -> host, launch socket:   {"event": "pid", "pid": N}         the sandbox's pid 1,
                                   + SCM_RIGHTS [pidfd]               its pidfd: the host's
                                                                      own guard of the deadline
                                   {"event": "proxy"} + SCM_RIGHTS    network allow mode:
                                   [listener]                         the proxy's socket
                                   {"event": "exit", ...}             the outcome; then close
  host -> helper, launch socket:   {"cmd": "kill", "reason": R}       e.g. output limit
                                   end-of-file                        the caller is gone: kill
  a plan with a "session" key:     the child does not exec but becomes the session's init,
                                   with the session's control socket as its stdin
                                   (nsbox/sandbox/sessioninit.py); the launch is otherwise the same

  helper <-> sandbox child:        on cgroup v1, a spawner clones the child in the run's
                                   cgroup, and the child first receives its plan and these
                                   descriptors on the spawner's socket (nsbox/helper/spawner.py);
                                   sync pipe: the helper writes the id maps, then one byte;
                                   error pipe (close-on-exec): {step, errno, message} on
                                   failure; the child forks a last time and pid 1 stays as
                                   the sandbox's init (_child.start_init), holding the pipe
                                   until the command ends, then writes one line
                                   {"status": N}: the command's wait status, which pid 1
                                   cannot pass on by dying of the same signal
                                   (pid_namespaces(7)); it exits with the shell's code for
                                   it (128+N for signal N). The helper reports that status
                                   unless pid 1 was killed (_child.command_status);
                                   learning mode only, a socket: the seccomp listener fd
                                   (SCM_RIGHTS), served here until the sandbox ends;
                                   network allow mode only, a socket: the proxy listener
                                   the child opened in its network namespace, passed on
                                   to the host at once;
                                   with NSBOX_TRACE, one line {"trace": [...]} before the exec.

End-of-file on the control socket means the host process is gone: every sandbox is killed and
the helper exits. Each sandbox gets PR_SET_PDEATHSIG, so it also dies with the helper.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable

from nsbox._sys import libc as _libc
from nsbox._sys import wire as _wire
from nsbox._sys.wire import ExitReport, WirePlan
from nsbox.helper import channels as _channels
from nsbox.helper import clone as _clone
from nsbox.helper import landlocked as _landlocked
from nsbox.helper import pool as _helper_pool
from nsbox.helper import report as _report
from nsbox.helper import start as _start
from nsbox.helper.launch import Launch, StepFailed, failure_info, failure_report
from nsbox.helper.sources import Sources, release_pins
from nsbox.policy import identity
from nsbox.sandbox import child as _child

MAX_FDS = 8
MAX_WAIT = 3600.0  # seconds: the longest single wait of the event loop


class Helper:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, self.on_control)
        self.launches: set[Launch] = set()
        # What this process holds decides the sandbox's identity and who opens bind sources
        # (nsbox/policy/identity.py); read once, credentials do not change under a process.
        self.identity = identity.Holdings.read()
        self.sources = Sources(self.identity)
        self.cap_last = _libc.last_cap()
        self.received_ns = 0  # when the last request arrived (NSBOX_TRACE)
        self.timers: list[tuple[float, Callable[[], None]]] = []  # e.g. a pool's refill
        # How a sandbox is born in its cgroup on this host, and what its child runs
        # (nsbox/helper/clone.py): moving a child into a cgroup costs an RCU grace period.
        self.cloner = _clone.choose(self, self.cap_last)
        self.landlock_cloner: _clone.Cloner | None = None  # made at its first launch
        if self.identity.privileged:
            # No supplementary group of root's may reach a sandbox. Where setgroups is denied
            # (inside a user namespace that wrote "deny"), the groups are fixed already.
            try:
                os.setgroups([])
            except PermissionError:
                pass

    # --- event loop ----------------------------------------------------------------------
    # The helper serves every launch of its host process: an exception from one launch's
    # callback must end that launch only, never the loop (and with it every other run).

    def loop(self) -> None:
        while True:
            for key, _mask in self.selector.select(self.next_timeout()):
                # An earlier callback of this batch may have unregistered and closed this fd
                # (a reap closes the launch's other fds); its number may even be reused.
                if self.selector.get_map().get(key.fd) is not key:
                    continue
                try:
                    key.data(key.fileobj)
                except Exception as exc:
                    self.callback_failed(key, exc)
            self.run_timers()
            self.check_limits()

    def check_limits(self) -> None:
        now = time.monotonic()
        for launch in list(self.launches):
            try:
                if launch.deadline is not None and now >= launch.deadline:
                    launch.timed_out = True
                    launch.kill("timeout")
                    launch.deadline = None
                if launch.limits is not None and launch.limits.poll():
                    launch.kill("cpu time")
            except Exception as exc:
                launch.fail("supervise", exc)

    def callback_failed(self, key: selectors.SelectorKey, exc: Exception) -> None:
        """The launch that owns ``key``'s descriptor fails with ``exc``; a descriptor nobody
        owns is no longer watched (it would be reported ready again at once)."""
        if key.fileobj is self.control:
            return  # on_control reports its own failures to the launch concerned
        launch = self.owner_of(key.fd)
        if launch is not None and key.fd == launch.pidfd:
            self.finish(launch, {"event": "exit", "setup_error": failure_info("reap", exc)})
            return
        try:
            self.selector.unregister(key.fileobj)
        except (KeyError, ValueError):
            pass
        if launch is not None:
            launch.fail("supervise", exc)

    def owner_of(self, fd: int) -> Launch | None:
        for launch in self.launches:
            socks = (launch.sock, launch.notify_sock, launch.net_sock)
            fds = {launch.pidfd, launch.err_fd, *(s.fileno() for s in socks if s is not None)}
            if launch.denied is not None:
                fds.add(launch.denied.listener)
            if fd in fds:
                return launch
        return None

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.timers.append((time.monotonic() + delay, callback))

    def run_timers(self) -> None:
        now = time.monotonic()
        due = [timer for timer in self.timers if timer[0] <= now]
        self.timers = [timer for timer in self.timers if timer[0] > now]
        for _when, callback in due:
            try:
                callback()
            except Exception:
                pass  # a spare not made now (a pool's, a spawner): made at the next launch

    def next_timeout(self) -> float | None:
        now = time.monotonic()
        deadlines = [x.deadline for x in self.launches if x.deadline is not None]
        # CPU-time limits are polled from the run's cgroup (limits.RunLimits.poll).
        deadlines += [now + interval for x in self.launches
                      if x.limits is not None and (interval := x.limits.poll_interval())]
        deadlines += [when for when, _callback in self.timers]
        if not deadlines:
            return None
        # epoll_wait(2) takes whole milliseconds in an int: a wait of more than 24.8 days
        # overflows. A long deadline is reached through several shorter waits.
        return min(max(0.0, min(deadlines) - now), MAX_WAIT)

    def on_control(self, sock: socket.socket) -> None:
        try:
            msg, fds = _wire.receive(sock, MAX_FDS)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ENOTCONN):
                self.shutdown()
            # Otherwise the request is lost (e.g. its memfd did not arrive under EMFILE): its
            # launch socket is gone with it, and the caller sees end-of-file.
            return
        if not msg:
            for fd in fds:
                os.close(fd)
            self.shutdown()
        self.received_ns = time.monotonic_ns()
        launch: Launch | None = None
        try:
            request = json.loads(msg)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            # Like a session's init: a malformed request fails alone, never this loop.
            refuse_request(fds, exc)
            return
        try:
            if "pool" in request:
                pool_sock = socket.socket(fileno=fds.pop(0))
                try:
                    _helper_pool.HelperPool(self, pool_sock, **request["pool"])
                except BaseException:
                    pool_sock.close()
                    raise
                return
            launch = Launch(socket.socket(fileno=fds.pop(0)))
            if len(fds) != 3:
                raise StepFailed("helper", 0, f"expected 3 standard streams, got {len(fds)}")
            self.start(launch, request["plan"], fds)
        except Exception as exc:
            if launch is not None and launch.sock is not None:
                launch.send(failure_report(exc))
                launch.sock.close()
        finally:
            for fd in fds:
                os.close(fd)

    def shutdown(self) -> None:
        for launch in self.launches:
            launch.kill("launcher gone")
        for launch in list(self.launches):
            try:
                os.waitpid(launch.pid, 0)
            except ChildProcessError:
                pass
            launch.reaped = True
            try:
                launch.cleanup.close()
            except Exception:
                pass
        self.cloner.close()
        sys.exit(0)

    # --- one launch ----------------------------------------------------------------------

    def start(self, launch: Launch, plan: WirePlan, stdio: list[int]) -> None:
        """Clone the sandbox of ``plan`` with ``stdio`` and release it (nsbox/helper/start.py,
        the steps in order); what the launch opens belongs to ``launch.cleanup``."""
        _start.start(self, launch, plan, stdio)

    def watch(self, launch: Launch) -> None:
        """Watch the child's exit, its error pipe and the launch's sockets."""
        launch.pidfd = os.pidfd_open(launch.pid)
        launch.cleanup.callback(self.drop_fd, launch, "pidfd")
        launch.mnt_ns = hold_namespace(launch.pid)
        # Closed after the report has gone out: the sandbox's mounts are torn down then.
        launch.cleanup.callback(self.drop_fd, launch, "mnt_ns")
        self.selector.register(launch.pidfd, selectors.EVENT_READ, lambda _f: self.reap(launch))
        self.selector.register(launch.err_fd, selectors.EVENT_READ,
                               lambda _f: self.read_error(launch))
        launch.cleanup.callback(self.unwatch_requests, launch)
        if launch.sock is not None:
            self.watch_requests(launch)
        _channels.watch_channels(self.selector, launch)
        self.launches.add(launch)

    def unwatch_requests(self, launch: Launch) -> None:
        if launch.sock is not None:
            _channels.unwatch(self.selector, launch.sock)

    def drop_fd(self, launch: Launch, name: str) -> None:
        """Close the launch's descriptor ``name`` (once), watched or not."""
        fd = getattr(launch, name)
        if fd < 0:
            return
        setattr(launch, name, -1)
        _channels.unwatch(self.selector, fd)
        os.close(fd)

    def read_error(self, launch: Launch) -> None:
        data = os.read(launch.err_fd, 65536)
        if data:
            launch.err_data += data
            return
        self.drop_fd(launch, "err_fd")

    def watch_requests(self, launch: Launch) -> None:
        assert launch.sock is not None
        self.selector.register(launch.sock, selectors.EVENT_READ,
                               lambda _f: self.on_request(launch))

    def on_request(self, launch: Launch) -> None:
        assert launch.sock is not None
        try:
            data = launch.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(launch.sock)
            launch.kill("caller gone")
            return
        try:
            reason = _wire.kill_reason(data)
        except ValueError as exc:
            # The host's end of this launch is broken: the launch fails alone, not the loop.
            launch.fail("request", StepFailed("request", 0, malformed_request(exc)))
            return
        if reason is not None:
            launch.kill(reason)

    def reap(self, launch: Launch) -> None:
        try:
            report = self.exit_report(launch)
        except Exception as exc:
            report = {"event": "exit", "setup_error": failure_info("reap", exc)}
        self.finish(launch, report)

    def exit_report(self, launch: Launch) -> ExitReport:
        """Reap the sandbox, take in what its side channels and error pipe still hold, and
        make its report (nsbox/helper/report.py)."""
        _pid, status, rusage = os.wait4(launch.pid, 0)
        launch.reaped = True
        reaped_ns = time.monotonic_ns()
        # If it is still here: the host gets the proxy listener before the exit.
        _channels.pass_proxy_listener(self.selector, launch)
        if launch.notify_sock is not None:  # sent before exec, not read yet
            _channels.receive_listener(self.selector, launch)
        denied = None
        if launch.notify_table:
            denied = launch.denied.names() if launch.denied else []
        _channels.close_notify(self.selector, launch)
        wall = time.monotonic() - launch.started
        self.drain_errors(launch)
        return _report.exit_report(launch, status, rusage, wall, reaped_ns, denied)

    def drain_errors(self, launch: Launch) -> None:
        """What the error pipe still holds, to its end (the child is gone)."""
        if launch.err_fd < 0:
            return
        os.set_blocking(launch.err_fd, False)
        try:
            while chunk := os.read(launch.err_fd, 65536):
                launch.err_data += chunk
        except BlockingIOError:
            pass
        self.drop_fd(launch, "err_fd")

    def finish(self, launch: Launch, report: ExitReport) -> None:
        """Send the launch's report, then release everything it held."""
        release_pins(launch)  # the bound directories' modes, before the caller hears
        _landlocked.remove_dirs(launch)  # a Landlock sandbox's fresh directories, likewise
        self.launches.discard(launch)
        launch.send(report)
        try:
            _report.remove_cgroup(launch)
            self.cloner.ended()
            if launch.pool is not None:  # a pooled sandbox: the pool prepares what follows
                launch.pool.ended(launch, report.get("setup_error"))
        finally:
            try:
                launch.cleanup.close()  # the sandbox's mounts are torn down here (mnt_ns)
            finally:
                if launch.sock is not None:
                    self.unwatch_requests(launch)
                    launch.sock.close()


def malformed_request(exc: ValueError) -> str:
    return f"the launch helper got a malformed message from the host ({str(exc)[:200]})"


def refuse_request(fds: list[int], exc: ValueError) -> None:
    """A request that is not JSON: its launch socket (the first descriptor, if any) gets the
    failure, and everything that came with it is closed."""
    try:
        if fds:
            sock = socket.socket(fileno=fds.pop(0))
            with sock:
                sock.send(json.dumps(failure_report(
                    StepFailed("helper", 0, malformed_request(exc)))).encode())
    except OSError:
        pass  # the caller is gone already
    finally:
        for fd in fds:
            os.close(fd)


def hold_namespace(pid: int) -> int:
    """A reference to the sandbox's mount namespace, or -1.

    Without it, the exit of the sandbox's last process unmounts its whole tree (and waits for
    RCU) before the exit can be reaped; held, that happens when the helper closes this, after
    the report has gone out. The sandbox is dead by then either way.
    """
    try:
        return os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def main() -> None:
    serve(int(sys.argv[1]))


def serve(fd: int) -> None:
    """Serve the control socket ``fd`` until the host process is gone."""
    # Every sandbox is a clone of this process: no host path (interpreter, checkout) nor host
    # environment of its start may be read in a sandbox's /proc.
    _libc.set_process_title("nsbox._helper")
    # Descriptors the host process leaked without close-on-exec end here, not in a sandbox.
    _libc.close_range(fd + 1)
    # Nor does the helper keep the host's own stdio (a pipe a reader waits on, an MCP client's
    # protocol stream): each sandbox gets its streams with its request.
    null = os.open("/dev/null", os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    if null > 2:  # one of them itself when the host closed it: it stays
        os.close(null)
    control = socket.socket(fileno=fd)
    os.set_inheritable(control.fileno(), False)
    # The helper must not be stopped by the terminal's ^C meant for the host program: the host
    # decides when sandboxes end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Every sandbox child resets what this process ignores, whatever its launcher left so.
    _child.note_ignored_signals()
    Helper(control).loop()


if __name__ == "__main__":
    main()
