"""Files out of a hostile workspace: only regular files, never a path the sandbox controls."""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from pathlib import Path

import pytest
from sessiontools import UserRunner, user_runner

import nsbox
from nsbox.errors import FileTransferError

NEWLINE_NAME = "two\nlines.txt"


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


@pytest.fixture
def host_secrets(unprivileged_tmp: Path) -> tuple[Path, Path, bytes, int]:
    """A secret file and a FIFO holding secret bytes on the host. Whoever opens and reads the
    FIFO takes the bytes out of it; they are still there afterwards only if nobody did."""
    secret = unprivileged_tmp / "secret.txt"
    secret.write_text("secret-" + uuid.uuid4().hex)
    secret.chmod(0o644)
    fifo = unprivileged_tmp / "secret.fifo"
    os.mkfifo(fifo, 0o666)
    holder = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # keeps the pipe and its buffer alive
    canary = b"fifo-secret-" + uuid.uuid4().hex.encode()
    os.write(holder, canary)
    return secret, fifo, canary, holder


def plant(secret: Path, fifo: Path) -> str:
    return (
        f"ln -s {secret} link-to-secret; ln -s {fifo} link-to-fifo; ln -s / rootlink; "
        "mkfifo pipe; truncate -s 1T sparse; "
        "printf 'newline file' > \"$(printf 'two\\nlines.txt')\"; "
        "mkdir -p sub/deep; printf good > sub/deep/good.txt; printf x > linked; "
        "ln linked linked2; printf '#!/bin/sh\\n' > run.sh; chmod 755 run.sh; echo planted"
    )


def give_workspace(ws: Path, as_user: UserRunner) -> None:
    """The unprivileged uid's own directory; as root, a user's (idmapped to the sandbox): a
    root-owned workspace that uid 65534 cannot write is refused (nsbox/policy/identity.py)."""
    owner = 65534 if as_user.mode == "unprivileged" else 1234
    if os.geteuid() == 0:
        os.chown(ws, owner, owner)


@pytest.mark.parametrize("workspace", ["tmpfs", "host"])
def test_copy_out_of_a_hostile_workspace(as_user: UserRunner, unprivileged_tmp: Path,
                                         host_secrets: tuple[Path, Path, bytes, int],
                                         workspace: str):
    secret, fifo, canary, holder = host_secrets
    dest = unprivileged_tmp / "out"
    ws = unprivileged_tmp / "ws"
    ws.mkdir()
    give_workspace(ws, as_user)
    ws_arg = repr(str(ws)) if workspace == "host" else "None"
    out = as_user.script(f"""
# No file-size limit: the 1T sparse file must come into existence, to be refused on copy-out.
policy = nsbox.Policy().with_limits(file_size=None)
with nsbox.Session(policy, workspace={ws_arg}, timeout=20) as s:
    planted = s.run(["sh", "-c", {plant(secret, fifo)!r}])
    skipped = []
    copied = s.copy_out({str(dest)!r}, skipped=skipped)
    errors = {{}}
    for name in ("link-to-secret", "link-to-fifo", "pipe", "sparse", "rootlink/etc/passwd",
                 "linked"):
        try:
            s.read_file(name)
            errors[name] = "read"
        except nsbox.errors.FileTransferError as exc:
            errors[name] = exc.reason
    emit(planted=planted.stdout.decode(), copied=[[f.path, f.size, f.sha256] for f in copied],
         skipped=dict(skipped), errors=errors)
""")
    try:
        left_in_fifo = os.read(holder, 4096)
    finally:
        os.close(holder)
    assert out["planted"] == "planted\n"
    assert left_in_fifo == canary, "someone read the host FIFO"
    copied = {path: (size, sha) for path, size, sha in out["copied"]}
    assert set(copied) == {"sub/deep/good.txt", "run.sh"}
    assert copied["sub/deep/good.txt"] == (4, hashlib.sha256(b"good").hexdigest())
    assert out["skipped"] == {
        "link-to-secret": "a symlink (not followed)",
        "link-to-fifo": "a symlink (not followed)",
        "rootlink": "a symlink (not followed)",
        "pipe": "a FIFO, not a regular file",
        "sparse": f"too large: {2**40} bytes, the limit is {64 * 2**20}",
        "linked": "a hard link (2 names)",
        "linked2": "a hard link (2 names)",
        NEWLINE_NAME: "its name holds a control, format, blank-looking or non-UTF-8 character: "
                      "not written on the host",
    }
    assert out["errors"] == {
        "link-to-secret": "a symlink (not followed)",
        "link-to-fifo": "a symlink (not followed)",
        "pipe": "a FIFO, not a regular file",
        "sparse": f"too large: {2**40} bytes, the limit is {64 * 2**20}",
        "rootlink/etc/passwd": "rootlink is a symlink or not a directory",
        "linked": "a hard link (2 names)",
    }
    on_host = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    assert on_host == sorted(["sub/deep/good.txt", "run.sh"])
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    for path in dest.rglob("*"):
        assert not path.is_symlink()
        if path.is_file():
            assert secret.read_bytes() not in path.read_bytes()


