"""The sandbox never acts as, or leaves behind, a privileged host identity
(nsbox/policy/identity.py).

Every attack runs inside a real sandbox; the evidence is read from the host: the modes, owners
and xattrs of what is left in the writable directories, the host uid of the sandboxed process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, Runner, processes_with, require

import nsbox
from nsbox.errors import HostError, PolicyError
from nsbox.policy import identity
from nsbox.policy.policy import Bind, Policy, Seccomp, SeccompRule
from nsbox.result import Status

USERNS = Path(__file__).with_name("_userns.py")
SETPRIV = shutil.which("setpriv")
UNSHARE = shutil.which("unshare")

# Inside the sandbox: every route to a set-id file, each reported as "ok" or its errno's name.
BATTERY = r"""
import ctypes, errno, json, os, stat, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, action):
    try:
        result = action()
        if isinstance(result, int) and result < 0:
            raise OSError(ctypes.get_errno(), "")
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
AT_FDCWD = -100
attempt("chmod 4755", lambda: os.chmod("f", 0o4755))
attempt("chmod 2755", lambda: os.chmod("f", 0o2755))
attempt("fchmod 4755", lambda: os.fchmod(os.open("f", os.O_RDONLY), 0o4755))
attempt("fchmodat 6755", lambda: os.chmod("f", 0o6755, dir_fd=os.open(".", os.O_RDONLY)))
attempt("fchmodat2 4755", lambda: libc.syscall(452, AT_FDCWD, b"f", 0o4755, 0))
attempt("lchmod 4755", lambda: os.chmod("f", 0o4755, follow_symlinks=False))
attempt("open O_CREAT 4755", lambda: os.open("o1", os.O_CREAT | os.O_WRONLY, 0o4755))
attempt("openat O_CREAT 2755", lambda: os.open("o2", os.O_CREAT | os.O_WRONLY, 0o2755,
                                               dir_fd=os.open(".", os.O_RDONLY)))
