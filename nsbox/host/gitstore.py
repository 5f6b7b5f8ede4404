"""What a project's git directory holds of a file: its path in an index, its content as an
object.

A project workspace masks its secrets (nsbox/host/projectmasks.py), but a secret that git
tracks is readable all the same through ``.git``: ``git show HEAD:.env``, a loose object, a
packfile. So the host asks, for each masked file, whether a git directory of the project
knows it; such a ``.git`` is withheld from the sandbox. The files are read here, never by
running git in the project: git obeys the project's config, and some of its keys run commands
(core.fsmonitor, core.sshCommand).

Formats: gitformat-index(5) (versions 2-4), gitformat-pack(5) (pack index versions 1 and 2),
loose objects under objects/xx/. Whatever cannot be read or is not understood (a split index,
alternates, an unknown object format, a damaged file) answers "holds it": a secret is never
shown for want of a parser.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Iterator

MAX_INDEX = 256 * 1024 * 1024  # a larger index is not read: the git directory is withheld
_HASHES = {"sha1": 20, "sha256": 32}
_FORMAT = re.compile(rb"^\s*objectformat\s*=\s*(\S+)", re.IGNORECASE | re.MULTILINE)


class Unreadable(Exception):
    """The git directory holds something this module does not read: assume the worst."""


def holds(git_dir: str, rel: str, path: str) -> bool:
    """Does the git directory ``git_dir`` (a work tree's ``.git``, with the repositories of
    its submodules under modules/) track ``rel`` (relative to the work tree) or store the
    content of the file ``path``? True when it cannot tell."""
    try:
        with open(path, "rb") as f:
            content = f.read()
        for repo in _repositories(git_dir):
            hash_name = _object_format(repo)
            if _stores(repo, _blob_id(content, hash_name), _HASHES[hash_name]):
                return True
            if _tracks(repo, rel, _HASHES[hash_name]):
                return True
        return False
    except (OSError, Unreadable, KeyError, struct.error, ValueError, IndexError):
        return True


def _repositories(git_dir: str) -> Iterator[str]:
    """The repository itself, then those of its submodules (modules/NAME, nested)."""
    yield git_dir
    modules = os.path.join(git_dir, "modules")
    for top, dirs, _files in os.walk(modules):
        for name in sorted(dirs):
            candidate = os.path.join(top, name)
            if os.path.isfile(os.path.join(candidate, "HEAD")):
                yield candidate


def _object_format(repo: str) -> str:
    try:
        with open(os.path.join(repo, "config"), "rb") as f:
            found = _FORMAT.search(f.read(1024 * 1024))
    except FileNotFoundError:
        return "sha1"
    name = found.group(1).decode("ascii", "replace").lower() if found else "sha1"
    if name not in _HASHES:
        raise Unreadable(f"object format {name}")
    return name


def _blob_id(content: bytes, hash_name: str) -> bytes:
    digest = hashlib.new(hash_name)
    digest.update(b"blob %d\0" % len(content))
    digest.update(content)
    return digest.digest()


# --- the object store -----------------------------------------------------------------------


def _stores(repo: str, oid: bytes, size: int) -> bool:
    objects = os.path.join(repo, "objects")
    hexid = oid.hex()
    if os.path.lexists(os.path.join(objects, hexid[:2], hexid[2:])):
        return True
    try:
        with open(os.path.join(objects, "info", "alternates"), "rb") as f:
            if f.read().strip():
                raise Unreadable("alternates")  # objects elsewhere, maybe in the project too
    except FileNotFoundError:
        pass
    try:
        names = os.listdir(os.path.join(objects, "pack"))
    except FileNotFoundError:
        return False
    for name in names:
        if name.endswith(".idx"):
            with open(os.path.join(objects, "pack", name), "rb") as f:
                if _in_pack_index(f.read(), oid, size):
                    return True
    return False


def _in_pack_index(data: bytes, oid: bytes, size: int) -> bool:
    """Binary search of a pack index (version 2: after the fan-out table, the sorted object
    names; version 1: entries of a 4-byte offset and the name)."""
    if data[:4] == b"\377tOc":
        if struct.unpack(">I", data[4:8])[0] != 2:
            raise Unreadable("pack index version")
        fanout, names, stride, skip = 8, 8 + 1024, size, 0
    else:
        fanout, names, stride, skip = 0, 1024, 4 + size, 4
    first = oid[0]
    low = struct.unpack(">I", data[fanout + 4 * (first - 1):fanout + 4 * first])[0] if first else 0
    high = struct.unpack(">I", data[fanout + 4 * first:fanout + 4 * first + 4])[0]
    while low < high:
        middle = (low + high) // 2
        start = names + middle * stride + skip
        name = data[start:start + size]
        if len(name) != size:
            raise Unreadable("short pack index")
        if name == oid:
            return True
        if name < oid:
            low = middle + 1
        else:
            high = middle
    return False


# --- the index ------------------------------------------------------------------------------


def _tracks(repo: str, rel: str, size: int) -> bool:
    """Is ``rel``, or a path it ends with (a submodule's files are relative to the
    submodule), an entry of the repository's index?"""
    path = os.path.join(repo, "index")
    try:
        if os.stat(path).st_size > MAX_INDEX:
            raise Unreadable("index too large")
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    wanted = rel.encode("utf-8", "surrogateescape")
    for entry in index_paths(data, size):
        if entry.endswith(b"/"):  # a sparse index's directory: everything below it
            if wanted.startswith(entry) or (b"/" + entry) in wanted:
                return True
        elif wanted == entry or wanted.endswith(b"/" + entry):
            return True
    return False


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """git's offset encoding (varint.c): 7 bits a byte, each continuation adding one."""
    byte = data[at]
    at += 1
    value = byte & 0x7F
    while byte & 0x80:
        byte = data[at]
        at += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, at


def index_paths(data: bytes, size: int = 20) -> Iterator[bytes]:
    """The paths of an index file's entries (``size``: the length of an object name)."""
    if data[:4] != b"DIRC":
        raise Unreadable("not an index")
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3, 4):
        raise Unreadable(f"index version {version}")
    at, previous = 12, b""
    fixed = 40 + size  # ctime, mtime, dev, ino, mode, uid, gid, size; the object name
    for _ in range(count):
        start = at
        flags = struct.unpack(">H", data[at + fixed:at + fixed + 2])[0]
        at += fixed + 2
        if version >= 3 and flags & 0x4000:
            at += 2  # extended flags
        if version == 4:
            strip, at = _varint(data, at)
            end = data.index(b"\0", at)
            if strip > len(previous):
                raise Unreadable("damaged index")
            path = previous[:len(previous) - strip] + data[at:end]
            at = end + 1
        else:
            end = data.index(b"\0", at)
            path = data[at:end]
            at = start + ((end - start) // 8 + 1) * 8  # 1 to 8 NULs up to a multiple of 8
        previous = path
        yield path
    while at + 8 <= len(data) - size:  # the extensions, then the checksum
        signature, length = data[at:at + 4], struct.unpack(">I", data[at + 4:at + 8])[0]
        if signature == b"link":  # a split index: more entries are in sharedindex.*
            raise Unreadable("split index")
        at += 8 + length
