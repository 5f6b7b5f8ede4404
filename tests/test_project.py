"""The project workspace: a host directory the sandbox changes copy-on-write; the host reviews
the changes and applies the ones it chooses (nsbox/host/project.py).

Each test runs as this process's user and as the unprivileged uid, as a host program would;
the evidence (the project tree byte for byte, modes, file types) is read on the host."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, UNPRIVILEGED_UID, require
from sessiontools import UserRunner, user_runner

from nsbox.errors import NsboxError

CANARY = "nsbox-canary-7f3a91"
DEVELOPER_UID = 1000  # the owner of the project when the tests run as root


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def _git(project: Path, *args: str) -> None:
    require(shutil.which("git") is not None, "git is not installed (the project is a repository)")
    subprocess.run(["git", "-C", str(project), "-c", "user.name=dev", "-c",
                    "user.email=dev@example.com", *args], check=True, capture_output=True)


@pytest.fixture
def project(as_user: UserRunner) -> Iterator[Path]:
    """A developer's project: a git repository with a .env holding a canary (ignored by git,
    as usual), a token in .git/config, sources, a binary file and a file the host edits
    during the session."""
    top = Path(tempfile.mkdtemp(prefix="nsbox-project-", dir="/tmp"))
    try:  # removed also when the setup fails (a test that fails has its teardown anyway)
        top.chmod(0o755)
        root = top / "app"
        (root / "src").mkdir(parents=True)
        (root / "src" / "app.py").write_text("def main():\n    return 1\n")
        (root / "README.md").write_text("# app\n")
        (root / "notes.txt").write_text("host notes\n")
        (root / "data.bin").write_bytes(bytes(range(256)))
        (root / ".env").write_text(f"API_KEY={CANARY}\n")
        (root / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{CANARY}\n")
        (root / ".gitignore").write_text(".env\nid_rsa\n")
        _git(root, "init", "-q")
        _git(root, "add", "-A")
        _git(root, "commit", "-qm", "start")
        _git(root, "remote", "add", "origin", f"https://dev:{CANARY}@example.com/app.git")
        owner = UNPRIVILEGED_UID if as_user.mode == "unprivileged" else (
            DEVELOPER_UID if os.geteuid() == 0 else os.geteuid())
        if os.geteuid() == 0:
            for path in [top, *top.rglob("*")]:
                os.lchown(path, owner, owner)
        yield root
    finally:
        shutil.rmtree(top)


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry below ``root``: type, permission bits and content (or link target)."""
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISREG(st.st_mode):
                found[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_nlink, path.read_bytes())
            elif stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            else:
                found[rel] = ("other" if not stat.S_ISDIR(st.st_mode) else "dir",
                              stat.S_IMODE(st.st_mode))
    return found


# The host program: the agent works in a session, the host looks and applies.
AGENT = """
s = nsbox.Session(project={project!r}, timeout=60)
def sh(cmd):
    r = s.run(["sh", "-c", cmd])
    return [r.status.value, r.exit_code, r.stdout.decode(), r.stderr.decode()]
out = {{}}
out["masked"] = s.masked
out["secrets"] = sh("cat /workspace/.env /workspace/id_rsa /workspace/.git/config; "
                    "grep -rs {canary!r} /workspace /.nsbox-project /tmp; echo end")
out["write_secret"] = sh("echo stolen > /workspace/.env; rm -f /workspace/.env; echo $?")
out["edit"] = sh("cd /workspace && printf 'def main():\\\\n    return 2\\\\n' > src/app.py && "
                 "rm README.md && echo new > src/new.py && mkdir docs && echo d > docs/a.md && "
                 "echo agent >> notes.txt && chmod 755 data.bin && git status --short")
emit_before = None
"""


def _changes(found: list[Any]) -> dict[str, str]:
    return {c["path"]: c["kind"] for c in found}


