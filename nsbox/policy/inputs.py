"""Checks at the door: every argument a caller passes to a run (nsbox.run, Session.run,
Pool.run) is checked here, before anything is opened, sent to the launch helper or started.

A bad value is a PolicyError whose ``key`` names the parameter, with a hint where the mistake
is a common one; the checks of single values are nsbox/policy/checks.py's. docs/api.md lists the
errors.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import stat
from collections.abc import Mapping
from typing import Any, NamedTuple

from nsbox.errors import PolicyError
from nsbox.policy.checks import flag, optional_path, optional_seconds, quote, size, text, type_name
from nsbox.policy.checks import path as path  # launcher.py: inputs.path, .optional_path, .quote
from nsbox.policy.policy import Policy


def argv(value: Any, key: str = "argv") -> list[str]:
    """The command: a non-empty list (or tuple) of str."""
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError:
            words = value.split()
        raise PolicyError("the command must be a list of arguments, not one string", key=key,
                          hint=f"did you mean {quote(words or [value])}?")
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (list, tuple)):
        raise PolicyError(f"expected a list of str, got {type_name(value)} {quote(value)}", key=key,
                          hint="e.g. [\"python3\", \"main.py\"]")
    if not value:
        raise PolicyError("no command given", key=key)
    for i, item in enumerate(value):
        text(item, f"{key}[{i}]")
    if not value[0]:
        raise PolicyError("no command given (the program name is empty)", key=key)
    return list(value)


def env(value: Any, key: str = "env") -> dict[str, str] | None:
    """Variables to set: a mapping of str names (no ``=``) to str values."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PolicyError(f"expected a dict of str to str, got {type_name(value)} {quote(value)}",
                          key=key)
    for name, item in value.items():
        text(name, f"{key} name", empty=False)
        if "=" in name:
            raise PolicyError(f"the name {quote(name)} contains '='", key=key)
        text(item, f"{key}[{quote(name)}]")
    return dict(value)


