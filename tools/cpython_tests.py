"""Run CPython's own regression tests on the host and inside nsbox, and list what differs.

    python3 tools/cpython_tests.py [--strict] [MODULE...]   (default: the OS-facing MODULES)

Needs the interpreter's test package (Debian: ``apt-get install libpython3.11-testsuite``).
On the host the tests run as an unprivileged uid (65534, or this user when not root), so that
both sides are unprivileged. Inside, they run in the default profile as a test suite needs it:
loopback networking (the suite serves sockets on localhost), no CPU-time and no file-size
limit (the suite checks that RLIMIT_CPU can be raised and that RLIMIT_FSIZE is unlimited), a
30-minute wall clock. ``--strict`` keeps the default profile's network and limits as they are.
Prints, per module, the counts of each side and every test whose outcome differs, then the
failing cases on each side; docs/compatibility.md explains the differences found.
"""

from __future__ import annotations

import os
import signal
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
# The modules of the suite that test what the operating system gives a program: processes,
# signals, terminals, descriptors, files, users, limits, threads.
MODULES = ("test_os", "test_posix", "test_subprocess", "test_signal", "test_pty",
           "test_openpty", "test_resource", "test_fcntl", "test_select", "test_selectors",
           "test_poll", "test_epoll", "test_mmap", "test_pwd", "test_grp", "test_tarfile",
           "test_threading", "test_threadsignals", "test_tempfile", "test_shutil",
           "test_faulthandler", "test_wait3", "test_wait4", "test_fork1", "test_eintr",
           "test_pathlib", "test_time", "test_getpass")
# regrtest writes a JUnit XML report; both sides print it, and only it, on stdout.
SCRIPT = "{python} -m test --junit-xml {xml} {module} >/dev/null 2>&1; cat {xml}"


def outcomes(report: str) -> dict[str, str]:
    """test id -> ok, failure, error or skipped (with the reason)."""
    found: dict[str, str] = {}
    last = "?"
    try:
        root = ET.fromstring(report)
    except ET.ParseError:
        # The module did not run to its end (it hung until the time limit, or crashed).
        return {"(no report)": f"error: the module did not finish: {report[-300:]!r}"}
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


def failing(report: str) -> int:
    """Failures and errors as regrtest counts them: each failing subtest is one (the report's
    testsuite totals; its test cases carry only the first of a test's failing subtests). A
    module that did not run to its end counts as one."""
    try:
        root = ET.fromstring(report)
    except ET.ParseError:
        return 1
    return sum(int(suite.get("failures") or 0) + int(suite.get("errors") or 0)
               for suite in root.iter("testsuite"))


def on_host(module: str, workdir: str) -> str:
    script = SCRIPT.format(python=PYTHON, xml=f"{workdir}/{module}.xml", module=module)
    argv = ["sh", "-c", script]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, timeout=1800)
    return proc.stdout


def policy_inside(strict: bool) -> nsbox.Policy:
    policy = nsbox.Policy()
    limits = replace(policy.limits, wall_time=1800.0, output=64 * 1024 * 1024)
    if strict:
        return replace(policy, limits=replace(limits, cpu_time=1800.0))
    return replace(policy, limits=replace(limits, cpu_time=None, file_size=None),
                   network=nsbox.Network(mode="loopback"))


def inside(module: str, policy: nsbox.Policy) -> str:
    script = SCRIPT.format(python=PYTHON, xml=f"/tmp/{module}.xml", module=module)
    result = nsbox.run(["sh", "-c", script], policy)
    if result.status is not nsbox.Status.OK:
        print(f"  ({module} inside: {result.status.value}, {result.wall_time:.0f} s)")
    return result.stdout.decode(errors="replace")


def default_signals() -> None:
    """Signals at their defaults, as a terminal gives them, for the host side: started as a
    background job (``cmd &``, nohup), this process would pass SIGINT and SIGQUIT on ignored
    (signal(7): ignored signals stay ignored across exec), and CPython's signal and threading
    tests fail on the host for that alone. nsbox resets the sandbox's own."""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM,
                   signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(signum) == signal.SIG_IGN:
            # A handler of this process is SIG_DFL again in its children (execve(2)).
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                          else signal.SIG_DFL)


def main() -> None:
    default_signals()
    args = sys.argv[1:]
    strict = "--strict" in args
    modules = [a for a in args if a != "--strict"] or list(MODULES)
    with tempfile.TemporaryDirectory(prefix="nsbox-cpython-") as workdir:
        os.chmod(workdir, 0o777)
        compare(modules, workdir, policy_inside(strict))


def compare(modules: list[str], workdir: str, policy: nsbox.Policy) -> None:
    counts_of: dict[str, dict[str, int]] = {}
    for module in modules:
        host_report, box_report = on_host(module, workdir), inside(module, policy)
        host, box = outcomes(host_report), outcomes(box_report)
        counts = {side: {kind: sum(1 for x in found.values() if x.startswith(kind))
                         for kind in ("ok", "failure", "error", "skipped")}
                  for side, found in (("host", host), ("inside", box))}
        print(f"{module}: host {counts['host']}, inside {counts['inside']}")
        for test in sorted(set(host) | set(box)):
            if host.get(test) != box.get(test):
                print(f"  {test}:\n    host:   {host.get(test)}\n    inside: {box.get(test)}")
        counts_of[module] = {"host": failing(host_report), "inside": failing(box_report)}
        sys.stdout.flush()
    print("failing cases (failures and errors), inside / host:")
    for module, count in counts_of.items():
        if count["host"] or count["inside"]:
            print(f"  {module}: {count['inside']} / {count['host']}")
    print(f"  all {len(modules)} modules: {sum(c['inside'] for c in counts_of.values())} / "
          f"{sum(c['host'] for c in counts_of.values())}")


if __name__ == "__main__":
    main()