def test_agent_changes_are_reviewed_and_only_the_chosen_ones_land(as_user: UserRunner,
                                                                 project: Path):
    before = snapshot(project)
    body = AGENT.format(project=str(project), canary=CANARY) + """
changes = [c.to_dict() for c in s.changes()]
out["changes"] = changes
# The user edits a file in the project meanwhile: the agent's edit of it is a conflict.
with open({notes!r}, "a") as f:
    f.write("edited by the host\\n")
out["apply"] = s.apply(["src/app.py", "src/new.py", "notes.txt"]).to_dict()
out["after_apply"] = [c.to_dict() for c in s.changes(diff=False)]
out["rm"] = sh("rm -rf /workspace/* ; ls -A /workspace")
out["after_rm"] = [c.to_dict() for c in s.changes(diff=False)]
s.close()
emit(**out)
""".format(notes=str(project / "notes.txt"))
    out = as_user.script(body)
    # The masked secrets: listed, empty and read-only inside, the canary nowhere.
    assert out["masked"] == [".env", ".git/config", "id_rsa"]
    assert CANARY not in out["secrets"][2] + out["secrets"][3]
    assert out["secrets"][2].strip() == "end"
    assert "Read-only file system" in out["write_secret"][3] or \
        "Permission denied" in out["write_secret"][3]
    assert out["edit"][0] == "OK", out["edit"]
    # changes() lists exactly what changed, with a diff for text.
    changes = {c["path"]: c for c in out["changes"]}
    assert _changes(out["changes"]) == {
        "src/app.py": "modified", "README.md": "deleted", "src/new.py": "added",
        "docs": "added", "docs/a.md": "added", "notes.txt": "modified", "data.bin": "mode"}
    assert "-    return 1\n+    return 2\n" in changes["src/app.py"]["diff"]
    assert changes["data.bin"]["mode"] == "755" and changes["data.bin"]["old_mode"] == "644"
    # Only the chosen subset landed; the file the host edited is a conflict, untouched.
    assert out["apply"] == {"applied": ["src/app.py", "src/new.py"],
                            "conflicts": ["notes.txt"], "refused": []}
    after = snapshot(project)
    assert after["src/app.py"][3] == b"def main():\n    return 2\n"
    assert after["src/new.py"][3] == b"new\n"
    assert after["notes.txt"][3] == b"host notes\nedited by the host\n"
    expected = dict(before)
    for rel in ("src/app.py", "src/new.py", "notes.txt"):
        expected.pop(rel, None)
        after.pop(rel)
    assert after == expected  # nothing else changed on the host: not README.md, not data.bin
    assert _changes(out["after_apply"]) == {
        "README.md": "deleted", "docs": "added", "docs/a.md": "added", "notes.txt": "modified",
        "data.bin": "mode"}
    # rm -rf /workspace/* inside: the host keeps every file; the deletions are only listed.
    assert out["rm"][2].split() == [".env", ".git", ".gitignore", "id_rsa"]  # masks: EBUSY
    final = snapshot(project)
    assert final["README.md"][3] == b"# app\n" and final["data.bin"][3] == bytes(range(256))
    kinds = _changes(out["after_rm"])
    assert kinds["README.md"] == kinds["src/app.py"] == kinds["data.bin"] == "deleted"
    assert ".env" not in kinds and ".git/config" not in kinds


def test_host_tree_is_untouched_until_apply(as_user: UserRunner, project: Path):
    before = snapshot(project)
    body = AGENT.format(project=str(project), canary=CANARY) + """
out["rm"] = sh("rm -rf /workspace/* /workspace/.git; ls -A /workspace")
import hashlib
out["n"] = len(s.changes(diff=False))
s.discard()
out["after_discard"] = len(s.changes(diff=False))
out["apply"] = s.apply().to_dict()
s.close()
emit(**out)
"""
    out = as_user.script(body)
    assert out["rm"][2].split() == [".env", ".git", ".gitignore", "id_rsa"]
    assert "Read-only file system" in out["rm"][3] or "busy" in out["rm"][3]  # .git
    assert out["n"] == 5  # README.md, data.bin, notes.txt, src, src/app.py
    assert out["after_discard"] == 0
    assert out["apply"] == {"applied": [], "conflicts": [], "refused": []}
    assert snapshot(project) == before


