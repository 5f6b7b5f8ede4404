"""Check the shape of the package: no function over a cyclomatic complexity of 20 (radon) and
no module over 500 lines.

    python3 tools/check_shape.py

Run by .ci/run. The exceptions below are what the code held when the check came in; each says
why it is still there. Any other function or module over a limit fails the check, and so does
an exception that no longer needs its place (take it off the list).
"""

from __future__ import annotations

import sys
from pathlib import Path

from radon.complexity import cc_visit

REPO = Path(__file__).resolve().parent.parent
MAX_COMPLEXITY = 20
MAX_LINES = 500

# "path:function" -> why it is over MAX_COMPLEXITY for now.
COMPLEX = {
    "nsbox/doctor/__init__.py:_simulated_cgroups":
        "the doctor is being moved onto the production cgroup detection, which removes it",
    "nsbox/doctor/hostfacts.py:HostFacts.cgroups":
        "a second parser of the cgroup layout; goes with the doctor's move to cgroups.detect",
    "nsbox/cli/run.py:_execute":
        "one branch per run option; goes when the options come from one table",
    "nsbox/cli/supervisor.py:Supervisor.dispatch":
        "one branch per session operation (diff, apply, discard came with project workspaces); "
        "to become a table of handlers",
    "nsbox/session.py:Session.__init__":
        "the project workspace and ask callback added steps; to become named start steps",
}

# path -> why it is over MAX_LINES for now.
LONG = {
    "nsbox/session.py": "Session and its file transfer, to be split when its work settles",
    "nsbox/host/seccomp.py": "the built-in rules, the compiler and the cache, to be three",
    "nsbox/host/netproxy.py": "the proxy's HTTP parsing and its relay, to be two",
    "nsbox/rules.py": "the rule book and the resolved-path checks, to be two",
    "nsbox/launcher.py": "the helper client and the output supervision, to leave for host/",
    "nsbox/ray.py": "the executor actors and the client, to be two",
    "nsbox/mcp_server.py": "the tools and the server loop, to be two",
    "nsbox/profiles/schema.py": "the value parsers and the TOML writers, to be two",
    "nsbox/cli/session.py": "the session commands and the project review commands, to be two",
    "nsbox/doctor/__init__.py": "the checks and the verdicts per guarantee, to be two",
}


def complex_functions(path: Path) -> dict[str, int]:
    found = {}
    blocks = list(cc_visit(path.read_text()))
    while blocks:
        block = blocks.pop()
        # A class's methods, and functions defined inside functions, count on their own.
        blocks += [*getattr(block, "methods", []), *getattr(block, "closures", [])]
        if block.complexity > MAX_COMPLEXITY:
            found[f"{path.relative_to(REPO)}:{block.fullname}"] = block.complexity
    return found


def main() -> int:
    problems = []
    complex_now: dict[str, int] = {}
    long_now: dict[str, int] = {}
    for path in sorted((REPO / "nsbox").rglob("*.py")):
        complex_now.update(complex_functions(path))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long_now[str(path.relative_to(REPO))] = lines
    for name, value in sorted(complex_now.items()):
        if name not in COMPLEX:
            problems.append(f"{name}: cyclomatic complexity {value} > {MAX_COMPLEXITY}: "
                            "split it into named steps")
    for name, value in sorted(long_now.items()):
        if name not in LONG:
            problems.append(f"{name}: {value} lines > {MAX_LINES}: split the module")
    for name in sorted(set(COMPLEX) - set(complex_now)):
        problems.append(f"{name}: within the limit now; take it off COMPLEX in {__file__}")
    for name in sorted(set(LONG) - set(long_now)):
        problems.append(f"{name}: within the limit now; take it off LONG in {__file__}")
    for problem in problems:
        print(f"check_shape: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
