"""A descriptor given as ``stdin`` never enters the sandbox as the caller's open file.

A pipe is passed as it is; a regular file, a device or a socket is read by the host into a new
pipe (nsbox/launch/stdin.py), so the sandbox cannot open the file again through /proc/self/fd/0
to write it, nor send through the host's socket; a directory, an O_PATH descriptor, a terminal,
a descriptor not open for reading or of no file at all is a PolicyError with the key
``stdin``. Each door is tried: nsbox.run, Session.run, Pool.run and the command line's
``nsbox run < file``; as this process's user and as an unprivileged uid, with the evidence taken
on the host.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON
from sessiontools import UserRunner, user_runner

import nsbox

# The launch core and engine under test (tests/conftest.py: CI runs with each), for the scripts.
CORE = {name: os.environ[name] for name in ("NSBOX_NATIVE", "NSBOX_ENGINE") if name in os.environ}

DOORS = """
def doors():
    pool = nsbox.Pool(size=1)
    session = nsbox.Session()
    return pool, session, {"run": nsbox.run, "session": session.run, "pool": pool.run}
"""


@pytest.fixture(params=["caller", "unprivileged"])
def user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def test_a_file_given_as_stdin_cannot_be_written_through_it(user: UserRunner,
                                                             unprivileged_tmp: Path) -> None:
    """The sandbox reads the file, but reopening /proc/self/fd/0 for writing (or writing fd 0,
    when the caller opened the file read-write) leaves the host's file as it was: its fd 0 is
    a pipe (which its uid may open again when the pipe is its uid's, and so write into what it
    reads itself). The file is writable by every uid: only the descriptor stands in the way."""
    victim = unprivileged_tmp / "data.txt"
    out = user.script(DOORS + f"""
path = {str(victim)!r}
with open(path, "w") as f:
    f.write("original\\n")
os.chmod(path, 0o666)
attack = ["sh", "-c", "echo pwned > /proc/self/fd/0; echo pwned >&0; python3 -c "
          "'import os; os.write(os.open(\\"/proc/self/fd/0\\", os.O_WRONLY), b\\"x\\")'; "
          "cat; readlink /proc/self/fd/0"]
pool, session, runs = doors()
got = {{}}
for name, run in runs.items():
    for flags in (os.O_RDONLY, os.O_RDWR):
        fd = os.open(path, flags)
        result = run(attack, stdin=fd)
        os.close(fd)
        got[f"{{name}} {{flags}}"] = [result.stdout.decode(), open(path).read()]
pool.close(); session.close()
emit(got=got)
""", env=CORE)
    assert len(out["got"]) == 6
    for door, (stdout, content) in out["got"].items():
        assert content == "original\n", door
        assert stdout.startswith("original\n") and "pipe:[" in stdout, (door, stdout)
    assert victim.read_text() == "original\n"


def test_the_bytes_of_a_file_or_device_arrive_exactly_and_the_pump_ends(
        user: UserRunner, unprivileged_tmp: Path) -> None:
    """Every byte value, a file of several pipe buffers, an endless device the command reads
    a little of or none of: what the sandbox reads is the file's bytes, and no thread is left
    feeding a pipe once the runs are over."""
    data = unprivileged_tmp / "data.bin"
    content = bytes(range(256)) * 64 + os.urandom(3 << 20)
    data.write_bytes(content)
    data.chmod(0o644)
    out = user.script(DOORS + f"""
import threading, time
pool, session, runs = doors()
got = {{}}
for name, run in runs.items():
    fd = os.open({str(data)!r}, os.O_RDONLY)
    got[name] = run(["sha256sum"], stdin=fd).stdout.decode().split()[0]
    os.close(fd)
    zero = os.open("/dev/zero", os.O_RDONLY)
    got[name + " zero"] = [run(["head", "-c", "3"], stdin=zero).stdout.hex(),
                           run(["true"], stdin=zero).status.value]
    os.close(zero)
    null = os.open("/dev/null", os.O_RDONLY)
    got[name + " null"] = run(["wc", "-c"], stdin=null).stdout.decode().strip()
