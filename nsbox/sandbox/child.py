"""The sandbox side of a launch: what runs between clone and exec.

It runs in the freshly cloned child of the launch helper, already inside new user, mount, pid,
network, ipc, uts and cgroup namespaces. ``main`` lists the steps in order; each step is a small
function. A failing step writes ``{step, errno, message}`` to the error pipe and the child exits;
the pipe is close-on-exec, so end-of-file without a message means the exec happened.

Nothing here starts a thread or imports a module the helper has not already imported.
"""

from __future__ import annotations

import _signal
import json
import os
import resource
import select
import signal
import socket
import stat
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from nsbox import _libc, _wire
from nsbox._wire import SetupErrorInfo, WirePlan
from nsbox.sandbox import netns as _netns

# The staging tmpfs is mounted over /tmp (privately, in the new mount namespace) and becomes the
# root; the host's root stays reachable under /oldroot until the final pivot, and the sandbox's
# root is built under /newroot.
STAGING = "/tmp"
OLDROOT = "/oldroot"
NEWROOT = "/newroot"
# New mounts (tmpfs, /dev, /proc) are made here, where nothing but this process can reach, then
# moved onto their target's descriptor: no name below the new root is looked up for them.
BUILD = "/build"
EMPTY = "/empty"  # an empty directory, bound read-only over parts of /proc (mask_host_files)
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
        # A pooled sandbox waits here, fully built, for its one command (nsbox/pool.py).
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
        apply_mount(ctx, index, op)
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
    ctx.step = "close file descriptors"
    # Everything but 0, 1, 2 closes at exec; the error pipe stays usable until then.
    _libc.close_range(3, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC)
    ctx.step = "drop capabilities"
    if not ctx.capabilities_dropped:
        _libc.drop_all_capabilities(ctx.cap_last)
    ctx.step = "no_new_privs"
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    ctx.step = "start init"
    start_init(ctx)  # from here on, the command's process; pid 1 stays behind as its init
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
# USR1 and USR2 for reloads and dumps. As plain ints for _signal (see _RESET_SIGNALS).
FORWARDED_SIGNALS = tuple(int(sig) for sig in (
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
    signal.SIGUSR2, signal.SIGWINCH))
_SIGCHLD = int(signal.SIGCHLD)
_INIT_WAITS = (_SIGCHLD, *FORWARDED_SIGNALS)
_SIG_BLOCK = int(signal.SIG_BLOCK)


def start_init(ctx: Context) -> None:
    """Fork; return in the child, which goes on to become the command. pid 1 never returns."""
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
        os.write(ctx.err_fd, b'\n{"status": %d}\n' % status)
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
        signo = _signal.sigwaitinfo(_INIT_WAITS).si_signo
        if signo != _SIGCHLD:
            try:
                os.kill(command_pid, signo)
            except ProcessLookupError:
                pass  # it has just ended: its SIGCHLD is queued
            continue
        while True:  # SIGCHLD does not queue: one may stand for many exits
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
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


def fail(ctx: Context, errno: int, message: str) -> NoReturn:
    report = json.dumps({"step": ctx.step, "errno": errno, "message": message}).encode()
    try:
        os.write(ctx.err_fd, report)
    finally:
        os._exit(127)


def send_trace(ctx: Context) -> None:
    # One line before any error report on the same close-on-exec pipe (read_report).
    assert ctx.trace is not None
    os.write(ctx.err_fd, json.dumps({"trace": ctx.trace}).encode() + b"\n")


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
    msg, fds = _wire.receive(sock, 3)  # a command of any size (nsbox/_wire.py)
    if not msg or len(fds) != 3:
        raise OSError(0, "the pool closed before this sandbox got a command")
    sock.detach()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
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


# --- mount targets ---------------------------------------------------------------------------
#
# A target may lie below a bind whose host directory another sandbox writes to at this very
# moment, swapping a directory for a symlink in a loop. Looked up by name, such a target could
# lead anywhere on the host. So every target is reached from a descriptor of the new root, one
# directory descriptor at a time, and no symlink is followed at any component (openat2(2) with
# RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH; a walk with O_NOFOLLOW where openat2 is missing).
# Directories and files are made relative to their parent's descriptor, and mounts go onto the
# descriptor itself (move_mount(2) with MOVE_MOUNT_T_EMPTY_PATH). A concurrent rename can then
# only fail the launch, never redirect it.

