"""What nsbox says of a run once it has ended, on stderr, and the exit code it picks: one
place for ``nsbox run`` (nsbox/cli/run.py) and ``nsbox session exec`` (nsbox/cli/session.py).
"""

from __future__ import annotations

import signal
import sys

from nsbox import visible
from nsbox.errors import CommandNotFound, NsboxError, SetupError
from nsbox.result import Result, Status

EXIT_OUTPUT_LIMIT = 123
EXIT_TIMEOUT = 124
EXIT_SETUP = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


def echo(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def fail_code(error: NsboxError) -> int:
    """Print ``nsbox: <step>: <reason>`` (and the hint); the matching exit code. A message
    may quote what a sandbox made (a file name, a report): shown by nsbox/visible.py's rule."""
    echo(f"nsbox: {visible.text(str(error))}", err=True)
    if isinstance(error, CommandNotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, SetupError) and error.step == "exec":
        return EXIT_NOT_EXECUTABLE
    return EXIT_SETUP


def exit_code(result: Result) -> int:
    if result.status is Status.TO:
        return EXIT_TIMEOUT
    if result.status is Status.OL:
        return EXIT_OUTPUT_LIMIT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code or 0


# The one limit that is not the host's doing says its own way out (nsbox/policy/limits.py,
# note_disk).
_SHORT = {"disk": "disk (/workspace is a host directory; --workspace-size none accepts that)"}


def degraded_line(result: Result) -> str:
    """The limits this host could only approximate, named in one short line; the Result (and
    --json) keeps each one's fallback and reason, and `nsbox doctor` explains them.

    A memory limit approximated by RLIMIT_AS that fires is a failed allocation inside the
    program, which ends as the program decides (Python: MemoryError, exit 1): the run is RE,
    not ML, and this line is what tells the two apart.
    """
    names = dict.fromkeys(_SHORT.get(name, name) for name in
                          (entry.split(":", 1)[0] for entry in result.degraded))
    return ("nsbox: limits approximated on this host: " + ", ".join(names)
            + " (`nsbox doctor` says why and how to enforce them; --quiet hides this line)")


_FULL_REMEDY = {"/tmp": "raise its size with --tmp-size",
                "/workspace": "raise its size with --workspace-size (a host directory: free "
                "space on its filesystem)",
                "/dev/shm": "raise its size with --set limits.shm_size=SIZE"}


def disk_full_lines(result: Result) -> list[str]:
    """One line per writable place that was full when a failed command ended: the failure may
    come from there (its own status and message stay the command's)."""
    if result.ok:
        return []
    return [f"nsbox: {place} was full when the command ended; {_FULL_REMEDY.get(place, '')}"
            for place in result.disk_full]


def network_lines(result: Result) -> list[str]:
    """The proxy's log in short (nsbox/host/netlog.py, ``summary``): a client prints only
    "403" for a refused CONNECT, so the first refused attempts and their reasons reach the
    user here, with how many more were refused, and each destination reached. --json keeps
    the whole report."""
    network = result.extra.get("network")
    if not network:
        return []
    from nsbox.host.netlog import summary

    return [f"nsbox: network: {line}" for line in summary(network)]


# What a signal that ended the command most likely means here.
_SIGNAL_REASONS: dict[int, str] = {
    signal.SIGXFSZ: "a file reached the file-size limit; raise it with --file-size",
    signal.SIGSYS: "a system call the seccomp filter kills (a rule's or its default_action's "
    "kill); --seccomp-log names it",
}


def signal_line(signum: int) -> str:
    """The line of a command killed by a signal (status SG, exit 128 + N)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    reason = _SIGNAL_REASONS.get(signum)
    return f"nsbox: SG: the command was killed by {name} ({signum})" + (
        f": {reason}" if reason else "")


_LIMIT_REASONS = {"memory": "memory limit reached (OOM kill); raise it with --memory",
                  "cpu_time": "CPU-time limit reached; raise it with --cpu-time"}


def report(result: Result, quiet: bool) -> None:
    """What the user should know about the run, on stderr."""
    for line in [*network_lines(result), *disk_full_lines(result)]:
        echo(line, err=True)
    if result.degraded and not quiet:
        echo(degraded_line(result), err=True)
    if "seccomp_denied" in result.extra:
        denied = ", ".join(result.extra["seccomp_denied"]) or "nothing"
        echo(f"nsbox: seccomp denied: {denied}", err=True)
    elif result.status is Status.SG and result.signal is not None:
        echo(signal_line(result.signal), err=True)
    elif result.status in (Status.TO, Status.OL, Status.ML):
        reason = _LIMIT_REASONS.get(result.extra.get("limit", ""))
        echo(f"nsbox: {result.status.value}: "
             + (reason or ("wall-clock limit reached; raise it with --time"
                           if result.status is Status.TO
                           else "output limit reached; raise it with --output-limit")),
             err=True)


def settle_terminal() -> None:
    """Once the command's output has ended and before nsbox's own lines: where that output took
    a control on its way to this process's stdout or stderr, the terminal there is settled
    (nsbox/host/terminal.py, settle_after_output; docs/cli.md). Once a run: later calls find
    nothing."""
    from nsbox.host import output, terminal

    controlled = output.TERMINAL_HOLD.take_controlled((1, 2))
    if controlled:
        terminal.settle_after_output(controlled)
