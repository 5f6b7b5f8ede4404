"""Helpers for the session, collect, audit and CLI tests: run a short Python script that uses
nsbox as this process's user or as the unprivileged uid, and get back what it emitted."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, UNPRIVILEGED_UID

PREAMBLE = """
import json, os, sys
sys.path.insert(0, {tree!r})
import nsbox, nsbox.errors

def emit(**values):
    print("RESULT " + json.dumps(values), flush=True)

def find(marker):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{{entry}}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found
"""


USERNS = Path(__file__).with_name("_userns.py")
NESTED_MAPS = "0 0 1,65534 65534 1"  # root of a user namespace, as a container's
# A network namespace of the test's own, where an address no rule of the proxy refuses is
# another host: a second namespace behind a veth pair (tests/_farhost.py), not an address of
# the test's own namespace, which the proxy refuses as "this host". Two sockets listening
# there are passed in NSBOX_TEST_FAR_FDS.
PUBLIC_ADDRESS = "1.2.3.4"
OWN_NETWORK = [PYTHON, str(Path(__file__).with_name("_farhost.py")), PUBLIC_ADDRESS, "2"]


class UserRunner:
    """Runs the test's scripts as this process's user ("caller"), as the unprivileged uid,
    or as root of a user namespace that maps 0 and 65534 ("nested")."""

    def __init__(self, mode: str, tree: Path) -> None:
        self.mode = mode
        self.tree = tree

    @property
    def uid(self) -> int:
        return UNPRIVILEGED_UID if self.mode == "unprivileged" else os.geteuid()

    def prefix(self) -> list[str]:
        if self.mode == "unprivileged":
            return ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                    "--clear-groups", "--"]
        if self.mode == "nested":
            return [PYTHON, str(USERNS), NESTED_MAPS, NESTED_MAPS]
        return []

    def script(self, body: str, env: dict[str, str] | None = None,
               wrap: list[str] | None = None) -> dict[str, Any]:
        """Run ``body`` after PREAMBLE; what it emitted. ``wrap`` goes before everything
        (as root: OWN_NETWORK)."""
        code = PREAMBLE.format(tree=str(self.tree)) + body
        proc = subprocess.run(
            [*(wrap or []), *self.prefix(), PYTHON, "-I", "-c", code], capture_output=True,
            cwd="/", timeout=120, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", **(env or {})})
        for line in proc.stdout.decode().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"the script failed ({proc.returncode}): {proc.stderr.decode()}")


def user_runner(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    """For a fixture with params ["caller", "unprivileged"] (and "nested"): runs the test's
    scripts as this process's user, as an unprivileged uid (and as root of a user
    namespace)."""
    if request.param == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'caller' run covers it")
    if request.param == "nested" and os.geteuid() != 0:
        pytest.skip("needs root to write the maps of a user namespace")
    return UserRunner(request.param, public_tree)


def sleepers(marker: str) -> list[int]:
    """PIDs on the host running exactly ``sleep MARKER`` (the sandboxed command, not a client
    or host program whose own command line mentions the marker)."""
    want = b"sleep\0" + marker.encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read() == want:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def wait_until(condition: Callable[[], Any], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())
