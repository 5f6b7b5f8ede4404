"""What everyday programs and users expect of the box they run in, through every door of nsbox:
stdin with --json, a /proc of the command's own pid namespace (ps), the /etc files programs
read, signals at their defaults, and the command line's messages where a run cannot start.

Every test runs real sandboxes (one reads a plan); what is inside is read by probes inside and
compared here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Runner, require
from sessiontools import UserRunner, user_runner

DOORS = {
    "fast": [str(Path(sys.executable).with_name("nsbox"))],
    "click": [sys.executable, "-c", "import sys; from nsbox.cli.commands import main; main()"],
}


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def nsbox_cli(*args: str, input: bytes | None = None, door: str = "fast",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run([*DOORS[door], *args], **stdin, capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})})


# --- stdin with --json ---------------------------------------------------------------------------


@pytest.mark.parametrize("door", sorted(DOORS))
def test_json_passes_stdin_as_without_it(door: str):
    plain = nsbox_cli("run", "--", "cat", input=b"hello\n", door=door)
    assert (plain.returncode, plain.stdout) == (0, b"hello\n"), plain.stderr
    as_json = nsbox_cli("run", "--json", "--", "sh", "-c", "cat; exit 3", input=b"hello\n",
                        door=door)
    assert as_json.returncode == 3, as_json.stderr
    result = json.loads(as_json.stdout)
    assert (result["status"], result["exit_code"], result["stdout"]) == ("RE", 3, "hello\n")


@contextlib.contextmanager
def _cli_session(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A session of the command line's, its runtime directory in ``tmp_path``: its ID and the
    environment that reaches it; stopped afterwards, which must succeed."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    start = nsbox_cli("session", "start", env=env)
    assert start.returncode == 0, start.stderr
    sid = start.stdout.decode().strip()
    try:
        yield sid, env
    finally:
        assert nsbox_cli("session", "stop", sid, env=env).returncode == 0


def test_session_exec_json_passes_stdin(tmp_path: Path):
    with _cli_session(tmp_path) as (sid, env):
        ran = nsbox_cli("session", "exec", "--json", sid, "--", "wc", "-c", input=b"12345",
                        env=env)
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["stdout"] == "5\n"


@pytest.mark.parametrize("door", sorted(DOORS))
def test_json_has_the_same_keys_when_the_run_did_not_start(door: str, tmp_path: Path):
    ran = json.loads(nsbox_cli("run", "--json", "--", "true", door=door).stdout)
    failed = nsbox_cli("run", "--json", "--", "no-such-program", door=door)
    assert failed.returncode == 127, failed.stderr
    data = json.loads(failed.stdout)
    assert sorted(data) == sorted(ran)
    assert (data["status"], data["exit_code"], data["stdout"]) == ("XX", None, "")
    assert "command not found inside the sandbox: no-such-program" in data["error"]
    tmp_path.chmod(0o700)
    gone = nsbox_cli("session", "exec", "--json", "no-such-session", "--", "true",
                     env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert gone.returncode != 0
    assert sorted(json.loads(gone.stdout)) == sorted(ran)


# --- /proc is the command's own: ps, and /proc/self is the reader ---------------------------------

# `ps -e` lists the processes of the command's pid namespace (it fails with "fatal library
# error, lookup self" when /proc/<its own pid> is another process); Python then checks that
# /proc/self and /proc/<getpid()> are the reading process.
PS_PROBE = ["sh", "-c", "ps -e -o pid=,comm= && python3 -c 'import os; p = os.getpid(); "
            "print(\"self\", os.readlink(\"/proc/self\") == str(p), "
            "open(\"/proc/%d/comm\" % p).read().strip())'"]


def require_ps() -> None:
    require(os.path.exists("/usr/bin/ps"), "ps is not installed (Debian package procps)")


def check_ps(stdout: str, stderr: str = "", shell: str = "sh") -> None:
    lines = stdout.splitlines()
    assert lines and lines[-1] == "self True python3", (stdout, stderr)
    listed = [line.split() for line in lines[:-1]]
    names = [name for _pid, name in listed]
    # The probe's own processes, and nothing of the session's init or another command.
    assert "ps" in names and shell in names, stdout
    assert "python" not in names and "python3" not in names, stdout
    assert listed[0] == ["1", "nsbox-init"], stdout


@pytest.mark.parametrize("door", sorted(DOORS))
def test_ps_through_the_command_line(door: str):
    require_ps()
    ran = nsbox_cli("run", "--", *PS_PROBE, door=door)
    assert ran.returncode == 0, ran.stderr
    check_ps(ran.stdout.decode(), ran.stderr.decode())


def test_ps_through_session_exec(tmp_path: Path):
    require_ps()
    with _cli_session(tmp_path) as (sid, env):
        for _ in range(2):  # the second command of a session was the one that failed
            ran = nsbox_cli("session", "exec", sid, "--", *PS_PROBE, env=env)
            assert ran.returncode == 0, ran.stderr
            check_ps(ran.stdout.decode(), ran.stderr.decode())


def test_ps_through_the_api_session_and_pool(as_user: UserRunner):
    require_ps()
    seen = as_user.script(f"""