pool.close(); session.close()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and any(t.name == "nsbox-stdin-pump"
                                          for t in threading.enumerate()):
    time.sleep(0.05)
emit(got=got, pumps=[t.name for t in threading.enumerate() if t.name == "nsbox-stdin-pump"])
""", env=CORE)
    digest = hashlib.sha256(content).hexdigest()
    for door in ("run", "session", "pool"):
        assert out["got"][door] == digest, door
        assert out["got"][door + " zero"] == ["000000", "OK"], door
        assert out["got"][door + " null"] == "0", door
    assert out["pumps"] == []


def test_a_directory_or_an_o_path_descriptor_is_refused(user: UserRunner,
                                                         unprivileged_tmp: Path) -> None:
    """Through a directory's descriptor (or an O_PATH one) the sandbox would list and open the
    host's files under it, by openat or /proc/self/fd/0: refused before anything runs."""
    (unprivileged_tmp / "secret.txt").write_text("host secret\n")
    out = user.script(DOORS + f"""
tmp = {str(unprivileged_tmp)!r}
attack = ["sh", "-c", "ls /proc/self/fd/0/; cat /proc/self/fd/0/secret.txt; "
          "echo x > /proc/self/fd/0/ESCAPED"]
descriptors = {{"dir": os.open(tmp, os.O_RDONLY | os.O_DIRECTORY),
                "o_path dir": os.open(tmp, os.O_PATH),
                "o_path root": os.open("/", os.O_PATH),
                "o_path file": os.open(tmp + "/secret.txt", os.O_PATH)}}
pool, session, runs = doors()
got = {{}}
for name, run in runs.items():
    for kind, fd in descriptors.items():
        try:
            result = run(attack, stdin=fd)
            got[f"{{name}} {{kind}}"] = ["ran", result.stdout.decode()]
        except nsbox.PolicyError as error:
            got[f"{{name}} {{kind}}"] = [error.key, str(error)]
pool.close(); session.close()
emit(got=got)
""", env=CORE)
    assert len(out["got"]) == 12
    for case, (key, message) in out["got"].items():
        assert key == "stdin", (case, message)
        assert ("O_PATH" if "o_path" in case else "a directory") in message, case
    assert not (unprivileged_tmp / "ESCAPED").exists()


def test_a_terminal_is_refused_and_the_error_points_at_the_pty_option() -> None:
    """A terminal handed in could be written and ioctl'ed (modes, TIOCSCTTY) past nsbox's
    output handling; a run of its own terminal is `nsbox run --tty`."""
    master, slave = os.openpty()
    try:
        with nsbox.Pool(size=1) as pool, nsbox.Session() as session:
            for run in (nsbox.run, session.run, pool.run):
                for fd in (slave, master):
                    with pytest.raises(nsbox.PolicyError) as caught:
                        run(["sh", "-c", "stty -echo; echo x >&0"], stdin=fd)  # type: ignore[operator]
                    assert caught.value.key == "stdin" and "terminal" in caught.value.message
                    assert "--tty" in (caught.value.hint or "")
    finally:
        os.close(master)
        os.close(slave)


def test_descriptors_not_open_for_reading_or_of_no_file_are_refused(tmp_path: Path) -> None:
    write_only = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
    read_end, write_end = os.pipe()
    epoll = select.epoll()
    others = {"write-only file": write_only, "pipe write end": write_end,
              "eventfd": os.eventfd(0), "pidfd": os.pidfd_open(os.getpid()),
              "epoll": os.dup(epoll.fileno())}
    epoll.close()
    try:
        for name, fd in others.items():
            with pytest.raises(nsbox.PolicyError) as caught:
                nsbox.run(["cat"], stdin=fd)
            assert caught.value.key == "stdin", name
            text = caught.value.message
            assert ("not open for reading" in text) == (name in ("write-only file",
                                                                "pipe write end")), name
    finally:
        for fd in [read_end, *others.values()]:
            os.close(fd)


