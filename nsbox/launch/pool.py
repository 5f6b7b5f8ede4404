"""A warm pool of sandboxes for embedders: ``nsbox.Pool(policy, size=N)``.

The launch helper prepares ``size`` sandboxes ahead (cloned with all namespaces, id maps written,
root and mounts built) and keeps them waiting for a command; ``Pool.run`` hands one its command,
so the caller waits only for what is per command: limits, capabilities, seccomp and the exec.
Each sandbox runs exactly one command and is then destroyed; the helper prepares a replacement
in the background. Nothing passes from one command to the next: every command gets namespaces,
a root, /tmp and /workspace of its own.

The sandboxes die with the pool (``close`` or the end of the ``with`` block) and with the host
process. nsbox/helper/pool.py documents the helper's side.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Literal, cast, overload

from nsbox._sys import wire as _wire
from nsbox._sys.wire import PoolMessage, PoolSpec, WireCommand, WirePlan
from nsbox.errors import LaunchError, PolicyError
from nsbox.launch import launcher
from nsbox.plan import plan as planmod
from nsbox.policy import checks, inputs, limits
from nsbox.policy.policy import Policy
from nsbox.result import Result, finish

# What a command brings; everything else of the plan is fixed when the pool is made.
MAX_SIZE = 1024  # sandboxes prepared at once: each holds processes, mounts and memory
COMMAND_KEYS = ("argv", "env", "cwd", "rlimits", "seccomp_bpf", "seccomp_notify", "wall_time")


class Pool:
    """Sandboxes prepared ahead from one policy; each serves exactly one command.

    ``run`` takes the same arguments as ``nsbox.run`` except the policy and the workspace,
    which belong to the pool. Safe to use from several threads.
    """

    def __init__(self, policy: Policy | None = None, size: int = 2, *,
                 workspace: str | None = None) -> None:
        checks.whole(size, "size", 1, MAX_SIZE, "a number of sandboxes")
        workspace = checks.optional_path(workspace, "workspace")
        policy = inputs.policy(policy) or Policy()
        if workspace is not None:
            policy = policy.replace(workspace=workspace)
        if policy.network.mode == "allow":
            raise PolicyError("a pool cannot prepare sandboxes for network allow mode (its "
                              "proxy is per run); use nsbox.run", key="network.mode")
        if launcher.isolation.mode_for(policy) == launcher.isolation.LANDLOCK:
            raise PolicyError("a pool prepares sandboxes in namespaces, which this host refuses "
                              "(the Landlock mode)", key="isolation",
                              hint="use nsbox.run or a Session, which run in the Landlock mode")
        self.policy = policy
        self.size = size
        # Checked and resolved once: a bad policy fails here, not at the first command.
        wire = launcher.build_plan(policy, ["true"]).to_wire()
        wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid)
        # What a command needs from the policy (rlimits, the seccomp program) is the same for
        # every command: taken once, here; only argv, env, cwd and the deadline are per command.
        self._template = cast(WireCommand, {key: wire.get(key) for key in COMMAND_KEYS})
        if os.environ.get("NSBOX_TRACE") == "1":
            wire["trace"] = True
        if os.environ.get("NSBOX_NATIVE") == "0":
            wire["native"] = False  # the Python child (nsbox/sandbox/native.py)
        self._lock = threading.Lock()
        self._sock: socket.socket | None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            spec: PoolSpec = {"plan": cast(WirePlan, wire), "size": size}
            launcher.helper_client.send_request({"pool": spec}, [theirs.fileno()])
        except BaseException:
            self._sock.close()
            raise
        finally:
            theirs.close()

    def wait_ready(self, timeout: float | None = 30.0) -> None:
        """Wait until all ``size`` sandboxes are prepared (e.g. before a latency-critical
        command, or between measurements; None waits as long as it takes). Raises SetupError
        when they cannot be built, LaunchError when the time is up."""
        timeout = checks.optional_seconds(timeout, "timeout")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            try:
                self._send({"wait_ready": True}, [theirs.fileno()])
            finally:
                theirs.close()
            ours.settimeout(timeout)
            try:
                answer = ours.recv(65536)
            except TimeoutError:
                raise LaunchError(f"the pool was not ready within {timeout} s") from None
        if answer == b"ready":
            return
        if not answer:
            raise LaunchError("the pool is closed, or its launch helper is gone")
        raise launcher.setup_error_from(json.loads(answer))

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the sandboxes still waiting; commands already running finish."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    @overload
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: Literal[False] = False,
            encoding: None = None, errors: None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False) -> Result[bytes]: ...
    @overload
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: Literal[True],
            encoding: str | None = None, errors: str | None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False) -> Result[str]: ...
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: bool = False,
            encoding: str | None = None, errors: str | None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False) -> Result[Any]:
        """Run ``argv`` in one of the prepared sandboxes. The arguments are ``nsbox.run``'s
        (``input``, ``text``, ``check``, ``capture_output`` as ``subprocess.run``'s;
        docs/api.md), less the policy and the workspace, which are the pool's."""
        return self._run_cancellable(
            argv, input=input, stdin=stdin, text=text, encoding=encoding, errors=errors,
            check=check, capture_output=capture_output, timeout=timeout,
            output_limit=output_limit, env=env, cwd=cwd, passthrough=passthrough)

    def _run_cancellable(self, argv: Any, *, input: Any = None, stdin: Any = None,
                        text: Any = False, encoding: Any = None, errors: Any = None,
                        check: Any = False, capture_output: Any = None, timeout: Any = None,
                        output_limit: Any = None, env: Any = None, cwd: Any = None,
                        passthrough: Any = False, cancel: launcher.Cancel | None = None
                        ) -> Result[Any]:
        """``run``, which ``cancel`` can kill from another thread (nsbox/aio.py)."""
        trace = launcher.trace_start()
        call = inputs.call_args(input_=input, stdin_=stdin, text_=text, encoding=encoding,
                                errors=errors, check=check, capture_output=capture_output,
                                passthrough=passthrough)
        cmd = inputs.command(argv, stdin_=call.stdin, timeout=timeout,
                             output_limit_=output_limit, env_=env, cwd=cwd,
                             passthrough=call.passthrough)
        command = self._command(cmd.argv, cmd.env, cmd.cwd, cmd.timeout)
        cap = cmd.output_limit if cmd.output_limit is not None else self.policy.limits.output
        result = launcher.launch_wire(dict(command), cmd.stdin, cap, call.passthrough,
                                  submit=self._submit, trace=trace, cancel=cancel)
        limits.note_disk(result, self.policy.workspace, self.policy.limits.workspace_size)
        return finish(result, call.text, call.check, cmd.argv, command["wall_time"])

    def _command(self, argv: list[str], env: dict[str, str] | None, cwd: str | None,
                 timeout: float | None) -> WireCommand:
        """The command's part of the plan, as planmod.build makes it, without resolving the
        policy's mounts again: the policy's part taken once (the template), and the command's
        own (tests/test_perf.py checks that the two make what build would)."""
        own = planmod.command_part(self.policy, argv, env=env, cwd=cwd, wall_time=timeout)
        return cast(WireCommand, {**self._template, **own})

    def _submit(self, command: WireCommand, fds: list[int]) -> None:
        self._send({"command": command}, fds)

    def _send(self, request: PoolMessage, fds: list[int]) -> None:
        with self._lock:
            if self._sock is None:
                raise LaunchError("the pool is closed")
            try:
                _wire.send(self._sock, request, fds)  # any size (nsbox/_sys/wire.py)
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    raise LaunchError(f"the pool's launch helper is gone: {exc}") from None
                raise launcher.out_of_descriptors("cannot send the command to the pool",
                                                   exc) from None
