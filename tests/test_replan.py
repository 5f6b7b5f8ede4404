"""The same Policy launched again after the host changed: the plan build remembers what it can
(nsbox/host/pathrules.py: the mount table until the kernel marks it changed, what a place
passed), and none of it may let a changed host through. Each case launches once (accepted),
changes the host between the two launches, and launches the very same Policy object again,
which must be refused by the rule that fits the new host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, UNPRIVILEGED_UID, Runner, require

# Runs in a fresh process (as the caller, or as the unprivileged uid): for each case, make the
# tree, wait until every directory is settled (the socket scan remembers only directories whose
# ctime is 2 s old), launch, change the host, launch the same Policy again.
DRIVER = textwrap.dedent("""\
    import json, os, socket, subprocess, sys, time
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["path"])
    import nsbox
    from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, Policy

    tmp = spec["tmp"]

    def path(name):
        return os.path.join(tmp, name)

    def make_socket(where):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(where)
        listener.close()

    def swap_to_link(name, points_to):
        os.rename(path(name), path(name + ".old"))
        os.symlink(points_to, path(name))

    CASES = {
        # a unix socket appears in a bound tree that was scanned clean
        "socket": ("sock/sub", False, lambda: make_socket(path("sock/sub/deep/late.sock"))),
        # a writable bind: the same, with the writable rules in the remembered answer
        "socket-writable": ("wsock/sub", True, lambda: make_socket(path("wsock/sub/late.sock"))),
        # the bound directory is replaced by a symlink to a tree that holds a socket
        "link-to-socket-tree": ("linked", False, lambda: swap_to_link("linked", path("ipc"))),
        # ... by a symlink to the host's /run
        "link-to-run": ("torun", False, lambda: swap_to_link("torun", "/run")),
        # a parent directory of the bound one becomes a symlink into /proc
        "parent-link-to-proc": ("parent/net", False, lambda: swap_to_link("parent",
                                                                         "/proc/self")),
        # a bind mount of /run over the bound directory (a private mount namespace)
        "mount-run-over": ("over", False, lambda: subprocess.run(
            ["mount", "--bind", "/run", path("over")], check=True)),
        # a proc filesystem mounted below the bound directory
        "mount-proc-below": ("below/sub", False, lambda: subprocess.run(
            ["mount", "-t", "proc", "proc", path("below/sub/deep")], check=True)),
    }
    cases = {name: CASES[name] for name in spec["cases"]}
    for bound, writable, _change in cases.values():
        os.makedirs(path(bound + "/deep"))
        if writable and os.geteuid() == 0:  # as root, a writable bind must not be root's
            os.chown(path(bound), 65534, 65534)
    os.makedirs(path("ipc/a"))
    make_socket(path("ipc/a/agent.sock"))
    time.sleep(2.2)
    out = {}
    for name, (bound, writable, change) in cases.items():
        policy = Policy(mounts=DEFAULT_MOUNTS + (Bind(path(bound), "/x", writable=writable),))
        first = nsbox.run(["/bin/true"], policy, timeout=20)
        change()
        try:
            nsbox.run(["/bin/true"], policy, timeout=20)
            second = "accepted"
        except nsbox.PolicyError as exc:
            second = exc.rule
        out[name] = [first.status.value, first.exit_code, second]
    print(json.dumps(out))
    """)

EXPECTED = {
    "socket": "host-socket",
    "socket-writable": "host-socket",
    "link-to-socket-tree": "host-socket",
    "link-to-run": "bind-run",
    "parent-link-to-proc": "bind-proc",
    "mount-run-over": "bind-run",
    "mount-proc-below": "bind-proc",
}
FILE_CASES = ["socket", "socket-writable", "link-to-socket-tree", "link-to-run",
              "parent-link-to-proc"]


def drive(command: list[str], spec: dict[str, object]) -> dict[str, list[object]]:
    done = subprocess.run([*command, "-c", DRIVER, json.dumps(spec)], capture_output=True,
                          text=True, timeout=300, cwd="/", env={"PATH": "/usr/bin:/bin"},
                          check=False)
    assert done.returncode == 0, done.stderr
    found: dict[str, list[object]] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_a_changed_tree_or_link_refuses_the_second_launch(sandbox: Runner,
                                                          unprivileged_tmp: Path) -> None:
    """As the caller and as uid 65534: sockets that appear, symlinks planted in the path."""
    tmp = unprivileged_tmp / "cases"
    if sandbox.mode == "caller":
        command = [sys.executable, "-I"]
        path = str(REPO)
    else:
        command = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                   "--clear-groups", "--", PYTHON, "-I"]
        path = str(sandbox.tree)
    tmp.mkdir()
    if sandbox.mode != "caller":
        os.chown(tmp, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    found = drive(command, {"path": path, "tmp": str(tmp), "cases": FILE_CASES})
    assert found == {name: ["OK", 0, EXPECTED[name]] for name in FILE_CASES}


def test_a_mount_between_launches_refuses_the_second_launch(tmp_path: Path) -> None:
    """A mount changes what a bound path is without changing how it is spelled: the mount
    table the rules look at must be the new one (a private mount namespace: the host's
    mounts are not touched)."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "a mount between launches needs a private mount namespace: root and unshare(1)")
    cases = ["mount-run-over", "mount-proc-below"]
    command = ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-I"]
    found = drive(command, {"path": str(REPO), "tmp": str(tmp_path), "cases": cases})
    assert found == {name: ["OK", 0, EXPECTED[name]] for name in cases}


def test_mountinfo_is_read_again_after_a_mount_and_in_a_forked_child(tmp_path: Path) -> None:
    """The kept /proc/self/mountinfo is read again when the kernel marks it (proc(5)), and a
    forked child opens its own: its poll must not clear the parent's mark."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "a mount needs a private mount namespace: root and unshare(1)")
    script = textwrap.dedent("""\
        import json, os, subprocess, sys
        sys.path.insert(0, sys.argv[1])
        from nsbox.host.pathrules import read_mountinfo
        target = sys.argv[2]
        seen = [target in read_mountinfo()]
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", target], check=True)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if target in read_mountinfo() else 1)
        _, status = os.waitpid(pid, 0)
        seen += [os.waitstatus_to_exitcode(status) == 0, target in read_mountinfo()]
        subprocess.run(["umount", target], check=True)
        seen.append(target in read_mountinfo())
        print(json.dumps(seen))
        """)
    target = tmp_path / "mnt"
    target.mkdir()
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                           sys.executable, "-I", "-c", script, str(REPO), str(target)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [False, True, True, False]


@pytest.mark.parametrize("allow", [(), ("host-socket",)])
def test_an_answer_is_remembered_only_for_the_same_rules_lifted(tmp_path: Path,
                                                                allow: tuple[str, ...]) -> None:
    """What a place passed with a rule lifted does not carry over to a policy without it."""
    from nsbox.errors import PolicyError
    from nsbox.plan import plan
    from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, Policy

    (tmp_path / "tree").mkdir()
    os.mkfifo(tmp_path / "tree" / "pipe")
    lifted = Policy(mounts=DEFAULT_MOUNTS + (Bind(str(tmp_path / "tree"), "/x"),),
                    allow_rules=("host-socket",))
    plain = Policy(mounts=DEFAULT_MOUNTS + (Bind(str(tmp_path / "tree"), "/x"),),
                   allow_rules=allow)
    plan.build(lifted, ["true"])
    if allow:
        assert plan.build(plain, ["true"]).mounts
        return
    with pytest.raises(PolicyError) as info:
        plan.build(plain, ["true"])
    assert info.value.rule == "host-socket"
