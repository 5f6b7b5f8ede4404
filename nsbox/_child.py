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
from typing import Any, NoReturn

from nsbox import _libc, _netns, _wire

# The staging tmpfs is mounted over /tmp (privately, in the new mount namespace) and becomes the
# root; the host's root stays reachable under /oldroot until the final pivot, and the sandbox's
# root is built under /newroot.
STAGING = "/tmp"
OLDROOT = "/oldroot"
NEWROOT = "/newroot"
CLOSE_RANGE_CLOEXEC = 4


class Context:
    def __init__(self, plan: dict[str, Any], sync_fd: int, err_fd: int,
                 source_fds: dict[int, int], cap_last: int, notify_fd: int = -1,
                 net_fd: int | None = None) -> None:
        self.plan = plan
        self.sync_fd = sync_fd
        self.err_fd = err_fd
        self.source_fds = source_fds  # mount index -> descriptor of the bind source
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
    stage()
    for index, op in enumerate(ctx.plan["mounts"]):
        ctx.step = f"{op['op']} {op['target']}"
        apply_mount(ctx, index, op)
    ctx.step = "pivot_root"
    enter_root()
    ctx.step = "remount root read-only"
    _libc.mount_setattr("/", _libc.MOUNT_ATTR_RDONLY, recursive=False)
    ctx.step = "hostname"
    _libc.sethostname(ctx.plan["hostname"])
    ctx.step = "network"
    net = ctx.plan["net"]
    _netns.setup_network(net.get("mode", "none"), net.get("proxy_port", 0), ctx.net_fd)


def finish_and_exec(ctx: Context, command: dict[str, Any]) -> NoReturn:
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
    reset_signals()
    ctx.step = "drop capabilities"
    if not ctx.capabilities_dropped:
        _libc.drop_all_capabilities(ctx.cap_last)
    ctx.step = "no_new_privs"
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    ctx.step = "seccomp"
    if command["seccomp_bpf"]:
        apply_seccomp(ctx, command)
    ctx.step = "exec"
    if ctx.trace is not None:
        send_trace(ctx)
    execute(command["argv"], dict(command["env"]))


def fail(ctx: Context, errno: int, message: str) -> NoReturn:
    report = json.dumps({"step": ctx.step, "errno": errno, "message": message}).encode()
    try:
        os.write(ctx.err_fd, report)
    finally:
        os._exit(127)


def send_trace(ctx: Context) -> None:
    # One line before any error report on the same close-on-exec pipe (_helper.split_report).
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


def inside(path: str) -> str:
    """The host-side path of a target in the new root, refusing symlinks that lead out."""
    # String operations, not os.path: same results for these absolute paths, and the sandbox
    # child does not touch the code of posixpath (a copy-on-write page fault per page).
    parent, _, name = (NEWROOT + path).rpartition("/")
    parent = resolve(parent)
    if parent != NEWROOT and not parent.startswith(NEWROOT + "/"):
        raise OSError(1, f"target {path} resolves outside the sandbox root")
    return parent + "/" + name


def resolve(path: str) -> str:
    """``os.path.realpath(path)`` for an absolute path, with a cheap common case.

    realpath lstat()s every component and takes one that is missing as it is; a normalized
    path none of whose components is a symlink therefore resolves to itself. Only when a
    component is a symlink (or ``.``, ``..``, empty) does realpath itself run.
    """
    walked = ""
    for part in path[1:].split("/"):
        if part in ("", ".", ".."):
            return os.path.realpath(path)
        walked += "/" + part
        try:
            mode = os.lstat(walked).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            return os.path.realpath(path)
    return path


def _is_dir(path: str) -> bool:
    # os.path.isdir without its Python frame (genericpath, shared copy-on-write).
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _exists(path: str) -> bool:
    # os.path.exists, likewise.
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def stage() -> None:
    mount_tmpfs(STAGING, 1024 * 1024, 0o755)
    os.mkdir(STAGING + OLDROOT)
    os.mkdir(STAGING + NEWROOT)
    _libc.pivot_root(STAGING, STAGING + OLDROOT)
    os.chdir("/")
    mount_tmpfs(NEWROOT, 4 * 1024 * 1024, 0o755)


