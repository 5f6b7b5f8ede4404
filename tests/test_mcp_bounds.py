"""What an MCP agent can make the server hold: waiting calls (and their threads), the list of
files written in a reply, a workspace listing. The Workbench's tool bodies are called
directly (nsbox/mcp/tools.py), as the server's worker threads call them: no SDK needed."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import processes_with
from sessiontools import wait_until

import nsbox
from nsbox import visible
from nsbox.errors import FileTransferError, NsboxError
from nsbox.launch.launcher import Cancel
from nsbox.mcp.tools import ServerConfig, Workbench


@pytest.fixture
def bench() -> Iterator[Workbench]:
    with nsbox.Session(timeout=120) as session:
        yield Workbench(session, ServerConfig())


class Caller(threading.Thread):
    """One tool call in a thread of its own, as the server makes it; ``handle`` is its
    cancel handle, ``outcome`` its Reply or the error it raised."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True)
        self.handle = Cancel()
        self.fn, self.args = fn, args
        self.outcome: Any = None

    def run(self) -> None:
        try:
            self.outcome = self.fn(*self.args, call=self.handle)
        except NsboxError as error:
            self.outcome = error


def test_a_cancelled_waiting_call_never_runs_and_the_queue_is_bounded(bench: Workbench):
    """While one command holds the session, a call that waits and is cancelled ends at once
    (its thread gone) and never runs; past a few waiting calls, a call is refused at once
    as busy; the running command is still the one a cancel kills."""
    marker = "nsbox-mcp-long-" + uuid.uuid4().hex
    long = Caller(bench.run_bash, f"exec -a {marker} sleep 60", 90)
    long.start()
    assert wait_until(lambda: processes_with(marker), 20), "the long command did not start"

    waiting = Caller(bench.run_bash, "echo ran > cancelled.txt", 10)
    waiting.start()
    time.sleep(0.3)  # it waits for its turn behind the long command
    bench.cancel(waiting.handle)
    waiting.join(5)
    assert not waiting.is_alive(), "a cancelled call's thread still waits for its turn"
    assert "cancelled before its turn" in str(waiting.outcome)

    early = Cancel()
    bench.cancel(early)  # cancelled before its thread got to the queue
    with pytest.raises(NsboxError, match="cancelled before its turn"):
        bench.write_file("early.txt", "ran", call=early)

    queued = []
    refused: Any = None
    for i in range(50):
        caller = Caller(bench.write_file, f"queued-{i}.txt", "ran")
        caller.start()
        caller.join(0.5)
        if not caller.is_alive():
            refused = caller.outcome
            break
        queued.append(caller)
    assert 1 <= len(queued) <= 16, f"{len(queued)} calls wait for the session"
    assert isinstance(refused, NsboxError)
    assert "the session is busy with another call" in str(refused)
    for caller in queued:
        bench.cancel(caller.handle)
    for caller in queued:
        caller.join(5)
        assert not caller.is_alive()

    bench.cancel(long.handle)
    long.join(10)
    assert not long.is_alive() and long.outcome.data["status"] == "SG"
    assert not processes_with(marker)
    after = bench.run_bash("ls", 10)
    assert after.data["status"] == "OK"
    assert after.data["stdout"] == "", "a cancelled call ran after all"


# Three directories of 251-character names with a thousand files of 241 characters in the
# deepest: each path written is ~1000 characters, most of them control characters (six bytes
# each in JSON, four in the text).
MANY_LONG_NAMES = r'''
import os
os.chdir("/workspace")
for i in range(3):
    n = "\x01" * 250 + str(i)
    os.mkdir(n); os.chdir(n)
for j in range(1000):
    open("\x02" * 240 + str(j), "w").write("0")
'''


