"""A project workspace: a host directory the sandbox changes copy-on-write, reviewed and
applied by the host.

The sandbox sees the project at /workspace, writable; its writes land in an overlayfs upper
layer on a tmpfs of the sandbox (nsbox/sandbox/projectfs.py), so the host directory is never written
while the sandbox runs. The host lists what changed through the capability-less file worker
(``Session.changes``), and writes the chosen changes itself, with the caller's identity
(``Session.apply``): per file a temporary file in the same directory (O_EXCL, O_NOFOLLOW),
fsync, rename; directories opened with O_NOFOLLOW, so no symlink of the host is followed.

Conflicts: when the session starts, the host records each project entry's lstat (type, mode,
size, inode, mtime and ctime, which no caller can set back). A change whose host entry no longer
has that record (the user edited the file meanwhile) is a conflict, never overwritten.

What the sandbox sees of the project (its secrets masked, its git directories read-only or
withheld) is decided by nsbox/host/projectmasks.py; which changes are never applied (under a
.git) and which the review marks (files the host runs by itself) by nsbox/host/autorun.py.
Files land with the caller's umask, and never with group or other write (``Project.umask``).
"""

from __future__ import annotations

import bisect
import difflib
import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nsbox import visible
from nsbox._sys.paths import caller_umask, open_dir_beneath, replace_file
from nsbox.errors import FileTransferError, PolicyError, SetupError
from nsbox.host import autorun, pathrules, projectmasks
from nsbox.host.projectmasks import Entry
from nsbox.policy import rules

if TYPE_CHECKING:
    from nsbox.policy.policy import Policy

UPPER = "/.nsbox-project/upper"  # the sandbox's upper layer (nsbox/sandbox/projectfs.py UPPER)
MAX_CHANGES = 20_000  # changed entries listed
DIFF_MAX = 1024 * 1024  # text files up to this size get a unified diff
# difflib's work grows with the product of the two sides' lines where they differ: a sandbox
# that changed every other line of a 25,000-line file kept the host's review at 90% of a core
# for 49 s. Past this product (lines after the common head and tail are set aside; a few
# tenths of a second) the change is listed with its sizes and digest, without a diff.
DIFF_WORK = 4_000_000
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LINES = re.compile(r"[^\n]*\n|[^\n]+")


@dataclass(frozen=True)
class Change:
    """One change of the sandbox to the project. ``kind``: added, modified, deleted, mode
    (the permission bits alone), symlink or refused (never applied; ``reason`` says why)."""

    path: str
    kind: str
    is_dir: bool = False
    size: int | None = None
    sha256: str | None = None
    mode: int | None = None  # the new permission bits (set-id bits never carried)
    old_mode: int | None = None
    old_sha256: str | None = None
    target: str | None = None  # of a symlink
    diff: str | None = None  # unified diff of a text file
    binary: bool = False
    no_diff: str | None = None  # why a text file's change has no diff (too many lines changed)
    conflict: bool = False  # the host's file changed since the session started
    reason: str | None = None
    runs_on_host: str | None = None  # what on the host runs this file by itself (autorun.py)
    asked_mode: int | None = None  # the sandbox's mode, when the umask clears bits of it

    @property
    def applicable(self) -> bool:
        return self.kind in ("added", "modified", "deleted", "mode") and self.reason is None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v not in (None, False)}
        for key in ("mode", "old_mode", "asked_mode"):
            if key in out:
                out[key] = f"{out[key]:o}"
        return out


@dataclass
class ApplyReport:
    """What ``apply`` did: paths applied, paths in conflict, paths refused (with the reason)."""

    applied: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "conflicts": self.conflicts,
                "refused": [{"path": p, "reason": r} for p, r in self.refused]}


# --- planning (host side, before the sandbox starts) ------------------------------------------


def plan_op(policy: Policy, allow: tuple[str, ...], host: pathrules.HostView | None
            ) -> dict[str, Any]:
    """The mount operation of the project workspace: the rule book decides the source as for
    a read-only bind; what the sandbox is not to see or write is listed for its setup."""
    real = checked_source(policy, allow, host)
    op: dict[str, Any] = {"op": "overlay", "source": real, "target": "/workspace",
                          "size": policy.limits.workspace_size, "masks": [], "is_dir": True}
    if host is not None:
        view = projectmasks.scan(real, policy.project_secrets)
        op.update(masks=view.masks, covered=view.covered, read_only=view.read_only)
    return op


def checked_source(policy: Policy, allow: tuple[str, ...], host: pathrules.HostView | None
                   ) -> str:
    """The project's resolved path, as the rule book allows it for a read-only bind (it is
    read, and scanned, only after that)."""
    assert policy.project is not None
    if policy.workspace is not None:
        raise PolicyError("a project and a workspace directory cannot both be /workspace",
                          key="project", hint="give one of them")
    real = pathrules.ruled_source(os.path.expanduser(policy.project), writable=False,
                                  allow=allow, key="project", host=host, kind="dir")
    if real is None:
        raise _not_a_directory(policy.project)
    return real


