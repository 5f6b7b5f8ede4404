"""The do-nothing backend of a host (or user) without a writable cgroup."""

from __future__ import annotations

from typing import Any

from nsbox.cgroups._base import Backend, Request, RunCgroup, Usage


class NullRun(RunCgroup):
    name = ""

    def set_limits(self, request: Request) -> None:
        pass

    def attach(self, pid: int) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def cpu_seconds(self) -> float | None:
        return None

    def usage(self) -> Usage:
        return Usage()

    def pids(self) -> list[int]:
        return []

    def kill_all(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class NullBackend(Backend):
    kind = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason or "no writable cgroup"

    def supports(self) -> frozenset[str]:
        return frozenset()

    def create(self, request: Request, name: str | None = None) -> RunCgroup:
        return NullRun()

    def reclaim(self) -> list[str]:
        return []

    def describe(self) -> dict[str, Any]:
        return {}
