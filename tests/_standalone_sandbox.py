"""A stand-in for nsbox.run until the core lands: unshare(1) for user/mount/pid namespaces, a
private /tmp, the binds under /tmp, then the seccomp program, then exec. Test scaffolding."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys

from nsbox import seccomp as sc
from nsbox.policy import Policy
from nsbox.result import Result, Status

_INNER = r"""
import json, os, socket, sys
from nsbox import _libc as L
from nsbox._seccomp_notify import SECCOMP_FILTER_FLAG_NEW_LISTENER
spec = json.loads(sys.argv[1])
fds = [os.open(src, os.O_PATH) for src, _ in spec["binds"]]
L.mount("tmpfs", "/tmp", "tmpfs", 0, "size=256m")
for fd, (_, target) in zip(fds, spec["binds"]):
    os.makedirs("/tmp" + target)
    L.mount(f"/proc/self/fd/{fd}", "/tmp" + target, None, L.MS_BIND | L.MS_REC)
    os.close(fd)
os.chdir("/tmp")
L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
bpf = bytes.fromhex(spec["bpf"])
if spec["listener"]:
    sock = socket.socket(fileno=spec["sock"])
    fd = L.seccomp_set_filter(bpf, SECCOMP_FILTER_FLAG_NEW_LISTENER)
    socket.send_fds(sock, [b"l"], [fd])
    os.close(fd)
    sock.close()
else:
    L.seccomp_set_filter(bpf)
argv = spec["argv"]
os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
"""


def run(argv: list[str], policy: Policy) -> Result:
    from nsbox._seccomp_notify import DeniedSyscalls

    program = sc.load(policy.seccomp)
    binds = [(m.source, m.target) for m in policy.mounts
             if getattr(m, "kind", "") == "bind" and m.source not in
             ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache",
              "/etc/alternatives")]
    for _source, target in binds:
        argv = [a.replace(target + "/", "/tmp" + target + "/") for a in argv]
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = {"binds": binds, "bpf": program.bpf.hex(), "listener": program.listener,
            "argv": argv, "sock": child.fileno()}
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(sc.__file__)))
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork",
         sys.executable, "-c", _INNER, json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(child.fileno(),),
        env=env,
    )
    child.close()
    extra: dict = {}
    if program.listener:
        _, fds, _, _ = socket.recv_fds(parent, 16, 1)
        denied = DeniedSyscalls(fds[0], program.notify or {})
        out_chunks: list[bytes] = []
        err_chunks: list[bytes] = []
        streams = {proc.stdout: out_chunks, proc.stderr: err_chunks}
        watch: list = [denied, proc.stdout, proc.stderr]
        while streams or denied in watch:
            ready, _, _ = select.select(watch, [], [], 30)
            for r in ready:
                if r is denied:
                    if not denied.handle():
                        watch.remove(denied)
                else:
                    data = os.read(r.fileno(), 65536)
                    if data:
                        streams[r].append(data)
                    else:
                        watch.remove(r)
                        del streams[r]
        denied.close()
        proc.wait()
        stdout, stderr = b"".join(out_chunks), b"".join(err_chunks)
        extra["seccomp_denied"] = sc.denied_names(program, denied.counts)
    else:
        stdout, stderr = proc.communicate(timeout=120)
    parent.close()
    code = proc.returncode
    if code < 0:  # unshare(1) dies of its child's signal
        return Result(Status.SG, signal=-code, stdout=stdout, stderr=stderr, extra=extra)
    return Result(Status.OK if code == 0 else Status.RE, exit_code=code, stdout=stdout,
                  stderr=stderr, extra=extra)
