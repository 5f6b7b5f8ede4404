"""The Landlock mode, from a host that refuses namespaces (docs/hosts.md, "The Landlock mode").

The host is simulated as a container's default seccomp profile makes it (tests/containerhost.py:
unshare, clone's namespace flags and mount refused, clone3 ENOSYS, a container's capabilities),
applied before nsbox starts; in the cgroup v2 VM with user.max_user_namespaces=0 the host
refuses by itself and no filter is needed (``HOST_REFUSES``). nsbox runs there as root and as
uid 65534, with the default policy (isolation "auto"): the first run finds the refusal and every
run gets the Landlock mode. The victims (a process of the sandbox's uid with a secret in its
environment, loopback listeners, a canary file of that uid) are on the host, outside the filter;
the evidence is checked from here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require

import nsbox
from nsbox._sys import landlock as _landlock
from nsbox.errors import HostError, PolicyError
from nsbox.host import isolation
from nsbox.policy.policy import DEFAULT_MOUNTS, Bind, Network, Policy, Tmpfs

CONTAINERHOST = Path(__file__).with_name("containerhost.py")
SANDBOX_UID = 65534
ABI = _landlock.abi_version()


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


# The VM (/work/shared/vm) with the guest's user.max_user_namespaces at 0: no filter needed.
HOST_REFUSES = _read("/proc/sys/user/max_user_namespaces") == "0"


def require_landlock() -> None:
    require(ABI >= _landlock.MIN_ABI, f"the kernel has Landlock ABI {ABI}, the mode needs 4")


def as_sandbox_uid() -> list[str]:
    """The prefix that runs a host process as the uid the sandbox gets (65534 for both callers
    here: root's sandbox maps to host_uid 65534, and the unprivileged caller is 65534)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--"]


class RefusingHost:
    """Runs Python code (or nsbox's command line) as ``caller`` on a host that refuses
    namespaces."""

    def __init__(self, caller: str, tree: Path) -> None:
        self.caller = caller
        self.tree = tree

    def command(self, argv: list[str]) -> list[str]:
        # The unprivileged caller runs the public tree's copy: the checkout may be in a home
        # directory it cannot enter (conftest.public_tree).
        script = CONTAINERHOST if self.caller == "root" else self.tree / CONTAINERHOST.name
        refuse = [] if HOST_REFUSES else [self.python, str(script)]
        if self.caller == "root":
            return [*refuse, *argv]
        return [*as_sandbox_uid(), *refuse, *argv]

    @property
    def python(self) -> str:
        return sys.executable if self.caller == "root" else "/usr/bin/python3"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "NSBOX_TEST_SECRET": "caller-" + uuid.uuid4().hex}
        if self.caller != "root":
            env["PYTHONPATH"] = str(self.tree)
        return {**env, **(extra or {})}

    def run(self, argv: list[str], *, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), capture_output=True, text=True, cwd="/",
                              env=self.env(env), timeout=timeout, check=False)

    def python_code(self, code: str, **kwargs: Any) -> Any:
        """Run ``code`` (which prints one JSON value last) and return that value."""
        done = self.run([self.python, "-c", textwrap.dedent(code)], **kwargs)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    def nsbox(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run([self.python, "-m", "nsbox", *args], **kwargs)


@pytest.fixture
def host(any_host: RefusingHost) -> RefusingHost:
    """A refusing host whose kernel has the Landlock mode."""
    require_landlock()
    return any_host


@pytest.fixture(params=["root", "unprivileged"])
def any_host(request: pytest.FixtureRequest, public_tree: Path) -> RefusingHost:
    if request.param == "unprivileged" and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the 'root' run is its own")
    require(HOST_REFUSES or subprocess.run([sys.executable, "-c", "import pyseccomp"],
                                           check=False).returncode == 0,
            "pyseccomp is needed to simulate a container's seccomp profile")
    shutil.copy(CONTAINERHOST, public_tree / CONTAINERHOST.name)
    (public_tree / CONTAINERHOST.name).chmod(0o644)
    return RefusingHost(request.param, public_tree)


def _result_json(code: str) -> str:
    """Code that prints a Result as JSON, stdout and stderr as text."""
    return textwrap.dedent(code) + "\nprint(json.dumps(result.to_dict(with_output=True)))"


# --- the victims, on the host ---------------------------------------------------------------


class Victims:
    """What the sandbox attacks: a process of its uid with a secret in its environment, TCP
    and UDP loopback listeners, a pathname and an abstract unix socket, a canary file and a
    home directory of its uid outside the workspace."""

    def __init__(self, tmp: Path) -> None:
        self.secret = "victim-" + uuid.uuid4().hex
        self.process = subprocess.Popen([*as_sandbox_uid(), "sleep", "300"],
                                        env={"PATH": "/usr/bin:/bin", "SECRET": self.secret})
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen()
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.unix_path = str(tmp / "service.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen()
        self.unix.setblocking(False)
        self.abstract_name = "nsbox-test-" + uuid.uuid4().hex
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen()
        self.abstract.setblocking(False)
        self.home = tmp / "home"
        self.home.mkdir(mode=0o700)
        self.canary = self.home / "canary.txt"
        self.canary.write_text("original")
        self.canary.chmod(0o600)
        if os.geteuid() == 0:
            for path in (tmp, self.home, self.canary):
                os.chown(path, SANDBOX_UID, SANDBOX_UID)

    def arguments(self) -> str:
        return json.dumps({"victim": self.process.pid, "tcp": self.tcp.getsockname()[1],
                           "udp": self.udp.getsockname()[1], "unix": self.unix_path,
                           "abstract": self.abstract_name, "canary": str(self.canary),
                           "home": str(self.home)})

    def got_nothing(self) -> None:
        for sock in (self.tcp, self.unix, self.abstract):
            with pytest.raises(BlockingIOError):
                sock.accept()
        with pytest.raises(BlockingIOError):
            self.udp.recvfrom(100)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for sock in (self.tcp, self.udp, self.unix, self.abstract):
            sock.close()


@pytest.fixture
def victims() -> Iterator[Victims]:
    tmp = Path(tempfile.mkdtemp(prefix="nsbox-victims-", dir="/tmp"))
    tmp.chmod(0o755)
    found = Victims(tmp)
    yield found
    found.close()
    subprocess.run(["rm", "-rf", str(tmp)], check=False)


# The probes' common part (tests/test_landlock_filter.py's too): the arguments (JSON in argv[1]),
# libc, and each attempt "done" (with what it returned) or "refused" (with its errno's name).
PROBE_HEAD = r'''
import ctypes, errno, fcntl, json, os, signal, socket, struct, sys
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, action):
    try:
        out[name] = ["done", repr(action())[:300]]
    except OSError as exc:
        out[name] = ["refused", errno.errorcode.get(exc.errno, str(exc.errno))]
def call(nr, *a):
    result = libc.syscall(nr, *a)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result
'''

# The probe: every attack of the threat model, each "refused" (with its errno) or "done".
ATTACKS = PROBE_HEAD + r'''
def connect(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(address)
def udp():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"leak", ("127.0.0.1", args["udp"]))
victim, canary = args["victim"], args["canary"]
for name in ("environ", "cmdline", "fd", "root/", "mem"):
    attempt(f"/proc/PID/{name}", lambda: open(f"/proc/{victim}/{name}", "rb").read(100)
            if not name.endswith(("fd", "/")) else os.listdir(f"/proc/{victim}/{name}"))
attempt("kill", lambda: os.kill(victim, signal.SIGKILL))
attempt("pidfd kill", lambda: signal.pidfd_send_signal(os.pidfd_open(victim), signal.SIGKILL))
def ptrace():
    if libc.ptrace(16, victim, 0, 0) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), "ptrace")
attempt("ptrace", ptrace)
attempt("tcp", lambda: connect(socket.AF_INET, ("127.0.0.1", args["tcp"])))
attempt("tcp6", lambda: connect(socket.AF_INET6, ("::ffff:127.0.0.1", args["tcp"])))
attempt("tcp fastopen", lambda: socket.socket().sendto(b"leak", 0x20000000,
                                                        ("127.0.0.1", args["tcp"])))
attempt("tcp listen", lambda: socket.socket().listen())
attempt("udp", udp)
attempt("unix", lambda: connect(socket.AF_UNIX, args["unix"]))
attempt("abstract unix", lambda: connect(socket.AF_UNIX, "\0" + args["abstract"]))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("read canary", lambda: open(canary).read())
attempt("write canary", lambda: open(canary, "w").write("changed"))
attempt("delete canary", lambda: os.unlink(canary))
attempt("rename canary", lambda: os.rename(canary, canary + ".moved"))
attempt("chmod canary", lambda: os.chmod(canary, 0o666))
attempt("chown canary", lambda: os.chown(canary, -1, 0))
attempt("list home", lambda: os.listdir(args["home"]))
attempt("list root", lambda: os.listdir("/"))
attempt("write /tmp", lambda: open("/tmp/nsbox-landlock-test", "w").write("x"))
attempt("workspace", lambda: open("in-workspace", "w").write("fine"))
attempt("tmpdir", lambda: open(os.environ["TMPDIR"] + "/t", "w").write("fine"))
attempt("setuid 0", lambda: os.setuid(0))
def setid_file():
    fd = os.open("planted", os.O_CREAT | os.O_WRONLY, 0o755)
    os.fchmod(fd, 0o4755)
attempt("set-id file", setid_file)
attempt("TIOCSTI", lambda: fcntl.ioctl(0, 0x5412, b"x"))
out["no_new_privs"] = libc.prctl(39, 0, 0, 0, 0)
print(json.dumps(out))
'''

REFUSED_ALWAYS = ("/proc/PID/environ", "/proc/PID/cmdline", "/proc/PID/fd", "/proc/PID/root/",
                  "/proc/PID/mem", "ptrace", "tcp", "tcp6", "tcp fastopen", "tcp listen", "udp",
                  "unix", "abstract unix", "netlink", "read canary", "write canary",
                  "delete canary", "rename canary", "chmod canary", "chown canary", "list home",
                  "list root", "write /tmp",
                  "setuid 0", "set-id file", "TIOCSTI")


def check_attacks(outcome: dict[str, Any], victims: Victims, scoped: bool = True) -> None:
    assert outcome.pop("no_new_privs") == 1
    refused = {name for name, (state, _detail) in outcome.items() if state == "refused"}
    assert set(REFUSED_ALWAYS) <= refused, outcome
    assert outcome["workspace"][0] == "done" and outcome["tmpdir"][0] == "done", outcome
    assert outcome["set-id file"] == ["refused", "EPERM"]
    if scoped:
        assert outcome["kill"] == ["refused", "EPERM"] and outcome["pidfd kill"][0] == "refused"
        assert victims.process.poll() is None, "the host process of the sandbox's uid was killed"
    victims.got_nothing()
    assert victims.canary.read_text() == "original"
    assert stat.S_IMODE(victims.canary.stat().st_mode) == 0o600
    assert sorted(p.name for p in victims.home.iterdir()) == ["canary.txt"]


# --- the three doors: the command line, the API, a session ------------------------------------


def test_the_command_line_runs_in_the_landlock_mode_and_says_so(host: RefusingHost):
    code = ("import os; open('out.txt', 'w').write('written'); "
            "print(os.getcwd(), open('out.txt').read(), os.environ['HOME'] == os.getcwd())")
    done = host.nsbox("run", "--json", "--", "python3", "-c", code)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "OK", result
    assert result["isolation"] == "landlock"
    workspace, written, home = result["stdout"].split()
    assert (written, home) == ("written", "True")
    assert any(line.startswith("files: paths are the host's") for line in
               result["isolation_weaker"])
    # One line on stderr says why; the fresh workspace is gone once the run is over.
    assert done.stderr.startswith("nsbox: Landlock mode: this host refuses namespaces (")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert not os.path.exists(workspace)


def test_isolation_namespaces_refuses_with_the_remedy(host: RefusingHost):
    done = host.nsbox("run", "--isolation", "namespaces", "--", "true")
    assert done.returncode == 125
    assert done.stderr.startswith("nsbox: create namespaces: ")
    assert "Landlock mode" in done.stderr and "--isolation auto" in done.stderr


def test_the_attacks_fail_through_the_api(host: RefusingHost, victims: Victims):
    code = _result_json(f"""
        import json, nsbox
        result = nsbox.run(["python3", "-c", {ATTACKS!r}, {victims.arguments()!r}], timeout=30)
        """)
    result = host.python_code(code)
    assert result["isolation"] == "landlock" and result["status"] == "OK", result
    check_attacks(json.loads(result["stdout"]), victims)
    # Neither the caller's environment nor the victim's reached the sandbox's output.
    assert "caller-" not in result["stdout"] and victims.secret not in result["stdout"]


def test_the_environment_is_scrubbed(host: RefusingHost):
    code = _result_json("""
        import json, nsbox
        result = nsbox.run(["sh", "-c", "env; id -u"])
        """)
    result = host.python_code(code)
    env = dict(line.split("=", 1) for line in result["stdout"].splitlines() if "=" in line)
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD", "SHLVL", "_"}, env
    assert env["TMPDIR"] != "/tmp" and env["HOME"] != "/workspace"
    assert result["stdout"].splitlines()[-1] == str(SANDBOX_UID)  # never root


def test_a_session_runs_in_the_landlock_mode(host: RefusingHost):
    marker = "marker-" + uuid.uuid4().hex
    code = f"""
        import json, nsbox
        with nsbox.Session(timeout=10) as s:
            s.write_file("main.py", "print(open('data.txt').read())")
            s.write_file("data.txt", "from the host")
            first = s.run(["python3", "main.py"])
            late = s.run(["sh", "-c", "(setsid sh -c 'sleep 300; :' {marker} &); sleep 100"],
                         timeout=1)
            made = s.run(["sh", "-c", "echo made > made.txt; ls"])
            out = s.read_file("made.txt")
            refused = None
            try:
                s.read_file("/etc/hostname")
            except nsbox.NsboxError as exc:
                refused = str(exc)
        print(json.dumps([first.isolation, first.stdout.decode(), late.status.value,
                          made.stdout.decode(), out.decode(), refused]))
        """
    isolation_, first, late, listing, out, refused = host.python_code(code)
    assert isolation_ == "landlock"
    assert first == "from the host\n"
    assert late == "TO"
    assert sorted(listing.split()) == ["data.txt", "made.txt", "main.py"]
    assert out == "made\n"
    assert "reaches the workspace only" in refused
    assert not processes_with(marker)


def processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


def test_the_time_limit_holds_and_nothing_is_left_behind(host: RefusingHost):
    marker = "marker-" + uuid.uuid4().hex
    script = (f"(setsid sh -c 'sleep 300; :' {marker} &); "
              f"(trap '' TERM HUP; sh -c 'sleep 301; :' {marker} &); "
              f"python3 -c 'import os; os.fork() or os.setsid(); import time; time.sleep(302)' "
              f"{marker} & pwd; sleep 100")
    code = _result_json(f"""
        import json, nsbox
        result = nsbox.run(["sh", "-c", {script!r}], timeout=1)
        """)
    started = time.monotonic()
    result = host.python_code(code)
    assert result["status"] == "TO" and result["isolation"] == "landlock", result
    assert time.monotonic() - started < 30
    assert processes_with(marker) == []
    assert not os.path.exists(result["stdout"].strip())  # the fresh workspace is removed


def test_doctor_predicts_the_mode_a_run_gets(host: RefusingHost):
    done = host.nsbox("doctor", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["isolation"]["status"] == "warn"
    assert checks["isolation"]["facts"]["mode"] == "landlock"
    assert checks["isolation"]["remedy"]
    # The live launch got what the checks predicted.
    assert checks["live launch"]["status"] == "ok", checks["live launch"]
    assert report["guarantees"]["isolation"] == "landlock"
    assert report["guarantees"]["namespaces"] == "none"


# --- older Landlock ABIs, on this kernel ------------------------------------------------------


def test_before_abi_6_the_init_ends_the_tree_by_its_children(host: RefusingHost,
                                                             victims: Victims):
    marker = "marker-" + uuid.uuid4().hex
    code = _result_json(f"""
        import json, nsbox
        attacks = nsbox.run(["python3", "-c", {ATTACKS!r}, {victims.arguments()!r}])
        result = nsbox.run(["sh", "-c", "(setsid sh -c 'sleep 300; :' {marker} &); sleep 100"],
                           timeout=1)
        result.stdout = attacks.stdout
        result.isolation_weaker = attacks.isolation_weaker
        """)
    result = host.python_code(code, env={"NSBOX_LANDLOCK_ABI": "4"})
    assert result["status"] == "TO"
    assert processes_with(marker) == []
    # Everything else still fails; a signal to a host process of the same uid is what Landlock
    # cannot stop before ABI 6 (listed as weaker: the probe's kill of the victim lands).
    check_attacks(json.loads(result["stdout"]), victims, scoped=False)
    assert any(line.startswith("signals: Landlock ABI 4") for line in result["isolation_weaker"])


def test_a_kernel_without_abi_4_refuses_with_the_remedy(any_host: RefusingHost):
    done = any_host.nsbox("run", "--", "true", env={"NSBOX_LANDLOCK_ABI": "3"})
    assert done.returncode == 125
    assert "the Landlock mode needs Landlock ABI 4" in done.stderr
    assert "lsm=" in done.stderr


# --- on this host: isolation = "landlock" asked for ---------------------------------------------


LANDLOCK = Policy(isolation="landlock")


@pytest.fixture
def landlock() -> Policy:
    """The policy that asks for the Landlock mode, where the kernel has it."""
    require_landlock()
    return LANDLOCK


def test_asked_for_on_a_host_with_namespaces(tmp_path: Path, landlock: Policy):
    result = nsbox.run(["sh", "-c", "echo $HOME $TMPDIR; pwd; cat /proc/self/status"], LANDLOCK)
    assert result.isolation == "landlock" and result.status.value == "RE"
    home, tmp, cwd = result.stdout.decode().split()
    assert home == cwd and tmp.endswith("/tmp")
    assert b"Permission denied" in result.stderr  # no /proc at all
    assert isolation.refusal_reason() is None  # nothing was refused: auto stays namespaces
    assert nsbox.run(["true"]).isolation == "namespaces"


def test_a_given_workspace_is_the_writable_one(unprivileged_tmp: Path, landlock: Policy):
    workspace = unprivileged_tmp / "ws"
    workspace.mkdir()
    if os.geteuid() == 0:
        # A root caller's sandbox is uid 65534: a root-owned directory it cannot write is
        # refused with the remedy, never written as root.
        with pytest.raises(HostError) as info:
            nsbox.run(["true"], LANDLOCK.replace(workspace=str(workspace)))
        assert (info.value.hint or "").startswith(f"chown 65534:65534 {workspace}")
    workspace.chmod(0o777)
    result = nsbox.run(["sh", "-c", "pwd; echo x > made; echo y > $HOME/also"],
                       LANDLOCK.replace(workspace=str(workspace)))
    assert result.status.value == "OK", result.stderr
    assert result.stdout.decode().strip() == str(workspace)
    assert sorted(p.name for p in workspace.iterdir()) == ["also", "made"]
    # Files it made are the sandbox's uid's, never root's.
    assert {p.stat().st_uid for p in workspace.iterdir()} == {
        SANDBOX_UID if os.geteuid() == 0 else os.geteuid()}


@pytest.mark.parametrize(("changes", "key", "words"), [
    ({"network": Network(mode="loopback")}, "network.mode", "needs a network namespace"),
    ({"mounts": (*DEFAULT_MOUNTS, Tmpfs("/scratch"))}, "mounts[9]", "nowhere to be made"),
    ({"mounts": (*DEFAULT_MOUNTS, Bind("/usr/share", "/data"))}, "mounts[9].target",
     "seen at its host path only"),
])
def test_what_needs_namespaces_is_refused_clearly(changes: dict[str, Any], key: str, words: str,
                                                  landlock: Policy):
    with pytest.raises(PolicyError) as info:
        nsbox.run(["true"], landlock.replace(**changes))
    assert info.value.key == key and words in info.value.message
    assert info.value.message.startswith("the Landlock mode (no namespaces): ")


def test_an_allow_list_is_refused(landlock: Policy):
    policy = LANDLOCK.replace(network=Network(mode="allow", allow=("pypi.org:443",)))
    with pytest.raises(PolicyError) as info:
        nsbox.run(["true"], policy)
    assert "a proxy's port or a loopback is the host's" in info.value.message


def test_a_pool_refuses_the_mode(landlock: Policy):
    with pytest.raises(PolicyError) as info:
        nsbox.Pool(LANDLOCK)
    assert info.value.key == "isolation"


def test_an_old_abi_refuses_landlock_asked_for(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(isolation._state, "abi", 3)
    with pytest.raises(HostError) as info:
        nsbox.run(["true"], LANDLOCK)
    assert info.value.feature == "landlock" and "lsm=" in (info.value.hint or "")


def test_the_apparmor_profile_is_printed_for_the_launcher():
    done = subprocess.run([sys.executable, "-m", "nsbox", "doctor", "--apparmor-profile"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    text = done.stdout
    assert f"profile nsbox {os.path.realpath(sys.executable)} flags=" in text
    assert "  allow userns,\n" in text and "  audit deny capability,\n" in text
    assert "allow pix /** -> &nsbox//&unpriv_nsbox," in text
    if subprocess.run(["which", "apparmor_parser"], capture_output=True).returncode == 0:
        parsed = subprocess.run(["apparmor_parser", "-Q", "-K", "/dev/stdin"], input=text,
                                capture_output=True, text=True, check=False)
        assert parsed.returncode == 0, parsed.stderr


@pytest.mark.cgroup2
def test_the_user_namespace_limit_at_0_gives_the_landlock_mode(public_tree: Path):
    """In a user namespace of the test's own whose limit is 0 (so also in the VM, whose kernel
    6.1 has Landlock ABI 2: there the run is refused with the remedy)."""
    if os.geteuid() != 0:
        pytest.skip("only root can map a second, unprivileged id into the test's namespace")
    if HOST_REFUSES:
        pytest.skip("this host refuses user namespaces itself: the tests above run on it")
    userns = Path(__file__).with_name("_userns.py")
    code = (f"import sys; sys.path.insert(0, {str(public_tree)!r}); import nsbox\n"
            "print(nsbox.run(['sh', '-c', 'echo ok']).isolation)\n")
    maps = "0 0 1,65534 65534 1"
    done = subprocess.run(
        ["/usr/bin/python3", str(userns), maps, maps, "sh", "-c",
         "echo 0 > /proc/sys/user/max_user_namespaces && exec /usr/bin/python3 -c \"$0\"", code],
        capture_output=True, text=True, timeout=60, check=False)
    if ABI >= _landlock.MIN_ABI:
        assert done.stdout == "landlock\n", done.stderr
    else:
        assert "the Landlock mode needs Landlock ABI 4" in done.stderr, done.stderr
        assert "user.max_user_namespaces is 0" in done.stderr


def test_signals_forwarded_to_the_command(tmp_path: Path, landlock: Policy):
    # The init passes SIGTERM on, as the namespaces' init does; the command's own handler runs.
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
            "print('ready', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c",
                             "import nsbox, sys; from nsbox.policy.policy import Policy; "
                             f"r = nsbox.run(['python3', '-c', {code!r}], Policy("
                             "isolation='landlock'), passthrough=True); sys.exit(r.exit_code)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    init = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if _comm(pid) == "nsbox-init" and _parent_chain_has(pid, proc.pid)]
    assert len(init) == 1
    os.kill(init[0], signal.SIGTERM)
    assert proc.wait(timeout=30) == 7


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return ""


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
    return False


def test_doctor_on_ubuntus_apparmor_restriction_names_the_profile(tmp_path: Path):
    """A simulated Ubuntu 24.04 host for a regular user: runs get the Landlock mode, and the
    remedy is the AppArmor profile for nsbox's launcher."""
    require_landlock()
    from test_doctor import facts, fake_host

    from nsbox.doctor import run_doctor
    from nsbox.profiles import load_profile

    report = run_doctor(facts(fake_host(tmp_path, apparmor="1")))
    checks = {check.name: check for check in report.checks}
    assert report.ok
    assert checks["user namespaces"].status == "warn"
    assert checks["isolation"].status == "warn" and checks["isolation"].facts["mode"] == "landlock"
    assert ("'nsbox doctor --apparmor-profile > /etc/apparmor.d/nsbox && apparmor_parser -r "
            "/etc/apparmor.d/nsbox'") in (checks["isolation"].remedy or "")
    assert report.guarantees["isolation"] == "landlock"
    namespaces = load_profile("default", {"isolation": "namespaces"})
    refused = run_doctor(facts(fake_host(tmp_path / "b", apparmor="1")), namespaces)
    check = {c.name: c for c in refused.checks}["isolation"]
    assert not refused.ok and check.status == "fail" and check.facts["mode"] == "refused"
    assert refused.guarantees["isolation"] == "refused"
