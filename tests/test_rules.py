"""The rule book (nsbox/policy/rules.py): every door refuses the same binds with the same rule.

A table of refused sources goes through every door (the API's Policy, run(workspace=),
Session, Pool, a profile file, --set, the CLI's options, the MCP server's --input), each as
written, through a symlink, through "..", and through a bind-mounted alias in a private mount
namespace; each must fail with a PolicyError naming the rule. A property test builds random
symlink chains and checks that what the rule book accepts never resolves into a refused area.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import UNPRIVILEGED_UID, require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nsbox
from nsbox.errors import PolicyError
from nsbox.host import codepaths, pathrules
from nsbox.launch.pool import Pool
from nsbox.policy import rules
from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, File, Policy, Symlink, Tmpfs
from nsbox.profiles import apply_overrides, load_profile
from nsbox.session.session import Session

# (id, source, writable, rule). "{ipc}" is a test directory holding a unix socket and a FIFO.
CASES = [
    ("root", "/", False, "bind-root"),
    ("proc-1", "/proc/1", False, "bind-proc"),
    ("proc-sys", "/proc/sys", False, "bind-proc"),
    ("sys-cgroup", "/sys/fs/cgroup", False, "bind-sys"),
    ("dev-shm", "/dev/shm", False, "bind-dev"),
    ("run", "/run", False, "bind-run"),
    ("var-run", "/var/run", False, "bind-run"),
    ("tmp", "/tmp", True, "shared-tmp"),
    ("etc", "/etc", True, "writable-system-dir"),
    ("usr-local", "/usr/local", True, "writable-system-dir"),
    ("var-lib", "/var/lib", True, "writable-system-dir"),
    ("root-home", "/root", True, "writable-home"),
    ("ssh", "/root/.ssh", False, "secret-dir"),
    ("ipc", "{ipc}", False, "host-socket"),
]
VARIANTS = ("plain", "symlink", "dotdot")


@pytest.fixture(scope="module")
def ipc_dir() -> Iterator[Path]:
    """A world-readable directory with a unix socket (its listener closed) and a FIFO."""
    root = Path(tempfile.mkdtemp(prefix="nsbox-rules-", dir="/tmp"))
    root.chmod(0o755)
    (root / "project" / "sub").mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(root / "project" / "sub" / "agent.sock"))
    listener.close()
    os.mkfifo(root / "project" / "pipe")
    for path in (root / "project", root / "project" / "sub"):
        path.chmod(0o755)
    yield root / "project"
    shutil.rmtree(root)


def spelled(variant: str, source: str, tmp: Path) -> str:
    """The source as written (plain), through a symlink in tmp, or through ".."."""
    if variant == "plain":
        return source
    if variant == "symlink":
        link = tmp / "link"
        link.symlink_to(source)
        return str(link)
    (tmp / "d").mkdir()
    return str(tmp / "d") + "/" + os.path.relpath(source, tmp / "d")


def real_source(case_source: str, ipc: Path) -> str:
    return case_source.format(ipc=ipc)


# --- the doors: each takes (source, writable, tmp) and must raise -------------------------------


def nsbox_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True,
                          text=True, check=False, cwd="/", stdin=subprocess.DEVNULL, timeout=60)


def cli_error(done: subprocess.CompletedProcess[str]) -> PolicyError:
    """The CLI's refusal as a PolicyError with the rule it names (exit 125, "nsbox: ...")."""
    assert done.returncode == 125, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.startswith("nsbox: "), done.stderr
    words = done.stderr.split("refused by rule ", 1)
    rule = words[1].split(":", 1)[0] if len(words) == 2 else None
    return PolicyError(done.stderr, rule=rule)


def bind_policy(source: str, writable: bool) -> Policy:
    return Policy(mounts=DEFAULT_MOUNTS + (Bind(source, "/x", writable=writable),))


def door_api_policy(source: str, writable: bool, tmp: Path) -> None:
    nsbox.run(["true"], bind_policy(source, writable), timeout=10)


def door_api_workspace(source: str, writable: bool, tmp: Path) -> None:
    nsbox.run(["true"], workspace=source, timeout=10)


def door_session(source: str, writable: bool, tmp: Path) -> None:
    with Session(bind_policy(source, writable)):
        pass


