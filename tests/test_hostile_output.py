"""What a sandbox makes reaches a person's terminal only escaped (nsbox/visible.py), and a
project's git hooks and config never come out of a sandbox (nsbox/host/autorun.py).

A hostile command in a project session names files and fills them with what a terminal obeys:
CR, "erase line", cursor moves, "clear screen and scrollback" (ESC [3J ESC [2J) on the file
that sorts last (it would wipe the line that announces a hook), an OSC (title, clipboard), the
C1 CSI, a bidi override, a newline with a forged diff header. The real CLI commands run on a
pseudo-terminal and in pipes; the exact bytes they wrote are checked. Then the changes are
applied and the host runs ``git commit`` in the project: no hook of the sandbox's runs (its
canary stays absent). As the caller (root here), as the unprivileged uid and as root of a user
namespace."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import UNPRIVILEGED_UID
from ptytools import lines, nsbox_argv, obeyed, run_on_terminal
from sessiontools import UserRunner, user_runner

from nsbox import visible
from nsbox.host import terminal as host_terminal

CANARY_NAME = "nsbox-hook-ran"
NAME_REASON = ("its name holds a control, format, blank-looking or non-UTF-8 character: not "
               "written on the host")
DEVELOPER_UID = 1000

# The sandbox's files: name -> content (python3 in the sandbox writes them, with names of any
# bytes). "zzz..." sorts last: its name clears the screen and the scrollback.
HOSTILE = {
    "zzz\x1b[3J\x1b[2J": "a\x1b[3J\x1b[2J\x1b[Hclean\n",
    "osc\x1b]0;pwned\x07.txt": "title\x1b]52;c;ZXZpbA==\x07\n",
    "cr\rREADME.md": "line\r\x1b[2Koverwritten\x1b[1A\n",
    "bidi\u202etxt.exe": "x = 1  # \u202e\u2066 hidden \u2069\n",
    "c1\u009b2J": "\u009b2J\n",
    "nl\n+++ b/README.md": "forged\n",
}
MAKE = "\n".join([
    "import os",
    f"files = {HOSTILE!r}",
    "for name, text in files.items():",
    "    os.makedirs(os.path.dirname('/workspace/' + name), exist_ok=True)",
    "    open('/workspace/' + name, 'w').write(text)",
    "open('/workspace/Makefile', 'w').write('all:\\n\\ttrue\\n')",
    "open('/workspace/deploy.sh', 'w').write('#!/bin/sh\\necho deployed\\n')",
    "os.chmod('/workspace/deploy.sh', 0o777)",
    "open('/workspace/new.sh', 'w').write('#!/bin/sh\\n')",
    "os.chmod('/workspace/new.sh', 0o777)",
    "hook = '#!/bin/sh\\ntouch /tmp/" + CANARY_NAME + "-$PPID\\n'",
    "try:",
    "    os.makedirs('/workspace/.git/hooks', exist_ok=True)",
    "    open('/workspace/.git/hooks/pre-commit', 'w').write(hook)",
    "    os.chmod('/workspace/.git/hooks/pre-commit', 0o755)",
    "    print('hook written')",
    "except OSError as e:",
    "    print('hook refused:', e.strerror)",
])


@pytest.fixture(params=["caller", "unprivileged", "nested"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def _owner(user: UserRunner) -> int:
    """Who owns the project: a developer for a root caller, the caller itself otherwise; for
    root of a user namespace, an id it maps and the sandbox's host id (65534): that root has
    no power over an unmapped owner's files, and its sandbox binds the project unmapped."""
    if user.mode == "caller" and os.geteuid() == 0:
        return DEVELOPER_UID
    return UNPRIVILEGED_UID if user.mode == "nested" else user.uid


def _git(project: Path, *args: str, uid: int | None = None) -> subprocess.CompletedProcess:
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if (
        uid is not None and uid != os.geteuid()) else []
    return subprocess.run([*prefix, "git", "-C", str(project), "-c", "user.name=dev", "-c",
                           "user.email=dev@example.com", *args], capture_output=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, timeout=60)


@contextmanager
def _make_project(user: UserRunner, git: bool, hooks_path: str | None = None
                  ) -> Iterator[Path]:
    """A project (``app``) and a runtime directory beside it in a directory of /tmp of its
    own, removed at the end of the ``with`` block, also when an assertion fails in it."""
    top = Path(tempfile.mkdtemp(prefix="nsbox-hostile-", dir="/tmp"))
    try:
        top.chmod(0o755)
        root = top / "app"
        root.mkdir()
        (root / "README.md").write_text("# app\n")
        (root / "deploy.sh").write_text("#!/bin/sh\necho old\n")
        (root / "deploy.sh").chmod(0o755)
        (top / "runtime").mkdir(mode=0o700)
        owner = _owner(user)
        for path in [top, *top.rglob("*")]:
            if os.geteuid() == 0:
                os.lchown(path, owner if path != top / "runtime" else user.uid,
                          owner if path != top / "runtime" else user.uid)
        if git:
            for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
                assert _git(root, *args, uid=owner).returncode == 0
            if hooks_path:
                assert _git(root, "config", "core.hooksPath", hooks_path,
                            uid=owner).returncode == 0
        yield root
    finally:
        shutil.rmtree(top)


@pytest.fixture
def project(as_user: UserRunner) -> Iterator[Path]:
    with _make_project(as_user, git=True) as root:
        yield root


def _env(user: UserRunner, runtime: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree),
            "XDG_RUNTIME_DIR": str(runtime), "HOME": "/tmp"}


