"""What a sandbox sees of a project: the project as the host recorded it, minus its secrets,
with its git directories read-only.

When a project session starts, the host walks the project (lstat, no symlink followed) and
decides, before the sandbox exists:

- ``masks``: the secrets, covered with an empty read-only file in the sandbox. A secret is a
  name that ``Policy.project_secrets`` matches (by default the rule book's list,
  rules.SECRETS: at any depth, in any case), or a ``config`` under a ``.git`` (its own, a
  submodule's in ``.git/modules/*/``, a worktree's ``config.worktree``) that holds a
  credential: userinfo in a URL (``https://ghp_x@github.com/...``), a password, a token, an
  extra header.
- ``covered``: directories the sandbox sees empty and read-only: a directory that is a
  secret (``.aws/``), and a git directory that knows a masked file (it tracks its path, or
  stores its content: ``git show HEAD:.env`` would read it, nsbox/host/gitstore.py). That
  ``.git`` is withheld whole; the run's record says so (``notes``).
- ``read_only``: every other ``.git`` (directory or file) of the project, at any depth: the
  sandbox may read the history but cannot write a hook or a config that the host's next git
  command would run (nsbox/host/autorun.py refuses them at apply as well).

The sandbox side (nsbox/sandbox/projectfs.py) mounts these in that order: read-only git
directories, covered directories, masked files.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field

from nsbox.errors import SetupError
from nsbox.host import gitstore
from nsbox.policy.rules import secret_matcher

MAX_ENTRIES = 200_000  # project entries recorded at start; more is refused
MAX_GIT_DIRS = 256  # .git entries made read-only (each one mount); more is refused
# A URL with userinfo, an auth header, a password or a token in a git config (git-config(1)).
_GIT_CREDENTIALS = re.compile(rb"://[^/\s@]+@|extraheader|password|token", re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    """What the host had at a path when the session started (lstat)."""

    kind: str  # "file", "dir", "link", "other"
    mode: int
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Entry:
        kind = ("file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                else "link" if stat.S_ISLNK(st.st_mode) else "other")
        return cls(kind, stat.S_IMODE(st.st_mode), st.st_size, st.st_ino, st.st_mtime_ns,
                   st.st_ctime_ns)


@dataclass
class View:
    """The project as recorded, and what the sandbox is not to see or write."""

    entries: dict[str, Entry] = field(default_factory=dict)
    masks: list[str] = field(default_factory=list)
    covered: list[str] = field(default_factory=list)
    read_only: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def masked(self) -> list[str]:
        """What the sandbox cannot read, sorted: files, and directories with a final "/"."""
        return sorted([*self.masks, *(d + "/" for d in self.covered)])


def is_git_name(name: str) -> bool:
    return name.lower() == ".git"


def _in_git_dir(rel: str) -> bool:
    return any(is_git_name(part) for part in rel.split("/")[:-1])


def scan(root: str, patterns: tuple[str, ...]) -> View:
    """Walk the project below ``root`` and decide what the sandbox sees of it."""
    view = View()
    matcher = secret_matcher(tuple(patterns))
    secret_files: list[str] = []  # every masked file, also those in covered directories
    git_dirs: list[str] = []

    def walk(path: str, prefix: str, in_secret: bool) -> None:
        with os.scandir(path) as it:
            found = sorted(it, key=lambda e: e.name)
        for item in found:
            rel = prefix + item.name
            st = item.stat(follow_symlinks=False)
            view.entries[rel] = Entry.of(st)
            if len(view.entries) > MAX_ENTRIES:
                raise SetupError("project", errno.E2BIG, f"{root} has more than {MAX_ENTRIES} "
                                 "entries", hint="use a smaller project directory")
            secret = in_secret or (matcher is not None and matcher.search(rel) is not None)
            is_dir = stat.S_ISDIR(st.st_mode)
            if is_git_name(item.name) and (is_dir or stat.S_ISREG(st.st_mode)):
                if is_dir:
                    git_dirs.append(rel)
                view.read_only.append(rel)
            if is_dir:
                if secret and not in_secret:
                    view.covered.append(rel)
                walk(item.path, rel + "/", secret)
            elif stat.S_ISREG(st.st_mode):
                if secret:
                    secret_files.append(rel)
                    if not in_secret:
                        view.masks.append(rel)
                elif _in_git_dir(rel) and _holds_credentials(item.name, item.path):
                    view.masks.append(rel)

    walk(root, "", False)
    if len(view.read_only) > MAX_GIT_DIRS:
        raise SetupError("project", errno.E2BIG, f"{root} holds more than {MAX_GIT_DIRS} git "
                         "directories", hint="use a smaller project directory")
    _withhold_git_dirs(root, view, git_dirs, secret_files)
    return view


def _holds_credentials(name: str, path: str) -> bool:
    if name.lower() not in ("config", "config.worktree"):
        return False
    try:
        with open(path, "rb") as f:
            return bool(_GIT_CREDENTIALS.search(f.read(1024 * 1024)))
    except OSError:
        return True  # unreadable here: masked rather than guessed at


def _withhold_git_dirs(root: str, view: View, git_dirs: list[str],
                       secret_files: list[str]) -> None:
    """Cover each git directory that knows a masked file of its work tree (or of a
    submodule's, kept below it), instead of making it read-only."""
    for git_dir in git_dirs:
        if any(git_dir == c or git_dir.startswith(c + "/") for c in view.covered):
            continue
        tree = git_dir.rpartition("/")[0]
        below = [f for f in secret_files if not tree or f.startswith(tree + "/")]
        known = next((f for f in below if gitstore.holds(
            os.path.join(root, git_dir), f[len(tree) + 1:] if tree else f,
            os.path.join(root, f))), None)
        if known is None:
            continue
        view.covered.append(git_dir)
        view.notes.append(f"{git_dir} withheld: git knows the masked {known} (its path or "
                          "its content), which the object store would show")
    covered = [c + "/" for c in view.covered]
    view.read_only = [r for r in view.read_only
                      if r not in view.covered and not any(r.startswith(c) for c in covered)]
    view.masks = [m for m in view.masks if not any(m.startswith(c) for c in covered)]
    view.covered.sort()
