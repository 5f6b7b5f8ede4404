"""Project files the host runs by itself: what apply never writes, and what review marks.

A change applied to a project lands where the host's own tools act without being asked. git
runs ``.git/hooks/*`` and obeys ``.git/config`` (core.fsmonitor, core.sshCommand, filter and
diff drivers: each one a command), so nothing under a ``.git`` is ever applied: the sandbox
sees the project's git directories read-only (nsbox/host/projectmasks.py), and a ``.git`` it
makes where none was is refused here too (``git init`` keeps the hooks of a ``.git`` it
finds; a ``sub/.git`` file can point git at a directory of the sandbox's making). A component
is compared in any case: a case-insensitive filesystem takes ``.GIT`` for ``.git``. The
directory that core.hooksPath names inside the project (husky's ``.husky``) holds git hooks
as well and is refused the same way.

The other files a host runs by itself are applied when chosen, but the review lists them
first, each marked with what runs it (``AUTORUN``).
"""

from __future__ import annotations

import os
import posixpath
import re

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
_HOOKS_PATH = re.compile(r"^\s*hookspath\s*=\s*(.+?)\s*$", re.IGNORECASE)


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


def hooks_dir(root: str) -> str | None:
    """The directory (relative to ``root``) that core.hooksPath names, when it lies inside
    the project; None otherwise. The project's .git/config first, then this user's and the
    system's config (git's order: the first that sets it wins); read here, not by git: a
    plain ``hooksPath = DIR`` in the core section (includes are not followed)."""
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    for config in (os.path.join(root, ".git", "config"), os.path.join(home, ".gitconfig"),
                   os.path.join(xdg, "git", "config"), "/etc/gitconfig"):
        value = _hooks_path(config)
        if value is None:
            continue
        full = posixpath.normpath(posixpath.join(root, os.path.expanduser(value)))
        if full.startswith(root.rstrip("/") + "/"):
            return full[len(root.rstrip("/")) + 1:]
        return None
    return None


def _hooks_path(config: str) -> str | None:
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
        match = _HOOKS_PATH.match(line)
        if section == "core" and match:
            found = match.group(1).strip('"')  # the last one in a file wins
    return found


def never_applied(rel: str, hooks: str | None) -> str | None:
    """Why the change at ``rel`` is never applied (a git directory, the hooks directory), or
    None."""
    if is_git(rel):
        return GIT_REASON
    if hooks is not None and (rel.lower() == hooks.lower()
                              or rel.lower().startswith(hooks.lower() + "/")):
        return HOOKS_REASON
    return None