def _cli(user: UserRunner, runtime: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(nsbox_argv(user.prefix(), *args), capture_output=True,
                          env=_env(user, runtime), cwd="/", timeout=90)


def _start(user: UserRunner, runtime: Path, *args: str) -> str:
    """`nsbox session start ARGS` as the user: the new session's id."""
    start = _cli(user, runtime, "session", "start", *args)
    assert start.returncode == 0, start.stderr
    return start.stdout.decode().strip()


def _session(user: UserRunner, project: Path) -> tuple[Path, str]:
    runtime = project.parent / "runtime"
    sid = _start(user, runtime, "--project", str(project))
    made = _cli(user, runtime, "session", "exec", sid, "--", "python3", "-c", MAKE)
    assert made.returncode == 0, made.stderr
    return runtime, sid


def _canaries() -> list[str]:
    return [name for name in os.listdir("/tmp") if name.startswith(CANARY_NAME)]


def _commit_on_the_host(project: Path, user: UserRunner) -> None:
    """The developer commits in the project, as git runs hooks: none of the sandbox's."""
    before = _canaries()
    (project / "host-edit.txt").write_text("edit\n")
    if os.geteuid() == 0:
        os.chown(project / "host-edit.txt", _owner(user), _owner(user))
    assert _git(project, "add", "host-edit.txt", uid=_owner(user)).returncode == 0
    committed = _git(project, "commit", "-qm", "host", uid=_owner(user))
    assert committed.returncode == 0, committed.stderr
    assert _canaries() == before
    assert not (project / ".git" / "hooks" / "pre-commit").exists()


SHOWN_NAMES = [  # how each hostile name appears in a listing
    "zzz\\x1b[3J\\x1b[2J", "osc\\x1b]0;pwned\\x07.txt", "cr\\rREADME.md", "bidi\\u202etxt.exe",
    "c1\\x9b2J", "nl\\n+++ b/README.md"]


def test_session_diff_on_a_terminal_shows_every_byte_and_obeys_none(as_user: UserRunner,
                                                                     project: Path):
    runtime, sid = _session(as_user, project)
    try:
        code, shown = run_on_terminal(nsbox_argv(as_user.prefix(), "session", "diff", sid),
                                      _env(as_user, runtime))
        assert code == 0, shown
        assert obeyed(shown) == []
        text = lines(shown)
        # Listed first and marked: a file that make runs; then the others by path, each name
        # and mode as it is. The sandbox's 777 lands as 755 (group and other write cleared).
        assert text[0] == "!   added  Makefile mode 644 [runs on the host: make runs its recipes]"
        # A name a terminal would obey is listed, with its diff, and never written.
        for name in SHOWN_NAMES:
            assert f"    added  {name} mode 644 (not applied: {NAME_REASON})" in text, name
        assert "    added  new.sh mode 755 (asked 777)" in text
        assert " modified  deploy.sh mode 755 -> 755 (asked 777)" not in text
        assert " modified  deploy.sh" in text
        # The contents: every line visible, the headers' paths escaped (no forged header).
        assert "+a\\x1b[3J\\x1b[2J\\x1b[Hclean" in text
        assert "+title\\x1b]52;c;ZXZpbA==\\x07" in text
        assert "+line\\r\\x1b[2Koverwritten\\x1b[1A" in text
        assert "+x = 1  # \\u202e\\u2066 hidden \\u2069" in text
        assert "+++ b/nl\\n+++ b/README.md" in text
        assert text.count("+++ b/README.md") == 0
        assert text[-3].startswith("nsbox: 1 change(s) marked '!'")
        assert text[-2].startswith(f"nsbox: to apply exactly these: nsbox session apply {sid} "
                                   "--reviewed ")
        # The same through pipes (click removes colour codes only, and only there).
        piped = _cli(as_user, runtime, "session", "diff", sid)
        assert piped.returncode == 0
        assert obeyed(piped.stdout + piped.stderr) == []
        assert piped.stdout.decode().splitlines() == text[:-3]
        # The JSON form keeps every value exact, in printable ASCII.
        as_json = _cli(as_user, runtime, "session", "diff", "--json", sid)
        assert as_json.stdout.isascii() and obeyed(as_json.stdout) == []
        exact = {c["path"] for c in json.loads(as_json.stdout)["changes"]}
        assert set(HOSTILE) <= exact
    finally:
        _cli(as_user, runtime, "session", "stop", sid)


def test_session_apply_lands_no_hook_and_no_world_writable_file(as_user: UserRunner,
                                                                 project: Path):
    runtime, sid = _session(as_user, project)
    try:
        ran = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                   "ls -la .git/hooks | grep -c pre-commit; touch .git/x 2>&1; "
                   "git status --short | wc -l")
        # Inside, the project's .git is read-only: the hook was never written.
        assert b"Read-only file system" in ran.stdout + ran.stderr
        code, shown = run_on_terminal(nsbox_argv(as_user.prefix(), "session", "apply", sid),
                                      _env(as_user, runtime))
        assert code == 1, shown
        assert obeyed(shown) == []
        applied = [line for line in lines(shown) if line.startswith("  applied  ")]
        assert sorted(applied) == sorted(f"  applied  {name}" for name in [
            "Makefile", "deploy.sh", "new.sh"])
        for name in ["nl\\n+++ b", *SHOWN_NAMES]:
            assert f"nsbox: not applied: {name}: {NAME_REASON}" in lines(shown), name
    finally:
        _cli(as_user, runtime, "session", "stop", sid)
    # Host-side evidence: no name a terminal obeys, no group or other write.
    assert sorted(p.name for p in project.iterdir()) == [
        ".git", "Makefile", "README.md", "deploy.sh", "new.sh"]
    for name in ("deploy.sh", "new.sh"):
        assert stat.S_IMODE((project / name).stat().st_mode) == 0o755, name
    assert not any(stat.S_IMODE(p.lstat().st_mode) & 0o022 for p in project.iterdir()
                   if not p.is_symlink())
    _commit_on_the_host(project, as_user)


