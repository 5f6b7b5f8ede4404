"""Checks at the door: every value a caller passes to the public API is checked here, before
anything is opened, sent to the launch helper or started.

A bad value is a PolicyError whose ``key`` names the parameter (``timeout``,
``limits.memory``, ``argv``...), with a hint where the mistake is a common one; never a raw
TypeError from deep inside, never a value the kernel or the helper would take another way
(NaN as "no deadline", 2^64 bytes wrapping to 0, -1 as "no output"). The messages quote at most
``QUOTE_MAX`` characters of the value: a wrong 1 MB argument must not become a 1 MB message.
docs/api.md lists the errors.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping
from typing import Any, NamedTuple

from nsbox.errors import PolicyError

QUOTE_MAX = 200
# The longest timeout: one year. Far below what the timers take (threading.TIMEOUT_MAX is
# 292 years on Linux; the event loops wait in steps below epoll_wait(2)'s 24.8-day maximum)
# and far above any run.
MAX_SECONDS = 365 * 24 * 3600.0
MAX_SIZE = 2**63 - 1  # bytes: what a signed 64-bit kernel value holds (memory.max, tmpfs size=)
MIN_MEMORY = 4096  # bytes: a memory limit under one page is a missing unit, not a limit


def quote(value: Any) -> str:
    """``repr(value)``, cut to QUOTE_MAX characters."""
    try:
        text = repr(value)
    except Exception:  # a caller's object whose repr fails
        text = f"<{type(value).__name__}>"
    if len(text) <= QUOTE_MAX:
        return text
    return f"{text[:QUOTE_MAX]}... ({len(text)} characters)"


def _type(value: Any) -> str:
    return type(value).__name__


def _number(value: Any, key: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"expected {what}, got {_type(value)} {quote(value)}", key=key)
    if isinstance(value, float) and math.isnan(value):
        raise PolicyError(f"expected {what}, got NaN", key=key)
    return value


def seconds(value: Any, key: str) -> float:
    """A timeout in seconds: a finite number, more than 0, at most MAX_SECONDS."""
    number = _number(value, key, "a number of seconds")
    if not 0 < number <= MAX_SECONDS:
        raise PolicyError(f"{quote(value)} seconds is out of range (more than 0, at most "
                          f"{MAX_SECONDS:.0f}: one year)", key=key,
                          hint="use None for the policy's default" if number > 0 else None)
    return float(number)


def optional_seconds(value: Any, key: str) -> float | None:
    return None if value is None else seconds(value, key)


def whole(value: Any, key: str, low: int, high: int = MAX_SIZE, what: str = "a whole number"
          ) -> int:
    """An int (not a bool, not a float) with ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"expected {what}, got {_type(value)} {quote(value)}", key=key)
    if not low <= value <= high:
        raise PolicyError(f"{quote(value)} is out of range ({low} to {high})", key=key)
    return value


def size(value: Any, key: str, low: int = 1) -> int:
    """A size in bytes: an int from ``low`` to 2^63 - 1."""
    return whole(value, key, low, MAX_SIZE, "a size in bytes (an int)")


def memory(value: Any, key: str) -> int:
    """A memory limit in bytes; a bare number under a page is taken for a missing unit."""
    number = size(value, key)
    if number < MIN_MEMORY:
        raise PolicyError(f"{number} bytes is too little memory to run anything", key=key,
                          hint=f"sizes are in bytes: did you mean {number}M?")
    return number


def flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"expected True or False, got {_type(value)} {quote(value)}", key=key)
    return value


def text(value: Any, key: str, *, empty: bool = True, nul: bool = True) -> str:
    """A str without NUL (the kernel cuts C strings there). ``nul=False`` checks the type
    alone, for the fields whose content the rule book judges (nsbox/rules.py)."""
    if not isinstance(value, str):
        raise PolicyError(f"expected a string, got {_type(value)} {quote(value)}", key=key)
    if nul and "\0" in value:
        raise PolicyError(f"{quote(value)} contains a NUL character", key=key)
    if not empty and not value:
        raise PolicyError("must not be empty", key=key)
    return value


