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
config, and through ``[include]`` files. Such an included file (``include.path =
../.gitconfig``, an ``[includeIf]`` one too) is git's config wherever it lies: one inside the
project is refused as well (``git_configs``), made or changed, and with it every config that
could set core.hooksPath inside the project, so the hooks directory read at the session's
start is the one the applied tree leaves.

Python runs a ``__pycache__/*.pyc`` in place of its source when the header's mtime and size
match the source's (both of which the sandbox can read): a bytecode cache never lands either
(``PYC_REASON``), so the reviewed source is what runs.

A name with a character a terminal obeys or hides (not ``visible.drawn``) never lands
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

from nsbox import visible
from nsbox.policy.rules import secret_matcher

# (pattern, what runs it): matched as rules.SECRETS are (any depth, any case; a directory
# stands for what it holds). The first pattern that matches gives the reason.
_JS = "the JS tool it configures runs it as code (eslint, prettier, vite, jest, webpack...)"
AUTORUN: tuple[tuple[str, str], ...] = (
    (".envrc", "direnv runs it when a shell enters the directory"),
    (".envrc.local", "direnv runs it (source_env from .envrc)"),
    ("shell.nix", "nix-shell and direnv (use nix) run it"),
    ("default.nix", "nix-shell and direnv (use nix) run it"),
    ("flake.nix", "nix develop and direnv (use flake) run it"),
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
    (".npmrc", "npm obeys it (node-options, script-shell: programs it runs)"),
    (".yarnrc", "yarn obeys it"), (".yarnrc.yml", "yarn obeys it"),
    (".yarn/releases", "yarn runs the release its yarnPath names"),
    (".yarn/plugins", "yarn runs the plugins its .yarnrc.yml names"),
    (".pnpmfile.cjs", "pnpm runs it"), ("bunfig.toml", "bun obeys it (preload runs scripts)"),
    ("node_modules", "node loads what it holds; npm runs its scripts and .bin programs"),
    ("*.config.js", _JS), ("*.config.cjs", _JS), ("*.config.mjs", _JS),
    ("*.config.ts", _JS), ("*.config.cts", _JS), ("*.config.mts", _JS), (".*rc.js", _JS),
    (".*rc.cjs", _JS), (".*rc.mjs", _JS), ("*.conf.js", _JS),
    ("gulpfile.*", "gulp runs it"), ("Gruntfile.*", "grunt runs it"),
    ("*.node", "node loads it as a native module"),
    ("Makefile", "make runs its recipes"), ("GNUmakefile", "make runs its recipes"),
    ("*.mk", "make runs its recipes"), ("CMakeLists.txt", "cmake runs it"),
    ("*.cmake", "cmake runs it"), ("meson.build", "meson runs it"),
    ("*.gradle", "gradle runs it"), ("*.gradle.kts", "gradle runs it"),
    ("gradlew", "the Gradle wrapper: IDEs and CI run it"),
    ("gradle/wrapper", "gradlew runs the Gradle it names"),
    ("pom.xml", "maven runs the plugins it names"), (".mvn", "maven obeys it (its wrapper, "
                                                         "options and extensions)"),
    ("mvnw", "the Maven wrapper: IDEs and CI run it"), ("*.sbt", "sbt runs it"),
    ("setup.py", "pip and setuptools run it"), ("pyproject.toml", "pip runs its build backend"),
    ("setup.cfg", "setuptools obeys it"), ("conftest.py", "pytest imports it"),
    ("pytest.ini", "pytest loads the plugins it names"),
    ("tox.ini", "tox runs its commands"), ("noxfile.py", "nox runs it"),
    (".pylintrc", "pylint runs its init-hook"), ("pylintrc", "pylint runs its init-hook"),
    ("mypy.ini", "mypy imports the plugins it names"),
    (".mypy.ini", "mypy imports the plugins it names"),
    (".flake8", "flake8 imports the local plugins it names"),
    (".pdbrc", "pdb runs its commands"),
    ("sitecustomize.py", "Python runs it at start"), ("usercustomize.py", "Python runs it at "
                                                     "start"),
    ("*.pth", "Python runs its import lines at start"),
    ("*.so", "Python imports it in place of a module's .py; the dynamic loader loads it"),
    (".venv", "the host runs its programs and imports its packages"),
    (".Rprofile", "R runs it at start"),
    (".pre-commit-config.yaml", "pre-commit runs the hooks it lists on git commit"),
    (".husky", "husky's git hooks"), (".githooks", "git hooks (by core.hooksPath)"),
    ("lefthook.yml", "lefthook runs it on git commands"),
    (".lefthook.yml", "lefthook runs it on git commands"),
    (".gitattributes", "git runs the filter, diff and merge drivers it names"),
    (".gitmodules", "git fetches and checks out what it lists"),
    (".hg", "Mercurial runs the hooks its hgrc names"),
    ("build.rs", "cargo runs it before building"), (".cargo", "cargo obeys its runners"),
    ("rust-toolchain", "rustup runs the toolchain it names"),
    ("rust-toolchain.toml", "rustup runs the toolchain it names"),
    ("Gemfile", "bundler runs it as Ruby"), ("*.gemspec", "bundler and gem run it as Ruby"),
    ("Rakefile", "rake runs it"), (".irbrc", "irb runs it at start"),
    (".pryrc", "pry runs it at start"), (".rspec", "rspec obeys it (--require)"),
    ("justfile", "just runs its recipes"), ("Taskfile.yml", "task runs it"),
    ("mise.toml", "mise runs its hooks and tasks"), (".mise.toml", "mise runs its hooks and "
                                                     "tasks"),
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
CONFIG_REASON = ("git's config (a file the project's git config includes): git runs the "
                 "commands it names (core.fsmonitor, core.hooksPath...) on the host; never "
                 "applied (rule git-dir)")
PYC_REASON = ("a Python bytecode cache: Python runs a cached .pyc in place of its source; "
              "never applied")
# Listed first in review, marked (the name is older than the last two).
GIT_DIR_REASONS = (GIT_REASON, BARE_REASON, HOOKS_REASON, CONFIG_REASON, PYC_REASON)
NAME_REASON = ("its name holds a control, format, blank-looking or non-UTF-8 character: not "
               "written on the host")
# A section's header ([name] or [name "subsection"]), then what may follow it on its line.
_HEADER = re.compile(r'\[\s*([A-Za-z0-9.-]+)(?:\s+"((?:[^"\\]|\\.)*)")?\s*\](.*)')
_KEY = re.compile(r"([A-Za-z][A-Za-z0-9-]*)\s*(?:=(.*))?")
_ESCAPES = {"n": "\n", "t": "\t", "b": "\b"}
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
    found = {hooks for top in _work_trees(paths)
             if (hooks := _hooks_dir(root, posixpath.join(root, top))) is not None}
    return tuple(sorted(found))


def git_configs(root: str, paths: Iterable[str] = ()) -> tuple[str, ...]:
    """The files (relative to ``root``) inside the project that git reads as config, for the
    work tree at ``root`` and each one below it: each file an ``[include]`` or
    ``[includeIf]`` names (its condition taken as met), at any depth, whether it exists yet or
    not (the sandbox could make it), and a config git reads that lies inside itself (a home
    directory for a project). As written and as its symlinks resolve."""
    tops = {root.rstrip("/"), os.path.realpath(root)}
    seen: set[str] = set()
    for top in _work_trees(paths):
        for config in _config_files(posixpath.join(root, top)):
            _read_includes(config, seen, 0)
    found: set[str] = set()
    for path in seen:
        for spelled in {posixpath.normpath(path), os.path.realpath(path)}:
            found.update(spelled[len(t) + 1:] for t in tops if spelled.startswith(t + "/"))
    return tuple(sorted(found))


def _read_includes(config: str, seen: set[str], depth: int) -> None:
    """``config`` and the files it includes, into ``seen`` (each read once)."""
    if config in seen:
        return
    seen.add(config)
    if depth >= _INCLUDE_DEPTH:
        return
    for section, key, value in _config_entries(config):
        if (included := _included(config, section, key, value)) is not None:
            _read_includes(included, seen, depth + 1)


def _work_trees(paths: Iterable[str]) -> list[str]:
    """The project's top ("") and each directory below it that holds a ``.git``."""
    return sorted({""} | {rel.rpartition("/")[0] for rel in paths
                          if rel.rpartition("/")[2].lower() == ".git"})


def _config_files(work_tree: str) -> list[str]:
    """The config files git reads for ``work_tree``, the last read first: its repository's,
    this user's, the system's."""
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return [*_repository_configs(work_tree), os.path.join(home, ".gitconfig"),
            os.path.join(xdg, "git", "config"), "/etc/gitconfig"]


def _hooks_dir(root: str, work_tree: str) -> str | None:
    """The directory core.hooksPath names for ``work_tree``, relative to ``root`` when it lies
    inside; None otherwise. git's order (the last read wins, so the first found here): the
    work tree's config.worktree, its repository's config, this user's, the system's."""
    for config in _config_files(work_tree):
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
    found = None
    for section, key, value in _config_entries(config):
        if section == "core" and key == "hookspath":
            found = value  # the last one in a file wins
        elif (included := _included(config, section, key, value)) is not None and (
                depth < _INCLUDE_DEPTH):
            found = _hooks_path(included, depth + 1) or found
    return found


def _included(config: str, section: str, key: str, value: str) -> str | None:
    """The file an ``[include]`` or ``[includeIf "..."]`` setting of ``config`` names (a
    relative path is relative to ``config``'s directory), or None."""
    if key != "path" or not value or not (section == "include"
                                          or section.startswith('includeif "')):
        return None
    return os.path.join(os.path.dirname(config), os.path.expanduser(value))


def _config_entries(config: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of each setting in the git config file ``config``, as git reads
    them: the section's name and the key in lower case, a subsection kept in quotes
    (``includeif "gitdir:~/x/"``); a key may follow its header on the same line, a value be
    quoted, end at a comment, go on past a backslash that ends a line. [] when unreadable."""
    try:
        with open(config, encoding="utf-8", errors="replace") as f:
            text = f.read(1024 * 1024)
    except OSError:
        return []
    found: list[tuple[str, str, str]] = []
    section = ""
    for line in re.sub(r"\\\r?\n", "", text).splitlines():
        rest = line.strip()
        if header := _HEADER.match(rest):
            name, sub, rest = header.groups()
            section = name.lower() + (f' "{sub}"' if sub is not None else "")
            rest = rest.strip()
        if not rest or rest[0] in "#;" or not (match := _KEY.fullmatch(rest)):
            continue
        key, raw = match.groups()
        found.append((section, key.lower(), _value(raw) if raw is not None else "true"))
    return found


def _value(raw: str) -> str:
    """A config value as git reads it: quotes taken off, escapes undone, a comment cut."""
    out, quoted, i = [], False, 0
    raw = raw.strip()
    while i < len(raw):
        c = raw[i]
        if c == '"':
            quoted = not quoted
        elif c == "\\" and i + 1 < len(raw):
            i += 1
            out.append(_ESCAPES.get(raw[i], raw[i]))
        elif c in "#;" and not quoted:
            break
        else:
            out.append(c)
        i += 1
    return "".join(out).strip()


def is_bytecode(rel: str) -> bool:
    """Is ``rel`` a Python bytecode cache: in a ``__pycache__``, or a ``.pyc`` or ``.pyo``
    (any component, any case)?"""
    return any(part == "__pycache__" or part.endswith((".pyc", ".pyo"))
               for part in rel.lower().split("/"))


def never_applied(rel: str, hooks: Sequence[str] = (),
                  repositories: frozenset[str] = frozenset(),
                  configs: Sequence[str] = ()) -> str | None:
    """Why the change at ``rel`` never lands on the host (under a .git, in a directory git
    takes for a repository (``git_dirs``), in a hooks directory (``hooks_dirs``), a file git
    reads as config (``git_configs``), a Python bytecode cache, a name a terminal obeys), or
    None."""
    if is_git(rel):
        return GIT_REASON
    if "" in repositories or any(p in repositories for p in at_and_above(rel.lower())):
        return BARE_REASON
    lowered = rel.lower()
    if any(at_or_below(lowered, h.lower()) for h in hooks):
        return HOOKS_REASON
    if any(at_or_below(lowered, c.lower()) for c in configs):
        return CONFIG_REASON
    if is_bytecode(rel):
        return PYC_REASON
    if not visible.drawn(rel):
        return NAME_REASON
    return None
