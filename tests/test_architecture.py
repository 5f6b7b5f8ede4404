"""The package's import graph has no cycles, counting the imports deferred into functions.

`lint-imports` (.importlinter) checks the layers, but its acyclic contract looks at siblings
only and misses a package's ``__init__`` importing its own modules that import it back. This
reads every module's import statements with ``ast`` and looks for any cycle among nsbox's
modules. Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "nsbox"

# No cycle is left: the click commands share their helpers through nsbox/cli/shared.py and
# the session-backed runs of `nsbox run` live in nsbox/cli/oneshot.py, below both.
KNOWN_CYCLES: list[list[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the tree except those under ``if TYPE_CHECKING:``."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The nsbox modules that ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from a import b` imports the module a.b if there is one, else a name of a.
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    table = modules()
    known = set(table)
    return {name: imports_of(name, path, known) for name, path in table.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Top-level, relative and deferred imports count; those under TYPE_CHECKING do not (so an
    empty graph cannot pass the test below)."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import nsbox.a\n"
        "from . import b\n"
        "from .c import name\n"
        "if TYPE_CHECKING:\n"
        "    import nsbox.d\n"
        "def later():\n"
        "    from nsbox import e\n")
    known = {"nsbox.a", "nsbox.pkg.b", "nsbox.pkg.c", "nsbox.d", "nsbox.e", "nsbox.pkg.mod"}
    assert imports_of("nsbox.pkg.mod", source, known) == {
        "nsbox.a", "nsbox.pkg.b", "nsbox.pkg.c", "nsbox.e"}
    assert "nsbox.errors" in import_graph()["nsbox.api"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    """No cycle, deferred imports counted (KNOWN_CYCLES names one only while it is meant to
    stay, and .importlinter then lists its imports)."""
    found = cycles(import_graph())
    new = [component for component in found if component not in KNOWN_CYCLES]
    assert new == [], "import cycles among nsbox's modules:\n" + "\n".join(
        " <-> ".join(component) for component in new)
    assert sorted(found) == sorted(KNOWN_CYCLES)


# Private by their names to the world outside nsbox, shared inside it on purpose: the libc,
# Landlock, path, mount-table and wire bindings (nsbox/_sys/) and the compiled core, which only
# its wrapper nsbox/sandbox/native.py imports.
SHARED_PRIVATE = {"nsbox._sys": "the system bindings", "nsbox._native": "the compiled core"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _shared(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in SHARED_PRIVATE)


def private_uses(name: str, path: Path, known: set[str]) -> list[str]:
    """The private names (a leading underscore) of other packages' modules that ``name`` uses:
    imported from them, or read off them as ``module._name``. A module's own package (a
    folder and its modules) may share its private names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def foreign(module: str) -> bool:
        return not (module == package or module.startswith(package + ".")) and not _shared(module)

    uses, aliases = [], {}
    nodes = _runtime_nodes(ast.parse(path.read_text(), str(path)))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nsbox"):
            module = node.module or ""
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target in known:
                    aliases[alias.asname or alias.name] = target
                    if _private(alias.name) and foreign(target):
                        uses.append(f"{name} imports the module {target}")
                elif _private(alias.name) and foreign(module) and not _shared(target):
                    uses.append(f"{name} imports {alias.name} from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    aliases[alias.asname] = alias.name
    for node in nodes:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _private(node.attr)
                and foreign(aliases[node.value.id])):
            uses.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
    return sorted(uses)


def test_the_private_name_finder_finds_each_kind(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from nsbox.host import engine, socketscan as scan\n"
                      "from nsbox.policy.limits import _rlimit\n"
                      "from nsbox.cgroups import _v2\n"
                      "from nsbox._sys import libc as _libc\n"
                      "scan._watches.clear(); engine.client; _libc._lib\n")
    known = set(modules())
    assert private_uses("nsbox.other.m", module, known) == [
        "nsbox.other.m imports _rlimit from nsbox.policy.limits",
        "nsbox.other.m imports the module nsbox.cgroups._v2",
        "nsbox.other.m reads nsbox.host.socketscan._watches",
    ]
    # Inside its own package a private module or name is the package's to share.
    assert private_uses("nsbox.cgroups.m", module, known) == [
        "nsbox.cgroups.m imports _rlimit from nsbox.policy.limits",
        "nsbox.cgroups.m reads nsbox.host.socketscan._watches",
    ]


def test_no_module_uses_another_packages_private_names() -> None:
    """Each stage has a public interface: no module of nsbox imports or reads a private name
    of a module outside its own package (docs/architecture.md, "Layers")."""
    table = modules()
    known = set(table)
    found = [use for name, path in sorted(table.items())
             for use in private_uses(name, path, known)]
    assert found == []


def test_the_sandbox_child_imports_nothing_after_its_clone() -> None:
    """docs/architecture.md, "Layers": a sandbox child imports nothing after its clone. So no
    module the Python child reaches imports inside a function (a first call would import)."""
    graph, table = import_graph(), modules()
    reached, todo = set(), ["nsbox.sandbox.child"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert {"nsbox.sandbox.mounts", "nsbox._sys.libc", "nsbox._sys.wire"} <= reached
    deferred = []
    for name in sorted(reached):
        for node in ast.walk(ast.parse(table[name].read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                deferred += [f"{name}:{inner.lineno}" for inner in ast.walk(node)
                             if isinstance(inner, (ast.Import, ast.ImportFrom))]
    assert deferred == []