def stdin(value: Any, key: str = "stdin") -> bytes | int | None:
    """bytes (or str, sent as UTF-8) to feed, an open descriptor to pass, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:  # as argv: a "\udcff" of os.fsdecode is the byte 0xff
            return value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise PolicyError(f"{quote(value[exc.start:exc.end])} at {exc.start} is a lone "
                              "surrogate, which no byte stands for", key=key,
                              hint="pass bytes, or text that UTF-8 can encode") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 2**31:  # an int of C (os.fstat would raise OverflowError)
            raise PolicyError(f"{quote(value)} is not a descriptor", key=key)
        stdin_kind(value, key)
        return value
    hint = "pass f.fileno() for an open file" if hasattr(value, "fileno") else None
    raise PolicyError(f"expected bytes, str, a descriptor (int) or None, got {type_name(value)} "
                      f"{quote(value)}", key=key, hint=hint)


_DEV_NULL = os.makedev(1, 3)


def stdin_kind(fd: int, key: str = "stdin") -> str:
    """How the descriptor ``fd`` given as stdin enters the sandbox (nsbox/launch/stdin.py):
    ``"pass"``, the same open file; ``"pump"``, the read end of a new pipe that the host feeds
    from it; ``"null"``, /dev/null of its own. PolicyError for what cannot be stdin.

    A descriptor passed as it is lets the sandbox open again what it names, through
    /proc/self/fd/0 (proc(5), /proc/pid/fd: "opening" the link opens the file itself, with the
    access the sandbox's uid has to it, not the descriptor's) or openat(2) under it. So only a
    pipe is passed: there the link names "pipe:[inode]", and opening it gives at most an end of
    the same pipe, which the sandbox already reads (writing there feeds its own stdin). A
    socket is pumped: it belongs to the host's network namespace, where an unconnected
    datagram socket sends to any address (sendto(2)) and a listening one accepts the host's
    connections, past the sandbox's network rules. A regular file or a device would be
    writable through /proc/self/fd/0 (and fd 0 itself when opened read-write) whenever its uid
    may write it: it is pumped too. A directory or
    an O_PATH descriptor would open the host's files under it; a terminal could be written and
    ioctl'ed (termios, TIOCSCTTY) past the output's capture: refused."""
    try:
        info = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as exc:
        raise PolicyError(f"descriptor {fd} is not open: {exc.strerror}", key=key) from None
    mode = info.st_mode
    if flags & os.O_PATH:
        raise PolicyError(f"descriptor {fd} is an O_PATH descriptor: it reads nothing, and the "
                          "sandbox would open the host's files it names", key=key,
                          hint="open the file for reading (os.open(path, os.O_RDONLY)), or pass "
                          "its content as input=")
    if stat.S_ISDIR(mode):
        raise PolicyError(f"descriptor {fd} is a directory: through it the sandbox would list "
                          "and open the host's files under it", key=key,
                          hint="pass a file or a pipe open for reading; to give the sandbox a "
                          "directory, bind it (Policy(mounts=...), --ro-bind)")
    if flags & os.O_ACCMODE == os.O_WRONLY:
        raise PolicyError(f"descriptor {fd} is not open for reading", key=key,
                          hint="open it with os.O_RDONLY (a pipe: pass its read end)")
    if stat.S_ISFIFO(mode):
        return "pass"
    if stat.S_ISCHR(mode) and os.isatty(fd):
        raise PolicyError(f"descriptor {fd} is a terminal: the sandbox could write to it and "
                          "change it (ioctl) past nsbox's output handling", key=key,
                          hint="an interactive program gets a pty of the sandbox's own with "
                          "`nsbox run --tty`; to feed data, pass input= or a pipe")
    if stat.S_ISCHR(mode) and info.st_rdev == _DEV_NULL:
        return "null"
    if stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        return "pump"
    raise PolicyError(f"descriptor {fd} is not a file, a pipe, a socket or a device (an "
                      "eventfd, a pidfd, an epoll...)", key=key,
                      hint="pass a file or a pipe open for reading, or input=")


def output_limit(value: Any, key: str = "output_limit") -> int | None:
    """Bytes of stdout + stderr kept; 0 keeps none (any output is then OL)."""
    return None if value is None else size(value, key, low=0)


def policy(value: Any, key: str = "policy") -> Any:
    if value is not None and not isinstance(value, Policy):
        hint = ("build one with nsbox.Policy(...) or nsbox.load_profile(...)"
                if isinstance(value, Mapping) else None)
        raise PolicyError(f"expected a nsbox.Policy, got {type_name(value)} {quote(value)}",
                          key=key, hint=hint)
    return value


class Command(NamedTuple):
    """The per-command arguments of ``run`` (nsbox.run, Session.run, Pool.run), checked."""

    argv: list[str]
    stdin: bytes | int | None
    timeout: float | None
    output_limit: int | None
    env: dict[str, str] | None
    cwd: str | None


def command(argv_: Any, *, stdin_: Any = None, timeout: Any = None, output_limit_: Any = None,
            env_: Any = None, cwd: Any = None, passthrough: Any = False) -> Command:
    flag(passthrough, "passthrough")
    return Command(argv(argv_), stdin(stdin_), optional_seconds(timeout, "timeout"),
                   output_limit(output_limit_), env(env_), optional_path(cwd, "cwd"))


# --- the subprocess-like arguments of a run (nsbox.run, Session.run, Pool.run) ------------------


class CallArgs(NamedTuple):
    """``input``, ``text``, ``encoding``, ``errors``, ``check`` and ``capture_output``,
    checked: the stdin and passthrough they amount to, and what to do with the Result."""

    stdin: Any  # what to feed (``input`` or ``stdin``); ``command`` checks it
    passthrough: Any
    text: tuple[str, str] | None  # (encoding, errors) to decode the output with
    check: bool


def call_args(*, input_: Any, stdin_: Any, text_: Any, encoding: Any, errors: Any,
              check: Any, capture_output: Any, passthrough: Any) -> CallArgs:
    """The arguments ``subprocess.run`` has too, checked, and what they mean here."""
    flag(text_, "text")
    flag(check, "check")
    if input_ is not None:
        if stdin_ is not None:
            raise PolicyError("give input or stdin, not both", key="input",
                              hint="input= is the data to feed; stdin= a descriptor")
        if not isinstance(input_, (bytes, bytearray, memoryview, str)):
            raise PolicyError(f"expected bytes or str, got {type_name(input_)} {quote(input_)}",
                              key="input", hint="pass a descriptor as stdin=")
        stdin_ = stdin(input_, "input")
    for value, key in ((encoding, "encoding"), (errors, "errors")):
        if value is None:
            continue
        text(value, key, empty=False)
        _decoding(value, key)
        if not text_:
            raise PolicyError(f"{key} applies to text output", key=key,
                              hint="pass text=True as well")
    if capture_output is not None:
        flag(capture_output, "capture_output")
        if capture_output and passthrough is True:
            raise PolicyError("capture_output=True and passthrough=True contradict each other",
                              key="capture_output")
        # As subprocess: without capture, the output goes to this process's stdout/stderr.
        passthrough = passthrough or not capture_output
    decode = (encoding or "utf-8", errors or "replace") if text_ else None
    return CallArgs(stdin_, passthrough, decode, check)


def _decoding(value: str, key: str) -> None:
    """``value`` can decode the output: a text encoding (not rot13, base64, hex: bytes.decode
    refuses those), an error handler that handles decoding (not namereplace)."""
    import codecs  # only on this path
    if key == "encoding":
        try:
            text_encoding = codecs.lookup(value)._is_text_encoding
        except LookupError:
            raise PolicyError(f"unknown encoding {quote(value)}", key=key) from None
        if not text_encoding:
            raise PolicyError(f"{quote(value)} is not a text encoding", key=key,
                              hint="decode the bytes yourself with codecs.decode (text=False)")
        return
    try:
        codecs.lookup_error(value)
    except LookupError:
        raise PolicyError(f"unknown errors {quote(value)}", key=key) from None
    try:
        b"\xff".decode("utf-8", value)
    except UnicodeDecodeError:
        pass  # strict, or a handler that gives up: OutputDecodeError when it does (result.py)
    except Exception:  # TypeError: a handler of encoding only (namereplace, xmlcharrefreplace)
        raise PolicyError(f"the error handler {quote(value)} cannot decode", key=key,
                          hint="e.g. replace, backslashreplace, surrogateescape, strict") from None
