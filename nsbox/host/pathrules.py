"""The rule book on resolved host paths: what a bind source or a workspace *is*.

``ruled_source`` is the one path check of a launch: it runs when the plan is built
(nsbox/plan/plan.py, nsbox/plan/landlock.py) and the project workspace is opened
(nsbox/host/project.py). It asks what the path is (which filesystem, which directory of it,
after every symlink and through bind-mounted aliases: /proc/self/mountinfo), not how it is
spelled, and looks inside the tree for unix sockets and FIFOs. The rules themselves, their
names and their refusals are in nsbox/policy/rules.py; docs/rules.md is the reference.
"""

from __future__ import annotations

import os
import posixpath
import select
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from nsbox._sys import mountinfo as _mountinfo
from nsbox._sys.mountinfo import MountEntry
from nsbox.host import codepaths
from nsbox.host.homes import SECRET_PARENTS, home_dirs, home_secrets
from nsbox.host.socketscan import find_host_socket, find_watched
from nsbox.policy.rules import (
    BELOW_AREAS,
    EXACT_AREAS,
    KERNEL_FS,
    SCANNED_INSIDE,
    SYSTEM_DIRS,
    SYSTEM_TREES,
    UNSCANNED_TREES,
    check_spelling,
    fire,
    is_below,
    refuse,
    resolve,
)

# What a bind source must be to be there: anything, a directory, a regular file.
Kind = Literal["any", "dir", "file"]


def read_mountinfo() -> str:
    """The text of /proc/self/mountinfo, read again only when the mount table has changed."""
    return _mount_table.text()


class _MountTable:
    """/proc/self/mountinfo, kept open and read again only after the kernel says it changed.

    proc(5): the file is pollable; a mount, unmount or move in the mount namespace marks every
    open descriptor of it, and the next poll(2) reports POLLPRI | POLLERR once (and clears the
    mark). So a poll with no wait tells whether the text read last is still the table. The
    descriptor belongs to one process and one mount namespace: after a fork (another pid) or a
    setns/unshare (another inode of /proc/self/ns/mnt) the file is opened anew, since the mark
    is per open file (a child polling an inherited descriptor would clear the parent's mark).
    Reading is about 40 us here; a poll and a stat about 3 us."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd = -1
        self._owner: tuple[int, int] = (0, 0)  # (pid, mount namespace inode) of _fd
        self._text = ""

    def text(self) -> str:
        try:
            owner = (os.getpid(), os.stat("/proc/self/ns/mnt").st_ino)
        except OSError:  # no way to tell the mount namespace: read the table every time
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                return f.read()
        with self._lock:
            if self._fd < 0 or owner != self._owner:
                self._reopen(owner)
            elif self._changed():
                self._text = self._read()
            return self._text

    def _reopen(self, owner: tuple[int, int]) -> None:
        if self._fd >= 0 and owner[0] == self._owner[0]:
            os.close(self._fd)
        # An inherited one is left alone: a forked process may have closed it and reused its
        # number for something else.
        self._fd = -1
        # Opened before reading: a change between the two is both in the text and marked.
        self._fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self._owner = owner
        self._text = self._read()

    def _changed(self) -> bool:
        poller = select.poll()
        poller.register(self._fd, select.POLLPRI | select.POLLERR)
        # The mark, or anything else poll reports (POLLNVAL, POLLHUP): read again.
        return bool(poller.poll(0))

    def _read(self) -> str:
        chunks = []
        os.lseek(self._fd, 0, os.SEEK_SET)
        while chunk := os.read(self._fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "surrogateescape")


_mount_table = _MountTable()


@dataclass(frozen=True)
class Where:
    """What a resolved path is: a directory ``fspath`` of the filesystem ``dev``."""

    dev: str
    fspath: str
    fstype: str

    def within(self, other: Where) -> bool:
        return self.dev == other.dev and is_below(self.fspath, other.fspath)


def _dev_string(st_dev: int) -> str:
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def where(real: str, mounts: Sequence[MountEntry]) -> Where | None:
    """Which filesystem ``real`` (a resolved path) is on and where in it; None if missing.

    The mount is the one with the longest mount point above the path whose device is the
    path's own (stat), so a covered mount is never mistaken for the one that is seen."""
    try:
        dev = _dev_string(os.stat(real).st_dev)
    except OSError:
        return None
    best: MountEntry | None = None
    for entry in mounts:
        if entry.dev == dev and is_below(real, entry.point) and (
                best is None or len(entry.point) >= len(best.point)):
            best = entry
    if best is None:  # not in this table (another namespace's path): the spelling must do
        return Where(dev, real, "")
    rest = real[len(best.point):] if best.point != "/" else real
    return Where(dev, posixpath.normpath(best.root + "/" + rest).replace("//", "/"),
                 best.fstype)