attempt("creat 4755", lambda: libc.creat(b"c1", 0o4755))
attempt("O_TMPFILE 4755", lambda: os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o4755))
attempt("mknod 4755", lambda: os.mknod("m1", stat.S_IFREG | 0o4755))
attempt("mknod chr", lambda: os.mknod("m2", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("mkdir 2755", lambda: os.mkdir("d1", 0o2755))
how = struct.pack("QQQ", os.O_CREAT | os.O_WRONLY, 0o4755, 0)
attempt("openat2", lambda: libc.syscall(437, AT_FDCWD, b"o3", how, len(how)))
# A file capability (VFS_CAP_REVISION_2, cap_setuid permitted and effective).
cap = struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0)
attempt("setxattr security.capability", lambda: os.setxattr("f", "security.capability", cap))
attempt("chmod 0777 /workspace", lambda: os.chmod("/workspace", 0o777))
tools = {"install -m 4755": ["install", "-m", "4755", "/usr/bin/id", "i1"],
         "cp -p setuid": ["cp", "-p", "/usr/bin/chfn", "cp1"],
         "tar xpf": ["tar", "xpf", "/in/setid.tar"]}
for name, argv in tools.items():
    done = subprocess.run(argv, capture_output=True)
    out[name] = done.returncode
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    if fields[4] in ("/workspace", "/in"):
        out["options " + fields[4]] = sorted(set(fields[5].split(",")) & {"nosuid", "nodev"})
print(json.dumps(out))
"""

EXPECTED = {
    "chmod 4755": "EPERM", "chmod 2755": "EPERM", "fchmod 4755": "EPERM",
    "fchmodat 6755": "EPERM", "fchmodat2 4755": "EPERM", "lchmod 4755": "EPERM",
    "open O_CREAT 4755": "EPERM", "openat O_CREAT 2755": "EPERM", "creat 4755": "EPERM",
    "O_TMPFILE 4755": "EPERM", "mknod 4755": "EPERM", "mknod chr": "EPERM",
    "mkdir 2755": "EPERM", "openat2": "ENOSYS", "setxattr security.capability": "EPERM",
}

# Policies that try to lift the rules: no seccomp at all, and rules allowing every route.
_ROUTES = ("chmod", "fchmod", "fchmodat", "fchmodat2", "open", "openat", "openat2", "creat",
           "mknod", "mknodat", "mkdir", "mkdirat")
SECCOMP_VARIANTS = {
    "default": None,
    "disabled": Seccomp(enabled=False),
    "allow rules": Seccomp(rules=tuple(SeccompRule(name, "allow") for name in _ROUTES)),
}


@pytest.fixture(scope="module")
def inputs() -> Iterator[Path]:
    """A read-only input directory with a tar holding set-id files and a setgid directory."""
    path = Path(tempfile.mkdtemp(prefix="nsbox-setid-in-", dir="/tmp"))
    path.chmod(0o755)
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for name, mode, kind in (("suid", 0o4755, tarfile.REGTYPE),
                                 ("sgid", 0o2755, tarfile.REGTYPE),
                                 ("sgdir", 0o2775, tarfile.DIRTYPE)):
            info = tarfile.TarInfo(name)
            info.mode, info.type, info.size = mode, kind, 0
            tar.addfile(info, io.BytesIO(b""))
    (path / "setid.tar").write_bytes(data.getvalue())
    (path / "setid.tar").chmod(0o644)
    yield path
    shutil.rmtree(path)


def make_workspace(owner: int, mode: int = 0o700) -> Path:
    path = Path(tempfile.mkdtemp(prefix="nsbox-ws-", dir="/tmp"))
    (path / "f").write_text("data\n")
    for item in (path / "f", path):
        os.chown(item, owner, owner)
    path.chmod(mode)
    return path


def scan(directory: Path) -> list[str]:
    """What must never be found in a writable host directory after a run."""
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(f"{path}: set-id mode {stat.S_IMODE(st.st_mode):o}")
            if 0 in (st.st_uid, st.st_gid):
                found.append(f"{path}: owned by {st.st_uid}:{st.st_gid}")
            if not stat.S_ISLNK(st.st_mode) and "security.capability" in os.listxattr(path):
                found.append(f"{path}: security.capability")
    return found


def owners_for(runner: Runner) -> list[int]:
    """Workspace owners to try: as root, a user's directory (idmapped) and one of the sandbox's
    host uid (bound as it is); unprivileged, the caller's own."""
    return [65534] if runner.unprivileged else [1234, 65534]


@pytest.mark.parametrize("variant", SECCOMP_VARIANTS)
def test_no_route_plants_a_set_id_file(sandbox: Runner, inputs: Path, variant: str) -> None:
    seccomp = SECCOMP_VARIANTS[variant]
    for owner in owners_for(sandbox):
        workspace = make_workspace(owner)
        try:
            kwargs: dict = {"workspace": str(workspace), "binds": [[str(inputs), "/in"]]}
            if seccomp is not None:
                import dataclasses

                kwargs["seccomp"] = dataclasses.asdict(seccomp)
            result = sandbox.run([PYTHON, "-c", BATTERY], **kwargs)
            assert result.status is Status.OK, result.stderr
            out = json.loads(result.stdout)
            assert {k: out[k] for k in EXPECTED} == EXPECTED, (owner, out)
            # install and tar report the refused chmod; cp -p drops set-id bits it cannot
            # keep with the owner (POSIX), quietly: the scan below is the evidence for all.
            assert (out["install -m 4755"], out["tar xpf"]) == (1, 2), out
            # The sandbox owns the directory (idmapped, or its own uid): the chmod works inside,
            # and the helper puts the mode back when the sandbox ends.
            assert out["chmod 0777 /workspace"] == "ok", out
            assert out["options /workspace"] == out["options /in"] == ["nodev", "nosuid"], out
            # From the host: nothing set-id, no file capability, nothing of root's, and the
            # directory's mode as it was (the sandbox may own it and chmod it meanwhile).
            assert scan(workspace) == []
            assert stat.S_IMODE(workspace.stat().st_mode) == 0o700
            assert workspace.stat().st_uid == owner
        finally:
            shutil.rmtree(workspace)


def test_files_made_in_a_root_owned_world_writable_directory_are_not_roots() -> None:
    require(os.geteuid() == 0, "needs root: the directory is root's")
    workspace = make_workspace(0, 0o777)
    try:
        result = nsbox.run(["sh", "-c", "echo x > new && mkdir sub && chmod 700 /workspace"],
                           workspace=str(workspace))
        assert result.status is Status.RE  # chmod: the sandbox does not own the directory
        assert b"Operation not permitted" in result.stderr
        new = workspace / "new"
        assert (new.stat().st_uid, new.stat().st_gid) == (65534, 65534)
        assert [p for p in scan(workspace) if "/f:" not in p] == []  # f is the test's own
        assert stat.S_IMODE(workspace.stat().st_mode) == 0o777
    finally:
        shutil.rmtree(workspace)


def test_a_users_directory_of_group_0_is_not_idmapped() -> None:
    """An idmap would make the sandbox's files group 0: the directory is bound as it is."""
    require(os.geteuid() == 0, "needs root: the directory's group is root's")
    workspace = make_workspace(1234, 0o777)
    os.chown(workspace, 1234, 0)
    try:
        result = nsbox.run(["sh", "-c", "echo x > new"], workspace=str(workspace))
        assert result.ok, result.stderr
        new = workspace / "new"
        assert (new.stat().st_uid, new.stat().st_gid) == (65534, 65534)
    finally:
        shutil.rmtree(workspace)


@pytest.mark.parametrize("mode", [0o755, 0o700])
def test_a_root_owned_workspace_it_cannot_write_is_refused_with_the_remedy(mode: int) -> None:
    require(os.geteuid() == 0, "needs root: the directory is root's")
    workspace = make_workspace(0, mode)
    try:
        with pytest.raises(HostError) as info:
            nsbox.run(["touch", "planted"], workspace=str(workspace))
        assert info.value.feature == "identity"
        assert f"{workspace} (owner 0:0, mode {mode:o}) is not writable" in str(info.value)
        assert info.value.hint is not None
        assert f"chown 65534:65534 {workspace}" in info.value.hint
        assert sorted(p.name for p in workspace.iterdir()) == ["f"]
    finally:
        shutil.rmtree(workspace)


def test_a_setgid_directory_of_group_0_is_refused() -> None:
    require(os.geteuid() == 0, "needs root: the directory's group is root's")
    workspace = make_workspace(0, 0o2777)
    try:
        with pytest.raises(HostError) as info:
            nsbox.run(["touch", "planted"], workspace=str(workspace))
        assert "setgid directory of group 0" in str(info.value)
        assert info.value.hint == f"chmod g-s {workspace}, or bind a directory of an " \
                                  "unprivileged user"
        assert sorted(p.name for p in workspace.iterdir()) == ["f"]
    finally:
        shutil.rmtree(workspace)


# --- the policy and the helper refuse host id 0 -------------------------------------------------


@pytest.mark.parametrize("changes", [{"host_uid": 0}, {"host_gid": 0}, {"host_uid": -1},
                                     {"host_gid": 2**32 - 1}, {"host_uid": "65534"}])
def test_policy_refuses_a_privileged_or_invalid_host_id(changes: dict) -> None:
    key = next(iter(changes))
    with pytest.raises(PolicyError) as info:
        Policy(**changes)
    assert info.value.key == key
    with pytest.raises(PolicyError):
        Policy().replace(**changes)


def test_a_hand_made_plan_with_host_uid_0_does_not_run(tmp_path: Path) -> None:
    """Defense in depth: the helper decides again and refuses, whatever the plan says."""
    require(os.geteuid() == 0, "as a regular user the policy's host ids are not used")
    from nsbox.launch import launcher
    from nsbox.plan import plan as planmod

    wire = planmod.build(Policy(), ["/bin/sh", "-c", f"touch {tmp_path}/ran"]).to_wire()
    wire.update(host_uid=0, host_gid=0)
    with pytest.raises(HostError) as info:
        launcher.launch_wire(wire, None, 1 << 20, False)
    assert info.value.feature == "identity"
    assert "the policy's host_uid/host_gid is uid 0" in str(info.value)
    assert not (tmp_path / "ran").exists()


# --- the decision, for the launchers this host can be made to be -------------------------------


def held(euid: int, caps: tuple[int, ...], uid_map: str) -> identity.Holdings:
    return identity.Holdings(euid, euid, sum(1 << c for c in caps),
                             identity.parse_map(uid_map), identity.parse_map(uid_map))


ALL = (identity.CAP_SETUID, identity.CAP_SETGID, identity.CAP_SYS_ADMIN)


def test_decision_for_each_kind_of_launcher() -> None:
    host_root = identity.decide(held(0, ALL, "0 0 4294967295"), 65534, 65534)
    assert (host_root.parent_uid, host_root.mapper) == (65534, True)
    regular = identity.decide(held(1000, (), "0 0 4294967295"), 65534, 65534)
    assert (regular.uid, regular.parent_uid, regular.mapper) == (1000, 1000, False)
    rootless = identity.decide(held(0, ALL, "0 1000 1\n1 100000 65536"), 65534, 65534)
    assert rootless.parent_uid == 100000 + 65533
    refused = {
        "unshare -Ur as root": (held(0, ALL, "0 0 1"), "is not mapped in this user namespace"),
        "root without CAP_SETUID": (held(0, (identity.CAP_SYS_ADMIN,), "0 0 4294967295"),
                                    "without CAP_SETUID and CAP_SETGID"),
        "uid 1000 that is root outside": (held(1000, (), "1000 0 1"),
                                          "is uid 0 of the parent user namespace"),
    }
    for name, (holdings, reason) in refused.items():
        with pytest.raises(HostError) as info:
            identity.decide(holdings, 65534, 65534)
        assert reason in str(info.value), name
        assert info.value.hint, name


# --- nested user namespaces and missing capabilities, on the real kernel ------------------------


NESTED_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import nsbox
from nsbox.policy.policy import Bind, DEFAULT_MOUNTS
marker = sys.stdin.read()
policy = nsbox.Policy(mounts=DEFAULT_MOUNTS + (Bind(sys.argv[2], "/w", writable=True),))
try:
    r = nsbox.run(["sh", "-c", "echo nested >> /w/rootfile; sleep 3; : " + marker], policy)
    print(json.dumps({"status": r.status.value, "stderr": r.stderr.decode()}))
except nsbox.NsboxError as e:
    print(json.dumps({"error": type(e).__name__, "feature": getattr(e, "feature", None),
                      "message": str(e)}))
"""


@pytest.fixture
def root_file_dir() -> Iterator[Path]:
    """A world-writable directory (as a container might bind) with a root-owned 0644 file."""
    path = Path(tempfile.mkdtemp(prefix="nsbox-rootfile-", dir="/tmp"))
    path.chmod(0o777)
    (path / "rootfile").write_text("root's\n")
    (path / "rootfile").chmod(0o644)
    yield path
    shutil.rmtree(path)


def run_nested(prefix: list[str], tree: Path, directory: Path) -> tuple[dict, list[str]]:
    """Run NESTED_RUN under ``prefix``; the host-side Uid lines of the sandboxed command."""
    marker = f"nsbox-nested-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([*prefix, PYTHON, "-I", "-c", NESTED_RUN, str(tree),
                             str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(marker)
    proc.stdin.close()
    uids: list[str] = []
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline and not uids:
        for pid in processes_with(marker):
            try:
                with open(f"/proc/{pid}/status") as f:
                    uids += [line for line in f if line.startswith("Uid:")]
            except OSError:
                continue
        time.sleep(0.05)
    assert proc.stdout is not None and proc.stderr is not None
    proc.wait(timeout=60)
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert out, err
    return json.loads(out), uids


@pytest.mark.parametrize("tool", ["unshare", "bwrap"])
def test_root_in_a_user_namespace_mapping_only_0_is_refused(public_tree: Path,
                                                            root_file_dir: Path,
                                                            tool: str) -> None:
    path = shutil.which(tool)
    require(os.geteuid() == 0 and path is not None, f"needs root and {tool}")
    assert path is not None
    prefix = ([path, "-Ur"] if tool == "unshare" else
              [path, "--dev-bind", "/", "/", "--unshare-user", "--die-with-parent", "--"])
    outcome, uids = run_nested(prefix, public_tree, root_file_dir)
    assert outcome["error"] == "HostError" and outcome["feature"] == "identity", outcome
    assert "is not mapped in this user namespace: it maps only 0 to 0" in outcome["message"]
    assert uids == []
    assert (root_file_dir / "rootfile").read_text() == "root's\n"


def test_root_in_a_user_namespace_with_unprivileged_ids_maps_the_sandbox_to_them(
        public_tree: Path, root_file_dir: Path) -> None:
    require(os.geteuid() == 0, "needs root to write a user namespace's maps")
    maps = "0 0 1,65534 65534 1"
    outcome, uids = run_nested([PYTHON, str(USERNS), maps, maps], public_tree, root_file_dir)
    assert outcome.get("status") == "OK", outcome
    assert "Permission denied" in outcome["stderr"]
    assert uids and all(line.split()[1:] == ["65534"] * 4 for line in uids), uids
    assert (root_file_dir / "rootfile").read_text() == "root's\n"


def test_root_without_cap_sys_admin_runs_and_doctor_says_so(public_tree: Path,
                                                           root_file_dir: Path) -> None:
    require(os.geteuid() == 0 and SETPRIV is not None, "needs root and setpriv(1)")
    drop = [SETPRIV, "--bounding-set", "-sys_admin", "--"]
    outcome, uids = run_nested(drop, public_tree, root_file_dir)
    assert outcome.get("status") == "OK", outcome
    assert "Permission denied" in outcome["stderr"]
    assert uids and all(line.split()[1:] == ["65534"] * 4 for line in uids), uids
    assert (root_file_dir / "rootfile").read_text() == "root's\n"
    check = doctor_identity(drop, public_tree)
    assert check["status"] == "ok", check
    assert "host uid 65534, gid 65534" in check["detail"]
    assert "no CAP_SYS_ADMIN" in check["detail"]


def test_root_without_cap_setuid_is_refused_and_doctor_says_so(public_tree: Path,
                                                               root_file_dir: Path) -> None:
    """It could map only its own uid, 0: the sandbox would be host root."""
    require(os.geteuid() == 0 and SETPRIV is not None, "needs root and setpriv(1)")
    drop = [SETPRIV, "--bounding-set", "-setuid,-setgid", "--"]
    outcome, uids = run_nested(drop, public_tree, root_file_dir)
    assert outcome.get("feature") == "identity", outcome
    assert "this process is uid 0 without CAP_SETUID and CAP_SETGID" in outcome["message"]
    assert uids == []
    assert (root_file_dir / "rootfile").read_text() == "root's\n"
    check = doctor_identity(drop, public_tree)
    assert check["status"] == "fail", check
    assert "without CAP_SETUID and CAP_SETGID" in check["detail"]


def test_doctor_predicts_the_refusal_in_unshare(public_tree: Path) -> None:
    require(os.geteuid() == 0 and UNSHARE is not None, "needs root and unshare(1)")
    check = doctor_identity([UNSHARE, "-Ur"], public_tree)
    assert check["status"] == "fail", check
    assert "is not mapped in this user namespace" in check["detail"]
    assert "subordinate ids" in check["remedy"]


def test_doctor_states_the_host_identity() -> None:
    check = doctor_identity([], REPO)
    expected = 65534 if os.geteuid() == 0 else os.geteuid()
    assert check["status"] == "ok", check
    assert f"host uid {expected}" in check["detail"]


def test_doctor_as_a_regular_user(public_tree: Path) -> None:
    require(os.geteuid() == 0 and SETPRIV is not None, "needs root and setpriv(1)")
    check = doctor_identity([SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", "--"],
                            public_tree)
    assert check["status"] == "ok", check
    assert check["detail"] == ("the sandbox's user is host uid 65534, gid 65534; the sandbox "
                               "binds each source by path with its own identity")


def doctor_identity(prefix: list[str], tree: Path) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from nsbox.doctor import "
            "run_doctor; print(json.dumps([c for c in run_doctor().to_dict()['checks'] "
            "if c['name'] == 'identity']))")
    done = subprocess.run([*prefix, PYTHON, "-I", "-c", code, str(tree)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    checks = json.loads(done.stdout)
    assert len(checks) == 1, checks
    return checks[0]


def test_a_bind_through_the_api_as_root_never_yields_root_files(unprivileged_tmp: Path) -> None:
    """The issue's first report, through Bind instead of the workspace."""
    require(os.geteuid() == 0, "needs root")
    out = unprivileged_tmp / "out"
    out.mkdir()
    os.chown(out, 1234, 1234)
    policy = Policy(mounts=Policy().mounts + (Bind(str(out), "/out", writable=True),))
    result = nsbox.run(["sh", "-c", "cp /usr/bin/id /out/x; chmod 4755 /out/x; "
                                    "chmod 2755 /out/x; ls -ln /out/x"], policy)
    assert b"Operation not permitted" in result.stderr
    assert scan(out) == []
    assert (out / "x").stat().st_uid == 1234


def test_sessions_and_pools_are_refused_too_in_unshare(public_tree: Path) -> None:
    require(os.geteuid() == 0 and UNSHARE is not None, "needs root and unshare(1)")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import nsbox\n"
            "for door in (lambda: nsbox.Session(), lambda: nsbox.Pool(nsbox.Policy(), size=1)):\n"
            "    try:\n"
            "        with door() as box: print('ran', box.run(['true']))\n"
            "    except nsbox.NsboxError as e:\n"
            "        print(type(e).__name__, str(e).splitlines()[0])\n")
    done = subprocess.run([UNSHARE, "-Ur", PYTHON, "-I", "-c", code, str(public_tree)],
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == 2, (done.stdout, done.stderr)
    assert lines[0].startswith("HostError identity: no unprivileged host identity"), lines
    assert lines[1].startswith("SetupError identity: identity: no unprivileged host identity"), \
        lines
