"""Exceptions of the public API.

The library raises; only the CLI turns these into messages and exit codes. Every exception
carries what a user needs to act: the step or key that failed and, for known host conditions,
a hint.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Iterable
from typing import Any, TypedDict

from nsbox import visible


class NsboxError(Exception):
    """Base class of every error nsbox raises."""

    hint: str | None = None

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n  hint: {self.hint}" if self.hint else text


class PolicyError(NsboxError):
    """A profile or an option is invalid. Names the file, the key and (when known) the line;
    ``rule`` is the name of the rule of the rule book (docs/rules.md) that refused it, if one
    did."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        file: str | None = None,
        line: int | None = None,
        hint: str | None = None,
        rule: str | None = None,
    ) -> None:
        self.key = key
        self.rule = rule
        self.file = file
        self.line = line
        self.message = message
        self.hint = hint
        where = ""
        if file:
            where = f"{file}:{line}: " if line else f"{file}: "
        prefix = f"{key}: " if key else ""
        super().__init__(f"{where}{prefix}{message}")


class HostError(NsboxError):
    """The host cannot provide a feature the policy requires (user namespaces, cgroups, ...)."""

    def __init__(self, message: str, *, feature: str, hint: str | None = None) -> None:
        self.feature = feature
        self.hint = hint
        super().__init__(message)


class SetupError(NsboxError):
    """A named setup step of the sandbox failed; the command did not start.

    ``step`` is the name of the failed step (e.g. ``"bind /data"``, ``"exec"``), ``errno`` the
    error number the kernel gave (0 when none), ``message`` the reason.
    """

    def __init__(self, step: str, errno: int, message: str, hint: str | None = None) -> None:
        self.step = step
        self.message = message
        self.hint = hint
        super().__init__(f"{step}: {message}")
        # After the base's __init__: an OSError subclass below resets errno there.
        self.errno = errno

    def __str__(self) -> str:
        text = f"{self.step}: {self.message}"
        return f"{text}\n  hint: {self.hint}" if self.hint else text


class CommandNotFound(SetupError, FileNotFoundError):  # type: ignore[misc]
    """The command does not exist inside the sandbox. Also a FileNotFoundError, as
    ``subprocess.run`` raises for a missing program: ``except FileNotFoundError`` catches it."""

    def __init__(self, step: str, errno: int, message: str, hint: str | None = None) -> None:
        super().__init__(step, errno, message, hint)
        self.strerror = "No such file or directory"


class CommandNotExecutable(SetupError, PermissionError):  # type: ignore[misc]
    """The command exists inside the sandbox but cannot be executed (no execute permission, a
    directory, a mount without exec). Also a PermissionError, as ``subprocess.run`` raises."""

    def __init__(self, step: str, errno: int, message: str, hint: str | None = None) -> None:
        super().__init__(step, errno, message, hint)
        self.strerror = "Permission denied"


class LaunchError(NsboxError):
    """The launcher itself failed (the helper process died, a pipe broke)."""


class SessionClosed(NsboxError):
    """The session has ended (closed, idle for too long, or killed); start a new one."""


class FileTransferError(NsboxError):
    """A file could not be copied into or out of a sandbox. ``path`` names it, ``reason`` says
    why (e.g. "a symlink (not followed)", "too large: ..."). Both may come from the sandbox:
    they are kept as they are, and the message shows them escaped (docs/sessions.md, "What
    nsbox shows of the sandbox's making")."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        shown = visible.name(reason)
        super().__init__(f"{visible.name(path)}: {shown}" if path else shown)

    def __str__(self) -> str:
        # Its own, not OSError's (SandboxFileNotFound): escaped as in __init__.
        shown = visible.name(self.reason)
        return f"{visible.name(self.path)}: {shown}" if self.path else shown


class SandboxFileNotFound(FileTransferError, FileNotFoundError):
    """The file to read (or list) does not exist in the sandbox. Also a FileNotFoundError:
    ``except FileNotFoundError`` catches it, as it would for a local ``open``."""

    def __init__(self, path: str, reason: str = "No such file or directory") -> None:
        super().__init__(path, reason)
        self.errno, self.strerror, self.filename = _errno.ENOENT, reason, path


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """A "did you mean" hint for a misspelled key or value."""
    import difflib  # only on the error path

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f'did you mean "{close[0]}"?' if close else None


class ErrorWire(TypedDict, total=False):
    """An NsboxError as JSON, between processes (a session's supervisor and its client):
    the class name and the fields its constructor takes, plus the text for any other class."""

    type: str
    text: str
    message: str | None
    hint: str | None
    step: str | None
    errno: int | None
    path: str | None
    reason: str | None
    key: str | None
    file: str | None
    line: int | None
    rule: str | None
    feature: str | None


def to_wire(exc: NsboxError) -> ErrorWire:
    """``exc`` as JSON-ready data; ``from_wire`` makes the same exception of it again."""
    wire: ErrorWire = {"type": type(exc).__name__, "text": str(exc), "hint": exc.hint,
                       "message": getattr(exc, "message", str(exc))}
    for name in ("step", "errno", "path", "reason", "key", "file", "line", "rule", "feature"):
        wire[name] = getattr(exc, name, None)  # type: ignore[literal-required]
    return wire


def from_wire(wire: ErrorWire | dict[str, Any]) -> NsboxError:
    """The exception ``to_wire`` described, of its class when it is one of these; any other
    comes back as an NsboxError with the same text."""
    cls = globals().get(str(wire.get("type")))
    message = wire.get("message") or wire.get("text") or "error"
    if isinstance(cls, type) and issubclass(cls, SetupError):
        return cls(wire.get("step") or "", wire.get("errno") or 0, message, hint=wire.get("hint"))
    if isinstance(cls, type) and issubclass(cls, FileTransferError):
        return cls(wire.get("path") or "", wire.get("reason") or "")  # type: ignore[no-any-return]
    if cls is PolicyError:
        return PolicyError(message, key=wire.get("key"), file=wire.get("file"),
                           line=wire.get("line"), hint=wire.get("hint"), rule=wire.get("rule"))
    if cls is HostError:
        return HostError(message, feature=wire.get("feature") or "", hint=wire.get("hint"))
    if cls in (SessionClosed, LaunchError):
        return cls(message)  # type: ignore[no-any-return]
    return NsboxError(wire.get("text") or message)
