"""Resource limits: the option parsers, the Plan's rlimits, the fallback decision, and (through
real sandboxes) every limit enforced on this host."""

from __future__ import annotations

import resource

import pytest

from nsbox import cgroups, limits
from nsbox.cgroups._null import NullBackend
from nsbox.errors import HostError, PolicyError
from nsbox.policy import Limits

M = 1 << 20


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("64K", 64 << 10), ("256M", 256 * M), ("256MiB", 256 * M),
     ("1.5G", 3 << 29), ("2g", 2 << 30)],
)
def test_parse_size(text: str, value: int) -> None:
    assert limits.parse_size(text) == value


@pytest.mark.parametrize(("text", "problem"), [("0", "more than zero"), ("lots", "not a size"),
                                               ("-5M", "not a size"), ("12X", "not a size"),
                                               ("", "not a size")])
def test_parse_size_rejects_bad_input_naming_the_option(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        limits.parse_size(text, key="--memory")
    assert info.value.key == "--memory" and problem in str(info.value)
    assert info.value.hint


@pytest.mark.parametrize(("text", "value"), [("10", 10.0), ("10s", 10.0), ("500ms", 0.5),
                                             ("2m", 120.0), ("1h", 3600.0), ("0.25s", 0.25)])
def test_parse_duration(text: str, value: float) -> None:
    assert limits.parse_duration(text) == value


@pytest.mark.parametrize("text", ["0s", "soon", "10 days", "-1"])
def test_parse_duration_rejects_bad_input(text: str) -> None:
    with pytest.raises(PolicyError, match="--cpu-time"):
        limits.parse_duration(text, key="--cpu-time")


@pytest.mark.parametrize("text", ["0", "-1", "half", "inf", "nan"])
def test_parse_cpus_and_counts_reject_bad_input(text: str) -> None:
    with pytest.raises(PolicyError, match="--cpus"):
        limits.parse_cpus(text, key="--cpus")
    with pytest.raises(PolicyError, match="--pids"):
        limits.parse_count(text, key="--pids")


def test_plan_carries_the_rlimits_every_run_gets() -> None:
    plan = limits.plan_limits(Limits(open_files=100, file_size=M, pids=64, cpu_time=2.5))
    by_resource = {r: (soft, hard) for r, soft, hard in plan["rlimits"]}
    assert by_resource[resource.RLIMIT_CORE] == (0, 0)
    assert by_resource[resource.RLIMIT_NOFILE] == (100, 100)
    assert by_resource[resource.RLIMIT_FSIZE] == (M, M)
    assert by_resource[resource.RLIMIT_NPROC] == (64, 64)
    assert by_resource[resource.RLIMIT_CPU] == (3, 4)  # SIGXCPU at 3 s, SIGKILL at 4 s
    assert resource.RLIMIT_AS not in by_resource  # only a fallback: see below
    assert plan["cgroup"]["memory"] == 512 * M


def test_plan_never_asks_for_more_than_the_hard_limit_allows() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = limits.plan_limits(Limits(open_files=hard + 1000 if hard > 0 else 1 << 30))
    nofile = [r for r in plan["rlimits"] if r[0] == resource.RLIMIT_NOFILE][0]
    if hard != resource.RLIM_INFINITY:
        assert nofile[1:] == [hard, hard]


def test_without_cgroups_the_run_falls_back_to_rlimits_and_says_so() -> None:
    plan = limits.plan_limits(Limits(memory=64 * M, pids=16, cpus=0.5, cpu_time=3))
    run = limits.RunLimits(plan["cgroup"], plan["rlimits"], NullBackend("no cgroup here"))
    try:
        assert run.cgroup is None and run.poll_interval() is None
        assert [resource.RLIMIT_AS, 64 * M, 64 * M] in run.rlimits
        text = "\n".join(run.degraded)
        for word in ("memory: RLIMIT_AS", "pids: RLIMIT_NPROC", "cpus: not limited",
                     "cpu_time: RLIMIT_CPU", "no cgroup here"):
            assert word in text
        assert run.finish()["accounting"] == "rusage"
    finally:
        run.close()


def test_require_cgroup_makes_a_host_without_cgroups_an_error() -> None:
    plan = limits.plan_limits(Limits(memory=64 * M, require_cgroup=True))
    with pytest.raises(HostError) as info:
        limits.RunLimits(plan["cgroup"], plan["rlimits"], NullBackend("no cgroup here"))
    assert info.value.feature == "cgroup"
    assert "memory" in str(info.value) and "no cgroup here" in str(info.value)


def test_with_this_hosts_cgroups_no_fallback_is_added() -> None:
    backend = cgroups.detect()
    if not {cgroups.MEMORY, cgroups.PIDS} <= backend.supports():
        pytest.skip(f"no writable memory+pids cgroup here: {backend.reason}")
    plan = limits.plan_limits(Limits(memory=64 * M, pids=16))
    run = limits.RunLimits(plan["cgroup"], plan["rlimits"], backend)
    try:
        assert run.cgroup is not None and not run.degraded
        assert all(r[0] != resource.RLIMIT_AS for r in run.rlimits)
    finally:
        run.close()