_RESOLVE = _libc.RESOLVE_NO_SYMLINKS | _libc.RESOLVE_BENEATH
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NODE = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def stage() -> int:
    """The staging root, with the host's root under /oldroot; a descriptor of the new root."""
    mount_tmpfs(STAGING, 1024 * 1024, 0o755)
    os.mkdir(STAGING + OLDROOT)
    os.mkdir(STAGING + NEWROOT)
    os.mkdir(STAGING + BUILD)
    os.mkdir(STAGING + EMPTY, 0o555)
    _libc.pivot_root(STAGING, STAGING + OLDROOT)
    os.chdir("/")
    mount_tmpfs(NEWROOT, 4 * 1024 * 1024, 0o755)
    return os.open(NEWROOT, _DIR)


def mount_tmpfs(target: str, size: int, mode: int) -> None:
    # ``target``: a fixed place of the staging tmpfs (never below the new root).
    _libc.mount("tmpfs", target, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV,
                f"size={size},mode={mode:o}")


def _components(path: str) -> list[str]:
    parts = path[1:].split("/")
    # The plan normalizes targets (plan.check_target); this is the child's own guard.
    if path[:1] != "/" or "" in parts or "." in parts or ".." in parts:
        raise OSError(22, f"mount target {path} is not a normalized absolute path")
    return parts


def _not_a_directory(fd: int, name: str, path: str) -> OSError:
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        what = "a symlink"
    elif mode and not stat.S_ISDIR(mode):
        what = "not a directory"
    else:
        what = "a symlink or not a directory (it changed meanwhile)"
    return OSError(20, f"{name} in mount target {path} is {what}: nsbox follows no symlink "
                       "in a mount target and makes no directory in place of a file")


def _open_dir(fd: int, name: str, path: str) -> int:
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (20, 40):  # ENOTDIR, ELOOP
            raise _not_a_directory(fd, name, path) from None
        raise


def open_dir(root: int, path: str, mode: int = 0o777, target: str = "") -> int:
    """An O_PATH descriptor of directory ``path`` of the new root, made (with its parents)
    where missing, with no symlink followed on the way. Errors name ``target`` (the mount
    target ``path`` leads to) or ``path``."""
    parts = _components(path)
    shown = target or path
    if _libc.HAS_OPENAT2 and len(parts) > 1:
        # A deep directory that is there: one call for the whole path. (One level down,
        # openat with O_NOFOLLOW is the same thing.) Otherwise the walk below makes what is
        # missing, or names the component that is in the way.
        fd = _libc.try_openat2(root, path[1:], _DIR, _RESOLVE)
        if fd >= 0:
            return fd
    fd = root
    try:
        for index, name in enumerate(parts):
            try:
                next_fd = _open_dir(fd, name, shown)
            except FileNotFoundError:
                try:
                    os.mkdir(name, mode if index == len(parts) - 1 else 0o777, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened below like any other
                next_fd = _open_dir(fd, name, shown)
            if fd != root:
                os.close(fd)
            fd = next_fd
    except BaseException:
        if fd != root:
            os.close(fd)
        raise
    return fd


def open_parent(root: int, path: str) -> tuple[int, str]:
    """A descriptor of the directory that holds ``path`` (made if missing), and its name.

    The descriptor is ``root`` itself for a target at the top: close it with ``release``."""
    parent, _, name = path.rpartition("/")
    _components(path)
    return (root if not parent else open_dir(root, parent, target=path)), name


def release(fd: int, root: int) -> None:
    if fd != root:
        os.close(fd)


def open_mountpoint(root: int, path: str, is_dir: bool) -> int:
    """An O_PATH descriptor of the place a mount goes: a directory, or a file for a file bind,
    made if missing. A symlink there is refused, never followed."""
    if is_dir:
        return open_dir(root, path)
    parent, name = open_parent(root, path)
    try:
        try:
            # A new file: its own descriptor is the mount's target.
            return os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                           | os.O_CLOEXEC, 0o644, dir_fd=parent)
        except FileExistsError:
            pass
        fd = os.open(name, _NODE, dir_fd=parent)
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
            os.close(fd)
            what = "directory" if stat.S_ISDIR(mode) else "symlink"
            raise OSError(21 if stat.S_ISDIR(mode) else 40,
                          f"mount target {path} is a {what} where a file is bound")
        return fd
    finally:
        release(parent, root)


