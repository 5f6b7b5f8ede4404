"""A malformed message from the host fails that one launch, never the launch helper's loop.

Each test starts a helper of its own (nsbox/launch/launcher.py, _HelperClient), sends it a message
that is not JSON where a request belongs, checks what the launch concerned gets, and then runs
a real sandbox through the same helper. The request on a launch's socket is read by one parser,
the helper's and a session's init's (``wire.kill_reason``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nsbox._sys import wire as _wire
from nsbox.launch import launcher
from nsbox.policy.policy import Policy
from nsbox.result import Status


@pytest.fixture
def helper() -> Iterator[launcher._HelperClient]:
    client = launcher._HelperClient()
    client.send_request({"ping": True}, [])  # starts it; a request without streams is dropped
    yield client
    client.stop()


def wire(argv: list[str]) -> dict[str, object]:
    policy = Policy()
    plan = launcher.build_plan(policy, argv, env=None, cwd=None, wall_time=None)
    return dict(plan.to_wire(), host_uid=policy.host_uid, host_gid=policy.host_gid)


def still_serves(helper: launcher._HelperClient) -> None:
    result = launcher.launch_wire(wire(["/bin/echo", "still here"]), None, 1 << 20, False,
                              submit=helper.submit)
    assert (result.status, result.stdout) == (Status.OK, b"still here\n")


def streams() -> list[int]:
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    return [null, os.dup(null), os.dup(null)]


def messages(sock: socket.socket) -> list[dict[str, object]]:
    sock.settimeout(30)
    out = []
    while data := sock.recv(65536):
        out.append(json.loads(data))
    return out


@pytest.mark.parametrize("request_bytes", [b"\xff not json", b"[1, 2]", b'"plan"'])
def test_a_malformed_request_fails_its_launch_alone(helper: launcher._HelperClient,
                                                    request_bytes: bytes):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = streams()
    assert helper._sock is not None
    _wire.send_bytes(helper._sock, request_bytes, [theirs.fileno(), *fds])
    theirs.close()
    for fd in fds:
        os.close(fd)
    with ours:
        (report,) = messages(ours)
    error = report["setup_error"]
    assert report["event"] == "exit" and error["step"] == "helper"  # type: ignore[index]
    assert "malformed message from the host" in error["message"]  # type: ignore[index]
    still_serves(helper)


def test_a_malformed_message_on_a_launch_socket_fails_that_launch(
        helper: launcher._HelperClient):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = streams()
    assert helper._sock is not None
    _wire.send(helper._sock, {"plan": wire(["/bin/sleep", "60"])}, [theirs.fileno(), *fds])
    theirs.close()
    for fd in fds:
        os.close(fd)
    with ours:
        ours.settimeout(30)
        pid_event, fds_in = _wire.receive_fds(ours, 65536, 1)
        for fd in fds_in:
            os.close(fd)
        assert json.loads(pid_event)["event"] == "pid"
        ours.send(b"{not json")
        (report,) = messages(ours)
    assert report["event"] == "exit"
    error = report["setup_error"]
    assert error["step"] == "request", report  # type: ignore[index]
    assert "malformed message from the host" in error["message"]  # type: ignore[index]
    assert report["kill_reason"] == "setup failed"  # the sandbox was stopped, not left
    still_serves(helper)


@pytest.mark.parametrize(("data", "reason"), [
    (b'{"cmd": "kill", "reason": "output"}', "output"), (b'{"cmd": "kill"}', "killed"),
    (b'{"cmd": "other"}', None), (b"{}", None)])
def test_the_request_reader_takes_a_kill_and_passes_others_by(data: bytes, reason: str | None):
    assert _wire.kill_reason(data) == reason


@pytest.mark.parametrize("data", [b"\xff not json", b"[1, 2]", b'"kill"', b"null", b"{"])
def test_the_request_reader_refuses_what_is_no_json_object(data: bytes):
    with pytest.raises(ValueError):
        _wire.kill_reason(data)


@settings(max_examples=300, database=None)
@given(st.one_of(st.binary(max_size=64),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda inner: st.lists(inner, max_size=3)
                              | st.dictionaries(st.sampled_from(["cmd", "reason", "x"]), inner,
                                                max_size=3),
                              max_leaves=6).map(lambda v: json.dumps(v).encode())))
def test_the_request_reader_answers_any_bytes_with_a_reason_none_or_value_error(data: bytes):
    try:
        reason = _wire.kill_reason(data)
    except ValueError:
        return
    assert reason is None or isinstance(reason, str)

