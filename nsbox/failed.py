"""The errors ``check=True`` raises: a command that did not end OK, as subprocess's errors.

Apart from nsbox/errors.py because they subclass subprocess's, and ``import subprocess`` costs
a few milliseconds that the command line and the launch helper do not pay: this module is
imported only when one is raised or named (``nsbox.CommandFailed``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nsbox.errors import NsboxError

if TYPE_CHECKING:  # nsbox/result.py imports this module when it raises one of its errors
    from nsbox.result import Result

# A Status is also its str value (nsbox/result.py): the time-limit status, without the import.
_TIMED_OUT = "TO"


class CommandFailed(NsboxError, subprocess.CalledProcessError):
    """A command run with ``check=True`` did not end OK (status RE, SG, ML, OL or XX).

    ``result`` is its whole Result. As a ``subprocess.CalledProcessError`` it also has
    ``returncode`` (``Result.returncode``), ``cmd``, ``output``/``stdout`` and ``stderr``, so
    ``except subprocess.CalledProcessError`` catches it too. A time limit raises the subclass
    CommandTimedOut.
    """

    def __init__(self, result: Result[Any], cmd: Sequence[str] = ()) -> None:
        Exception.__init__(self, result.status.value)
        self.result = result
        self.cmd = list(cmd)
        self.returncode = result.returncode  # type: ignore[assignment]
        self.output = result.stdout
        self.stderr = result.stderr

    def __str__(self) -> str:
        result = self.result
        command = f"{self.cmd!r} " if self.cmd else ""
        if result.exit_code is not None:
            how = f"exit status {result.exit_code}"
        elif result.signal is not None:
            how = f"signal {result.signal}"
        else:
            how = result.error or "no exit status"
        limit = result.extra.get("limit") or ("wall_time" if result.status == _TIMED_OUT else "")
        limit = f", {limit} limit" if limit else ""
        return f"command {command}ended with status {result.status.value} ({how}{limit})"


class CommandTimedOut(CommandFailed, subprocess.TimeoutExpired):
    """A command run with ``check=True`` reached its wall-clock or CPU-time limit (status
    TO). Also a ``subprocess.TimeoutExpired``; ``timeout`` is the run's wall-clock limit in
    seconds when known, else None."""

    def __init__(self, result: Result[Any], cmd: Sequence[str] = (),
                 timeout: float | None = None) -> None:
        super().__init__(result, cmd)
        self.timeout = timeout  # type: ignore[assignment]


def failure(result: Result[Any], cmd: Sequence[str], timeout: float | None) -> CommandFailed:
    """The error for a Result that is not OK."""
    if result.status == _TIMED_OUT:
        return CommandTimedOut(result, cmd, timeout)
    return CommandFailed(result, cmd)