def door_session_workspace(source: str, writable: bool, tmp: Path) -> None:
    with Session(workspace=source):
        pass


def door_pool(source: str, writable: bool, tmp: Path) -> None:
    Pool(bind_policy(source, writable), size=1).close()


def door_pool_workspace(source: str, writable: bool, tmp: Path) -> None:
    Pool(workspace=source, size=1).close()


def door_profile(source: str, writable: bool, tmp: Path) -> None:
    path = tmp / "p.toml"
    path.write_text(textwrap.dedent(f"""\
        [[filesystem.mounts]]
        type = "bind"
        source = {json.dumps(source)}
        target = "/x"
        writable = {str(writable).lower()}
        """))
    nsbox.run(["true"], load_profile(str(path)), timeout=10)


def door_profile_workspace(source: str, writable: bool, tmp: Path) -> None:
    path = tmp / "p.toml"
    path.write_text(f"[workspace]\npath = {json.dumps(source)}\n")
    nsbox.run(["true"], load_profile(str(path)), timeout=10)


def door_set(source: str, writable: bool, tmp: Path) -> None:
    mount = f'[{{type="bind", source={json.dumps(source)}, target="/x", ' \
            f'writable={str(writable).lower()}}}]'
    raise cli_error(nsbox_cli("run", "--set", f"filesystem.mounts={mount}", "--", "true"))


def door_set_workspace(source: str, writable: bool, tmp: Path) -> None:
    raise cli_error(nsbox_cli("run", "--set", f"workspace.path={json.dumps(source)}", "--",
                              "true"))


def door_cli(source: str, writable: bool, tmp: Path) -> None:
    option = "--bind" if writable else "--ro-bind"
    raise cli_error(nsbox_cli("run", option, f"{source}:/x", "--", "true"))


def door_cli_workspace(source: str, writable: bool, tmp: Path) -> None:
    raise cli_error(nsbox_cli("run", "-w", source, "--", "true"))


def door_mcp(source: str, writable: bool, tmp: Path) -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        pytest.skip("the mcp extra is not installed (pip install 'nsbox[mcp]')")
    raise cli_error(nsbox_cli("mcp", "--input", f"{source}:x"))


Door = Callable[[str, bool, Path], None]
# (door, what it binds): "any" takes read-only and writable binds, "workspace" is a writable
# bind at /workspace, "ro" only read-only binds (--input).
DOORS: dict[str, tuple[Door, str]] = {
    "api-policy": (door_api_policy, "any"), "api-workspace": (door_api_workspace, "workspace"),
    "session": (door_session, "any"), "session-workspace": (door_session_workspace, "workspace"),
    "pool": (door_pool, "any"), "pool-workspace": (door_pool_workspace, "workspace"),
    "profile": (door_profile, "any"), "profile-workspace": (door_profile_workspace, "workspace"),
    "set": (door_set, "any"), "set-workspace": (door_set_workspace, "workspace"),
    "cli": (door_cli, "any"), "cli-workspace": (door_cli_workspace, "workspace"),
    "mcp-input": (door_mcp, "ro"),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("case", "source", "writable", "rule"), CASES,
                         ids=[c[0] for c in CASES])
def test_every_door_refuses_with_the_rule(
    case: str, source: str, writable: bool, rule: str, door: str, variant: str,
    ipc_dir: Path, tmp_path: Path
) -> None:
    function, takes = DOORS[door]
    if takes == "ro" and writable:
        pytest.skip("this door binds read-only only; the case is refused as writable")
    source = real_source(source, ipc_dir)
    if not os.path.lexists(source) and source != "/root/.ssh":
        pytest.skip(f"{source} is not on this host")
    with pytest.raises(PolicyError) as info:
        function(spelled(variant, source, tmp_path), writable, tmp_path)
    assert info.value.rule == rule, str(info.value)
    assert f"refused by rule {rule}" in str(info.value)


