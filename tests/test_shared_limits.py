"""Kernel resources that a sandbox shares with the rest of the host: ptys, and the inotify and
fanotify objects that the kernel counts per user of each user namespace (ucounts).

Each test runs a probe in a real sandbox that takes as many as it can, and checks the evidence
from the host's side: the probe's count stays within the sandbox's own limit, and the owner of
the sandbox (the user that launched it, here root or the unprivileged uid) can still get one
while the sandbox holds all it could take (docs/limits.md, "Shared kernel resources").
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import PYTHON, Runner
from sessiontools import UserRunner, user_runner

from nsbox.policy import limits
from nsbox.sandbox import mounts

# The sandbox's own limits (nsbox/sandbox/mounts.py, PTY_MAX and USER_NAMESPACE_LIMITS;
# nsbox/policy/limits.py, MSGQUEUE_BYTES).
PTY_MAX = 64
LIMITS = {"max_inotify_instances": 32, "max_inotify_watches": 8192,
          "max_fanotify_groups": 32, "max_fanotify_marks": 8192}

# Opens /dev/ptmx until the kernel refuses, but never more than 200 times: enough to see that a
# limit of 64 holds, without taking the ptys other sandboxes and the host need.
PTY_PROBE = """
import errno, json, os
fds, error = [], ""
while len(fds) < 200:
    try:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    except OSError as exc:
        error = errno.errorcode[exc.errno]
        break
print(json.dumps({"count": len(fds), "error": error}))
"""

# Makes one of argv[1]: an inotify instance, a fanotify group, or a POSIX message queue of
# 10 messages of 8 KiB (mq_overview(7)'s defaults: about 82 KB charged to its user).
TAKE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class MqAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("flags", "maxmsg", "msgsize", "curmsgs")]
def take(kind, name):
    if kind == "inotify":
        return libc.inotify_init1(os.O_CLOEXEC)
    if kind == "mqueue":
        return libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600,
                            ctypes.byref(MqAttr(0, 10, 8192, 0)))
    return libc.fanotify_init(0x200 | 1, os.O_RDONLY)  # FAN_REPORT_FID | FAN_CLOEXEC
"""

# Takes inotify instances, fanotify groups or message queues (argv[1]) until the kernel refuses
# (at most 1000), says how many, and holds them until its stdin ends.
HOLD_PROBE = TAKE + """
import errno, json, sys
def take_one():
    return take(sys.argv[1], f"/nsbox-probe-{len(fds)}")
fds, error = [], ""
while len(fds) < 1000:
    fd = take_one()
    if fd < 0:
        error = errno.errorcode[ctypes.get_errno()]
        break
    fds.append(fd)
print(json.dumps({"count": len(fds), "error": error}), flush=True)
sys.stdin.read()
"""

# Run by the owner of the sandbox, on the host: launches the hold probe with the CLI, and once
# the sandbox holds all it could take, takes one of the same kind itself.
OWNER = """
import ctypes, subprocess
libc = ctypes.CDLL(None, use_errno=True)
kind = {kind!r}
env = {{"PATH": "/usr/bin:/bin", "PYTHONPATH": {tree!r}, **{core_env!r}}}
probe = subprocess.Popen(
    [sys.executable, "-m", "nsbox", "run", "-q", "--", "/usr/bin/python3", "-c", {probe!r},
     kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/")
held = json.loads(probe.stdout.readline() or "null")
exec({take!r})
name = f"/nsbox-test-{{os.getpid()}}"
fd = take(kind, name)
own = "" if fd >= 0 else os.strerror(ctypes.get_errno())
if kind == "mqueue" and fd >= 0:
    libc.mq_unlink(name.encode())
probe.stdin.close()
emit(held=held, own=own, code=probe.wait(timeout=60))
"""


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def _core_env() -> dict[str, str]:
    """The launch core under test, for a CLI run the test starts."""
    return {name: os.environ[name] for name in ("NSBOX_NATIVE", "NSBOX_ENGINE")
            if name in os.environ}


def test_a_sandbox_leaves_its_owner_message_queues(as_user: UserRunner) -> None:
    """POSIX message queues are charged to the user who launched the sandbox too, against
    that user's RLIMIT_MSGQUEUE (819200 bytes): without the sandbox's own rlimit it made 9 and
    the owner's mq_open failed EMFILE. With 256 KiB of its own it makes 3 (82 KB each)."""
    body = OWNER.format(kind="mqueue", tree=str(as_user.tree), core_env=_core_env(),
                        probe=HOLD_PROBE, take=TAKE)
    found = as_user.script(body)
    assert found == {"held": {"count": 3, "error": "EMFILE"}, "own": "", "code": 0}


# Queues a blocked real-time signal to itself until the kernel refuses (at most 5000 times).
# sigqueue(3), not kill(2): past the limit the kernel drops a kill's real-time signal silently.
SIGNAL_PROBE = """
import ctypes, errno, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
count, error = 0, ""
while count < 5000:
    if libc.sigqueue(os.getpid(), int(signal.SIGRTMIN), ctypes.c_long(0)) != 0:
        error = errno.errorcode[ctypes.get_errno()]
        break
    count += 1
print(json.dumps({"count": count, "error": error}))
"""


def test_a_sandbox_queues_at_most_its_own_pending_signals(sandbox: Runner) -> None:
    """Queued signals are charged to the launching user as well, against its
    RLIMIT_SIGPENDING: the sandbox has a limit of its own (sigqueue(3): EAGAIN past it)."""
    result = sandbox.run([PYTHON, "-c", SIGNAL_PROBE])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"count": limits.PENDING_SIGNALS, "error": "EAGAIN"}


