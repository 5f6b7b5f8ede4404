"""Property tests: any arguments to nsbox.run, Policy, Session, Pool, any mutation of a shipped
profile and any `nsbox run` argument list end in a result or a documented nsbox error; never
another exception, a hang (hypothesis' per-case deadline) or a dead helper or session.

Seeded, a few hundred cases each; the ``slow`` variants run ten times as many, and only when
NSBOX_SLOW_FUZZ=1 is set (minutes each: too long for every CI run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import nsbox
from nsbox.errors import NsboxError, PolicyError
from nsbox.launch import launcher
from nsbox.policy.policy import Limits, Policy
from nsbox.result import Status

SEED = 20261201
slow_fuzz = pytest.mark.skipif(os.environ.get("NSBOX_SLOW_FUZZ") != "1",
                               reason="the long fuzz runs need NSBOX_SLOW_FUZZ=1")
CASES = 200
SLOW_CASES = 2000


def _settings(cases: int) -> Any:
    return settings(max_examples=cases, deadline=timedelta(seconds=20), database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


# --- values of every kind, right and wrong ---------------------------------------------------

_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 4095, 4096, 2**31, 2**63 - 1, 2**63, 2**64, 2_200_000, 3e6,
                     1e10, 0.001, -1]),
)
_junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=8), st.binary(max_size=8),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                         st.integers(), max_size=2),
)
_anything = st.one_of(_numbers, _junk)
_good_argv = st.sampled_from([["true"], ["echo", "hi"], ["sh", "-c", "exit 3"],
                              ["/nonexistent"]])
_argv = st.one_of(_good_argv, st.text(max_size=12), st.lists(_junk, max_size=3), _junk,
                  st.lists(st.text(max_size=5), max_size=3))
_env = st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                            max_size=3),
                 st.dictionaries(st.one_of(st.text(max_size=3), st.binary(max_size=3)),
                                 _anything, max_size=2), _junk)
_stdin = st.one_of(st.none(), st.binary(max_size=16), st.text(max_size=8),
                   st.sampled_from([-1, 9999, 0, 1.5, 2**40]), _junk)
_timeout = st.one_of(st.none(), st.sampled_from([5.0, 30, 2_200_000]), _anything)
_cwd = st.one_of(st.none(), st.sampled_from(["/tmp", "/nope", "relative", "/"]), _junk)


def _mostly(good: Any, bad: Any) -> Any:
    """``good`` two times in three, ``bad`` otherwise (one_of would weigh by its branches)."""
    return st.integers(0, 2).flatmap(lambda i: good if i else bad)


_VALID = {
    "stdin": st.one_of(st.none(), st.binary(max_size=16), st.text(max_size=8)),
    "timeout": st.one_of(st.none(), st.floats(0.5, 2_200_000), st.integers(1, 30)),
    "output_limit": st.one_of(st.none(), st.integers(0, 2**62)),
    "env": st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,5}", fullmatch=True),
                           st.text(alphabet=st.characters(blacklist_characters="\0"),
                                   max_size=5), max_size=3),
    "cwd": st.sampled_from([None, "/tmp", "/workspace"]),
    "passthrough": st.just(False),
}
_INVALID = {"stdin": _stdin, "timeout": _timeout, "output_limit": _anything, "env": _env,
            "cwd": _cwd, "passthrough": _junk}


@st.composite
def _run_args(draw: Any) -> dict[str, Any]:
    """Up to three arguments, each valid two times in three, so that many cases run."""
    names = draw(st.lists(st.sampled_from(sorted(_VALID)), max_size=3, unique=True))
    return {name: draw(_mostly(_VALID[name], _INVALID[name])) for name in names}


def _outcome(call: Any) -> Any:
    """The call's Result or nsbox error; anything else fails the test."""
    try:
        return call()
    except NsboxError as exc:
        assert str(exc)
        assert len(str(exc)) < 2000, "an error message must not echo a large value"
        return exc