def test_errors_name_the_key_and_the_line(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        Policy(mounts=(Bind("/run", "/r"),))
    assert (info.value.rule, info.value.key) == ("bind-run", "mounts[0].source")
    with pytest.raises(PolicyError) as info:
        apply_overrides(Policy(), {"workspace": "/etc"})
    assert (info.value.rule, info.value.key) == ("writable-system-dir", "workspace.path")
    path = tmp_path / "p.toml"
    path.write_text('description = "x"\n\n[[filesystem.mounts]]\ntype = "bind"\n'
                    'source = "/proc/1"\ntarget = "/p"\n')
    with pytest.raises(PolicyError) as info:
        load_profile(str(path))
    assert (info.value.rule, info.value.key, info.value.line) == (
        "bind-proc", "filesystem.mounts[0].source", 5)
    assert str(info.value).startswith(f"{path}:5: filesystem.mounts[0].source: refused by rule "
                                      "bind-proc: /proc/1 is at or below /proc")


# --- a bind-mounted alias: what the path is, not how it is spelled -------------------------------

ALIAS_DRIVER = textwrap.dedent("""\
    import json, os, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    import nsbox
    from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, Policy
    from nsbox.launch.pool import Pool
    from nsbox.session.session import Session
    cases = json.loads(sys.argv[2])
    out = {}
    for name, source, writable, alias in cases:
        os.makedirs(alias)
        # A private mount namespace (unshare -m): the host's mounts are not touched.
        subprocess.run(["mount", "--bind", source, alias], check=True)
        policy = lambda: Policy(mounts=DEFAULT_MOUNTS + (Bind(alias, "/x", writable=writable),))
        doors = {
            "api-policy": lambda: nsbox.run(["true"], policy(), timeout=10),
            "api-workspace": lambda: nsbox.run(["true"], workspace=alias, timeout=10),
            "session": lambda: Session(policy()).close(),
            "pool": lambda: Pool(policy(), size=1).close(),
        }
        for door, call in doors.items():
            try:
                call()
                out[f"{name}/{door}"] = "accepted"
            except nsbox.PolicyError as exc:
                out[f"{name}/{door}"] = exc.rule
        option = "--bind" if writable else "--ro-bind"
        done = subprocess.run([sys.executable, "-m", "nsbox", "run", option, alias + ":/x",
                               "--", "true"], capture_output=True, text=True, cwd="/")
        rule = done.stderr.split("refused by rule ", 1)[-1].split(":", 1)[0]
        out[f"{name}/cli"] = rule if done.returncode == 125 else "accepted"
    print(json.dumps(out))
    """)


def test_a_bind_mounted_alias_is_refused_like_its_source(ipc_dir: Path, tmp_path: Path) -> None:
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "an alias needs a private mount namespace: root and unshare(1)")
    cases = []
    for name, source, writable, _rule in CASES:
        source = real_source(source, ipc_dir)
        if os.path.isdir(source):
            cases.append((name, source, writable, str(tmp_path / "aliases" / name)))
    repo = str(Path(nsbox.__file__).parent.parent)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c",
         ALIAS_DRIVER, repo, json.dumps(cases)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    expected = {name: rule for name, _s, _w, rule in CASES}
    for key, rule in found.items():
        assert rule == expected[key.split("/")[0]], (key, rule)
    assert len(found) == 5 * len(cases)


# --- as an unprivileged caller -------------------------------------------------------------------

PUBLIC_CASES = [c for c in CASES if c[0] in (
    "proc-1", "sys-cgroup", "dev-shm", "run", "tmp", "etc", "usr-local", "ipc")]


@pytest.mark.parametrize(("case", "source", "writable", "rule"), PUBLIC_CASES,
                         ids=[c[0] for c in PUBLIC_CASES])
@pytest.mark.parametrize("variant", ["plain", "symlink"])
def test_refused_as_caller_and_as_unprivileged_uid(
    sandbox: object, case: str, source: str, writable: bool, rule: str, variant: str,
    ipc_dir: Path, unprivileged_tmp: Path
) -> None:
    source = spelled(variant, real_source(source, ipc_dir), unprivileged_tmp)
    with pytest.raises(PolicyError) as info:
        sandbox.run(["true"], binds=[(source, "/x", writable)])  # type: ignore[attr-defined]
    assert info.value.rule == rule
    with pytest.raises(PolicyError) as info:
        sandbox.run(["true"], policy_changes={"workspace": source})  # type: ignore[attr-defined]
    assert info.value.rule == rule