def test_the_files_written_in_a_run_reply_are_capped(bench: Workbench):
    bench.write_file("setup.py", MANY_LONG_NAMES)
    reply = bench.run_bash("python3 setup.py", 60)
    assert reply.data["status"] == "OK"
    assert len(reply.text) < 32 * 1024
    assert len(json.dumps(visible.json_ready(reply.data))) < 128 * 1024
    assert reply.data["files_total"] == 1000
    assert len(reply.data["files"]) == 50
    assert all(entry["name_truncated"] and len(entry["name"]) <= 200
               for entry in reply.data["files"])
    assert reply.text.endswith("[950 more; 1000 files written in all]")
    shown = reply.text.split("--- files written ---\n", 1)[1].splitlines()
    assert len(shown) == 51 and all(len(line) < 300 for line in shown)
    # Short names are listed whole, with no mark (the long ones gone: 1000 files is the
    # listing's limit).
    small = bench.run_bash("rm -r -- */ setup.py && echo 1 > a.txt", 10)
    assert [f["name"] for f in small.data["files"]] == ["a.txt"]
    assert "name_truncated" not in small.data["files"][0] and small.data["files_total"] == 1


# Three chains of 60 directories with 250-character names of control characters, and 400
# files in the deepest of each: the workspace's listing in JSON is over 16 MiB.
HUGE_LISTING = r'''
import os
name = "\x01" * 250
os.chdir("/workspace")
for top in range(3):
    os.makedirs(f"t{top}", exist_ok=True)
    os.chdir(f"t{top}")
    for i in range(60):
        n = name[:-3] + f"{i:03d}"
        os.mkdir(n); os.chdir(n)
    for j in range(400):
        open(f"{j}" + "\x02" * 200, "w").close()
    os.chdir("/workspace")
'''


def test_a_listing_past_its_size_is_cut_and_the_run_tools_go_on(bench: Workbench):
    made = bench.run_python(HUGE_LISTING, 60)
    assert made.data["status"] == "OK"
    assert any("listing was cut" in note for note in made.data["notes"]), made.text
    assert "note: the workspace's listing was cut" in made.text
    assert made.data["files"] and all(f["name"].startswith("t0/") for f in made.data["files"])

    skipped: list[tuple[str, str]] = []
    listing = bench.session.files(skipped=skipped)
    assert listing.truncated is True and len(listing) > 0
    assert skipped[-1][0] == "..." and "the rest is not listed" in skipped[-1][1]
    listed = bench.list_files()
    assert listed.data["truncated"] is True
    assert "was cut" in listed.text.splitlines()[-1]

    # The agent can still run a command, and one that cleans up gets a whole listing again.
    cleaned = bench.run_bash("rm -rf t0 t1 t2; echo cleaned", 60)
    assert cleaned.data["status"] == "OK" and cleaned.data["stdout"] == "cleaned\n"
    assert any("listing was cut" in note for note in cleaned.data["notes"])
    again = bench.run_bash("echo x > after.txt", 10)
    assert [f["name"] for f in again.data["files"]] == ["after.txt"]
    assert "notes" not in again.data
    assert bench.session.files().truncated is False


def test_a_listing_that_fails_does_not_stop_the_run_tools(bench: Workbench,
                                                           monkeypatch: pytest.MonkeyPatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise FileTransferError("/workspace", "the file operation failed (OL)")

    monkeypatch.setattr(bench.session, "files", broken)
    reply = bench.run_bash("echo ran > ran.txt; echo ok", 10)
    assert reply.data["status"] == "OK" and reply.data["stdout"] == "ok\n"
    assert reply.data["files"] == [] and reply.data["files_total"] == 0
    assert reply.data["notes"] == [
        "the files the command wrote are not known: the workspace could not be listed before "
        "it (/workspace: the file operation failed (OL))"]
    monkeypatch.undo()
    assert bench.session.read_file("ran.txt") == b"ran\n"


def test_files_past_a_cut_listing_are_not_taken_for_new():
    """Before the command, the listing was cut after b/x: a file past it is not known to be
    new (it may have been there, unlisted); a change before the cut is."""
    from nsbox.mcp.files_written import Snapshot, written

    def entry(name: str, sha: str) -> dict[str, Any]:
        return {"name": name, "size": 1, "sha256": sha * 64}

    before = Snapshot({"a": "1" * 64, "b/x": "2" * 64}, cut=True)
    entries = [entry("a", "3"), entry("b/x", "2"), entry("b/y", "4"), entry("b.txt", "5"),
               entry("c", "6")]
    after = Snapshot({e["name"]: e["sha256"] for e in entries})
    produced, notes = written(before, after, entries)
    assert [e["name"] for e in produced] == ["a"]
    assert notes == ["the workspace's listing was cut (its names passed the listing's size): "
                     "files written past the cut are not listed"]