def _check_run(argv: Any, kwargs: dict[str, Any]) -> None:
    outcome = _outcome(lambda: nsbox.run(argv, **kwargs))
    if isinstance(outcome, nsbox.Result):
        # Whatever else was asked, the command was one of the harmless ones and ran as such.
        allowed = {Status.OK, Status.RE}
        if kwargs.get("timeout") is not None:
            allowed.add(Status.TO)  # a drawn timeout of a few ms can end even `true`
        if kwargs.get("output_limit") is not None:
            allowed.add(Status.OL)  # "hi\n" is over a cap of 0, 1 or 2 bytes
        assert outcome.status in allowed, outcome
        timeout = kwargs.get("timeout")
        assert timeout is None or (isinstance(timeout, (int, float)) and not
                                   isinstance(timeout, bool) and 0 < timeout < math.inf)


def _run_property(cases: int) -> None:
    nsbox.run(["true"])
    helper = launcher.helper_client.pid

    @seed(SEED)
    @_settings(cases)
    @given(argv=_mostly(_good_argv, _argv), kwargs=_run_args())
    def prop(argv: Any, kwargs: dict[str, Any]) -> None:
        _check_run(argv, kwargs)

    prop()
    assert launcher.helper_client.pid == helper


def test_run_arguments():
    _run_property(CASES)


@pytest.mark.slow
@slow_fuzz
def test_run_arguments_slow():
    _run_property(SLOW_CASES)


# --- Policy and Limits: checked on construction; a plan is built from what passes ------------

_limit_fields = ("wall_time", "output", "memory", "pids", "cpus", "cpu_time", "open_files",
                 "file_size", "tmp_size", "workspace_size", "shm_size", "require_cgroup")
_policy_fields = ("mounts", "env", "env_passthrough", "path", "lang", "uid", "gid", "user",
                  "hostname", "host_uid", "host_gid", "workspace", "limits")


def _policy_property(cases: int) -> None:
    from nsbox.plan import plan as planmod

    sizes = st.integers(1, 2**63 - 1)
    valid_limits = {
        "wall_time": st.one_of(st.none(), st.floats(0.001, 365 * 24 * 3600.0)),
        "output": st.integers(0, 2**63 - 1), "memory": st.one_of(st.none(),
                                                                st.integers(4096, 2**63 - 1)),
        "pids": st.one_of(st.none(), st.integers(1, 2**31 - 1)),
        "cpus": st.one_of(st.none(), st.floats(0.01, 64)),
        "cpu_time": st.one_of(st.none(), st.floats(0.001, 3600)),
        "open_files": st.integers(1, 2**31 - 1), "file_size": st.one_of(st.none(), sizes),
        "tmp_size": sizes, "workspace_size": sizes, "shm_size": sizes,
        "require_cgroup": st.just(False),
    }

    @st.composite
    def limit_changes(draw: Any) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(_limit_fields), max_size=3, unique=True))
        return {name: draw(_mostly(valid_limits[name], _anything)) for name in names}

    @seed(SEED)
    @_settings(cases)
    @given(limits=limit_changes(),
           fields=st.dictionaries(st.sampled_from(_policy_fields), _anything, max_size=1))
    def prop(limits: dict[str, Any], fields: dict[str, Any]) -> None:
        def build() -> Any:
            policy = Policy(**fields).with_limits(**limits)
            return planmod.build(policy, ["true"])

        plan = _outcome(build)
        if not isinstance(plan, NsboxError):
            # What passed is what the plan says: no limit was dropped or wrapped.
            if limits.get("memory") is not None:
                assert plan.cgroup["memory"] == limits["memory"] < 2**63
            wall = limits.get("wall_time", Limits().wall_time)
            assert plan.wall_time == wall
            assert wall is None or 0 < wall < math.inf

    prop()


def test_policy_values():
    _policy_property(CASES)


@pytest.mark.slow
@slow_fuzz
def test_policy_values_slow():
    _policy_property(SLOW_CASES)


# --- Session and Pool: a bad per-command value fails that command, never the sandbox ---------


def _session_property(cases: int) -> None:
    with nsbox.Session(timeout=30) as session:
        session.write_file("keep.txt", "kept")

        @seed(SEED)
        @_settings(cases)
        @given(argv=_mostly(_good_argv, _argv), kwargs=_run_args())
        def prop(argv: Any, kwargs: dict[str, Any]) -> None:
            _outcome(lambda: session.run(argv, **kwargs))
            assert session.alive

        prop()
        assert session.read_file("keep.txt") == b"kept"


def test_session_command_arguments():
    _session_property(CASES)