class HostView:
    """The host as the rules see it: the mount table, the places of the refused areas, the
    homes and their secret folders, each worked out when first needed.

    ``current()`` keeps one view while the mount table and the user database are unchanged
    (the text of /proc/self/mountinfo, the mtimes of /etc/passwd and /home), so a launch pays
    for a poll of mountinfo, not for resolving every area again. Only host paths that root
    manages are remembered (the areas, the homes); a caller's bind source is resolved and
    located afresh every time, and only what the rules said of the place it was found at is
    kept (``passed``), for as long as the view. A home's secrets are looked for again when the
    home or its .config changes (creating an entry changes a directory's ctime)."""

    def __init__(self, text: str | None = None, homes_stamp: tuple[int, ...] = ()) -> None:
        self.text = read_mountinfo() if text is None else text
        self.mounts = _mountinfo.parse(self.text)
        self.homes_stamp = homes_stamp
        self._areas: dict[str, list[Where]] = {}
        self._homes: list[str] | None = None
        self._where: dict[str, Where | None] = {}
        self._secrets: dict[str, tuple[tuple[int, ...], list[tuple[str, Where]]]] = {}
        # (resolved path, its place, writable, allow_rules) -> whether the socket scan skips
        # it: the places that passed the spelling and place rules in this view (check_source).
        self.passed: dict[tuple[str, Where | None, bool, tuple[str, ...]], bool] = {}
        self._near: dict[Where, list[str]] = {}  # a place -> the homes above or below it

    @classmethod
    def current(cls) -> HostView:
        global _view
        text = read_mountinfo()
        stamp = _homes_stamp()
        view = _view
        if view is None or view.text != text or view.homes_stamp != stamp:
            view = _view = cls(text, stamp)
        return view

    def remember(self, memo: tuple[str, Where | None, bool, tuple[str, ...]],
                 unscanned: bool) -> None:
        if len(self.passed) >= _PASSED_MAX:  # a caller with ever new paths: start again
            self.passed.clear()
            self._near.clear()
        self.passed[memo] = unscanned

    def where(self, path: str) -> Where | None:
        if path not in self._where:
            self._where[path] = where(os.path.realpath(path), self.mounts)
        return self._where[path]

    def area(self, path: str) -> list[Where]:
        """Everything at or below ``path``: the path's own place, and every filesystem mounted
        below it (a bind-mounted alias of any of them elsewhere is the same place)."""
        if path not in self._areas:
            real = os.path.realpath(path)
            own = where(real, self.mounts)
            places = [] if own is None else [own, *self.below(real)]
            self._areas[path] = places
        return self._areas[path]

    def below(self, real: str) -> list[Where]:
        return [Where(e.dev, e.root, e.fstype) for e in self.mounts
                if e.point != real and is_below(e.point, real)]

    def homes(self) -> list[str]:
        if self._homes is None:
            self._homes = home_dirs()
        return self._homes

    def secrets_near(self, here: Where) -> list[tuple[str, Where]]:
        """The secret folders that ``here`` could be in or hold: those of the homes that lie
        above or below it (a home's place is one stat; its secrets are looked at only then)."""
        near = self._near.get(here)
        if near is None:
            near = self._near[here] = [
                home for home in self.homes() if (place := self.where(home)) is not None
                and (here.within(place) or place.within(here))]
        found = []
        for home in near:
            found += self._secrets_of(home)
        return found

    def _secrets_of(self, home: str) -> list[tuple[str, Where]]:
        stamp = tuple(_ctime(home + name) for name in ("", *SECRET_PARENTS))
        cached = self._secrets.get(home)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        places = []
        for secret in home_secrets(home):
            place = where(os.path.realpath(secret), self.mounts)
            if place is not None:
                places.append((secret, place))
        self._secrets[home] = (stamp, places)
        return places


_view: HostView | None = None
_PASSED_MAX = 10_000


def _ctime(path: str) -> int:
    try:
        return os.stat(path).st_ctime_ns
    except OSError:
        return -1


def _homes_stamp() -> tuple[int, ...]:
    stamps = []
    for path in ("/etc/passwd", "/home"):
        try:
            stamps.append(os.stat(path).st_mtime_ns)
        except OSError:
            stamps.append(-1)
    return tuple(stamps)


def ruled_source(source: str, *, writable: bool, allow: Sequence[str], key: str,
                 host: HostView | None, kind: Kind = "any") -> str | None:
    """The one path check of a plan: ``source`` resolved, as the rule book allows it, or None
    when it is not there as ``kind`` ("any", "dir" or "file"; the caller says what is missing).

    The spelling is judged before the path is looked at, so that a refused place is refused
    whether or not it exists here (a link to /root/.ssh); what the path *is* is judged once
    it exists, unless ``host`` is None (a session's command: its sources were judged when the
    session started)."""
    real = resolve(source, key)
    check_spelling(real, writable, allow, key)
    if not _exists_as(real, kind):
        return None
    if host is None:
        return real
    return _check_resolved(real, writable=writable, allow=allow, key=key, host=host)