def test_a_pipe_passes_as_it_is_and_a_socket_is_pumped(user: UserRunner) -> None:
    """The sandbox reads the caller's pipe itself (the same pipe inode). A socket's bytes
    reach it through a pipe of its own: an unconnected UDP socket of the host's network given
    as stdin sent the sandbox's datagram to a host listener (sendto), past its network rules;
    now the listener gets nothing."""
    out = user.script(DOORS + """
import socket
pool, session, runs = doors()
got = {}
listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
listener.bind(("127.0.0.1", 0))
listener.setblocking(False)
port = listener.getsockname()[1]
send = ("python3 -c 'import socket; s = socket.socket(fileno=0); "
        f"s.sendto(b\\"from the sandbox\\", (\\"127.0.0.1\\", {port}))'; "
        "readlink /proc/self/fd/0")
for name, run in runs.items():
    r, w = os.pipe()
    os.write(w, b"through the pipe")
    os.close(w)
    result = run(["sh", "-c", "cat; echo; readlink /proc/self/fd/0"], stdin=r)
    got[name] = [result.stdout.decode(), f"pipe:[{os.fstat(r).st_ino}]"]
    os.close(r)
    ours, theirs = socket.socketpair()
    ours.sendall(b"over a socket")
    ours.shutdown(socket.SHUT_WR)
    got[name + " socket"] = run(["cat"], stdin=theirs.fileno()).stdout.decode()
    ours.close(); theirs.close()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sent = run(["sh", "-c", send], stdin=udp.fileno(), timeout=30)
    udp.close()
    try:
        heard = listener.recv(100).decode()
    except BlockingIOError:
        heard = ""
    got[name + " udp"] = [heard, sent.stdout.decode()]
pool.close(); session.close()
emit(got=got)
""", env=CORE)
    for door in ("run", "session", "pool"):
        stdout, link = out["got"][door]
        assert stdout == f"through the pipe\n{link}\n", door
        assert out["got"][door + " socket"] == "over a socket", door
        heard, link = out["got"][door + " udp"]
        assert heard == "", door  # host-side: the listener got no datagram
        assert link.startswith("pipe:["), (door, link)


def test_the_command_line_pumps_a_file_on_its_stdin(user: UserRunner,
                                                    unprivileged_tmp: Path) -> None:
    """`nsbox run < file` (fd 0 is not a terminal, so it is handed in): the command reads the
    file's 200 MB exactly, cannot write the file through /proc/self/fd/0, and the command line
    does not hold the file in its memory."""
    big = unprivileged_tmp / "big.bin"
    with open(big, "wb") as f:  # sparse, with bytes of their own at both ends and the middle
        for offset in (0, 100 << 20, (200 << 20) - 4096):
            f.seek(offset)
            f.write(os.urandom(4096))
    big.chmod(0o666)
    digest = _sha256(big)
    wrapper = (
        "import resource, subprocess, sys\n"
        f"with open({str(big)!r}, 'rb') as f:\n"
        "    proc = subprocess.run([sys.executable, '-m', 'nsbox', 'run', '-q', '--', 'sh', '-c',"
        " 'sha256sum; echo pwned > /proc/self/fd/0; true'], stdin=f, capture_output=True)\n"
        "print(proc.returncode, proc.stdout.decode().split()[0], "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(proc.stderr.decode())\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp", **CORE}
    proc = subprocess.run([*user.prefix(), PYTHON, "-c", wrapper], capture_output=True,
                          text=True, env=env, cwd="/", timeout=120)
    assert proc.stdout, proc.stderr
    code, seen, max_rss_kib = proc.stdout.split()
    assert (code, seen) == ("0", digest), proc.stderr
    assert int(max_rss_kib) < 100 * 1024  # KiB: far less than the file
    assert _sha256(big) == digest and big.stat().st_size == 200 << 20  # as it was


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