def path(value: Any, key: str) -> str:
    """A path as str (an os.PathLike is taken too)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        raise PolicyError(f"expected a path as str, got bytes {quote(value)}", key=key,
                          hint="decode it first (os.fsdecode)")
    return text(value, key, empty=False)


def optional_path(value: Any, key: str) -> str | None:
    return None if value is None else path(value, key)


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
        raise PolicyError(f"expected a list of str, got {_type(value)} {quote(value)}", key=key,
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
        raise PolicyError(f"expected a dict of str to str, got {_type(value)} {quote(value)}",
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
    raise PolicyError(f"expected bytes, str, a descriptor (int) or None, got {_type(value)} "
                      f"{quote(value)}", key=key, hint=hint)


def output_limit(value: Any, key: str = "output_limit") -> int | None:
    """Bytes of stdout + stderr kept; 0 keeps none (any output is then OL)."""
    return None if value is None else size(value, key, low=0)


def policy(value: Any, key: str = "policy") -> Any:
    from nsbox.policy import Policy

    if value is not None and not isinstance(value, Policy):
        hint = ("build one with nsbox.Policy(...) or nsbox.load_profile(...)"
                if isinstance(value, Mapping) else None)
        raise PolicyError(f"expected a nsbox.Policy, got {_type(value)} {quote(value)}",
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


# --- the policy's own fields (Limits, Tmpfs, Policy call these from __post_init__) -------------

_SIZES = ("output", "file_size", "tmp_size", "workspace_size", "shm_size")


def check_limits(limits: Any) -> None:
    """Types and ranges of Limits. (limits.check_limits refuses zero and negative values.)"""
    if limits.wall_time is not None:
        seconds(limits.wall_time, "limits.wall_time")
    if limits.cpu_time is not None:
        seconds(limits.cpu_time, "limits.cpu_time")
    if limits.memory is not None:
        memory(limits.memory, "limits.memory")
    for name in _SIZES:
        value = getattr(limits, name)
        if value is not None:
            size(value, f"limits.{name}", low=0 if name == "output" else 1)
    if limits.pids is not None:
        whole(limits.pids, "limits.pids", 1, 2**31 - 1)
    whole(limits.open_files, "limits.open_files", 1, 2**31 - 1)
    if limits.cpus is not None:
        cpus = _number(limits.cpus, "limits.cpus", "a share of cores")
        if not 0 < cpus <= 1 << 20:
            raise PolicyError(f"{quote(cpus)} is out of range (more than 0)", key="limits.cpus")
    flag(limits.require_cgroup, "limits.require_cgroup")


def check_tmpfs(mount: Any) -> None:
    key = f"tmpfs {quote(mount.target)} size"
    if mount.size == 0 and not isinstance(mount.size, bool):
        # tmpfs(5): size=0 means no limit at all; a sandbox's tmpfs always has one.
        raise PolicyError("0 would be a tmpfs without a size limit", key=key,
                          hint="give its size in bytes, e.g. 64 * 1024 * 1024")
    size(mount.size, key)
    whole(mount.mode, f"tmpfs {quote(mount.target)} mode", 0, 0o7777,
          "a mode (an int, e.g. 0o755)")


def _one_of(kinds: tuple[type, ...]) -> str:
    """The mount classes a policy takes, as in "a Bind, Tmpfs or Dir"."""
    names = [kind.__name__ for kind in kinds]
    return "a " + (", ".join(names[:-1]) + " or " if len(names) > 1 else "") + names[-1]


def check_policy(value: Any) -> None:
    """The types of a Policy's fields (the path rules are nsbox.rules')."""
    from nsbox.policy import ISOLATION_MODES, MOUNT_KINDS, Limits, Network, Seccomp

    if not isinstance(value.mounts, (tuple, list)):
        raise PolicyError(f"expected a tuple of mounts, got {_type(value.mounts)} "
                          f"{quote(value.mounts)}", key="mounts")
    kinds = tuple(MOUNT_KINDS.values())
    for i, mount in enumerate(value.mounts):
        if not isinstance(mount, kinds):
            raise PolicyError(f"expected {_one_of(kinds)}, got {_type(mount)} {quote(mount)}",
                              key=f"mounts[{i}]")
    if not isinstance(value.env, (tuple, list)):
        raise PolicyError(f"expected (name, value) pairs, got {_type(value.env)}", key="env")
    for i, pair in enumerate(value.env):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise PolicyError(f"expected a (name, value) pair, got {quote(pair)}",
                              key=f"env[{i}]")
        # Types here; names and values (NUL, '=') are the rule book's "env-text".
        text(pair[0], f"env[{i}] name", empty=False, nul=False)
        text(pair[1], f"env[{quote(pair[0])}]", nul=False)
    if isinstance(value.env_passthrough, str) or not isinstance(value.env_passthrough,
                                                                 (tuple, list)):
        raise PolicyError(f"expected a tuple of names, got {quote(value.env_passthrough)}",
                          key="env_passthrough")
    for name in value.env_passthrough:
        text(name, "env_passthrough", empty=False)
    for name in ("name", "description"):
        text(getattr(value, name), name)
    for name in ("path", "lang", "user", "hostname"):  # their content: the rule book's
        text(getattr(value, name), name, nul=False)
    for name in ("uid", "gid", "host_uid", "host_gid"):
        whole(getattr(value, name), name, 0, 2**32 - 2)
    optional_path(value.workspace, "workspace")
    if value.isolation not in ISOLATION_MODES:
        raise PolicyError(f"{quote(value.isolation)} is not one of "
                          f"{', '.join(ISOLATION_MODES)}", key="isolation")
    for name, kind in (("limits", Limits), ("network", Network), ("seccomp", Seccomp)):
        if not isinstance(getattr(value, name), kind):
            raise PolicyError(f"expected a nsbox.{kind.__name__}, got "
                              f"{_type(getattr(value, name))} {quote(getattr(value, name))}",
                              key=name)


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
            raise PolicyError(f"expected bytes or str, got {_type(input_)} {quote(input_)}",
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
