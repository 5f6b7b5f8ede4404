"""The sandbox side of a Landlock launch: from the helper's plain fork (no namespaces) to exec.

``main`` lists the steps in order, like nsbox/sandbox/child.py, whose step functions, failure
report and init protocol it shares: a failed step is ``{step, errno, message}`` on the error
pipe; the init writes ``{"status": N}`` when the command ends.

The processes and their Landlock layers (landlock(7); every layer is inherited and stacks):

- the *init* (the forked child itself, or a session's per-command init) restricts itself with a
  layer of scopes alone (ABI 6: signals and abstract unix sockets stay inside the domain), and
  is a child subreaper (PR_SET_CHILD_SUBREAPER), so every orphan of the sandbox comes to it;
- the *command* adds the full layer: every filesystem right handled, granted read-only on the
  policy's system trees and read-write on the workspace, the temporary directory and writable
  binds; TCP bind and connect handled with no port granted; both scopes.

The command cannot signal or trace its init (the init's domain is outside the command's), the
init can signal the command and all it starts (their domains are nested in its own). So at the
end, or when the helper sends ``TREE_SIGNAL`` (deadline, output cap, the caller gone, and the
helper's own death through PR_SET_PDEATHSIG), the init ends the whole tree: ``kill(-1,
SIGKILL)`` from inside the scoped domain reaches exactly the sandbox's processes (the kernel
skips every process the scope refuses), double-forked and setsid ones included, and it reaps
them until none is left. Before ABI 6 there are no scopes: the init is not restricted and ends
the tree by killing its children until it has none (orphans come to it, the subreaper).

Nothing here imports a module the helper has not imported before the fork.
"""

from __future__ import annotations

import _signal
import os
import resource
import select
import signal
from collections.abc import Mapping
from typing import Any, NoReturn

from nsbox._sys import landlock as _landlock
from nsbox._sys import libc as _libc
from nsbox.sandbox import child as _child
from nsbox.sandbox import terminal as _terminal

TREE_SIGNAL = int(signal.SIGRTMIN)  # helper (or a session's init) -> an init: end the tree
PR_SET_CHILD_SUBREAPER = 36
_SIGKILL = int(signal.SIGKILL)
_SIGCHLD = int(signal.SIGCHLD)
_INIT_WAITS = (_SIGCHLD, TREE_SIGNAL, *_child.FORWARDED_SIGNALS)
_SIG_BLOCK = int(signal.SIG_BLOCK)
_INSIDE = ("workspace", "tmp")  # /workspace and /tmp in a command's cwd and environment


def main(ctx: _child.Context) -> NoReturn:
    """One command: the identity, then the per-command steps, the init and the exec."""
    try:
        become_sandbox_user(ctx)
        finish_and_exec(ctx, ctx.plan, os.getppid())
    except OSError as exc:
        _child.fail(ctx, exc.errno or 0, exc.strerror or str(exc))
    except Exception as exc:  # a bug in a step must still reach the user as a named failure
        _child.fail(ctx, 0, f"{type(exc).__name__}: {exc}")


def become_sandbox_user(ctx: _child.Context) -> None:
    """The steps of the forked child before anything of the command's: the helper's go, the
    host uid, the helper's lifetime. A session's init takes them too."""
    ctx.step = "wait for the helper"
    _child.wait_for_maps(ctx)  # one byte once the run's cgroup holds this process
    ctx.step = "set identity"
    set_identity(ctx)
    ctx.step = "die with the launcher"
    die_with(ctx, os.getppid())
    # The helper's end of the sync pipe is held until here: a hang-up means it died first.
    poller = select.poll()
    poller.register(ctx.sync_fd, select.POLLIN)
    for _fd, events in poller.poll(0):
        if events & (select.POLLHUP | select.POLLERR):
            raise OSError(0, "the launch helper went away before the sandbox was set up")


def set_identity(ctx: _child.Context) -> None:
    """A root caller's sandbox becomes the unprivileged host uid nsbox/policy/identity.py decided
    (the helper put it in the plan); anyone else's stays the caller's uid."""
    uid, gid, mapper = ctx.plan["landlock"]["ids"]
    if mapper:
        # The bounding set first: dropping from it needs CAP_SETPCAP, which the uid change
        # clears with every other capability (capabilities(7), "Effect of user ID changes").
        drop_bounding_set(ctx.cap_last)
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    os.umask(0o022)


