"""Starting one launch, the helper's side: the named steps from a plan to a released sandbox,
in order (docs/architecture.md, "The launch").

``start`` reads top to bottom: the run's cgroup, the bind sources, the pipes and side channels,
the clone (through the helper's clone strategy, nsbox/helper/clone.py), the watch; then the id
maps, the cgroup settled, the child let go and the caller told. Everything a step opens is put
in the launch's one cleanup owner, ``launch.cleanup``, at once; what only the child keeps goes
in ``child_ends``, closed here once the child has its copies. A step that fails raises
StepFailed with its name (the name the caller's SetupError shows).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nsbox._sys.wire import WirePlan
from nsbox.helper import channels, ids, landlocked, report
from nsbox.helper.clone import Cloner
from nsbox.helper.launch import ChildFds, Launch, StepFailed
from nsbox.policy import limits as _limits

if TYPE_CHECKING:
    from nsbox.helper.loop import Helper


def start(helper: Helper, launch: Launch, plan: WirePlan, stdio: list[int]) -> None:
    """Clone the sandbox of ``plan`` with ``stdio`` (the caller keeps and closes those) and
    release it. A failure before the sandbox exists raises (StepFailed, HostError, anything)
    with all the launch opened released; one after becomes the launch's report (Launch.fail)."""
    cloner = landlocked.cloner_for(helper, plan)  # the helper's, or the Landlock mode's
    try:
        pid = clone_sandbox(helper, launch, plan, stdio, cloner)
    except BaseException:
        try:
            launch.cleanup.close()
        except Exception:
            pass
        raise
    try:
        release(helper, launch, plan, pid, cloner)
    except Exception as exc:
        launch.fail("release", exc)


def clone_sandbox(helper: Helper, launch: Launch, plan: WirePlan, stdio: list[int],
                  cloner: Cloner) -> int:
    """The steps up to a cloned child, watched by the helper. Returns its pid."""
    begin_trace(launch, plan, helper.received_ns)
    import_session_init(plan)
    create_cgroup(launch, plan, cloner)
    with contextlib.ExitStack() as child_ends:  # closed here once the child has its copies
        cgroup_fd = open_cgroup(launch, cloner, child_ends)
        sources = open_sources(helper, launch, plan, child_ends)
        sync_r, err_w = create_pipes(helper, launch, child_ends)
        notify_fd, net_fd = open_channels(helper, launch, plan, child_ends)
        fds = ChildFds(stdio, sync_r, err_w, sources, notify_fd, net_fd)
        pid = clone(launch, plan, fds, cgroup_fd, cloner)
    watch(helper, launch)
    return pid


def release(helper: Helper, launch: Launch, plan: WirePlan, pid: int, cloner: Cloner) -> None:
    """The steps from a cloned child to a running sandbox: raises StepFailed (which
    ``start`` turns into the launch's report)."""
    with step("write id maps"):
        if not landlocked.is_landlock(plan):  # no user namespace: the child sets its uid
            ids.write_id_maps(helper.identity, pid, plan)
    with step("attach to cgroup"):
        cloner.settle(launch)
    let_go(launch)
    start_deadline(launch, plan)
    tell_pid(launch)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """An OSError of the step ``name`` becomes StepFailed(name) with its errno."""
    try:
        yield
    except OSError as exc:
        raise StepFailed(name, exc.errno or 0, exc.strerror or str(exc)) from None


# --- the steps up to the clone -------------------------------------------------------------

def begin_trace(launch: Launch, plan: WirePlan, received_ns: int) -> None:
    if plan.get("trace"):
        launch.trace = [("helper: receive plan", received_ns)]
    launch.mark("helper: create cgroup")


def import_session_init(plan: WirePlan) -> None:
    if plan.get("session"):
        # A session's init serves commands instead of exec (nsbox/sandbox/sessioninit.py); it is
        # imported here, before the clone, because nothing can be imported after pivot_root.
        import nsbox.sandbox.sessioninit  # noqa: F401
        if landlocked.is_landlock(plan):
            import nsbox.sandbox.landlock_session  # noqa: F401


def create_cgroup(launch: Launch, plan: WirePlan, cloner: Cloner) -> None:
    """The run's cgroup, with its limits written, exists before the child does; the child
    applies the rlimits, including the fallbacks for what the cgroup cannot limit here.
    Raises HostError when a required limit cannot be had."""
    try:
        limits = launch.limits = _limits.RunLimits(
            plan["cgroup"], plan["rlimits"], create=functools.partial(cloner.make_cgroup, launch))
    except BaseException:
        cloner.abandon(launch)  # e.g. the spawner make_cgroup took
        raise
    launch.cleanup.callback(report.close_limits, launch)
    launch.cleanup.callback(cloner.abandon, launch)  # until settled (release)
    plan["rlimits"] = limits.rlimits
    plan["degraded"] = limits.degraded  # a session's init reports them with each command


