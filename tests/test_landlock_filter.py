"""The Landlock mode's own seccomp filter (nsbox/host/landlock_filter.py), attacked from inside.

Each test starts a probe in a real Landlock sandbox on a host that refuses namespaces (the
fixtures of tests/test_landlock.py: as root, whose sandbox is uid 65534, and as uid 65534),
holds it open while the host looks, and checks the evidence from the host: an ACL or a mode on
a file of the sandbox's uid outside the workspace, a datagram on a host socket, an abstract name
a host daemon wants, the inotify instances of the sandbox's uid, a host file's name.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_landlock
from test_landlock import SANDBOX_UID, RefusingHost, as_sandbox_uid

# The refusing hosts of tests/test_landlock.py, as root and as uid 65534.
any_host, host = test_landlock.any_host, test_landlock.host

# The probes' common part, tests/test_landlock.py's, and held(): the first line of output
# while the sandbox still runs.
ATTEMPT = test_landlock.PROBE_HEAD + r'''
def held():
    print(json.dumps(out), flush=True)
    sys.stdin.read()  # the host looks while the sandbox still runs, then closes stdin
'''


class Probe:
    """A probe running in a Landlock sandbox of ``host``: its first line of output, parsed,
    then held until ``finish``."""

    def __init__(self, host: RefusingHost, code: str, arguments: dict[str, Any],
                 nsbox_args: tuple[str, ...] = ()) -> None:
        argv = [host.python, "-m", "nsbox", "run", "--quiet", "--isolation", "landlock",
                *nsbox_args, "--", "python3", "-c", ATTEMPT + code, json.dumps(arguments)]
        self.process = subprocess.Popen(host.command(argv), cwd="/", env=host.env(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            assert line, self.finish()
        self.outcome: dict[str, list[str]] = json.loads(line)

    def finish(self) -> str:
        """Let the probe go on and end; what it printed after the first line, and stderr."""
        out, err = self.process.communicate(timeout=60)
        return out + err


@pytest.fixture
def sandbox_dir() -> Iterator[Path]:
    """A host directory of the sandbox's uid outside any workspace (a home, another sandbox's
    workspace), readable to the sandbox through a read-only bind."""
    # Not below /tmp: that is the sandbox's own there (a bind at /tmp/... is refused).
    tmp = Path(tempfile.mkdtemp(prefix="nsbox-llfilter-", dir="/var/tmp"))
    tmp.chmod(0o755)
    found = tmp / "home"
    found.mkdir(mode=0o700)
    (found / "authorized_keys").write_text("ssh-ed25519 AAAA user@host\n")
    (found / "authorized_keys").chmod(0o600)
    if os.geteuid() == 0:
        for path in (found, found / "authorized_keys"):
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
    yield found
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


def acl(other: int) -> bytes:
    """A POSIX ACL in the kernel's xattr format (include/uapi/linux/posix_acl_xattr.h):
    user::rw-, user:1:rw- (daemon), group::rw-, mask::rw-, other:: ``other``. The named user
    keeps it an attribute (one of the base entries only would be stored as the mode)."""
    entries = ((0x01, 6, -1), (0x02, 6, 1), (0x04, 6, -1), (0x10, 6, -1), (0x20, other, -1))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident & 0xFFFFFFFF)
                                           for tag, perm, ident in entries)


METADATA = r'''
target, directory = args["target"], args["dir"]
acl_other_rw, acl_other_rwx = bytes.fromhex(args["acl6"]), bytes.fromhex(args["acl7"])
A, D = "system.posix_acl_access", "system.posix_acl_default"
attempt("setxattr acl", lambda: os.setxattr(target, A, acl_other_rw))
attempt("lsetxattr acl", lambda: os.setxattr(target, A, acl_other_rw, follow_symlinks=False))
attempt("setxattr default acl", lambda: os.setxattr(directory, D, acl_other_rwx))
attempt("setxattr user", lambda: os.setxattr(target, "user.mark", b"x"))
fd = os.open(target, os.O_RDONLY)  # the read-only bind lets it open for reading
attempt("fsetxattr acl", lambda: os.setxattr(fd, A, acl_other_rw))
value = ctypes.create_string_buffer(acl_other_rw, len(acl_other_rw))
xattr_args = struct.pack("<QII", ctypes.addressof(value), len(acl_other_rw), 0)
attempt("setxattrat acl", lambda: call(463, -100, target.encode(), 0, A.encode(), xattr_args,
                                       ctypes.c_size_t(len(xattr_args))))
attempt("removexattr", lambda: os.removexattr(target, "user.none"))
attempt("fremovexattr", lambda: os.removexattr(fd, "user.none"))
attempt("removexattrat", lambda: call(466, -100, target.encode(), 0, b"user.none"))
attempt("fchmod 0400", lambda: os.fchmod(fd, 0o400))
attempt("fchmod 0666", lambda: os.fchmod(fd, 0o666))
attempt("fchmod 0602", lambda: os.fchmod(fd, 0o602))
attempt("fchmod 0620", lambda: os.fchmod(fd, 0o620))
mine = os.open("mine", os.O_CREAT | os.O_WRONLY, 0o600)
attempt("fchmod 0755 in the workspace", lambda: os.fchmod(mine, 0o755))
attempt("chmod 0644 in the workspace", lambda: os.chmod("mine", 0o644))
attempt("fchmod 0777 in the workspace", lambda: os.fchmod(mine, 0o777))
held()
'''


def test_no_acl_xattr_or_fchmod_opens_a_file_of_the_sandboxs_uid(host: RefusingHost,
                                                                  sandbox_dir: Path):
    target = sandbox_dir / "authorized_keys"
    probe = Probe(host, METADATA, {"target": str(target), "dir": str(sandbox_dir),
                                   "acl6": acl(6).hex(), "acl7": acl(7).hex()},
                  ("--ro-bind", f"{sandbox_dir}:{sandbox_dir}"))
    try:
        # From the host: no ACL, no attribute, no mode anyone else could use.
        assert os.listxattr(target) == [] and os.listxattr(sandbox_dir) == []
        assert stat.S_IMODE(target.stat().st_mode) == 0o400  # fchmod 0400 is allowed
        assert stat.S_IMODE(sandbox_dir.stat().st_mode) == 0o700
    finally:
        probe.finish()
    outcome = probe.outcome
    for name in ("setxattr acl", "lsetxattr acl", "setxattr default acl", "setxattr user",
                 "fsetxattr acl", "setxattrat acl", "removexattr", "fremovexattr",
                 "removexattrat"):
        assert outcome[name] == ["refused", "ENOTSUP"], (name, outcome)
    for name in ("fchmod 0666", "fchmod 0602", "fchmod 0620", "fchmod 0777 in the workspace"):
        assert outcome[name] == ["refused", "EPERM"], (name, outcome)
    for name in ("fchmod 0400", "fchmod 0755 in the workspace", "chmod 0644 in the workspace"):
        assert outcome[name][0] == "done", (name, outcome)


SOCKETS = r'''
attempt("socketpair dgram", lambda: socket.socketpair(
    socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b"leak", args["dgram"]))
attempt("socketpair dgram cloexec", lambda: socket.socketpair(
    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC))
attempt("socketpair seqpacket", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
attempt("sendto pathname", lambda: a.sendto(b"leak", args["dgram"]))
attempt("connect pathname", lambda: a.connect(args["dgram"]))
attempt("bind abstract", lambda: a.bind("\0" + args["abstract"]))
attempt("bind abstract autobind", lambda: b.bind(""))
attempt("stream pair works", lambda: (a.send(b"ping"), b.recv(4))[1])
attempt("socket.socketpair()", lambda: [s.close() for s in socket.socketpair()])
def event_loop():
    import asyncio
    async def main():
        proc = await asyncio.create_subprocess_exec("echo", "hi", stdout=asyncio.subprocess.PIPE)
        return (await proc.communicate())[0]
    return asyncio.run(main())
attempt("asyncio", event_loop)
def pipe_to_a_process():
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=lambda: theirs.send("from the child"))
    child.start()
    got = ours.recv()
    child.join()
    return got
attempt("multiprocessing", pipe_to_a_process)
held()
'''


def test_no_socketpair_reaches_a_host_socket_or_takes_a_name(host: RefusingHost,
                                                             sandbox_dir: Path):
    path = str(sandbox_dir.parent / "dgram.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.setblocking(False)
    name = "nsbox-test-daemon-" + uuid.uuid4().hex
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe = Probe(host, SOCKETS, {"dgram": path, "abstract": name})
        try:
            daemon.bind("\0" + name)  # the host daemon still gets its name
        finally:
            probe.finish()
        with pytest.raises(BlockingIOError):
            listener.recvfrom(100)
    finally:
        listener.close()
        daemon.close()
    outcome = probe.outcome
    for kind in ("dgram", "dgram cloexec", "seqpacket"):
        assert outcome[f"socketpair {kind}"] == ["refused", "EACCES"], outcome
    assert outcome["sendto pathname"] == ["refused", "EISCONN"], outcome
    # A stream socket of a pair is connected for good: EISCONN (EPROTOTYPE, a datagram
    # socket being no peer for it, comes first here).
    assert outcome["connect pathname"] in (["refused", "EISCONN"], ["refused", "EPROTOTYPE"])
    assert outcome["bind abstract"] == ["refused", "EACCES"], outcome
    assert outcome["bind abstract autobind"] == ["refused", "EACCES"], outcome
    assert outcome["stream pair works"] == ["done", "b'ping'"], outcome
    assert outcome["socket.socketpair()"][0] == "done", outcome
    assert outcome["asyncio"] == ["done", "b'hi\\n'"], outcome
    assert outcome["multiprocessing"] == ["done", "'from the child'"], outcome


WATCHES = r'''
IN_ALL, IN_NONBLOCK = 0xFFF, 0o4000
def check(value):
    if value < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return value
instances = []
def take_all():
    while True:
        instances.append(check(libc.inotify_init1(IN_NONBLOCK)))
attempt("inotify_init1 until none is left", take_all)
out["inotify instances"] = len(instances)
attempt("inotify_init", lambda: call(253))  # x86_64's; ENOSYS elsewhere anyway
# Refused before the descriptor is looked at: ENOSYS here, EBADF without the filter.
attempt("inotify_add_watch", lambda: check(libc.inotify_add_watch(
    instances[0] if instances else 0, args["watch"].encode(), IN_ALL)))
FAN_REPORT_FID, FAN_MARK_ADD, FAN_CREATE, FAN_ONDIR = 0x200, 1, 0x100, 0x40000000
attempt("fanotify_init", lambda: check(libc.fanotify_init(FAN_REPORT_FID, 0)))
attempt("fanotify_mark", lambda: check(libc.fanotify_mark(
    0, FAN_MARK_ADD, ctypes.c_uint64(FAN_CREATE | FAN_ONDIR), -100, args["watch"].encode())))
held()
import select, struct
seen = []
for fd in instances[:1]:
    while select.select([fd], [], [], 0.5)[0]:
        buf, i = os.read(fd, 65536), 0
        while i < len(buf):
            length = struct.unpack_from("iIII", buf, i)[3]
            seen.append(buf[i + 16:i + 16 + length].rstrip(b"\0").decode(errors="replace"))
            i += 16 + length
print(json.dumps(seen), flush=True)
'''

INOTIFY_INIT = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                "fd = libc.inotify_init1(0); print(fd >= 0 or os.strerror(ctypes.get_errno()))")


def test_no_watch_sees_host_files_or_takes_the_uids_instances(host: RefusingHost,
                                                              sandbox_dir: Path):
    watched = sandbox_dir.parent
    probe = Probe(host, WATCHES, {"watch": str(watched)})
    secret = "host-secret-" + uuid.uuid4().hex
    try:
        # A host process of the sandbox's uid still gets an inotify instance while the
        # sandbox runs; a file the host makes in a watched directory stays unseen.
        mine = subprocess.run([*as_sandbox_uid(), "/usr/bin/python3", "-c", INOTIFY_INIT],
                              capture_output=True, text=True, check=False, cwd="/")
        (watched / secret).write_text("x")
        (watched / secret).unlink()
    finally:
        rest = probe.finish()
    assert mine.stdout.strip() == "True", mine.stdout + mine.stderr
    assert secret not in rest
    outcome = probe.outcome
    assert outcome["inotify instances"] == 0, outcome
    for name in ("inotify_init1 until none is left", "inotify_init", "inotify_add_watch",
                 "fanotify_init", "fanotify_mark"):
        assert outcome[name] == ["refused", "ENOSYS"], (name, outcome)


def test_tail_follow_falls_back_to_polling(host: RefusingHost):
    done = host.nsbox("run", "--quiet", "--isolation", "landlock", "--", "sh", "-c",
                      "echo one > log; (sleep 1.5; echo two >> log) & "
                      "timeout 4 tail -s 0.2 -f log; true")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["one", "two"], done.stdout + done.stderr


MOUNT_LISTS = r'''
# listmount(req, list, nr, flags) and statmount(req, buf, size, flags) of Linux 6.8, by number
# (x86_64, arm64 and the other shared table): the host's mount table, out of /proc's reach.
class Request(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("spare", ctypes.c_uint32),
                ("mnt_id", ctypes.c_uint64), ("param", ctypes.c_uint64)]
LSMT_ROOT = 0xFFFFFFFFFFFFFFFF
ids = (ctypes.c_uint64 * 64)()
attempt("listmount", lambda: call(458, ctypes.byref(Request(24, 0, LSMT_ROOT, 0)), ids, 64, 0))
buf = ctypes.create_string_buffer(4096)
attempt("statmount", lambda: call(457, ctypes.byref(Request(24, 0, ids[0] or 1, 0x8)), buf,
                                  4096, 0))
held()
'''


def test_the_host_mount_table_cannot_be_listed(host: RefusingHost):
    """/proc is out of reach in this mode, but listmount(2) and statmount(2), which libseccomp
    2.5 does not know by name, listed every host mount with its mount point."""
    probe = Probe(host, MOUNT_LISTS, {})
    probe.finish()
    assert probe.outcome == {"listmount": ["refused", "ENOSYS"],
                             "statmount": ["refused", "ENOSYS"]}, probe.outcome


NEWER_CALLS = r'''
# Calls the kernel (6.17 on) has and no rule of the filter names, by number (the table x86_64
# shares with the other architectures from Linux 5.1 on), on a file of the workspace.
class FileAttr(ctypes.Structure):  # struct file_attr, <linux/fs.h>
    _fields_ = [("xflags", ctypes.c_uint64), ("extsize", ctypes.c_uint32),
                ("nextents", ctypes.c_uint32), ("projid", ctypes.c_uint32),
                ("cowextsize", ctypes.c_uint32)]
open("mine", "w").close()
attr, size = FileAttr(), ctypes.c_size_t(ctypes.sizeof(FileAttr))
attempt("file_getattr", lambda: call(468, -100, b"mine", ctypes.byref(attr), size, 0))
attempt("file_setattr", lambda: call(469, -100, b"mine", ctypes.byref(attr), size, 0))
count, ids = ctypes.c_uint32(64), ctypes.create_string_buffer(64)
attempt("lsm_list_modules", lambda: call(461, ids, ctypes.byref(count), 0))
attempt("lsm_get_self_attr", lambda: call(459, 100, ids, ctypes.byref(count), 0))
attempt("open_tree_attr", lambda: call(467, -100, b".", 0, None, ctypes.c_size_t(0)))
attempt("a number no kernel has yet", lambda: call(471))
# Past the table, allowed on purpose; and an ordinary call.
attempt("mseal", lambda: call(462, None, ctypes.c_size_t(0), 0))
value = ctypes.create_string_buffer(64)
xattr_args = struct.pack("<QII", ctypes.addressof(value), 64, 0)
attempt("getxattrat", lambda: call(464, -100, b"mine", 0, b"user.none", xattr_args,
                                   ctypes.c_size_t(len(xattr_args))))
attempt("listxattrat", lambda: call(465, -100, b"mine", 0, value, ctypes.c_size_t(64)))
attempt("getpid", lambda: call(39) == os.getpid())
# The other ABIs, each in a child: "killed" with the signal, or what the call answered.
def int80(nr):  # mov eax, nr; int 0x80; ret: the i386 entry from a 64-bit process
    import mmap
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(b"\xb8" + struct.pack("<I", nr) + b"\xcd\x80\xc3")
    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
def in_child(name, action):
    child = os.fork()
    if child == 0:
        attempt(name, action)
        os.write(1, (json.dumps(out[name]) + "\n").encode())
        os._exit(0)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        out[name] = ["killed", signal.Signals(os.WTERMSIG(status)).name]
    else:
        out[name] = ["returned", os.WEXITSTATUS(status)]
X32 = 0x40000000
in_child("x32 getpid", lambda: call(X32 | 39))
in_child("x32 file_setattr", lambda: call(X32 | 469, -100, b"mine", ctypes.byref(attr), size, 0))
in_child("i386 getpid", lambda: int80(20))
in_child("i386 file_setattr", lambda: int80(469))
held()
'''

PAST_THE_TABLE = ("file_getattr", "file_setattr", "lsm_list_modules", "lsm_get_self_attr",
                  "open_tree_attr", "a number no kernel has yet")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64's numbers, x32 and int 0x80")
def test_a_call_newer_than_the_filter_is_not_implemented(host: RefusingHost):
    """Past the last number the filter was written against (landlock_filter.TABLE_END), a call
    no rule names answers ENOSYS, as on a kernel without it, before the kernel sees it: here
    file_setattr changed attributes of a file by name and lsm_list_modules answered. The x32
    and i386 entries are killed, with those numbers too, as in every other filter."""
    from nsbox.host import landlock_filter

    numbers = {459, 461, 467, 468, 469, 471}  # the probe's, past the table and not allowed
    assert min(numbers) > landlock_filter.TABLE_END
    assert not numbers & set(landlock_filter._ALLOWED_PAST_TABLE.values())
    probe = Probe(host, NEWER_CALLS, {})
    rest = probe.finish()
    outcome = probe.outcome
    for name in PAST_THE_TABLE:
        assert outcome[name] == ["refused", "ENOSYS"], (name, outcome, rest)
    assert outcome["mseal"] == ["done", "0"], outcome
    assert outcome["getxattrat"] == ["refused", "ENODATA"], outcome
    assert outcome["listxattrat"] == ["done", "0"], outcome
    assert outcome["getpid"] == ["done", "True"], outcome
    for name in ("x32 getpid", "x32 file_setattr", "i386 getpid", "i386 file_setattr"):
        assert outcome[name] == ["killed", "SIGSYS"], (name, outcome, rest)


AIO_SETUP = r'''
context = ctypes.c_ulong(0)
attempt("io_setup", lambda: call(206, 1, ctypes.byref(context)))  # x86_64's number
held()
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64's number of io_setup")
def test_no_aio_context_takes_the_hosts(host: RefusingHost):
    """The kernel's AIO contexts are one count for the whole host (fs.aio-max-nr): io_setup
    answers ENOSYS here, as in the namespace mode (tests/test_shared_limits.py)."""
    probe = Probe(host, AIO_SETUP, {})
    rest = probe.finish()
    assert probe.outcome == {"io_setup": ["refused", "ENOSYS"]}, (probe.outcome, rest)