def drop_bounding_set(cap_last: int) -> None:
    for cap in range(cap_last + 1):
        if _libc.prctl(_libc.PR_CAPBSET_READ, cap):
            _libc.prctl(_libc.PR_CAPBSET_DROP, cap)


def die_with(ctx: _child.Context, parent: int) -> None:
    """TREE_SIGNAL when ``parent`` (the helper, a session's init) dies: the init then ends the
    sandbox's tree. Set after the uid change, which clears it (prctl(2))."""
    _libc.prctl(_libc.PR_SET_PDEATHSIG, TREE_SIGNAL)
    if os.getppid() != parent:
        raise OSError(0, "the launcher went away before the sandbox was set up")


def finish_and_exec(ctx: _child.Context, command: Mapping[str, Any], parent: int) -> NoReturn:
    """The per-command steps, in order (those of nsbox/sandbox/child.py, plus Landlock), ending
    with seccomp and the exec. ``command``: argv, env, cwd, rlimits, seccomp_bpf."""
    landlock = ctx.plan["landlock"]
    ctx.step = "rlimits"
    set_rlimits(command["rlimits"])
    ctx.step = "new session"
    os.setsid()
    ctx.step = "working directory"
    os.chdir(inside(command["cwd"], landlock))
    if command.get("tty"):
        # A pty of the host's devpts (no mount namespace here), new and nobody else's; opened
        # before the Landlock layer, as the streams are (nsbox/sandbox/terminal.py).
        ctx.step = "terminal"
        _terminal.open_terminal(command["tty"])
    ctx.step = "close file descriptors"
    _libc.close_range(3, 0xFFFFFFFF, _child.CLOSE_RANGE_CLOEXEC)
    ctx.step = "drop capabilities"
    drop_capabilities()
    ctx.step = "no_new_privs"
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    ctx.step = "landlock init"
    become_keeper(ctx, parent)
    ctx.step = "start init"
    start_init(ctx, bool(command.get("tty")))  # the command's process; the init stays behind
    ctx.step = "landlock"
    restrict(landlock)
    ctx.step = "seccomp"
    _child.apply_setid_filter(ctx)
    _libc.seccomp_set_filter(bytes.fromhex(landlock["bpf"]))
    if command["seccomp_bpf"]:
        _child.apply_seccomp(ctx, command)
    ctx.step = "exec"
    if ctx.trace is not None:
        _child.send_trace(ctx)
    env = {name: inside(value, landlock) for name, value in command["env"]}
    _child.execute(command["argv"], env)


def inside(value: str, landlock: Mapping[str, Any]) -> str:
    """``/workspace`` and ``/tmp`` (and paths below them) as the host directories they are."""
    for name in _INSIDE:
        prefix = f"/{name}"
        if value == prefix or value.startswith(prefix + "/"):
            return str(landlock[name]) + value[len(prefix):]
    return value


def set_rlimits(rlimits: list[list[int]]) -> None:
    """As the namespace child's, but RLIMIT_NPROC counts every process of this uid on the host
    here (no user namespace of its own): the limit is on top of those running now."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for res, soft, hard in rlimits:
        if res == resource.RLIMIT_NPROC:
            running = count_processes(os.getuid())
            soft, hard = soft + running, hard + running
        resource.setrlimit(res, (soft, hard))


def count_processes(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass  # it has just ended
    return count


def drop_capabilities() -> None:
    """Whatever the process still holds: ambient, inheritable, permitted and effective. (A root
    caller's sandbox lost them with the uid change, its bounding set before; an unprivileged
    caller's may still have inheritable ones.) Under no_new_privs no exec can give any back."""
    _libc.clear_capabilities()


def become_keeper(ctx: _child.Context, parent: int) -> None:
    """The init's own layer (scopes alone) and the subreaper flag, before it forks."""
    abi = int(ctx.plan["landlock"]["abi"])
    die_with(ctx, parent)
    if abi >= _landlock.SCOPES_ABI:
        ruleset = _landlock.create_ruleset(abi, fs=False, net=False, scoped=True)
        try:
            _landlock.restrict_self(ruleset)
        finally:
            os.close(ruleset)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)


