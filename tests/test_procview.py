"""No host path of the caller and no host block device name can be read in a sandbox's /proc,
except what the kernel itself shows of a bind mount (docs/threat-model.md, "What /proc shows").

A probe reads every command line, environment and mount table in /proc of a single run, a
session and a pooled sandbox, as the caller and as an unprivileged uid; the host side looks for
the caller's checkout, interpreter, home and working directory, the host directories it bound,
and the names of the host's block devices (in the files, and as names of entries in /proc).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, UNPRIVILEGED_UID

PROBE = r"""
import json, os
seen = {}
pids = sorted(p for p in os.listdir("/proc") if p.isdigit())
for pid in pids + ["self", "thread-self"]:
    for name in ("cmdline", "environ", "mountinfo", "mountstats", "mounts"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                seen[f"{pid}/{name}"] = f.read().decode("utf-8", "replace")
        except OSError as exc:
            seen[f"{pid}/{name}"] = f"error {exc.errno}"
for name in ("cmdline", "partitions", "diskstats", "swaps"):
    with open(f"/proc/{name}", "rb") as f:
        seen[name] = f.read().decode("utf-8", "replace")
# The names of everything in /proc that is not a process (/proc/fs/ext4/vda, say).
names = []
for top, dirs, files in os.walk("/proc"):
    if top == "/proc":
        dirs[:] = [d for d in dirs if not d.isdigit() and d not in ("self", "thread-self")]
    names += dirs + files
print(json.dumps({"pids": pids, "seen": seen, "names": names}))
"""

SCRIPT = r"""
import json, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, args["path"])
import nsbox
from nsbox import Bind, Policy
from nsbox.policy.policy import DEFAULT_MOUNTS

policy = Policy().replace(mounts=DEFAULT_MOUNTS + (Bind(args["data"], "/data"),),
                          workspace=args["workspace"])
argv = ["python3", "-c", args["probe"]]
out = {"run": nsbox.run(argv, policy)}
with nsbox.Session(policy) as session:
    out["session"] = session.run(argv)
with nsbox.Pool(policy, size=1) as pool:
    out["pool"] = pool.run(argv)
print(json.dumps({kind: [r.status.value, r.stdout.decode(), r.stderr.decode()]
                  for kind, r in out.items()}))
"""


@pytest.fixture
def host_dirs() -> Iterator[dict[str, Path]]:
    """The caller's working directory, and the two directories it binds."""
    with tempfile.TemporaryDirectory(prefix="nsbox-proc-", dir="/tmp") as top:
        base = Path(top)
        base.chmod(0o755)
        dirs = {name: base / name for name in ("cwd", "workspace", "data")}
        for path in dirs.values():
            path.mkdir(mode=0o777)
            path.chmod(0o777)
        yield dirs


def host_block_devices() -> list[str]:
    with open("/proc/partitions") as f:
        return [line.split()[3] for line in f.read().splitlines()[2:] if line.strip()]


def mount_tables_only(key: str, line: str, needle: str) -> bool:
    """Whether ``needle`` shows in ``line`` only where a mount table names a bind's source.

    mountinfo: field 4 is the mount's root within its filesystem, the field after " - " and
    the type is the source (proc(5)); mounts: field 1 is the source; mountstats: "device X".
    """
    fields = line.split()
    kind = key.rsplit("/", 1)[-1]
    if kind == "mountinfo":
        source = fields.index("-") + 2
        allowed = {3, source}
    elif kind == "mounts":
        allowed = {0}
    elif kind == "mountstats" and fields[0] == "device":
        allowed = {1}
    else:
        return False
    rest = " ".join(field for index, field in enumerate(fields) if index not in allowed)
    return any(fields[index] == needle for index in allowed) and needle not in rest


@pytest.mark.parametrize("mode", ["caller", "unprivileged"])
def test_proc_shows_no_host_paths_or_devices(mode: str, public_tree: Path,
                                             host_dirs: dict[str, Path]):
    if mode == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'caller' run covers it")
    tree = REPO if mode == "caller" else public_tree
    args = json.dumps({"path": str(tree), "probe": PROBE, "workspace": str(host_dirs["workspace"]),
                       "data": str(host_dirs["data"])})
    if mode == "caller":
        command = [sys.executable, "-c", SCRIPT, args]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    else:
        command = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                   "--clear-groups", "--", PYTHON, "-I", "-c", SCRIPT, args]
        env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run(command, capture_output=True, timeout=120, cwd=host_dirs["cwd"],
                          env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    results = json.loads(proc.stdout.splitlines()[-1])

    # Never anywhere: the checkout, the interpreter's environment, home, working directory.
    secrets = {str(tree), str(host_dirs["cwd"]), sys.prefix, os.path.dirname(sys.executable)}
    if mode == "caller" and Path.home() != Path("/"):
        secrets.add(str(Path.home()) + "/")
    # Bound directories: in the mount tables, as the root of their own bind, and nowhere else.
    bound = [str(host_dirs["workspace"]), str(host_dirs["data"])]
    devices = ["/dev/" + name for name in host_block_devices()]
    assert devices, "the host lists no block device: nothing to look for"
    for kind, (status, out, err) in results.items():
        assert status == "OK", (kind, err)
        report = json.loads(out)
        seen = report["seen"]
        # Host-wide files that name devices, swap files or the boot arguments read empty.
        assert [seen[name] for name in ("cmdline", "partitions", "diskstats", "swaps")] == [
            ""] * 4, kind
        # No entry of /proc is named after a host block device.
        assert report["names"] and not set(report["names"]) & set(host_block_devices()), kind
        # A run, a pooled sandbox or a command of a session holds its init (pid 1) and the
        # command (2): a session's command has a /proc of its own pid namespace.
        assert report["pids"] == ["1", "2"], (kind, report["pids"])
        for key, text in seen.items():
            for line in text.replace("\0", "\n").splitlines():
                for secret in secrets:
                    assert secret not in line, (kind, key, line)
                for needle in bound + devices:
                    if needle in line:
                        assert mount_tables_only(key, line, needle), (kind, key, line)
        # The init of a session's command (a fork of the session's) shows a fixed title; its
        # environment is closed (not dumpable).
        if kind == "session":
            assert seen["1/cmdline"] == "nsbox._helper\0", seen["1/cmdline"]
            assert seen["1/environ"] == "error 13"
