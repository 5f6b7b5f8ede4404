"""The table of limits: one entry per field of Limits, and the parsers of their option values.

The profile schema (nsbox/profiles/schema.py), the command-line options (nsbox/cli/options.py),
their parsers and the check of a Limits' values (nsbox/policy/policy.py) are all derived from
LIMITS: adding a limit touches this table, the Limits field (nsbox/policy/policy.py, which holds its
default) and the limit's enforcement (nsbox/policy/limits.py: an rlimit in plan_limits, or a cgroup
knob).

Kept apart from nsbox/policy/limits.py, which loads the cgroup backends: ``nsbox run`` reads this
table before it forks its launch helper, while the process is still small.
"""

from __future__ import annotations

import math

from nsbox.errors import PolicyError
from nsbox.policy import units

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

SIZE, DURATION, COUNT, SHARE, FLAG = "size", "duration", "count", "share", "flag"


class LimitSpec:
    """One limit: its Limits field, the kind of value, its profile key and its CLI option.

    ``nullable``: "none" (no limit) is allowed; ``low``/``high``: the range a profile may give
    (``low`` 0 allows zero); ``flag`` is None for a limit set only in profiles, or with an
    option of its own in the option table (``--time``, ``--output-limit``: also options of
    ``nsbox session exec``, per command)."""

    __slots__ = ("name", "kind", "nullable", "low", "high", "key", "flag", "metavar", "help")

    def __init__(self, name: str, kind: str, *, nullable: bool = False, low: int = 1,
                 high: int = 2**63 - 1, key: str = "", flag: str | None = None,
                 metavar: str = "", help: str = "") -> None:
        self.name, self.kind, self.nullable = name, kind, nullable
        self.low, self.high = low, high
        self.key = key or f"limits.{name}"
        self.flag, self.metavar, self.help = flag, metavar, help

    def parse_option(self, text: str, key: str | None = None) -> Any:
        """The option's value (``--memory 256M``) more than zero, or NO_LIMIT for ``none``
        where the profile key takes it too; else a PolicyError naming the option."""
        key = key or self.flag or self.key
        if str(text).strip().lower() == "none":
            if self.nullable:
                return NO_LIMIT
            example = "a size, e.g. 1G" if self.kind == SIZE else "a number, e.g. 4096"
            raise PolicyError(f"'none' is not allowed: {_ALWAYS[self.name]}", key=key,
                              hint=f"give {example}")
        try:
            value = _OPTION_PARSERS[self.kind](text, key=key)
        except PolicyError as exc:
            if exc.hint != _LEAVE_OUT:
                raise
            # Leaving the option out keeps the profile's limit (pids: 128 by default), which
            # is not "no limit".
            hint = (f"for no limit write {key} none" if self.nullable
                    else f"this limit is always set: {_ALWAYS.get(self.name, 'give a value')}")
            raise PolicyError(exc.message, key=key, hint=hint) from None
        if self.kind == COUNT and not self.low <= value <= self.high:
            bound = f"at least {self.low}" if self.high == 2**63 - 1 else \
                f"{self.low}..{self.high}"
            raise PolicyError(f"{value} is out of range (must be {bound}{why_low(self)})",
                              key=key)
        return value


class _NoLimit:
    """The value of a limit option given as ``none``: no limit of this kind (None in Limits;
    None itself means "option not given")."""

    def __repr__(self) -> str:
        return "none"


NO_LIMIT: Any = _NoLimit()

# Why a limit takes no "none" (its profile key neither).
_ALWAYS = {
    "tmp_size": "/tmp is a tmpfs, and a tmpfs of the sandbox always has a size",
    "shm_size": "/dev/shm is a tmpfs, and a tmpfs of the sandbox always has a size",
    "output": "the output is always capped",
    "open_files": "the sandbox always has an open-files limit",
}


# Why a count's range starts where it does (said with a value below it).
_LOW_REASONS = {
    "pids": "; the sandbox's own init is one of its processes, the command another",
    "open_files": "; every process starts with stdin, stdout and stderr open, and a "
                  "dynamically linked one opens its libraries",
}


def why_low(spec: LimitSpec) -> str:
    return _LOW_REASONS.get(spec.name, "")


