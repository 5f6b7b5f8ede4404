"""Sessions: one sandbox that runs many commands, and files into and out of it.

A Session is launched through the same helper as ``nsbox.run``; its sandbox child builds the
sandbox and then stays as the sandbox's pid 1, serving commands (nsbox/sandbox/sessioninit.py
documents the protocol). The workspace, /tmp and every mount live as long as the session; each
command runs in a pid namespace of its own inside it, with its own deadline, output cap and Result.

Files move only as data, through the sandbox: the host never opens a path inside the workspace
itself (the sandbox could have turned it into a symlink, a FIFO or a 1 TB sparse file since the
host looked). A file operation is a small command the init runs as the sandbox's user without
capabilities: it walks the path without following symlinks, checks with fstat that it opened a
regular file with one name, and sends at most the size it saw. The host checks the SHA-256 of
what arrived.

The session ends on ``close()``, when idle for ``idle_timeout`` seconds, or when the host
process ends in any way: the helper sees end-of-file and kills the session's pid 1, which ends
every process, mount and tmpfs of the sandbox.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import selectors
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nsbox import _wire, launcher, rules
from nsbox import inputs as doors
from nsbox import plan as planmod
from nsbox.errors import (
    FileTransferError,
    LaunchError,
    NsboxError,
    PolicyError,
    SessionClosed,
)
from nsbox.host import audit as auditmod
from nsbox.host import project as projectmod
from nsbox.host.network import RunNetwork
from nsbox.policy import Bind, MiB, Policy
from nsbox.result import Result, Status

DEFAULT_IDLE_TIMEOUT = 600.0  # seconds without a command before the session expires
START_TIMEOUT = 30.0
# After a command's deadline the init kills it; should the init fail to (it lives in the
# sandbox), the host kills the whole session this much later.
BACKSTOP = 5.0
FILE_OP_TIMEOUT = 60.0
INPUT_DIR = "/input"


@dataclass(frozen=True)
class FileInfo:
    """A regular file in the sandbox: ``path`` relative to the listed directory."""

    path: str
    size: int
    sha256: str
    mode: int = 0o644

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class CopyLimits:
    """Caps on what leaves the sandbox: per file, number of files, bytes in all."""

    max_file_size: int = 64 * MiB
    max_files: int = 1000
    max_total: int = 256 * MiB


def input_mount(spec: str) -> Bind:
    """``HOST_PATH[:NAME]`` -> a read-only bind of HOST_PATH at /input/NAME."""
    source, sep, name = spec.rpartition(":")
    if not sep:
        source, name = spec, ""
    if not source:
        raise PolicyError(f"{spec!r}: expected HOST_PATH[:NAME]", key="input")
    name = name or os.path.basename(os.path.normpath(source))
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise PolicyError(f"{spec!r}: the name under {INPUT_DIR} must be one path component",
                          key="input")
    if not os.path.exists(source):
        # A refused path is refused by its rule, whether or not it exists on this host; one
        # that exists meets the rules (with the policy's allow_rules) in Policy and the plan.
        rules.check_spelling(rules.resolve(os.path.abspath(source), "input"), False, (),
                             "input")
        raise PolicyError(f"{spec!r}: {source} does not exist", key="input",
                          hint="check the path of the input")
    return Bind(os.path.abspath(source), f"{INPUT_DIR}/{name}", writable=False)


class Session:
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
        workspace = doors.optional_path(workspace, "workspace")
        audit = doors.optional_path(audit, "audit")
        env = doors.env(env)
        timeout = doors.optional_seconds(timeout, "timeout")
        output_limit = doors.output_limit(output_limit)
        idle_timeout = doors.optional_seconds(idle_timeout, "idle_timeout")
        if copy_limits is not None and not isinstance(copy_limits, CopyLimits):
            raise PolicyError(f"expected a nsbox.CopyLimits, got {doors.quote(copy_limits)}",
                              key="copy_limits")
        if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)):
            raise PolicyError(f"expected a list of HOST_PATH[:NAME], got {doors.quote(inputs)}",
                              key="inputs", hint=f"did you mean [{doors.quote(inputs)}]?"
                              if isinstance(inputs, str) else None)
        for spec in inputs:
            doors.text(spec, "inputs")
        policy = launcher.choose_policy(policy, profile)
        if workspace is not None:
            policy = policy.replace(workspace=workspace)
        if project is not None:
            policy = policy.replace(project=projectmod.source(doors.path(project, "project")))
        if inputs:
            policy = policy.replace(mounts=policy.mounts + tuple(input_mount(s) for s in inputs))
        if policy.seccomp.log_denied:
            # The learning-mode listener is handed over once per launch, not per command.
            raise PolicyError("seccomp learning mode is not available in a session",
                              key="seccomp.log_denied", hint="use nsbox run --seccomp-log")
        if ask is not None and (not callable(ask) or policy.network.effective_mode != "allow"):
            raise PolicyError(
                "ask needs a callable and network mode allow with at least one entry"
                if callable(ask) else f"expected a callable, got {doors.quote(ask)}",
                key="ask", hint="e.g. Network(mode='allow', allow=('pypi.org',)): hosts not "
                "on the list are put to ask(host, port)")
        # The project as the session found it: recorded before the sandbox starts (and before
        # anything is opened that a failure here would have to close).
        project_state = projectmod.Project(policy) if policy.project is not None else None
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
        self._written: list[dict[str, Any]] = []  # files the caller wrote since the last run
        self._known: dict[str, str] = {}  # path -> sha256 after the last run (for the audit)
        # The callback lives here, not in the Policy, which stays hashable and serializable.
        self._net = RunNetwork(policy.network, ask)  # allow mode: the session's proxy
        self._net_seen = 0  # proxy log entries reported with earlier commands
        self._net_answered = 0  # and answers of ``ask``
        self._project = project_state
        try:
            self._ctl, self._launch = self._start()
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
        wire = plan.to_wire()
        wire.update(host_uid=self.policy.host_uid, host_gid=self.policy.host_gid,
                    wall_time=None, session={"idle_timeout": self.idle_timeout})
        ctl, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launch, launch_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            # The control socket is the init's fd 0 (nsbox/sandbox/sessioninit.py).
            launcher._helper.submit(wire, [launch_theirs.fileno(), ctl_theirs.fileno(), null,
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
                                launcher._result(message, 0, [], 0, 0.0)  # raises the error
                            raise LaunchError("the session's sandbox ended while starting")
                    else:
                        message = _message(ctl.recv(65536))
                        if message is None:
                            selector.unregister(ctl)  # the helper's exit report says why
                        elif message.get("event") == "ready":
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

    def run(
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
    ) -> Result:
        """Run ``argv`` in the session and return its Result.

        A timeout (status TO) or output limit (OL) ends this command and everything it started,
        never the session. ``stdin`` is bytes (or text) to feed, a descriptor, or None.
        """
        # A bad value fails this command alone, before it reaches the session's sandbox.
        cmd = doors.command(argv, stdin_=stdin, timeout=timeout, output_limit_=output_limit,
                            env_=env, cwd=cwd, passthrough=passthrough)
        data = cmd.stdin
        timeout = cmd.timeout if cmd.timeout is not None else self.timeout
        cap = cmd.output_limit if cmd.output_limit is not None else self.output_limit
        command_env = {**self._env, **(cmd.env or {})}
        # The session's binds were checked when it started (nsbox/rules.py); what its own
        # commands left in its workspace since does not stop the next one.
        plan = launcher.build_plan(self.policy, cmd.argv, env=command_env, cwd=cmd.cwd,
                                   wall_time=timeout, check_sources=False)
        wire = plan.to_wire()
        command = {key: wire[key] for key in ("argv", "env", "cwd", "rlimits", "seccomp_bpf",
                                              "wall_time")}
        sinks = _sinks or ((1, 2) if passthrough else (None, None))
        with self._lock:
            result: Result | None = None
            error: NsboxError | None = None
            heads = (b"", b"")
            try:
                result = self._command({"cmd": "run", "command": command}, data, cap, sinks,
                                       timeout)
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

    def _command(self, request: dict[str, Any], stdin: bytes | int | None, cap: int,
                 sinks: tuple[int | None, int | None], timeout: float | None) -> Result:
        self._check_open()
        started = time.monotonic()
        out_r, err_r, ours = launcher._submit_with_streams(self._send_command, request, stdin)
        head = auditmod.HEAD if self._audit else 0
        streams = [launcher._Stream(out_r, sinks[0], head_limit=head),
                   launcher._Stream(err_r, sinks[1], head_limit=head)]
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout + BACKSTOP, self._kill_overdue)
            timer.daemon = True
            timer.start()
        self._current = ours
        try:
            with ours:
                report, pid = launcher._supervise(ours, streams, cap, self._net)
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
            if timer is not None:
                timer.cancel()
        result = launcher._result(report, pid, streams, cap, time.monotonic() - started)
        result.extra["session"] = self.id
        if request["cmd"] == "run":
            self._network_report(result)
        # Output passed through is not in the Result; the audit record still gets its head.
        self._heads = (bytes(streams[0].kept) if sinks[0] is not None else result.stdout,
                       bytes(streams[1].kept) if sinks[1] is not None else result.stderr)
        if sinks[0] is not None:
            result.stdout = b""
        if sinks[1] is not None:
            result.stderr = b""
        return result

    def _send_command(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            _wire.send(self._ctl, request, fds)  # any size (nsbox/_wire.py)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                # Not sent (EMFILE for its memfd, say): this command fails, the session lives.
                raise launcher._out_of_descriptors("cannot send the command", exc) from None
            self._ended_reason = "the session's sandbox has ended (idle timeout or killed)"
            raise SessionClosed(self._ended_reason) from None

    def _network_report(self, result: Result) -> None:
        """The session's proxy log, cut to the attempts made since the previous command."""
        report = self._net.report()
        if report is None:
            return
        attempts = report.get("attempts")
        if isinstance(attempts, list):
            report["attempts"] = attempts[self._net_seen:]
            self._net_seen = len(attempts)
        answers = report.get("answers")
        if isinstance(answers, list):  # the answers of ``ask`` given during this command
            report["answers"] = answers[self._net_answered:]
            self._net_answered = len(answers)
        result.extra["network"] = report

    def cancel(self) -> None:
        """Kill the command running now (from another thread) and everything it started;
        its Result has status SG. The session goes on."""
        current = self._current
        if current is not None:
            launcher._send_kill(current, "cancelled")

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

    def _file_op(self, op: dict[str, Any], stdin: bytes | None = None,
                 cap: int = 16 * MiB) -> bytes:
        op = {"wall_time": FILE_OP_TIMEOUT, **op}
        with self._lock:
            result = self._command({"cmd": "file", "op": op}, stdin, cap, (None, None),
                                   FILE_OP_TIMEOUT)
        if result.status is Status.OK:
            return result.stdout
        if result.status is Status.OL and op["kind"] == "get":
            raise FileTransferError(str(op.get("path", "")),
                                    f"too large: more than {op.get('max_size')} bytes")
        if result.exit_code == 1:
            try:
                info = json.loads(result.stderr)
                raise FileTransferError(str(info.get("path", "")), str(info["reason"]))
            except (ValueError, KeyError, TypeError):
                pass
        raise FileTransferError(str(op.get("path", "")),
                                f"the file operation failed ({result.status.value})")

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the sandbox (relative paths are under /workspace),
        creating parent directories; never through a symlink or into a FIFO."""
        path = doors.path(path, "path")
        doors.whole(mode, "mode", 0, 0o7777, "a mode (an int, e.g. 0o644)")
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PolicyError(f"expected bytes or str, got {type(data).__name__} "
                              f"{doors.quote(data)}", key="data")
        data = bytes(data)
        self._file_op({"kind": "put", "path": path, "mode": mode}, data)
        if self._audit is not None:
            described = auditmod.describe_data(data)
            self._written.append({"path": path, **described})
            # What the caller wrote is not something a command produced.
            rel = path[len(planmod.WORKSPACE) + 1:] if path.startswith(
                planmod.WORKSPACE + "/") else path
            self._known[rel] = described["sha256"]

    def read_file(self, path: str, *, max_size: int | None = None) -> bytes:
        """The content of the regular file ``path`` in the sandbox. Refuses symlinks, FIFOs,
        devices, hard links and files over ``max_size`` (default: the per-file copy limit)."""
        path = doors.path(path, "path")
        if max_size is not None:
            doors.size(max_size, "max_size", low=0)
        limit = max_size if max_size is not None else self.copy_limits.max_file_size
        # Room for the sandbox's error report on stderr (a refusal is no partial file).
        data = self._file_op({"kind": "get", "path": path, "max_size": limit},
                             cap=limit + 65536)
        if len(data) > limit:
            raise FileTransferError(path, f"too large: more than {limit} bytes")
        return data

    def files(self, patterns: Iterable[str] = ("*",), root: str = planmod.WORKSPACE,
              *, skipped: list[tuple[str, str]] | None = None) -> list[FileInfo]:
        """The regular files below ``root`` whose relative path matches one of ``patterns``
        (fnmatch: ``*`` also matches ``/``), with sizes and SHA-256. What is not copyable
        (symlinks, FIFOs, devices, hard links, over the caps) is left out; pass a list as
        ``skipped`` to get (path, reason) for each."""
        limits = self.copy_limits
        data = self._file_op({"kind": "list", "path": root, "patterns": list(patterns),
                              "max_files": limits.max_files, "max_size": limits.max_file_size,
                              "max_total": limits.max_total})
        try:
            listing = json.loads(data)
            found = [FileInfo(str(f["path"]), int(f["size"]), str(f["sha256"]),
                              int(f["mode"])) for f in listing["files"]]
            if skipped is not None:
                skipped.extend((str(s["path"]), str(s["reason"])) for s in listing["skipped"])
        except (ValueError, KeyError, TypeError):
            raise FileTransferError(root, "the sandbox sent a malformed listing") from None
        for info in found:
            _check_relative(info.path)
        return found

    def copy_out(self, dest: str, patterns: Iterable[str] = ("*",),
                 root: str = planmod.WORKSPACE,
                 *, skipped: list[tuple[str, str]] | None = None) -> list[FileInfo]:
        """Copy the files ``files(patterns, root)`` lists into the host directory ``dest``
        (created if missing), keeping their relative paths. Returns what was copied."""
        found = self.files(patterns, root, skipped=skipped)
        try:
            os.makedirs(dest, exist_ok=True)
            dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileTransferError(dest, f"cannot use it as the destination: "
                                          f"{exc.strerror or exc}") from None
        try:
            for info in found:
                data = self.read_file(f"{root.rstrip('/')}/{info.path}", max_size=info.size)
                if len(data) != info.size or hashlib.sha256(data).hexdigest() != info.sha256:
                    raise FileTransferError(info.path, "changed while it was copied")
                try:
                    _write_below(dest_fd, info.path, data,
                                 0o755 if info.mode & 0o100 else 0o644)
                except OSError as exc:
                    reason = ("a symlink or non-directory is in the way at the destination"
                              if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                              else exc.strerror or str(exc))
                    raise FileTransferError(os.path.join(dest, info.path), reason) from None
        finally:
            os.close(dest_fd)
        return found

    # --- project review ----------------------------------------------------------------------

    @property
    def masked(self) -> list[str]:
        """The project's secrets covered with an empty read-only file in the sandbox."""
        return list(self._project.masked) if self._project is not None else []

    def _project_or_refuse(self) -> projectmod.Project:
        if self._project is None:
            raise PolicyError("this session has no project workspace", key="project",
                              hint="start it with Session(project=DIR) or --project DIR")
        return self._project

    def changes(self, *, diff: bool = True) -> list[projectmod.Change]:
        """What the sandbox changed in the project: added, modified, deleted files and
        directories, mode changes, symlinks and what cannot be applied (hard links, FIFOs,
        files over the copy limit), each text file with a unified diff (``diff``)."""
        project = self._project_or_refuse()
        data = self._file_op({"kind": "changes", "max_entries": projectmod.MAX_CHANGES,
                              "max_size": self.copy_limits.max_file_size})
        try:
            listing = json.loads(data)["entries"]
            found = project.changes(listing)
        except (ValueError, KeyError, TypeError):
            raise FileTransferError(projectmod.UPPER, "the sandbox sent a malformed listing"
                                    ) from None
        if not diff:
            return found
        contents = self._upper([c for c in found if c.size is not None
                                and c.size <= projectmod.DIFF_MAX])
        return [project.with_diff(c, contents.get(c.path)) for c in found]

    def _upper(self, changes: list[projectmod.Change]) -> dict[str, bytes]:
        """The sandbox's version of the changed files, read in batches (one file operation
        for many files), each checked against the SHA-256 it was listed with."""
        wanted = [c for c in changes if c.kind in ("added", "modified") and not c.is_dir
                  and c.size is not None and c.sha256 is not None]
        contents: dict[str, bytes] = {}
        batch: list[projectmod.Change] = []
        for change in wanted:
            batch.append(change)
            if sum(c.size or 0 for c in batch) >= self.copy_limits.max_file_size:
                contents.update(self._read_batch(batch))
                batch = []
        if batch:
            contents.update(self._read_batch(batch))
        return contents

    def _read_batch(self, batch: list[projectmod.Change]) -> dict[str, bytes]:
        total = sum(c.size or 0 for c in batch)
        data = self._file_op({"kind": "getmany", "max_size": self.copy_limits.max_file_size,
                              "paths": [f"{projectmod.UPPER}/{c.path}" for c in batch]},
                             cap=total + 65536)
        if len(data) != total:
            raise FileTransferError(batch[0].path, "changed while it was read")
        contents, offset = {}, 0
        for change in batch:
            part = data[offset:offset + (change.size or 0)]
            offset += change.size or 0
            if hashlib.sha256(part).hexdigest() != change.sha256:
                raise FileTransferError(change.path, "changed while it was read")
            contents[change.path] = part
        return contents

    def apply(self, paths: Sequence[str] | None = None) -> projectmod.ApplyReport:
        """Write the chosen changes (all, or those at or below ``paths``) into the project
        directory, as this process, atomically per file. A change whose host file changed
        since the session started is a conflict and is not written."""
        project = self._project_or_refuse()
        chosen = _choose(self.changes(diff=False), paths)
        report = projectmod.ApplyReport()
        with self._lock:
            contents = self._upper([c for c in chosen if c.applicable and not c.conflict])
            for change in projectmod.order(chosen):
                if not change.applicable:
                    report.refused.append((change.path, change.reason or change.kind))
                elif change.conflict or project.conflict(change):
                    report.conflicts.append(change.path)
                else:
                    try:
                        self._apply_one(project, change, contents)
                    except (OSError, NsboxError) as exc:
                        report.refused.append((change.path, getattr(exc, "strerror", None)
                                               or str(exc)))
                        continue
                    report.applied.append(change.path)
        return report

    def _apply_one(self, project: projectmod.Project, change: projectmod.Change,
                   contents: dict[str, bytes]) -> None:
        if change.kind == "deleted":
            project.remove(change)
        elif change.kind == "mode":
            project.chmod(change)
        elif change.is_dir:
            project.make_dir(change)
        else:
            project.write(change, contents[change.path])

    def discard(self, paths: Sequence[str] | None = None) -> list[str]:
        """Drop the chosen changes from review: they are not listed or applied (unless the
        sandbox changes them again). The sandbox keeps its own view until the session ends;
        nothing reaches the host."""
        project = self._project_or_refuse()
        chosen = _choose(self.changes(diff=False), paths)
        project.discard(chosen)
        return [c.path for c in chosen]

    # --- audit -------------------------------------------------------------------------------

    def _record(self, argv: Sequence[str], env: dict[str, str], stdin: bytes | int | None,
                timeout: float | None, cap: int, result: Result | None,
                error: NsboxError | None, heads: tuple[bytes, bytes]) -> None:
        assert self._audit is not None
        produced: list[dict[str, Any]] = []
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
            record["project"] = {"source": self._project.root, "masked": self._project.masked}
        self._written = []
        self._audit.write(record, secrets=shown.values())