def source(path: str) -> str:
    """The project directory ``path`` names, resolved (a session's start: the rule book judges
    it when the session's plan is built)."""
    real = rules.resolve(os.path.expanduser(path), "project")
    if not os.path.isdir(real):
        raise _not_a_directory(path)
    return real


def _not_a_directory(path: str) -> SetupError:
    return SetupError("project", errno.ENOTDIR, f"project {path} is not a directory",
                      hint="give the project's top directory")


# --- review and apply (host side, while the session runs) -------------------------------------


class Project:
    """The host's side of one session's project workspace."""

    def __init__(self, policy: Policy) -> None:
        self.root = checked_source(policy, policy.allow_rules, pathrules.HostView.current())
        self.view = projectmasks.scan(self.root, policy.project_secrets)
        self.baseline = self.view.entries
        self.masked = self.view.masked
        self.hooks = autorun.hooks_dirs(self.root, self.baseline)
        # The files git reads as config inside the project (an [include] of .git/config):
        # never applied, so no config the applied tree leaves moves the hooks directory.
        self.git_configs = autorun.git_configs(self.root, self.baseline)
        # Group and other write never land: a root caller's file would be rewritable by any
        # local user (the sandbox's chmod 777 is its own business until then).
        self.umask = caller_umask() | 0o022
        self._hashes: dict[tuple[str, Entry], str] = {}
        self._discarded: dict[str, tuple[str, str | None]] = {}

    # reading the host's own tree, never through a symlink
    def _open_parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        """The directory that holds ``rel`` below the project's root, reached without
        following a symlink (the sandbox writes the tree), and the last component's name."""
        *dirs, name = rel.split("/")
        return open_dir_beneath(self.root, dirs, create=create), name

    def host_entry(self, rel: str) -> Entry | None:
        try:
            fd, name = self._open_parent(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return Entry("other", 0, 0, 0, 0, 0)  # a symlink in the way: never equal
            raise
        try:
            return Entry.of(os.stat(name, dir_fd=fd, follow_symlinks=False))
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def host_read(self, rel: str, limit: int, digest: Any = None) -> bytes | None:
        """The host file's content (None: not a regular file, or over ``limit``); with
        ``digest``, its bytes go into that hash instead and b"" is returned."""
        fd, name = self._open_parent(rel)
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                        dir_fd=fd)
        finally:
            os.close(fd)
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            chunks = []
            while chunk := os.read(f, 1 << 20):
                if digest is not None:
                    digest.update(chunk)
                else:
                    chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(f)

    def host_sha256(self, rel: str, entry: Entry) -> str | None:
        key = (rel, entry)
        if key not in self._hashes:
            digest = hashlib.sha256()
            if self.host_read(rel, 1 << 62, digest) is None:
                return None
            self._hashes[key] = digest.hexdigest()
        return self._hashes[key]

    # --- the changes -------------------------------------------------------------------------

    def changes(self, listing: list[dict[str, Any]]) -> list[Change]:
        """The changes the upper layer's ``listing`` (nsbox/sandbox/projectfs.py) makes to the
        project as the session found it: those never applied (under a .git) first, then
        those to files the host runs by itself, then the others, each group by path."""
        upper = {str(e["path"]): e for e in listing}
        self._sorted = sorted(self.baseline)  # for _deleted_under's ranges
        out: dict[str, Change] = {}
        for path, item in upper.items():
            _check_relative(path)
            base = self.baseline.get(path)
            for change in self._change(path, item, base, upper):
                out[change.path] = change
        # The tree as apply would leave it: a directory git would take for a repository there
        # (one the sandbox made, or a bare one of the project's) takes no change.
        repositories = autorun.git_dirs([*self.baseline, *(
            path for path, item in upper.items() if item.get("kind") != "whiteout")])
        result = []
        for path in sorted(out):
            change = out[path]
            if self._discarded.get(path) == (change.kind, change.sha256):
                continue
            if self._hidden(path):
                continue
            now = self.host_entry(path)
            if change.kind != "symlink" and change.kind != "refused" and now != self.baseline.get(
                    path):
                change = _with(change, conflict=True)
            result.append(self._marked(change, repositories))
        return sorted(result, key=lambda c: (0 if c.reason in autorun.GIT_DIR_REASONS
                                             else 1 if c.runs_on_host else 2, c.path))

    def _hidden(self, path: str) -> bool:
        """A masked file, or below a directory the sandbox sees covered."""
        return path in self.view.masks or any(
            autorun.at_or_below(path, d) for d in self.view.covered)

    def _marked(self, change: Change, repositories: frozenset[str]) -> Change:
        never = autorun.never_applied(change.path, self.hooks, repositories, self.git_configs)
        if never == autorun.NAME_REASON:
            # Listed with its diff, never written: only a new name would land on the host.
            return _with(change, reason=never) if change.kind == "added" else change
        if never is not None:
            kind = change.kind if change.kind in ("symlink", "refused") else "refused"
            return _with(change, kind=kind, reason=never)
        why = autorun.runs_it(change.path)
        return _with(change, runs_on_host=why) if why else change

    def _landing(self, asked: int, base: Entry | None) -> int:
        """The mode a change lands with: the host's own while the sandbox kept it, else the
        sandbox's without the bits of the umask."""
        if base is not None and asked == base.mode & 0o777:
            return asked
        return asked & ~self.umask

    def _change(self, path: str, item: dict[str, Any], base: Entry | None,
                upper: dict[str, dict[str, Any]]) -> list[Change]:
        kind = item.get("kind")
        asked = stat.S_IMODE(int(item.get("mode", 0))) & 0o777
        mode = self._landing(asked, base)
        asked_mode = asked if asked != mode else None
        if kind == "whiteout":
            return self._deleted_under(path, upper, include_self=True) if base else []
        if kind == "dir":
            found = []
            if base is None:
                found.append(Change(path, "added", is_dir=True, mode=mode, asked_mode=asked_mode))
            elif base.kind != "dir":
                found.append(Change(path, "refused", is_dir=True,
                                    reason="a file replaced by a directory: apply by hand"))
            elif mode != base.mode & 0o777:
                found.append(Change(path, "mode", is_dir=True, mode=mode,
                                    old_mode=base.mode & 0o777, asked_mode=asked_mode))
            if item.get("opaque") and base is not None:
                found += self._deleted_under(path, upper, include_self=False)
            return found
        if kind == "symlink":
            return [Change(path, "symlink", target=str(item.get("target")),
                           reason="a symlink: never applied to the host")]
        if kind != "file":
            return [Change(path, "refused", size=_size(item.get("size")),
                           reason=str(item.get("reason", "not a regular file")))]
        size, sha = _size(item["size"]), str(item["sha256"])
        if size is None or not _SHA256.fullmatch(sha):
            raise ValueError(f"a bad size or sha256 for {path!r}")
        if base is None:
            return [Change(path, "added", size=size, sha256=sha, mode=mode,
                           asked_mode=asked_mode)]
        if base.kind == "dir":
            return [Change(path, "refused", size=size, sha256=sha,
                           reason="a directory replaced by a file: apply by hand")]
        old_sha = self.host_sha256(path, base) if base.kind == "file" else None
        if old_sha == sha:
            if mode == base.mode & 0o777:
                return []
            return [Change(path, "mode", size=size, sha256=sha, mode=mode,
                           old_mode=base.mode & 0o777, old_sha256=old_sha,
                           asked_mode=asked_mode)]
        return [Change(path, "modified", size=size, sha256=sha, mode=mode,
                       old_mode=base.mode & 0o777, old_sha256=old_sha, asked_mode=asked_mode)]

    def _deleted_under(self, path: str, upper: dict[str, dict[str, Any]],
                       include_self: bool) -> list[Change]:
        """Each baseline entry at or below ``path`` that the upper layer hides (a deleted
        file has none below it; a directory's are a range of the sorted baseline)."""
        found = []
        if include_self:
            base = self.baseline[path]
            found.append(Change(path, "deleted", is_dir=base.kind == "dir",
                                old_mode=base.mode & 0o777))
            if base.kind != "dir":
                return found
        keys = self._sorted  # "/" + 1 is "0": the names below path sort in [path/, path0)
        for rel in keys[bisect.bisect_left(keys, f"{path}/"):bisect.bisect_left(keys, f"{path}0")]:
            base = self.baseline[rel]
            if rel not in upper:
                found.append(Change(rel, "deleted", is_dir=base.kind == "dir",
                                    old_mode=base.mode & 0o777))
        return found

    def with_diff(self, change: Change, new: bytes | None) -> Change:
        """``change`` with a unified diff when old and new are text, else marked binary."""
        if change.kind not in ("added", "modified") or change.is_dir:
            return change
        if new is None and (change.size or 0) > DIFF_MAX:
            return _with(change, no_diff=f"too large to diff: over {DIFF_MAX >> 20} MiB")
        old: bytes | None = b""
        if change.kind == "modified":
            try:
                old = self.host_read(change.path, DIFF_MAX)  # None: over the limit
            except OSError:
                old = None  # no diff rather than one against an empty file
        if old is None:
            return _with(change, no_diff=f"the host's file is over {DIFF_MAX >> 20} MiB, or "
                                         "could not be read")
        old_text, new_text = _text(old), _text(new) if new is not None else None
        if old_text is None or new_text is None:
            return _with(change, binary=True)
        # Lines end at "\n" only (str.splitlines would also cut at CR, FF, U+2028...), and
        # the headers show the path escaped: a name holding "\n+++ b/x" forges no header.
        old_lines, new_lines = _LINES.findall(old_text), _LINES.findall(new_text)
        if _diff_work(old_lines, new_lines) > DIFF_WORK:
            return _with(change, no_diff=f"too many lines changed to diff here "
                                         f"({len(old_lines)} and {len(new_lines)} lines)")
        name = visible.name(change.path)
        lines = difflib.unified_diff(
            old_lines, new_lines,
            fromfile="/dev/null" if change.kind == "added" else f"a/{name}",
            tofile=f"b/{name}")
        return _with(change, diff="".join(_ended(line) for line in lines))

    # --- apply -------------------------------------------------------------------------------

    def conflict(self, change: Change) -> bool:
        return self.host_entry(change.path) != self.baseline.get(change.path)

    def write(self, change: Change, data: bytes) -> None:
        """Write ``data`` at the change's path atomically: a new file beside it, fsync, rename
        (rename(2) replaces the name, never follows it; nsbox/_sys/paths.py)."""
        dir_fd, name = self._open_parent(change.path, create=True)
        try:
            mode = (change.mode if change.mode is not None else 0o644) & 0o777 & ~self.umask
            replace_file(dir_fd, name, [data], mode)  # no set-id bit, no group or other write
        finally:
            os.close(dir_fd)
        self._record(change.path)

    def make_dir(self, change: Change) -> None:
        dir_fd, name = self._open_parent(change.path, create=True)
        try:
            try:
                os.mkdir(name, (change.mode or 0o755) & 0o777 & ~self.umask, dir_fd=dir_fd)
            except FileExistsError:
                pass
        finally:
            os.close(dir_fd)
        self._record(change.path)

    def chmod(self, change: Change) -> None:
        dir_fd, name = self._open_parent(change.path)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=dir_fd)
            try:
                os.fchmod(fd, (change.mode or 0) & 0o777 & ~self.umask)
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)
        self._record(change.path)

    def remove(self, change: Change) -> None:
        dir_fd, name = self._open_parent(change.path)
        try:
            if change.is_dir:
                os.rmdir(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        self.baseline.pop(change.path, None)

    def _record(self, rel: str) -> None:
        """What apply wrote is the new baseline (a second apply is no conflict)."""
        entry = self.host_entry(rel)
        if entry is not None:
            self.baseline[rel] = entry

    def discard(self, changes: list[Change]) -> None:
        for change in changes:
            self._discarded[change.path] = (change.kind, change.sha256)


def _with(change: Change, **values: Any) -> Change:
    import dataclasses

    return dataclasses.replace(change, **values)


def _size(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _diff_work(old: list[str], new: list[str]) -> int:
    """The product of the two sides' lines once their common head and tail are set aside."""
    head = 0
    while head < len(old) and head < len(new) and old[head] == new[head]:
        head += 1
    tail = 0
    while (tail < len(old) - head and tail < len(new) - head
           and old[-1 - tail] == new[-1 - tail]):
        tail += 1
    return (len(old) - head - tail) * (len(new) - head - tail)


def _ended(line: str) -> str:
    """A diff line ends with a newline, also the last line of a file that has none."""
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def _text(data: bytes) -> str | None:
    if b"\0" in data or len(data) > DIFF_MAX:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _check_relative(path: str) -> None:
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise FileTransferError(path, "the sandbox listed a path that leaves the project")


def review_token(changes: Sequence[Change]) -> str:
    """A digest of exactly these changes as a review shows them (path, kind, content digest,
    mode, symlink target, what refuses one): ``apply`` with it writes only if the changes are
    still these. 128 bits: the sandbox makes both what is reviewed and what it would swap in,
    so a shorter digest would let it search for two sets that share one."""
    shown = sorted([c.path, c.kind, c.is_dir, c.sha256, c.mode, c.target, c.reason]
                   for c in changes)
    return hashlib.sha256(json.dumps(shown, ensure_ascii=True).encode()).hexdigest()[:32]


def order(changes: list[Change]) -> list[Change]:
    """Directories made first (parents before children), then files, then deletions deepest
    first (a directory is removed after what was in it)."""
    made = sorted((c for c in changes if c.kind != "deleted"),
                  key=lambda c: (not c.is_dir, c.path))
    gone = sorted((c for c in changes if c.kind == "deleted"), key=lambda c: c.path,
                  reverse=True)
    return made + gone
