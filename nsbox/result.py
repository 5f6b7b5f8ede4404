"""The result of one sandboxed command: plain data, safe to serialize."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nsbox.errors import NsboxError

# What the output fields hold: bytes, or str for a run with text=True (``Result.decoded``).
Out = TypeVar("Out", bytes, str)


class Status(str, enum.Enum):
    """How a command ended, as a two-letter code (the convention of programming-contest
    judges). A Status is also its str value: ``Status.OK == "OK"``.

    - ``OK``: exited with status 0.
    - ``RE``: "runtime error", exited with a non-zero status (``Result.exit_code``).
    - ``SG``: killed by a signal (``Result.signal``) nsbox did not send for a limit.
    - ``TO``: time out: the wall-clock limit (``timeout``) or the CPU-time limit.
    - ``ML``: memory limit: the run's cgroup counted an OOM kill.
    - ``OL``: output limit: stdout + stderr passed ``output_limit``; the run was stopped.
    - ``XX``: the sandbox failed around the command (``Result.error`` says what).

    docs/api.md, "Coming from subprocess", tells what each means for ``returncode`` and
    ``check=True``.
    """

    def __new__(cls, value: str, doc: str = "") -> Status:
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    OK = "OK", "The command exited with status 0."
    RE = "RE", "The command exited with a non-zero status (Result.exit_code)."
    SG = "SG", "The command was killed by a signal (Result.signal) that was not a limit's."
    TO = "TO", "The wall-clock or CPU-time limit was reached; the sandbox was killed."
    ML = "ML", "The memory limit was reached: the run's cgroup counted an OOM kill."
    OL = "OL", "The output passed the output limit; the sandbox was stopped."
    XX = "XX", "The sandbox failed around the command (Result.error says what)."


@dataclass
class Result(Generic[Out]):
    """What one command did, as plain data (``to_dict()`` gives it as JSON-ready values).

    How it ended:
        ``status``: a Status; ``ok`` is ``status is Status.OK``.
        ``returncode``: as ``subprocess``'s: the exit status, or ``-N`` for signal N.
        ``exit_code``: the exit status, when the command exited (else None).
        ``signal``: the signal number, when it was killed by one (else None).
        ``timed_out``, ``oom_killed``: a time limit ended it; the cgroup counted an OOM kill.
        ``error``: for XX, what failed.
        ``disk_full``: the writable places (``/tmp``, ``/workspace``, ``/dev/shm``) that were
        full when the command ended, e.g. ``["/tmp"]``: a failure may come from there.

    Its output, kept up to the output limit:
        ``stdout``, ``stderr``: bytes, or str for a run with ``text=True``.
        ``stdout_bytes``, ``stderr_bytes``: what the command wrote, also past the cap.
        ``stdout_truncated``, ``stderr_truncated``: whether the cap cut it.

    What it used (for every process of the run where a cgroup counted, see ``accounting``):
        ``wall_time``, ``cpu_user``, ``cpu_system`` in seconds; ``peak_memory`` in bytes;
        ``peak_pids``; ``accounting``: ``"cgroup"`` or ``"rusage"`` (the largest process).

    ``degraded``: the guarantees this host could only approximate, one line each (e.g. memory
    limited by RLIMIT_AS where no cgroup can be written). ``isolation``: ``"namespaces"``, or
    ``"landlock"`` where the host refuses them (docs/hosts.md), and then ``isolation_weaker``:
    every guarantee weaker than with namespaces, one "name: what" line each. ``extra``:
    per-feature data (the
    network log, the launch core, the session). docs/api.md and docs/limits.md say more.
    """

    status: Status
    exit_code: int | None = None
    signal: int | None = None
    wall_time: float = 0.0
    cpu_user: float = 0.0
    cpu_system: float = 0.0
    peak_memory: int = 0
    peak_pids: int | None = None
    stdout: Out = b""  # type: ignore[assignment]
    stderr: Out = b""  # type: ignore[assignment]
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    error: str | None = None
    disk_full: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    accounting: str = "rusage"
    isolation: str = "namespaces"
    isolation_weaker: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the command exited with status 0 (``status is Status.OK``)."""
        return self.status is Status.OK

    @property
    def returncode(self) -> int | None:
        """The exit status as ``subprocess`` gives it: the command's exit code, or ``-N`` when
        it was killed by signal N (also by nsbox at a limit: TO, ML and OL are ``-9``); None
        when it never ran to an end (XX)."""
        if self.exit_code is not None:
            return self.exit_code
        if self.signal is not None:
            return -self.signal
        return None

    def decoded(self, encoding: str = "utf-8", errors: str = "replace") -> Result[str]:
        """A copy whose ``stdout`` and ``stderr`` are text (what ``text=True`` returns). The
        output is the sandbox's: by default a byte that is not ``encoding`` becomes U+FFFD
        rather than an exception that would lose the Result; with ``errors="strict"`` such a
        byte raises OutputDecodeError, which holds the Result (its output as bytes)."""
        if isinstance(self.stdout, str) and isinstance(self.stderr, str):
            return self  # type: ignore[return-value]
        texts = {}
        for name in ("stdout", "stderr"):
            try:
                texts[name] = _text(getattr(self, name), encoding, errors)
            except UnicodeDecodeError as exc:  # errors="strict", and the sandbox wrote that
                raise OutputDecodeError(self, name, exc) from None  # type: ignore[arg-type]
        replace: Any = dataclasses.replace  # a Result[bytes] becomes a Result[str]
        return replace(self, **texts)  # type: ignore[no-any-return]

    def check_returncode(self) -> None:
        """Raise ``nsbox.CommandFailed`` (a ``subprocess.CalledProcessError``) unless the
        status is OK, as ``subprocess.CompletedProcess.check_returncode`` does."""
        if not self.ok:
            from nsbox.failed import CommandFailed  # imports subprocess: only when raised

            raise CommandFailed(self)

    def to_dict(self, *, with_output: bool = False) -> dict[str, Any]:
        """The Result as JSON-ready data (its output, as UTF-8 text, only ``with_output``)."""
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        del data["stdout"], data["stderr"]
        if with_output:
            data["stdout"] = _text(self.stdout, "utf-8", "replace")
            data["stderr"] = _text(self.stderr, "utf-8", "replace")
        return data