@pytest.mark.parametrize("layout", ["no-git", "hooks-path"])
def test_a_git_directory_made_by_the_sandbox_is_never_applied(as_user: UserRunner,
                                                               layout: str):
    """Where the project has no .git, the sandbox can make one (and a hook in it), and where
    core.hooksPath names a directory of the project, it can write there: apply refuses both
    (rule git-dir), lists them first and marked; the host's next git commit runs none."""
    with _make_project(as_user, git=layout != "no-git",
                       hooks_path=".husky" if layout == "hooks-path" else None) as project:
        runtime = project.parent / "runtime"
        sid = _start(as_user, runtime, "--project", str(project))
        hook = f"#!/bin/sh\ntouch /tmp/{CANARY_NAME}-$$\n"
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                        f"mkdir -p .husky sub; printf '{hook}' > .husky/pre-commit; "
                        "echo 'gitdir: ../.husky' > sub/.git; "
                        "printf 'zzz\\033[3J\\033[2J' > \"$(printf 'zzz\\033[3J\\033[2J')\"; "
                        f"mkdir -p .git/hooks; printf '{hook}' > .git/hooks/pre-commit; "
                        "printf '[core]\\n\\tfsmonitor = touch /tmp/x\\n' > .git/config.new; "
                        "chmod 755 .git/hooks/pre-commit .husky/pre-commit; true")
            assert made.returncode == 0, made.stderr
            code, shown = run_on_terminal(nsbox_argv(as_user.prefix(), "session", "diff",
                                                     "--stat", sid), _env(as_user, runtime))
            assert obeyed(shown) == []
            text = lines(shown)
            marked = [line for line in text if line.startswith("!")]
            assert marked and text[:len(marked)] == marked  # listed first
            assert all("(rule git-dir)" in line or "[runs on the host:" in line
                       for line in marked)
            applied = _cli(as_user, runtime, "session", "apply", sid)
            assert applied.returncode == 1
            refused = applied.stderr.decode()
            if layout == "no-git":
                assert "nsbox: not applied: .git/hooks/pre-commit: under .git: git runs its " \
                       "hooks and obeys its config on the host; never applied (rule git-dir)" \
                       in refused
                assert "nsbox: not applied: sub/.git:" in refused
            else:
                assert "nsbox: not applied: .husky/pre-commit: in the git hooks directory " \
                       "(core.hooksPath)" in refused
            assert f"nsbox: not applied: zzz\\x1b[3J\\x1b[2J: {NAME_REASON}" in refused
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        assert not (project / "sub" / ".git").exists()
        if layout == "hooks-path":
            assert not (project / ".husky" / "pre-commit").exists()
        if layout == "no-git":
            assert not (project / ".git").exists()
            assert _git(project, "init", "-q", uid=_owner(as_user)).returncode == 0
        _commit_on_the_host(project, as_user)


BARE_REASON = ("in a directory git takes for a repository (it holds HEAD and refs or objects): "
               "git runs its hooks and obeys its config on the host; never applied "
               "(rule git-dir)")


def _fsmonitor_repo(where: str) -> str:
    """A shell line that makes ``where`` a repository to git (HEAD, refs, objects) whose
    config runs a command on every `git status`: a bare repository by any name."""
    config = ("[core]\\n\\trepositoryformatversion = 0\\n\\tbare = false\\n"
              f"\\tworktree = .\\n\\tfsmonitor = touch /tmp/{CANARY_NAME}-fsmonitor\\n")
    return (f"mkdir -p {where}/refs/heads {where}/objects; "
            f"touch {where}/refs/heads/.keep {where}/objects/.keep; "
            f"echo 'ref: refs/heads/main' > {where}/HEAD; printf '{config}' > {where}/config")


@pytest.mark.parametrize("layout", ["made", "the-project's"])
def test_a_repository_of_any_name_takes_no_change(as_user: UserRunner, layout: str):
    """git takes a directory of any name that holds HEAD, refs and objects for a repository,
    and `git status` there runs its core.fsmonitor: apply writes no change into one, whether
    the sandbox made it or the project holds one (a bare repository of its tests)."""
    with _make_project(as_user, git=True) as project:
        if layout == "the-project's":
            assert _git(project, "init", "-q", "--bare", "fixtures/repo.git",
                        uid=_owner(as_user)).returncode == 0
        runtime = project.parent / "runtime"
        sid = _start(as_user, runtime, "--project", str(project))
        where = "vendor/lib" if layout == "made" else "fixtures/repo.git"
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                        f"{_fsmonitor_repo(where)}; echo ok > notes.txt")
            assert made.returncode == 0, made.stderr
            applied = _cli(as_user, runtime, "session", "apply", sid)
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        assert applied.returncode == 1, applied.stdout
        assert f"nsbox: not applied: {where}/config: {BARE_REASON}" in applied.stderr.decode()
        assert sorted(applied.stdout.decode().splitlines()) == [
            "  applied  notes.txt", *(["  applied  vendor"] if layout == "made" else [])]
        # Host-side evidence: no config of the sandbox's, and git runs nothing of it.
        assert (project / "notes.txt").read_text() == "ok\n"
        if layout == "made":
            assert os.listdir(project / "vendor") == []
        else:
            assert "fsmonitor" not in (project / where / "config").read_text()
            before = _canaries()
            _git(project / where, "status", uid=_owner(as_user))
            assert _canaries() == before
        _commit_on_the_host(project, as_user)


def test_collect_writes_no_git_directory_and_no_repository(as_user: UserRunner):
    """`session collect` into a checkout (or anywhere): what apply never writes is not
    written there either; the checkout's own .git keeps its config and gets no hook."""
    with _make_project(as_user, git=True) as dest:
        runtime = dest.parent / "runtime"
        with open(dest / ".git" / "config", "a") as f:  # the checkout's config includes one
            f.write("[include]\n\tpath = ../.gitconfig\n")
        config = (dest / ".git" / "config").read_bytes()
        sid = _start(as_user, runtime)
        hook = f"#!/bin/sh\\ntouch /tmp/{CANARY_NAME}-$$\\n"
        monitor = f"[core]\\n\\tfsmonitor = touch /tmp/{CANARY_NAME}-included\\n"
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                        f"{_fsmonitor_repo('.git')}; {_fsmonitor_repo('out/bare')}; "
                        f"mkdir -p .git/hooks; printf '{hook}' > .git/hooks/pre-commit; "
                        f"printf '{monitor}' > .gitconfig; "
                        "chmod 755 .git/hooks/pre-commit; echo 42 > out/result.txt")
            assert made.returncode == 0, made.stderr
            collected = _cli(as_user, runtime, "session", "collect", sid, "--dest", str(dest))
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        assert collected.returncode == 0, collected.stderr
        said = collected.stderr.decode()
        for rel in (".git/config", ".git/HEAD", ".git/hooks/pre-commit"):
            assert f'nsbox: not collected: "{rel}": under .git' in said, rel
        assert f'nsbox: not collected: "out/bare/config": {BARE_REASON}' in said
        assert f'nsbox: not collected: ".gitconfig": {CONFIG_REASON}' in said
        assert not (dest / ".gitconfig").exists()
        # Host-side evidence: the result landed, nothing of git's did; git runs no hook.
        assert (dest / "out" / "result.txt").read_text() == "42\n"
        assert (dest / ".git" / "config").read_bytes() == config
        assert not (dest / ".git" / "hooks" / "pre-commit").exists()
        assert not (dest / "out" / "bare").exists()
        _commit_on_the_host(dest, as_user)