def test_links_fifos_setid_and_sparse_files_never_reach_the_host(as_user: UserRunner,
                                                                  project: Path):
    before = snapshot(project)
    body = """
# No file size rlimit: the 5 GB sparse file is made, and must stop at the review.
s = nsbox.Session(nsbox.Policy().with_limits(file_size=None), project={project!r}, timeout=60)
r = s.run(["sh", "-c", "cd /workspace && ln -s /etc/shadow link && echo h > h1 && ln h1 h2 && "
           "mkfifo fifo && echo x > suid && chmod 755 suid && (chmod 6755 suid || true) && "
           "truncate -s 5G sparse && "
           "ln -s ../../outside src/escape && mkdir -p tricky && echo t > tricky/f"])
out = dict(status=r.status.value, err=r.stderr.decode())
out["changes"] = [c.to_dict() for c in s.changes(diff=False)]
# The host's directory becomes a symlink to a place outside before apply.
os.rename({project!r} + "/src", {project!r} + "/src.moved")
os.mkdir({outside!r})
os.symlink({outside!r}, {project!r} + "/tricky")
out["apply"] = s.apply().to_dict()
s.close()
emit(**out)
""".format(project=str(project), outside=str(project.parent / "outside"))
    out = as_user.script(body)
    assert out["status"] == "OK", out["err"]
    kinds = {c["path"]: (c["kind"], c.get("reason", "")) for c in out["changes"]}
    assert kinds["link"] == ("symlink", "a symlink: never applied to the host")
    assert kinds["src/escape"][0] == "symlink"
    assert kinds["h1"] == kinds["h2"] == ("refused", "a hard link (2 names)")
    assert kinds["fifo"] == ("refused", "a FIFO, socket or device")
    assert kinds["sparse"] == ("refused", "too large: 5368709120 bytes, the limit is 67108864")
    assert kinds["suid"][0] == "added"
    refused = {r["path"]: r["reason"] for r in out["apply"]["refused"]}
    assert set(refused) >= {"link", "h1", "h2", "fifo", "sparse", "src/escape"}
    # Host-side evidence: the set-id file landed without its bits, nothing else of the above.
    after = snapshot(project)
    assert after["suid"][:3] == ("file", 0o755, 1)
    assert not any(after.get(name) for name in ("link", "h1", "h2", "fifo", "sparse"))
    assert not any(stat.S_IMODE(p.lstat().st_mode) & 0o6000 for p in project.rglob("*"))
    # tricky/ was a new directory; the host's symlink there was never followed.
    assert os.listdir(project.parent / "outside") == []
    assert "tricky/f" in out["apply"]["conflicts"] + list(refused)
    assert "tricky" in out["apply"]["conflicts"]
    for rel in ("README.md", "notes.txt", ".env"):
        assert after[rel] == before[rel]


def _cli(user: UserRunner, runtime: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree),
           "XDG_RUNTIME_DIR": str(runtime), "HOME": "/tmp"}
    return subprocess.run([*user.prefix(), PYTHON, "-m", "nsbox", *args],
                          capture_output=True, env=env, cwd=runtime, timeout=60)


def _start_session(as_user: UserRunner, project: Path) -> tuple[Path, str]:
    """`nsbox session start --project` as the user, with a runtime directory of its own."""
    runtime = project.parent / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, as_user.uid, as_user.uid)
    start = _cli(as_user, runtime, "session", "start", "--project", str(project))
    assert start.returncode == 0, start.stderr
    return runtime, start.stdout.decode().strip()


