"""The sandbox side of a launch: what runs between clone and exec.

It runs in the freshly cloned child of the launch helper, already inside new user, mount, pid,
network, ipc, uts and cgroup namespaces. ``main`` lists the steps in order; each step is a small
function. A failing step writes ``{step, errno, message}`` to the error pipe and the child exits;
the pipe is close-on-exec, so end-of-file without a message means the exec happened.

Nothing here starts a thread or imports a module the helper has not already imported.
"""

from __future__ import annotations

import _signal
import fcntl
import json
import os
import resource
import select
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from nsbox._sys import libc as _libc
from nsbox._sys import wire as _wire
from nsbox._sys.wire import SetupErrorInfo, WirePlan
from nsbox.sandbox import diskfull
from nsbox.sandbox import netns as _netns
from nsbox.sandbox import terminal as _terminal
from nsbox.sandbox.mounts import NEWROOT, apply_mount, stage

CLOSE_RANGE_CLOEXEC = 4


class Context:
    def __init__(self, plan: WirePlan, sync_fd: int, err_fd: int,
                 source_fds: dict[int, int], cap_last: int, notify_fd: int = -1,
                 net_fd: int | None = None) -> None:
        self.plan = plan
        self.sync_fd = sync_fd
        self.err_fd = err_fd
        self.source_fds = source_fds  # mount index -> descriptor of the bind source
        self.root_fd = -1  # the new root while the mounts are made (stage)
        self.cap_last = cap_last
        self.notify_fd = notify_fd  # learning mode: a socket to hand the helper the listener
        self.net_fd = net_fd  # network allow mode: a socket to hand the helper the proxy listener
        # NSBOX_TRACE: (step, CLOCK_MONOTONIC ns) at the start of every step, sent to the helper
        # just before the exec (docs/performance.md, "Where the time goes").
        self.trace: list[tuple[str, int]] | None = [] if plan.get("trace") else None
        self._step = "start"
        self.capabilities_dropped = False  # a pooled sandbox drops them before it waits

    @property
    def step(self) -> str:
        return self._step

    @step.setter
    def step(self, name: str) -> None:
        self._step = name
        if self.trace is not None:
            self.trace.append((name, time.monotonic_ns()))


def main(ctx: Context) -> NoReturn:
    """One command: build the sandbox, then become the command."""
    try:
        build_sandbox(ctx)
        # A pooled sandbox waits here, fully built, for its one command (nsbox/launch/pool.py).
        command = await_command(ctx) if ctx.plan.get("pooled") else ctx.plan
        finish_and_exec(ctx, command)
    except OSError as exc:
        fail(ctx, exc.errno or 0, exc.strerror or str(exc))
    except Exception as exc:  # a bug in a step must still reach the user as a named failure
        fail(ctx, 0, f"{type(exc).__name__}: {exc}")


def build_sandbox(ctx: Context) -> None:
    """The steps that make the sandbox: identity, mounts, root, hostname, network.

    After this the process still holds the capabilities of its user namespace; a long-lived
    process (a session's init, a pooled sandbox) stops here and finishes per command.
    """
    ctx.step = "wait for id maps"
    wait_for_maps(ctx)
    ctx.step = "cgroup namespace"
    # The helper moved us into the run's cgroup before releasing us; a cgroup namespace made
    # now is rooted there, so the sandbox sees only its own cgroup as "/"
    # (cgroup_namespaces(7)). The one from clone was rooted at the helper's cgroup.
    _libc.unshare(_libc.CLONE_NEWCGROUP)
    ctx.step = "set identity"
    set_identity(ctx)
    ctx.step = "die with the launcher"
    die_with_launcher(ctx)
    ctx.step = "make mounts private"
    _libc.mount(None, "/", None, _libc.MS_REC | _libc.MS_PRIVATE)
    ctx.step = "mount tmpfs root"
    ctx.root_fd = stage()
    for index, op in enumerate(ctx.plan["mounts"]):
        ctx.step = f"{op['op']} {op['target']}"
        apply_mount(ctx.root_fd, op, ctx.source_fds.pop(index, None))
    os.close(ctx.root_fd)
    ctx.step = "pivot_root"
    enter_root()
    ctx.step = "remount root read-only"
    _libc.mount_setattr("/", _libc.MOUNT_ATTR_RDONLY, recursive=False)
    ctx.step = "hostname"
    _libc.sethostname(ctx.plan["hostname"])
    ctx.step = "network"
    net = ctx.plan["net"]
    _netns.setup_network(net.get("mode", "none"), net.get("proxy_port", 0), ctx.net_fd)