# --- nsbox's own files, identity text --------------------------------------------------------


def test_nsbox_never_writes_its_files_into_a_bind(tmp_path: Path) -> None:
    host = tmp_path / "d"
    host.mkdir()
    (host / "passwd").write_text("precious\n")
    for option in ("--bind", "--ro-bind"):
        done = nsbox_cli("run", "--profile", "minimal", option, f"{host}:/etc", "--", "true")
        assert cli_error(done).rule == "nsbox-files"
    for mount in (Bind(str(host), "/etc"), Symlink("/etc", "/workspace"),
                  File("/etc/hosts", "1.2.3.4 x\n"), Tmpfs("/etc/passwd")):
        with pytest.raises(PolicyError) as info:
            Policy(mounts=(mount,))
        assert info.value.rule == "nsbox-files"
    # The evidence on the host: nothing replaced, nothing added.
    assert sorted(p.name for p in host.iterdir()) == ["passwd"]
    assert (host / "passwd").read_text() == "precious\n"
    # A tmpfs at /etc is the sandbox's own: allowed, and nsbox's files are written there.
    policy = Policy(mounts=(Tmpfs("/etc"), *DEFAULT_MOUNTS))
    result = nsbox.run(["/usr/bin/cat", "/etc/passwd"], policy, timeout=10)
    assert result.stdout.startswith(b"sandbox:x:1000:1000:"), result.stderr


