"""``nsbox.run``: one command in a new sandbox, plain or with an audit record.

The only module that imports both the launch (nsbox/launch/launcher.py) and the session
(nsbox/session/session.py): an audited run is a session of one command, so that the files it
produced are listed before the sandbox goes away, and a session launches through the launcher.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, overload

from nsbox.errors import NsboxError, PolicyError
from nsbox.launch import launcher
from nsbox.policy import checks, inputs
from nsbox.policy.policy import Policy
from nsbox.result import Result, finish


@overload
def run(argv: Sequence[str], policy: Policy | None = None, *, input: bytes | str | None = None,
        stdin: bytes | str | int | None = None, text: Literal[False] = False,
        encoding: None = None, errors: None = None, check: bool = False,
        capture_output: bool | None = None, timeout: float | None = None,
        output_limit: int | None = None, env: dict[str, str] | None = None,
        workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
        passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
        profile: str | os.PathLike[str] | None = None) -> Result[bytes]: ...
@overload
def run(argv: Sequence[str], policy: Policy | None = None, *, input: bytes | str | None = None,
        stdin: bytes | str | int | None = None, text: Literal[True],
        encoding: str | None = None, errors: str | None = None, check: bool = False,
        capture_output: bool | None = None, timeout: float | None = None,
        output_limit: int | None = None, env: dict[str, str] | None = None,
        workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
        passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
        profile: str | os.PathLike[str] | None = None) -> Result[str]: ...
def run(argv: Sequence[str], policy: Policy | None = None, *, input: bytes | str | None = None,
        stdin: bytes | str | int | None = None, text: bool = False,
        encoding: str | None = None, errors: str | None = None, check: bool = False,
        capture_output: bool | None = None, timeout: float | None = None,
        output_limit: int | None = None, env: dict[str, str] | None = None,
        workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
        passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
        profile: str | os.PathLike[str] | None = None) -> Result[Any]:
    """Run ``argv`` in a new sandbox and return its Result.

    Arguments as ``subprocess.run``'s where they mean the same (docs/api.md, "Coming from
    subprocess"):

    - ``input``: bytes or str to feed on stdin (``stdin``: the same, or an open descriptor;
      not both). Without either, stdin is /dev/null.
    - ``text``: the Result's ``stdout`` and ``stderr`` are str, decoded as ``encoding``
      (default UTF-8) with ``errors`` (default ``"replace"``: the output is the sandbox's).
    - ``check``: raise CommandFailed (a ``subprocess.CalledProcessError`` carrying the Result)
      unless the status is OK; CommandTimedOut (also a ``subprocess.TimeoutExpired``) for TO.
    - ``capture_output``: the output is captured by default; ``capture_output=False`` sends it
      to this process's stdout and stderr as it arrives (``passthrough=True``), still capped.
    - ``timeout``: seconds of wall-clock time; at the deadline the whole sandbox is killed and
      the status is TO (an exception only with ``check``).

    The sandbox is ``policy``, or the profile ``profile`` names (a shipped profile or a TOML
    file), or the default policy; ``workspace`` is a host directory bound at /workspace
    (default: a fresh tmpfs); ``env`` adds variables; ``cwd`` is the working directory inside;
    ``output_limit`` caps stdout + stderr in bytes (past it: status OL); ``audit`` names a file
    that gets one JSON line for the run (docs/sessions.md, "Audit").

    Raises CommandNotFound (also a FileNotFoundError) when the program does not exist inside
    the sandbox, SetupError when the sandbox cannot be built, and PolicyError naming the
    argument for a bad value (docs/api.md, "Errors"), before anything starts.
    """
    return run_cancellable(
        argv, policy, input=input, stdin=stdin, text=text, encoding=encoding, errors=errors,
        check=check, capture_output=capture_output, timeout=timeout, output_limit=output_limit,
        env=env, workspace=workspace, cwd=cwd, passthrough=passthrough, audit=audit,
        profile=profile)


def run_cancellable(argv: Any, policy: Any = None, *, input: Any = None, stdin: Any = None,
                   text: Any = False, encoding: Any = None, errors: Any = None,
                   check: Any = False, capture_output: Any = None, timeout: Any = None,
                   output_limit: Any = None, env: Any = None, workspace: Any = None,
                   cwd: Any = None, passthrough: Any = False, audit: Any = None,
                   profile: Any = None, cancel: launcher.Cancel | None = None,
                   tty: tuple[int, int] | None = None) -> Result[Any]:
    """``run``, which ``cancel`` can kill from another thread (nsbox/aio.py), on a pty of its
    own for ``tty`` (rows, columns; `nsbox run --tty`, nsbox/host/terminal.py). The one door
    of a launch: every argument is checked here, once, and the launch gets them checked."""
    call = inputs.call_args(input_=input, stdin_=stdin, text_=text, encoding=encoding,
                            errors=errors, check=check, capture_output=capture_output,
                            passthrough=passthrough)
    cmd = inputs.command(argv, stdin_=call.stdin, timeout=timeout, output_limit_=output_limit,
                         env_=env, cwd=cwd, passthrough=call.passthrough)
    workspace = checks.optional_path(workspace, "workspace")
    policy = launcher.choose_policy(policy, profile)
    if workspace is not None:
        policy = policy.replace(workspace=workspace)
    if audit is None:
        result = launcher.launch(cmd, policy, passthrough=call.passthrough, cancel=cancel,
                                 tty=tty)
    elif tty is not None:
        raise PolicyError("a run on a pty has no audit record", key="audit",
                          hint="leave out audit, or the pty")
    else:
        result = run_audited(cmd, policy, audit=checks.path(audit, "audit"),
                             passthrough=call.passthrough, cancel=cancel)
    deadline = cmd.timeout if cmd.timeout is not None else policy.limits.wall_time
    return finish(result, call.text, call.check, cmd.argv, deadline)


def run_audited(cmd: inputs.Command, policy: Policy, *, audit: str, passthrough: bool,
                cancel: launcher.Cancel | None = None) -> Result:
    """``nsbox.run`` with an audit record: one command in a session of its own, so that the
    files it produced can be listed (and hashed) before the sandbox goes away."""
    if policy.seccomp.log_denied:
        # Learning mode needs a launch of its own; the record then lists no produced files.
        return _run_audited_plain(cmd, policy, audit=audit, passthrough=passthrough,
                                  cancel=cancel)
    from nsbox.session.run import run_checked  # not on the plain run's path
    from nsbox.session.session import of_command

    with of_command(policy, cmd, audit) as session:
        return run_checked(session, cmd, passthrough=passthrough, cancel=cancel)


def _run_audited_plain(cmd: inputs.Command, policy: Policy, *, audit: str, passthrough: bool,
                       cancel: launcher.Cancel | None) -> Result:
    from nsbox.host import audit as auditmod  # not on the plain run's path

    log = auditmod.AuditLog(audit)
    result: Result | None = None
    error: NsboxError | None = None
    try:
        result = launcher.launch(cmd, policy, passthrough=passthrough, cancel=cancel)
        return result
    except NsboxError as exc:
        error = exc
        raise
    finally:
        cap = cmd.output_limit if cmd.output_limit is not None else policy.limits.output
        shown = auditmod.set_env(policy, cmd.env or {})
        record = auditmod.command_record(
            argv=cmd.argv, policy=policy, session=None, env=shown, stdin=cmd.stdin,
            timeout=cmd.timeout if cmd.timeout is not None else policy.limits.wall_time,
            output_limit=cap, result=result, error=error)
        record["files_produced"] = None  # not listed: the sandbox is gone
        log.write(record, secrets=shown.values())
        log.close()
