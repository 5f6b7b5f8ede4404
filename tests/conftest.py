"""Shared test fixtures: real sandboxes, as the caller and as an unprivileged uid.

Where the host lacks a feature, ``require`` skips locally but fails in CI (CI=true), unless the
test is marked ``needs_host``: something this machine cannot have.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _driver
import _tiers
import pytest

from nsbox import errors
from nsbox.result import Result, Status

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"
UNPRIVILEGED_UID = 65534
DRIVER = Path(__file__).with_name("_driver.py")


# The tiers (tests/_tiers.py): `pytest -m "not sandbox"` runs only the tests that launch no
# sandbox and no process, in seconds; a plain `pytest` runs them all.
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _tiers.MARKER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _tiers.mark(items)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from _tiers.guard(request)


def require(condition: bool, reason: str) -> None:
    """Skip when a host feature is missing; in CI a missing feature is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required host feature missing in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def public_tree() -> Iterator[Path]:
    """A copy of the package that an unprivileged uid can read (the checkout may be under a
    private home directory)."""
    root = Path(tempfile.mkdtemp(prefix="nsbox-pkg-", dir="/tmp"))
    root.chmod(0o755)
    shutil.copytree(REPO / "nsbox", root / "nsbox", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(DRIVER, root / "_driver.py")
    # The runtime dependencies too (the seccomp compiler of the plan builder, the v1 cgroup
    # library, the CLI's parser), so that /usr/bin/python3 with this tree on its path is a
    # whole nsbox for any uid: the test environment's own interpreter may sit in a private
    # directory.
    import cgroupspy
    import click
    import pyseccomp

    shutil.copy(pyseccomp.__file__, root / "pyseccomp.py")
    for package in (cgroupspy, click):
        source = Path(package.__file__).parent
        shutil.copytree(source, root / source.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() or path.name == "nsbox-engine" else 0o644)
    yield root
    shutil.rmtree(root)


class Runner:
    """Runs nsbox.run in this process ("caller") or in a process of an unprivileged uid."""

    def __init__(self, mode: str, tree: Path | None) -> None:
        self.mode = mode
        self.tree = tree

    @property
    def unprivileged(self) -> bool:
        return self.mode == "unprivileged" or os.geteuid() != 0

    def run(self, argv: list[str], **kwargs: Any) -> Result:
        if self.mode == "caller":
            return _driver.invoke(argv, kwargs)
        return run_as(UNPRIVILEGED_UID, self.tree, argv, **kwargs)


def run_as(uid: int, tree: Path | None, argv: list[str], **kwargs: Any) -> Result:
    """Run nsbox.run(argv, **kwargs) in a fresh Python process with ``uid`` and return its
    Result (or raise the same nsbox error)."""
    assert tree is not None
    if isinstance(kwargs.get("stdin"), bytes):
        kwargs["stdin_b64"] = base64.b64encode(kwargs.pop("stdin")).decode()
    request = json.dumps({"argv": argv, "kwargs": kwargs})
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         "/usr/bin/python3", "-I", str(tree / "_driver.py")],
        input=request.encode(), capture_output=True, cwd="/", timeout=120,
        env={"PATH": "/usr/bin:/bin", "NSBOX_TEST_CANARY": os.environ.get("NSBOX_TEST_CANARY", ""),
             # The launch core under test (tests/test_native.py; CI runs with both).
             "NSBOX_NATIVE": os.environ.get("NSBOX_NATIVE", ""),
             "NSBOX_ENGINE": os.environ.get("NSBOX_ENGINE", ""),  # the launch engine's runs
             "NSBOX_TRACE": os.environ.get("NSBOX_TRACE", "")},
    )
    if proc.returncode != 0:
        raise AssertionError(f"driver failed: {proc.stderr.decode()}")
    return decode_result(json.loads(proc.stdout))


def decode_result(data: dict[str, Any]) -> Result:
    if "error_type" in data:
        cls = getattr(errors, data["error_type"])
        if issubclass(cls, errors.SetupError):
            raise cls(data["step"], data["errno"], data["message"], hint=data.get("hint"))
        if issubclass(cls, errors.HostError):
            raise cls(data["message"], feature=data["feature"], hint=data.get("hint"))
        if issubclass(cls, errors.PolicyError):
            raise cls(data["message"], key=data.get("key"), hint=data.get("hint"),
                      rule=data.get("rule"))
        raise cls(data["message"])
    data["status"] = Status(data["status"])
    data["stdout"] = base64.b64decode(data.pop("stdout_b64"))
    data["stderr"] = base64.b64decode(data.pop("stderr_b64"))
    return Result(**data)


@pytest.fixture(params=["caller", "unprivileged"])
def sandbox(request: pytest.FixtureRequest, public_tree: Path) -> Runner:
    """Every test using this runs twice: as this process's user and as an unprivileged uid."""
    if request.param == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'caller' run covers it")
    return Runner(request.param, public_tree)


@pytest.fixture
def unprivileged_tmp() -> Iterator[Path]:
    """A temporary directory the unprivileged uid can use, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="nsbox-test-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (proc(5), /proc/PID/stat: the fields after the command name,
    which may hold spaces and parentheses); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def processes_with(marker: str) -> list[int]:
    """PIDs on the host whose command line contains ``marker`` (to look, never to kill)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


PYTHON = "/usr/bin/python3"
assert sys.version_info >= (3, 10)