def test_cli_session_diff_apply_discard(as_user: UserRunner, project: Path):
    runtime, sid = _start_session(as_user, project)
    record = json.loads((runtime / "nsbox" / f"{sid}.json").read_text())
    assert record["masked"] == [".env", ".git/config", "id_rsa"]
    try:
        ran = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                   "echo more >> README.md && echo tmp > scratch.txt && rm notes.txt")
        assert ran.returncode == 0, ran.stderr
        diff = _cli(as_user, runtime, "session", "diff", sid)
        assert diff.returncode == 0, diff.stderr
        assert diff.stdout.decode().splitlines()[:6] == [
            " modified  README.md", "--- a/README.md", "+++ b/README.md", "@@ -1 +1,2 @@",
            " # app", "+more"]
        assert "  deleted  notes.txt" in diff.stdout.decode()
        assert project.joinpath("README.md").read_text() == "# app\n"
        applied = _cli(as_user, runtime, "session", "apply", sid, "README.md", "notes.txt")
        assert (applied.returncode, applied.stdout.decode()) == (
            0, "  applied  README.md\n  applied  notes.txt\n"), applied.stderr
        assert project.joinpath("README.md").read_text() == "# app\nmore\n"
        assert not project.joinpath("notes.txt").exists()
        dropped = _cli(as_user, runtime, "session", "discard", sid)
        assert dropped.stdout.decode() == "discarded  scratch.txt\n"
        assert _cli(as_user, runtime, "session", "diff", sid, "--stat").stdout == b""
        assert not project.joinpath("scratch.txt").exists()
    finally:
        _cli(as_user, runtime, "session", "stop", sid)


def test_apply_with_the_review_writes_what_was_reviewed_or_nothing(as_user: UserRunner,
                                                                   project: Path):
    """The agent makes a harmless change, the user reviews it; before the user applies, the
    agent's next command rewrites the reviewed file and adds another. apply with the review
    (the CLI's token, the API's list of changes) writes nothing of it; the host keeps its
    tree. For the same paths, an unchanged review applies."""
    runtime, sid = _start_session(as_user, project)
    try:
        assert _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                    "printf 'def main():\\n    return 2\\n' > src/app.py").returncode == 0
        diff = _cli(as_user, runtime, "session", "diff", sid, "src")
        assert "+    return 2" in diff.stdout.decode()
        hint = diff.stderr.decode().splitlines()[-1]
        assert hint.startswith(f"nsbox: to apply exactly these: nsbox session apply {sid} "
                               "--reviewed "), hint
        token = hint.split("--reviewed ")[1].split()[0]
        assert len(token) == 32 and hint.endswith(f"{token} src")
        swapped = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                       f"printf 'import os\\nos.system(\\\"touch /tmp/{CANARY}\\\")\\n' "
                       "> src/app.py; echo evil > src/evil.py")
        assert swapped.returncode == 0, swapped.stderr
        before = snapshot(project)
        refused = _cli(as_user, runtime, "session", "apply", sid, "--reviewed", token, "src")
        assert refused.returncode != 0
        assert refused.stderr.decode().startswith(
            "nsbox: reviewed: the changes are not the ones reviewed: the sandbox changed them "
            "since; "
            "nothing was applied"), refused.stderr
        assert snapshot(project) == before  # host-side: not a byte written
        # Reviewed again, applied as reviewed.
        diff = _cli(as_user, runtime, "session", "diff", sid, "--json", "src")
        token = json.loads(diff.stdout)["review"]
        applied = _cli(as_user, runtime, "session", "apply", sid, "--reviewed", token, "src")
        assert applied.returncode == 0, applied.stderr
        assert sorted(applied.stdout.decode().splitlines()) == [
            "  applied  src/app.py", "  applied  src/evil.py"]
    finally:
        _cli(as_user, runtime, "session", "stop", sid)
    out = as_user.script(f"""
s = nsbox.Session(project={str(project)!r})
s.run(["sh", "-c", "echo one > /workspace/notes.txt"])
reviewed = s.changes()
s.run(["sh", "-c", "echo two > /workspace/notes.txt"])
try:
    s.apply(reviewed=reviewed)
    error = None
except nsbox.errors.PolicyError as e:
    error = e.key
host = open({str(project / "notes.txt")!r}).read()
s.apply(["notes.txt"], reviewed=[c for c in s.changes() if c.path == "notes.txt"])
emit(error=error, host=host)
s.close()
""")
    assert out == {"error": "reviewed", "host": "host notes\n"}
    assert project.joinpath("notes.txt").read_text() == "two\n"


