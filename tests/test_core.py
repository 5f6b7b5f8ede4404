"""The core sandbox, probed from inside and checked from the host side."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import PYTHON, Runner, parent_of, processes_with, require

import nsbox
from nsbox.errors import CommandNotFound, SetupError
from nsbox.result import Status

USERNS = Path(__file__).with_name("_userns.py")  # a user namespace with maps written from outside


def py(code: str) -> list[str]:
    return [PYTHON, "-c", code]


# --- secrets of the caller ---------------------------------------------------------------------


def test_caller_environment_is_not_visible(sandbox: Runner, monkeypatch: pytest.MonkeyPatch):
    secret = "canary-" + uuid.uuid4().hex
    monkeypatch.setenv("NSBOX_TEST_CANARY", secret)
    result = sandbox.run(["sh", "-c", "env; cat /proc/self/environ; cat /proc/1/environ"])
    assert result.exit_code == 1
    # pid 1 is the sandbox's init, which no process inside may read (_child.serve_as_init).
    assert result.stderr == b"cat: /proc/1/environ: Permission denied\n"
    assert secret.encode() not in result.stdout
    names = {line.split("=", 1)[0] for line in result.stdout.decode().splitlines() if "=" in line}
    assert names <= {"PATH", "HOME", "LANG", "PWD", "SHLVL", "_"}, names


def test_env_option_sets_only_what_is_named(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "echo $GREETING"], env={"GREETING": "hello"})
    assert result.stdout == b"hello\n"


def test_secret_file_in_home_is_not_readable(sandbox: Runner, unprivileged_tmp: Path):
    home = unprivileged_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    secret = "key-" + uuid.uuid4().hex
    (home / ".ssh" / "id_ed25519").write_text(secret)
    os.chmod(home / ".ssh" / "id_ed25519", 0o644)
    result = sandbox.run(["sh", "-c", f"cat {home}/.ssh/id_ed25519; ls /root /home; ls /"])
    assert secret.encode() not in result.stdout
    assert b"No such file or directory" in result.stderr
    # The default binds' optional merged-usr links exist inside exactly where the host has them.
    links = {name for name in ("bin", "sbin", "lib", "lib32", "lib64")
             if os.path.lexists(f"/{name}")}
    assert set(result.stdout.decode().split()) == {
        "dev", "etc", "proc", "tmp", "usr", "workspace", *links}


def test_host_etc_is_not_visible(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "ls /etc; cat /etc/shadow"])
    assert set(result.stdout.decode().split()) <= {
        "passwd", "group", "hostname", "hosts", "nsswitch.conf", "mtab", "ld.so.cache",
        "alternatives", "localtime", "services", "protocols", "mime.types", "inputrc",
        "os-release", "ssl", "host.conf", "gai.conf", "timezone"}
    assert b"No such file or directory" in result.stderr


# --- files outside the workspace ---------------------------------------------------------------


def test_canary_outside_workspace_cannot_change(sandbox: Runner, unprivileged_tmp: Path):
    canary = unprivileged_tmp / "canary.txt"
    canary.write_text("original")
    canary.chmod(0o666)  # even a host file anyone may write is out of reach
    probe = (
        f"echo changed > {canary}; rm -f {canary}; "
        f"echo changed > /ro{canary}; rm -f /ro{canary}; touch /ro/new; "
        "touch /usr/new /new /etc/new; echo done"
    )
    result = sandbox.run(["sh", "-c", probe],
                         binds=[[str(unprivileged_tmp), "/ro" + str(unprivileged_tmp)]])
    assert result.stdout == b"done\n"
    assert b"Read-only file system" in result.stderr
    assert canary.read_text() == "original"
    assert sorted(p.name for p in unprivileged_tmp.iterdir()) == ["canary.txt"]


def test_workspace_directory_is_writable_and_files_owned_sensibly(
        sandbox: Runner, unprivileged_tmp: Path):
    workspace = unprivileged_tmp / "ws"
    workspace.mkdir()
    # Unprivileged: the caller's own directory. As root: a regular user's directory, which the
    # sandbox writes through an idmapped bind (a root-owned one is refused: test_identity.py).
    owner = 65534 if sandbox.unprivileged else 1234
    os.chown(workspace, owner, owner)
    result = sandbox.run(["sh", "-c", "echo data > out.txt && id -u && stat -c %u out.txt"],
                         workspace=str(workspace))
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"1000\n1000\n"
    made = workspace / "out.txt"
    assert made.read_text() == "data\n"
    # Files end up owned by the workspace's owner on the host, never by root.
    assert made.stat().st_uid == workspace.stat().st_uid == owner


def test_default_workspace_is_a_fresh_tmpfs(sandbox: Runner):
    first = sandbox.run(["sh", "-c", "echo x > /workspace/f; ls /workspace"])
    second = sandbox.run(["ls", "-A", "/workspace"])
    assert first.stdout == b"f\n"
    assert second.stdout == b""


# --- network -----------------------------------------------------------------------------------


def test_host_loopback_listener_is_unreachable(sandbox: Runner):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (
            "import socket,errno\n"
            "s=socket.socket()\n"
            "try:\n"
            f"  s.connect(('127.0.0.1',{port})); print('connected')\n"
            "except OSError as e: print(errno.errorcode[e.errno])\n"
        )
        result = sandbox.run(py(code))
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.stdout.strip() in (b"ENETUNREACH", b"ECONNREFUSED"), result.stderr


def test_host_abstract_unix_socket_is_unreachable(sandbox: Runner):
    name = "\0nsbox-test-" + uuid.uuid4().hex
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen()
        code = (
            "import socket,errno\n"
            "s=socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"  s.connect({name!r}); print('connected')\n"
            "except OSError as e: print(errno.errorcode[e.errno])\n"
        )
        result = sandbox.run(py(code))
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.stdout.strip() == b"ECONNREFUSED", result.stderr


def test_no_network_interface_is_up(sandbox: Runner):
    result = sandbox.run(["cat", "/proc/net/dev", "/proc/net/route"])
    lines = result.stdout.decode().splitlines()
    interfaces = [line.split(":")[0].strip() for line in lines if ":" in line]
    assert interfaces == ["lo"]


# --- processes ---------------------------------------------------------------------------------


def test_host_processes_invisible_unkillable_untraceable(sandbox: Runner):
    marker = f"{time.time():.6f}"
    victim = subprocess.Popen(["sleep", "60", marker])
    try:
        code = (
            "import os,errno,ctypes\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            "try:\n"
            f"  os.kill({victim.pid}, 9); print('killed')\n"
            "except OSError as e: print(errno.errorcode[e.errno])\n"
            "libc=ctypes.CDLL(None, use_errno=True)\n"
            f"r=libc.ptrace(16, {victim.pid}, 0, 0)\n"  # PTRACE_ATTACH
            "print(errno.errorcode[ctypes.get_errno()] if r else 'attached')\n"
        )
        result = sandbox.run(py(code))
        assert victim.poll() is None, "the host process was killed from inside"
    finally:
        victim.kill()
        victim.wait()
    pids, kill, trace = result.stdout.decode().splitlines()
    assert pids == "[1, 2]"  # python and its init (pid 1) are alone in their pid namespace
    assert kill == "ESRCH"
    assert trace == "ESRCH"


def test_timeout_kills_everything_including_double_forked_and_setsid(sandbox: Runner):
    marker = f"9{uuid.uuid4().int % 10**8}"
    script = (
        f"(setsid sh -c 'trap \"\" TERM HUP INT; sleep {marker}' &) ; "
        f"(sh -c 'sleep {marker}' &) & "
        f"trap '' TERM; sleep {marker}"
    )
    result = sandbox.run(["sh", "-c", script], timeout=1.0)
    assert result.status is Status.TO
    assert result.timed_out
    assert processes_with(marker) == []


def test_exit_of_pid1_kills_background_processes(sandbox: Runner):
    marker = f"8{uuid.uuid4().int % 10**8}"
    result = sandbox.run(["sh", "-c", f"(setsid sleep {marker} &); echo started"])
    assert result.stdout == b"started\n"
    assert processes_with(marker) == []


def test_sandbox_dies_with_the_launcher(public_tree: Path):
    marker = f"7{uuid.uuid4().int % 10**8}"
    code = (
        f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox; "
        f"nsbox.run(['sleep', '{marker}'])"
    )
    launcher = subprocess.Popen([PYTHON, "-c", code])
    deadline = time.monotonic() + 10
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker), "the sandbox did not start"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


# --- descriptors, terminal, privileges ---------------------------------------------------------


def test_leaked_descriptor_is_not_usable_inside(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text("leaked-" + uuid.uuid4().hex)
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        result = nsbox.run(["sh", "-c", f"ls /proc/self/fd; cat <&{fd}; cat /proc/self/fd/{fd}"])
    finally:
        os.close(fd)
    assert secret.read_text().encode() not in result.stdout
    assert result.stdout.split() == [b"0", b"1", b"2", b"3"]  # 3 is ls's own directory


def test_tiocsti_does_not_reach_the_callers_terminal():
    # In this process only: a terminal descriptor cannot be handed across the test driver.
    # The caller's terminal is refused as stdin (the sandbox could push input into it, write
    # to it and change its modes); TIOCSTI on a terminal the sandbox has is refused by the
    # seccomp filter (tests/test_seccomp.py).
    code = (
        "import fcntl,termios,errno\n"
        "try:\n"
        "  fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('injected')\n"
        "except OSError as e: print(errno.errorcode[e.errno])\n"
    )
    master, slave = os.openpty()
    try:
        with pytest.raises(nsbox.PolicyError) as refused:
            nsbox.run(py(code), stdin=slave)
        os.set_blocking(slave, False)
        try:
            injected = os.read(slave, 100)
        except BlockingIOError:
            injected = b""
    finally:
        os.close(master)
        os.close(slave)
    assert refused.value.key == "stdin" and "terminal" in refused.value.message
    assert injected == b""


def test_capabilities_dropped_and_no_new_privs(sandbox: Runner):
    result = sandbox.run(["cat", "/proc/self/status"])
    status = dict(line.split(":\t", 1) for line in result.stdout.decode().splitlines()
                  if ":\t" in line)
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[field].strip() == "0000000000000000", field
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Uid"].split() == ["1000"] * 4


def test_sandbox_user_maps_to_unprivileged_host_uid(sandbox: Runner):
    result = sandbox.run(["cat", "/proc/self/uid_map", "/proc/self/gid_map"])
    uid_line, gid_line = result.stdout.decode().splitlines()
    inside, outside, count = uid_line.split()
    assert (inside, count) == ("1000", "1")
    assert outside != "0"
    assert gid_line.split()[1] != "0"


def test_new_session_and_hostname(sandbox: Runner):
    result = sandbox.run(py("import os,socket; print(os.getsid(0), os.getpid(), "
                            "socket.gethostname())"))
    # The command leads a session of its own, as the child of the sandbox's init.
    assert result.stdout.split() == [b"2", b"2", b"nsbox"]


# --- output ------------------------------------------------------------------------------------


def test_output_over_the_cap_is_truncated_and_stops_the_run(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "yes nsbox"], output_limit=1000, timeout=20)
    assert result.status is Status.OL
    assert result.stdout_truncated
    assert len(result.stdout) == 1000
    assert result.stdout_bytes > 1000


def test_stdout_stderr_exit_code_and_stdin(sandbox: Runner):
    result = sandbox.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"input\n")
    assert (result.status, result.exit_code) == (Status.RE, 3)
    assert result.stdout == b"input\n"
    assert result.stderr == b"err\n"


def test_signal_status(sandbox: Runner):
    # A fault, like any signal, ends the command, and its init passes the signal on.
    result = sandbox.run(py("import ctypes; ctypes.string_at(0)"))
    assert result.status is Status.SG
    assert result.signal == signal.SIGSEGV


# --- errors ------------------------------------------------------------------------------------


def test_command_not_found_names_the_step(sandbox: Runner):
    with pytest.raises(CommandNotFound) as info:
        sandbox.run(["no-such-program-here"])
    assert info.value.step == "exec"
    assert info.value.errno == errno.ENOENT
    assert "command not found inside the sandbox: no-such-program-here" in str(info.value)


def test_missing_bind_source_names_the_mount(sandbox: Runner):
    with pytest.raises(SetupError) as info:
        sandbox.run(["true"], binds=[["/no/such/dir", "/data"]])
    assert info.value.step == "bind /data"
    assert "source /no/such/dir does not exist on the host" in str(info.value)


def test_user_namespace_limit_gives_a_hint(public_tree: Path):
    require(os.path.exists("/usr/bin/unshare"), "unshare(1) is needed to simulate the host")
    code = (
        f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox\n"
        "try: nsbox.run(['true'], nsbox.Policy(isolation='namespaces'))\n"
        "except nsbox.SetupError as e: print(e.step, e.errno, e.hint)\n"
    )
    # In a user namespace of its own, the test may set that namespace's limit to 0. It maps an
    # unprivileged id too, for the sandbox (nsbox/policy/identity.py: only 0 would be refused),
    # which needs root: a regular user can map its own uid alone, and uid 0 inside is refused.
    if os.geteuid() != 0:
        pytest.skip("only root can map a second, unprivileged id into the test's namespace")
    maps = "0 0 1,65534 65534 1"
    prefix = [PYTHON, str(USERNS), maps, maps]
    proc = subprocess.run(
        [*prefix, "sh", "-c",
         f"echo 0 > /proc/sys/user/max_user_namespaces && exec {PYTHON} -c \"$0\"", code],
        capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith(f"create namespaces {errno.ENOSPC} "), proc.stderr
    assert "user.max_user_namespaces" in proc.stdout


# --- concurrency -------------------------------------------------------------------------------


def test_concurrent_launches_from_threads():
    results: dict[int, bytes] = {}

    def worker(n: int) -> None:
        for i in range(4):
            results[n * 10 + i] = nsbox.run(["echo", str(n * 10 + i)]).stdout

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {k: f"{k}\n".encode() for k in results}
    assert len(results) == 24


def test_helper_does_not_hold_the_callers_stdio(public_tree: Path):
    # A reader of the host program's stdout (a pipe, an MCP client) must see end-of-file when
    # the program exits, not when its launch helper does.
    code = (f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox; "
            "print(nsbox.run(['echo', 'x']).stdout, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([PYTHON, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"b'x\\n'\n"
        helpers = [pid for name in ("nsbox._helper", "nsbox-engine")  # the launch engine's too
                   for pid in processes_with(name) if parent_of(pid) == proc.pid]
        assert len(helpers) == 1
        streams = [os.readlink(f"/proc/{helpers[0]}/fd/{fd}") for fd in (0, 1, 2)]
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    assert streams == ["/dev/null"] * 3
