"""The launch helper: a small, thread-free process that clones and supervises sandboxes.

The host process starts it once (``python3 -I -S``) and keeps a control socket to it. Cloning
from here instead of from the host process is what makes launches fast (a small process has few
page tables to copy) and safe (the host may have threads; this process never does).

Protocol (SOCK_SEQPACKET, one JSON object per message; one too large for a datagram travels in
a memfd, nsbox/_wire.py):

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

import contextlib
import errno
import functools
import json
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from nsbox import _libc, _wire, cgroups, identity
from nsbox import limits as _limits
from nsbox._wire import ExitReport, WirePlan
from nsbox.errors import HostError
from nsbox.helper import pool as _helper_pool
from nsbox.helper import spawner as _spawner
from nsbox.helper.launch import NAMESPACES, Launch, StepFailed, failure_info, failure_report
from nsbox.helper.seccomp_notify import DeniedSyscalls
from nsbox.sandbox import child as _child
from nsbox.sandbox import native as _native_core
from nsbox.sandbox import netns as _netns

MAX_FDS = 8
MAX_WAIT = 3600.0  # seconds: the longest single wait of the event loop


class Helper:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, self.on_control)
        self.launches: set[Launch] = set()
        # What this process holds decides the sandbox's identity and who opens bind sources
        # (nsbox/identity.py); read once, credentials do not change under a process.
        self.identity = identity.Holdings.read()
        self.pins: dict[int, list[tuple[int, int]]] = {}  # sandbox pid -> writable bind pins
        self.pending_pins: list[tuple[int, int]] = []  # pinned for the launch being started
        self.cap_last = _libc.last_cap()
        self.idmap_userns: dict[tuple[int, int, int, int], int] = {}
        self.received_ns = 0  # when the last request arrived (NSBOX_TRACE)
        self.timers: list[tuple[float, Callable[[], None]]] = []  # e.g. a pool's refill
        # v1 run cgroups are made ahead, each holding a spawner that clones the sandbox there
        # (nsbox/helper/spawner.py): moving a child into a cgroup costs an RCU grace period.
        self.spawners = _spawner.Spawners.for_host(self)
        if self.spawners is not None:
            self.call_later(0, self.spawners.fill)
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
        if self.spawners is not None:
            self.spawners.close()
        sys.exit(0)

    # --- one launch ----------------------------------------------------------------------

    def start(self, launch: Launch, plan: WirePlan, stdio: list[int]) -> None:
        """Clone the sandbox of ``plan`` with ``stdio`` (the caller keeps and closes those) and
        release it. What the launch opens belongs to ``launch.cleanup``. A failure before the
        sandbox exists raises (StepFailed, HostError, anything) with all of it released; one
        after becomes the launch's report (Launch.fail)."""
        try:
            pid = self.clone_sandbox(launch, plan, stdio)
        except BaseException:
            try:
                launch.cleanup.close()
            except Exception:
                pass
            raise
        try:
            self.release(launch, plan, pid)
        except Exception as exc:
            launch.fail("release", exc)

    def clone_sandbox(self, launch: Launch, plan: WirePlan, stdio: list[int]) -> int:
        """The run's cgroup, the child's pipes and sockets, the clone; then the child is
        watched. Returns its pid; raises StepFailed for a step that failed."""
        keep = launch.cleanup
        if plan.get("trace"):
            launch.trace = [("helper: receive plan", self.received_ns),
                            ("helper: create cgroup", time.monotonic_ns())]
        if plan.get("session"):
            # A session's init serves commands instead of exec (nsbox/sandbox/sessioninit.py); it is
            # imported here, before the clone, because nothing can be imported after pivot_root.
            import nsbox.sandbox.sessioninit  # noqa: F401
        # The run's cgroup, with its limits written, exists before the child does; the child
        # applies the rlimits, including the fallbacks for what the cgroup cannot limit here.
        try:
            limits = launch.limits = _limits.RunLimits(
                plan["cgroup"], plan["rlimits"], create=functools.partial(self.make_cgroup, launch))
        except BaseException:
            self.end_spawner(launch)  # one make_cgroup took
            raise
        keep.callback(self.close_limits, launch)
        keep.callback(self.end_spawner, launch)  # until it has left (release)
        plan["rlimits"] = limits.rlimits
        plan["degraded"] = limits.degraded  # a session's init reports them with each command
        with contextlib.ExitStack() as child_ends:  # closed here once the child has them
            step = "create cgroup"
            try:
                # On cgroup v2 the child is cloned into its cgroup; elsewhere it is born in a
                # spawner's cgroup, or moved into the run's cgroup after the clone (attach).
                cgroup_fd = None
                if limits.cgroup and launch.spawner is None:
                    cgroup_fd = limits.cgroup.clone_fd()  # None: attach after the clone
                    if cgroup_fd is not None:
                        child_ends.callback(os.close, cgroup_fd)
                if launch.trace is not None:
                    launch.trace.append(("helper: open bind sources", time.monotonic_ns()))
                source_fds = self.open_sources(plan)
                for fd in source_fds.values():
                    child_ends.callback(os.close, fd)
                step = "create pipes"
                sync_r, launch.sync_fd = os.pipe2(os.O_CLOEXEC)
                child_ends.callback(os.close, sync_r)
                keep.callback(self.drop_fd, launch, "sync_fd")
                launch.err_fd, err_w = os.pipe2(os.O_CLOEXEC)
                child_ends.callback(os.close, err_w)
                keep.callback(self.drop_fd, launch, "err_fd")
                notify_fd, net_fd = self.child_sockets(launch, plan, child_ends)
            except OSError as exc:
                raise StepFailed(step, exc.errno or 0, exc.strerror or str(exc)) from None
            launch.started = time.monotonic()
            if launch.trace is not None:
                launch.trace.append(("helper: clone", time.monotonic_ns()))
            fds = _spawner.ChildFds(stdio, sync_r, err_w, source_fds, notify_fd, net_fd)
            pid = self.clone(launch, plan, fds, cgroup_fd)
            launch.cloned_into_cgroup = cgroup_fd is not None and launch.spawner is None
            keep.callback(self.end_child, launch)
        if launch.trace is not None:
            launch.trace.append(("helper: write id maps", time.monotonic_ns()))
        try:
            self.watch(launch)
        except OSError as exc:  # e.g. EMFILE for the pidfd
            raise StepFailed("watch the sandbox", exc.errno or 0, str(exc)) from None
        return pid

    def child_sockets(self, launch: Launch, plan: WirePlan,
                      child_ends: contextlib.ExitStack) -> tuple[int, int | None]:
        """Learning mode's and network allow mode's socket pairs: the child's ends' fds."""
        notify_fd, net_fd = -1, None
        launch.notify_table = plan.get("seccomp_notify")
        if launch.notify_table:
            launch.notify_sock, notify_child = socket.socketpair(socket.AF_UNIX,
                                                                 socket.SOCK_SEQPACKET)
            launch.cleanup.callback(self.close_notify, launch)
            child_ends.callback(notify_child.close)
            notify_fd = notify_child.fileno()
        if plan["net"].get("mode") == "allow":
            launch.net_sock, net_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            launch.cleanup.callback(self.close_net, launch)
            # The child's end, closed here after the clone: EOF once the child sent or died.
            child_ends.callback(net_child.close)
            net_fd = net_child.fileno()
        return notify_fd, net_fd

    def clone(self, launch: Launch, plan: WirePlan, fds: _spawner.ChildFds,
              cgroup_fd: int | None) -> int:
        """Clone the child (through the launch's spawner, or here); in the child, go on as the
        sandbox. Raises StepFailed("create namespaces")."""
        flat = self.native_plan(launch, plan, fds)
        try:
            if launch.spawner is not None:
                try:
                    pid = launch.spawner.clone(flat)
                except OSError:
                    # It died before it cloned (killed from outside, say): clone here and
                    # attach instead; its cgroup, with the run's limits, stays the run's.
                    dead, launch.spawner = launch.spawner, None  # ended here, whatever happens
                    dead.leave(kill=True)
            if launch.spawner is not None:
                if flat is None:
                    try:
                        # The child waits for its plan, then for the id maps like any other.
                        launch.spawner.send_plan(plan, fds)
                    except OSError:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        raise
            elif flat is not None:
                pid = _native_core.spawn(*flat, (launch.sync_fd, launch.err_fd),
                                         NAMESPACES | signal.SIGCHLD,
                                         -1 if cgroup_fd is None else cgroup_fd)
            elif cgroup_fd is not None:
                pid = _libc.clone_into_cgroup(NAMESPACES, signal.SIGCHLD, cgroup_fd)
            else:
                pid = _libc.raw_clone(NAMESPACES | signal.SIGCHLD)
        except OSError as exc:
            raise StepFailed("create namespaces", exc.errno or 0, str(exc)) from None
        if pid == 0:
            self.become_child(plan, fds.stdio, fds.sync_r, fds.err_w, fds.sources,
                              (launch.sync_fd, launch.err_fd), fds.notify, fds.net)
        launch.pid = pid
        return pid

    def native_plan(self, launch: Launch, plan: WirePlan,
                    fds: _spawner.ChildFds) -> tuple[bytes, list[int]] | None:
        """The flat plan and its descriptors for the native core, or None: the Python child
        runs this launch (nsbox/sandbox/native.py says when)."""
        reason = _native_core.unsupported(plan)
        if reason is None:
            try:
                flat = _native_core.flatten(plan, fds.stdio, fds.sync_r, fds.err_w, fds.sources,
                                            fds.notify, fds.net, self.cap_last,
                                            _native_core.own_name())
            except ValueError:
                flat = None  # a name the C side cannot carry: the Python child takes it
            else:
                launch.core = "native"
                return flat
        return None

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
        if launch.notify_sock is not None:
            self.selector.register(launch.notify_sock, selectors.EVENT_READ,
                                   lambda _f: self.receive_listener(launch))
        if launch.net_sock is not None:
            self.selector.register(launch.net_sock, selectors.EVENT_READ,
                                   lambda _f: self.pass_proxy_listener(launch))
        self.launches.add(launch)

    def unwatch_requests(self, launch: Launch) -> None:
        if launch.sock is not None:
            try:
                self.selector.unregister(launch.sock)
            except (KeyError, ValueError):
                pass

    def release(self, launch: Launch, plan: WirePlan, pid: int) -> None:
        """Write the id maps, settle the cgroup, let the child go on; tell the caller."""
        step = "write id maps"
        try:
            self.write_id_maps(pid, plan)
            step = "attach to cgroup"
            spawner, launch.spawner = launch.spawner, None  # ended here, whatever happens next
            if launch.trace is not None and (spawner is not None or not launch.cloned_into_cgroup):
                launch.trace.append(("helper: spawner exits" if spawner else
                                     "helper: attach to cgroup", time.monotonic_ns()))
            if spawner is not None:
                spawner.leave()  # it exits once it has cloned
            elif launch.limits is not None and not launch.cloned_into_cgroup:
                launch.limits.attach(pid)  # before the child runs anything of its own
        except OSError as exc:
            launch.fail(step, exc)
            return
        os.write(launch.sync_fd, b"1")
        if launch.trace is not None:
            launch.trace.append(("helper: released, supervise", time.monotonic_ns()))
        if plan["wall_time"] is not None:
            launch.deadline = launch.started + float(plan["wall_time"])
        # With the pid, a descriptor for it: the host process kills the sandbox by it should
        # this helper not get to run at the deadline (nsbox/launcher.py, the second guard).
        launch.send_fd({"event": "pid", "pid": pid}, launch.pidfd)

    def drop_fd(self, launch: Launch, name: str) -> None:
        """Close the launch's descriptor ``name`` (once), watched or not."""
        fd = getattr(launch, name)
        if fd < 0:
            return
        setattr(launch, name, -1)
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass
        os.close(fd)

    def end_spawner(self, launch: Launch) -> None:
        spawner, launch.spawner = launch.spawner, None
        if spawner is not None:
            spawner.end(kill=True)

    def end_child(self, launch: Launch) -> None:
        """A child that was never reaped (its launch failed on the way) is killed and
        waited for here."""
        if launch.pid and not launch.reaped:
            launch.reaped = True
            try:
                os.kill(launch.pid, signal.SIGKILL)
                os.waitpid(launch.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def make_cgroup(self, launch: Launch, request: cgroups.Request) -> cgroups.RunCgroup:
        """The run's cgroup: a ready spawner's, made ahead (then ``launch.spawner`` is set),
        or a new one."""
        if self.spawners is None:
            return cgroups.get_backend().create(request)
        spawner = self.spawners.take()
        if spawner is None:
            return cgroups.get_backend().create(request)
        try:
            spawner.prepare(request)
        except OSError:
            # A broken spare (removed from outside, say) must not cost the run its cgroup.
            self.spawners.discard(spawner)
            return cgroups.get_backend().create(request)
        launch.spawner = spawner
        return spawner.cgroup

    def become_child(self, plan: WirePlan, stdio: list[int], sync_r: int, err_w: int,
                     source_fds: dict[int, int], parent_fds: tuple[int, ...],
                     notify_fd: int, net_fd: int | None) -> None:
        try:
            for fd in parent_fds:
                os.close(fd)
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            if plan.get("pooled"):
                _child.keep_only({0, 1, 2, sync_r, err_w, notify_fd, *source_fds.values(),
                                  *([net_fd] if net_fd is not None else [])})
            ctx = _child.Context(plan, sync_r, err_w, source_fds, self.cap_last, notify_fd,
                                 net_fd)
            if plan.get("session"):
                sys.modules["nsbox.sandbox.sessioninit"].main(ctx)
            _child.main(ctx)
        finally:
            os._exit(127)

    def open_sources(self, plan: WirePlan) -> dict[int, int]:
        """Decide the sandbox's identity (or refuse), pin each writable bind's directory and,
        with CAP_SYS_ADMIN of the initial user namespace, copy every bind source here as a
        detached mount the child moves in.

        The sandbox's user is then an unprivileged host uid that may not reach the source
        itself. Without that capability (a regular user, root in a container) the child binds
        each source by path with its own identity (nsbox/identity.py).
        """
        ids = identity.decide(self.identity, plan["host_uid"], plan["host_gid"])
        for fd, _mode in self.pending_pins:  # of a launch that failed before its clone
            os.close(fd)
        self.pending_pins = []
        fds: dict[int, int] = {}
        try:
            for index, op in enumerate(plan["mounts"]):
                if op["op"] == "overlay" and self.identity.detached_binds:
                    fds[index] = self.project_tree(op["source"], ids)
                if op["op"] != "bind":
                    continue
                if op["writable"]:
                    self.pending_pins.append(identity.pin(op["source"]))
                    how = identity.writable_bind(op["source"], op["target"], ids,
                                                 self.identity.detached_binds)
                if not self.identity.detached_binds:
                    continue
                if op["writable"] and how == "idmap":
                    fds[index] = self.idmapped_tree(op["source"], ids)
                else:
                    fds[index] = _libc.open_tree_nofollow(
                        op["source"],
                        _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC | _libc.AT_RECURSIVE)
        except BaseException as exc:
            for fd in [*fds.values(), *(pin for pin, _mode in self.pending_pins)]:
                os.close(fd)
            self.pending_pins = []
            if isinstance(exc, OSError):
                raise StepFailed(f"bind {op['target']}", exc.errno or 0, str(exc)) from None
            raise
        return fds

    def project_tree(self, source: str, ids: identity.SandboxIds) -> int:
        """The lower layer of a project workspace: idmapped so that its owner (root's too: see
        userns_for) appears as the sandbox's user, who may then change its files in the
        upper layer; files of other owners stay read-only to the sandbox."""
        st = os.stat(source)
        if (st.st_uid, st.st_gid) != (ids.parent_uid, ids.parent_gid):
            return self.idmapped_tree(source, ids, lower_layer=True)
        return _libc.open_tree_nofollow(
            source, _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC | _libc.AT_RECURSIVE)

    def idmapped_tree(self, source: str, ids: identity.SandboxIds,
                      lower_layer: bool = False) -> int:
        """A detached copy of ``source`` whose owner appears as the sandbox's host uid.

        As root, the sandbox runs as an unprivileged host uid; an idmapped mount lets it write
        to a host directory without changing anything on disk, and files it creates there are
        owned by the directory's owner (mount_setattr(2), MOUNT_ATTR_IDMAP). Never for an owner
        uid or gid 0 (identity.writable_bind): those files would be root's.
        """
        fd = _libc.open_tree_nofollow(source, _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC
                                      | _libc.AT_RECURSIVE)
        try:
            st = os.fstat(fd)  # the tree opened, not whatever the path names by now
            userns = self.userns_for(st.st_uid, st.st_gid, ids.uid, ids.gid, lower_layer)
            _libc.mount_setattr("", _libc.MOUNT_ATTR_IDMAP, recursive=True, userns_fd=userns,
                                dirfd=fd, empty_path=True)
        except OSError:
            os.close(fd)
            raise
        return fd

    def userns_for(self, disk_uid: int, disk_gid: int, host_uid: int, host_gid: int,
                   lower_layer: bool = False) -> int:
        # Defense in depth: whatever the caller, an idmap never makes files root's on the host.
        # A project's lower layer is the exception for its owner on disk: that mount is
        # read-only and hidden from the sandbox (overlayfs writes only its upper tmpfs), so
        # nothing is ever written through it; the sandbox's side is never 0.
        if 0 in (host_uid, host_gid) or (0 in (disk_uid, disk_gid) and not lower_layer):
            raise OSError(1, "an idmapped mount never maps to or from id 0")
        key = (disk_uid, disk_gid, host_uid, host_gid)
        if key not in self.idmap_userns:
            ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
            hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(hold_w)
                    _libc.unshare(_libc.CLONE_NEWUSER)
                    os.write(ready_w, b"1")
                    os.read(hold_r, 1)
                finally:
                    os._exit(0)
            os.close(ready_w)
            os.close(hold_r)
            try:
                if os.read(ready_r, 1) != b"1":
                    raise OSError(0, "could not create the user namespace for an idmapped mount")
                with open(f"/proc/{pid}/uid_map", "w") as f:
                    f.write(f"{disk_uid} {host_uid} 1\n")
                with open(f"/proc/{pid}/gid_map", "w") as f:
                    f.write(f"{disk_gid} {host_gid} 1\n")
                self.idmap_userns[key] = os.open(f"/proc/{pid}/ns/user",
                                                 os.O_RDONLY | os.O_CLOEXEC)
            finally:
                os.close(ready_r)
                os.close(hold_w)
                os.waitpid(pid, 0)
        return self.idmap_userns[key]

    def write_id_maps(self, pid: int, plan: WirePlan) -> None:
        # The launch's pins now belong to this sandbox: reap restores the modes (restore_pins).
        self.pins[pid], self.pending_pins = self.pending_pins, []
        # Decided again from the same holdings: open_sources refused already if there is none.
        try:
            ids = identity.decide(self.identity, plan["host_uid"], plan["host_gid"])
        except HostError as exc:
            raise OSError(1, str(exc.args[0])) from None
        if not ids.mapper:
            # Unprivileged writers must give up setgroups first (user_namespaces(7)).
            with open(f"/proc/{pid}/setgroups", "w") as f:
                f.write("deny")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"{plan['uid']} {ids.uid} 1\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{plan['gid']} {ids.gid} 1\n")

    def restore_pins(self, pid: int) -> None:
        """The sandbox is gone: its writable binds' directories get their modes back (it may
        own them through the bind and chmod them, e.g. to 0777)."""
        self.release_pins(self.pins.pop(pid, []))

    @staticmethod
    def release_pins(pins: list[tuple[int, int]]) -> None:
        for fd, mode in pins:
            try:
                identity.restore_mode(fd, mode)
            finally:
                os.close(fd)

    def close_limits(self, launch: Launch, remove: bool = True) -> dict[str, Any]:
        """Read the run's usage, then remove its cgroup (killing what is left in it).

        ``remove=False`` leaves the removal to ``remove_cgroup``, after the report is out.
        """
        if launch.limits is None:
            return {}
        limits = launch.limits
        try:
            outcome = limits.finish()
        except OSError as exc:
            outcome = {"degraded": limits.degraded, "usage_error": str(exc)}
        if remove:
            launch.limits = None
            try:
                limits.close()
            except OSError as exc:  # left behind for the next helper to reclaim
                outcome["cleanup_error"] = str(exc)
        return outcome

    def remove_cgroup(self, launch: Launch) -> None:
        # After the report: removing the cgroups takes about 0.25 ms that the caller need not
        # wait for. Everything in them was killed by finish(); one that cannot be removed now
        # is left behind for the next helper to reclaim (nsbox/cgroups).
        limits, launch.limits = launch.limits, None
        if limits is not None:
            try:
                limits.close()
            except OSError:
                pass

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
        request = json.loads(data)
        if request.get("cmd") == "kill":
            launch.kill(str(request.get("reason", "killed")))

    # --- learning mode: the seccomp listener ------------------------------------------------

    def receive_listener(self, launch: Launch) -> None:
        """The child sends the listener right after loading the filter, or nothing (EOF) when
        it failed before; either way this socket's work is done."""
        assert launch.notify_sock is not None
        try:
            _msg, fds = _wire.receive_fds(launch.notify_sock, 16, 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            fds = []
        self.selector.unregister(launch.notify_sock)
        launch.notify_sock.close()
        launch.notify_sock = None
        if fds:
            launch.denied = DeniedSyscalls(fds[0], launch.notify_table or {})
            self.selector.register(fds[0], selectors.EVENT_READ,
                                   lambda _f: self.serve_listener(launch))

    def serve_listener(self, launch: Launch) -> None:
        if launch.denied is None or launch.denied.listener < 0:
            return
        if not launch.denied.handle():
            self.selector.unregister(launch.denied.listener)
            launch.denied.close()

    def close_notify(self, launch: Launch) -> None:
        if launch.notify_sock is not None:
            try:
                self.selector.unregister(launch.notify_sock)
            except (KeyError, ValueError):
                pass
            launch.notify_sock.close()
            launch.notify_sock = None
        if launch.denied is not None and launch.denied.listener >= 0:
            try:
                self.selector.unregister(launch.denied.listener)
            except (KeyError, ValueError):
                pass
            launch.denied.close()

    # --- network allow mode: the proxy listener -----------------------------------------------

    def close_net(self, launch: Launch) -> None:
        if launch.net_sock is not None:
            try:
                self.selector.unregister(launch.net_sock)
            except (KeyError, ValueError):
                pass
            launch.net_sock.close()
            launch.net_sock = None

    def pass_proxy_listener(self, launch: Launch) -> None:
        """Hand the proxy listener from the sandbox child on to the host process. The child
        sends it before exec; end-of-file means it failed before (its error pipe says why)."""
        if launch.net_sock is None:
            return
        try:
            fd = _netns.receive_listener(launch.net_sock)
        except OSError:
            fd = None
        self.close_net(launch)
        if fd is not None:
            launch.send_fd({"event": "proxy"}, fd)
            os.close(fd)

    def reap(self, launch: Launch) -> None:
        try:
            report = self.exit_report(launch)
        except Exception as exc:
            report = {"event": "exit", "setup_error": failure_info("reap", exc)}
        self.finish(launch, report)

    def exit_report(self, launch: Launch) -> ExitReport:
        _pid, status, rusage = os.wait4(launch.pid, 0)
        launch.reaped = True
        reaped_ns = time.monotonic_ns()
        self.pass_proxy_listener(launch)  # if it is still here: the host gets it before the exit
        if launch.notify_sock is not None:  # sent before exec, not read yet
            self.receive_listener(launch)
        denied = None
        if launch.notify_table:
            denied = launch.denied.names() if launch.denied else []
        self.close_notify(launch)
        wall = time.monotonic() - launch.started
        if launch.err_fd >= 0:
            os.set_blocking(launch.err_fd, False)
            try:
                while chunk := os.read(launch.err_fd, 65536):
                    launch.err_data += chunk
            except BlockingIOError:
                pass
            self.drop_fd(launch, "err_fd")
        child_trace, setup_error, reported = _child.read_report(launch.err_data)
        status = _child.command_status(status, reported)
        limits = self.close_limits(launch, remove=False)
        report: ExitReport = {
            "event": "exit",
            "wait_status": status,
            "wall_time": wall,
            "cpu_user": rusage.ru_utime,
            "cpu_system": rusage.ru_stime,
            "maxrss_kib": rusage.ru_maxrss,
            "timed_out": launch.timed_out,
            "kill_reason": launch.kill_reason,
            "setup_error": launch.internal_error or setup_error,  # the helper's is the cause
            "seccomp_denied": denied,
            "limits": limits,
            "core": launch.core,
        }
        if launch.trace is not None:
            report["trace"] = [*launch.trace, *child_trace, ("helper: reaped", reaped_ns)]
        return report

    def finish(self, launch: Launch, report: ExitReport) -> None:
        """Send the launch's report, then release everything it held."""
        self.restore_pins(launch.pid)  # the bound directories' modes, before the caller hears
        self.launches.discard(launch)
        launch.send(report)
        try:
            self.remove_cgroup(launch)
            if self.spawners is not None:
                self.spawners.refill_later()
            if launch.pool is not None:  # a pooled sandbox: the pool prepares what follows
                launch.pool.ended(launch, report.get("setup_error"))
        finally:
            try:
                launch.cleanup.close()  # the sandbox's mounts are torn down here (mnt_ns)
            finally:
                if launch.sock is not None:
                    self.unwatch_requests(launch)
                    launch.sock.close()


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
    os.close(null)
    control = socket.socket(fileno=fd)
    os.set_inheritable(control.fileno(), False)
    # The helper must not be stopped by the terminal's ^C meant for the host program: the host
    # decides when sandboxes end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Helper(control).loop()


if __name__ == "__main__":
    main()
