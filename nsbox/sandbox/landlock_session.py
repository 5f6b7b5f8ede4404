"""A session's init in the Landlock mode: nsbox/sandbox/sessioninit.py's, without namespaces.

The init becomes the sandbox's user as a single run's child does (nsbox/sandbox/landlocked.py),
keeps no capability, takes a Landlock layer of scopes alone and is a child subreaper. Each
command is a plain fork that becomes that command's own init (the same steps as a single run:
its own scoped layer, then the command's full layer), so a deadline or a kill (TREE_SIGNAL to
that init) ends the command and everything it started, never the session. When the session's
init ends (the host closed the session, the helper killed it with TREE_SIGNAL, or died), every
command's init gets TREE_SIGNAL through PR_SET_PDEATHSIG and ends its tree.

File operations reach the workspace only (a relative path, or one below /workspace): there is
no root of the sandbox's own to resolve other paths in. They run in a forked child with the
sandbox's uid and no capability, walking from the workspace with no symlink followed
(nsbox/sandbox/fileworker.py).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, NoReturn

from nsbox._sys import libc as _libc
from nsbox._sys import wire as _wire
from nsbox.sandbox import child as _child
from nsbox.sandbox import fileworker, sessioninit
from nsbox.sandbox import landlocked as _landlocked


def main(ctx: _child.Context) -> NoReturn:
    try:
        _landlocked.become_sandbox_user(ctx)
        ctx.step = "session init"
        _landlocked.drop_capabilities()
        _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
        _landlocked.become_keeper(ctx, os.getppid())
        init = LandlockInit(ctx)
    except OSError as exc:
        _child.fail(ctx, exc.errno or 0, exc.strerror or str(exc))
    except Exception as exc:
        _child.fail(ctx, 0, f"{type(exc).__name__}: {exc}")
    try:
        init.serve()
    finally:
        os._exit(0)


class LandlockInit(sessioninit.Init):
    clone_flags = int(signal.SIGCHLD)
    kill_signal = _landlocked.TREE_SIGNAL

    def keep_privileges(self) -> None:
        """It holds none (become_sandbox_user, drop_capabilities)."""
        self.session_pid = os.getpid()

    def run_command(self, command: dict[str, Any]) -> NoReturn:
        _landlocked.finish_and_exec(self.ctx, command, self.session_pid)

    def run_file_op(self, op: dict[str, Any]) -> int:
        _libc.close_range(3)
        workspace = str(self.ctx.plan["landlock"]["workspace"])
        paths = op["paths"] if isinstance(op.get("paths"), list) else [op.get("path", "")]
        for path in paths:
            if in_workspace(path, workspace) is None:
                reason = "the Landlock mode reaches the workspace only (a relative path)"
                _wire.write_all(2, json.dumps({"path": path, "reason": reason}).encode())
                return 1
        op = dict(op)
        if "path" in op:
            op["path"] = in_workspace(op["path"], workspace)
        if isinstance(op.get("paths"), list):
            op["paths"] = [in_workspace(path, workspace) for path in op["paths"]]
        # Walked from the workspace itself: the directories above it may not be readable
        # by the sandbox's uid (nsbox/helper/landlocked.py makes them 0711).
        fileworker.ROOT, fileworker.WORKSPACE = workspace, ""
        return fileworker.perform(self.ctx, op)


def in_workspace(path: str, workspace: str) -> str | None:
    """A path of the sandbox's relative to the workspace, or None: outside it."""
    if not path.startswith("/"):
        return path
    if path == "/workspace" or path.startswith("/workspace/"):
        return path[len("/workspace"):].lstrip("/")
    return None