@pytest.mark.parametrize(("field", "value"), [
    ("user", "a\nb"), ("user", "ab\n"), ("user", "a\x00b"), ("user", "a:b"),
    ("user", "root "), ("user", ""),
    ("hostname", "box\n10.0.0.1 evil"), ("hostname", "a\x00b"), ("hostname", "a b"),
    ("hostname", "a:b"), ("hostname", "#x"),
])
def test_identity_text_the_files_cannot_carry_is_refused(field: str, value: str,
                                                         tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        Policy(**{field: value})
    assert (info.value.rule, info.value.key) == ("identity-text", f"identity.{field}")
    with pytest.raises(PolicyError) as info:
        apply_overrides(Policy(), {field: value})
    assert (info.value.rule, info.value.key) == ("identity-text", f"identity.{field}")
    if "\x00" not in value:  # a command line cannot carry NUL at all
        done = nsbox_cli("run", "--set", f"identity.{field}={json.dumps(value)}", "--", "true")
        assert cli_error(done).rule == "identity-text"


def test_env_text_execve_cannot_carry_is_refused() -> None:
    for changes, key in (({"env": (("A", "x\x00y"),)}, "environment.set.A"),
                         ({"env": (("A=B", "x"),)}, "environment.set"),
                         ({"env": (("A\n", "x"),)}, "environment.set"),
                         ({"path": "/bin\x00/evil"}, "environment.path")):
        with pytest.raises(PolicyError) as info:
            Policy(**changes)  # type: ignore[arg-type]
        assert (info.value.rule, info.value.key) == ("env-text", key)


# --- the escape ---------------------------------------------------------------------------------


def test_a_trusted_caller_lifts_one_named_rule(ipc_dir: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    sock_path = ipc_dir / "sub" / "live.sock"
    listener.bind(str(sock_path))
    sock_path.chmod(0o777)  # connect(2) needs write permission on the socket (unix(7))
    listener.listen(1)
    listener.settimeout(0.5)
    try:
        probe = ["/usr/bin/python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); "
                 "s.connect('/x/sub/live.sock'); print('connected')"]
        with pytest.raises(PolicyError) as info:
            nsbox.run(probe, bind_policy(str(ipc_dir), False), timeout=10)
        assert info.value.rule == "host-socket"
        with pytest.raises(socket.timeout):
            listener.accept()  # host-side evidence: nobody connected
        allowed = bind_policy(str(ipc_dir), False).replace(allow_rules=("host-socket",))
        result = nsbox.run(probe, allowed, timeout=10)
        assert result.stdout == b"connected\n", result.stderr  # the rule was what stopped it
    finally:
        listener.close()
        sock_path.unlink()
    # One rule lifted leaves every other in force.
    with pytest.raises(PolicyError) as info:
        Policy(mounts=(Bind("/run", "/r"), Bind("/proc/1", "/p")), allow_rules=("bind-run",))
    assert (info.value.rule, info.value.key) == ("bind-proc", "mounts[1].source")
    lifted = Policy(mounts=DEFAULT_MOUNTS + (Bind("/run", "/r"),), allow_rules=("bind-run",))
    assert lifted.allow_rules == ("bind-run",)


@pytest.mark.parametrize(("names", "message"), [
    (("bind-rum",), "'bind-rum' is not a rule of nsbox"),
    (("target-reserved",), "rule target-reserved protects nsbox's own setup"),
    (("nsbox-files",), "rule nsbox-files protects nsbox's own setup"),
    ("bind-run", "expected a list of rule names"),
])
def test_allow_rules_takes_only_rules_that_can_be_lifted(names: object, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy(allow_rules=names)  # type: ignore[arg-type]
    assert info.value.key == "allow_rules"
    assert message in info.value.message


def test_cli_allow_rule_names_an_unknown_rule() -> None:
    done = nsbox_cli("run", "--allow-rule", "bind-rum", "--", "true")
    assert done.returncode == 125
    assert "--allow-rule: 'bind-rum' is not a rule of nsbox" in done.stderr
    assert 'did you mean "bind-run"?' in done.stderr


def test_allow_rules_through_profiles_set_and_cli(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('allow_rules = ["bind-run"]\n[[filesystem.mounts]]\ntype = "bind"\n'
                    'source = "/run"\ntarget = "/r"\noptional = true\n')
    assert load_profile(str(path)).allow_rules == ("bind-run",)
    for args in (["--allow-rule", "bind-run"], ["--set", 'allow_rules=["bind-run"]']):
        done = nsbox_cli("run", *args, "--ro-bind", "/run:/r", "--print-profile")
        assert done.returncode == 0, done.stderr
        assert 'allow_rules = ["bind-run"]' in done.stdout


# --- devices: unusable through any bind ----------------------------------------------------------


def test_a_device_node_in_a_bound_tree_cannot_be_opened(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "making a device node needs root")
    tree = tmp_path / "tree"
    tree.mkdir()
    os.mknod(tree / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null
    (tree / "null").chmod(0o666)
    os.chown(tree, 65534, 65534)  # as root, a writable bind must not be root's (identity rule)
    for writable in (False, True):
        result = nsbox.run(["/usr/bin/python3", "-c", "open('/x/null', 'w')"],
                           bind_policy(str(tree), writable), timeout=10)
        # Binds are nodev (mount_setattr MOUNT_ATTR_NODEV): the node is a name, not a device.
        assert result.exit_code == 1
        assert b"PermissionError: [Errno 13] Permission denied: '/x/null'" in result.stderr


# --- the socket scan ----------------------------------------------------------------------------


def test_the_scan_finds_a_socket_added_after_a_clean_scan(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    old = 1_000_000_000
    for path in (tree, tree / "a", tree / "a" / "b"):
        os.utime(path, (old, old))
    assert pathrules.find_host_socket(str(tree)) is None
    assert pathrules.find_host_socket(str(tree)) is None  # now from what was remembered
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tree / "a" / "b" / "late.sock"))
    listener.close()
    os.utime(tree / "a" / "b", (old, old))  # mtime set back; the ctime cannot be
    assert pathrules.find_host_socket(str(tree)) == (str(tree / "a" / "b" / "late.sock"),
                                                 "a unix socket")


# --- a home's secrets, and what the rule book accepts -------------------------------------------


def test_a_tree_that_holds_a_home_with_secrets_is_refused(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "homes" / "alice"
    (home / ".config" / "gcloud").mkdir(parents=True)
    (home / "project").mkdir()
    monkeypatch.setattr(pathrules, "home_dirs", lambda: [str(home)])
    host = pathrules.HostView()
    for source, rule in ((home / ".config" / "gcloud", "secret-dir"),
                         (tmp_path / "homes", "secret-dir"), (home, "secret-dir")):
        with pytest.raises(PolicyError) as info:
            pathrules.check_source(str(source), writable=False, allow=(), key="k", host=host)
        assert info.value.rule == rule, str(source)
    assert pathrules.check_source(str(home / "project"), writable=True, allow=(), key="k",
                              host=host) == str(home / "project")
    with pytest.raises(PolicyError) as info:
        pathrules.check_source(str(home), writable=True, allow=("secret-dir",), key="k", host=host)
    assert info.value.rule == "writable-home"


def refused_by_oracle(real: str, writable: bool) -> bool:
    """An independent statement of the areas, on the resolved path."""
    def below(area: str) -> bool:
        return real == area or real.startswith(area.rstrip("/") + "/")

    if real in ("/", "/tmp", "/var/tmp") or any(below(a) for a in
                                                 ("/proc", "/sys", "/dev", "/run")):
        return True
    return writable and (any(below(t) for t in rules.SYSTEM_TREES)
                         or real in rules.SYSTEM_DIRS or real in pathrules.home_dirs())


TARGETS = ["/run", "/proc/self", "/proc/1/root", "/sys/kernel", "/dev/shm", "/etc", "/usr/lib",
           "/", "/tmp", "/var/tmp", "/var/run", "/root", "/var/lib/dpkg", "/home"]


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_what_the_rule_book_accepts_never_resolves_into_a_refused_area(
    data: st.DataObject, tmp_path: Path
) -> None:
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    (base / "safe" / "deep").mkdir(parents=True)
    names = ["a", "b", "c", "d"]
    # A chain of links: each points at a refused area, at the safe directory, at another
    # link, or along a path of "..".
    for name in names:
        kind = data.draw(st.sampled_from(["area", "safe", "link", "dotdot"]))
        if kind == "area":
            points_to = data.draw(st.sampled_from(TARGETS))
        elif kind == "safe":
            points_to = str(base / "safe")
        elif kind == "link":
            points_to = str(base / data.draw(st.sampled_from(names)))
        else:
            points_to = "../" * data.draw(st.integers(0, 12)) + data.draw(
                st.sampled_from(["run", "etc", "tmp", "proc/self", "usr", "."]))
        (base / name).symlink_to(points_to)
    parts = data.draw(st.lists(st.sampled_from(names + ["safe", "deep", "..", "."]),
                               min_size=1, max_size=5))
    path = str(base) + "/" + "/".join(parts)
    writable = data.draw(st.booleans())
    try:
        real = os.path.realpath(path)
    except OSError:  # a link that cannot be read (/proc/1/root): the rule book says so
        with pytest.raises(PolicyError, match="cannot resolve"):
            pathrules.check_source(path, writable=writable, allow=(), key="k")
        return
    if not os.path.isdir(real):
        return  # a loop or a missing component: plan.py refuses it as missing
    try:
        accepted = pathrules.check_source(path, writable=writable, allow=(), key="k")
    except PolicyError:
        return
    assert accepted == real
    assert not refused_by_oracle(real, writable), (path, real, writable)


def _in_child_as(uid: int, call: Callable[[], str]) -> str:
    """call() in a forked child of this interpreter with ``uid`` (when root): what it returned
    and what it wrote on stderr."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exec, so the interpreter under test is this one
        try:
            os.close(read)
            sys.stderr = os.fdopen(write, "w", buffering=1, closefd=False)  # not pytest's
            if os.geteuid() == 0:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            sys.stderr.write(call())
        except BaseException as exc:  # noqa: BLE001 - shown to the parent's assert
            sys.stderr.write(f"raised {exc!r}")
        finally:
            sys.stderr.flush()
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def _resolve(path: str) -> str:
    try:
        return "resolved " + rules.resolve(path, "k")
    except PolicyError as exc:
        return f"refused {exc}"


def _bind(policy: Policy, spec: str) -> str:
    """What the command line makes of ``--ro-bind SPEC``: its profile parser resolves the
    bind's directories."""
    from nsbox.cli.run import bind_override

    try:
        apply_overrides(policy, {"mounts": [bind_override(spec, False)]})
    except PolicyError as exc:
        return f"refused {exc}"
    return "accepted"


def test_a_link_this_user_may_not_read_is_refused_on_every_python() -> None:
    """/proc/1/root is a link that only a process allowed to ptrace pid 1 may read (proc(5)).
    Python 3.13's os.path.realpath returns it unresolved instead of raising EACCES; resolve
    walks the path itself, so the refusal is the same under any interpreter, also for the
    command line's --ro-bind (whose profile parser resolves a bind's directories)."""
    uid = UNPRIVILEGED_UID if os.geteuid() == 0 else os.geteuid()
    require(os.stat("/proc/1").st_uid != uid,
            f"pid 1 belongs to uid {uid} here, who may read its links")
    refused = _in_child_as(uid, lambda: _resolve("/proc/1/root/etc")).splitlines()
    assert refused == ["refused k: cannot resolve /proc/1/root/etc: Permission denied",
                       "  hint: give a path that this user can resolve"]
    # The same kind of link to its own process resolves.
    assert _in_child_as(uid, lambda: _resolve("/proc/self/root/etc")) == "resolved /etc"
    # Loaded and imported here: the uid may not read the checkout.
    policy = load_profile("default")
    assert _bind(policy, "/etc:/e") == "accepted"
    said = _in_child_as(uid, lambda: _bind(policy, "/proc/1/root/etc:/e")).splitlines()[0]
    assert said == ("refused filesystem.mounts[0].source: cannot resolve /proc/1/root: "
                    "Permission denied")


def test_resolve_follows_links_like_realpath_and_refuses_a_loop(tmp_path: Path) -> None:
    (tmp_path / "dir" / "deep").mkdir(parents=True)
    (tmp_path / "up").symlink_to("dir/deep/..")
    (tmp_path / "abs").symlink_to(tmp_path / "up" / "deep")
    (tmp_path / "dir" / "rel").symlink_to("../abs/../../dir")
    for path in ("up", "abs", "dir/rel/deep", "abs/../missing/../up", "missing/x", "dir/rel/.."):
        assert rules.resolve(str(tmp_path / path), "k") == os.path.realpath(tmp_path / path)
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(PolicyError, match="cannot resolve .*: Too many levels of symbolic links"):
        rules.resolve(str(tmp_path / "a" / "x"), "workspace")


def test_the_rule_table_is_documented() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    for name, rule in rules.RULES.items():
        assert f"| `{name}` |" in docs, name
        row = docs.split(f"| `{name}` |", 1)[1].split("\n", 1)[0]
        assert row.rstrip().endswith("| yes |" if rule.can_allow else "| no |"), row


# --- nsbox-code: the code that launches sandboxes is never writable from one ------------------


PACKAGE = Path(nsbox.__file__).parent


def _refused_rule(source: Path, writable: bool = True, allow: tuple[str, ...] = ()) -> str | None:
    try:
        nsbox.run(["true"], Policy(mounts=DEFAULT_MOUNTS + (Bind(str(source), "/code",
                                                                  writable=writable),),
                                   allow_rules=allow))
    except PolicyError as exc:
        return exc.rule
    return None


def test_a_writable_bind_over_nsbox_itself_is_refused(tmp_path: Path) -> None:
    """A checkout with its venv inside, given writable, would let the sandbox edit the code
    that the next launch runs as the caller (or plant a .pth file in site-packages)."""
    link = tmp_path / "link"
    link.symlink_to(PACKAGE.parent)
    for source in (PACKAGE, PACKAGE / "host", PACKAGE.parent, link, Path(sys.prefix)):
        assert _refused_rule(source) == "nsbox-code", source
    site_packages = next(Path(p) for p in codepaths.code_paths()
                         if p.startswith(sys.prefix) and p.endswith("site-packages"))
    assert _refused_rule(site_packages) == "nsbox-code"
    assert _refused_rule(PACKAGE, writable=False) is None  # reading it is harmless


def test_the_nsbox_code_rule_can_be_lifted_and_names_the_place() -> None:
    with pytest.raises(PolicyError, match=f"nsbox-code: {PACKAGE.parent} holds ") as info:
        nsbox.run(["true"], Policy(mounts=DEFAULT_MOUNTS + (Bind(str(PACKAGE.parent), "/code",
                                                                  writable=True),)))
    assert info.value.rule == "nsbox-code"
    if os.geteuid() == 0 and PACKAGE.parent.stat().st_uid == 0:
        return  # as root, a root-owned tree is refused by the identity rule after this one
    assert _refused_rule(PACKAGE.parent, allow=("nsbox-code",)) is None
