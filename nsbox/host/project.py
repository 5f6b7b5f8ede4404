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

Secrets inside the project (``Policy.project_secrets``, fnmatch patterns matched against each
name and each relative path; and a .git/config that holds credentials) are covered with an
empty read-only file inside the sandbox, and listed in ``Session.masked`` and the audit record.
"""

from __future__ import annotations

import difflib
import errno
import fnmatch
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nsbox import rules
from nsbox._paths import open_dir_beneath
from nsbox.errors import FileTransferError, PolicyError, SetupError
from nsbox.host import pathrules

if TYPE_CHECKING:
    from nsbox.policy import Policy

UPPER = "/.nsbox-project/upper"  # the sandbox's upper layer (nsbox/sandbox/projectfs.py UPPER)
MAX_ENTRIES = 200_000  # project entries recorded at start; more is refused
MAX_CHANGES = 20_000  # changed entries listed
DIFF_MAX = 1024 * 1024  # text files up to this size get a unified diff
# A URL with a password, an auth header or a token in a git config (git-config(1)).
_GIT_CREDENTIALS = re.compile(rb"://[^/\s@]+:[^/\s@]+@|extraheader|password|token",
                              re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    """What the host had at a path when the session started (lstat)."""

    kind: str  # "file", "dir", "link", "other"
    mode: int
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Entry:
        kind = ("file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                else "link" if stat.S_ISLNK(st.st_mode) else "other")
        return cls(kind, stat.S_IMODE(st.st_mode), st.st_size, st.st_ino, st.st_mtime_ns,
                   st.st_ctime_ns)


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
    conflict: bool = False  # the host's file changed since the session started
    reason: str | None = None

    @property
    def applicable(self) -> bool:
        return self.kind in ("added", "modified", "deleted", "mode") and self.reason is None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v not in (None, False)}
        for key in ("mode", "old_mode"):
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
    a read-only bind, and the secrets found in it are listed for masking."""
    real = checked_source(policy, allow, host)
    masks = scan(real, policy.project_secrets)[1] if host is not None else []
    return {"op": "overlay", "source": real, "target": "/workspace",
            "size": policy.limits.workspace_size, "masks": masks, "is_dir": True}


def checked_source(policy: Policy, allow: tuple[str, ...], host: pathrules.HostView | None
                   ) -> str:
    """The project's resolved path, as the rule book allows it for a read-only bind (it is
    read, and scanned, only after that)."""
    assert policy.project is not None
    if policy.workspace is not None:
        raise PolicyError("a project and a workspace directory cannot both be /workspace",
                          key="project", hint="give one of them")
    real = source(policy.project)
    rules.check_spelling(real, False, allow, "project")
    if host is not None:
        real = pathrules.check_source(real, writable=False, allow=allow, key="project", host=host)
    return real


def source(path: str) -> str:
    real = rules.resolve(os.path.expanduser(path), "project")
    if not os.path.isdir(real):
        raise SetupError("project", errno.ENOTDIR, f"project {path} is not a directory",
                         hint="give the project's top directory")
    return real


def scan(root: str, patterns: tuple[str, ...]) -> tuple[dict[str, Entry], list[str]]:
    """Every entry below ``root`` (lstat, no symlink followed) and the secrets to mask."""
    entries: dict[str, Entry] = {}
    masks: list[str] = []
    matcher = _matcher(patterns)

    def walk(path: str, prefix: str) -> None:
        with os.scandir(path) as it:
            found = sorted(it, key=lambda e: e.name)
        for item in found:
            rel = prefix + item.name
            st = item.stat(follow_symlinks=False)
            entries[rel] = Entry.of(st)
            if len(entries) > MAX_ENTRIES:
                raise SetupError("project", errno.E2BIG, f"{root} has more than {MAX_ENTRIES} "
                                 "entries", hint="use a smaller project directory")
            if stat.S_ISDIR(st.st_mode):
                walk(item.path, rel + "/")
            elif stat.S_ISREG(st.st_mode) and is_secret(rel, item.path, matcher):
                masks.append(rel)

    walk(root, "")
    return entries, masks


