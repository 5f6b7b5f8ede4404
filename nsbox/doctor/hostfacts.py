"""What the host offers, read through one root so that tests can point it at a fake /proc, /sys.

Every file ``nsbox doctor`` looks at is read here, below ``root`` ("/" on the real host). Facts
that are not files (the uid, the Python and libseccomp versions, the result of the live probe)
come from the running process on the real host and from the constructor on a simulated one. The
cgroup layout is read by nsbox.cgroups itself, the code a run uses, through the same root and for
the same uid (``cgroup_view``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from nsbox._sys import mountinfo as _mountinfo
from nsbox._sys.mountinfo import MountEntry
from nsbox.cgroups import HostView
from nsbox.policy.identity import Holdings

PROBE_TIMEOUT = 10.0  # seconds; the probe itself takes about 50 ms


class HostFacts:
    def __init__(self, root: str = "/", *, uid: int | None = None,
                 python: tuple[int, int, int] | None = None,
                 libseccomp: str | None = "real", probe: dict[str, object] | None = None):
        self.root = root
        self.simulated = os.path.realpath(root) != "/"
        self.uid = os.geteuid() if uid is None else uid
        self.python = python or tuple(sys.version_info[:3])
        self._libseccomp = libseccomp
        self._probe = probe

    # --- files ----------------------------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.root, name.lstrip("/"))

    def read(self, name: str) -> str | None:
        """The file's text, or None when it is missing or unreadable."""
        try:
            with open(self.path(name), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def read_int(self, name: str) -> int | None:
        text = self.read(name)
        try:
            return int(text.strip()) if text is not None else None
        except ValueError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path(name))

    def status_field(self, name: str) -> str | None:
        """A field of /proc/self/status, e.g. "Seccomp"."""
        for line in (self.read("/proc/self/status") or "").splitlines():
            key, _, value = line.partition(":")
            if key == name:
                return value.strip()
        return None

    def mounts(self) -> list[MountEntry]:
        return _mountinfo.parse(self.read("/proc/self/mountinfo") or "")

    def cgroup_view(self) -> HostView:
        """This host for the cgroup detection of nsbox.cgroups: the real one judged by access(2),
        or the simulated tree judged for the simulated uid."""
        if not self.simulated:
            return HostView()
        return HostView(self.root, self.uid)

    def holdings(self) -> Holdings | None:
        """This process's ids, effective capabilities and user namespace maps (identity.py);
        None when they cannot be read (a simulated host without them)."""
        try:
            return Holdings.read(self.path("/proc/self"))
        except (OSError, KeyError, ValueError, IndexError):
            return None

    # --- facts that are not files ---------------------------------------------------------------

    def libseccomp_version(self) -> str | None:
        if self._libseccomp != "real":
            return self._libseccomp
        from nsbox.host.seccomp import libseccomp_version

        version = libseccomp_version()
        return None if version == "unknown" else version

    def probe(self) -> dict[str, object] | None:
        """The live probe's outcome (see nsbox/doctor/probe.py); None on a simulated host unless the
        test gave one."""
        if self.simulated:
            return self._probe
        return run_probe()


def run_probe() -> dict[str, object]:
    package_parent = str(Path(__file__).resolve().parent.parent.parent)
    code = (f"import sys; sys.path.insert(0, {package_parent!r}); "
            "from nsbox.doctor.probe import main; sys.exit(main())")
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                              timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"done": [], "failed": "start the probe", "errno": 0, "error": str(exc)}
    try:
        result: dict[str, object] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        error = done.stderr.decode(errors="replace").strip()[-500:] or f"status {done.returncode}"
        return {"done": [], "failed": "run the probe", "errno": 0, "error": error}
    return result


def kernel_release(facts: HostFacts) -> str:
    text = facts.read("/proc/sys/kernel/osrelease")
    if text is not None:
        return text.strip()
    return "" if facts.simulated else platform.release()


