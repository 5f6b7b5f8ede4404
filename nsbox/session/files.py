"""A session's files: into and out of its sandbox, only as data, through the sandbox.

The host never opens a path inside the workspace itself (the sandbox could have turned it into
a symlink, a FIFO or a 1 TB sparse file since the host looked). A file operation
(``_wire.FileOp``) is a small command the session's init runs as the sandbox's user without
capabilities (nsbox/sandbox/fileworker.py): it walks the path without following symlinks,
checks with fstat that it opened a regular file with one name, and sends at most the size it
saw. The host checks the SHA-256 of what arrived, and writes what it copies out below a
directory descriptor, never through a symlink.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nsbox._sys import paths
from nsbox._sys.wire import FileEntry, FileOp, InitRequest
from nsbox.errors import FileTransferError, PolicyError, SandboxFileNotFound
from nsbox.host import audit as auditmod
from nsbox.host import autorun
from nsbox.plan import plan as planmod
from nsbox.policy import checks
from nsbox.policy.policy import MiB
from nsbox.result import Result, Status

FILE_OP_TIMEOUT = 60.0
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileInfo:
    """A regular file in the sandbox: ``path`` relative to the listed directory."""

    path: str
    size: int
    sha256: str
    mode: int = 0o644

    def to_dict(self) -> FileEntry:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class CopyLimits:
    """Caps on what leaves the sandbox: per file, number of files, bytes in all."""

    max_file_size: int = 64 * MiB
    max_files: int = 1000
    max_total: int = 256 * MiB


class Listing(list[FileInfo]):
    """What ``files`` found: FileInfo each, in the walk's order; ``truncated`` when the
    sandbox cut the listing at its size (the files after the cut are not in it)."""

    truncated: bool = False


class FileTransfer:
    """The file methods of nsbox.Session: ``write_file``, ``read_file``, ``files`` and
    ``copy_out``, each one file operation run by the session's init."""

    # Session's, set when it starts.
    copy_limits: CopyLimits
    _lock: Any  # a threading.RLock: run() records files with it held
    _audit: auditmod.AuditLog | None
    _written: list[dict[str, Any]]  # files the caller wrote since the last run (audit)
    _known: dict[str, str]  # path -> sha256 after the last run (audit)

    def _command(self, request: InitRequest, stdin: bytes | int | None, cap: int,
                 sinks: tuple[int | None, int | None], timeout: float | None) -> Result:
        raise NotImplementedError  # Session._command: one command of the session's init

    def _file_op(self, op: FileOp, stdin: bytes | None = None, cap: int = 16 * MiB) -> bytes:
        op = {"wall_time": FILE_OP_TIMEOUT, **op}
        with self._lock:
            result = self._command({"cmd": "file", "op": op}, stdin, cap, (None, None),
                                   FILE_OP_TIMEOUT)
        if result.status is Status.OK:
            return result.stdout
        if result.status is Status.OL and op["kind"] == "get":
            raise FileTransferError(str(op.get("path", "")),
                                    f"too large: more than {op.get('max_size')} bytes")
        if result.exit_code == 1:
            try:
                info = json.loads(result.stderr)
                if info.get("errno") == errno.ENOENT:
                    raise SandboxFileNotFound(str(info.get("path", "")), str(info["reason"]))
                raise FileTransferError(str(info.get("path", "")), str(info["reason"]))
            except (ValueError, KeyError, TypeError):
                pass
        raise FileTransferError(str(op.get("path", "")),
                                f"the file operation failed ({result.status.value})")

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the sandbox (relative paths are under /workspace),
        creating parent directories; never through a symlink or into a FIFO."""
        path = checks.path(path, "path")
        checks.whole(mode, "mode", 0, 0o7777, "a mode (an int, e.g. 0o644)")
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PolicyError(f"expected bytes or str, got {type(data).__name__} "
                              f"{checks.quote(data)}", key="data")
        data = bytes(data)
        self._file_op({"kind": "put", "path": path, "mode": mode}, data)
        if self._audit is not None:
            described = auditmod.describe_data(data)
            self._written.append({"path": path, **described})
            # What the caller wrote is not something a command produced.
            rel = path[len(planmod.WORKSPACE) + 1:] if path.startswith(
                planmod.WORKSPACE + "/") else path
            self._known[rel] = described["sha256"]

    def read_file(self, path: str, *, max_size: int | None = None) -> bytes:
        """The content of the regular file ``path`` in the sandbox. Refuses symlinks, FIFOs,
        devices, hard links and files over ``max_size`` (default: the per-file copy limit)."""
        path = checks.path(path, "path")
        if max_size is not None:
            checks.size(max_size, "max_size", low=0)
        limit = max_size if max_size is not None else self.copy_limits.max_file_size
        # Room for the sandbox's error report on stderr (a refusal is no partial file).
        data = self._file_op({"kind": "get", "path": path, "max_size": limit},
                             cap=limit + 65536)
        if len(data) > limit:
            raise FileTransferError(path, f"too large: more than {limit} bytes")
        return data

    def files(self, patterns: Iterable[str] = ("*",), root: str = planmod.WORKSPACE,
              *, skipped: list[tuple[str, str]] | None = None) -> Listing:
        """The regular files below ``root`` whose relative path matches one of ``patterns``
        (fnmatch: ``*`` also matches ``/``), with sizes and SHA-256. What is not copyable
        (symlinks, FIFOs, devices, hard links, over the caps) is left out; pass a list as
        ``skipped`` to get (path, reason) for each. A listing whose names passed 8 MiB of
        JSON is cut there: the files found so far, with ``truncated`` set, and a
        ("...", reason) last in ``skipped``."""
        limits = self.copy_limits
        data = self._file_op({"kind": "list", "path": root, "patterns": list(patterns),
                              "max_files": limits.max_files, "max_size": limits.max_file_size,
                              "max_total": limits.max_total})
        try:
            listing = json.loads(data)
            found = Listing(FileInfo(str(f["path"]), int(f["size"]), str(f["sha256"]),
                                     int(f["mode"])) for f in listing["files"])
            found.truncated = listing.get("truncated", False) is True  # absent: the whole
            if skipped is not None:
                skipped.extend((str(s["path"]), str(s["reason"])) for s in listing["skipped"])
                if found.truncated:
                    skipped.append(("...", f"the listing passed {int(listing['max_bytes'])} "
                                           "bytes (long or many names): the rest is not listed"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FileTransferError(root, "the sandbox sent a malformed listing") from None
        for info in found:
            _check_relative(info.path)
            if not _SHA256.fullmatch(info.sha256) or info.size < 0:
                raise FileTransferError(root, "the sandbox sent a malformed listing")
        return found

    def copy_out(self, dest: str, patterns: Iterable[str] = ("*",),
                 root: str = planmod.WORKSPACE,
                 *, skipped: list[tuple[str, str]] | None = None) -> list[FileInfo]:
        """Copy the files ``files(patterns, root)`` lists into the host directory ``dest``
        (created if missing), keeping their relative paths. Returns what was copied.

        What apply never writes into a project is not written here either, each skipped
        with its reason (``read_file`` still reads it): a name with a
        character a terminal obeys or hides (a control, a bidi or other format character, a
        byte that is not UTF-8), where every later ``ls``, file manager or script would meet
        it as made; a file under a ``.git``, in a directory git takes for a repository, or in
        a hooks directory of ``dest``'s repository, which git would obey or run on the host
        (``git status`` in ``dest`` runs a core.fsmonitor the sandbox wrote). docs/sessions.md,
        "A project's changes", says which. Each file is written as a new one, renamed over the
        name: an existing file's inode (a setuid file, a hard link) never takes the bytes."""
        listed = self.files(patterns, root, skipped=skipped)
        repositories = autorun.git_dirs([info.path for info in listed]
                                        + _repository_marks(dest, listed))
        checkout = os.path.isdir(dest)
        hooks = autorun.hooks_dirs(dest) if checkout else ()
        configs = autorun.git_configs(dest) if checkout else ()
        found = []
        for info in listed:
            never = autorun.never_applied(info.path, hooks, repositories, configs)
            if never is None:
                found.append(info)
            elif skipped is not None:
                skipped.append((info.path, never))
        try:
            os.makedirs(dest, exist_ok=True)
            dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileTransferError(dest, f"cannot use it as the destination: "
                                          f"{exc.strerror or exc}") from None
        try:
            for info in found:
                data = self.read_file(f"{root.rstrip('/')}/{info.path}", max_size=info.size)
                if len(data) != info.size or hashlib.sha256(data).hexdigest() != info.sha256:
                    raise FileTransferError(info.path, "changed while it was copied")
                try:
                    _write_below(dest_fd, info.path, data,
                                 0o755 if info.mode & 0o100 else 0o644)
                except OSError as exc:
                    reason = ("a symlink or non-directory is in the way at the destination"
                              if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                              else exc.strerror or str(exc))
                    raise FileTransferError(os.path.join(dest, info.path), reason) from None
        finally:
            os.close(dest_fd)
        return found