def test_collect_and_cp_write_a_new_file_never_into_an_existing_one(as_user: UserRunner):
    """A file the sandbox sends lands as a new file renamed over the name: an existing file
    there is never written into, so a hard link to a file elsewhere keeps that file as it was,
    a setuid file does not become a setuid copy of the sandbox's program (root writing keeps
    the bit: CAP_FSETID), and a world-writable one does not stay open to every user."""
    with _make_project(as_user, git=False) as dest:
        runtime = dest.parent / "runtime"
        outside = dest.parent / "outside.txt"
        outside.write_text("host\n")
        os.link(outside, dest / "notes.txt")
        for name, mode in (("tool", 0o4755), ("tool2", 0o4755), ("ww.txt", 0o666)):
            (dest / name).write_text("host\n")
            (dest / name).chmod(mode)
        if os.geteuid() == 0:
            for path in (outside, dest / "tool", dest / "tool2", dest / "ww.txt"):
                os.chown(path, _owner(as_user), _owner(as_user))
                os.chmod(path, stat.S_IMODE(path.lstat().st_mode))  # chown cleared set-id
            (dest / "tool").chmod(0o4755)
            (dest / "tool2").chmod(0o4755)
        sid = _start(as_user, runtime)
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                        "echo sandbox > notes.txt; cp /usr/bin/id tool; echo sandbox > ww.txt")
            assert made.returncode == 0, made.stderr
            collected = _cli(as_user, runtime, "session", "collect", sid, "--dest", str(dest))
            assert collected.returncode == 0, collected.stderr
            copied = _cli(as_user, runtime, "session", "cp", f"{sid}:tool", str(dest / "tool2"))
            assert copied.returncode == 0, copied.stderr
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        # Host-side evidence: the file elsewhere is untouched; no set-id bit, no world write.
        assert outside.read_text() == "host\n"
        assert (dest / "notes.txt").read_text() == "sandbox\n"
        assert (dest / "notes.txt").stat().st_nlink == 1
        for name in ("tool", "tool2"):
            assert (dest / name).read_bytes() == Path("/usr/bin/id").read_bytes()
            assert stat.S_IMODE((dest / name).stat().st_mode) & 0o7000 == 0, name
        assert stat.S_IMODE((dest / "ww.txt").stat().st_mode) & 0o022 == 0


def test_run_project_and_listings_show_names_escaped(as_user: UserRunner, project: Path):
    """`nsbox run --project` (its "added NAME" lines), `session ls`, `session collect` and a
    file transfer error quoting a sandbox-made name: all escaped, on a terminal."""
    runtime = project.parent / "runtime"
    env = _env(as_user, runtime)
    code, shown = run_on_terminal(nsbox_argv(
        as_user.prefix(), "run", "--project", str(project), "--", "python3", "-c", MAKE), env)
    assert code == 0, shown
    assert obeyed(shown) == []
    text = lines(shown)
    for name in SHOWN_NAMES:
        assert f"nsbox:   added {name}" in text, name
    assert "nsbox:   added Makefile (runs on the host)" in text
    sid = _start(as_user, runtime)
    try:
        made = _cli(as_user, runtime, "session", "exec", sid, "--", "python3", "-c",
                    MAKE.replace("/workspace/.git/hooks", "/tmp/h").replace(
                        "/workspace/.git", "/tmp/g")
                    + "\nos.symlink('/etc/passwd', '/workspace/zz\\x1b[2Jlink')"
                    + "\nos.mkfifo('/workspace/fifo\\x1b]0;x\\x07')")
        assert made.returncode == 0, made.stderr
        for args in (["session", "ls", sid], ["session", "collect", sid, "--dest",
                                                str(runtime / "out")],
                     ["session", "cp", f"{sid}:fifo\x1b]0;x\x07", str(runtime / "f")]):
            code, shown = run_on_terminal(nsbox_argv(as_user.prefix(), *args), env)
            assert obeyed(shown) == [], (args, shown)
            text = lines(shown)
            if args[1] == "cp":
                assert code == 125
                assert any(line.startswith("nsbox: fifo\\x1b]0;x\\x07: ") for line in text), text
                continue
            assert code == 0, shown
            names = [m.group(1) for line in text
                     if (m := re.match(r"\s*\d+  [0-9a-f]{64}  \"(.*)\"$", line))]
            if args[1] == "collect":
                # Listed as not collected, escaped: such a name is not written on the host.
                for name in SHOWN_NAMES:
                    assert f'nsbox: not collected: "{name}": {NAME_REASON}' in text, name
                assert not set(SHOWN_NAMES) & set(names), names
                assert sorted(os.listdir(runtime / "out")) == ["Makefile", "deploy.sh", "new.sh"]
            else:
                assert set(SHOWN_NAMES) <= set(names), names
            assert any("zz\\x1b[2Jlink" in line for line in text)
    finally:
        _cli(as_user, runtime, "session", "stop", sid)


def test_the_caller_own_program_output_passes_as_it_is(as_user: UserRunner):
    """What the program itself prints with `nsbox run` is its talk to its user: untouched."""
    code, shown = run_on_terminal(nsbox_argv(as_user.prefix(), "run", "--", "printf",
                                             "\\033[1mbold\\033[0m\\n"),
                                  {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(as_user.tree)})
    assert code == 0
    assert b"\x1b[1mbold\x1b[0m\r\n" in shown


def test_python_api_keeps_the_exact_names(as_user: UserRunner, project: Path):
    """The library gives data as it is (Change.path, FileTransferError.path); only the
    messages meant for a person are escaped."""
    out = as_user.script(f"""
s = nsbox.Session(project={str(project)!r})
s.run(["python3", "-c", {MAKE!r}])
changes = {{c.path: c.to_dict() for c in s.changes()}}
try:
    s.read_file("/workspace/nl\\n+++ b/README.md/x")
    error = None
except nsbox.errors.FileTransferError as e:
    error = [e.path, str(e)]
s.close()
emit(paths=sorted(changes), diff=changes["zzz\\x1b[3J\\x1b[2J"]["diff"], error=error)
""")
    assert set(HOSTILE) <= set(out["paths"])
    assert out["diff"] == ("--- /dev/null\n+++ b/zzz\\x1b[3J\\x1b[2J\n@@ -0,0 +1 @@\n"
                           "+a\x1b[3J\x1b[2J\x1b[Hclean\n")
    assert out["error"] is not None and "\x1b" not in out["error"][1] and "\n" not in \
        out["error"][1]