def restrict(landlock: Mapping[str, Any]) -> None:
    """The command's layer: the policy's trees read-only, its workspace, temporary directory
    and writable binds read-write, the devices of nsbox/plan/plan.py, no TCP port, both scopes."""
    abi = int(landlock["abi"])
    ruleset = _landlock.create_ruleset(abi, fs=True, net=True,
                                       scoped=abi >= _landlock.SCOPES_ABI)
    try:
        grants = [(path, _landlock.READ_ONLY, False) for path in landlock["read"]]
        grants += [(path, _landlock.WRITABLE, False) for path in [
            *landlock["write"], landlock["workspace"], landlock["tmp"]]]
        grants += [(path, _landlock.DEVICE, True) for path in landlock["devices"]]
        for path, rights, optional in grants:
            grant(ruleset, path, rights, abi, optional)
        _landlock.restrict_self(ruleset)
    finally:
        os.close(ruleset)


def grant(ruleset: int, path: str, rights: int, abi: int, optional: bool) -> None:
    """A rule for ``path``, opened with no symlink followed at any component (the host
    resolved it when the plan was made; a symlink now was swapped in since)."""
    try:
        fd = _libc.open_path_nofollow(path)
    except FileNotFoundError:
        if optional:
            return
        raise
    try:
        is_dir = (os.fstat(fd).st_mode & 0o170000) == 0o040000
        _landlock.add_path_rule(ruleset, fd, rights, abi, is_dir)
    finally:
        os.close(fd)


# --- the init ---------------------------------------------------------------------------------


def start_init(ctx: _child.Context, tty: bool = False) -> None:
    """Fork; return in the child, which goes on to become the command. The init never returns.
    As nsbox/sandbox/child.py's start_init, with TREE_SIGNAL among the signals it waits for."""
    _signal.pthread_sigmask(_SIG_BLOCK, _INIT_WAITS)
    _libc.prctl(_libc.PR_SET_DUMPABLE, 0)  # never traced or read by the command (same uid)
    _libc.set_name(b"nsbox-init")
    pid = _libc.raw_clone(_SIGCHLD | _libc.CLONE_VFORK)
    if pid == 0:
        os.setsid()
        if tty:
            _terminal.take_as_controlling()
        _child.reset_signals()
        return
    serve_as_init(ctx, pid)


def serve_as_init(ctx: _child.Context, command_pid: int) -> NoReturn:
    ctx.step = "init"
    scoped = int(ctx.plan["landlock"]["abi"]) >= _landlock.SCOPES_ABI
    try:
        _libc.close_range(0, ctx.err_fd - 1)
        _libc.close_range(ctx.err_fd + 1)
        status = wait_for_command(command_pid, scoped)
        os.write(ctx.err_fd, b'\n{"status": %d}\n' % status)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    except Exception as exc:  # a bug here must not pass for the command's own failure
        _child.fail(ctx, getattr(exc, "errno", None) or 0, f"{type(exc).__name__}: {exc}")


def wait_for_command(command_pid: int, scoped: bool) -> int:
    """Reap until the command ends, passing the forwarded signals on; then end what is left.
    TREE_SIGNAL ends everything at once. Returns the command's wait status."""
    while True:
        signo = _signal.sigwaitinfo(_INIT_WAITS).si_signo
        if signo == TREE_SIGNAL:
            return end_tree(scoped, command_pid)
        status = _child.forward_or_reap(signo, command_pid)
        if status is not None:
            end_tree(scoped, None)
            return status


def end_tree(scoped: bool, command_pid: int | None) -> int:
    """SIGKILL every process of the sandbox and reap them all; the command's wait status if it
    was among them (else SIGKILL's)."""
    status = _SIGKILL
    while True:
        if scoped:
            try:
                os.kill(-1, _SIGKILL)  # the scope limits -1 to this init's domain
            except ProcessLookupError:
                pass  # nothing left to signal
        else:
            for pid in children():
                try:
                    os.kill(pid, _SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            pid, reaped = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        if pid == command_pid:
            status = reaped


def children() -> list[int]:
    """This process's children (proc(5), /proc/PID/task/TID/children; by every process's
    parent where the kernel lacks that file)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except FileNotFoundError:
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(int(name))
    return found
