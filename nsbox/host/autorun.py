"""Project files the host runs by itself: what never lands on the host, and what review marks.

A change applied to a project lands where the host's own tools act without being asked. git
runs ``.git/hooks/*`` and obeys ``.git/config`` (core.fsmonitor, core.sshCommand, filter and
diff drivers: each one a command), so nothing under a ``.git`` is ever applied: the sandbox
sees the project's git directories read-only (nsbox/host/projectmasks.py), and a ``.git`` it
makes where none was is refused here too (``git init`` keeps the hooks of a ``.git`` it
finds; a ``sub/.git`` file can point git at a directory of the sandbox's making). A component
is compared in any case: a case-insensitive filesystem takes ``.GIT`` for ``.git``. git takes
a directory of any name for a repository when it holds HEAD and refs (a bare one: git looks
for one in each directory it starts from, and safe.bareRepository admits it by default), so
such a directory is refused the same way (``git_dirs``). The directory that core.hooksPath
names inside the project (husky's ``.husky``) holds git hooks as well and is refused the same
way, as git finds it: for a linked work tree (``.git`` a file) in the common directory's
config, and through ``[include]`` files.

A name with a character a terminal obeys or hides (not ``str.isprintable``) never lands
either: every later ``ls``, file manager or script on the host would meet it as made. The same
rule book decides what ``collect`` writes (nsbox/session/files.py).

The other files a host runs by itself are applied when chosen, but the review lists them
first, each marked with what runs it (``AUTORUN``).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Sequence

from nsbox.policy.rules import secret_matcher

# (pattern, what runs it): matched as rules.SECRETS are (any depth, any case; a directory
# stands for what it holds).
AUTORUN: tuple[tuple[str, str], ...] = (
    (".envrc", "direnv runs it when a shell enters the directory"),
    (".vscode", "VS Code runs its tasks and the programs its settings name"),
    ("*.code-workspace", "VS Code runs the tasks and programs it names"),
    (".idea", "JetBrains IDEs run its run configurations and tools"),
    (".devcontainer", "a dev container runs its lifecycle commands"),
    (".github/workflows", "CI runs these workflows"),
    (".github/actions", "CI runs these actions"),
    (".gitlab-ci.yml", "CI runs it"), (".circleci", "CI runs it"), (".travis.yml", "CI runs it"),
    ("Jenkinsfile", "CI runs it"), (".buildkite", "CI runs it"),
    ("azure-pipelines.yml", "CI runs it"), (".drone.yml", "CI runs it"),
    ("package.json", "npm, yarn and pnpm run its scripts (install, test, prepare)"),
    (".yarnrc", "yarn obeys it"), (".yarnrc.yml", "yarn obeys it"),
    (".pnpmfile.cjs", "pnpm runs it"),
    ("Makefile", "make runs its recipes"), ("GNUmakefile", "make runs its recipes"),
    ("*.mk", "make runs its recipes"), ("CMakeLists.txt", "cmake runs it"),
    ("*.cmake", "cmake runs it"), ("meson.build", "meson runs it"),
    ("setup.py", "pip and setuptools run it"), ("pyproject.toml", "pip runs its build backend"),
    ("setup.cfg", "setuptools obeys it"), ("conftest.py", "pytest imports it"),
    ("tox.ini", "tox runs its commands"), ("noxfile.py", "nox runs it"),
    ("sitecustomize.py", "Python runs it at start"), ("usercustomize.py", "Python runs it at "
                                                     "start"),
    ("*.pth", "Python runs its import lines at start"),
    (".pre-commit-config.yaml", "pre-commit runs the hooks it lists on git commit"),
    (".husky", "husky's git hooks"), (".githooks", "git hooks (by core.hooksPath)"),
    ("lefthook.yml", "lefthook runs it on git commands"),
    (".lefthook.yml", "lefthook runs it on git commands"),
    (".gitattributes", "git runs the filter, diff and merge drivers it names"),
    (".gitmodules", "git fetches and checks out what it lists"),
    ("build.rs", "cargo runs it before building"), (".cargo", "cargo obeys its runners"),
    ("Gemfile", "bundler runs it as Ruby"), ("Rakefile", "rake runs it"),
    ("justfile", "just runs its recipes"), ("Taskfile.yml", "task runs it"),
    ("*.desktop", "a desktop runs the program it names"),
)
_AUTORUN = secret_matcher(tuple(pattern for pattern, _why in AUTORUN))
_WHY = [(secret_matcher((pattern,)), why) for pattern, why in AUTORUN]
GIT_REASON = ("under .git: git runs its hooks and obeys its config on the host; never "
              "applied (rule git-dir)")
HOOKS_REASON = ("in the git hooks directory (core.hooksPath): git runs these on the host; "
                "never applied (rule git-dir)")
BARE_REASON = ("in a directory git takes for a repository (it holds HEAD and refs or objects): "
               "git runs its hooks and obeys its config on the host; never applied "
               "(rule git-dir)")
GIT_DIR_REASONS = (GIT_REASON, BARE_REASON, HOOKS_REASON)  # listed first in review, marked
NAME_REASON = ("its name holds a control, format or non-UTF-8 character: not written on the "
               "host")
_HOOKS_PATH = re.compile(r"^\s*hookspath\s*=\s*(.+?)\s*$", re.IGNORECASE)
_INCLUDE_PATH = re.compile(r"^\s*path\s*=\s*(.+?)\s*$", re.IGNORECASE)
_INCLUDE_DEPTH = 10  # git's own limit (config.c MAX_INCLUDE_DEPTH)
# What makes a directory holding HEAD a repository to git (setup.c is_git_directory: objects
# and refs; a linked work tree's git directory has a commondir instead).
REPOSITORY_MARKS = ("refs", "objects", "commondir")


def is_git(rel: str) -> bool:
    """Is ``rel`` a ``.git`` or below one (any component, any case)?"""
    return any(part.lower() == ".git" for part in rel.split("/"))


def runs_it(rel: str) -> str | None:
    """What on the host runs the file ``rel`` by itself, or None."""
    if _AUTORUN is None or not _AUTORUN.search(rel):
        return None
    for matcher, why in _WHY:
        if matcher is not None and matcher.search(rel):
            return why
    return None


def at_and_above(rel: str) -> list[str]:
    """``rel`` and each directory above it, top first, without the top itself ("a", "a/b",
    "a/b/c" for "a/b/c")."""
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def at_or_below(path: str, top: str) -> bool:
    """Is the relative path ``path`` the directory ``top`` or below it, at a "/" ("a" and
    "a/b" are at or below "a"; "ab" is not). Compared as spelled: no "/" at either end, the
    case as given; "" is no directory here (only "" is at it)."""
    return path == top or path.startswith(top + "/")


def git_dirs(paths: Iterable[str]) -> frozenset[str]:
    """The directories (in lower case; "" for the top) that git would take for a repository,
    in the tree whose entries (at any depth; a file stands for the directories above it) are
    ``paths``: each that holds a HEAD and a refs, objects or commondir."""
    names: set[str] = set()
    for path in paths:
        names.update(at_and_above(path.lower()))
    found = set()
    for name in names:
        top, _, last = name.rpartition("/")
        if last == "head" and any(_below(top, mark) in names for mark in REPOSITORY_MARKS):
            found.add(top)
    return frozenset(found)


def _below(top: str, name: str) -> str:
    return f"{top}/{name}" if top else name


def hooks_dirs(root: str, paths: Iterable[str] = ()) -> tuple[str, ...]:
    """The directories (relative to ``root``) that core.hooksPath names inside the project,
    for the work tree at ``root`` and each one below it (a ``sub/.git`` among ``paths``)."""
    tops = {""} | {rel.rpartition("/")[0] for rel in paths
                   if rel.rpartition("/")[2].lower() == ".git"}
    found = {hooks for top in sorted(tops)
             if (hooks := _hooks_dir(root, posixpath.join(root, top))) is not None}
    return tuple(sorted(found))


def _hooks_dir(root: str, work_tree: str) -> str | None:
    """The directory core.hooksPath names for ``work_tree``, relative to ``root`` when it lies
    inside; None otherwise. git's order (the last read wins, so the first found here): the
    work tree's config.worktree, its repository's config, this user's, the system's."""
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    for config in (*_repository_configs(work_tree), os.path.join(home, ".gitconfig"),
                   os.path.join(xdg, "git", "config"), "/etc/gitconfig"):
        value = _hooks_path(config)
        if value is None:
            continue
        full = posixpath.normpath(posixpath.join(work_tree, os.path.expanduser(value)))
        if full.startswith(root.rstrip("/") + "/"):
            return full[len(root.rstrip("/")) + 1:]
        return None
    return None


def _repository_configs(work_tree: str) -> list[str]:
    """The config files of the repository of ``work_tree``: ``.git/config``, or for a linked
    work tree (``.git`` a file, "gitdir: DIR") its config.worktree and the config of the
    common directory (DIR/commondir)."""
    dot_git = os.path.join(work_tree, ".git")
    if os.path.isdir(dot_git):
        return [os.path.join(dot_git, "config.worktree"), os.path.join(dot_git, "config")]
    first = _first_line(dot_git)
    if not first.startswith("gitdir:"):
        return []
    git_dir = os.path.join(work_tree, first[len("gitdir:"):].strip())
    common = os.path.join(git_dir, _first_line(os.path.join(git_dir, "commondir")) or ".")
    return [os.path.join(git_dir, "config.worktree"), os.path.join(common, "config")]


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline(4096).strip()
    except OSError:
        return ""


def _hooks_path(config: str, depth: int = 0) -> str | None:
    """The last core.hooksPath that ``config`` sets, an ``[include]`` or ``[includeIf]``
    file's where it sets one (each condition taken as met: refusing more is the safe side)."""
    try:
        with open(config, encoding="utf-8", errors="replace") as f:
            lines = f.read(1024 * 1024).splitlines()
    except OSError:
        return None
    section, found = "", None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]").strip().lower()
            continue
        if section == "core" and (match := _HOOKS_PATH.match(line)):
            found = match.group(1).strip('"')  # the last one in a file wins
        elif (section == "include" or section.startswith("includeif")) and (
                match := _INCLUDE_PATH.match(line)) and depth < _INCLUDE_DEPTH:
            included = os.path.join(os.path.dirname(config),
                                    os.path.expanduser(match.group(1).strip('"')))
            found = _hooks_path(included, depth + 1) or found
    return found


def never_applied(rel: str, hooks: Sequence[str] = (),
                  repositories: frozenset[str] = frozenset()) -> str | None:
    """Why the change at ``rel`` never lands on the host (under a .git, in a directory git
    takes for a repository (``git_dirs``), in a hooks directory (``hooks_dirs``), a name a
    terminal obeys), or None."""
    if is_git(rel):
        return GIT_REASON
    if "" in repositories or any(p in repositories for p in at_and_above(rel.lower())):
        return BARE_REASON
    lowered = rel.lower()
    if any(at_or_below(lowered, h.lower()) for h in hooks):
        return HOOKS_REASON
    if not rel.isprintable():
        return NAME_REASON
    return None
