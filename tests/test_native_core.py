"""The native core's boundaries, through the real extension and the real wire: malformed flat
plans and an unknown FORMAT refused by name, values the C side cannot carry left to the Python
child, messages that do not arrive whole refused with every descriptor closed, and standard
streams that are already 0, 1 or 2 kept open across exec.

The C receivers and writers are also fuzzed under sanitizers (tools/fuzz_native.py, run by
.ci/run); test_fuzz_harness_finds_nothing runs it briefly here.
"""

from __future__ import annotations

import array
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, require

from nsbox._sys import wire as _wire
from nsbox.launch import launcher
from nsbox.policy.policy import Bind, Policy
from nsbox.sandbox import native

MALFORMED = "the native plan is malformed"
UNKNOWN = "the native plan has an unknown version"
# Flags that clone(2) refuses (CLONE_NEWUSER with CLONE_FS): should a bad plan ever be
# accepted, spawn raises OSError instead of starting a sandbox from the test process.
NO_CLONE = 0x10000000 | 0x200


@pytest.fixture
def extension() -> Iterator[object]:
    require(native.MISSING == "", native.MISSING or "the native core")
    from nsbox import _native

    yield _native


def wire_plan(policy: Policy | None = None) -> dict[str, object]:
    plan = launcher.build_plan(policy or Policy(), ["/bin/true"], env=None, cwd=None,
                               wall_time=None)
    return dict(plan.to_wire(), rlimits=[[7, 64, 64], [1, -1, -1]])


def flat(wire: dict[str, object] | None = None) -> tuple[bytes, list[int]]:
    return native.flatten(wire or wire_plan(), [0, 1, 2], 3, 4, {}, -1, None, 40)


def refusal(extension: object, blob: bytes, fds: list[int]) -> str:
    with pytest.raises(ValueError) as caught:
        extension.spawn(blob, fds, [], NO_CLONE, -1)  # type: ignore[attr-defined]
    return str(caught.value)


def test_a_real_plan_parses(extension: object):
    # The control: the same call with the plan intact gets past the parser to the clone.
    blob, fds = flat()
    with pytest.raises(OSError):
        extension.spawn(blob, fds, [], NO_CLONE, -1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("change", [
    "empty", "garbage", "cut short", "one byte more", "a string's length past the end",
    "a tag changed",
])
def test_malformed_plans_are_refused(extension: object, change: str):
    blob, fds = flat()
    bad = {
        "empty": b"",
        "garbage": b"not a plan",
        "cut short": blob[:-1],
        "one byte more": blob + b"\0",
        # The first string item (the process name): its length now runs past the blob.
        "a string's length past the end": blob.replace(b"s\0\0\0\0\0", b"s\xff\xff\xff\x7f\0", 1),
        "a tag changed": blob[:9] + b"s" + blob[10:],
    }[change]
    assert refusal(extension, bad, fds) == MALFORMED


def test_an_unknown_format_is_refused(extension: object):
    blob, fds = flat()
    other = (native.FORMAT + 1).to_bytes(8, "little", signed=True)
    assert refusal(extension, b"i" + other + blob[9:], fds) == UNKNOWN


@pytest.mark.parametrize("field, value", [
    ("kind", 2**32 + 1),  # would have narrowed to 1, a bind
    ("uid", 2**31), ("uid", -1), ("mode", 0o10000), ("proxy_port", 65536),
    ("rlimit", -2), ("descriptor index", -2), ("descriptor index", 5),
])
def test_values_out_of_range_make_the_plan_malformed(extension: object,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     field: str, value: int):
    wire = wire_plan(Policy(mounts=(*Policy().mounts, Bind("/etc/hostname", "/etc/hn"))))
    # Written past flatten's own checks (which send such a plan to the Python child), as a
    # broken or hostile writer would.
    monkeypatch.setattr(native.Writer, "put_in", lambda self, v, low, high: self.put_int(v))
    if field == "kind":
        monkeypatch.setitem(native.KINDS, "bind", value)
    elif field == "uid":
        wire["uid"] = value
    elif field == "mode":
        wire["mounts"] = [dict(op, mode=value) if op["op"] == "tmpfs" else op
                          for op in wire["mounts"]]  # type: ignore[attr-defined]
    elif field == "proxy_port":
        wire["net"] = {"mode": "none", "proxy_port": value}
    elif field == "rlimit":
        wire["rlimits"] = [[7, value, 64]]
    blob, fds = flat(wire)
    if field == "descriptor index":  # the notify descriptor's index: -1 or one of the list
        index = b"i" + (-1).to_bytes(8, "little", signed=True)
        at = blob.index(index, 9 * 6)
        blob = blob[:at] + b"i" + value.to_bytes(8, "little", signed=True) + blob[at + 9:]
    assert refusal(extension, blob, fds) == MALFORMED


def test_a_descriptor_that_is_no_int_is_refused(extension: object):
    blob, fds = flat()
    with pytest.raises(ValueError, match="is not a file descriptor"):
        extension.spawn(blob, [*fds[:-1], 2**40], [], NO_CLONE, -1)  # type: ignore[attr-defined]


def test_flatten_leaves_what_the_c_side_cannot_carry_to_the_python_child():
    for changes in ({"uid": 2**31}, {"rlimits": [[7, -2, 64]]},
                    {"net": {"mode": "none", "proxy_port": 70000}}):
        with pytest.raises(OverflowError):
            flat({**wire_plan(), **changes})


# --- messages that do not arrive whole ------------------------------------------------------

def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def send(sock: socket.socket, data: bytes, groups: list[list[int]]) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", group))
                          for group in groups])


