"""A project's secrets stay out of the sandbox: matched at any depth and in any case, a
credential in any git config, and a masked file that git knows is not readable through
``.git`` either (nsbox/host/projectmasks.py, nsbox/host/gitstore.py).

A hostile command looks for a canary everywhere it can: the files, the object store (loose
objects inflated, packs through git itself), ``git show HEAD:.env``. As the caller, the
unprivileged uid and root of a user namespace; the host checks what it was told (masks, the
record's note) and that the project is unchanged."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import UNPRIVILEGED_UID, require
from sessiontools import UserRunner, user_runner

CANARY = "nsbox-secret-5d1e0c"
DEVELOPER_UID = 1000
SECRETS = [  # each holds the canary; none may be read inside
    ".ENV", "sub/dir/.aws/credentials", "deep/er/.kube/config", "x/.docker/config.json",
    "a/.netrc", "b/.npmrc", "c/.pypirc", "d/server.KEY", "e/.env.local",
    ".config/gcloud/application_default_credentials.json", ".azure/accessTokens.json",
]
LOOK = f"""
import os, subprocess, zlib
found = []
for top, dirs, files in os.walk("/workspace"):
    for name in files:
        path = os.path.join(top, name)
        try:
            data = open(path, "rb").read()
        except OSError:
            continue
        if b"/objects/" in path.encode() and "pack" not in path:
            try:
                data = zlib.decompress(data)
            except zlib.error:
                pass
        if {CANARY!r}.encode() in data:
            found.append(path)
git = subprocess.run("git -C /workspace cat-file --batch-all-objects --batch 2>&1; "
                     "git -C /workspace show HEAD:.ENV 2>&1; git -C /workspace log --oneline",
                     shell=True, capture_output=True)
print(repr(found), {CANARY!r}.encode() in git.stdout, git.stdout.decode("utf-8", "replace")[-300:])
"""


@pytest.fixture(params=["caller", "unprivileged", "nested"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def _owner(user: UserRunner) -> int:
    if user.mode == "caller" and os.geteuid() == 0:
        return DEVELOPER_UID
    return UNPRIVILEGED_UID if user.mode == "nested" else user.uid


def _git(root: Path, *args: str) -> None:
    require(shutil.which("git") is not None, "git is not installed (the project is a repository)")
    subprocess.run(["git", "-C", str(root), "-c", "user.name=dev", "-c",
                    "user.email=dev@example.com", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _project(user: UserRunner, track: bool) -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="nsbox-secrets-", dir="/tmp"))
    try:  # removed also when an assertion fails inside the with block
        top.chmod(0o755)
        root = top / "app"
        root.mkdir()
        (root / "README.md").write_text("# app\n")
        for rel in SECRETS:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(f"token={CANARY}\n")
        if not track:
            (root / ".gitignore").write_text("\n".join(SECRETS) + "\n")
        _git(root, "init", "-q")
        _git(root, "add", "-A")
        _git(root, "commit", "-qm", "start")
        _git(root, "gc", "-q")  # the objects in a pack, as a real repository's are
        # A token as the user name of a URL, in the project's config and a submodule's.
        _git(root, "remote", "add", "origin", f"https://ghp_{CANARY}@github.com/org/app.git")
        module = root / ".git" / "modules" / "lib"
        module.mkdir(parents=True)
        (module / "HEAD").write_text("ref: refs/heads/main\n")
        (module / "config").write_text(f'[remote "origin"]\n\turl = https://{CANARY}@x.org/l\n')
        if os.geteuid() == 0:
            for path in [top, *top.rglob("*")]:
                os.lchown(path, _owner(user), _owner(user))
        yield root
    finally:
        shutil.rmtree(top)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("track", [False, True], ids=["ignored", "tracked"])
def test_secrets_are_masked_at_any_depth_and_never_readable_through_git(
        as_user: UserRunner, track: bool) -> None:
    with _project(as_user, track) as root:
        before = _snapshot(root)
        audit = root.parent / "audit.jsonl"
        out = as_user.script(f"""
