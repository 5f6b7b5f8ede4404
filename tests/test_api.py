"""The Python API as subprocess users expect it: input, text, check, capture_output, returncode,
FileNotFoundError for a missing program or file, and the asyncio API, whose cancellation kills
the sandbox (checked from the host: no process left, no cgroup left).

Each test runs a short script as this process's user and as an unprivileged uid
(tests/sessiontools.py), against real sandboxes.
"""

from __future__ import annotations

import inspect
import pydoc
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON
from sessiontools import UserRunner, user_runner

import nsbox


@pytest.fixture(params=["caller", "unprivileged"])
def user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def test_input_text_and_returncode_in_run_session_and_pool(user: UserRunner) -> None:
    out = user.script("""
r = nsbox.run(["sh", "-c", "tr a-z A-Z; exit 3"], input="hello", text=True)
b = nsbox.run(["cat"], input=b"\\xff\\xfe", text=False)
k = nsbox.run(["sh", "-c", "kill -TERM $$"])
with nsbox.Session() as s:
    sr = s.run(["cat"], input="session", text=True, check=True)
with nsbox.Pool(size=1) as p:
    pr = p.run(["cat"], input=b"pool", text=True, check=True)
emit(stdout=r.stdout, code=r.returncode, status=r.status.value, kind=type(r.stdout).__name__,
     raw=list(b.stdout), signal_code=k.returncode, session=sr.stdout, pool=pr.stdout,
     bad=nsbox.run(["printf", "\\\\377ok"], text=True).stdout)
""")
    assert out["stdout"] == "HELLO" and out["kind"] == "str"
    assert out["code"] == 3 and out["status"] == "RE"
    assert out["raw"] == [0xFF, 0xFE]
    assert out["signal_code"] == -15
    assert out["session"] == "session" and out["pool"] == "pool"
    assert out["bad"] == "\ufffdok"  # the sandbox's bytes never lose the Result


def test_check_raises_a_called_process_error_that_carries_the_result(user: UserRunner) -> None:
    out = user.script("""
import subprocess
caught = {}
for name, call in [
        ("run", lambda: nsbox.run(["sh", "-c", "echo partial; exit 4"], check=True, text=True)),
        ("timeout", lambda: nsbox.run(["sleep", "30"], timeout=0.5, check=True)),
        ("session", lambda: nsbox.Session().run(["false"], check=True))]:
    try:
        call()
    except subprocess.TimeoutExpired as exc:
        caught[name] = ["TimeoutExpired", type(exc).__name__, exc.result.status.value,
                        exc.timeout, isinstance(exc, nsbox.NsboxError)]
    except subprocess.CalledProcessError as exc:
        caught[name] = ["CalledProcessError", type(exc).__name__, exc.returncode, repr(exc.stdout),
                        exc.result.status.value, str(exc)]
emit(**caught)
""")
    assert out["run"] == ["CalledProcessError", "CommandFailed", 4, "'partial\\n'", "RE",
                          "command ['sh', '-c', 'echo partial; exit 4'] ended with status RE "
                          "(exit status 4)"]
    assert out["timeout"] == ["TimeoutExpired", "CommandTimedOut", "TO", 0.5, True]
    assert out["session"][:3] == ["CalledProcessError", "CommandFailed", 1]


def test_a_missing_program_or_file_is_a_file_not_found_error(user: UserRunner) -> None:
    out = user.script("""
got = {}
try:
    nsbox.run(["no-such-program"])
except FileNotFoundError as exc:
    got["program"] = [type(exc).__name__, exc.errno, exc.step]
try:
    nsbox.run(["/etc/passwd"])
except PermissionError as exc:
    got["not_executable"] = [type(exc).__name__, exc.errno]
with nsbox.Session() as s:
    try:
        s.run(["no-such-program"])
    except FileNotFoundError as exc:
        got["session_program"] = type(exc).__name__
    try:
        s.read_file("missing.txt")
    except FileNotFoundError as exc:
        got["file"] = [type(exc).__name__, exc.filename, isinstance(exc, nsbox.FileTransferError)]
emit(**got)
""")
    assert out["program"] == ["CommandNotFound", 2, "exec"]
    assert out["not_executable"] == ["CommandNotExecutable", 13]
    assert out["session_program"] == "CommandNotFound"
    assert out["file"] == ["SandboxFileNotFound", "missing.txt", True]