CHANGE_EVERY_OTHER = """
rows = open("/workspace/data.csv").read().splitlines(True)
open("/workspace/data.csv", "w").write("".join(r if i % 2 else "changed," + r
                                               for i, r in enumerate(rows)))
open("/workspace/big.txt", "w").write("short\\n")
"""
CHANGE_ONE = """
rows = open("/workspace/data.csv").read().splitlines(True)
rows = [r[len("changed,"):] if r.startswith("changed,") else r for r in rows]
rows[12000] = "one line changed\\n"
open("/workspace/data.csv", "w").write("".join(rows))
"""


def test_a_diff_costs_the_host_little_whatever_the_sandbox_changed(as_user: UserRunner,
                                                                     project: Path):
    """difflib's work grows with the product of the lines that differ: a sandbox that changes
    every other line of a large file of unique lines (a CSV) kept the review busy for most of a
    minute. Such a change is listed without a diff, with why; one line changed in the same
    file still has its diff; a host file over the diff limit is never diffed against nothing."""
    rows = [f"{i},{i * 7919 % 100003},row-{i}\n" for i in range(25_000)]
    project.joinpath("data.csv").write_text("".join(rows))
    project.joinpath("big.txt").write_text("x" * 100 + "\n" * (1 << 20))
    if os.geteuid() == 0:
        owner = project.stat()
        for name in ("data.csv", "big.txt"):
            os.chown(project / name, owner.st_uid, owner.st_gid)
    out = as_user.script(f"""
s = nsbox.Session(project={str(project)!r})
s.run(["python3", "-c", {CHANGE_EVERY_OTHER!r}])
seen = {{c.path: [c.kind, c.diff is not None, c.no_diff] for c in s.changes()}}
s.run(["python3", "-c", {CHANGE_ONE!r}])
one = [c.diff for c in s.changes() if c.path == "data.csv"][0]
emit(seen=seen, one=one)
s.close()
""")
    assert out["seen"]["data.csv"] == [
        "modified", False, "too many lines changed to diff here (25000 and 25000 lines)"]
    assert out["seen"]["big.txt"] == [
        "modified", False, "the host's file is over 1 MiB, or could not be read"]
    added = [line for line in out["one"].splitlines() if line.startswith("+")]
    assert added == ["+++ b/data.csv", "+one line changed"]


def test_cli_session_diff_larger_than_a_datagram(as_user: UserRunner, project: Path):
    # The supervisor's reply is about 700 KB, more than one SOCK_SEQPACKET datagram may be
    # (the socket's send buffer, about 208 KB by default).
    runtime, sid = _start_session(as_user, project)
    try:
        ran = _cli(as_user, runtime, "session", "exec", sid, "--", "python3", "-c",
                   "open('big.txt', 'w').write(''.join("
                   "f'line {i} of a long file\\n' for i in range(30000)))")
        assert ran.returncode == 0, ran.stderr
        diff = _cli(as_user, runtime, "session", "diff", sid, "big.txt")
        assert diff.returncode == 0, diff.stderr
        lines = diff.stdout.decode().splitlines()
        assert lines[:3] == ["    added  big.txt mode 644", "--- /dev/null", "+++ b/big.txt"]
        assert lines[-1] == "+line 29999 of a long file"
        assert len(lines) == 30004
    finally:
        _cli(as_user, runtime, "session", "stop", sid)


def test_cli_run_project_lists_and_drops_changes(as_user: UserRunner, project: Path):
    before = snapshot(project)
    ran = _cli(as_user, project.parent, "run", "--project", str(project), "--", "sh", "-c",
               "rm -rf /workspace/*; cat /workspace/.env; echo done")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == b"done\n"
    assert "change(s) to the project, not applied" in ran.stderr.decode()
    assert "nsbox:   deleted README.md" in ran.stderr.decode()
    assert snapshot(project) == before


def _in_process_only(user: UserRunner) -> None:
    if user.mode != "caller":
        pytest.skip("runs in this process: the 'caller' run covers it")


