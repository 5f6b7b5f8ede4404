"""The launch helper's side of a warm pool (the host's side is nsbox/launch/pool.py).

A pool keeps ``size`` sandboxes prepared ahead: cloned with all namespaces, id maps written,
``_child.build_sandbox`` done (mounts, root, hostname, network), each blocked on its command
socket. A command takes one, the helper hands it the command and its stdio, and a replacement is
prepared once the command has ended. Each sandbox serves exactly one command and is then
reaped like any launch: nothing passes from one command to the next.

Protocol, on the pool socket (SOCK_SEQPACKET, JSON):

  host -> helper:     {"command": {...}} with SCM_RIGHTS [launch socket, stdin, stdout, stderr];
                      the launch socket then works as for nsbox.run (pid, exit, kill)
                      {"wait_ready": true} with SCM_RIGHTS [reply socket]: "ready" (or the
                      pool's error) goes there once all ``size`` sandboxes are prepared
                      end-of-file: the pool is closed; its idle sandboxes are killed
  helper <-> sandbox: the sandbox's fd 0 until its command: "ready" once built; then the
                      command (JSON) with SCM_RIGHTS [stdin, stdout, stderr]

A prepared sandbox that fails to build makes the pool fail: the error goes to every later
command (and to the Pool's constructor), and nothing more is prepared.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from nsbox._sys import wire as _wire
from nsbox._sys.wire import SetupErrorInfo, WirePlan
from nsbox.errors import HostError
from nsbox.sandbox import native as _native_core

if TYPE_CHECKING:
    from nsbox.helper.launch import Launch
    from nsbox.helper.loop import Helper

REFILL_DELAY = 0.002  # seconds


class HelperPool:
    def __init__(self, helper: Helper, sock: socket.socket, plan: WirePlan,
                 size: int) -> None:
        self.helper = helper
        self.sock = sock
        # The deadline runs from the command's arrival, not from the preparation.
        self.plan: WirePlan = {**plan, "pooled": True, "wall_time": None}
        self.size = max(1, size)
        self.ready: deque[Launch] = deque()
        self.preparing: set[Launch] = set()
        self.waiting: deque[tuple[dict[str, Any], list[int], int]] = deque()
        self.error: SetupErrorInfo | None = None
        self.closed = False
        self.command_socks: dict[Launch, socket.socket] = {}  # until each gets its command
        self.ready_waiters: list[socket.socket] = []
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        helper.selector.register(sock, selectors.EVENT_READ, lambda _f: self.on_message())
        self.fill()

    # --- preparing sandboxes --------------------------------------------------------------

    def fill(self) -> None:
        while (not self.closed and self.error is None
               and len(self.ready) + len(self.preparing) < self.size):
            self.prepare()

    def prepare(self) -> None:
        from nsbox.helper.launch import Launch, failure_info

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launch = Launch(None)
        launch.pool = self
        try:
            # A copy: the launch keeps its own plan (the helper sets its rlimits in it).
            self.helper.start(launch, self.plan.copy(),
                              [theirs.fileno(), self.devnull, self.devnull])
        except HostError as exc:  # e.g. no unprivileged identity (nsbox/policy/identity.py)
            ours.close()
            self.fail({"step": exc.feature, "errno": 0, "message": str(exc)})
            return
        except Exception as exc:  # StepFailed, or anything else: the pool fails, not the helper
            ours.close()
            self.fail(failure_info("prepare", exc))
            return
        finally:
            theirs.close()
        self.command_socks[launch] = ours
        self.preparing.add(launch)
        self.helper.selector.register(ours, selectors.EVENT_READ,
                                      lambda _f: self.on_ready(launch))

    def on_ready(self, launch: Launch) -> None:
        sock = self.command_socks[launch]
        try:
            data = sock.recv(16)
        except OSError:
            data = b""
        if data != b"ready":
            self.drop_command_sock(launch)  # it died while building: lost() follows at reap
            return
        self.preparing.discard(launch)
        self.ready.append(launch)
        self.dispatch_waiting()
        self.answer_ready_waiters()

    def answer_ready_waiters(self) -> None:
        if len(self.ready) < self.size and self.error is None and not self.closed:
            return
        answer = b"ready" if self.error is None else json.dumps(self.error).encode()
        for waiter in self.ready_waiters:
            try:
                waiter.send(answer)
            except OSError:
                pass
            waiter.close()
        self.ready_waiters.clear()

    def ended(self, launch: Launch, setup_error: SetupErrorInfo | None) -> None:
        """A sandbox of this pool was reaped: after its command, or before it had one.

        The replacement is prepared now, not at the hand-over: cloning and building it while
        the command runs would take the helper and a core away from that command.
        """
        dispatched = launch.sock is not None
        self.drop_command_sock(launch)
        self.preparing.discard(launch)
        if launch in self.ready:
            self.ready.remove(launch)
        if not dispatched and setup_error is not None and not self.closed:
            self.fail(setup_error)
        elif dispatched or launch.kill_reason is None:
            # Used, or killed from outside (e.g. the OOM killer): replace it, a moment later,
            # so that the caller gets the report (and the core) first.
            self.helper.call_later(REFILL_DELAY, self.fill)

    def fail(self, setup_error: SetupErrorInfo) -> None:
        self.error = setup_error
        self.answer_ready_waiters()
        while self.waiting:
            command, fds, _received = self.waiting.popleft()
            self.refuse(fds)

    def drop_command_sock(self, launch: Launch) -> None:
        sock = self.command_socks.pop(launch, None)
        if sock is not None:
            try:
                self.helper.selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

    # --- commands -------------------------------------------------------------------------

    def on_message(self) -> None:
        try:
            msg, fds = _wire.receive(self.sock, 4)
        except ValueError:
            return  # this message is lost alone (cut short, a bad memfd): its caller sees EOF
        except OSError:
            msg, fds = b"", []
        if not msg:
            for fd in fds:
                os.close(fd)
            self.close()
            return
        received = time.monotonic_ns()
        try:
            request = json.loads(msg)
            if request.get("wait_ready") and len(fds) == 1:
                self.ready_waiters.append(socket.socket(fileno=fds.pop()))
                self.answer_ready_waiters()
                return
            command = request["command"]
        except (ValueError, KeyError, TypeError, AttributeError):
            command = None
        if command is None or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            return
        if self.error is not None:
            self.refuse(list(fds))
            return
        self.waiting.append((command, list(fds), received))
        self.dispatch_waiting()

    def dispatch_waiting(self) -> None:
        while self.waiting and self.ready:
            command, fds, received = self.waiting.popleft()
            launch = self.ready.popleft()
            if not self.dispatch(launch, command, fds, received):
                self.waiting.appendleft((command, fds, received))
        if self.waiting:
            self.fill()  # more commands than sandboxes: prepare more at once

    def dispatch(self, launch: Launch, command: dict[str, Any], fds: list[int],
                 received: int) -> bool:
        sock = self.command_socks[launch]
        run_limits = getattr(launch, "limits", None)
        if run_limits is not None:
            # The rlimits the helper chose for this sandbox when it made its cgroup (with the
            # fallbacks for what the cgroup cannot limit), not the caller's plain list.
            command = {**command, "rlimits": run_limits.rlimits}
        if command.get("trace"):
            launch.trace = [("helper: receive command", received),
                            ("helper: hand over command", time.monotonic_ns())]
        else:
            launch.trace = None
        try:
            _wire.send_bytes(sock, self.command_message(launch, command), fds[1:4])
        except OSError:
            launch.kill("pool: sandbox gone before its command")
            self.drop_command_sock(launch)
            return False
        self.drop_command_sock(launch)
        for fd in fds[1:4]:
            os.close(fd)
        launch.sock = socket.socket(fileno=fds[0])
        launch.started = time.monotonic()
        try:
            self.helper.watch_requests(launch)
            if command.get("wall_time") is not None:
                launch.deadline = launch.started + float(command["wall_time"])
        except Exception as exc:  # this command fails, not the pool
            launch.fail("dispatch", exc)
            return True
        launch.send_fd({"event": "pid", "pid": launch.pid}, launch.pidfd)  # see Helper.release
        return True

    def command_message(self, launch: Launch, command: dict[str, Any]) -> bytes:
        """The command as its sandbox reads it: JSON for the Python child, the flat form for
        the native core (nsbox/sandbox/native.py). One the flat form cannot carry goes as JSON,
        which the native core refuses with a message that names the remedy."""
        if launch.core == "native":
            try:
                return _native_core.flatten_command(command, self.plan["setid_bpf"])
            except (ValueError, OverflowError):
                pass
        return json.dumps(command).encode()

    def refuse(self, fds: list[int]) -> None:
        sock = socket.socket(fileno=fds[0])
        try:
            sock.send(json.dumps({"event": "exit", "setup_error": self.error}).encode())
        except OSError:
            pass
        sock.close()
        for fd in fds[1:]:
            os.close(fd)

    def close(self) -> None:
        """The host closed the pool: idle sandboxes die; running commands finish."""
        self.closed = True
        try:
            self.helper.selector.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()
        for launch in [*self.ready, *self.preparing]:
            launch.kill("pool closed")
        self.answer_ready_waiters()
        while self.waiting:
            _command, fds, _received = self.waiting.popleft()
            for fd in fds:
                os.close(fd)
        os.close(self.devnull)
