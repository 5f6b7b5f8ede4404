"""The socket scan walks /usr/local like any bound tree, though it skips the package-managed
rest of /usr (rules.SCANNED_INSIDE): the default policy binds /usr, which carries /usr/local.

A socket or FIFO there is simulated without touching the host: a directory of the test's,
holding one, is bind-mounted over /usr/local in a private mount namespace, and nsbox runs
with the default policy inside it. As root, as root of a user namespace and as an unprivileged
uid in that namespace."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, UNPRIVILEGED_UID, require
from sessiontools import NESTED_MAPS, USERNS

LAUNCH = """
import json, sys
sys.path.insert(0, sys.argv[1])
import nsbox
try:
    r = nsbox.run(["/usr/bin/true"])
    print(json.dumps({"status": r.status.value}))
except nsbox.PolicyError as e:
    print(json.dumps({"rule": e.rule, "message": str(e)}))
"""


@pytest.fixture
def local_tree() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nsbox-usr-local-", dir="/tmp"))
    (path / "lib" / "service").mkdir(parents=True)
    (path / "bin").mkdir()
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _launch(mode: str, tree: Path, local: Path) -> dict:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "needs root and unshare(1) for a mount namespace of the test's own")
    inner = [PYTHON, "-I", "-c", LAUNCH, str(tree)]
    if mode == "unprivileged":
        inner = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                 "--clear-groups", "--", *inner]
    mount = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
             f'mount --bind "{local}" /usr/local; exec "$@"', "sh", *inner]
    argv = mount if mode == "caller" else [PYTHON, str(USERNS), NESTED_MAPS, NESTED_MAPS, *mount]
    proc = subprocess.run(argv, capture_output=True, timeout=60, cwd="/",
                          env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("mode", ["caller", "nested", "unprivileged"])
def test_a_socket_or_fifo_in_usr_local_refuses_the_default_launch(
        mode: str, public_tree: Path, local_tree: Path) -> None:
    assert _launch(mode, public_tree, local_tree) == {"status": "OK"}  # scanned, clean
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(local_tree / "lib" / "service" / "control.sock"))
    try:
        refused = _launch(mode, public_tree, local_tree)
        assert refused["rule"] == "host-socket", refused
        assert "/usr/local/lib/service/control.sock is a unix socket" in refused["message"]
    finally:
        listener.close()
        (local_tree / "lib" / "service" / "control.sock").unlink()
    os.mkfifo(local_tree / "bin" / "pipe")
    refused = _launch(mode, public_tree, local_tree)
    assert refused["rule"] == "host-socket"
    assert "/usr/local/bin/pipe is a FIFO" in refused["message"]


def test_the_scan_of_usr_skips_only_what_packages_manage(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, with the trees moved under tmp_path: a socket in the package-managed part
    is not looked for, one in its local part is, whichever of the two is bound."""
    from nsbox.errors import PolicyError
    from nsbox.host import pathrules

    usr = tmp_path / "usr"
    (usr / "lib").mkdir(parents=True)
    (usr / "local" / "lib").mkdir(parents=True)
    monkeypatch.setattr(pathrules, "UNSCANNED_TREES", (str(usr),))
    monkeypatch.setattr(pathrules, "SCANNED_INSIDE", (str(usr / "local"),))
    packaged = socket.socket(socket.AF_UNIX)
    packaged.bind(str(usr / "lib" / "packaged.sock"))
    try:
        for source in (usr, usr / "lib"):
            assert pathrules.check_source(str(source), writable=False, allow=(), key="k",
                                          host=pathrules.HostView()) == str(source)
        local = socket.socket(socket.AF_UNIX)
        local.bind(str(usr / "local" / "lib" / "local.sock"))
        for source in (usr, usr / "local", usr / "local" / "lib"):
            with pytest.raises(PolicyError) as info:
                pathrules.check_source(str(source), writable=False, allow=(), key="k",
                                       host=pathrules.HostView())
            assert info.value.rule == "host-socket" and "local.sock" in str(info.value)
        local.close()
    finally:
        packaged.close()