probe = {PS_PROBE!r}
def out(r):
    return [r.status.value, r.stdout.decode(), r.stderr.decode()]
seen = {{"run": out(nsbox.run(probe))}}
with nsbox.Session() as s:
    seen["session"] = [out(s.run(probe)) for _ in range(3)]
    seen["session masks"] = out(s.run(["sh", "-c",
        "wc -c < /proc/cmdline; ls -A /proc/fs | wc -l; echo x > /proc/sys/kernel/hostname"]))
with nsbox.Pool(size=1) as pool:
    seen["pool"] = [out(pool.run(probe)) for _ in range(2)]
import asyncio
seen["arun"] = out(asyncio.run(nsbox.arun(probe)))
emit(**seen)
""")
    for status, stdout, stderr in [seen["run"], *seen["session"], *seen["pool"], seen["arun"]]:
        assert status == "OK", stderr
        check_ps(stdout, stderr)
    # The command's own /proc is masked and read-only as the session's is.
    status, stdout, stderr = seen["session masks"]
    assert (status, stdout) == ("RE", "0\n0\n"), stderr
    assert "Read-only file system" in stderr


def _mcp_server_parts() -> Any:
    import test_mcp

    test_mcp._require_server_parts()
    return test_mcp


def test_ps_through_the_mcp_tools(public_tree: Path):
    require_ps()
    test_mcp = _mcp_server_parts()
    server = test_mcp.Server("caller", public_tree)
    code = ("import os; p = os.getpid(); "
            "print('self', os.readlink('/proc/self') == str(p), "
            "open(f'/proc/{p}/comm').read().strip())")

    async def scenario() -> list[Any]:
        async with test_mcp.connect(server) as client:
            return [await test_mcp.call(client, "run_bash", command=" ".join(
                        ["ps -e -o pid=,comm= &&", "python3 -c", shlex.quote(code)])),
                    await test_mcp.call(client, "run_python", code=code),
                    await test_mcp.call(client, "run_bash", command="ps aux")]

    bash, python, aux = test_mcp.run(scenario)
    assert bash.structured_content["status"] == "OK", test_mcp.text_of(bash)
    check_ps(bash.structured_content["stdout"], shell="bash")
    assert python.structured_content["stdout"] == "self True python3\n", test_mcp.text_of(python)
    assert aux.structured_content["status"] == "OK", test_mcp.text_of(aux)
    assert "ps aux" in aux.structured_content["stdout"]



# --- the /etc that programs read ---------------------------------------------------------------

ETC_PROBE = r"""
import json, mimetypes, os, shutil, socket, ssl, subprocess
out = {"services": socket.getservbyname("http"), "tcp": socket.getprotobyname("tcp"),
       "gai": sorted({a[4][1] for a in socket.getaddrinfo("localhost", "http")}),
       "webp": mimetypes.guess_type("a.webp")[0],
       "release": os.path.exists("/etc/os-release") and "ID=" in open("/etc/os-release").read(),
       "nsswitch": open("/etc/nsswitch.conf").read().split("\n")[0],
       "mtab": os.readlink("/etc/mtab"),
       "cas": ssl.create_default_context().cert_store_stats()["x509_ca"],
       "ca_file": os.path.exists("/etc/ssl/certs/ca-certificates.crt")}
for name in ("shadow", "gshadow", "machine-id", "resolv.conf", "ssh", "ssl/private",
             "pip.conf", "environment", "profile"):
    out[name] = os.path.lexists("/etc/" + name)
req = ["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout", "/tmp/k", "-out",
       "/tmp/c", "-subj", "/CN=x", "-days", "1"]