@pytest.mark.slow
@slow_fuzz
def test_session_command_arguments_slow():
    _session_property(SLOW_CASES)


def test_session_and_pool_constructor_arguments():
    @seed(SEED)
    @_settings(CASES)
    @given(kwargs=st.fixed_dictionaries({}, optional={
        "timeout": _anything, "idle_timeout": _anything, "output_limit": _anything,
        "env": _env, "workspace": _junk, "inputs": _junk, "policy": _junk}),
        size=_anything)
    def prop(kwargs: dict[str, Any], size: Any) -> None:
        session = _outcome(lambda: nsbox.Session(**kwargs))
        if isinstance(session, nsbox.Session):
            with session:
                assert _outcome(lambda: session.run(["true"])).status is Status.OK
        if isinstance(size, int) and not isinstance(size, bool) and size > 4:
            size = 4  # a valid size: a few sandboxes, not thousands
        pool = _outcome(lambda: nsbox.Pool(size=size))
        if isinstance(pool, nsbox.Pool):
            with pool:
                assert _outcome(lambda: pool.run(["true"])).status is Status.OK

    prop()


def test_pool_command_arguments():
    with nsbox.Pool(size=2) as pool:
        @seed(SEED)
        @_settings(CASES)
        @given(argv=_mostly(_good_argv, _argv), kwargs=_run_args())
        def prop(argv: Any, kwargs: dict[str, Any]) -> None:
            _outcome(lambda: pool.run(argv, **kwargs))

        prop()
        assert pool.run(["echo", "still"]).stdout == b"still\n"


# --- profiles: mutations of the shipped ones --------------------------------------------------

_SHIPPED = sorted((Path(nsbox.__file__).parent / "profiles").glob("*.toml"))
_TOML_VALUES = ["0", "-1", "1e400", "nan", "inf", '"16777216T"', '"10"', '"720h"', "true",
                "[]", "{}", '"x"', "[[[[[[[[]]]]]]]]", "[" * 200 + "]" * 200, '"/dev/zero"',
                '"/proc/1/root"', "2200000", "18446744073709551616", '"0"', '"none"']