@pytest.mark.parametrize(("kwargs", "key", "text"), [
    ({"input": 5}, "input", "expected bytes or str, got int 5"),
    ({"input": b"a", "stdin": b"b"}, "input", "give input or stdin, not both"),
    ({"text": "yes"}, "text", "expected True or False"),
    ({"check": 1}, "check", "expected True or False"),
    ({"encoding": "latin-1"}, "encoding", "encoding applies to text output"),
    ({"text": True, "encoding": "no-such-codec"}, "encoding", "unknown encoding"),
    ({"text": True, "errors": "sloppy"}, "errors", "unknown errors"),
    ({"capture_output": "no"}, "capture_output", "expected True or False"),
    ({"capture_output": True, "passthrough": True}, "capture_output", "contradict"),
    # A codec that is not a text encoding, a handler that cannot decode: refused at the door,
    # not a LookupError or TypeError after the command ran.
    ({"text": True, "encoding": "rot13"}, "encoding", "not a text encoding"),
    ({"text": True, "encoding": "base64"}, "encoding", "not a text encoding"),
    ({"text": True, "encoding": "hex"}, "encoding", "not a text encoding"),
    ({"text": True, "errors": "namereplace"}, "errors", "cannot decode"),
    ({"text": True, "errors": "xmlcharrefreplace"}, "errors", "cannot decode"),
    # A lone surrogate is no byte: a PolicyError, not a UnicodeEncodeError.
    ({"input": "\ud800"}, "input", "lone surrogate"),
    ({"stdin": "a\udfff"}, "stdin", "lone surrogate"),
])
def test_bad_subprocess_arguments_are_one_line_errors(kwargs: dict[str, object], key: str,
                                                       text: str) -> None:
    for call in (lambda: nsbox.run(["true"], **kwargs),  # type: ignore[call-overload]
                 lambda: nsbox.Pool(size=1).run(["true"], **kwargs)):  # type: ignore[call-overload]
        with pytest.raises(nsbox.PolicyError) as caught:
            call()
        assert caught.value.key == key and text in str(caught.value)
        assert "\n" not in caught.value.message


@pytest.mark.parametrize(("argv", "kwargs", "key"), [
    (["echo", "\ud800"], {}, "argv[1]"),
    (["\ud800"], {}, "argv[0]"),
    (["true"], {"env": {"A": "\ud800"}}, "env['A']"),
    (["true"], {"env": {"\ud800": "x"}}, "env name"),
    (["pwd"], {"cwd": "/\ud800"}, "cwd"),
])
def test_a_lone_surrogate_is_refused_at_the_door(argv: list[str], kwargs: dict[str, object],
                                                 key: str) -> None:
    """Before anything is built (not a SetupError of the sandbox's exec step)."""
    calls = [lambda: nsbox.run(argv, **kwargs),  # type: ignore[arg-type]
             lambda: nsbox.Pool(size=1).run(argv, **kwargs)]  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(nsbox.PolicyError) as caught:
            call()
        assert caught.value.key == key and "lone surrogate" in str(caught.value)
    for where in ("workspace", "audit", "profile"):
        with pytest.raises(nsbox.PolicyError) as caught:
            nsbox.run(["true"], **{where: "/tmp/\ud800"})  # type: ignore[call-overload]
        assert caught.value.key == where


def test_surrogate_escapes_are_the_bytes_they_stand_for() -> None:
    """"\\udcff" (os.fsdecode's way of writing the byte 0xff) is the byte, in input as in argv."""
    assert nsbox.run(["cat"], input="a\udcffb").stdout == b"a\xffb"
    assert nsbox.run(["cat"], stdin="\udc80").stdout == b"\x80"
    assert nsbox.run(["printf", "%s", "\udcfe"]).stdout == b"\xfe"


def test_output_that_does_not_decode_strictly_keeps_the_result() -> None:
    """errors="strict" and output that is not UTF-8: an OutputDecodeError (also a
    UnicodeDecodeError) that holds the whole Result, not a raw error that loses it."""
    argv = ["sh", "-c", "printf 'ok\\377'; echo err >&2; exit 3"]
    with nsbox.Pool(size=1) as pool, nsbox.Session() as session:
        for run in (nsbox.run, pool.run, session.run):
            with pytest.raises(nsbox.OutputDecodeError) as caught:
                run(argv, text=True, errors="strict")  # type: ignore[operator]
            error = caught.value
            assert isinstance(error, UnicodeDecodeError) and isinstance(error, nsbox.NsboxError)
            assert (error.stream, error.start, error.encoding) == ("stdout", 2, "utf-8")
            assert (error.result.stdout, error.result.stderr) == (b"ok\xff", b"err\n")
            assert (error.result.status, error.result.returncode) == (nsbox.Status.RE, 3)
            assert ".result" in str(error)
    with pytest.raises(nsbox.OutputDecodeError) as caught:
        nsbox.run(["sh", "-c", "printf 'a\\377' >&2"], text=True, errors="strict")
    assert caught.value.stream == "stderr" and caught.value.result.stdout == b""
    assert nsbox.run(["printf", "\\377"], text=True).stdout == "\ufffd"  # the default


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "5", True, 10**9])
def test_pool_wait_ready_checks_its_timeout(timeout: object) -> None:
    with nsbox.Pool(size=1) as pool:
        with pytest.raises(nsbox.PolicyError) as caught:
            pool.wait_ready(timeout)  # type: ignore[arg-type]
        assert caught.value.key == "timeout"
        pool.wait_ready(30)
        pool.wait_ready(None)


def test_capture_output_false_sends_the_output_to_this_process(public_tree: Path) -> None:
    code = (f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox; "
            "r = nsbox.run(['echo', 'through'], capture_output=False); "
            "c = nsbox.run(['echo', 'kept'], capture_output=True); "
            "print('captured', repr(r.stdout), repr(c.stdout))")
    proc = subprocess.run([PYTHON, "-I", "-c", code], capture_output=True, timeout=60)
    assert proc.stdout.decode().splitlines() == ["through", "captured b'' b'kept\\n'"], proc


