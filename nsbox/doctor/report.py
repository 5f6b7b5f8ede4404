"""What `nsbox doctor` reports: one Check per host feature, and the Report that gathers them with
the verdict per guarantee (nsbox/doctor/verdicts.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The guarantees of DESIGN.md's threat model, as a check names them.
FILESYSTEM = "filesystem isolation (empty root, read-only binds)"
PROCESSES = "process isolation (own PID namespace and /proc)"
NETWORK = "network isolation (own network namespace)"
PRIVILEGE = "privilege confinement (a user namespace: root inside is nobody outside)"
SYSCALLS = "syscall filter (seccomp)"
MEMORY = "memory limit and OOM detection (cgroup memory)"
PIDS = "process-count limit (cgroup pids)"
CPU = "CPU share limit (cgroup cpu)"
CLEANUP = "cleanup of everything the command started"

STATUSES = ("ok", "info", "warn", "fail")


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str
    affects: list[str] = field(default_factory=list)
    remedy: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # what the check found, for --json


@dataclass
class Report:
    profile: str
    checks: list[Check]
    # Per guarantee, what a run gets here (see GUARANTEES): the prediction, corrected by the
    # live launch where that launch ran and saw otherwise.
    guarantees: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the profile can run safely here (warnings allowed)."""
        return all(check.status != "fail" for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "ok": self.ok, "guarantees": self.guarantees,
                "checks": [asdict(check) for check in self.checks]}

    def format_table(self) -> str:
        width = max(len(check.name) for check in self.checks)
        lines = [f"{'STATUS':<6}  {'CHECK':<{width}}  DETAIL"]
        for check in self.checks:
            lines.append(f"{check.status.upper():<6}  {check.name:<{width}}  {check.detail}")
            pad = " " * (8 + width + 2)
            if check.affects and check.status in ("warn", "fail"):
                lines.append(f"{pad}affects: {'; '.join(check.affects)}")
            if check.remedy and check.status != "ok":
                lines.append(f"{pad}remedy: {check.remedy}")
        if self.guarantees:
            lines.append("\nA run here gets: " + ", ".join(
                f"{name} {verdict}" for name, verdict in self.guarantees.items()) + ".")
        failed = [c.name for c in self.checks if c.status == "fail"]
        warned = sum(c.status == "warn" for c in self.checks)
        if failed:
            lines.append(f"\nThe {self.profile!r} profile cannot run safely here: "
                         f"{', '.join(failed)}.")
        else:
            lines.append(f"\nThe {self.profile!r} profile can run here"
                         + (f", with {warned} weaker guarantee(s) (see WARN)." if warned else "."))
        return "\n".join(lines)