def mount_tmpfs(target: str, size: int, mode: int) -> None:
    _libc.mount("tmpfs", target, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV,
                f"size={size},mode={mode:o}")


def makedirs(path: str, mode: int = 0o777) -> None:
    """``os.makedirs(path, mode, exist_ok=True)``, checking first for the common case, a
    directory that is there already: one stat instead of a stat, a failing mkdir, an exception
    and a second stat."""
    if _is_dir(path):
        return
    try:
        os.mkdir(path, mode)  # what os.makedirs comes down to when the parent is there
    except FileNotFoundError:
        os.makedirs(path, mode, exist_ok=True)  # parents are missing too


def _make_mountpoint(path: str, is_dir: bool) -> None:
    makedirs(path.rpartition("/")[0])
    if is_dir:
        makedirs(path)
    elif not _exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def apply_mount(ctx: Context, index: int, op: dict[str, Any]) -> None:
    kind = op["op"]
    path = inside(op["target"])
    if kind == "bind":
        bind(path, op, ctx.source_fds.get(index))
    elif kind == "tmpfs":
        makedirs(path)
        mount_tmpfs(path, op["size"], op["mode"])
    elif kind == "file":
        makedirs(path.rpartition("/")[0])
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, op["mode"])
        try:
            os.write(fd, op["content"].encode())
        finally:
            os.close(fd)
        os.chmod(path, op["mode"])
    elif kind == "symlink":
        makedirs(path.rpartition("/")[0])
        os.symlink(op["points_to"], path)
    elif kind == "dir":
        makedirs(path, op["mode"])
    elif kind == "dev":
        mount_dev(path, op["devices"], op["shm_size"])
    elif kind == "proc":
        mount_proc(path)
    else:
        raise OSError(22, f"unknown mount operation {kind!r}")


def bind(path: str, op: dict[str, Any], tree_fd: int | None) -> None:
    _make_mountpoint(path, op["is_dir"])
    if tree_fd is not None:
        # A detached copy made by the helper when it runs as root (idmapped when writable):
        # the sandbox's unprivileged uid need not be able to reach the source itself.
        _libc.move_mount_fd(tree_fd, path)
    else:
        # Unprivileged: the source is reached with the caller's own permissions.
        _libc.mount(OLDROOT + op["source"], path, None, _libc.MS_BIND | _libc.MS_REC)
    attrs = _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NODEV
    if not op["writable"]:
        attrs |= _libc.MOUNT_ATTR_RDONLY
    _libc.mount_setattr(path, attrs, recursive=True)


def mount_dev(path: str, devices: list[str], shm_size: int) -> None:
    makedirs(path)
    _libc.mount("tmpfs", path, "tmpfs", _libc.MS_NOSUID | _libc.MS_NOEXEC, "size=64k,mode=755")
    for name in devices:
        node = path + "/" + name
        _make_mountpoint(node, is_dir=False)
        _libc.mount(f"{OLDROOT}/dev/{name}", node, None, _libc.MS_BIND)
        _libc.mount_setattr(node, _libc.MOUNT_ATTR_NOSUID | _libc.MOUNT_ATTR_NOEXEC,
                            recursive=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, path + "/" + name)
    shm = path + "/shm"
    os.mkdir(shm)
    mount_tmpfs(shm, shm_size, 0o1777)
    _libc.mount_setattr(path, _libc.MOUNT_ATTR_RDONLY, recursive=False)


def mount_proc(path: str) -> None:
    # Mounted before pivot_root: once the host's /proc is detached, the kernel refuses a new
    # proc mount in a user namespace (mount_too_revealing in fs/namespace.c).
    makedirs(path)
    _libc.mount("proc", path, "proc", _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC)
    # Kernel knobs stay read-only even where the namespace would allow a write.
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        sub_path = path + "/" + sub
        if _exists(sub_path):
            _libc.mount(sub_path, sub_path, None, _libc.MS_BIND | _libc.MS_REC)
            _libc.mount_setattr(sub_path, _libc.MOUNT_ATTR_RDONLY, recursive=True)


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


def apply_seccomp(ctx: Context, command: dict[str, Any]) -> None:
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
