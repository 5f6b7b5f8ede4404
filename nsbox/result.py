"""The result of one sandboxed command: plain data, safe to serialize."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Outcome codes, following the convention of programming-contest judges."""

    OK = "OK"  # exit status 0
    RE = "RE"  # non-zero exit status
    SG = "SG"  # killed by a signal
    TO = "TO"  # wall-clock or CPU time limit
    ML = "ML"  # memory limit (OOM kill)
    OL = "OL"  # output limit: the sandbox was stopped once its output passed the cap
    XX = "XX"  # sandbox failure


@dataclass
class Result:
    status: Status
    exit_code: int | None = None  # set when the command exited
    signal: int | None = None  # set when it was killed by a signal
    wall_time: float = 0.0  # seconds
    cpu_user: float = 0.0  # seconds
    cpu_system: float = 0.0
    peak_memory: int = 0  # bytes
    peak_pids: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0  # bytes the command wrote, also those dropped past the cap
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    error: str | None = None  # for XX: what failed
    # Guarantees that were weaker than asked, e.g. "memory: rlimit only (no writable cgroup)".
    degraded: list[str] = field(default_factory=list)
    accounting: str = "rusage"  # where cpu/memory figures come from: rusage or cgroup
    # "namespaces", or "landlock" where the host refuses them (docs/hosts.md), and then every
    # guarantee that is weaker than with namespaces, one "name: what" line each.
    isolation: str = "namespaces"
    isolation_weaker: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per-feature data (network log, ...)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self, *, with_output: bool = False) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        del data["stdout"], data["stderr"]
        if with_output:
            data["stdout"] = self.stdout.decode("utf-8", "replace")
            data["stderr"] = self.stderr.decode("utf-8", "replace")
        return data