def test_the_mcp_review_pane_shows_names_and_diffs_escaped(as_user: UserRunner, project: Path):
    """`changes` on the agent's connection and on the user's review server (render_changes),
    and the review's apply: the text a person's MCP client shows holds no byte a terminal
    or a text widget would obey; the structured data keeps the names exact."""
    runtime = project.parent / "runtime"
    out = as_user.script(f"""
from nsbox.mcp.tools import ServerConfig, Workbench
from nsbox.mcp.review import Reviewer, publish_for_review
s = nsbox.Session(project={str(project)!r})
publish_for_review(s)
bench = Workbench(s, ServerConfig(project={str(project)!r}))
ran = bench.run_python({MAKE!r}, 30)
seen = bench.changes()
review = Reviewer(s.id)
listed = review.changes()
applied = review.apply(["Makefile", "zzz\\x1b[3J\\x1b[2J"])
emit(texts=[ran.text, seen.text, listed.text, applied.text],
     paths=[c["path"] for c in listed.data["changes"]])
s.close()
""", env={"XDG_RUNTIME_DIR": str(runtime)})
    for text in out["texts"]:
        assert obeyed(text.encode("utf-8", "surrogateescape")) == [], text
    review = out["texts"][2].splitlines()
    assert review[0] == ("! added: Makefile (mode new -> 644) [runs on the host: make runs its "
                         "recipes]")
    assert (f"added: zzz\\x1b[3J\\x1b[2J (mode new -> 644) (not applicable: {NAME_REASON})"
            in review)
    assert "+a\\x1b[3J\\x1b[2J\\x1b[Hclean" in review
    assert out["texts"][3] == ("applied: Makefile\n"
                               f"not applied: zzz\\x1b[3J\\x1b[2J: {NAME_REASON}")
    assert set(HOSTILE) <= set(out["paths"])