def write_file(root: int, path: str, content: str, mode: int) -> None:
    """``File``: made new, or an existing regular file rewritten, always through its descriptor."""
    parent, name = open_parent(root, path)
    try:
        try:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode, dir_fd=parent)
        except FileExistsError:
            fd = _open_existing_file(parent, name, path)
    finally:
        release(parent, root)
    try:
        data = memoryview(content.encode())
        while data:
            data = data[os.write(fd, data):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _open_existing_file(parent: int, name: str, path: str) -> int:
    refused = OSError(17, f"{path} exists and is not a plain file of its own (a directory, a "
                          "device, a FIFO, a socket or a hard link): not written")
    try:
        # O_NONBLOCK: a FIFO put here must not hang the launch; it is refused below.
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError as exc:
        if exc.errno in (6, 21):  # ENXIO: a FIFO without a reader, a socket; EISDIR
            raise refused from None
        raise
    st = os.fstat(fd)
    # A second name of the file (a hard link) could lead the write out of the tree.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise refused
    os.ftruncate(fd, 0)
    return fd


def apply_mount(ctx: Context, index: int, op: dict[str, Any]) -> None:
    kind = op["op"]
    root = ctx.root_fd
    if kind == "bind":
        bind(root, op, ctx.source_fds.pop(index, None))
    elif kind == "tmpfs":
        target = open_dir(root, op["target"])
        mount_tmpfs(BUILD, op["size"], op["mode"])
        move_into_place(BUILD, target)
    elif kind == "file":
        write_file(root, op["target"], op["content"], op["mode"])
    elif kind == "symlink":
        parent, name = open_parent(root, op["target"])
        try:
            os.symlink(op["points_to"], name, dir_fd=parent)
        finally:
            release(parent, root)
    elif kind == "dir":
        os.close(open_dir(root, op["target"], op["mode"]))
    elif kind == "dev":
        mount_dev(open_dir(root, op["target"]), op["devices"], op["shm_size"])
    elif kind == "proc":
        mount_proc(open_dir(root, op["target"]))
    else:
        raise OSError(22, f"unknown mount operation {kind!r}")


def attach(tree: int, target: int) -> None:
    """Move the detached mount ``tree`` onto the descriptor ``target``; both are closed."""
    try:
        _libc.move_mount(tree, target)
    finally:
        os.close(tree)
        os.close(target)


def bind(root: int, op: dict[str, Any], tree: int | None) -> None:
    target = open_mountpoint(root, op["target"], op["is_dir"])
    if tree is None:
        # Unprivileged: the source is reached with the caller's own permissions. The plan
        # resolved it; a symlink put in its path since then is refused, not followed.
        tree = _open_source(op["source"])
    # Otherwise a detached copy made by the helper when it runs as root (idmapped when
    # writable): the sandbox's unprivileged uid need not be able to reach the source itself.
    attrs = _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NODEV
    if not op["writable"]:
        attrs |= _libc.MOUNT_ATTR_RDONLY
    try:
        _libc.mount_setattr("", attrs, recursive=True, dirfd=tree, empty_path=True)
    except BaseException:
        os.close(tree)
        os.close(target)
        raise
    attach(tree, target)


def _open_source(source: str) -> int:
    return _libc.open_tree_nofollow(
        OLDROOT + source, _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC | _libc.AT_RECURSIVE)


def mount_dev(target: int, devices: list[str], shm_size: int) -> None:
    path = BUILD
    _libc.mount("tmpfs", path, "tmpfs", _libc.MS_NOSUID | _libc.MS_NOEXEC, "size=64k,mode=755")
    for name in devices:
        node = path + "/" + name
        os.close(os.open(node, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        _libc.mount(f"{OLDROOT}/dev/{name}", node, None, _libc.MS_BIND)
        _libc.mount_setattr(node, _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NOEXEC,
                            recursive=False)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(link, path + "/" + name)
    shm = path + "/shm"
    os.mkdir(shm)
    mount_tmpfs(shm, shm_size, 0o1777)
    mount_devpts(path)
    _libc.mount_setattr(path, _libc.MOUNT_ATTR_RDONLY, recursive=False)
    move_into_place(path, target)


def mount_devpts(dev: str) -> None:
    """The sandbox's own terminals: a new devpts instance at /dev/pts, /dev/ptmx leading to it.

    ``newinstance`` makes a private set of ptys: the host's terminals are not in it, and the
    sandbox's are not visible outside (devpts in the kernel's Documentation/filesystems). No
    ``gid=tty``: gid 5 is not mapped in the sandbox's user namespace, so a pty belongs to the
    group of the process that opens it.
    """
    pts = dev + "/pts"
    os.mkdir(pts)
    _libc.mount("devpts", pts, "devpts", _libc.MS_NOSUID | _libc.MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", dev + "/ptmx")


def mount_proc(target: int) -> None:
    # Mounted before pivot_root: once the host's /proc is detached, the kernel refuses a new
    # proc mount in a user namespace (mount_too_revealing in fs/namespace.c).
    path = BUILD
    _libc.mount("proc", path, "proc", _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC)
    # Kernel knobs stay read-only even where the namespace would allow a write.
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        sub_path = path + "/" + sub
        try:
            _libc.mount(sub_path, sub_path, None, _libc.MS_BIND | _libc.MS_REC)
        except FileNotFoundError:
            continue
        _libc.mount_setattr(sub_path, _libc.MOUNT_ATTR_RDONLY, recursive=True)
    mask_host_files(path)
    move_into_place(path, target)


def move_into_place(path: str, target: int) -> None:
    """Move the mount built at ``path`` (with what is mounted below it) onto ``target``."""
    try:
        _libc.move_mount_path(path, target)
    finally:
        os.close(target)


# Parts of /proc that show the whole host, not the sandbox: the host's block devices, swap
# devices or files, the kernel's boot arguments (which name the root device), and per
# filesystem and device, /proc/fs (ext4/vda...). /dev/null goes over each file and an empty
# read-only directory over the directory, as container runtimes mask /proc/kcore. What the
# kernel shows per process (mountinfo, mountstats) cannot be covered so (docs/threat-model.md).
PROC_MASKED = ("cmdline", "partitions", "diskstats", "swaps")
PROC_MASKED_DIRS = ("fs",)


def mask_host_files(proc: str) -> None:
    for name in PROC_MASKED:
        try:
            _libc.mount(OLDROOT + "/dev/null", proc + "/" + name, None, _libc.MS_BIND)
        except FileNotFoundError:
            pass  # a kernel without it (swaps without CONFIG_SWAP): nothing to cover
    for name in PROC_MASKED_DIRS:
        path = proc + "/" + name
        try:
            _libc.mount(EMPTY, path, None, _libc.MS_BIND)
        except FileNotFoundError:
            continue
        _libc.mount_setattr(path, _libc.MOUNT_ATTR_RDONLY | _libc.MOUNT_ATTR_NOSUID
                            | _libc.MOUNT_ATTR_NODEV | _libc.MOUNT_ATTR_NOEXEC, recursive=False)


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


# Python ignores SIGPIPE and SIGXFSZ, the helper SIGINT; ignored signals stay ignored across
# exec (signal(7)). Plain ints for the C functions of _signal: the wrappers in the signal module
# turn every argument and result into an enum member, which costs the child far more than the
# system calls.
_RESET_SIGNALS = tuple(int(sig) for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT))
_SIG_DFL = int(signal.SIG_DFL)
_SIG_SETMASK = int(signal.SIG_SETMASK)


def reset_signals() -> None:
    for sig in _RESET_SIGNALS:
        _signal.signal(sig, _SIG_DFL)
    _signal.pthread_sigmask(_SIG_SETMASK, ())


def apply_setid_filter(ctx: Context) -> None:
    """The set-id filter goes into every sandbox, before the policy's (nsbox/host/seccomp.py):
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
