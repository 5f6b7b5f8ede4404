"""Where the code that launches sandboxes lives, for the rule nsbox-code (docs/rules.md)."""

from __future__ import annotations

import os

_code_paths: tuple[str, ...] | None = None
# What nsbox imports at launch beside the standard library.
_CODE_MODULES = ("nsbox", "pyseccomp", "click", "cgroupspy")


def code_paths() -> tuple[str, ...]:
    """Where the code that launches sandboxes lives: the directories of nsbox and its
    dependencies, the site-packages (a .pth file there runs at every interpreter start) and
    the interpreter's prefixes (a venv's, and the installation's). A sandbox runs as its
    caller's uid unless the caller is root: given one of these writable, it could change the
    next launch, which runs outside any sandbox. Worked out once per process."""
    global _code_paths
    if _code_paths is None:
        import importlib.util
        import site
        import sys

        paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
        for name in _CODE_MODULES:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            if spec is not None and spec.origin and os.path.isabs(spec.origin):
                paths.add(os.path.dirname(spec.origin))  # the package, or a module's directory
        try:
            paths.update(site.getsitepackages())
        except AttributeError:  # an interpreter started without the site module's functions
            pass
        paths.add(site.getusersitepackages())
        _code_paths = tuple(sorted(p for p in paths if os.path.isabs(p) and os.path.isdir(p)))
    return _code_paths