openssl = shutil.which("openssl") and subprocess.run(req, capture_output=True, text=True)
out["openssl"] = openssl and [openssl.returncode, openssl.stderr]
print(json.dumps(out))
"""
NEVER_THERE = ("shadow", "gshadow", "machine-id", "resolv.conf", "ssh", "ssl/private", "pip.conf",
               "environment", "profile")


@pytest.fixture(params=["native", "python"])
def core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from nsbox.sandbox import native

    if request.param == "native":
        require(native.MISSING == "", native.MISSING or "the native core")
    monkeypatch.setenv("NSBOX_NATIVE", "0" if request.param == "python" else "1")
    return str(request.param)


def etc_probe(sandbox: Runner, **kwargs: Any) -> dict[str, Any]:
    result = sandbox.run(["python3", "-c", ETC_PROBE], **kwargs)
    assert result.status.value == "OK", result.stderr.decode()
    return dict(json.loads(result.stdout))


def test_etc_has_the_public_files_programs_read(core: str, sandbox: Runner):
    require(all(os.path.exists(p) for p in ("/etc/services", "/etc/protocols")),
            "the host has no /etc/services or /etc/protocols (Debian's netbase)")
    got = etc_probe(sandbox)
    assert (got["services"], got["tcp"], got["gai"]) == (80, 6, [80])
    assert got["release"] is True
    assert got["nsswitch"] == "passwd: files"
    assert got["mtab"] == "../proc/self/mounts"
    if os.path.exists("/etc/mime.types"):
        assert got["webp"] == "image/webp"
    if os.path.exists("/etc/ssl/openssl.cnf") and got["openssl"] is not None:
        assert got["openssl"][0] == 0, got["openssl"][1]
    # The CA store only where the network is allowed.
    assert (got["cas"], got["ca_file"]) == (0, False)
    assert [name for name in NEVER_THERE if got[name]] == []


def test_the_ca_store_is_there_where_the_network_is_allowed(core: str, sandbox: Runner):
    require(os.path.exists("/etc/ssl/certs/ca-certificates.crt"),
            "the host has no CA store at /etc/ssl/certs (Debian's ca-certificates)")
    require(all(os.path.exists(p) for p in ("/etc/services", "/etc/protocols")),
            "the host has no /etc/services or /etc/protocols (Debian's netbase): the probe "
            "looks up a service")
    network = {"mode": "allow", "allow": ["pypi.org:443"]}
    got = etc_probe(sandbox, policy_changes={"network": network})
    assert got["ca_file"] is True
    assert got["cas"] > 10
    assert [name for name in NEVER_THERE if got[name]] == []


def test_the_policys_own_mounts_at_etc_win(core: str, sandbox: Runner):
    mounts = [{"kind": "file", "target": "/etc/services", "content": "web 8080/tcp\n"},
              {"kind": "file", "target": "/etc/nsswitch.conf", "content": "hosts: files\n"}]
    result = sandbox.run(["sh", "-c", "cat /etc/services /etc/nsswitch.conf; "
                          "test -e /etc/protocols && echo protocols"], mounts=mounts)
    # The host's other files are still there, those it has (a minimal Debian has no netbase).
    others = b"protocols\n" if os.path.exists("/etc/protocols") else b""
    assert result.stdout == b"web 8080/tcp\nhosts: files\n" + others, result.stderr


def test_a_policy_without_the_hosts_usr_gets_no_host_etc():
    # The minimal profile's shape (one static program, nothing of the host's tree): only what
    # nsbox writes, and the mount table's link.
    from nsbox.plan import plan
    from nsbox.profiles import load_profile

    built = plan.build(load_profile("minimal"), ["/app/prog"])
    etc = sorted(op["target"] for op in built.mounts if op["target"].startswith("/etc/"))
    assert etc == ["/etc/group", "/etc/hostname", "/etc/hosts", "/etc/mtab", "/etc/passwd"]


def test_the_landlock_mode_reads_the_same_public_etc_files():
    from nsbox._sys import landlock as _landlock

    require(_landlock.abi_version() >= _landlock.MIN_ABI, "the kernel has no Landlock ABI 4")
    require(os.path.exists("/etc/services"), "the host has no /etc/services (netbase)")
    code = "import socket; print(socket.getservbyname('http'), socket.getprotobyname('tcp'))"
    import nsbox

    result = nsbox.run(["python3", "-c", code], nsbox.Policy(isolation="landlock"))
    assert result.isolation == "landlock"
    assert result.stdout == b"80 6\n", result.stderr


# --- signals start at their defaults, whatever the launcher ignored -------------------------------

SIGQUIT_BIT = 1 << 2  # SigIgn in /proc/PID/status: bit N-1 for signal N (proc(5))
IGNORING_SHELL = ["sh", "-c", 'trap "" QUIT; exec "$@"', "sh"]  # as a shell's background job


def ignored(status_text: str) -> int:
    return int(status_text.split("SigIgn:")[1].split()[0], 16)


def test_sigquit_ignored_by_the_shell_is_at_default_in_the_cli(tmp_path: Path):
    probe = ["grep", "SigIgn", "/proc/self/status"]
    outside = subprocess.run([*IGNORING_SHELL, *probe], capture_output=True, text=True)
    assert ignored(outside.stdout) & SIGQUIT_BIT, outside.stdout  # the launcher does ignore it
    for door in DOORS.values():
        ran = subprocess.run([*IGNORING_SHELL, *door, "run", "--", *probe],
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert ignored(ran.stdout) == 0, ran.stdout
    # glibc's posix_spawn (up to 2.36) leaves its internal signals 32 and 33 ignored too.
    spawn = ("import os, sys; pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ); "
             "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    ran = subprocess.run([sys.executable, "-c", spawn, DOORS["fast"][0], "run", "--", *probe],
                         capture_output=True, text=True, timeout=120)
    assert (ran.returncode, ignored(ran.stdout)) == (0, 0), ran.stdout + ran.stderr
    # ... and in a session started and used from such a shell.
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)
    start = subprocess.run([*IGNORING_SHELL, *DOORS["fast"], "session", "start"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert start.returncode == 0, start.stderr
    sid = start.stdout.strip()
    try:
        ran = subprocess.run([*IGNORING_SHELL, *DOORS["fast"], "session", "exec", sid, *probe],
                             capture_output=True, text=True, env=env, timeout=120)
        assert (ran.returncode, ignored(ran.stdout)) == (0, 0), ran.stdout + ran.stderr
    finally:
        subprocess.run([*DOORS["fast"], "session", "stop", sid], env=env, timeout=60)


def test_sigquit_ignored_by_the_launcher_is_at_default_through_the_api(as_user: UserRunner):
    seen = as_user.script("""