def open_cgroup(launch: Launch, cloner: Cloner, child_ends: contextlib.ExitStack) -> int | None:
    """On cgroup v2 the child is cloned into its cgroup; elsewhere it is born in a spawner's
    cgroup, or moved into the run's cgroup after the clone (attach): no descriptor."""
    with step("create cgroup"):
        cgroup_fd = cloner.cgroup_fd(launch)
    if cgroup_fd is not None:
        child_ends.callback(os.close, cgroup_fd)
    return cgroup_fd


def open_sources(helper: Helper, launch: Launch, plan: WirePlan,
                 child_ends: contextlib.ExitStack) -> dict[int, int]:
    """The bind sources the helper opens for the child (nsbox/helper/sources.py)."""
    launch.mark("helper: open bind sources")
    source_fds = helper.sources.open(launch, plan)
    for fd in source_fds.values():
        child_ends.callback(os.close, fd)
    return source_fds


def create_pipes(helper: Helper, launch: Launch,
                 child_ends: contextlib.ExitStack) -> tuple[int, int]:
    """The sync pipe (the helper says "go" once the id maps are written) and the error pipe
    (close-on-exec: the child's failed step, or end-of-file at its exec). The child's ends."""
    with step("create pipes"):
        sync_r, launch.sync_fd = os.pipe2(os.O_CLOEXEC)
        child_ends.callback(os.close, sync_r)
        launch.cleanup.callback(helper.drop_fd, launch, "sync_fd")
        launch.err_fd, err_w = os.pipe2(os.O_CLOEXEC)
        child_ends.callback(os.close, err_w)
        launch.cleanup.callback(helper.drop_fd, launch, "err_fd")
    return sync_r, err_w


def open_channels(helper: Helper, launch: Launch, plan: WirePlan,
                  child_ends: contextlib.ExitStack) -> tuple[int, int | None]:
    """Learning mode's and network allow mode's sockets (nsbox/helper/channels.py)."""
    with step("create pipes"):
        return channels.open_channels(helper.selector, launch, plan, child_ends)


def clone(launch: Launch, plan: WirePlan, fds: ChildFds, cgroup_fd: int | None,
          cloner: Cloner) -> int:
    """The child, with every namespace, by the helper's clone strategy; killed and waited
    for by the cleanup unless it is reaped."""
    launch.started = time.monotonic()
    launch.mark("helper: clone")
    try:
        pid = cloner.clone(launch, plan, fds, cgroup_fd)
    except OSError as exc:
        name = "fork" if landlocked.is_landlock(plan) else "create namespaces"
        raise StepFailed(name, exc.errno or 0, str(exc)) from None
    launch.cleanup.callback(end_child, launch)
    return pid


def end_child(launch: Launch) -> None:
    """A child that was never reaped (its launch failed on the way) is killed and waited for
    here."""
    if launch.pid and not launch.reaped:
        launch.reaped = True
        try:
            os.kill(launch.pid, signal.SIGKILL)
            os.waitpid(launch.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def watch(helper: Helper, launch: Launch) -> None:
    """The helper watches the child's exit, its error pipe and the launch's sockets."""
    launch.mark("helper: write id maps")  # the trace counts the watch with the id maps
    try:
        helper.watch(launch)
    except OSError as exc:  # e.g. EMFILE for the pidfd
        raise StepFailed("watch the sandbox", exc.errno or 0, str(exc)) from None


# --- the steps after the clone -------------------------------------------------------------

def let_go(launch: Launch) -> None:
    """One byte on the sync pipe: the child goes on with its own steps."""
    os.write(launch.sync_fd, b"1")
    launch.mark("helper: released, supervise")


def start_deadline(launch: Launch, plan: WirePlan) -> None:
    if plan["wall_time"] is not None:
        launch.deadline = launch.started + float(plan["wall_time"])


def tell_pid(launch: Launch) -> None:
    # With the pid, a descriptor for it: the host process kills the sandbox by it should this
    # helper not get to run at the deadline (nsbox/launch/launcher.py, the second guard).
    message: dict[str, int | str] = {"event": "pid", "pid": launch.pid}
    if launch.kill_signal != signal.SIGKILL:  # a Landlock sandbox's (nsbox/helper/landlocked.py)
        message["kill_signal"] = launch.kill_signal
    launch.send_fd(message, launch.pidfd)