_CGROUPS = """
def cgroup_dirs(pid):
    # The host directories of a process's cgroups (proc(5), /proc/PID/cgroup; mountinfo).
    mounts = []
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        fstype, _source, options = right.split()[:3]
        if fstype in ("cgroup", "cgroup2"):
            mounts.append((fstype, left.split()[4], set(options.split(","))))
    dirs = []
    for line in open(f"/proc/{pid}/cgroup"):
        _id, controllers, path = line.strip().split(":", 2)
        for fstype, point, options in mounts:
            if (fstype == "cgroup2" and not controllers) or (
                    fstype == "cgroup" and controllers and set(controllers.split(",")) <= options):
                if "nsbox-" in path:
                    dirs.append(point + path)
    return dirs

def wait_for(marker):
    import time
    for _ in range(400):
        found = [pid for pid in find(marker) if open(f"/proc/{pid}/cmdline", "rb").read()
                 == b"sleep\\0" + marker.encode() + b"\\0"]
        if found:
            return found[0]
        time.sleep(0.025)
    raise AssertionError("the sandboxed command did not start")
"""


def test_cancelling_arun_kills_the_sandbox_and_removes_its_cgroup(user: UserRunner) -> None:
    out = user.script(_CGROUPS + """
import asyncio, time

async def main():
    task = asyncio.create_task(nsbox.arun(["sleep", "301.5"], timeout=60))
    pid = await asyncio.to_thread(wait_for, "301.5")
    dirs = cgroup_dirs(pid)
    started = time.monotonic()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        cancelled = True
    return {"cancelled": cancelled, "seconds": time.monotonic() - started,
            "alive": [p for p in find("301.5") if os.path.exists(f"/proc/{p}")],
            "dirs": dirs, "dirs_left": [d for d in dirs if os.path.exists(d)],
            "next": (await nsbox.arun(["echo", "next"], text=True)).stdout}

emit(**asyncio.run(main()))
""")
    assert out["cancelled"] and out["alive"] == [] and out["dirs_left"] == []
    assert out["next"] == "next\n"
    if user.mode == "caller":
        assert out["dirs"], "a run as root has cgroups here: the test must see them go"


def test_async_session_cancelled_run_and_block(user: UserRunner) -> None:
    out = user.script(_CGROUPS + """
import asyncio

async def main():
    got = {}
    async with nsbox.AsyncSession(timeout=60) as s:
        await s.write_file("in.txt", "data")
        task = asyncio.create_task(s.run(["sleep", "302.5"]))
        await asyncio.to_thread(wait_for, "302.5")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            got["run_cancelled"] = find("302.5") == []
        got["session_goes_on"] = (await s.run(["cat", "in.txt"], text=True)).stdout
        init = s.session.pid
    got["init_gone_after_block"] = not os.path.exists(f"/proc/{init}")

    async def agent():
        async with nsbox.AsyncSession(timeout=60) as s:
            await s.run(["sleep", "303.5"])
    task = asyncio.create_task(agent())
    pid = await asyncio.to_thread(wait_for, "303.5")
    dirs = cgroup_dirs(pid)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        got["block_cancelled"] = [p for p in find("303.5") if os.path.exists(f"/proc/{p}")]
        got["dirs_left"] = [d for d in dirs if os.path.exists(d)]
    return got

emit(**asyncio.run(main()))
""")
    assert out == {"run_cancelled": True, "session_goes_on": "data",
                   "init_gone_after_block": True, "block_cancelled": [], "dirs_left": []}


def test_help_shows_docstrings_that_point_at_docs_not_sources() -> None:
    for member in nsbox.Status:
        assert member.__doc__ and member.__doc__ != nsbox.Status.__doc__, member
    assert "returncode" in (nsbox.Result.__doc__ or "")
    text = pydoc.render_doc(nsbox.run, renderer=pydoc.plaintext)
    for word in ("input", "text", "check", "capture_output", "FileNotFoundError"):
        assert word in text
    public = [getattr(nsbox, name) for name in nsbox.__all__ if name != "__version__"]
    for obj in [nsbox, *public]:
        docs = [inspect.getdoc(obj) or ""]
        if inspect.isclass(obj):
            docs += [inspect.getdoc(m) or "" for _n, m in inspect.getmembers(obj)
                     if not _n.startswith("_") and callable(m)]
        for doc in docs:
            assert "nsbox/" not in doc.replace("docs/", ""), (obj, doc)
            assert "PEP 562" not in doc


def test_a_relative_cwd_is_below_the_workspace():
    """cwd="src" is /workspace/src, where the command starts (as write_file's relative paths
    are), not /src."""
    with nsbox.Session() as session:
        session.write_file("src/x", b"")
        done = session.run(["pwd"], cwd="src")
        assert done.stdout == b"/workspace/src\n", done
    assert nsbox.run(["pwd"], cwd=".").stdout == b"/workspace\n"
