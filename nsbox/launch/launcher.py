"""The host side of a launch: ``launch`` builds the plan, hands it with the standard streams to the
launch engine or helper (nsbox/helper/loop.py has the protocol), collects output up to the cap
in the calling thread and makes the report a Result. Safe from many threads at once."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import socket
import sys
import threading
import time
from typing import Any

from nsbox import cgroups, errors
from nsbox._sys import wire as _wire
from nsbox.errors import CommandNotFound, HostError, LaunchError, PolicyError, SetupError
from nsbox.host import engine, isolation
from nsbox.host.launchprocess import LaunchProcess, enable_cgroups
from nsbox.host.network import RunNetwork
from nsbox.host.output import (  # noqa: F401 (Stream, send_kill: sessions use them from here)
    HOST_GRACE,
    Cancel,
    Stream,
    out_of_descriptors,
    send_kill,
    supervise,
)
from nsbox.launch import stdin as stdinmod
from nsbox.plan import landlock as landlockplan
from nsbox.plan import plan as planmod
from nsbox.policy import inputs, limits
from nsbox.policy.policy import Network, Policy
from nsbox.result import Result, Status


def _helper_environment() -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin"}
    if os.environ.get("NSBOX_NATIVE") == "0":
        env["NSBOX_NATIVE"] = "0"  # no native spawners either (nsbox/helper/spawner.py)
    return env


class _HelperClient(LaunchProcess):
    """One launch helper per host process, started on first use, restarted if it died."""

    def __init__(self) -> None:
        super().__init__()
        self.fork = False  # use_forked_helper()
        self._reap_registered = False

    def _start(self) -> socket.socket:
        if self.fork and threading.active_count() == 1:
            from nsbox.helper.fork import fork_helper

            sock, self.pid = fork_helper()
            return sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nsbox/launch/..
        paths = [os.path.dirname(package), *cgroups.helper_paths()]  # cgroupspy, for cgroup v1
        # The package is entered without its __init__ (the public API, dataclasses, hashlib):
        # the helper needs only its own modules, and every sandbox is a clone of its memory.
        boot = (f"import sys, types; sys.path[:0] = {paths!r}; "
                "pkg = sys.modules['nsbox'] = types.ModuleType('nsbox'); "
                f"pkg.__path__ = [{package!r}]; "
                "from nsbox.helper.loop import main; main()")
        python = sys.executable or "/usr/bin/python3"
        try:
            self.pid = os.posix_spawn(
                python, [python, "-I", "-S", "-c", boot, "3"], _helper_environment(),
                file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)],
                setsid=True,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start the launch helper with {python}: {exc}") from None
        finally:
            theirs.close()
        return ours

    def adopt(self, sock: socket.socket, pid: int) -> None:
        """Use a helper already started (the command line forks one at its very start)."""
        with self._lock:
            self._sock, self.pid = sock, pid

    def submit(self, wire_plan: dict[str, Any], fds: list[int]) -> None:
        self.send_request({"plan": wire_plan}, fds)

    def send_request(self, request: dict[str, Any], fds: list[int]) -> None:
        plan = request.get("plan") or request.get("pool", {}).get("plan") or {}
        # What stops the helper's cgroup v2 setup, it finds again and reports as degraded.
        enable_cgroups(plan.get("cgroup") or {})
        with self._lock:
            try:
                sock = self._running()
            except OSError as exc:  # socketpair: EMFILE
                raise out_of_descriptors("cannot start the launch helper", exc) from None
            try:
                _wire.send(sock, request, fds)  # a plan of any size (nsbox/_sys/wire.py)
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    # This request could not be sent (EMFILE for its memfd, ENOBUFS): the
                    # helper and the runs it serves for other threads go on.
                    raise out_of_descriptors("cannot send the launch request", exc) from None
                sock.close()
                self._sock = None
                raise LaunchError(f"the launch helper is gone: {exc}") from None

    def reap_at_exit(self) -> None:
        """The command line waits for its helper before it exits: left to init, each call
        would leave a zombie under a pid 1 that does not reap."""
        if not self._reap_registered:
            self._reap_registered = True
            atexit.register(self.stop)

    def stop(self) -> None:
        """End the helper and reap it (the command line, before it exits): every sandbox it
        still runs is killed first (end-of-file on its control socket)."""
        engine.client.stop()  # the launch engine's sandboxes too (nsbox/host/engine.py)
        super().stop()


helper_client = _HelperClient()


def use_forked_helper() -> None:
    """Start the helper by forking this process rather than as a new interpreter (about
    20 ms sooner). Only for a small process that stays single-threaded until then, such as the
    command line: a clone of a big process costs every launch more."""
    helper_client.fork = True
    helper_client.reap_at_exit()


def choose_policy(policy: Policy | None, profile: str | None) -> Policy:
    """The policy given, or the one the profile names, or the default; never both."""
    inputs.policy(policy)
    if profile is not None:
        profile = inputs.path(profile, "profile")
    if profile is None:
        return policy or Policy()
    if policy is not None:
        raise PolicyError("give a policy or a profile, not both", key="profile")
    from nsbox.profiles import load_profile

    return load_profile(profile)


def launch(cmd: inputs.Command, policy: Policy, *, passthrough: bool = False,
           cancel: Cancel | None = None, tty: tuple[int, int] | None = None) -> Result:
    """One command in a new sandbox of ``policy``, and its Result: the launch behind
    ``nsbox.run``, whose door (nsbox/api.py) has checked every argument once
    (nsbox/policy/inputs.py) and set the workspace in the policy.

    With ``passthrough`` the output goes to this process's stdout/stderr as it arrives (still
    capped) instead of into the Result; ``cancel`` lets another thread kill the run; ``tty``
    (rows, columns) gives it a pty of its own, the master sent over the stdin descriptor (a
    unix socket: nsbox/host/terminal.py). Raises SetupError when the sandbox cannot be built
    (CommandNotFound when the command does not exist inside it).
    """
    trace = trace_start()
    cap = cmd.output_limit if cmd.output_limit is not None else policy.limits.output

    def attempt() -> Result:
        plan = build_plan(policy, cmd.argv, env=cmd.env, cwd=cmd.cwd, wall_time=cmd.timeout)
        wire = plan.to_wire()
        wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid)
        if tty is not None:
            wire["tty"] = list(tty)
        return launch_wire(wire, cmd.stdin, cap, passthrough, RunNetwork(policy.network),
                           trace=trace, cancel=cancel)

    result = isolation.with_fallback(policy, attempt)
    limits.note_disk(result, policy.workspace, policy.limits.workspace_size)
    return result


def build_plan(policy: Policy, argv: list[str], *, mode: str | None = None,
               **kwargs: Any) -> planmod.Plan:
    """``plan.build`` (or the Landlock mode's, for ``mode`` or the mode the policy gets now),
    with a failure of the host (a path it may not resolve, no descriptor left for the seccomp
    program's memfd) as a SetupError that names it."""
    mode = mode or isolation.mode_for(policy)
    build = landlockplan.build if mode == isolation.LANDLOCK else planmod.build
    try:
        return build(policy, argv, **kwargs)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        message = f"{exc.strerror or exc}{where}"
        out = exc.errno in (errno.EMFILE, errno.ENFILE)
        if not out and _descriptors_exhausted():
            # Some libraries hide EMFILE behind an error of their own (tempfile, which the
            # seccomp compiler's library lookup uses: "No usable temporary directory").
            out = True
            message += " (this process is out of descriptors: Too many open files)"
        error = SetupError("prepare", exc.errno or 0, message)
        if out:
            error.hint = out_of_descriptors("", OSError(errno.EMFILE, "")).hint
        raise error from None


def _descriptors_exhausted() -> bool:
    """Whether this process cannot open one more descriptor right now."""
    try:
        os.close(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


# --- NSBOX_TRACE=1: where the time of a launch goes (docs/performance.md) ----------------------


def trace_start() -> list[tuple[str, int]] | None:
    if os.environ.get("NSBOX_TRACE") != "1":
        return None
    return [("host: build plan", time.monotonic_ns())]


def _trace_steps(events: list[Any]) -> list[dict[str, Any]]:
    """Host, helper and child events (name, CLOCK_MONOTONIC ns) as one timeline: each step
    lasts until the next event, in whichever process that happens."""
    events = sorted(events, key=lambda event: event[1])
    origin = events[0][1]
    return [{"step": name, "at_ms": round((at - origin) / 1e6, 4),
             "ms": round((events[i + 1][1] - at) / 1e6, 4) if i + 1 < len(events) else 0.0}
            for i, (name, at) in enumerate(events)]


# -----------------------------------------------------------------------------------------------


def launch_wire(wire: dict[str, Any], stdin: bytes | int | None, cap: int, passthrough: bool,
                net: RunNetwork | None = None, *, submit: Any = None,
                trace: list[tuple[str, int]] | None = None, cancel: Cancel | None = None) -> Result:
    """One launch through ``submit(wire, fds)``: the helper (run) or a pool (Pool.run)."""
    started = time.monotonic()
    net = net or RunNetwork(Network())
    if os.environ.get("NSBOX_NATIVE") == "0":
        wire["native"] = False  # the helper's environment is not the caller's
    if trace is not None:
        wire["trace"] = True
        trace.append(("host: send to helper", time.monotonic_ns()))
    by_engine = None if submit else engine.submission(wire)  # nsbox/host/engine.py: which
    submit = submit or by_engine or helper_client.submit
    try:
        out_r, err_r, ours = submit_with_streams(submit, wire, stdin,
                                                 terminal="tty" in wire)
    except BaseException:
        net.close()
        raise
    streams = [Stream(out_r, 1 if passthrough else None),
               Stream(err_r, 2 if passthrough else None)]
    if trace is not None:
        trace.append(("host: wait for the report", time.monotonic_ns()))
    with ours:
        if cancel is not None:
            cancel.attach(ours)
        try:
            report, pid = supervise(ours, streams, cap, net, wall_time=wire.get("wall_time"))
            report = by_engine.report(report) if by_engine else report
        finally:
            if cancel is not None:
                cancel.detach()
            net.close()  # the proxy ends with the run, whatever happened
            if by_engine is not None:
                by_engine.close()
    if trace is not None:
        trace.append(("host: report received, build result", time.monotonic_ns()))
    try:
        result = result_from(report, pid, streams, cap, time.monotonic() - started)
        landlockplan.mark_result(result, wire)
    except SetupError as exc:
        if exc.step != "working directory":
            raise
        # The child's chdir reports the errno alone: name the directory (--cwd).
        raise SetupError(exc.step, exc.errno, f"{inputs.quote(wire.get('cwd'))}: {exc.message}",
                         hint="the working directory must exist inside the sandbox, e.g. "
                         "/workspace, /tmp or a bind's target") from None
    net_report = net.report()
    if net_report is not None:
        result.extra["network"] = net_report
    if trace is not None:
        trace.append(("host: done", time.monotonic_ns()))
        result.extra["trace"] = _trace_steps([*trace, *report.get("trace", [])])
    return result


def submit_with_streams(submit: Any, wire: dict[str, Any], stdin: bytes | int | None, *,
                        terminal: bool = False) -> tuple[int, int, socket.socket]:
    """Open the run's pipes and launch socket and submit the request with the helper's ends
    (closed here once sent). Returns our ends; on any failure nothing stays open.

    With ``terminal`` (a run on a pty) ``stdin`` is nsbox's own unix socket, over which the
    sandbox sends its pty's master back (nsbox/host/terminal.py Relay): it goes as it is, and
    the command's stdin is the pty."""
    with contextlib.ExitStack() as ours, contextlib.ExitStack() as theirs:
        try:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            ours.callback(os.close, out_r)
            theirs.callback(os.close, out_w)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            ours.callback(os.close, err_r)
            theirs.callback(os.close, err_w)
            if terminal and isinstance(stdin, int):
                in_fd, close_in = stdin, False
            else:
                in_fd, close_in = stdinmod.sandbox_stdin(stdin)  # a pump's pipe: closed below
            if close_in:
                theirs.callback(os.close, in_fd)
            sock, their_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.callback(sock.close)
            theirs.callback(their_sock.close)
        except OSError as exc:
            raise out_of_descriptors("cannot open the run's pipes", exc) from None
        submit(wire, [their_sock.fileno(), in_fd, out_w, err_w])
        ours.pop_all()  # the caller owns them now
    return out_r, err_r, sock


_HINTS = {
    ("create namespaces", errno.EPERM): "this host does not allow unprivileged user "
    "namespaces; run `nsbox doctor` for the setting to change (kernel.unprivileged_userns_clone, "
    "user.max_user_namespaces, or AppArmor's apparmor_restrict_unprivileged_userns)",
    ("create namespaces", errno.ENOSPC): "the user namespace limit is reached "
    "(user.max_user_namespaces); `nsbox doctor` shows the setting",
    ("create namespaces", errno.ENOSYS): "unshare(2) is refused with ENOSYS: a seccomp "
    "filter around nsbox (a container's) blocks it; run the container with --security-opt "
    "seccomp=unconfined",
    ("pivot_root", errno.EINVAL): "pivot_root is refused: nsbox may be running in a container "
    "or chroot whose root is not a mount point",
    ("exec", errno.EACCES): "the file is not executable inside the sandbox",
    ("seccomp", errno.EINVAL): "the kernel refuses the seccomp program: it needs "
    "CONFIG_SECCOMP_FILTER (and SECCOMP_RET_USER_NOTIF, Linux 5.0, for --seccomp-log)",
    ("seccomp", errno.EBUSY): "--seccomp-log cannot be used here: nsbox already runs under a "
    "seccomp filter with a listener (nested in another sandbox); run without it",
}


def _read_proc(name: str) -> str:
    try:
        with open(name) as f:
            return f.read()
    except OSError:
        return ""


def namespace_hint(err: int) -> str | None:
    """Why unshare(2) failed, from what the host says now: disabled user namespaces, or a
    seccomp filter around this process (a container's) that refuses unshare."""
    if err == errno.ENOSPC and _read_proc("/proc/sys/user/max_user_namespaces").strip() == "0":
        return ("user namespaces are disabled (user.max_user_namespaces is 0): sysctl -w "
                "user.max_user_namespaces=15000 (and set it in /etc/sysctl.d/)")
    if err in (errno.EPERM, errno.ENOSYS) and os.geteuid() == 0:
        status = _read_proc("/proc/self/status")
        if "\nSeccomp:\t2" in status:
            return ("root may create namespaces, so the seccomp filter this process runs under "
                    "(a container's) refuses unshare(2): run the container with "
                    "--security-opt seccomp=unconfined")
    return None


def setup_error_from(info: _wire.SetupErrorInfo) -> SetupError:
    step, err, message = info["step"], int(info.get("errno") or 0), info["message"]
    hint = _HINTS.get((step, err))
    if step == "create namespaces":
        hint = namespace_hint(err) or hint
    if step == "proc /proc" and err == errno.EPERM:
        # proc(5), fs/namespace.c mount_too_revealing: a new proc is refused in a user
        # namespace while parts of the current /proc are covered (a container's masked paths).
        hint = ("the kernel refuses a new /proc while parts of this /proc are covered by "
                "other mounts (a container's masked paths): run the container with "
                "--security-opt systempaths=unconfined")
    if step.startswith("bind ") and err == errno.EPERM and "open_tree" in message:
        hint = ("opening the bind source needs CAP_SYS_ADMIN, which this process lacks (a "
                "container's default capability set): give it --cap-add SYS_ADMIN, or run "
                "nsbox as a regular user")
    if step == "exec" and err == errno.ENOENT:
        return CommandNotFound(step, err, message, hint=(
            "the sandbox sees only /usr and the profile's binds; use an absolute path, or "
            "bind the program's directory with --ro-bind"))
    if step == "exec" and err == errno.EACCES:
        return errors.CommandNotExecutable(step, err, message, hint=hint)
    if err in (errno.EMFILE, errno.ENFILE):
        hint = ("the launch helper ran out of descriptors (it has this process's ulimit -n): "
                "run fewer sandboxes at once, or raise the limit")
    if step.startswith("bind ") and err in (errno.ENOENT, errno.EACCES):
        hint = "check that the bind source exists and that you can read it"
    if step.startswith("bind ") and "mount_setattr" in message:
        hint = ("as root, a writable bind needs a filesystem with idmapped mounts (ext4, xfs, "
                "btrfs, tmpfs); or run nsbox as a regular user")
    return SetupError(step, err, message, hint=hint)


def result_from(report: dict[str, Any], pid: int, streams: list[Stream], cap: int,
                wall: float) -> Result:
    if report.get("setup_error"):
        raise setup_error_from(report["setup_error"])
    if report.get("host_error"):
        info = report["host_error"]
        raise HostError(info["message"], feature=info["feature"], hint=info.get("hint"))
    code = os.waitstatus_to_exitcode(report["wait_status"])
    out, err = streams
    result = Result(
        status=Status.OK,
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        wall_time=report["wall_time"],
        cpu_user=report["cpu_user"],
        cpu_system=report["cpu_system"],
        peak_memory=report["maxrss_kib"] * 1024,
        stdout=bytes(out.kept),
        stderr=bytes(err.kept),
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=report["timed_out"],
    )
    result.extra["pid"] = pid
    result.disk_full = [str(place) for place in report.get("disk_full") or []]
    if report.get("core"):
        result.extra["core"] = report["core"]
    if report.get("seccomp_denied") is not None:
        result.extra["seccomp_denied"] = report["seccomp_denied"]
    if report["timed_out"]:
        result.status = Status.TO
    elif report["kill_reason"] == "output" or out.truncated or err.truncated:
        # Also when the command ended before the kill for its output arrived: what it wrote
        # was cut all the same.
        result.status = Status.OL
    elif result.signal is not None:
        result.status = Status.SG
    elif code != 0:
        result.status = Status.RE
    # cgroup accounting, ML for an OOM kill, TO for the CPU-time limit, degraded limits.
    outcome = report.get("limits") or {}
    limits.apply_outcome(result, outcome)
    for key in ("usage_error", "cleanup_error"):
        if outcome.get(key):
            result.extra[f"cgroup_{key}"] = outcome[key]
    return result