def test_write_file_never_goes_through_a_symlink(as_user: UserRunner, unprivileged_tmp: Path):
    ws = unprivileged_tmp / "ws"
    ws.mkdir()
    target = unprivileged_tmp / "target.txt"
    target.write_text("original")
    target.chmod(0o666)
    give_workspace(ws, as_user)
    out = as_user.script(f"""
with nsbox.Session(workspace={str(ws)!r}) as s:
    s.run(["sh", "-c", "ln -s {target} planted; ln -s /tmp dirlink; mkfifo fifo"])
    errors = {{}}
    for name in ("planted", "dirlink/x", "fifo"):
        try:
            s.write_file(name, "overwritten")
            errors[name] = "written"
        except nsbox.errors.FileTransferError as exc:
            errors[name] = exc.reason
    s.write_file("new/dir/ok.txt", "fine")
    emit(errors=errors, ok=s.run(["cat", "new/dir/ok.txt"]).stdout.decode())
""")
    assert out["errors"] == {
        "planted": "a symlink is in the way (not followed)",
        "dirlink/x": "dirlink is a symlink or not a directory",
        "fifo": "a FIFO is in the way",
    }
    assert out["ok"] == "fine"
    assert target.read_text() == "original"
    assert (ws / "new" / "dir" / "ok.txt").read_text() == "fine"


def test_copy_caps_count_and_total_size():
    limits = nsbox.CopyLimits(max_file_size=100, max_files=3, max_total=250)
    with nsbox.Session(copy_limits=limits) as s:
        s.run(["sh", "-c", "for i in 1 2 3 4 5; do head -c 90 /dev/zero > f$i; done; "
                           "head -c 101 /dev/zero > big"])
        skipped: list[tuple[str, str]] = []
        found = s.files(skipped=skipped)
        with pytest.raises(FileTransferError, match="too large: 101 bytes, the limit is 100"):
            s.read_file("big")
    assert [f.path for f in found] == ["f1", "f2"]
    assert dict(skipped) == {
        "big": "too large: 101 bytes, the limit is 100",
        "f3": "over the limit of 250 bytes in all",
        "f4": "over the limit of 250 bytes in all",
        "f5": "over the limit of 250 bytes in all",
    }


def test_patterns_select_files_and_paths_stay_below_the_destination(tmp_path: Path):
    with nsbox.Session() as s:
        s.run(["sh", "-c", "mkdir -p a/b; echo 1 > a/b/x.csv; echo 2 > y.csv; echo 3 > z.txt"])
        assert [f.path for f in s.files(["*.csv"])] == ["a/b/x.csv", "y.csv"]
        copied = s.copy_out(str(tmp_path / "out"), ["*.csv"])
        assert [f.path for f in copied] == ["a/b/x.csv", "y.csv"]
        assert s.files(root="/workspace/a") == [
            nsbox.FileInfo("b/x.csv", 2, hashlib.sha256(b"1\n").hexdigest(), 0o644)]
    assert (tmp_path / "out/a/b/x.csv").read_text() == "1\n"
    assert not (tmp_path / "out/z.txt").exists()


def test_copy_out_does_not_follow_a_symlink_at_the_destination(tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(elsewhere)
    with nsbox.Session() as s:
        s.run(["sh", "-c", "mkdir sub; echo data > sub/f"])
        with pytest.raises(FileTransferError, match="a symlink or non-directory is in the way"):
            s.copy_out(str(dest))
    assert list(elsewhere.iterdir()) == []


def test_skipped_list_is_bounded():
    with nsbox.Session(copy_limits=nsbox.CopyLimits(max_files=2)) as s:
        s.run(["sh", "-c", "for i in 1 2 3 4 5 6 7 8; do mkfifo p$i; done"])
        skipped: list[tuple[str, str]] = []
        assert s.files(skipped=skipped) == []
    assert skipped == [(f"p{i}", "a FIFO, not a regular file") for i in (1, 2, 3, 4)] + [
        ("...", "more files skipped, not listed")]


def test_names_a_terminal_would_obey_are_not_written_on_the_host(tmp_path: Path):
    # Names the sandbox made to act on whoever lists the destination later: an OSC that sets
    # the title, a CR that redraws the line, a bidi override ("exe.txt" shown for "txt.exe"), a
    # byte that is not UTF-8; and the same in a directory's name.
    hostile = [b"t\x1b]0;owned\x07.txt", b"a\rb.txt", "\u202etxt.exe".encode(), b"x\xff.txt",
               b"d\x1b[2J/inner.txt"]
    script = (f"import os\nos.mkdir({b'd' + bytes([27]) + b'[2J'!r})\n"
              f"for name in {hostile!r}:\n    open(name, 'wb').write(b'x')\n"
              "open('plain.txt', 'w').write('kept')\n")
    with nsbox.Session() as s:
        assert s.run(["python3", "-c", script], cwd="/workspace").exit_code == 0
        skipped: list[tuple[str, str]] = []
        copied = s.copy_out(str(tmp_path / "out"), skipped=skipped)
        assert s.read_file("/workspace/\u202etxt.exe") == b"x"  # still readable as data
    assert [f.path for f in copied] == ["plain.txt"]
    assert sorted(os.fsencode(p) for p, _ in skipped) == sorted(hostile)
    assert {r for _, r in skipped} == {
        "its name holds a control, format, blank-looking or non-UTF-8 character: not written "
        "on the host"}
    assert os.listdir(tmp_path / "out") == ["plain.txt"]
