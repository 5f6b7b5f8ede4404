"""Checks at the door: every argument a caller passes to a run (nsbox.run, Session.run,
Pool.run) is checked here, before anything is opened, sent to the launch helper or started.

A bad value is a PolicyError whose ``key`` names the parameter, with a hint where the mistake
is a common one; the checks of single values are nsbox/policy/checks.py's. docs/api.md lists the
errors.
"""

from __future__ import annotations

import os
import shlex
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
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 2**31:  # an int of C (os.fstat would raise OverflowError)
            raise PolicyError(f"{quote(value)} is not a descriptor", key=key)
        try:
            os.fstat(value)
        except OSError as exc:
            raise PolicyError(f"descriptor {value} is not open: {exc.strerror}", key=key) from None
        return value
    hint = "pass f.fileno() for an open file" if hasattr(value, "fileno") else None
    raise PolicyError(f"expected bytes, str, a descriptor (int) or None, got {type_name(value)} "
                      f"{quote(value)}", key=key, hint=hint)


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
    import codecs  # only on this path

    flag(text_, "text")
    flag(check, "check")
    if input_ is not None:
        if stdin_ is not None:
            raise PolicyError("give input or stdin, not both", key="input",
                              hint="input= is the data to feed; stdin= a descriptor")
        if not isinstance(input_, (bytes, bytearray, memoryview, str)):
            raise PolicyError(f"expected bytes or str, got {type_name(input_)} {quote(input_)}",
                              key="input", hint="pass a descriptor as stdin=")
        stdin_ = input_
    for value, key, lookup in ((encoding, "encoding", codecs.lookup),
                               (errors, "errors", codecs.lookup_error)):
        if value is None:
            continue
        text(value, key, empty=False)
        try:
            lookup(value)
        except LookupError:
            raise PolicyError(f"unknown {key} {quote(value)}", key=key) from None
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