@pytest.mark.parametrize("data, groups, bufsize, maxfds, whole", [
    (b"x" * 100, [], 10, 1, False),            # MSG_TRUNC
    (b"x", [[0, 0, 0]], 10, 1, False),         # MSG_CTRUNC: no room for three
    (b"x", [[0, 0]], 10, 1, False),            # two where one was asked for (rounding)
    (b"x", [[0], [0]], 10, 2, True),           # two SCM_RIGHTS messages, both taken
    (b"x", [[0], [0, 0]], 10, 2, False),       # ... one too many across the two
    (b"x", [[0, 0]], 10, 2, True),
])
def test_a_message_is_taken_whole_or_not_at_all(data: bytes, groups: list[list[int]],
                                                 bufsize: int, maxfds: int, whole: bool):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        before = open_fds()
        send(theirs, data, groups)
        if whole:
            msg, fds = _wire.receive_fds(ours, bufsize, maxfds)
            assert msg == data and len(fds) == sum(map(len, groups))
            for fd in fds:
                os.close(fd)
        else:
            with pytest.raises(_wire.CutMessage, match="did not arrive whole"):
                _wire.receive_fds(ours, bufsize, maxfds)
        assert open_fds() == before  # nothing that came stays open


def test_a_memfd_shorter_than_announced_is_an_error():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("short", os.MFD_CLOEXEC)
    with ours, theirs:
        os.write(fd, b"x" * 10)
        send(theirs, b'{"memfd": 100}', [[fd]])
        os.close(fd)
        before = open_fds()
        with pytest.raises(ValueError, match="shorter than announced"):
            _wire.receive(ours, 0)
        assert open_fds() == before


# --- standard streams that are already 0, 1 or 2 --------------------------------------------

TAKE_STREAMS = r"""
import fcntl, os, sys
from nsbox.sandbox.child import take_streams
def at(fd):  # /dev/null close-on-exec at exactly fd, as a received descriptor arrives
    new = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    if new != fd:
        os.dup2(new, fd, inheritable=False)
        os.close(new)
    return fd
high, other = at(20), at(21)
case = sys.argv[1]
fds = {"own": [at(0), at(1), at(2)], "shared": [high, other, other],
       "crossed": [high, at(0), other]}[case]
take_streams(fds)
bad = [fd for fd in (0, 1, 2) if fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC]
left = [fd for fd in fds if fd > 2 and fd in map(int, os.listdir("/proc/self/fd"))]
with open(sys.argv[2], "w") as out:  # the standard streams are /dev/null now
    out.write(f"{bad} {left}")
"""


@pytest.mark.parametrize("case", ["own", "shared", "crossed"])
def test_streams_stay_open_across_exec(case: str, tmp_path: Path):
    # dup2 of a descriptor onto itself does nothing: it stayed close-on-exec. (The C twin,
    # nsbox/native/child.c, take_streams, is checked by the fuzz harness.)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", TAKE_STREAMS, case, str(out)],
                          capture_output=True, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "[] []"


# --- the C side under sanitizers ------------------------------------------------------------

def test_fuzz_harness_finds_nothing():
    require(shutil.which("gcc") is not None, "gcc, for the sanitizer build")
    proc = subprocess.run([sys.executable, str(REPO / "tools/fuzz_native.py"), "--cases",
                           "1000", "--seed", "7"], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"no finding" in proc.stdout


def test_the_seed_corpus_is_real_plans(extension: object):
    # tools/fuzz_native.py starts from plans flatten makes: each parses as the extension sees it.
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import fuzz_native
    finally:
        sys.path.pop(0)
    for policy, argv, extra in fuzz_native.seed_policies():
        plan = launcher.build_plan(policy, argv, env=extra.get("env"), cwd=extra.get("cwd"),
                                   wall_time=None)
        blob, fds = flat(dict(plan.to_wire(), rlimits=[]))
        with pytest.raises(OSError):
            extension.spawn(blob, fds, [], NO_CLONE, -1)  # type: ignore[attr-defined]
