"""``Session.run``: a command of a session, with the arguments ``subprocess.run`` has too.

The session's own part, one command of its init (``Session._run_command``), is in
nsbox/session/session.py; this is the door: ``input``, ``text``, ``check`` and ``capture_output``
checked (nsbox/policy/inputs.py, ``call_args``), and the Result decoded or raised as ``nsbox.run``
does (nsbox/result.py, ``finish``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from nsbox.policy import inputs
from nsbox.result import Result, finish

if TYPE_CHECKING:
    from nsbox.launch.launcher import Cancel


class SessionRun:
    """The ``run`` method of nsbox.Session."""

    timeout: float | None  # the session's default deadline (Session's)

    def _run_command(self, argv: Sequence[str], *, stdin: bytes | str | int | None = None,
                    timeout: float | None = None, output_limit: int | None = None,
                    env: dict[str, str] | None = None, cwd: str | None = None,
                    passthrough: bool = False,
                    _sinks: tuple[int | None, int | None] | None = None,
                    cancel: Cancel | None = None, tty: list[int] | None = None
                    ) -> Result[bytes]:
        raise NotImplementedError  # Session._run_command

    def _run_checked(self, cmd: inputs.Command, *, passthrough: bool = False,
                     sinks: tuple[int | None, int | None] | None = None,
                     cancel: Cancel | None = None, tty: list[int] | None = None
                     ) -> Result[bytes]:
        raise NotImplementedError  # Session._run_checked

    @overload
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: Literal[False] = False,
            encoding: None = None, errors: None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False,
            _sinks: tuple[int | None, int | None] | None = None) -> Result[bytes]: ...
    @overload
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: Literal[True],
            encoding: str | None = None, errors: str | None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False,
            _sinks: tuple[int | None, int | None] | None = None) -> Result[str]: ...
    def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
            stdin: bytes | str | int | None = None, text: bool = False,
            encoding: str | None = None, errors: str | None = None, check: bool = False,
            capture_output: bool | None = None, timeout: float | None = None,
            output_limit: int | None = None, env: dict[str, str] | None = None,
            cwd: str | None = None, passthrough: bool = False,
            _sinks: tuple[int | None, int | None] | None = None) -> Result[Any]:
        """Run ``argv`` in the session and return its Result.

        The arguments are ``nsbox.run``'s (``input``, ``text``, ``check``, ``capture_output``
        as ``subprocess.run``'s; docs/api.md), less the policy and the workspace, which are the
        session's. ``timeout`` and ``output_limit`` default to the session's. A timeout (TO)
        or output limit (OL) ends this command and everything it started, never the session.
        """
        return run_cancellable(
            self, argv, input=input, stdin=stdin, text=text, encoding=encoding, errors=errors,
            check=check, capture_output=capture_output, timeout=timeout,
            output_limit=output_limit, env=env, cwd=cwd, passthrough=passthrough,
            _sinks=_sinks)


# --- one command of a session: with nsbox's own arguments, or with subprocess's (cancellable) ---


def run_command(session: SessionRun, argv: Sequence[str], *,
                stdin: bytes | str | int | None = None, timeout: float | None = None,
                output_limit: int | None = None, env: dict[str, str] | None = None,
                cwd: str | None = None, passthrough: bool = False,
                sinks: tuple[int | None, int | None] | None = None,
                cancel: Cancel | None = None, tty: list[int] | None = None) -> Result[bytes]:
    """One command of ``session`` with nsbox's own arguments (checked there), its Result
    neither decoded nor raised: nsbox.run's audited run (nsbox/api.py) and a published
    session's supervisor (nsbox/session/supervisor.py, with the client's ``sinks`` and
    ``tty``)."""
    return session._run_command(argv, stdin=stdin, timeout=timeout, output_limit=output_limit,
                                env=env, cwd=cwd, passthrough=passthrough, _sinks=sinks,
                                cancel=cancel, tty=tty)


def run_checked(session: SessionRun, cmd: inputs.Command, *, passthrough: bool = False,
                cancel: Cancel | None = None) -> Result[bytes]:
    """``run_command`` with a command nsbox.run's door has checked (nsbox/api.py, an audited
    run): it is not checked again."""
    return session._run_checked(cmd, passthrough=passthrough, cancel=cancel)


def run_cancellable(session: SessionRun, argv: Any, *, input: Any = None, stdin: Any = None,
                    text: Any = False, encoding: Any = None, errors: Any = None,
                    check: Any = False, capture_output: Any = None, timeout: Any = None,
                    output_limit: Any = None, env: Any = None, cwd: Any = None,
                    passthrough: Any = False,
                    _sinks: tuple[int | None, int | None] | None = None,
                    cancel: Cancel | None = None) -> Result[Any]:
    """``session.run``, which ``cancel`` can kill from another thread (nsbox/aio.py)."""
    call = inputs.call_args(input_=input, stdin_=stdin, text_=text, encoding=encoding,
                            errors=errors, check=check, capture_output=capture_output,
                            passthrough=passthrough)
    result = session._run_command(argv, stdin=call.stdin, timeout=timeout,
                                  output_limit=output_limit, env=env, cwd=cwd,
                                  passthrough=call.passthrough, _sinks=_sinks, cancel=cancel)
    deadline = timeout if isinstance(timeout, (int, float)) else session.timeout
    return finish(result, call.text, call.check, list(argv), deadline)