def limit_changes(values: dict[str, Any]) -> dict[str, Any]:
    """The Limits fields the limit options gave (None: not given), NO_LIMIT as None."""
    return {name: None if value is NO_LIMIT else value for name, value in values.items()
            if name in BY_NAME and value is not None}


LIMITS: tuple[LimitSpec, ...] = (
    LimitSpec("wall_time", DURATION, nullable=True),
    LimitSpec("cpu_time", DURATION, nullable=True, flag="--cpu-time", metavar="DURATION",
              help="Total CPU time (e.g. 10s); over it the run ends (TO)."),
    LimitSpec("memory", SIZE, nullable=True, flag="--memory", metavar="SIZE",
              help="Memory limit, swap off (e.g. 256M); past it: OOM kill (ML)."),
    LimitSpec("pids", COUNT, nullable=True, low=2, flag="--pids", metavar="N",
              help="Most processes and threads at once."),
    LimitSpec("cpus", SHARE, nullable=True, flag="--cpus", metavar="SHARE",
              help="Share of cores (e.g. 0.5)."),
    LimitSpec("output", SIZE, low=0),
    LimitSpec("open_files", COUNT, low=3, high=1 << 20, flag="--open-files", metavar="N",
              help="Most open file descriptors per process."),
    LimitSpec("file_size", SIZE, nullable=True, flag="--file-size", metavar="SIZE",
              help="Largest file a process may write."),
    LimitSpec("tmp_size", SIZE, flag="--tmp-size", metavar="SIZE",
              help="Size of the tmpfs at /tmp."),
    LimitSpec("shm_size", SIZE),
    LimitSpec("require_cgroup", FLAG),
    LimitSpec("workspace_size", SIZE, nullable=True, key="workspace.size",
              flag="--workspace-size", metavar="SIZE",
              help="Size of the tmpfs at /workspace; with --workspace DIR, none accepts that "
              "the host directory's disk is not limited."),
)
BY_NAME = {spec.name: spec for spec in LIMITS}
# The limits with an option of their own, in the order of the table.
OPTION_LIMITS = tuple(spec for spec in LIMITS if spec.flag)


# --- option values: sizes, durations, counts ----------------------------------------------------
# The syntax is nsbox.policy.units' (shared with profiles); a limit also has to be more than zero,
# and a bad value is a PolicyError naming the option.


_LEAVE_OUT = "to have no limit, leave the option out"


def ascii_only(text: Any) -> Any:
    """``text`` as it is, unless a string with a character that is not ASCII: a digit of
    another script ("١٢M") is not a number here, whatever Python's int() and re's \\d say."""
    if isinstance(text, str) and not text.isascii():
        raise ValueError(f"{text!r} has a character that is not ASCII: write the number "
                         "with the digits 0-9")
    return text


def _positive(parse: Callable[[str], Any], text: str, key: str, what: str, example: str) -> Any:
    try:
        value = parse(ascii_only(text))
    except ValueError as exc:
        message = str(exc)
        hint = None if "e.g." in message else f"write {what}, e.g. {example}"
        raise PolicyError(message, key=key, hint=hint) from None
    if not value > 0 or math.isinf(value):
        raise PolicyError(f"{text!r} must be more than zero", key=key, hint=_LEAVE_OUT)
    return value


def parse_size(text: str, *, key: str = "size") -> int:
    """``256M``, ``1.5G``, ``64KiB``, ``4096`` -> bytes, more than zero."""
    return int(_positive(units.parse_size, text, key, "a size", "64K, 256M, 1.5G"))


def parse_duration(text: str, *, key: str = "duration") -> float:
    """``10s``, ``500ms``, ``2m``, ``2.5`` -> seconds, more than zero."""
    return float(_positive(units.parse_duration, text, key, "a duration", "10, 10s, 500ms, 2m"))


def _number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return kind(str(text).strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None

    return parse


def parse_cpus(text: str, *, key: str = "cpus") -> float:
    """A share of cores: ``0.5``, ``2``."""
    return float(_positive(_number(float), text, key, "a share of cores", "0.5"))


def parse_count(text: str, *, key: str = "count") -> int:
    """A whole number of processes or files: ``64``."""
    return int(_positive(_number(int), text, key, "a whole number", "64"))


_OPTION_PARSERS: dict[str, Callable[..., Any]] = {
    SIZE: parse_size, DURATION: parse_duration, COUNT: parse_count, SHARE: parse_cpus,
}
