"""Both launch cores report the same failure the same way, step by step.

The native core (nsbox/native/*.c) and the Python child (nsbox/sandbox/child.py) run the same
named steps; each case below injects one failure, runs it with each core, as the caller and as
an unprivileged uid, and compares the reports (step, errno, message), which must also be the
expected ones. The cases include names far past the report's budget, so that a report is cut
(on a character boundary, "..." after the cut) and still arrives as the real step and errno.
A successful launch must go through the same steps (NSBOX_TRACE).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Runner, require

from nsbox.errors import SetupError
from nsbox.sandbox import native
from nsbox.sandbox.child import REPORT_TEXT_MAX, cut_text

# 3,765 bytes of control characters: each takes 6 bytes escaped in a report's JSON.
CONTROL_TARGET = "/" + "/".join(["\x01" * 250] * 15)
# 4,095 bytes, mostly two-byte characters: its step, "file " + it, is over the budget, and the
# budget's last byte is the first of a character, so the cut backs up one byte.
WIDE_TARGET = "/" + "/".join(["\u00e9" * 120] * 16) + "/a" + "\u00e9" * 118 + "b"
assert len(WIDE_TARGET.encode()) == 4095
LONG_TARGET = "/" + "/".join(["x" * 200] * 25)  # over PATH_MAX

SETTLE = "nsbox follows no symlink in a mount target and makes no directory in place of a file"
EXISTS = (" exists and is not a plain file of its own (a directory, a device, a FIFO, a socket "
          "or a hard link): not written")


def mounts(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"mounts": list(entries)}


# (id, kwargs for the run, expected step, errno, message); the message as the Python child
# would write it without a budget (cut_text applies the budget).
CASES: list[tuple[str, dict[str, Any], str, int, str]] = [
    ("control-bytes-target",
     {"binds": [["/etc", CONTROL_TARGET, False], ["/etc/hostname", CONTROL_TARGET, False]]},
     "bind " + CONTROL_TARGET, errno.EISDIR,
     f"mount target {CONTROL_TARGET} is a directory where a file is bound"),
    ("wide-characters-past-the-budget",
     mounts({"kind": "dir", "target": WIDE_TARGET},
            {"kind": "file", "target": WIDE_TARGET, "content": "x"}),
     "file " + WIDE_TARGET, errno.EEXIST, WIDE_TARGET + EXISTS),
    ("target-over-path-max", mounts({"kind": "dir", "target": LONG_TARGET}),
     "dir " + LONG_TARGET, errno.ENAMETOOLONG,
     f"mount target {LONG_TARGET} is longer than PATH_MAX (4096 bytes)"),
    ("symlinked-target",
     mounts({"kind": "symlink", "target": "/lnk", "points_to": "/tmp"},
            {"kind": "dir", "target": "/lnk/sub"}),
     "dir /lnk/sub", errno.ENOTDIR, f"lnk in mount target /lnk/sub is a symlink: {SETTLE}"),
    ("file-in-the-way",
     mounts({"kind": "file", "target": "/f", "content": "x"},
            {"kind": "tmpfs", "target": "/f/sub"}),
     "tmpfs /f/sub", errno.ENOTDIR, f"f in mount target /f/sub is not a directory: {SETTLE}"),
    ("file-bound-on-a-directory", {"binds": [["/etc/hostname", "/usr", False]]},
     "bind /usr", errno.EISDIR, "mount target /usr is a directory where a file is bound"),
    ("missing-source",
     {"binds": [["/etc/hostname", "/etc/hn", False]],
      "wire_changes": {"mounts": {"/etc/hn": {"source": "/etc/no-such-file"}}}},
     "bind /etc/hn", errno.ENOENT,
     "openat2('/etc/no-such-file'): No such file or directory"),
    ("bad-cwd", {"cwd": "/nowhere"}, "working directory", errno.ENOENT,
     "'/nowhere': No such file or directory"),
    ("missing-command", {"argv": ["no-such-command"]}, "exec", errno.ENOENT,
     "command not found inside the sandbox: no-such-command"),
    ("not-executable", {"argv": ["/etc/passwd"]}, "exec", errno.EACCES, "Permission denied"),
    ("hostname-too-long", {"wire_changes": {"hostname": "h" * 65}}, "hostname", errno.EINVAL,
     f"sethostname('{'h' * 65}'): Invalid argument"),
    ("rlimit-soft-over-hard", {"wire_changes": {"rlimits": [[7, 64, 32]]}}, "rlimits", 0,
     "ValueError: current limit exceeds maximum limit"),
]


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    require(native.MISSING == "", native.MISSING or "the native core")
    monkeypatch.delenv("NSBOX_NATIVE", raising=False)
    yield monkeypatch


def failure(monkeypatch: pytest.MonkeyPatch, sandbox: Runner, core: str,
            kwargs: dict[str, Any]) -> tuple[str, int, str]:
    kwargs = dict(kwargs)
    argv = kwargs.pop("argv", ["/bin/true"])
    monkeypatch.setenv("NSBOX_NATIVE", "0" if core == "python" else "1")
    with pytest.raises(SetupError) as caught:
        sandbox.run(argv, **kwargs)
    exc = caught.value
    return exc.step, exc.errno, exc.message


@pytest.mark.parametrize("kwargs, step, err, message",
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_both_cores_report_the_same_failure(both: pytest.MonkeyPatch, sandbox: Runner,
                                            kwargs: dict[str, Any], step: str, err: int,
                                            message: str):
    native_report = failure(both, sandbox, "native", kwargs)
    python_report = failure(both, sandbox, "python", kwargs)
    assert native_report == python_report
    assert native_report == (cut_text(step), err, cut_text(message))


def test_a_cut_report_ends_on_a_character(both: pytest.MonkeyPatch, sandbox: Runner):
    # The step of this case is over the budget: cut after whole characters, then "...".
    _id, kwargs, step, _err, _message = CASES[1]
    got, _errno, _msg = failure(both, sandbox, "native", kwargs)
    assert got.endswith("...") and step.startswith(got[:-3])
    assert len(got[:-3].encode()) == REPORT_TEXT_MAX - 1


def child_steps(result: Any) -> list[str]:
    return [entry["step"] for entry in result.extra["trace"]
            if not entry["step"].startswith(("host:", "helper:"))]


def test_a_launch_goes_through_the_same_steps(both: pytest.MonkeyPatch, sandbox: Runner):
    both.setenv("NSBOX_TRACE", "1")
    steps = {}
    for core in ("native", "python"):
        both.setenv("NSBOX_NATIVE", "0" if core == "python" else "1")
        result = sandbox.run(["/bin/true"])
        assert result.extra["core"] == core
        steps[core] = child_steps(result)
    assert steps["native"] == steps["python"]
    assert steps["native"][:2] == ["wait for id maps", "cgroup namespace"]
    assert steps["native"][-3:] == ["start init", "seccomp", "exec"]
    assert "bind /usr" in steps["native"] and "pivot_root" in steps["native"]
