"""Run a command in a network namespace of the test's own where ADDRESS is another host.

usage (as root): _farhost.py ADDRESS COUNT COMMAND...

The command runs in a new network namespace (the near side). ADDRESS lives in a second one (the
far side), behind a veth pair: to the near side it is a host on the internet, not one of its
own addresses, which the proxy refuses (rule "this host", docs/network.md). COUNT sockets
listening on ADDRESS in the far side are passed to the command, their numbers in
NSBOX_TEST_FAR_FDS, so the command's servers run there while the command stays near. Both
namespaces end with the command and its sockets: the machine's network is untouched.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys

CLONE_NEWNET = 0x40000000
NEAR_ADDRESS = "1.2.3.5"
_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args: int) -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def main() -> None:
    address, count, command = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    _call("unshare", CLONE_NEWNET)
    near = os.open("/proc/self/ns/net", os.O_RDONLY)
    _call("unshare", CLONE_NEWNET)
    far = os.open("/proc/self/ns/net", os.O_RDONLY)
    _call("setns", near, CLONE_NEWNET)
    far_path = f"/proc/{os.getpid()}/fd/{far}"
    steps = [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "name", "nsbox-near", "type", "veth", "peer", "name", "nsbox-far"],
        ["ip", "link", "set", "nsbox-far", "netns", far_path],
        ["ip", "addr", "add", f"{NEAR_ADDRESS}/32", "dev", "nsbox-near"],
        ["ip", "link", "set", "nsbox-near", "up"],
        ["ip", "route", "add", f"{address}/32", "dev", "nsbox-near"],
    ]
    far_ip = ["nsenter", f"--net={far_path}", "ip"]
    steps += [
        [*far_ip, "link", "set", "lo", "up"],
        [*far_ip, "addr", "add", f"{address}/32", "dev", "nsbox-far"],
        [*far_ip, "link", "set", "nsbox-far", "up"],
        [*far_ip, "route", "add", f"{NEAR_ADDRESS}/32", "dev", "nsbox-far"],
    ]
    for step in steps:
        subprocess.run(step, check=True)
    _call("setns", far, CLONE_NEWNET)
    listeners = [socket.create_server((address, 0)) for _ in range(count)]
    _call("setns", near, CLONE_NEWNET)
    os.close(far)
    os.close(near)
    for sock in listeners:
        sock.set_inheritable(True)
    os.environ["NSBOX_TEST_FAR_FDS"] = ",".join(str(s.fileno()) for s in listeners)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