probe = ["grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status"]
import signal
out = {"launcher": signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN,
       "run": nsbox.run(probe).stdout.decode()}
with nsbox.Session() as s:
    out["session"] = s.run(probe).stdout.decode()
with nsbox.Pool(size=1) as pool:
    out["pool"] = pool.run(probe).stdout.decode()
emit(**out)
""", wrap=IGNORING_SHELL)
    assert seen.pop("launcher") is True
    for door, text in seen.items():
        assert ignored(text) == 0 and "SigBlk:\t0000000000000000" in text, (door, text)


# --- smaller things users met --------------------------------------------------------------------


def test_session_exec_names_an_option_after_id_and_the_remedy_of_a_limit(tmp_path: Path):
    with _cli_session(tmp_path) as (sid, env):
        late = nsbox_cli("session", "exec", sid, "--time", "1", "--", "sleep", "3", env=env)
        assert late.returncode == 2
        assert b'"--time" after ID: options go before ID' in late.stderr
        slow = nsbox_cli("session", "exec", "--time", "1", sid, "sleep", "3", env=env)
        assert slow.returncode == 124
        assert slow.stderr.endswith(b"nsbox: TO: wall-clock limit reached; raise it with --time\n")


@pytest.mark.parametrize("door", sorted(DOORS))
def test_ask_without_an_allow_list_is_a_usage_error_in_the_options_terms(door: str):
    ran = nsbox_cli("run", "--ask", "--", "true", door=door)
    assert ran.returncode == 2
    assert b"name at least one with --allow-host HOST" in ran.stderr
    assert b"callable" not in ran.stderr and b"Network(" not in ran.stderr


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_program_that_cannot_run_is_named(door: str):
    denied = nsbox_cli("run", "--", "/etc/passwd", door=door)
    assert denied.returncode == 126
    assert denied.stderr.startswith(b"nsbox: exec: /etc/passwd: Permission denied\n")
    missing = nsbox_cli("run", "--", "/workspace/missing", door=door)
    assert missing.returncode == 127
    assert missing.stderr.startswith(b"nsbox: exec: /workspace/missing: No such file")


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_refused_bind_is_named_by_its_option(door: str):
    ran = nsbox_cli("run", "--ro-bind", "/run:/r", "--", "true", door=door)
    assert ran.returncode == 125
    assert ran.stderr.startswith(b"nsbox: --ro-bind /run:/r: refused by rule bind-run: ")
    assert b"mounts[" not in ran.stderr


@pytest.mark.parametrize("door", sorted(DOORS))
def test_set_comes_after_every_option_the_limits_own_too(door: str):
    shown = nsbox_cli("run", "--time", "5", "--set", "limits.wall_time=none", "--memory", "100M",
                      "--set", "limits.memory=200M", "--pids", "50", "--print-profile", door=door)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode()
    assert 'wall_time = "none"' in text and 'memory = "200M"' in text and "pids = 50" in text
    # nsbox session start takes the same rule.
    from nsbox import Policy
    from nsbox.cli.shared import with_limits

    started = with_limits(Policy(), {"memory": 100 << 20, "pids": 50}, ("limits.memory=1G",))
    assert (started.limits.memory, started.limits.pids) == (Policy().limits.memory, 50)