def _message(data: bytes) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        message = json.loads(data)
    except ValueError:
        raise LaunchError("the session's sandbox sent a malformed message") from None
    if not isinstance(message, dict):
        raise LaunchError("the session's sandbox sent a malformed message")
    return message


def _choose(changes: list[projectmod.Change],
            paths: Sequence[str] | None) -> list[projectmod.Change]:
    if paths is None:
        return changes
    if isinstance(paths, str):
        raise PolicyError(f"expected a list of paths, got {paths!r}", key="paths",
                          hint=f"did you mean [{paths!r}]?")
    wanted = [doors.text(p, "paths").strip("/") for p in paths]
    return [c for c in changes
            if any(c.path == w or c.path.startswith(w + "/") for w in wanted)]


def _check_relative(path: str) -> None:
    """A listed path comes from inside the sandbox: it must stay below the destination."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise FileTransferError(path, "the sandbox listed a path that leaves its directory")


def _write_below(dest_fd: int, path: str, data: bytes, mode: int) -> None:
    """Write ``data`` at ``path`` below the directory ``dest_fd``, creating directories and
    never following a symlink on the way."""
    _check_relative(path)
    *dirs, name = path.split("/")
    fd = os.dup(dest_fd)
    try:
        for part in dirs:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                next_fd = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                next_fd = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                      | os.O_CLOEXEC, mode, dir_fd=fd)
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise FileTransferError(path, "the destination is not a regular file")
            os.ftruncate(out, 0)
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(out, view):]
            except OSError:
                os.unlink(name, dir_fd=fd)  # no truncated copy is left behind (ENOSPC)
                raise
        finally:
            os.close(out)
    finally:
        os.close(fd)


def run_audited(argv: Sequence[str], policy: Policy, *, audit: str, stdin: bytes | int | None,
                timeout: float | None, output_limit: int | None, env: dict[str, str] | None,
                workspace: str | None, cwd: str | None, passthrough: bool) -> Result:
    """``nsbox.run`` with an audit record: one command in a session of its own, so that the
    files it produced can be listed (and hashed) before the sandbox goes away."""
    if policy.seccomp.log_denied:
        # Learning mode needs a launch of its own; the record then lists no produced files.
        return _run_audited_plain(argv, policy, audit=audit, stdin=stdin, timeout=timeout,
                                  output_limit=output_limit, env=env, workspace=workspace,
                                  cwd=cwd, passthrough=passthrough)
    with Session(policy, workspace=workspace, env=env, audit=audit, idle_timeout=None,
                 timeout=timeout, output_limit=output_limit) as session:
        return session.run(argv, stdin=stdin, cwd=cwd, passthrough=passthrough)


def _run_audited_plain(argv: Sequence[str], policy: Policy, *, audit: str,
                       stdin: bytes | int | None, timeout: float | None,
                       output_limit: int | None, env: dict[str, str] | None,
                       workspace: str | None, cwd: str | None, passthrough: bool) -> Result:
    log = auditmod.AuditLog(audit)
    result: Result | None = None
    error: NsboxError | None = None
    try:
        result = launcher.run(list(argv), policy, stdin=stdin, timeout=timeout,
                              output_limit=output_limit, env=env, workspace=workspace, cwd=cwd,
                              passthrough=passthrough)
        return result
    except NsboxError as exc:
        error = exc
        raise
    finally:
        cap = output_limit if output_limit is not None else policy.limits.output
        shown = auditmod.set_env(policy, env or {})
        record = auditmod.command_record(
            argv=argv, policy=policy, session=None, env=shown, stdin=stdin,
            timeout=timeout if timeout is not None else policy.limits.wall_time,
            output_limit=cap, result=result, error=error)
        record["files_produced"] = None  # not listed: the sandbox is gone
        log.write(record, secrets=shown.values())
        log.close()