def finish_and_exec(ctx: Context, command: Mapping[str, Any]) -> NoReturn:
    """The per-command steps, in order, ending with seccomp (last) and the exec.

    ``command`` carries argv, env, cwd, rlimits and seccomp_bpf (the plan, for one command).
    """
    ctx.step = "rlimits"
    set_rlimits(command["rlimits"])
    ctx.step = "new session"
    os.setsid()
    ctx.step = "working directory"
    os.chdir(command["cwd"])
    if command.get("tty"):
        ctx.step = "terminal"
        _terminal.open_terminal(command["tty"])  # the slave replaces fds 0, 1 and 2
    ctx.step = "close file descriptors"
    # Everything but 0, 1, 2 closes at exec; the error pipe stays usable until then.
    _libc.close_range(3, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC)
    ctx.step = "drop capabilities"
    if not ctx.capabilities_dropped:
        _libc.drop_all_capabilities(ctx.cap_last)
    ctx.step = "no_new_privs"
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    ctx.step = "start init"
    start_init(ctx, bool(command.get("tty")))  # the command's process from here; pid 1 stays
    ctx.step = "seccomp"
    apply_setid_filter(ctx)
    if command["seccomp_bpf"]:
        apply_seccomp(ctx, command)
    ctx.step = "exec"
    if ctx.trace is not None:
        send_trace(ctx)
    execute(command["argv"], dict(command["env"]))


# --- the init: pid 1 of every run ----------------------------------------------------------------
#
# A normal host's pid 1 reaps orphans and a supervisor's signals reach the program it runs; a
# command that is itself pid 1 does neither: its orphans stay zombies (each counts against the
# pids limit) and the kernel drops every signal it has no handler for, even one it sends itself
# (pid_namespaces(7)). So pid 1 forks once more: the child finishes the launch and becomes the
# command; pid 1 reaps, forwards signals, and ends with the command's status.
#
# The command is forked, not spawned: posix_spawn (a vfork-like clone, no page tables to copy,
# nothing copied on write) would need the filter loaded in pid 1 before the spawn, so a profile
# whose filter is an allow-list would have to allow pid 1's clone, wait4 and kill to every
# command, and learning mode would report glibc's clone3 attempt on every run. Measured here,
# the spawn saved about 0.5 MB of peak memory per run, the launch time within the noise.
#
# pid 1 of a pid namespace cannot die of a signal it sends itself, so it cannot pass a signal
# death on by dying of it. It writes the command's wait status as one line on the error pipe,
# {"status": N}, then exits with the exit code a shell would show (128+N for signal N): the
# helper takes the line's status when pid 1 exited normally (read_report, command_status).

# What a supervisor sends: docker stop / systemd (TERM), a terminal (INT, QUIT, HUP, WINCH),
# USR1 and USR2 for reloads and dumps. As plain ints for _signal: the wrappers in the signal
# module turn every argument and result into an enum member, which costs the child far more
# than the system calls.
FORWARDED_SIGNALS = tuple(int(sig) for sig in (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
    signal.SIGUSR2, signal.SIGWINCH))
_SIGCHLD = int(signal.SIGCHLD)
_INIT_WAITS = (_SIGCHLD, *FORWARDED_SIGNALS)
_SIG_BLOCK = int(signal.SIG_BLOCK)