def test_profile_keys_for_the_project(as_user: UserRunner, project: Path, tmp_path: Path):
    _in_process_only(as_user)
    profile = tmp_path / "agent.toml"
    profile.write_text(f'[workspace]\nproject = "{project}"\nsecrets = ["*.md"]\n')
    from nsbox.profiles import load_profile

    policy = load_profile(str(profile))
    assert policy.project == str(project)
    assert policy.project_secrets == ("*.md",)
    from nsbox.session.session import Session

    with Session(policy) as s:
        # Credentials are always masked; README.md is tracked, so .git is withheld (git show
        # HEAD:README.md would read it).
        assert s.masked == [".git/", "README.md"]
        assert s.project_notes == [".git withheld: git knows the masked README.md (its path "
                                   "or its content), which the object store would show"]
        shown = s.run(["cat", "README.md", ".env"])
        assert shown.stdout == f"API_KEY={CANARY}\n".encode()  # only the listed names masked


def test_the_changes_op_diffs_only_the_chosen_changes(as_user: UserRunner, project: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    """The supervisor's ``changes`` op (`nsbox session diff ID PATH`, the review server's
    `changes`) gives what ``choose(changes(), paths)`` gives, and reads from the sandbox the
    chosen files only for their diffs, not every changed file's."""
    _in_process_only(as_user)
    import socket

    from nsbox.session import review
    from nsbox.session.session import Session
    from nsbox.session.supervisor import Supervisor

    with Session(project=str(project)) as s:
        ran = s.run(["sh", "-c", "echo agent >> README.md; echo sandbox > notes.txt; "
                     "echo x > src/new.py; echo y > READMEx"])
        assert ran.ok, ran.stderr
        read: list[str] = []
        batch_read = s._read_batch

        def recording(batch: list[Any]) -> dict[str, bytes]:
            read.extend(c.path for c in batch)
            return batch_read(batch)

        monkeypatch.setattr(s, "_read_batch", recording)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        supervisor = Supervisor(s, listener, [], None)
        try:
            reply = supervisor.changes({"op": "changes", "paths": ["README.md"]}, [], listener)
        finally:
            listener.close()
            os.close(supervisor.wake_r)
            os.close(supervisor.wake_w)
        assert read == ["README.md"]
        read.clear()
        every = review.choose(s.changes(), ["README.md"])
        assert sorted(read) == ["README.md", "READMEx", "notes.txt", "src/new.py"]
        assert reply == {"changes": [c.to_dict() for c in every],
                         "review": review.review_token(every)}
        assert [c["path"] for c in reply["changes"]] == ["README.md"]
        assert "+agent" in reply["changes"][0]["diff"]


def test_project_and_workspace_together_are_refused(as_user: UserRunner, project: Path,
                                                     tmp_path: Path):
    _in_process_only(as_user)
    from nsbox.errors import PolicyError
    from nsbox.session.session import Session

    with pytest.raises(PolicyError, match="a project and a workspace directory cannot both"):
        Session(workspace=str(tmp_path), project=str(project))
    with pytest.raises(NsboxError, match="is not a directory"):
        Session(project=str(project / "README.md"))
    # The rule book decides the project as a read-only bind source, before anything is read.
    with pytest.raises(PolicyError, match="^project: refused by rule bind-root: / is /"):
        Session(project="/")
    with pytest.raises(PolicyError, match="^project: refused by rule bind-proc"):
        Session(project="/proc/1")


def test_mcp_agent_sees_changes_and_only_the_user_applies(as_user: UserRunner, project: Path):
    """The agent's tools (the Workbench of ``nsbox mcp --project``) list changes and write
    nothing; the user's review tools (``nsbox mcp --review ID``) reach the published session
    through this user's private socket. The MCP SDK is not needed for these tool bodies."""
    runtime = project.parent / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, as_user.uid, as_user.uid)
    body = """
from nsbox.mcp.tools import ServerConfig, Workbench
from nsbox.mcp.review import AGENT_TOOLS, REVIEW_TOOLS, Reviewer, publish_for_review
s = nsbox.Session(project={project!r})
publish_for_review(s)
bench = Workbench(s, ServerConfig(project={project!r}))
ran = bench.run_bash("echo agent >> README.md && rm notes.txt", 30)
seen = bench.changes()
review = Reviewer(s.id)
listed = review.changes().data
host_before = open({readme!r}).read()
try:
    review.apply(["README.md"], "0" * 32)
    stale = None
except nsbox.errors.PolicyError as e:
    stale = e.key
applied = review.apply(["README.md"], review.changes(["README.md"]).data["review"]).data
dropped = review.discard().data
after = bench.changes().data
emit(status=ran.data["status"], agent=seen.data, text=seen.text, listed=listed, stale=stale,
     host_before=host_before, applied=applied, dropped=dropped, after=after,
     agent_tools=list(AGENT_TOOLS), review_tools=list(REVIEW_TOOLS),
     bench_has=[n for n in ("apply", "discard") if hasattr(bench, n)])
s.close()
""".format(project=str(project), readme=str(project / "README.md"))
    out = as_user.script(body, env={"XDG_RUNTIME_DIR": str(runtime)})
    assert out["status"] == "OK"
    assert _changes(out["agent"]["changes"]) == {"README.md": "modified", "notes.txt": "deleted"}
    assert "no tool of yours can" in out["text"] and "+agent" in out["text"]
    assert out["agent_tools"] == ["changes"] and out["bench_has"] == []
    assert out["review_tools"] == ["changes", "apply", "discard"]
    assert out["listed"]["changes"] == out["agent"]["changes"]
    assert out["host_before"] == "# app\n"  # nothing landed before the user applied
    assert out["stale"] == "reviewed" and len(out["listed"]["review"]) == 32
    assert out["applied"] == {"applied": ["README.md"], "conflicts": [], "refused": []}
    assert out["dropped"] == {"discarded": ["notes.txt"]}
    assert out["after"]["changes"] == []
    assert project.joinpath("README.md").read_text() == "# app\nagent\n"
    assert project.joinpath("notes.txt").read_text() == "host notes\n"


