"""What a project's review costs the host is bounded by what it shows, not by what the sandbox
wrote (nsbox/host/project.py, nsbox/session/review.py): deletions are found in the sorted
baseline, not by a pass over it per deletion; a listing without diffs reads no file; the diffs
of one reply stop at DIFF_TOTAL; too many changed entries say so and what to do."""

from __future__ import annotations

import errno
import json
import os
import socket
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nsbox.errors import FileTransferError
from nsbox.host import project as projectmod
from nsbox.host.projectmasks import Entry
from nsbox.session import review


class CountingDict(dict[str, Entry]):
    """A baseline that counts the entries any pass over it yields."""

    passed = 0

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            CountingDict.passed += 1
            yield key

    def items(self) -> Any:
        return list(self._counted_items())

    def _counted_items(self) -> Iterator[tuple[str, Entry]]:
        for item in super().items():
            CountingDict.passed += 1
            yield item


def _bare_project(baseline: dict[str, Entry]) -> projectmod.Project:
    """A Project without a host directory (as /tmp/review-out/dos.py built it)."""
    p = projectmod.Project.__new__(projectmod.Project)
    p.baseline = baseline
    p.view = types.SimpleNamespace(masks={}, covered=())  # type: ignore[assignment]
    p.hooks, p.git_configs = (), ()
    p._hashes, p._discarded, p.umask, p.root = {}, {}, 0o022, "/nonexistent"
    p.host_entry = baseline.get  # type: ignore[method-assign,assignment]
    return p


def _file(i: int) -> Entry:
    return Entry("file", 0o100644, 1, i, 0, 0)


def _dir(i: int) -> Entry:
    return Entry("dir", 0o040755, 1, i, 0, 0)