def test_a_sandbox_opens_at_most_its_own_ptys(sandbox: Runner) -> None:
    """Without a limit of its own, one sandbox took every pty outside the host's reserve
    (kernel.pty.max - kernel.pty.reserve, 3071 here) and another's --tty failed ENOSPC."""
    result = sandbox.run([PYTHON, "-c", PTY_PROBE])
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert probe == {"count": PTY_MAX, "error": "ENOSPC"}


@pytest.mark.parametrize("kind", ["inotify", "fanotify"])
def test_a_sandbox_leaves_its_owner_inotify_and_fanotify(as_user: UserRunner,
                                                         kind: str) -> None:
    """The kernel charges a sandbox's instances to every user namespace above it as well, to
    the user who launched it: without the sandbox's own limit, the sandbox took all of the
    owner's (128 for root here) and the owner's own inotify_init failed EMFILE."""
    body = OWNER.format(kind=kind, tree=str(as_user.tree), core_env=_core_env(),
                        probe=HOLD_PROBE, take=TAKE)
    found = as_user.script(body)
    limit = LIMITS["max_inotify_instances" if kind == "inotify" else "max_fanotify_groups"]
    assert found == {"held": {"count": limit, "error": "EMFILE"}, "own": "", "code": 0}


# Reads each limit named in argv of the sandbox's /proc/sys/user, and tries to raise it.
READ_PROBE = """
import errno, json, sys
seen, refused = {}, {}
for name in sys.argv[1:]:
    path = "/proc/sys/user/" + name
    seen[name] = int(open(path).read())
    try:
        with open(path, "w") as f:
            f.write("1000000")
    except OSError as exc:
        refused[name] = errno.errorcode[exc.errno]
print(json.dumps({"seen": seen, "refused": refused}))
"""


def test_the_sandbox_sees_its_limits_and_cannot_raise_them(sandbox: Runner) -> None:
    """The limits are those of the sandbox's user namespace, and fixed inside it: /proc/sys is
    read-only there, and no capability is left to write them."""
    result = sandbox.run([PYTHON, "-c", READ_PROBE, *LIMITS])
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found == {"seen": LIMITS, "refused": dict.fromkeys(LIMITS, "EROFS")}


# Watches (inotify) or marks (fanotify), argv[1], on one file after another of /usr and /etc
# until the kernel refuses, or 9,001 were made.
WATCH_PROBE = """
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
kind = sys.argv[1]
if kind == "inotify":
    group = libc.inotify_init1(os.O_CLOEXEC)
else:
    group = libc.fanotify_init(0x200 | 1, os.O_RDONLY)  # FAN_REPORT_FID | FAN_CLOEXEC
count, error, seen = 0, "", set()
for top in ("/usr", "/etc"):
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in seen:
                continue  # a hard link: its inode is watched already
            seen.add((st.st_dev, st.st_ino))
            path = path.encode()
            if kind == "inotify":  # IN_CREATE, IN_DONT_FOLLOW
                ok = libc.inotify_add_watch(group, path, 0x100 | 0x02000000) >= 0
            else:  # FAN_MARK_ADD | FAN_MARK_DONT_FOLLOW, FAN_OPEN, AT_FDCWD
                ok = libc.fanotify_mark(group, 1 | 4, ctypes.c_uint64(0x20), -100, path) == 0
            if ok:
                count += 1
            elif ctypes.get_errno() not in (errno.EACCES, errno.ENOENT, errno.ELOOP):
                error = errno.errorcode[ctypes.get_errno()]
                break
            if count > 9000:
                break
        if error or count > 9000:
            break
    if error or count > 9000:
        break
print(json.dumps({"count": count, "error": error}))
"""


@pytest.mark.parametrize(("kind", "limit", "error"),
                         [("inotify", "max_inotify_watches", "ENOSPC"),
                          ("fanotify", "max_fanotify_marks", "ENOSPC")])
def test_a_sandbox_watches_at_most_its_own_number_of_files(sandbox: Runner, kind: str,
                                                           limit: str, error: str) -> None:
    result = sandbox.run([PYTHON, "-c", WATCH_PROBE, kind])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"count": LIMITS[limit], "error": error}


def test_both_launch_cores_set_the_same_limits() -> None:
    """The native core (nsbox/native/devproc.c) and the Python child write the same values."""
    source = (Path(__file__).resolve().parent.parent / "nsbox/native/devproc.c").read_text()
    assert f'#define PTY_MAX "{mounts.PTY_MAX}"' in source
    table = re.search(r"user_limits\[\]\[2\] = \{(.*?)\};", source, re.S)
    assert table is not None
    in_c = [(name, int(value)) for name, value in re.findall(r'\{"(\w+)", "(\d+)"\}',
                                                               table.group(1))]
    assert in_c == list(mounts.USER_NAMESPACE_LIMITS)
    assert dict(in_c) == LIMITS and mounts.PTY_MAX == PTY_MAX


# Asks for AIO contexts (io_setup(2), x86_64's number 206): how many it got, and its errno.
AIO_PROBE = """
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
context = ctypes.c_ulong(0)
got = libc.syscall(206, 65536, ctypes.byref(context))
print(json.dumps({"got": got, "error": errno.errorcode.get(ctypes.get_errno(), "")}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64's number of io_setup")
def test_a_sandbox_takes_no_aio_context_of_the_hosts(sandbox: Runner) -> None:
    """AIO contexts are counted for the whole host, in no namespace or cgroup: one sandbox's
    io_setup(65536) made every io_setup on the host fail with EAGAIN while it ran. The
    sandbox's answers ENOSYS, and the host's count (fs.aio-nr) does not move."""
    before = Path("/proc/sys/fs/aio-nr").read_text()
    result = sandbox.run([PYTHON, "-c", AIO_PROBE])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"got": -1, "error": "ENOSYS"}
    assert Path("/proc/sys/fs/aio-nr").read_text() == before
