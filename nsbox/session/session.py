"""Sessions: one sandbox that runs many commands, and files into and out of it.

A Session is launched through the same helper as ``nsbox.run``; its sandbox child builds the
sandbox and then stays as the sandbox's pid 1, serving commands (nsbox/sandbox/sessioninit.py
documents the protocol). The workspace, /tmp and every mount live as long as the session; each
command runs in a pid namespace of its own inside it, with its own deadline, output cap and Result.

Files move only as data, through the sandbox (nsbox/session/files.py); a project session's
changes reach the project only when applied (nsbox/session/review.py).

The session ends on ``close()``, when idle for ``idle_timeout`` seconds, or when the host
process ends in any way: the helper sees end-of-file and kills the session's pid 1, which ends
every process, mount and tmpfs of the sandbox.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nsbox._sys import wire as _wire
from nsbox._sys.wire import InitEvent, InitRequest, WireCommand
from nsbox.errors import LaunchError, NsboxError, SessionClosed
from nsbox.host import audit as auditmod
from nsbox.host import project as projectmod
from nsbox.host.network import RunNetwork
from nsbox.launch import launcher
from nsbox.policy import checks, limits
from nsbox.policy import inputs as doors  # "inputs" is also a parameter of Session
from nsbox.policy.policy import Policy
from nsbox.result import Result, Status
from nsbox.session.files import CopyLimits, FileInfo
from nsbox.session.policy import check_ask, check_copy_limits, check_inputs, input_mount, policy_for
from nsbox.session.review import ProjectReview
from nsbox.session.run import SessionRun

__all__ = ["CopyLimits", "FileInfo", "Session", "input_mount"]

DEFAULT_IDLE_TIMEOUT = 600.0  # seconds without a command before the session expires
START_TIMEOUT = 30.0
# After a command's deadline the init kills it; should the init fail to (it lives in the
# sandbox), the host kills the whole session this much later.
BACKSTOP = 5.0


class Session(SessionRun, ProjectReview):
    """One sandbox for several commands. Use as a context manager::

        with nsbox.Session(timeout=10) as s:
            s.write_file("main.py", "print(6 * 7)")
            print(s.run(["python3", "main.py"]).stdout)   # b'42\\n'

    ``profile`` names a shipped profile or a profile file (instead of ``policy``);
    ``timeout`` and ``output_limit`` are the defaults of each ``run``; ``inputs`` are
    ``HOST_PATH[:NAME]`` specs mounted read-only under /input; ``env`` is set for every command
    (its values are redacted in the audit record); ``audit`` is a file that gets one JSON line
    per command. ``project`` is a host directory seen copy-on-write at /workspace (review with
    ``changes``, write with ``apply``); ``ask(host, port) -> bool`` is called, in network allow
    mode, for a host not on the allow-list (once per host and port; answers are in each
    Result's network report and the audit record).
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        profile: str | None = None,
        workspace: str | None = None,
        inputs: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        audit: str | None = None,
        copy_limits: CopyLimits | None = None,
        project: str | None = None,
        ask: Callable[[str, int], bool] | None = None,
    ) -> None:
        self._closed = True  # until started: nothing for close() or __del__ to end
        # The start steps, in order; a bad value fails before anything is opened.
        workspace = checks.optional_path(workspace, "workspace")
        audit = checks.optional_path(audit, "audit")
        env = doors.env(env)
        timeout = checks.optional_seconds(timeout, "timeout")
        output_limit = doors.output_limit(output_limit)
        idle_timeout = checks.optional_seconds(idle_timeout, "idle_timeout")
        check_copy_limits(copy_limits)
        check_inputs(inputs)
        policy = policy_for(launcher.choose_policy(policy, profile), workspace, project, inputs)
        check_ask(ask, policy)
        self._set_up(policy, timeout=timeout, output_limit=output_limit,
                     idle_timeout=idle_timeout, copy_limits=copy_limits, env=env, audit=audit,
                     ask=ask)
        self._start_or_clean_up()

    def _set_up(self, policy: Policy, *, timeout: float | None, output_limit: int | None,
                idle_timeout: float | None, copy_limits: CopyLimits | None,
                env: dict[str, str] | None, audit: str | None,
                ask: Callable[[str, int], bool] | None) -> None:
        """The session's state, before its sandbox starts."""
        # The project as the session found it: recorded before the sandbox starts (and before
        # anything is opened that a failure here would have to close).
        self._project = projectmod.Project(policy) if policy.project is not None else None
        self.policy = policy
        self.id = secrets.token_hex(6)
        self.timeout = timeout if timeout is not None else policy.limits.wall_time
        self.output_limit = output_limit if output_limit is not None else policy.limits.output
        self.idle_timeout = idle_timeout
        self.copy_limits = copy_limits or CopyLimits()
        self.pid = 0  # host pid of the session's init
        self._pidfd = -1  # and a descriptor for it (sent with the pid)
        self.commands = 0
        self._env = dict(env or {})
        self._lock = threading.RLock()  # run() records files with the lock held
        self._closed = False
        self._ended_reason: str | None = None
        self._overdue = False
        self._current: socket.socket | None = None  # the running command's socket
        self._audit = auditmod.AuditLog(audit) if audit else None
        self._heads: tuple[bytes, bytes] = (b"", b"")  # of the last command's output
        self._written = []  # files the caller wrote since the last run
        self._known = {}  # path -> sha256 after the last run (for the audit)
        # The callback lives here, not in the Policy, which stays hashable and serializable.
        self._net = RunNetwork(policy.network, ask)  # allow mode: the session's proxy

    def _start_or_clean_up(self) -> None:
        """Launch the session's sandbox; on failure close what the state opened."""
        try:
            self._ctl, self._launch = launcher.isolation.with_fallback(self.policy, self._start)
        except BaseException:
            self._closed = True
            if self._pidfd >= 0:
                os.close(self._pidfd)
            if self._audit is not None:
                self._audit.close()
            raise

    # --- lifetime ----------------------------------------------------------------------------

    def _start(self) -> tuple[socket.socket, socket.socket]:
        plan = launcher.build_plan(self.policy, ["nsbox-session-init"], env=self._env)
        self._isolation = plan.isolation  # every command's plan is the same mode's
        wire = plan.to_wire()
        self._wire = wire
        wire.update(host_uid=self.policy.host_uid, host_gid=self.policy.host_gid,
                    wall_time=None, session={"idle_timeout": self.idle_timeout})
        ctl, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launch, launch_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            # The control socket is the init's fd 0 (nsbox/sandbox/sessioninit.py).
            launcher.helper_client.submit(wire, [launch_theirs.fileno(), ctl_theirs.fileno(), null,
                                           null])
        except BaseException:
            ctl.close()
            launch.close()
            raise
        finally:
            ctl_theirs.close()
            launch_theirs.close()
            os.close(null)
        try:
            self._wait_ready(ctl, launch, wire["net"].get("mode") == "allow")
        except BaseException as exc:
            ctl.close()
            launch.close()
            self._net.close()
            if isinstance(exc, OSError):  # ECONNRESET: the init died while starting
                raise LaunchError(f"the session's sandbox ended while starting: "
                                  f"{exc.strerror or exc}") from None
            raise
        return ctl, launch

    def _wait_ready(self, ctl: socket.socket, launch: socket.socket, proxy: bool) -> None:
        """Until the init says it is ready, the helper has sent its pid and, in network allow
        mode, the proxy's listener."""
        ready = False
        deadline = time.monotonic() + START_TIMEOUT
        with selectors.DefaultSelector() as selector:
            selector.register(ctl, selectors.EVENT_READ, "ctl")
            selector.register(launch, selectors.EVENT_READ, "launch")
            while not (ready and self.pid and (self._net.proxy or self._net.error or not proxy)):
                events = selector.select(max(0.0, deadline - time.monotonic()))
                if not events:
                    raise LaunchError("the session's sandbox did not start in time")
                for key, _mask in events:
                    if key.data == "launch":
                        message = self._on_launch_message(launch)
                        if message is None:
                            raise LaunchError("the launch helper died while starting a session")
                        if message.get("event") == "exit":
                            if message.get("setup_error") or message.get("host_error"):
                                launcher.result_from(message, 0, [], 0, 0.0)  # raises the error
                            raise LaunchError("the session's sandbox ended while starting")
                    else:
                        event: InitEvent | None = _message(ctl.recv(65536))
                        if event is None:
                            selector.unregister(ctl)  # the helper's exit report says why
                        elif event.get("event") == "ready":
                            ready = True

    def _on_launch_message(self, launch: socket.socket) -> dict[str, Any] | None:
        """One message of the helper about the session's launch (pid, proxy, exit)."""
        data, fds = _wire.receive_fds(launch, 65536, 1)
        message = _message(data)
        if message is not None and message.get("event") == "proxy":
            self._net.serve(fds)
            return message
        if message is not None and message.get("event") == "pid" and fds and self._pidfd < 0:
            self._pidfd = fds.pop()  # the init's: _kill_overdue needs no helper
        for fd in fds:
            os.close(fd)
        if message is not None and message.get("event") == "pid":
            self.pid = int(message["pid"])
        return message

    @property
    def alive(self) -> bool:
        """Whether the session still runs (it may have expired or been killed)."""
        if self._closed or self._ended_reason:
            return False
        with selectors.DefaultSelector() as selector:
            selector.register(self._launch, selectors.EVENT_READ)
            while selector.select(0):
                try:
                    message = self._on_launch_message(self._launch)
                except (OSError, LaunchError):
                    message = None
                if message is None or message.get("event") == "exit":
                    self._ended_reason = ("the session's sandbox has ended (idle timeout or "
                                          "killed)")
                    return False
        return True

    def close(self) -> None:
        """End the session: every process, mount and file of the sandbox is gone on return."""
        if self._closed:
            return
        self._closed = True
        for sock in (self._ctl, self._launch):
            try:
                # shutdown, not close: another thread may be inside run() (CLI stop).
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        # End-of-file makes the helper kill the init; it reports once the init is reaped.
        deadline = time.monotonic() + 10.0
        with selectors.DefaultSelector() as selector:
            selector.register(self._launch, selectors.EVENT_READ)
            while time.monotonic() < deadline and selector.select(deadline - time.monotonic()):
                try:
                    data = self._launch.recv(65536)
                except OSError:
                    break
                if not data:
                    break
        self._ctl.close()
        self._launch.close()
        self._net.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._audit is not None:
            self._audit.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    # --- commands ----------------------------------------------------------------------------

    def _run_command(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str | int | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        passthrough: bool = False,
        _sinks: tuple[int | None, int | None] | None = None,
        cancel: launcher.Cancel | None = None,
        tty: list[int] | None = None,
    ) -> Result:
        """One command of the session, with nsbox's own arguments (``run`` adds those of
        subprocess, nsbox/session/run.py); ``cancel`` lets another thread kill it; ``tty``
        (rows, columns): a pty of its own, the master sent over ``stdin`` (a unix socket,
        nsbox/host/terminal.py: `nsbox session exec --tty`)."""
        # A bad value fails this command alone, before it reaches the session's sandbox.
        cmd = doors.command(argv, stdin_=stdin, timeout=timeout, output_limit_=output_limit,
                            env_=env, cwd=cwd, passthrough=passthrough)
        return self._run_checked(cmd, passthrough=passthrough, sinks=_sinks, cancel=cancel,
                                 tty=tty)

    def _run_checked(self, cmd: doors.Command, *, passthrough: bool = False,
                     sinks: tuple[int | None, int | None] | None = None,
                     cancel: launcher.Cancel | None = None, tty: list[int] | None = None
                     ) -> Result:
        """``_run_command`` with its arguments checked (there, or at nsbox.run's door)."""
        data = cmd.stdin
        timeout = cmd.timeout if cmd.timeout is not None else self.timeout
        cap = cmd.output_limit if cmd.output_limit is not None else self.output_limit
        command_env = {**self._env, **(cmd.env or {})}
        # The session's binds were checked when it started (nsbox/policy/rules.py); what its own
        # commands left in its workspace since does not stop the next one.
        plan = launcher.build_plan(self.policy, cmd.argv, env=command_env, cwd=cmd.cwd,
                                   wall_time=timeout, check_sources=False, mode=self._isolation)
        wire = plan.to_wire()
        command: WireCommand = {
            "argv": wire["argv"], "env": wire["env"], "cwd": wire["cwd"],
            "rlimits": wire["rlimits"], "seccomp_bpf": wire["seccomp_bpf"],
            "wall_time": wire["wall_time"]}
        if tty:
            command["tty"] = list(tty)
        sinks = sinks or ((1, 2) if passthrough else (None, None))
        with self._lock:
            result: Result | None = None
            error: NsboxError | None = None
            heads = (b"", b"")
            try:
                result = self._command({"cmd": "run", "command": command}, data, cap, sinks,
                                       timeout, cancel)
                heads = self._heads
                return result
            except NsboxError as exc:
                error = exc
                raise
            finally:
                self.commands += 1
                if self._audit is not None:
                    self._record(cmd.argv, command_env, data, timeout, cap, result, error,
                                 heads)

    def _command(self, request: InitRequest, stdin: bytes | int | None, cap: int,
                 sinks: tuple[int | None, int | None], timeout: float | None,
                 cancel: launcher.Cancel | None = None) -> Result:
        self._check_open()
        started = time.monotonic()
        out_r, err_r, ours = launcher.submit_with_streams(
            self._send_command, dict(request), stdin,
            terminal="tty" in request.get("command", {}))
        head = auditmod.HEAD if self._audit else 0
        streams = [launcher.Stream(out_r, sinks[0], head_limit=head),
                   launcher.Stream(err_r, sinks[1], head_limit=head)]
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout + BACKSTOP, self._kill_overdue)
            timer.daemon = True
            timer.start()
        self._current = ours
        if cancel is not None:
            cancel.attach(ours)
        try:
            with ours:
                report, pid = launcher.supervise(ours, streams, cap, self._net)
        except (LaunchError, ValueError, KeyError, OSError):  # ECONNRESET: the init died
            if self._overdue:
                self._ended_reason = ("the session was killed: a command outlived its deadline "
                                      "and the sandbox's init did not stop it")
                return Result(status=Status.TO, timed_out=True, error=self._ended_reason,
                              wall_time=time.monotonic() - started)
            self._ended_reason = "the session's sandbox ended during the command"
            raise SessionClosed(self._ended_reason) from None
        finally:
            self._current = None
            if cancel is not None:
                cancel.detach()
            if timer is not None:
                timer.cancel()
        result = launcher.result_from(report, pid, streams, cap, time.monotonic() - started)
        launcher.landlockplan.mark_result(result, self._wire)
        if result.isolation != "namespaces":  # its init sees the host's /tmp, not the sandbox's
            result.disk_full = []
        result.extra["session"] = self.id
        if request["cmd"] == "run":
            network = self._net.report_since()
            if network is not None:
                result.extra["network"] = network
            limits.note_disk(result, self.policy.workspace, self.policy.limits.workspace_size)
        # Output passed through is not in the Result; the audit record still gets its head.
        self._heads = (bytes(streams[0].kept) if sinks[0] is not None else result.stdout,
                       bytes(streams[1].kept) if sinks[1] is not None else result.stderr)
        if sinks[0] is not None:
            result.stdout = b""
        if sinks[1] is not None:
            result.stderr = b""
        return result

    def _send_command(self, request: InitRequest, fds: list[int]) -> None:
        try:
            _wire.send(self._ctl, request, fds)  # any size (nsbox/_sys/wire.py)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                # Not sent (EMFILE for its memfd, say): this command fails, the session lives.
                raise launcher.out_of_descriptors("cannot send the command", exc) from None
            self._ended_reason = "the session's sandbox has ended (idle timeout or killed)"
            raise SessionClosed(self._ended_reason) from None

    def cancel(self) -> None:
        """Kill the command running now (from another thread) and everything it started;
        its Result has status SG. The session goes on."""
        current = self._current
        if current is not None:
            launcher.send_kill(current, "cancelled")

    def _kill_overdue(self) -> None:
        self._overdue = True
        try:
            self._launch.shutdown(socket.SHUT_WR)  # the helper kills the init
        except OSError:
            pass
        # And this process does, should the helper not get to run (stopped, starved): by the
        # pidfd, so never another process that reused the pid (pidfd_send_signal(2)).
        if self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("the session is closed")
        if self._ended_reason:
            raise SessionClosed(self._ended_reason)

    # --- files -------------------------------------------------------------------------------
    # --- audit -------------------------------------------------------------------------------

    def _record(self, argv: Sequence[str], env: dict[str, str], stdin: bytes | int | None,
                timeout: float | None, cap: int, result: Result | None,
                error: NsboxError | None, heads: tuple[bytes, bytes]) -> None:
        assert self._audit is not None
        produced: list[Any] = []  # FileEntry each, or the error that stopped the listing
        if self.alive:
            try:
                now = {f.path: f for f in self.files()}
            except NsboxError as exc:
                produced = [{"error": str(exc)}]
            else:
                produced = [f.to_dict() for path, f in sorted(now.items())
                            if self._known.get(path) != f.sha256]
                self._known = {path: f.sha256 for path, f in now.items()}
        shown = auditmod.set_env(self.policy, env)
        record = auditmod.command_record(
            argv=argv, policy=self.policy, session=self.id, env=shown, stdin=stdin,
            timeout=timeout, output_limit=cap, result=result, error=error,
            files_written=self._written, files_produced=produced,
            heads=heads if result is not None else None)
        if self._project is not None:
            view = self._project.view
            record["project"] = {"source": self._project.root, "masked": view.masked,
                                 "read_only": view.read_only, "notes": view.notes}
        self._written = []
        self._audit.write(record, secrets=shown.values())


def of_command(policy: Policy, cmd: doors.Command, audit: str) -> Session:
    """The session of one audited ``nsbox.run`` (nsbox/api.py), whose door has chosen the
    policy and checked every argument: nothing is checked twice."""
    session = Session.__new__(Session)
    session._closed = True
    session._set_up(policy, timeout=cmd.timeout, output_limit=cmd.output_limit,
                    idle_timeout=None, copy_limits=None, env=cmd.env, audit=audit, ask=None)
    session._start_or_clean_up()
    return session


def _message(data: bytes) -> Any:
    """A JSON object, or None at end-of-file."""
    if not data:
        return None
    try:
        message = json.loads(data)
    except ValueError:
        raise LaunchError("the session's sandbox sent a malformed message") from None
    if not isinstance(message, dict):
        raise LaunchError("the session's sandbox sent a malformed message")
    return message