def test_the_hooks_directory_is_found_where_git_would_look(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    from nsbox.host import autorun

    root = tmp_path / "app"
    (root / ".git").mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert autorun.hooks_dirs(str(root)) == ()
    # A user's global hooksPath, relative: each work tree's own directory.
    (home / ".gitconfig").write_text("[core]\n\thooksPath = .githooks\n")
    assert autorun.hooks_dirs(str(root)) == (".githooks",)
    assert autorun.never_applied(".GitHooks/pre-push", (".githooks",)) == autorun.HOOKS_REASON
    # The project's own setting comes first; one outside the project is no part of it.
    (root / ".git" / "config").write_text('[Core]\n\tHooksPath = "tools/hooks"\n')
    assert autorun.hooks_dirs(str(root)) == ("tools/hooks",)
    (root / ".git" / "config").write_text(f"[core]\n\thooksPath = {tmp_path}/elsewhere\n")
    assert autorun.hooks_dirs(str(root)) == ()
    # A repository below the project's top has a hooks directory of its own.
    (root / "sub" / ".git").mkdir(parents=True)
    (root / "sub" / ".git" / "config").write_text("[core]\n\thooksPath = h\n")
    assert autorun.hooks_dirs(str(root), ["sub", "sub/.git"]) == ("sub/h",)
    for rel in (".git/hooks/x", "sub/.GIT/config", "a/b/.git"):
        assert autorun.never_applied(rel) == autorun.GIT_REASON, rel
    assert autorun.never_applied(".gitignore") is None


def test_the_hooks_directory_of_a_linked_work_tree_and_of_an_include(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A linked work tree (``.git`` a file) reads the common directory's config, and a config
    may set core.hooksPath in a file it includes: git finds the hooks there, so does apply."""
    from nsbox.host import autorun

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    main = tmp_path / "main" / ".git"
    (main / "worktrees" / "wt").mkdir(parents=True)
    (main / "worktrees" / "wt" / "commondir").write_text("../..\n")
    (main / "config").write_text("[core]\n\thooksPath = tools/hooks\n")
    work_tree = tmp_path / "wt"
    work_tree.mkdir()
    (work_tree / ".git").write_text(f"gitdir: {main}/worktrees/wt\n")
    assert autorun.hooks_dirs(str(work_tree)) == ("tools/hooks",)
    # The work tree's own config.worktree is read before the common config.
    (main / "worktrees" / "wt" / "config.worktree").write_text("[core]\n\thooksPath = wt-h\n")
    assert autorun.hooks_dirs(str(work_tree)) == ("wt-h",)
    # An include (and an includeIf, its condition taken as met), relative to the config.
    project = tmp_path / "app"
    (project / ".git").mkdir(parents=True)
    (project / ".git" / "config").write_text(
        '[core]\n\tbare = false\n[includeIf "gitdir:~/elsewhere/"]\n\tpath = extra.inc\n')
    (project / ".git" / "extra.inc").write_text("[include]\n\tpath = ../../deep.inc\n")
    (tmp_path / "deep.inc").write_text("[core]\n\thooksPath = .hooks\n")
    assert autorun.hooks_dirs(str(project)) == (".hooks",)
    (tmp_path / "deep.inc").write_text("[include]\n\tpath = deep.inc\n")  # a loop ends
    assert autorun.hooks_dirs(str(project)) == ()


def test_a_directory_git_takes_for_a_repository_takes_no_change():
    """git takes a directory of any name that holds HEAD and refs (or objects, or a commondir)
    for a bare repository, and obeys its config (core.fsmonitor): nothing lands in one, in
    any case, whether the sandbox made it or the project had it."""
    from nsbox.host import autorun

    made = ["vendor/lib/HEAD", "vendor/lib/config", "vendor/lib/refs/heads/.keep", "README.md"]
    found = autorun.git_dirs(made)
    assert found == frozenset({"vendor/lib"})
    for rel in ("vendor/lib", "vendor/lib/config", "Vendor/LIB/hooks/pre-commit"):
        assert autorun.never_applied(rel, (), found) == autorun.BARE_REASON, rel
    assert autorun.never_applied("vendor/other.py", (), found) is None
    assert autorun.git_dirs(["x/HEAD", "x/objects"]) == frozenset({"x"})
    assert autorun.git_dirs(["x/Head", "x/COMMONDIR"]) == frozenset({"x"})
    assert autorun.git_dirs(["HEAD", "refs"]) == frozenset({""})
    assert autorun.never_applied("anything", (), frozenset({""})) == autorun.BARE_REASON
    # HEAD alone, or refs alone, is no repository.
    assert autorun.git_dirs(["docs/HEAD", "src/refs/x", "HEADS", "a/HEAD/refs"]) == frozenset()


def test_at_or_below_is_the_directory_or_under_it_at_a_slash():
    """The one prefix test of the hooks directory (never_applied), the paths chosen for
    review or apply (review.choose) and the directories the sandbox sees covered
    (Project._hidden): at a component boundary, never a prefix of a name."""
    from nsbox.host import autorun
    from nsbox.host.project import Change, Project
    from nsbox.session import review

    for path in ("src/a", "src/a/b", "src/a/b/c.py", "src/a/.git"):
        assert autorun.at_or_below(path, "src/a"), path
    for path in ("src/ab", "src/a.py", "src/", "src", "src/b/a", "xsrc/a", "src/A", ""):
        assert not autorun.at_or_below(path, "src/a"), path
    assert autorun.at_or_below("", "") and not autorun.at_or_below("a", "")
    # The hooks directory, in any case; a sibling that starts with its name is no part of it.
    assert autorun.never_applied(".husky/pre-commit", (".husky",)) == autorun.HOOKS_REASON
    assert autorun.never_applied(".Husky", (".husky",)) == autorun.HOOKS_REASON
    assert autorun.never_applied(".husky-old/pre-commit", (".husky",)) is None
    assert autorun.never_applied(".huskyx", (".husky",)) is None
    # The paths chosen: "src/a" (and "/src/a/") takes src/a and below, not src/ab.
    found = [Change(path=p, kind="added") for p in ("src/a", "src/a/x", "src/ab", "src/ab/x")]
    for wanted in (["src/a"], ["/src/a/"]):
        assert [c.path for c in review.choose(found, wanted)] == ["src/a", "src/a/x"], wanted
    assert review.choose(found, ["/"]) == found  # "/" is the whole project
    # A directory the sandbox sees covered hides what is at or below it, not its siblings.
    view = SimpleNamespace(view=SimpleNamespace(masks=frozenset({".env"}), covered=("vendor",)))
    for path, hidden in ((".env", True), ("vendor", True), ("vendor/x", True),
                         ("vendors/x", False), (".envrc", False)):
        assert Project._hidden(view, path) is hidden, path  # type: ignore[arg-type]


def test_a_name_a_terminal_obeys_never_lands():
    from nsbox.host import autorun

    for rel in ("zzz\x1b[3J", "a/b\u202etxt.sh", "new\nline", "bad\udcff", "n\u3164ame"):
        assert autorun.never_applied(rel) == autorun.NAME_REASON, repr(rel)
    assert autorun.never_applied("caf\u00e9/\u65e5\u672c.txt") is None
    assert autorun.runs_it("deep/dir/Makefile") == "make runs its recipes"
    assert autorun.runs_it(".github/workflows/ci.yml") == "CI runs these workflows"
    assert autorun.runs_it("src/app.py") is None


ASCII_LINES = re.compile(rb"[ -~\n]*")  # printable ASCII and newlines: nothing to obey


def test_run_collect_json_and_audit_show_nothing_to_obey(as_user: UserRunner, tmp_path: Path):
    """`nsbox run --collect` (its "not collected" lines), `--json` (collected names, the
    output) and the `--audit` record (the output's head, written with DEL too): what a
    person reads on a terminal, with cat or less, holds no byte a terminal obeys."""
    top = Path(tempfile.mkdtemp(prefix="nsbox-doors-", dir="/tmp"))
    top.chmod(0o777)
    try:
        make = (MAKE.replace("/workspace/.git/hooks", "/tmp/h").replace("/workspace/.git",
                                                                          "/tmp/g")
                + "\nos.mkfifo('/workspace/fifo\\x1b]0;x\\x07')"
                + "\nos.symlink('/etc/passwd', '/workspace/ln\\x7f\\x1b[2J')"
                + "\nprint('out\\x7f\\x1b]52;c;?\\x07\\u202e')")
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(as_user.tree), "HOME": "/tmp"}
        code, shown = run_on_terminal(nsbox_argv(
            as_user.prefix(), "run", "--quiet", "--collect", "*", "--collect-dir",
            str(top / "out"), "--audit", str(top / "audit.jsonl"), "--", "python3", "-c",
            make), env)
        assert code == 0, shown
        # The program's own output passes as it is; nsbox's lines are escaped.
        own = b"out\x7f\x1b]52;c;?\x07\xe2\x80\xae\r\n"
        assert own in shown
        # Past the program's output, nsbox settles the terminal it reached (docs/cli.md, "What
        # comes out on your terminal") before its own lines, which hold nothing to obey.
        settle = host_terminal.CLOSE_OPEN + host_terminal.TERMINAL_DEFAULTS
        assert shown.index(own) < shown.index(settle) < shown.index(b"nsbox: not collected")
        rest = shown.replace(own, b"").replace(settle, b"").replace(host_terminal.DA1_QUERY, b"")
        assert obeyed(rest) == [], shown
        text = lines(shown.replace(settle, b"").replace(host_terminal.DA1_QUERY, b""))
        assert 'nsbox: not collected: "fifo\\x1b]0;x\\x07": a FIFO, not a regular file' in text
        assert 'nsbox: not collected: "ln\\x7f\\x1b[2J": a symlink (not followed)' in text
        # Names a terminal would obey are not written on the host (nsbox/session/files.py).
        for name in HOSTILE:
            assert f"nsbox: not collected: {visible.quoted(name)}: {NAME_REASON}" in text, name
        collected = {str(p.relative_to(top / "out")) for p in (top / "out").rglob("*")}
        assert collected == {"Makefile", "deploy.sh", "new.sh"}, collected
        record = (top / "audit.jsonl").read_bytes()
        assert ASCII_LINES.fullmatch(record), record
        kept = json.loads(record)
        assert kept["output"]["stdout"]["head"].endswith("out\x7f\x1b]52;c;?\x07\u202e\n")
        assert set(HOSTILE) <= {f["path"] for f in kept["files_produced"]}
        code, shown = run_on_terminal(nsbox_argv(
            as_user.prefix(), "run", "--quiet", "--json", "--collect", "*", "--collect-dir",
            str(top / "out2"), "--", "python3", "-c", make), env)
        assert code == 0, shown
        out = shown.replace(b"\r\n", b"\n")
        report = out[out.index(b"\n{") + 1:]  # past the notes of what was not collected
        assert ASCII_LINES.fullmatch(report), out
        data = json.loads(report)
        assert {f["path"] for f in data["files"]} == {"Makefile", "deploy.sh", "new.sh"}
        assert data["stdout"].endswith("out\x7f\x1b]52;c;?\x07\u202e\n")
    finally:
        shutil.rmtree(top)


CONFIG_REASON = ("git's config (a file the project's git config includes): git runs the "
                 "commands it names (core.fsmonitor, core.hooksPath...) on the host; never "
                 "applied (rule git-dir)")
PYC_REASON = ("a Python bytecode cache: Python runs a cached .pyc in place of its source; "
              "never applied")


def _host_file(project: Path, user: UserRunner, rel: str, text: str) -> None:
    """A file of the project's, made on the host and owned as the project is."""
    path = project / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if os.geteuid() == 0:
        for made in (path, *path.relative_to(project).parents):
            os.chown(project / made, _owner(user), _owner(user))


@pytest.mark.parametrize("layout", ["include", "include-if-made"])
def test_a_config_file_the_git_config_includes_is_never_applied(as_user: UserRunner,
                                                               layout: str):
    """git reads a file that .git/config includes (``include.path = ../.gitconfig``, or an
    ``[includeIf]`` one) as its own config, wherever it lies: a core.fsmonitor the sandbox
    appends there would run on the host's next `git status`, a core.hooksPath there would
    name hooks of the sandbox's making. apply never writes it, whether the project had it or
    the sandbox makes it; the host's git runs nothing of the sandbox's."""
    with _make_project(as_user, git=True) as project:
        owner = _owner(as_user)
        if layout == "include":
            target, key = ".gitconfig", "include.path"
            _host_file(project, as_user, target, "[alias]\n\tst = status\n")
        else:
            target, key = "conf/git.cfg", "includeIf.gitdir:/.path"
        assert _git(project, "config", key, f"../{target}", uid=owner).returncode == 0
        runtime = project.parent / "runtime"
        sid = _start(as_user, runtime, "--project", str(project))
        config = (f'[core]\\n\\tfsmonitor = "touch /tmp/{CANARY_NAME}-fsmonitor-$$; false"\\n'
                  "\\thooksPath = .myhooks\\n")
        hook = f"#!/bin/sh\\ntouch /tmp/{CANARY_NAME}-$$\\n"
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "sh", "-c",
                        f"mkdir -p conf .myhooks; printf '{config}' >> {target}; "
                        f"printf '{hook}' > .myhooks/pre-commit; chmod 755 .myhooks/pre-commit; "
                        "echo ok > notes.txt")
            assert made.returncode == 0, made.stderr
            diff = _cli(as_user, runtime, "session", "diff", "--stat", sid)
            assert diff.returncode == 0, diff.stderr
            assert diff.stdout.decode().splitlines()[0].startswith("!")  # listed first, marked
            applied = _cli(as_user, runtime, "session", "apply", sid)
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        assert applied.returncode == 1, applied.stdout
        assert f"nsbox: not applied: {target}: {CONFIG_REASON}" in applied.stderr.decode()
        assert "  applied  notes.txt" in applied.stdout.decode().splitlines()
        # Host-side evidence: the host's config as it was; git status and commit run nothing.
        if layout == "include":
            assert (project / target).read_text() == "[alias]\n\tst = status\n"
        else:
            assert not (project / target).exists()
        before = _canaries()
        assert _git(project, "status", "--short", uid=owner).returncode == 0
        assert _canaries() == before
        _commit_on_the_host(project, as_user)


PYC = """
import importlib.util, marshal, os, struct
st = os.stat("/workspace/src/app.py")
code = compile('print("forged")', "/workspace/src/app.py", "exec")
data = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF,
                                                 st.st_size & 0xFFFFFFFF) + marshal.dumps(code)
cached = importlib.util.cache_from_source("/workspace/src/app.py")
os.makedirs(os.path.dirname(cached), exist_ok=True)
open(cached, "wb").write(data)
open("/workspace/src/legacy.pyc", "wb").write(data)
print(os.path.relpath(cached, "/workspace"))
"""


def test_a_python_bytecode_cache_is_never_applied(as_user: UserRunner):
    """A ``__pycache__/*.pyc`` whose header holds the host source's mtime and size (the
    sandbox reads both) runs in place of the reviewed, unchanged source: apply writes no
    bytecode cache, and the host's Python runs its own source."""
    with _make_project(as_user, git=False) as project:
        _host_file(project, as_user, "src/app.py", 'print("reviewed")\n')
        runtime = project.parent / "runtime"
        sid = _start(as_user, runtime, "--project", str(project))
        try:
            made = _cli(as_user, runtime, "session", "exec", sid, "--", "python3", "-c", PYC)
            assert made.returncode == 0, made.stderr
            cached = made.stdout.decode().strip()
            assert cached.startswith("src/__pycache__/app.") and cached.endswith(".pyc")
            applied = _cli(as_user, runtime, "session", "apply", sid)
        finally:
            _cli(as_user, runtime, "session", "stop", sid)
        # Refused, and no failure: Python makes its cache again from the reviewed source.
        assert applied.returncode == 0, applied.stderr
        refused = applied.stderr.decode()
        for rel in ("src/__pycache__", cached, "src/legacy.pyc"):
            assert f"nsbox: not applied: {rel}: {PYC_REASON}" in refused, rel
        # Host-side evidence: no cache landed; the host's Python runs the reviewed source.
        assert sorted(os.listdir(project / "src")) == ["app.py"]
        ran = subprocess.run(["python3", "-B", "-c", "import app"], cwd=project / "src",
                             capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert ran.stdout == b"reviewed\n", ran.stderr


def test_the_files_git_reads_as_config_are_found_where_git_would_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each file an [include] or [includeIf] names (relative to the config that names it, at
    any depth, whether it exists yet or not, as written and through a symlink), from the
    project's .git/config, a linked work tree's config.worktree and common config, a
    repository's below the top: those inside the project are never applied."""
    from nsbox.host import autorun

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    root = tmp_path / "app"
    (root / ".git").mkdir(parents=True)
    assert autorun.git_configs(str(root)) == (".git/config", ".git/config.worktree")
    (root / ".git" / "config").write_text(
        "[core]\n\tbare = false\n[include]\n\tpath = ../.gitconfig ; a comment\n"
        '[includeIf "gitdir:~/elsewhere/"] path = "../conf/not-yet.cfg"\n'
        f"[include]\n\tpath = {tmp_path}/outside.cfg\n")
    (root / ".gitconfig").write_text("[include]\n\tpath = nested/more.cfg\n")
    (tmp_path / "outside.cfg").write_text("[include]\n\tpath = app/via-outside.cfg\n")
    found = autorun.git_configs(str(root))
    assert found == (".git/config", ".git/config.worktree", ".gitconfig", "conf/not-yet.cfg",
                     "nested/more.cfg", "via-outside.cfg"), found
    for rel in (".gitconfig", ".GitConfig", "conf/not-yet.cfg", "nested/more.cfg"):
        assert autorun.never_applied(rel, (), frozenset(), found) == autorun.CONFIG_REASON, rel
    assert autorun.never_applied("conf/other.cfg", (), frozenset(), found) is None
    assert autorun.never_applied(".gitconfig.bak", (), frozenset(), found) is None
    # Through a symlink of the project's: the file git reads is where it points.
    (root / "real").mkdir()
    (root / "link").symlink_to("real")
    (root / ".gitconfig").write_text("[include]\n\tpath = link/git.cfg\n")
    assert "real/git.cfg" in autorun.git_configs(str(root))
    # A linked work tree: its config.worktree and the common config, each with an include.
    main = tmp_path / "main" / ".git"
    (main / "worktrees" / "wt").mkdir(parents=True)
    (main / "worktrees" / "wt" / "commondir").write_text("../..\n")
    (main / "config").write_text("[include]\n\tpath = ../../wt/common.cfg\n")
    (main / "worktrees" / "wt" / "config.worktree").write_text(
        "[include]\n\tpath = ../../../../wt/own.cfg\n")
    work_tree = tmp_path / "wt"
    work_tree.mkdir()
    (work_tree / ".git").write_text(f"gitdir: {main}/worktrees/wt\n")
    assert autorun.git_configs(str(work_tree)) == ("common.cfg", "own.cfg")
    # A repository below the top reads its own.
    (root / "sub" / ".git").mkdir(parents=True)
    (root / "sub" / ".git" / "config").write_text("[include]\n\tpath = ../local.cfg\n")
    assert "sub/local.cfg" in autorun.git_configs(str(root), ["sub", "sub/.git"])
    # A key after its header on one line, in any case, sets core.hooksPath too.
    (root / ".gitconfig").write_text("[Core] HooksPath = .hooks # a comment\n")
    assert autorun.hooks_dirs(str(root)) == (".hooks",)


def test_python_bytecode_is_never_applied_and_native_modules_are_marked():
    from nsbox.host import autorun

    for rel in ("src/__pycache__/app.cpython-311.pyc", "__pycache__", "a/__PYCACHE__/x",
                "lib/mod.pyc", "lib/MOD.PYO", "src/__pycache__/notes.txt"):
        assert autorun.never_applied(rel) == autorun.PYC_REASON, rel
    for rel in ("src/app.py", "pyc/readme.md", "src/pycache.py"):
        assert autorun.never_applied(rel) is None, rel
    assert autorun.runs_it("src/fast.cpython-311-x86_64-linux-gnu.so") == (
        "Python imports it in place of a module's .py; the dynamic loader loads it")
    assert autorun.runs_it("build/Release/addon.node") == "node loads it as a native module"


def test_files_tools_run_by_themselves_are_marked():
    """What npm, linters, debuggers, nix, Gradle, Maven and the JS tools run or obey by
    themselves is marked, in any case, at any depth; an ordinary source file is not."""
    from nsbox.host import autorun

    expected = {
        ".npmrc": "npm obeys it (node-options, script-shell: programs it runs)",
        "web/.NPMRC": "npm obeys it (node-options, script-shell: programs it runs)",
        ".pylintrc": "pylint runs its init-hook", "pylintrc": "pylint runs its init-hook",
        "mypy.ini": "mypy imports the plugins it names",
        ".flake8": "flake8 imports the local plugins it names",
        ".Rprofile": "R runs it at start", "bunfig.toml": "bun obeys it (preload runs scripts)",
        ".pdbrc": "pdb runs its commands", ".irbrc": "irb runs it at start",
        ".pryrc": "pry runs it at start",
        ".envrc.local": "direnv runs it (source_env from .envrc)",
        "shell.nix": "nix-shell and direnv (use nix) run it",
        "flake.nix": "nix develop and direnv (use flake) run it",
        ".yarn/releases/yarn-4.1.0.cjs": "yarn runs the release its yarnPath names",
        ".yarnrc.yml": "yarn obeys it",
        "build.gradle": "gradle runs it", "app/build.gradle.kts": "gradle runs it",
        "settings.gradle.kts": "gradle runs it",
        "gradle/wrapper/gradle-wrapper.properties": "gradlew runs the Gradle it names",
        "gradlew": "the Gradle wrapper: IDEs and CI run it",
        "pom.xml": "maven runs the plugins it names",
        ".mvn/wrapper/maven-wrapper.properties": "maven obeys it (its wrapper, options and "
                                                 "extensions)",
        "conftest.py": "pytest imports it", "tests/conftest.py": "pytest imports it",
        "node_modules/left-pad/index.js": "node loads what it holds; npm runs its scripts and "
                                          ".bin programs",
        "rust-toolchain.toml": "rustup runs the toolchain it names",
    }
    for rel, why in expected.items():
        assert autorun.runs_it(rel) == why, rel
    for rel in ("eslint.config.mjs", ".eslintrc.js", "prettier.config.cjs", "vite.config.ts",
                "web/jest.config.js", "webpack.config.js", ".prettierrc.mjs"):
        assert autorun.runs_it(rel) == ("the JS tool it configures runs it as code (eslint, "
                                        "prettier, vite, jest, webpack...)"), rel
    for rel in ("src/app.py", "README.md", "config.json", ".eslintrc.json", "src/gradle.py",
                "docs/pom.xml.md"):
        assert autorun.runs_it(rel) is None, rel


def test_the_docs_table_lists_every_marked_file():
    """docs/sessions.md's table of marked files names every AUTORUN pattern (a directory's
    with its "/"), and nothing else: the table and the rule book stay one."""
    from nsbox.host import autorun

    text = (Path(__file__).resolve().parent.parent / "docs" / "sessions.md").read_text()
    head = "| file (at any depth, any case) | what runs it |\n|---|---|\n"
    table = text[text.index(head) + len(head):].split("\n\n")[0]
    listed = {name.rstrip("/") for row in table.splitlines()
              for name in re.findall(r"`([^`]+)`", re.sub(r"\(.*?\)", "", row.split(" | ")[0]))}
    assert listed == {pattern for pattern, _why in autorun.AUTORUN}