def _matcher(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    """One regular expression for all the patterns (fnmatch, case-sensitive)."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def is_secret(rel: str, path: str, matcher: re.Pattern[str] | None) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if matcher is not None and (matcher.match(name) or matcher.match(rel)):
        return True
    if rel.endswith(".git/config") or rel == ".git/config":
        try:
            with open(path, "rb") as f:
                return bool(_GIT_CREDENTIALS.search(f.read(1024 * 1024)))
        except OSError:
            return True  # unreadable here: masked rather than guessed at
    return False


# --- review and apply (host side, while the session runs) -------------------------------------


class Project:
    """The host's side of one session's project workspace."""

    def __init__(self, policy: Policy) -> None:
        self.root = checked_source(policy, policy.allow_rules, pathrules.HostView.current())
        self.baseline, self.masked = scan(self.root, policy.project_secrets)
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
        project as the session found it."""
        upper = {str(e["path"]): e for e in listing}
        out: dict[str, Change] = {}
        for path, item in upper.items():
            _check_relative(path)
            base = self.baseline.get(path)
            for change in self._change(path, item, base, upper):
                out[change.path] = change
        result = []
        for path in sorted(out):
            change = out[path]
            if self._discarded.get(path) == (change.kind, change.sha256):
                continue
            if path in self.masked:
                continue
            now = self.host_entry(path)
            if change.kind != "symlink" and change.kind != "refused" and now != self.baseline.get(
                    path):
                change = _with(change, conflict=True)
            result.append(change)
        return result

    def _change(self, path: str, item: dict[str, Any], base: Entry | None,
                upper: dict[str, dict[str, Any]]) -> list[Change]:
        kind = item.get("kind")
        mode = stat.S_IMODE(int(item.get("mode", 0))) & 0o777
        if kind == "whiteout":
            return self._deleted_under(path, upper, include_self=True) if base else []
        if kind == "dir":
            found = []
            if base is None:
                found.append(Change(path, "added", is_dir=True, mode=mode))
            elif base.kind != "dir":
                found.append(Change(path, "refused", is_dir=True,
                                    reason="a file replaced by a directory: apply by hand"))
            elif mode != base.mode & 0o777:
                found.append(Change(path, "mode", is_dir=True, mode=mode,
                                    old_mode=base.mode & 0o777))
            if item.get("opaque") and base is not None:
                found += self._deleted_under(path, upper, include_self=False)
            return found
        if kind == "symlink":
            return [Change(path, "symlink", target=str(item.get("target")),
                           reason="a symlink: never applied to the host")]
        if kind != "file":
            return [Change(path, "refused", size=item.get("size"),
                           reason=str(item.get("reason", "not a regular file")))]
        size, sha = int(item["size"]), str(item["sha256"])
        if base is None:
            return [Change(path, "added", size=size, sha256=sha, mode=mode)]
        if base.kind == "dir":
            return [Change(path, "refused", size=size, sha256=sha,
                           reason="a directory replaced by a file: apply by hand")]
        old_sha = self.host_sha256(path, base) if base.kind == "file" else None
        if old_sha == sha:
            if mode == base.mode & 0o777:
                return []
            return [Change(path, "mode", size=size, sha256=sha, mode=mode,
                           old_mode=base.mode & 0o777, old_sha256=old_sha)]
        return [Change(path, "modified", size=size, sha256=sha, mode=mode,
                       old_mode=base.mode & 0o777, old_sha256=old_sha)]

    def _deleted_under(self, path: str, upper: dict[str, dict[str, Any]],
                       include_self: bool) -> list[Change]:
        """Each baseline entry at or below ``path`` that the upper layer hides."""
        found = []
        if include_self:
            base = self.baseline[path]
            found.append(Change(path, "deleted", is_dir=base.kind == "dir",
                                old_mode=base.mode & 0o777))
        prefix = path + "/"
        for rel, base in self.baseline.items():
            if rel.startswith(prefix) and rel not in upper:
                found.append(Change(rel, "deleted", is_dir=base.kind == "dir",
                                    old_mode=base.mode & 0o777))
        return found

    def with_diff(self, change: Change, new: bytes | None) -> Change:
        """``change`` with a unified diff when old and new are text, else marked binary."""
        if change.kind not in ("added", "modified") or change.is_dir:
            return change
        old = b""
        if change.kind == "modified":
            try:
                old = self.host_read(change.path, DIFF_MAX) or b""
            except OSError:
                old = b""
        old_text, new_text = _text(old), _text(new) if new is not None else None
        if old_text is None or new_text is None:
            return _with(change, binary=True)
        lines = difflib.unified_diff(
            old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
            fromfile="/dev/null" if change.kind == "added" else f"a/{change.path}",
            tofile=f"b/{change.path}")
        return _with(change, diff="".join(lines))

    # --- apply -------------------------------------------------------------------------------

    def conflict(self, change: Change) -> bool:
        return self.host_entry(change.path) != self.baseline.get(change.path)

    def write(self, change: Change, data: bytes) -> None:
        """Write ``data`` at the change's path atomically: a new file beside it, fsync, rename
        (rename(2) replaces the name, never follows it)."""
        dir_fd, name = self._open_parent(change.path, create=True)
        try:
            tmp = f".{name}.nsbox-{secrets.token_hex(4)}"
            mode = (change.mode if change.mode is not None else 0o644) & 0o777
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, mode)  # never a set-id bit: mode is masked to 0o777
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.close(fd)
            try:
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                os.unlink(tmp, dir_fd=dir_fd)
                raise
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._record(change.path)

    def make_dir(self, change: Change) -> None:
        dir_fd, name = self._open_parent(change.path, create=True)
        try:
            try:
                os.mkdir(name, (change.mode or 0o755) & 0o777, dir_fd=dir_fd)
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
                os.fchmod(fd, (change.mode or 0) & 0o777)
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


def order(changes: list[Change]) -> list[Change]:
    """Directories made first (parents before children), then files, then deletions deepest
    first (a directory is removed after what was in it)."""
    made = sorted((c for c in changes if c.kind != "deleted"),
                  key=lambda c: (not c.is_dir, c.path))
    gone = sorted((c for c in changes if c.kind == "deleted"), key=lambda c: c.path,
                  reverse=True)
    return made + gone