def _mutate(text: str, data: Any) -> str:
    lines = text.splitlines()
    for kind, index, value in data:
        if not lines:
            break
        i = index % len(lines)
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "value" and "=" in lines[i]:
            lines[i] = lines[i].split("=", 1)[0] + "= " + value
        elif kind == "insert":
            lines.insert(i, value)
        elif kind == "cut":
            lines[i] = lines[i][: len(lines[i]) // 2]
    return "\n".join(lines) + "\n"


def _profile_property(cases: int, tmp: Path) -> None:
    from nsbox.plan import plan as planmod
    from nsbox.profiles import load_profile

    mutation = st.tuples(st.sampled_from(["delete", "duplicate", "value", "insert", "cut"]),
                         st.integers(0, 200),
                         st.one_of(st.sampled_from(_TOML_VALUES),
                                   st.sampled_from(["extends = \"default\"",
                                                    "extends = \"/dev/zero\"",
                                                    "[limits]", "memory = 10",
                                                    "tmp_size = \"16777216T\"",
                                                    "wall_time = \"720h\""]),
                                   st.text(max_size=20)))

    @seed(SEED)
    @_settings(cases)
    @given(shipped=st.sampled_from(_SHIPPED), mutations=st.lists(mutation, min_size=1,
                                                                 max_size=4))
    def prop(shipped: Path, mutations: list[Any]) -> None:
        path = tmp / "mutated.toml"
        path.write_text(_mutate(shipped.read_text(), mutations))

        def load() -> Any:
            return planmod.build(load_profile(str(path)), ["true"])

        plan = _outcome(load)
        if not isinstance(plan, NsboxError):
            for op in plan.mounts:
                if op["op"] == "tmpfs":
                    assert 0 < op["size"] < 2**63
            memory = plan.cgroup["memory"]
            assert memory is None or 4096 <= memory < 2**63

    prop()


def test_profile_mutations(tmp_path: Path):
    _profile_property(CASES, tmp_path)


@pytest.mark.slow
@slow_fuzz
def test_profile_mutations_slow(tmp_path: Path):
    _profile_property(SLOW_CASES, tmp_path)


# --- nsbox run argument lists, in one worker process that parses like the command line ---------

WORKER = """
import json, os, sys
from click.testing import CliRunner
from nsbox.cli import commands as cli
requests, replies = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
runner = CliRunner()
for line in requests:
    args = json.loads(line)
    result = runner.invoke(cli.main, ["run", *args], catch_exceptions=True)
    exc = result.exception
    raw = None if exc is None or isinstance(exc, SystemExit) else repr(exc)[:500]
    replies.write(json.dumps({"code": result.exit_code, "raw": raw,
                              "output": result.output[-2000:]}) + "\\n")
    replies.flush()
"""

_OPTIONS = {
    "--time": ["1", "0", "-1", "nan", "inf", "2200000", "1" * 400, "10s", "abc", "5m"],
    "--memory": ["10", "64M", "16777216T", "0", "1" * 400, "1.5G", "-5"],
    "--output-limit": ["0", "-1", "1K", "16777216T", "x"],
    "--pids": ["0", "64", "1e3", "-1", "99999999999999999999"],
    "--cpus": ["0.5", "nan", "inf", "0", "1e400"],
    "--cpu-time": ["1", "nan", "0"],
    "--tmp-size": ["16777216T", "64M", "0", "10"],
    "--set": ["limits.tmp_size=16777216T", "limits.wall_time=\"720h\"", "limits.memory=10",
              "hostname=" + "x" * 300, "nope=1", "limits.cpu_time=\"none\"", "=", "a"],
    "--env": ["A=b", "=x", "A", "B=" + "y" * 1000],
    "--cwd": ["/nope", "/tmp", "relative"],
    "--profile": ["default", "python", "/dev/zero", "/nonexistent", "nosuch"],
    "--net": ["none", "loopback", "bogus"],
    "--audit": ["/dev/full", "/dev/null"],
    "--workspace": ["/nonexistent-dir", "/dev/null"],
}
_COMMANDS = [["--", "true"], ["--", "echo", "hi"], ["--", "sh", "-c", "exit 3"],
             ["--", "/nonexistent"], []]
# The exit codes of nsbox run (nsbox/cli/run.py): the command's own, 2 for a usage error, 123-127.
_CODES = {0, 1, 2, 3, 123, 124, 125, 126, 127}


@pytest.fixture(scope="module")
def cli_worker() -> Any:
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(requests_r), str(replies_w)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        pass_fds=(requests_r, replies_w))
    os.close(requests_r)
    os.close(replies_w)
    send, receive = os.fdopen(requests_w, "w"), os.fdopen(replies_r, "r")

    def call(args: list[str]) -> dict[str, Any]:
        send.write(json.dumps(args) + "\n")
        send.flush()
        line = receive.readline()
        assert line, f"the worker died: {proc.stderr.read().decode() if proc.stderr else ''}"
        return json.loads(line)

    yield call
    send.close()
    proc.wait(30)
    receive.close()


def _cli_property(cases: int, call: Any) -> None:
    option = st.sampled_from(sorted(_OPTIONS)).flatmap(
        lambda name: st.tuples(st.just(name), st.sampled_from(_OPTIONS[name])))

    @seed(SEED)
    @_settings(cases)
    @given(options=st.lists(option, max_size=3), command=st.sampled_from(_COMMANDS))
    def prop(options: list[tuple[str, str]], command: list[str]) -> None:
        args = [part for pair in options for part in pair] + command
        reply = call(args)
        assert reply["raw"] is None, (args, reply)
        assert "Traceback" not in reply["output"], (args, reply["output"])
        assert reply["code"] in _CODES, (args, reply)

    prop()


def test_cli_argument_lists(cli_worker: Any):
    _cli_property(CASES, cli_worker)


@pytest.mark.slow
@slow_fuzz
def test_cli_argument_lists_slow(cli_worker: Any):
    _cli_property(SLOW_CASES, cli_worker)


def test_property_tests_see_errors():
    # The properties accept nsbox errors only: a bad value gives one, a raw exception passes.
    assert isinstance(_outcome(lambda: nsbox.run(["true"], timeout=float("nan"))), PolicyError)
    with pytest.raises(TypeError):
        _outcome(lambda: (_ for _ in ()).throw(TypeError("raw")))
