"""What the host offers, read through one root so that tests can point it at a fake /proc, /sys.

Every file ``nsbox doctor`` looks at is read here, below ``root`` ("/" on the real host). Facts
that are not files (the uid, the Python and libseccomp versions, the result of the live probe)
come from the running process on the real host and from the constructor on a simulated one.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nsbox.identity import Holdings

PROBE_TIMEOUT = 10.0  # seconds; the probe itself takes about 50 ms


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5))."""

    root: str
    mount_point: str
    fstype: str
    super_options: tuple[str, ...]


@dataclass(frozen=True)
class CgroupInfo:
    """The cgroup layout and what this process may do with it."""

    layout: str  # "v2", "v1", "hybrid" or "none"
    v2_path: str | None = None  # this process's cgroup directory on the v2 hierarchy
    v2_controllers: tuple[str, ...] = ()  # enabled for this cgroup's children to use
    v2_writable: bool = False
    # v1: controller -> (this process's cgroup directory, writable by this user)
    v1: dict[str, tuple[str, bool]] = field(default_factory=dict)


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

    def writable(self, name: str) -> bool:
        """Whether this user can write the file or create entries in the directory."""
        path = self.path(name)
        if not self.simulated:
            return os.access(path, os.W_OK)
        try:
            info = os.stat(path)
        except OSError:
            return False
        # Simulated hosts carry the owner and mode bits that matter; no ACLs, no groups.
        return self.uid == 0 or bool(
            (info.st_uid == self.uid and info.st_mode & stat.S_IWUSR)
            or info.st_mode & stat.S_IWOTH)

    def status_field(self, name: str) -> str | None:
        """A field of /proc/self/status, e.g. "Seccomp"."""
        for line in (self.read("/proc/self/status") or "").splitlines():
            key, _, value = line.partition(":")
            if key == name:
                return value.strip()
        return None

    def mounts(self) -> list[MountEntry]:
        entries = []
        for line in (self.read("/proc/self/mountinfo") or "").splitlines():
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 5 or len(tail) < 3:
                continue
            entries.append(MountEntry(_unescape(fields[3]), _unescape(fields[4]), tail[0],
                                      tuple(tail[2].split(","))))
        return entries

    # --- cgroups --------------------------------------------------------------------------------

    def cgroups(self) -> CgroupInfo:
        """The layout from the mounts, this process's cgroups from /proc/self/cgroup."""
        mounts = self.mounts()
        v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
        v1_mounts = [m for m in mounts if m.fstype == "cgroup"]
        own: dict[str, str] = {}
        for line in (self.read("/proc/self/cgroup") or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(",") if parts[1] else [""]:
                    own[controller] = parts[2]
        v1: dict[str, tuple[str, bool]] = {}
        for m in v1_mounts:
            for controller in m.super_options:
                if controller in own and controller:
                    directory = _below(m, own[controller])
                    v1[controller] = (directory, self.writable(directory))
        v1_controllers = {c for c in v1 if not c.startswith("name=")}
        if v2_mount and v1_controllers:
            layout = "hybrid"
        elif v2_mount:
            layout = "v2"
        elif v1_controllers:
            layout = "v1"
        else:
            layout = "none"
        if not v2_mount or "" not in own:
            return CgroupInfo(layout, v1=v1)
        directory = _below(v2_mount, own[""])
        controllers = tuple((self.read(f"{directory}/cgroup.controllers") or "").split())
        # Delegation (cgroup-v2.rst): creating children, moving processes and enabling the
        # controllers for the children.
        writable = all(self.writable(f"{directory}/{name}")
                       for name in ("", "cgroup.procs", "cgroup.subtree_control"))
        return CgroupInfo(layout, directory, controllers, writable, v1)

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


def _below(mount: MountEntry, cgroup_path: str) -> str:
    """The directory of ``cgroup_path`` under a cgroup mount whose root may be a sub-tree."""
    relative = cgroup_path
    if mount.root != "/" and (relative == mount.root or relative.startswith(mount.root + "/")):
        relative = relative[len(mount.root):]
    return os.path.join(mount.mount_point, relative.lstrip("/")).rstrip("/") or "/"


def _unescape(text: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text
