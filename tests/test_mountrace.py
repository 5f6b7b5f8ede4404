"""A concurrent writer cannot redirect the mount setup of a sandbox out of its binds.

One sandbox holds a host directory as its writable workspace and swaps, in a tight loop, a
directory ``cfg`` with a symlink ``alt`` that points at a host "victim" directory
(renameat2(2), RENAME_EXCHANGE). Meanwhile other launches bind the same host directory writable
at /data and put a File, a Dir, a Symlink, a tmpfs and a file bind below /data/cfg. Made by
name, those targets would land in the victim directory on some launches; made through directory
descriptors, the launch fails with a named error instead. The evidence is checked on the host:
the victim tree is exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, UNPRIVILEGED_UID

LAUNCHES = 1000

# Run in a process of its own (as this process's user, or as the unprivileged uid): the
# swapper sandbox in a thread, the launches in the main thread. Prints one JSON line.
SCRIPT = r"""
import json, os, sys, threading, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["path"])
import nsbox
from nsbox import Bind, Dir, File, Policy, SetupError, Symlink, Tmpfs
from nsbox.policy.policy import DEFAULT_MOUNTS

SWAP = '''
import ctypes, os
os.chdir("/workspace")
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
print("swapping", flush=True)
open("started", "w").close()
while not os.path.exists("stop"):
    for _ in range(1000):
        renameat2(-100, b"cfg", -100, b"alt", 2)  # RENAME_EXCHANGE
'''

swapper = {}
def swap():
    swapper["result"] = nsbox.run(["python3", "-c", SWAP], workspace=args["shared"],
                                  timeout=120)
thread = threading.Thread(target=swap)
thread.start()
deadline = time.monotonic() + 60
while not os.path.exists(args["shared"] + "/started") and time.monotonic() < deadline:
    time.sleep(0.01)

outcomes = {"ok": 0, "errors": []}
for i in range(args["launches"]):
    mounts = DEFAULT_MOUNTS + (
        Bind(args["shared"], "/data", writable=True),
        File("/data/cfg/settings.txt", "PWNED\n"),
        Dir(f"/data/cfg/dir{i}"),
        Symlink(f"/data/cfg/link{i}", "/pwned"),
        Tmpfs(f"/data/cfg/tmpfs{i}"),
        Bind(args["source"], f"/data/cfg/bound{i}"),
    )
    try:
        result = nsbox.run(["true"], Policy().replace(mounts=mounts))
        outcomes["ok"] += result.status is nsbox.Status.OK
    except SetupError as exc:
        outcomes["errors"].append([exc.step, exc.errno, str(exc)])
open(args["shared"] + "/stop", "w").close()
thread.join()
result = swapper["result"]
outcomes["swapper"] = [result.status.value, result.stdout.decode(), result.stderr.decode()]
print(json.dumps(outcomes))
"""


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry below ``root``: mode, size, and the content's hash for files."""
    tree = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        tree[str(path.relative_to(root))] = (st.st_mode, st.st_size, digest)
    return tree


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """The shared host directory and the victim directory, both writable by the sandbox's
    host uid (so that only the mount setup stands between the attacker and the victim)."""
    with tempfile.TemporaryDirectory(prefix="nsbox-race-", dir="/tmp") as top:
        base = Path(top)
        base.chmod(0o755)
        shared, victim = base / "shared", base / "victim"
        shared.mkdir(mode=0o777)
        # The attacker's pair: a real directory, and a symlink to the victim as the sandbox
        # child sees it while it sets up (the host's root is at /oldroot then).
        (shared / "cfg").mkdir()
        (shared / "alt").symlink_to(f"/oldroot{victim}")
        victim.mkdir()
        (victim / "settings.txt").write_text("the victim's settings\n")
        (victim / "keep").mkdir()
        (victim / "keep" / "data").write_text("more\n")
        (base / "source.txt").write_text("bound read-only\n")
        (base / "source.txt").chmod(0o644)
        if os.geteuid() == 0:
            for path in (shared, shared / "cfg", shared / "alt", victim, *victim.rglob("*")):
                os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID, follow_symlinks=False)
        shared.chmod(0o777)
        yield shared, victim