def test_deletions_cost_a_lookup_each_not_a_pass_over_the_project() -> None:
    """19,000 deleted files of a 100,000-file project took one `diff --stat` 3 minutes: every
    deletion scanned the whole baseline. The passes over it no longer grow with the number of
    deletions."""
    n, deleted = 4000, 800
    baseline = CountingDict({f"d{i // 100}/f{i}": _file(i) for i in range(n)})
    baseline.update({f"d{i}": _dir(i) for i in range(n // 100)})
    p = _bare_project(baseline)
    listing = [{"path": f"d{i // 100}/f{i}", "kind": "whiteout", "mode": 0o20000}
               for i in range(deleted)]
    CountingDict.passed = 0
    found = p.changes(listing)
    assert [c.path for c in found] == sorted(f"d{i // 100}/f{i}" for i in range(deleted))
    assert {c.kind for c in found} == {"deleted"}
    # A constant number of passes (sorting, the repository check): 3,360,000 before.
    assert CountingDict.passed <= 3 * len(baseline), CountingDict.passed


def test_a_deleted_or_opaque_directory_lists_exactly_what_was_below_it() -> None:
    """The range of the sorted baseline is what a prefix test over it found: names that sort
    between "d/" and "d0" ("d-x", "d.x", "d/" itself) are not taken for its children."""
    names = ["d", "d-x", "d.x", "d/a", "d/a/b", "d/z", "d0", "dd/e", "e", "e/f", "e/g", "f",
             "f/h"]
    baseline = {n: (_dir(i) if n in ("d", "d/a", "dd", "e", "f") else _file(i))
                for i, n in enumerate(names)}
    baseline["dd"] = _dir(99)
    p = _bare_project(baseline)
    listing = [
        {"path": "d", "kind": "whiteout", "mode": 0o20000},
        {"path": "e", "kind": "dir", "mode": 0o40755, "opaque": True},
        {"path": "e/g", "kind": "file", "mode": 0o100644, "size": 0, "sha256": "0" * 64},
        {"path": "d-x", "kind": "whiteout", "mode": 0o20000},
    ]
    p.host_sha256 = lambda rel, entry: "0" * 64  # type: ignore[method-assign]
    shown = {c.path: (c.kind, c.is_dir) for c in p.changes(listing)}
    assert shown == {"d": ("deleted", True), "d/a": ("deleted", True),
                     "d/a/b": ("deleted", False), "d/z": ("deleted", False),
                     "d-x": ("deleted", False), "e/f": ("deleted", False)}


# --- with a real session ----------------------------------------------------------------------


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Any]:
    from nsbox.session.session import Session

    root = tmp_path / "app"
    root.mkdir()
    root.chmod(0o755)
    (root / "main.py").write_text("print(1)\n")
    with Session(project=str(root)) as s:
        yield s


def _supervised(s: Any, request: dict[str, Any]) -> dict[str, Any]:
    from nsbox.session.supervisor import Supervisor

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    supervisor = Supervisor(s, listener, [], None)
    try:
        return dict(supervisor.changes(request, [], listener))  # type: ignore[arg-type]
    finally:
        listener.close()
        os.close(supervisor.wake_r)
        os.close(supervisor.wake_w)


def _record_reads(s: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    read: list[str] = []
    batch_read = s._read_batch

    def recording(batch: list[Any]) -> dict[str, bytes]:
        read.extend(c.path for c in batch)
        return batch_read(batch)

    monkeypatch.setattr(s, "_read_batch", recording)
    return read


def test_a_listing_without_diffs_reads_no_file_and_has_the_same_token(
        session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nsbox session diff --stat` sends "diff": false: the supervisor built every diff for it
    before (60 files of 1 MiB: 453 MB)."""
    ran = session.run(["sh", "-c", "echo 'print(2)' > main.py; echo new > a.txt"])
    assert ran.ok, ran.stderr
    read = _record_reads(session, monkeypatch)
    bare = _supervised(session, {"op": "changes", "paths": None, "diff": False})
    assert read == []
    assert [(c["path"], "diff" in c) for c in bare["changes"]] == [("a.txt", False),
                                                                   ("main.py", False)]
    full = _supervised(session, {"op": "changes", "paths": None})
    assert sorted(read) == ["a.txt", "main.py"]
    assert all("diff" in c for c in full["changes"])
    assert bare["review"] == full["review"]  # the token digests contents, not diffs


def test_the_diffs_of_one_reply_are_capped(session: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Past DIFF_TOTAL bytes of diffs, a change is listed without its diff and says why, and
    no later batch of files is read. A file over DIFF_MAX is "too large to diff", not
    "binary". The review token does not change."""
    ran = session.run(["sh", "-c", "for f in a b c d; do seq 1 300 > $f.txt; done; "
                       "head -c 1100000 /dev/zero | tr '\\0' x > big.txt"])
    assert ran.ok, ran.stderr
    whole = session.changes()
    one = len(next(c for c in whole if c.path == "a.txt").diff.encode())
    assert not any(c.no_diff for c in whole if c.path != "big.txt")
    monkeypatch.setattr(review, "DIFF_TOTAL", 2 * one + 10)
    found = {c.path: c for c in session.changes()}
    assert [p for p in "abcd" if found[f"{p}.txt"].diff] == ["a", "b"]
    for p in "cd":
        assert found[f"{p}.txt"].no_diff == review.OVER_TOTAL
        assert not found[f"{p}.txt"].binary
    assert found["big.txt"].no_diff == "too large to diff: over 1 MiB"
    assert not found["big.txt"].binary
    assert projectmod.review_token(list(found.values())) == projectmod.review_token(whole)
    # Files are read in batches of at most DIFF_TOTAL bytes (here one file each), and none
    # once the diffs passed it.
    read = _record_reads(session, monkeypatch)
    monkeypatch.setattr(review, "DIFF_TOTAL", 10)
    assert not any(c.diff for c in session.changes())
    assert read == ["a.txt"]
    monkeypatch.setattr(review, "DIFF_TOTAL", 2 * one + 10)
    read.clear()
    session.changes()
    assert read == ["a.txt", "b.txt", "c.txt"]  # c's diff passed it: d is not read
    monkeypatch.setattr(review, "DIFF_TOTAL", 2 * one + 10)
    assert review.changes_at(session, ["d.txt"])[0].diff  # alone, it has its diff


def test_too_many_changed_entries_say_so_and_what_to_do(session: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """20,001 changed files (an npm install) made diff, apply and discard fail with
    "Argument list too long" alone: the sandbox's reason was lost."""
    monkeypatch.setattr(projectmod, "MAX_CHANGES", 5)
    ran = session.run(["sh", "-c", "mkdir node_modules; for i in 1 2 3 4 5 6 7; do "
                       "echo $i > node_modules/$i; done"])
    assert ran.ok, ran.stderr
    for call in (session.changes, session.apply, session.discard):
        with pytest.raises(FileTransferError) as caught:
            call()
        message = str(caught.value)
        assert "Argument list too long" not in message
        assert ("the project has more than 5 changed entries (a review lists at most 5)"
                in message)
        assert "rm -rf node_modules" in message
    ran = session.run(["rm", "-rf", "node_modules"])
    assert [c.path for c in session.changes()] == []


def test_the_file_worker_keeps_the_reason_of_an_os_error(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from nsbox.sandbox import fileworker, projectfs

    def too_many(op: dict[str, Any]) -> bytes:
        raise OSError(errno.E2BIG, "more than 20000 changed entries")

    def missing(op: dict[str, Any]) -> bytes:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))

    ctx = types.SimpleNamespace(step="")
    monkeypatch.setattr(projectfs, "run_changes", too_many)
    assert fileworker.perform(ctx, {"kind": "changes"}) == 1  # type: ignore[arg-type]
    assert json.loads(capfd.readouterr().err)["reason"] == "more than 20000 changed entries"
    monkeypatch.setattr(projectfs, "run_changes", missing)
    assert fileworker.perform(ctx, {"kind": "changes"}) == 1  # type: ignore[arg-type]
    assert json.loads(capfd.readouterr().err) == {"path": "", "reason": os.strerror(
        errno.ENOENT), "errno": errno.ENOENT}
