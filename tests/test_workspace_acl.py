"""A writable bind's directory gets its POSIX ACLs back when the sandbox ends, as its mode
(nsbox/policy/identity.py, ``pin`` and ``restore``; docs/security.md, "The identity rule").

Through the bind the sandbox may own the directory (its own uid, or idmapped to it) and give
it an ACL. A default ACL with other::rwx left on the workspace makes every file its owner
makes there later world-writable, whatever the umask (acl(5)). The evidence is read from the
host: the directory's ACL xattrs after the run, and the mode of a file made there afterwards.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, Runner, require

from nsbox.policy import identity
from nsbox.result import Status

ACCESS, DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
# include/uapi/linux/posix_acl_xattr.h: version 2, then (tag, perm, id) entries.
USER_OBJ, USER, GROUP_OBJ, MASK, OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
NO_ID = 0xFFFFFFFF


def acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


# What a sandbox sets: rwx for everyone (the mask too, so that the kernel keeps an access ACL
# rather than folding it into the mode).
OPEN = acl((USER_OBJ, 7, NO_ID), (GROUP_OBJ, 7, NO_ID), (MASK, 7, NO_ID), (OTHER, 7, NO_ID))
# What a host user may have set before the run: a default ACL for a group-shared project
# (files 0640, directories 0750 whatever the umask) and an access ACL naming a user.
SHARED = acl((USER_OBJ, 7, NO_ID), (GROUP_OBJ, 5, NO_ID), (OTHER, 0, NO_ID))
NAMED = acl((USER_OBJ, 7, NO_ID), (USER, 5, 4321), (GROUP_OBJ, 5, NO_ID), (MASK, 5, NO_ID),
            (OTHER, 5, NO_ID))

# Inside: set (or remove) the workspace's ACLs as told, each reported "ok" or its errno's name.
PROBE = r"""
import errno, json, os, sys
todo = json.loads(sys.argv[1])
out = {}
for name, value in todo.items():
    try:
        if value is None:
            os.removexattr("/workspace", name)
        else:
            os.setxattr("/workspace", name, bytes.fromhex(value))
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def acls(path: Path) -> dict[str, bytes | None]:
    found: dict[str, bytes | None] = {}
    for name in (ACCESS, DEFAULT):
        try:
            found[name] = os.getxattr(path, name)
        except OSError as exc:
            if exc.errno != errno.ENODATA:  # none
                raise
            found[name] = None
    return found


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A host workspace, mode 0755, on a filesystem with ACLs."""
    path = Path(tempfile.mkdtemp(prefix="nsbox-acl-", dir="/tmp"))
    path.chmod(0o755)
    try:
        os.getxattr(path, ACCESS)
    except OSError as exc:
        require(exc.errno != errno.EOPNOTSUPP, f"{path}: the filesystem keeps no POSIX ACLs")
    yield path
    shutil.rmtree(path)


def owners_for(runner: Runner) -> list[int]:
    """As root: a user's directory (idmapped) and one of the sandbox's host uid (bound as it
    is); unprivileged, the caller's own."""
    if os.geteuid() != 0:
        return [os.geteuid()]
    return [65534] if runner.unprivileged else [1234, 65534]


def run_probe(runner: Runner, path: Path, owner: int, before: dict[str, bytes],
              todo: dict[str, bytes | None]) -> None:
    """Give ``path`` to ``owner`` with the ACLs ``before``, let the sandbox do ``todo`` to
    /workspace, and check from the host that the ACLs and the mode are as they were."""
    for name, value in before.items():
        os.setxattr(path, name, value)
    path.chmod(0o755)  # after an access ACL: its mask, r-x
    if os.geteuid() == 0:
        os.chown(path, owner, owner)
    expected = acls(path)
    argv = json.dumps({k: None if v is None else v.hex() for k, v in todo.items()})
    result = runner.run([PYTHON, "-c", PROBE, argv], workspace=str(path))
    assert result.status is Status.OK, result.stderr
    assert json.loads(result.stdout) == dict.fromkeys(todo, "ok"), (owner, result.stdout)
    assert acls(path) == expected, owner
    assert stat.S_IMODE(path.stat().st_mode) == 0o755, owner
    assert path.stat().st_uid == owner


def made_later(path: Path) -> tuple[int, int]:
    """The modes of a file and a directory the host makes in ``path`` after the run, with
    umask 022."""
    old = os.umask(0o022)
    try:
        (path / "later.txt").write_text("host data\n")
        (path / "laterdir").mkdir()
    finally:
        os.umask(old)
    return (stat.S_IMODE((path / "later.txt").stat().st_mode),
            stat.S_IMODE((path / "laterdir").stat().st_mode))


@pytest.mark.parametrize("name", [DEFAULT, ACCESS])
def test_an_acl_the_sandbox_gives_the_workspace_is_gone_after_the_run(
        sandbox: Runner, workspace: Path, name: str) -> None:
    for owner in owners_for(sandbox):
        run_probe(sandbox, workspace, owner, {}, {name: OPEN})
        assert acls(workspace) == {ACCESS: None, DEFAULT: None}, owner
        assert made_later(workspace) == (0o644, 0o755), owner  # the umask's, not 0666/0777
        for later in ("later.txt", "laterdir"):
            assert acls(workspace / later) == {ACCESS: None, DEFAULT: None}
        (workspace / "later.txt").unlink()
        (workspace / "laterdir").rmdir()


def test_the_workspaces_own_acls_come_back_exactly(sandbox: Runner, workspace: Path) -> None:
    """Replaced, then removed by the sandbox: the host's ACLs are back, byte for byte."""
    require(os.geteuid() == 0, "needs root: the access ACL names another user")
    before = {DEFAULT: SHARED, ACCESS: NAMED}
    for owner in owners_for(sandbox):
        for todo in ({DEFAULT: OPEN, ACCESS: OPEN}, {DEFAULT: None, ACCESS: None}):
            run_probe(sandbox, workspace, owner, before, todo)
            assert acls(workspace)[DEFAULT] == SHARED
            # The access ACL the host set, its mask the mode's group bits (chmod 0755 above).
            assert acls(workspace)[ACCESS] == NAMED
            assert made_later(workspace) == (0o640, 0o750), (owner, todo)  # SHARED's modes
            (workspace / "later.txt").unlink()
            (workspace / "laterdir").rmdir()


def test_a_filesystem_without_acls_pins_only_the_mode() -> None:
    """/proc keeps no POSIX ACLs (EOPNOTSUPP): nothing to save, nothing to put back."""
    held = identity.pin("/proc")
    try:
        assert held.acls == ()
        assert identity.restore(held)
    finally:
        os.close(held.fd)


def test_restore_puts_back_what_was_pinned_through_the_descriptor(workspace: Path) -> None:
    """The ACLs of the inode pinned, even when its path names another directory by then."""
    os.setxattr(workspace, DEFAULT, SHARED)
    held = identity.pin(str(workspace))
    moved = workspace.with_name(workspace.name + "-moved")
    try:
        os.setxattr(workspace, DEFAULT, OPEN)
        os.setxattr(workspace, ACCESS, OPEN)
        workspace.rename(moved)
        workspace.mkdir(0o755)
        os.setxattr(workspace, DEFAULT, OPEN)  # the swapped-in directory: not the pinned one
        assert identity.restore(held)
        assert acls(moved) == {ACCESS: None, DEFAULT: SHARED}
        assert stat.S_IMODE(moved.stat().st_mode) == 0o755
        assert acls(workspace)[DEFAULT] == OPEN
    finally:
        shutil.rmtree(moved, ignore_errors=True)
        os.close(held.fd)
