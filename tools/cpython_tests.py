"""Run CPython's own regression tests on the host and inside nsbox, and list what differs.

    python3 tools/cpython_tests.py [MODULE...]     (default: os subprocess signal pty ...)

Needs the interpreter's test package (Debian: ``apt-get install libpython3.11-testsuite``).
On the host the tests run as an unprivileged uid (65534, or this user when not root), so that
both sides are unprivileged; inside, in the default profile with a longer time limit. Prints,
per module, the counts of each side and every test whose outcome differs; docs/compatibility.md
explains the differences found.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nsbox  # noqa: E402

PYTHON = "/usr/bin/python3"
MODULES = ("test_os", "test_subprocess", "test_signal", "test_pty", "test_resource",
           "test_shutil", "test_tarfile", "test_threading", "test_tempfile")
# regrtest writes a JUnit XML report; both sides print it, and only it, on stdout.
SCRIPT = "{python} -m test --junit-xml {xml} {module} >/dev/null 2>&1; cat {xml}"


def outcomes(report: str) -> dict[str, str]:
    """test id -> ok, failure, error or skipped (with the reason)."""
    found: dict[str, str] = {}
    last = "?"
    try:
        root = ET.fromstring(report)
    except ET.ParseError:
        return {"(no report)": report[-300:]}
    for case in root.iter("testcase"):
        outcome = "ok"
        for kind in ("failure", "error", "skipped"):
            child = case.find(kind)
            if child is not None:
                outcome = f"{kind}: {(child.get('message') or '')[:100]}"
        # A failing subtest is written without a name, after its test.
        name = case.get("name") or f"{last} (a subtest)"
        last = name
        found[name] = outcome
    return found


def on_host(module: str, workdir: str) -> str:
    script = SCRIPT.format(python=PYTHON, xml=f"{workdir}/{module}.xml", module=module)
    argv = ["sh", "-c", script]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, timeout=1800)
    return proc.stdout


def inside(module: str) -> str:
    policy = nsbox.Policy()
    policy = replace(policy, limits=replace(policy.limits, wall_time=1800.0, cpu_time=1800.0,
                                            output=64 * 1024 * 1024))
    script = SCRIPT.format(python=PYTHON, xml=f"/tmp/{module}.xml", module=module)
    result = nsbox.run(["sh", "-c", script], policy)
    return result.stdout.decode(errors="replace")


def main() -> None:
    modules = sys.argv[1:] or list(MODULES)
    with tempfile.TemporaryDirectory(prefix="nsbox-cpython-") as workdir:
        os.chmod(workdir, 0o777)
        compare(modules, workdir)


def compare(modules: list[str], workdir: str) -> None:
    for module in modules:
        host, box = outcomes(on_host(module, workdir)), outcomes(inside(module))
        counts = {side: {kind: sum(1 for x in found.values() if x.startswith(kind))
                         for kind in ("ok", "failure", "error", "skipped")}
                  for side, found in (("host", host), ("inside", box))}
        print(f"{module}: host {counts['host']}, inside {counts['inside']}")
        for test in sorted(set(host) | set(box)):
            if host.get(test) != box.get(test):
                print(f"  {test}:\n    host:   {host.get(test)}\n    inside: {box.get(test)}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
