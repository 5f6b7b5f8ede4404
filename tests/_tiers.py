"""The test tiers: which tests launch a sandbox (marker ``sandbox``), and which need none.

``pytest -m "not sandbox"`` is the fast tier: the rule book, profiles, options, tables, docs,
the import graph, the parsers... in seconds. The whole suite (no ``-m``) runs every tier.

A test is marked ``sandbox`` when its code, the fixtures it asks for or the functions of its
module it calls (at any depth) name something that launches one: ``nsbox.run``, a Session, a
Pool, the launcher, a process (``subprocess``, the CLI runner), the ``sandbox`` fixture...
The reading is by name, so it errs on the side of ``sandbox``. In the fast tier a guard then
fails any test that still leaves a process behind (the launch helper outlives the launch that
started it): mark such a test, or the helper it calls, by hand with ``pytest.mark.sandbox``.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Names whose use launches a sandbox or a process (a conftest fixture, an API, a module).
LAUNCHING = frozenset({
    "sandbox", "public_tree", "run", "arun", "run_cancellable", "Session", "AsyncSession",
    "Pool", "launcher", "run_as", "Runner", "_driver", "subprocess", "Popen", "CliRunner", "pty",
    "ptytools", "sessiontools", "containerhost", "_userns", "run_doctor", "probe_dir",
})
MARKER = "sandbox: launches a sandbox or a process (the fast tier is -m 'not sandbox')"


@functools.cache
def _module_functions(path: str) -> dict[str, ast.AST]:
    """The module-level functions, classes and assigned names of a test file (a table of
    functions, say), by name."""
    tree = ast.parse(Path(path).read_text(), path)
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node.value if node.value is not None else node
    return found


def _names(node: ast.AST) -> set[str]:
    found = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            # x.run(...) is a session's, a pool's or the fixture's, each a name of its own
            # here, or a click command's (cli.run): only nsbox.run itself counts as "run".
            if child.attr not in ("run", "arun") or (
                    isinstance(child.value, ast.Name) and child.value.id == "nsbox"):
                found.add(child.attr)
        elif isinstance(child, ast.arg):
            found.add(child.arg)  # a fixture asked for
        elif isinstance(child, ast.alias):
            found.add((child.asname or child.name).split(".")[0])
    return found


def launches(path: str, name: str) -> bool:
    """Whether the test function ``name`` of ``path`` (or what it uses of its module, at any
    depth) names something that launches."""
    functions = _module_functions(path)
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in functions:
            continue
        seen.add(current)
        names = _names(functions[current])
        if names & LAUNCHING:
            return True
        todo.extend(names)
    return False


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is None or item.get_closest_marker("sandbox"):
            continue
        # A method is judged with its whole class (its fixtures and helpers live there).
        root = item.cls.__name__ if getattr(item, "cls", None) else function.__name__
        if launches(str(item.path), root):
            item.add_marker(pytest.mark.sandbox)


def _children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    return found


def fast_tier(config: pytest.Config) -> bool:
    return config.getoption("markexpr", "").replace(" ", "") in ("notsandbox", "(notsandbox)")


def guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the fast tier, a test that leaves a child process behind launched something (an
    autouse fixture of conftest.py)."""
    if not fast_tier(request.config):
        yield
        return
    before = _children()
    yield
    left = _children() - before
    if left:
        pytest.fail(f"{request.node.nodeid} left processes {sorted(left)} in the fast tier: "
                    "it launches one; mark it pytest.mark.sandbox", pytrace=False)