s = nsbox.Session(project={str(root)!r}, audit={str(audit)!r})
r = s.run(["python3", "-c", {LOOK!r}])
emit(masked=s.masked, notes=s.project_notes, out=r.stdout.decode(), err=r.stderr.decode())
s.close()
""")
        assert _snapshot(root) == before
        # Nothing inside holds the canary: no file, no object, no answer of git.
        assert out["out"].startswith("[] False "), out
        masked = set(out["masked"])
        for rel in [*SECRETS, ".git/config", ".git/modules/lib/config"]:
            assert rel in masked or any(m.endswith("/") and rel.startswith(m) for m in masked), rel
        record = json.loads(audit.read_text().splitlines()[-1])["project"]
        if track:
            # git knows the masked files: the whole .git is withheld, and the record says so.
            assert ".git/" in masked
            assert out["notes"] == record["notes"] == [
                ".git withheld: git knows the masked .ENV (its path or its content), which the "
                "object store would show"]
            assert "not a git repository" in out["out"]
        else:
            # An ignored secret leaves git to the sandbox, read-only.
            assert ".git/" not in masked and out["notes"] == record["notes"] == []
            assert record["read_only"] == [".git"]
            assert "start" in out["out"]  # git log works


def test_git_inside_cannot_write_the_project_git(as_user: UserRunner) -> None:
    with _project(as_user, track=False) as root:
        before = _snapshot(root)
        out = as_user.script(f"""
s = nsbox.Session(project={str(root)!r})
r = s.run(["sh", "-c", "cd /workspace && echo x >> README.md && git add README.md; "
           "git -c user.name=a -c user.email=a@b commit -qam agent; echo $?; "
           "mkdir .git/hooks/x; rm -rf .git; ls -d .git"])
emit(out=r.stdout.decode(), err=r.stderr.decode(), changes=[c.path for c in s.changes()])
s.close()
""")
        assert "Read-only file system" in out["err"], out
        assert out["out"].splitlines()[-1] == ".git"
        assert out["changes"] == ["README.md"]
        assert _snapshot(root) == before


def test_the_rule_book_matches_secrets_at_any_depth_and_in_any_case(tmp_path: Path) -> None:
    import nsbox
    from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, Policy

    for rel in ("srv/.AWS/credentials", "data/deep/.kube", "keys/tls.Key", "x/.env.prod"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        with pytest.raises(nsbox.PolicyError) as info:
            Policy(mounts=DEFAULT_MOUNTS + (Bind(str(path), "/s"),))
        assert info.value.rule == "secret-dir", rel
        # And by what the path is, when a harmless name leads there.
        link = tmp_path / f"innocent-{len(rel)}"
        link.symlink_to(path)
        with pytest.raises(nsbox.PolicyError) as info:
            nsbox.run(["true"], Policy(mounts=DEFAULT_MOUNTS + (Bind(str(link), "/s"),)))
        assert info.value.rule == "secret-dir", rel
    assert Policy().project_secrets == nsbox.policy.rules.SECRETS  # one list for both


# --- what git holds of a file, read without git (nsbox/host/gitstore.py) ---------------------


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
def test_gitstore_finds_a_path_in_any_index_and_content_in_any_object(
        tmp_path: Path, object_format: str) -> None:
    from nsbox.host import gitstore

    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q", f"--object-format={object_format}")
    (root / "deep" / "er").mkdir(parents=True)
    for i in range(30):  # long and similar names: v4's prefix compression has work to do
        (root / "deep" / "er" / f"file-with-a-long-name-{i}.txt").write_text(f"{i}\n")
    (root / "deep" / ".env").write_text("tracked\n")
    (root / "new.txt").write_text("intent\n")
    _git(root, "add", "deep")
    _git(root, "add", "-N", "new.txt")  # an extended flag: a version 3 index
    _git(root, "commit", "-qm", "one")
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_text("tracked\n")
    other.write_text("never committed\n")
    git_dir = str(root / ".git")
    for version in ("3", "4", "2"):
        _git(root, "update-index", "--index-version", version)
        paths = list(gitstore.index_paths((root / ".git" / "index").read_bytes(),
                                          32 if object_format == "sha256" else 20))
        assert b"deep/.env" in paths and b"new.txt" in paths and len(paths) == 32, version
        assert gitstore.holds(git_dir, "deep/.env", str(other))
        assert not gitstore.holds(git_dir, "elsewhere/.env", str(other))
    # Untracked now, its content in a pack: still known.
    _git(root, "gc", "-q")
    _git(root, "rm", "-q", "--cached", "deep/.env")
    assert not list((root / ".git" / "objects").glob("??/*"))
    assert gitstore.holds(git_dir, "deep/.env", str(secret))
    assert not gitstore.holds(git_dir, "deep/.env", str(other))
    # What this module does not read answers "holds it".
    _git(root, "update-index", "--split-index")
    assert gitstore.holds(git_dir, "deep/.env", str(other))
    _git(root, "update-index", "--no-split-index")
    assert not gitstore.holds(git_dir, "deep/.env", str(other))
    (root / ".git" / "objects" / "info" / "alternates").write_text("/elsewhere/objects\n")
    assert gitstore.holds(git_dir, "deep/.env", str(other))