def _exists_as(path: str, kind: Kind) -> bool:
    if kind == "dir":
        return os.path.isdir(path)
    if kind == "file":
        return os.path.isfile(path)
    return os.path.exists(path)


def check_source(source: str, *, writable: bool, allow: Sequence[str], key: str,
                 host: HostView | None = None) -> str:
    """The rules for a bind source or a workspace, on what the path is; its resolved path.

    ``source`` must exist (plan.py says so otherwise). Submounts below the source come along
    with a recursive bind (nsbox binds with AT_RECURSIVE), so they are checked as well."""
    real = resolve(source, key)
    check_spelling(real, writable, allow, key)
    return _check_resolved(real, writable=writable, allow=allow, key=key,
                           host=host or HostView.current())


def _check_resolved(real: str, *, writable: bool, allow: Sequence[str], key: str,
                    host: HostView) -> str:
    """``check_source`` of a path resolved, whose spelling the rule book has passed.

    The path is located (stat) every time. The rules that follow from where it is are
    answered once per host view (while the mount table and the homes are unchanged) for each
    place; the homes' secrets and the socket scan look again each time, each with its own
    record of what it saw."""
    here = where(real, host.mounts)
    memo = (real, here, writable, tuple(allow))
    unscanned = host.passed.get(memo)
    if unscanned is None:
        unscanned = here is None or _check_place(real, here, writable, allow, key, host)
        host.remember(memo, unscanned)
    if here is None:
        return real
    if "secret-dir" not in allow:
        for secret, place in host.secrets_near(here):
            if here.within(place):
                raise refuse("secret-dir", f"{real} is {secret} or inside it", key)
            if place.within(here):
                raise refuse("secret-dir", f"{real} holds {secret}", key)
    if "host-socket" not in allow:
        for tree in [real] if not unscanned else _scanned_inside(real):
            found = (find_watched(tree, host.text) if tree in SCANNED_INSIDE
                     else find_host_socket(tree))
            if found:
                raise refuse("host-socket", f"{found[0]} is {found[1]}", key)
    return real


def _scanned_inside(real: str) -> list[str]:
    """The trees below a package-managed ``real`` that the socket scan still walks: those of
    SCANNED_INSIDE it holds, as the bind of ``real`` shows them (a symlink there leads
    nowhere inside the sandbox; find_host_socket does not follow it)."""
    return [tree for tree in SCANNED_INSIDE if tree != real and is_below(tree, real)]


def _check_place(real: str, here: Where, writable: bool, allow: Sequence[str], key: str,
                 host: HostView) -> bool:
    """The rules on the filesystem and the directory ``real`` is (``here``) and on what is
    mounted below it; whether the socket scan may skip it (a package-managed tree)."""
    places = [here, *host.below(real)]
    for place in places:
        name = KERNEL_FS.get(place.fstype)
        if name:
            fire(name, allow, f"{real} is on a {place.fstype} filesystem", key)
    for name, area in BELOW_AREAS:
        if any(p.within(a) for p in places for a in host.area(area)):
            fire(name, allow, f"{real} is (or holds) {area} or a part of it, by another "
                 "name", key)
    for name, area in EXACT_AREAS:
        if _same(here, host.where(area)):
            fire(name, allow, f"{real} is {area}, by another name", key)
    if writable:
        _check_writable_place(real, here, allow, key, host)
    return _unscanned(here, host)


def _same(a: Where | None, b: Where | None) -> bool:
    return a is not None and b is not None and (a.dev, a.fspath) == (b.dev, b.fspath)


def _check_writable_place(real: str, here: Where, allow: Sequence[str], key: str,
                          host: HostView) -> None:
    for tree in SYSTEM_TREES:
        if any(here.within(a) for a in host.area(tree)):
            fire("writable-system-dir", allow, f"{real} is at or below {tree}, by another "
                  "name", key)
    for name, dirs in (("writable-system-dir", SYSTEM_DIRS), ("writable-home", host.homes())):
        for directory in dirs:
            if _same(here, host.where(directory)):
                fire(name, allow, f"{real} is {directory}", key)
    _check_code(real, here, allow, key, host)


def _check_code(real: str, here: Where, allow: Sequence[str], key: str,
                host: HostView) -> None:
    for path in codepaths.code_paths():
        place = host.where(path)
        if place is None:
            continue
        how = ("is" if _same(here, place) else "is inside" if here.within(place)
               else "holds" if place.within(here) else None)
        if how:
            fire("nsbox-code", allow, f"{real} {how} {path}, where code that launches "
                 "sandboxes lives", key)


def _unscanned(here: Where, host: HostView) -> bool:
    """Is ``here`` in a package-managed tree (and not in one of SCANNED_INSIDE)?"""
    if any(here.within(place) for tree in SCANNED_INSIDE for place in host.area(tree)[:1]):
        return False
    return any(here.within(host.area(tree)[0]) for tree in UNSCANNED_TREES
               if host.area(tree))