class OutputDecodeError(NsboxError, UnicodeDecodeError):
    """The output of a run with ``text=True`` did not decode with its ``encoding`` and
    ``errors`` (``errors="strict"``): ``result`` is the whole Result, its output as bytes, and
    ``stream`` names the one that failed (``"stdout"`` or ``"stderr"``). Also a
    UnicodeDecodeError (and a ValueError), with its ``encoding``, ``object``, ``start``, ``end``
    and ``reason``."""

    def __init__(self, result: Result[bytes], stream: str, error: UnicodeDecodeError) -> None:
        UnicodeDecodeError.__init__(self, error.encoding, error.object, error.start, error.end,
                                    error.reason)
        self.result = result
        self.stream = stream
        self.hint = ("the Result, its output as bytes, is this error's .result; "
                     'errors="replace" (the default) never raises')

    def __str__(self) -> str:
        return f"{self.stream}: {super().__str__()}"


def _text(data: bytes | str, encoding: str, errors: str) -> str:
    return data if isinstance(data, str) else data.decode(encoding, errors)


def finish(result: Result[bytes], text: tuple[str, str] | None, check: bool,
           cmd: list[str], timeout: float | None) -> Result[Any]:
    """What a run with ``text`` and ``check`` (nsbox/policy/inputs.py, ``call_args``) returns: the
    Result, decoded when asked; with ``check``, a CommandFailed unless it is OK."""
    done: Result[Any] = result.decoded(*text) if text else result
    if check and not done.ok:
        from nsbox.failed import failure  # imports subprocess: only when raised

        raise failure(done, cmd, timeout)
    return done