def start_init(ctx: Context, tty: bool = False) -> None:
    """Fork; return in the child, which goes on to become the command. pid 1 never returns.
    With ``tty``, the child takes the terminal on fd 0 as its controlling terminal."""
    # Blocked before the fork, so that none arrives before pid 1 waits for it; the child
    # unblocks them (reset_signals). A blocked signal is queued for pid 1 even without a
    # handler (kernel/signal.c, sig_ignored), and sigwaitinfo takes it.
    _signal.pthread_sigmask(_SIG_BLOCK, _INIT_WAITS)
    # Not dumpable before the command exists: the command (same uid) must never be able to
    # ptrace pid 1, which is outside the seccomp filter, nor read its memory or descriptors
    # (ptrace(2), "Ptrace access mode checking"). The uid change cleared the flag only where
    # it changed the uid (as root); launched unprivileged, the uid stays the same (prctl(2)).
    # The command's own process gets the flag back at exec.
    _libc.prctl(_libc.PR_SET_DUMPABLE, 0)
    _libc.set_name(b"nsbox-init")  # as ps shows pid 1: "python" otherwise (a helper's copy)
    # CLONE_VFORK: pid 1 sleeps until the child has exec'd (or failed). Meanwhile the child
    # runs alone on the CPU, and afterwards pid 1 writes to pages it no longer shares with
    # anyone: no page is copied twice (clone(2)). The memory is not shared (no CLONE_VM).
    pid = _libc.raw_clone(_SIGCHLD | _libc.CLONE_VFORK)
    if pid == 0:
        # Its own session and process group, as a command a shell starts: `kill 0` and a
        # terminal's job control reach the command's group, never pid 1.
        os.setsid()
        if tty:
            _terminal.take_as_controlling()
        reset_signals()
        return
    serve_as_init(ctx, pid)


def serve_as_init(ctx: Context, command_pid: int) -> NoReturn:
    """pid 1: no capability, not dumpable (both since before the fork), no descriptor but
    the error pipe."""
    ctx.step = "init"
    try:
        # The command's streams close here, so that a reader sees end-of-file when the command
        # and its children close theirs.
        _libc.close_range(0, ctx.err_fd - 1)
        _libc.close_range(ctx.err_fd + 1)
        status = wait_for_command(command_pid)
        full = json.dumps(diskfull.full_places()).encode()
        os.write(ctx.err_fd, b'\n{"status": %d, "full": %s}\n' % (status, full))
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    except Exception as exc:  # a bug here must not pass for the command's own failure
        fail(ctx, getattr(exc, "errno", None) or 0, f"{type(exc).__name__}: {exc}")


def wait_for_command(command_pid: int) -> int:
    """Reap every child until the command ends; pass the forwarded signals on to it.

    Returns the command's wait status. The processes still running then end with pid 1, as
    they did when the command was pid 1 itself.
    """
    while True:
        status = forward_or_reap(_signal.sigwaitinfo(_INIT_WAITS).si_signo, command_pid)
        if status is not None:
            return status


def forward_or_reap(signo: int, command_pid: int) -> int | None:
    """One signal an init waited for (this one, and the Landlock mode's in landlocked.py): a
    forwarded signal goes on to the command; SIGCHLD reaps every child that has ended. The
    command's wait status once it has ended, else None."""
    if signo != _SIGCHLD:
        try:
            os.kill(command_pid, signo)
        except ProcessLookupError:
            pass  # it has just ended: its SIGCHLD is queued
        return None
    while True:  # SIGCHLD does not queue: one may stand for many exits
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == command_pid:
            return status


def read_report(data: bytes) -> tuple[list[Any], SetupErrorInfo | None, int | None]:
    """The error pipe of a launch: (trace, error report, the command's wait status).

    Each writer writes JSON without a raw newline inside and lines apart: the command's process
    the trace before exec (send_trace) or an error report (fail), pid 1 the status last.
    """
    trace: list[Any] = []
    error: SetupErrorInfo | None = None
    status: int | None = None
    for line in data.split(b"\n"):
        if not line:
            continue
        record = json.loads(line)
        if "trace" in record:
            trace = record["trace"]
        elif "status" in record:
            status = int(record["status"])
        else:
            error = record
    return trace, error, status


def command_status(init_status: int, reported: int | None) -> int:
    """The run's wait status: the command's as pid 1 reported it, unless pid 1 did not exit of
    its own accord (the helper killed the sandbox: timeout, output limit, caller gone)."""
    if reported is not None and os.WIFEXITED(init_status):
        return reported
    return init_status