@pytest.mark.parametrize("mode", ["caller", "unprivileged"])
def test_swapping_symlinks_cannot_redirect_mount_targets(mode: str, public_tree: Path,
                                                         dirs: tuple[Path, Path]):
    if mode == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'caller' run covers it")
    shared, victim = dirs
    before = snapshot(victim)
    args = json.dumps({"shared": str(shared), "victim": str(victim), "launches": LAUNCHES,
                       "source": str(shared.parent / "source.txt"),
                       "path": str(REPO if mode == "caller" else public_tree)})
    if mode == "caller":
        command = [sys.executable, "-c", SCRIPT, args]
    else:
        command = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                   "--clear-groups", "--", PYTHON, "-I", "-c", SCRIPT, args]
    proc = subprocess.run(command, capture_output=True, timeout=240, cwd="/",
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr.decode()
    outcomes = json.loads(proc.stdout.splitlines()[-1])

    # The host-side evidence: nothing new in the victim tree, nothing changed or truncated.
    assert snapshot(victim) == before
    # The race was live: the swapper ran throughout, and launches met its symlink.
    status, out, err = outcomes["swapper"]
    assert (status, out) == ("OK", "swapping\n"), err
    errors = outcomes["errors"]
    assert errors, "no launch met the swapped symlink: the race was not exercised"
    assert outcomes["ok"] + len(errors) == LAUNCHES
    # Each failure names the step, the component and the reason.
    for step, errno, message in errors:
        assert step.split()[0] in ("file", "dir", "symlink", "tmpfs", "bind"), (step, message)
        assert step.split()[1].startswith("/data/cfg"), (step, message)
        assert errno == 20, (step, errno, message)
        assert "cfg in mount target /data/cfg" in message, message
        assert "nsbox follows no symlink in a mount target" in message, message
    # What succeeded landed in the shared directory (under either name of the real one).
    written = [path for path in shared.rglob("settings.txt")]
    if outcomes["ok"]:
        assert [path.read_text() for path in written] == ["PWNED\n"]


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways to look up a path with no symlink followed: openat2(2) where the kernel has it
    (5.6), the O_NOFOLLOW walk one component at a time where it does not."""
    from nsbox._sys import libc as _libc

    monkeypatch.setattr(_libc, "HAS_OPENAT2", request.param and _libc.HAS_OPENAT2)
    return bool(request.param)


def test_target_walk_makes_directories_and_refuses_symlinks(resolver: bool, tmp_path: Path):
    from nsbox.sandbox import mounts

    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "link").symlink_to(outside)
    (root / "a" / "file").write_text("x")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = mounts.open_dir(root_fd, "/a/b/c", 0o700)
        assert os.path.samestat(os.fstat(fd), (root / "a" / "b" / "c").stat())
        os.close(fd)
        assert (root / "a" / "b" / "c").stat().st_mode & 0o777 == 0o700
        with pytest.raises(OSError) as symlink:
            mounts.open_dir(root_fd, "/a/link/d")
        with pytest.raises(OSError) as file:
            mounts.write_file(root_fd, "/a/file/d", "y", 0o644)
        with pytest.raises(OSError) as last:
            mounts.write_file(root_fd, "/a/link", "y", 0o644)
        with pytest.raises(OSError) as dotdot:
            mounts.open_dir(root_fd, "/a/../b")
    finally:
        os.close(root_fd)
    assert symlink.value.errno == 20
    assert str(symlink.value.strerror) == (
        "link in mount target /a/link/d is a symlink: nsbox follows no symlink in a mount "
        "target and makes no directory in place of a file")
    assert file.value.errno == 20 and "file in mount target /a/file/d is not a directory" in str(
        file.value.strerror)
    assert last.value.errno == 40  # O_NOFOLLOW on the last component
    assert dotdot.value.errno == 22 and "not a normalized absolute path" in str(
        dotdot.value.strerror)
    assert list(outside.iterdir()) == []
    assert (root / "a" / "file").read_text() == "x"


def test_bind_source_with_a_symlink_component_is_refused(resolver: bool, tmp_path: Path):
    from nsbox._sys import libc as _libc

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    flags = _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC
    if os.geteuid() == 0:  # open_tree(OPEN_TREE_CLONE) needs CAP_SYS_ADMIN
        for source in ("real", "real/sub", "real/file"):
            os.close(_libc.open_tree_nofollow(str(tmp_path / source), flags))
    refused = []
    for source in ("alias", "alias/sub", "alias/file"):
        with pytest.raises(OSError) as exc:
            _libc.open_tree_nofollow(str(tmp_path / source), flags)
        refused.append(exc.value)
    for exc in refused:
        assert exc.errno == 40, exc
        assert "a component became a symlink since the path was resolved" in str(exc.strerror)


def test_every_walk_closes_the_descriptors_on_its_way(resolver: bool, tmp_path: Path):
    """The one loop of the no-symlink walks (nsbox/_sys/paths.py) leaves no descriptor open but the
    one it returns, whether it gets there or fails on the way."""
    from nsbox._sys import libc as _libc
    from nsbox._sys import paths as _paths
    from nsbox.sandbox import mounts

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "b")

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    for attempt in (
        lambda: _paths.open_dir_beneath(str(tmp_path), ["a", "b", "new"], create=True),
        lambda: _paths.open_dir_beneath(str(tmp_path), ["a", "link", "x"]),
        lambda: _paths.open_dir_beneath(str(tmp_path), []),
        lambda: mounts.open_dir(root_fd, "/a/b/made"),
        lambda: mounts.open_dir(root_fd, "/a/link/x"),
        lambda: _libc.open_path_nofollow(str(tmp_path / "a" / "b")),
        lambda: _libc.open_path_nofollow(str(tmp_path / "a" / "link" / "x")),
    ):
        try:
            os.close(attempt())
        except OSError as exc:
            assert exc.errno in (20, 40), exc  # the symlink, refused
    os.close(root_fd)
    assert open_fds() == before
    assert (tmp_path / "a" / "b" / "new").is_dir() and (tmp_path / "a" / "b" / "made").is_dir()


def test_file_rewrites_only_a_plain_file_of_its_own(tmp_path: Path):
    from nsbox.sandbox import mounts

    outside = tmp_path / "outside.txt"
    outside.write_text("outside\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "plain").write_text("old content that is longer\n")
    os.link(outside, root / "linked")
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        mounts.write_file(root_fd, "/plain", "new\n", 0o600)
        mounts.write_file(root_fd, "/sub/fresh", "fresh\n", 0o644)
        refused = {}
        for name in ("linked", "fifo", "dir"):
            with pytest.raises(OSError) as exc:
                mounts.write_file(root_fd, f"/{name}", "x\n", 0o644)
            refused[name] = exc.value
    finally:
        os.close(root_fd)
    assert (root / "plain").read_text() == "new\n"
    assert (root / "plain").stat().st_mode & 0o777 == 0o600
    assert (root / "sub" / "fresh").read_text() == "fresh\n"
    for name, exc in refused.items():
        assert exc.errno == 17, (name, exc)
        assert f"/{name} exists and is not a plain file of its own" in str(exc.strerror)
    assert outside.read_text() == "outside\n"