def test_a_root_owned_project_as_root_is_edited_and_applied_as_root(tmp_path: Path):
    """As root the sandbox is nobody on the host; the project's read-only lower layer shows
    its owner as the sandbox's user, and apply writes as the caller (root), never as the
    sandbox's host uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the project is root's")
    from nsbox.session.session import Session

    root = tmp_path / "app"
    root.mkdir()
    (root / "main.py").write_text("print(1)\n")
    with Session(project=str(root)) as s:
        ran = s.run(["sh", "-c", "echo 'print(2)' > main.py && echo new > added.txt"])
        assert ran.status.value == "OK", ran.stderr
        assert (root / "main.py").read_text() == "print(1)\n"
        assert s.apply().applied == ["added.txt", "main.py"]
    assert (root / "main.py").read_text() == "print(2)\n"
    st = (root / "added.txt").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o644)


def test_a_long_name_in_bytes_is_written_and_a_large_text_is_too_large_to_diff(tmp_path: Path):
    """The temporary name beside a file was cut at 200 characters, not bytes: 80 CJK
    characters (240 bytes) made it 255+ bytes, and apply failed "File name too long". A text
    file over DIFF_MAX was shown as "binary"."""
    from nsbox._sys.paths import replace_file
    from nsbox.host import project as projectmod

    names = ["漢" * 80, "a" * 255, os.fsdecode(b"\xff" * 200 + "é".encode() * 27)]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            assert len(os.fsencode(name)) <= 255
            replace_file(fd, name, [b"data"], 0o644)
            assert (tmp_path / name).read_bytes() == b"data"
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(names)  # no temporary name left
    p = projectmod.Project.__new__(projectmod.Project)
    big = projectmod.Change("big.log", "added", size=projectmod.DIFF_MAX + 1, sha256="0" * 64)
    shown = p.with_diff(big, None)
    assert (shown.no_diff, shown.binary, shown.diff) == ("too large to diff: over 1 MiB",
                                                         False, None)