def _repository_marks(dest: str, listed: list[FileInfo]) -> list[str]:
    """The entries of ``dest`` that make a directory a repository to git (HEAD, refs, objects,
    commondir), in each directory a listed file would land in: a HEAD there and a refs the
    sandbox sends make one too."""
    marks = []
    tops = {"", *(top for info in listed for top in autorun.at_and_above(info.path)[:-1])}
    for top in sorted(tops):
        for name in ("HEAD", *autorun.REPOSITORY_MARKS):
            rel = f"{top}/{name}" if top else name
            if os.path.lexists(os.path.join(dest, rel)):
                marks.append(rel)
    return marks


def _check_relative(path: str) -> None:
    """A listed path comes from inside the sandbox: it must stay below the destination."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise FileTransferError(path, "the sandbox listed a path that leaves its directory")


def _write_below(dest_fd: int, path: str, data: bytes, mode: int) -> None:
    """Write ``data`` at ``path`` below the directory ``dest_fd``, creating directories and
    never following a symlink on the way; a new file renamed over the name, never written into
    an existing one (nsbox/_sys/paths.py, replace_file: a setuid file or a hard link there
    would take the sandbox's bytes)."""
    _check_relative(path)
    *dirs, name = path.split("/")
    fd = paths.open_dir_below(os.dup(dest_fd), dirs, create=True)
    try:
        paths.replace_file(fd, name, [data], mode & ~paths.caller_umask())
    except (IsADirectoryError, FileExistsError):
        raise FileTransferError(path, "the destination is not a regular file") from None
    finally:
        os.close(fd)
