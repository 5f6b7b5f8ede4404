"""Run a command in a new user namespace whose maps are written from outside, as root does for a
container: ``python3 _userns.py UID_MAP GID_MAP COMMAND...`` with maps as "0 0 1,65534 65534 1".

util-linux's ``unshare -Ur`` maps only 0 to 0; a container runtime maps ranges. The child
unshares, the parent (which holds CAP_SETUID and CAP_SETGID here) writes the maps, then the
child execs the command; the exit status is the command's.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000


def main() -> int:
    uid_map, gid_map, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER) != 0:
            os._exit(125)
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":
            os._exit(125)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        os.execvp(argv[0], argv)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) != b"1":
        return 125
    for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text.replace(",", "\n") + "\n")
    os.write(go_w, b"1")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    sys.exit(main())