# The bytes of a step name or a message that a report carries: a longer one is cut on a
# character boundary and ends in "...", as the native core cuts it (nsbox/native/child.h,
# REPORT_TEXT_MAX), so that both cores report the same failure the same way and a report
# stays small whatever the plan's names.
REPORT_TEXT_MAX = 4096


def cut_text(text: str) -> str:
    """``text`` within REPORT_TEXT_MAX bytes of UTF-8, cut where a character starts."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= REPORT_TEXT_MAX:
        return text
    end = REPORT_TEXT_MAX
    for _ in range(3):  # a character has at most 3 continuation bytes (RFC 3629)
        if data[end] & 0xC0 != 0x80:
            break
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass") + "..."


def fail(ctx: Context, errno: int, message: str) -> NoReturn:
    report = json.dumps({"step": cut_text(ctx.step), "errno": errno,
                         "message": cut_text(message)}).encode()
    try:
        os.write(ctx.err_fd, report)
    finally:
        os._exit(127)


def send_trace(ctx: Context) -> None:
    # One line before any error report on the same close-on-exec pipe (read_report).
    assert ctx.trace is not None
    trace = [(cut_text(name), at) for name, at in ctx.trace]
    data = json.dumps({"trace": trace}).encode() + b"\n"
    view = memoryview(data)
    while view:  # a long one takes more than one write
        view = view[os.write(ctx.err_fd, view):]


def take_streams(fds: Sequence[int]) -> None:
    """Make ``fds`` the standard streams 0, 1 and 2, open across exec, and close them (unless
    one of them is a standard stream itself). As nsbox/native/child.c, take_streams."""
    sources = list(fds)
    for target, fd in enumerate(sources):
        if fd < 3 and fd != target:
            # It would be overwritten by an earlier dup2 (as _posixsubprocess moves it too).
            sources[target] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    for target, fd in enumerate(sources):
        if fd == target:
            # dup2 onto itself does nothing: the stream would stay close-on-exec (they arrive
            # so, MSG_CMSG_CLOEXEC) and the command would start without it.
            os.set_inheritable(fd, True)
        else:
            os.dup2(fd, target)
    for fd in set(sources):
        if fd > 2:
            os.close(fd)


def await_command(ctx: Context) -> dict[str, Any]:
    """A pooled sandbox: report ready on the command socket (fd 0), then take one command.

    The command arrives with its stdin, stdout and stderr (SCM_RIGHTS), which replace the
    socket as fds 0-2; the socket is gone before the command's first step.
    """
    # Nothing that follows needs a capability: they go now, off the command's path (earlier is
    # no weaker; rlimits are only lowered, which needs none).
    ctx.step = "drop capabilities"
    _libc.drop_all_capabilities(ctx.cap_last)
    ctx.capabilities_dropped = True
    ctx.step = "no_new_privs"
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    ctx.step = "wait for command"
    sock = socket.socket(fileno=0)
    sock.send(b"ready")
    msg, fds = _wire.receive(sock, 3)  # a command of any size (nsbox/_sys/wire.py)
    if not msg or len(fds) != 3:
        raise OSError(0, "the pool closed before this sandbox got a command")
    sock.detach()
    take_streams(fds)
    command: dict[str, Any] = json.loads(msg)
    if ctx.trace is not None:
        ctx.trace.clear()  # the command's trace starts when it arrives
        ctx.step = "command received"
    return command


def keep_only(keep: set[int]) -> None:
    """Close every descriptor inherited from the helper but those in ``keep``.

    A pooled sandbox lives on while the helper serves other launches; it must not hold their
    pipes (a held pipe end would keep another caller waiting for end-of-file).
    """
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory's own descriptor, closed by now


def wait_for_maps(ctx: Context) -> None:
    """The helper writes uid_map/gid_map, then one byte; EOF means the helper is gone."""
    if os.read(ctx.sync_fd, 1) != b"1":
        raise OSError(0, "the launch helper went away before the sandbox was set up")


def set_identity(ctx: Context) -> None:
    # The capabilities of the new user namespace survive: the kernel only clears them when
    # leaving uid 0 of that namespace, and 0 is not mapped in it (capabilities(7)).
    gid, uid = ctx.plan["gid"], ctx.plan["uid"]
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    os.umask(0o022)


def die_with_launcher(ctx: Context) -> None:
    # Set after the uid change, which clears the parent-death signal (prctl(2)). The helper
    # holds the sync pipe open while it lives: a hang-up there means it died before this line.
    _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    poller = select.poll()
    poller.register(ctx.sync_fd, select.POLLIN)
    for _fd, events in poller.poll(0):
        if events & (select.POLLHUP | select.POLLERR):
            raise OSError(0, "the launch helper went away before the sandbox was set up")


def enter_root() -> None:
    # pivot_root(".", ".") stacks the staging root (with the host's root below /oldroot) on
    # the new one; detaching it leaves only the new root (pivot_root(2), NOTES).
    os.chdir(NEWROOT)
    _libc.pivot_root(".", ".")
    _libc.umount2(".", _libc.MNT_DETACH)
    os.chdir("/")


def set_rlimits(rlimits: list[list[int]]) -> None:
    # No core dumps: a dump would write the sandbox's memory where the host decides.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for res, soft, hard in rlimits:
        resource.setrlimit(res, (soft, hard))


# The command starts with every signal at its default and none blocked, whatever the launcher
# left ignored: ignored signals stay ignored across fork and exec (signal(7)), and a shell's
# background job arrives with SIGINT and SIGQUIT ignored, nohup with SIGHUP, Python with SIGPIPE
# and SIGXFSZ, the helper with SIGINT. Only an ignored signal needs it (exec puts a caught one
# back to SIG_DFL), and the child inherits the helper's: the helper notes which it ignores when
# it starts (note_ignored_signals), so that a launch makes a few system calls, not 62 (80 us in
# C, 0.7 ms through ctypes here). Until noted, every signal is reset (nsbox/native/child.c,
# reset_signals, reads the same mask from its plan).
_SIG_SETMASK = int(signal.SIG_SETMASK)
_ALWAYS_RESET = sum(1 << (int(sig) - 1) for sig in (signal.SIGPIPE, signal.SIGXFSZ,
                                                    signal.SIGINT))
ignored_signals = _libc.ALL_SIGNALS


def note_ignored_signals() -> None:
    """In the helper, once its own dispositions are set: the signals every child resets."""
    global ignored_signals
    ignored_signals = _libc.ignored_signals() | _ALWAYS_RESET


def reset_signals() -> None:
    _libc.default_signals(ignored_signals)
    _signal.pthread_sigmask(_SIG_SETMASK, ())


def apply_setid_filter(ctx: Context) -> None:
    """The set-id filter goes into every sandbox, before the policy's (nsbox/host/seccomp_rules.py):
    a plan without it does not run."""
    bpf = ctx.plan.get("setid_bpf")
    if not bpf:
        raise OSError(22, "the plan has no set-id filter (plan.build makes one)")
    _libc.seccomp_set_filter(bytes.fromhex(bpf))


def apply_seccomp(ctx: Context, command: Mapping[str, Any]) -> None:
    """The last step before exec. Any failure stops the launch (fail closed)."""
    bpf = bytes.fromhex(command["seccomp_bpf"])
    if not command.get("seccomp_notify"):
        _libc.seccomp_set_filter(bpf)
        return
    # Learning mode: the listener goes to the helper and never reaches the sandbox, which could
    # otherwise answer its own notifications with "continue" (seccomp_unotify(2)).
    listener = _libc.seccomp_set_filter(bpf, _libc.SECCOMP_FILTER_FLAG_NEW_LISTENER)
    try:
        socket.send_fds(socket.socket(fileno=ctx.notify_fd), [b"l"], [listener])
    finally:
        os.close(listener)


def execute(argv: list[str], env: dict[str, str]) -> NoReturn:
    name = argv[0]
    if "/" in name:
        os.execve(name, argv, env)
    denied: OSError | None = None
    for directory in env.get("PATH", "/usr/bin:/bin").split(":"):
        candidate = os.path.join(directory or ".", name)
        try:
            os.execve(candidate, argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as exc:
            denied = exc
    if denied is not None:
        raise denied
    raise FileNotFoundError(2, f"command not found inside the sandbox: {name}")
