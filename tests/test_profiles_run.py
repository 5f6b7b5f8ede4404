"""Every shipped profile runs a representative command in a real sandbox, as the caller and as
an unprivileged uid; and the command line's profile commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, Runner, require
from netservers import HTTPServer

from nsbox.result import Status


def host_has_module(name: str) -> bool:
    done = subprocess.run([PYTHON, "-c", f"import {name}"], capture_output=True, check=False)
    return done.returncode == 0


def test_default_profile_runs_python_in_its_workspace(sandbox: Runner) -> None:
    code = ("import os, pathlib; p = pathlib.Path('out.txt'); p.write_text('x' * 3); "
            "print(os.getcwd(), p.stat().st_size, os.path.exists('/home'), "
            "sorted(os.environ))")
    result = sandbox.run(["python3", "-c", code], profile="default")
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"/workspace 3 False ['HOME', 'LANG', 'PATH']\n"


def test_python_profile_analyses_data_and_writes_a_plot(sandbox: Runner,
                                                       unprivileged_tmp: Path) -> None:
    require(host_has_module("numpy"), "the host has no numpy for python3 (python3-numpy)")
    plot = host_has_module("matplotlib")
    code = "\n".join([
        "import os, numpy as np",
        "data = np.arange(1, 101, dtype=float)",
        "print(os.environ['MPLBACKEND'], data.mean(), np.percentile(data, 90))",
        # Without matplotlib on the host, the "plot" is a PGM image written with numpy alone.
        f"if {plot}:",
        "    import matplotlib.pyplot as plt",
        "    plt.plot(data, data ** 2); plt.savefig('/workspace/plot.png')",
        "else:",
        "    img = (np.outer(data, data) % 256).astype(np.uint8)",
        "    open('/workspace/plot.pgm', 'wb').write(b'P5 100 100 255\\n' + img.tobytes())",
    ])
    result = sandbox.run(["python3", "-c", code], profile="python",
                         overrides={"workspace": str(unprivileged_tmp)})
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"Agg 50.5 90.10000000000001\n"
    if plot:
        assert (unprivileged_tmp / "plot.png").read_bytes().startswith(b"\x89PNG")
    else:
        assert (unprivileged_tmp / "plot.pgm").read_bytes().startswith(b"P5 100 100 255\n")


def test_shell_profile_runs_a_pipeline(sandbox: Runner) -> None:
    script = "printf 'b\\na\\nc\\n' | sort -r | head -n 1; echo $SHELL; ls / | grep -c workspace"
    result = sandbox.run(["sh", "-c", script], profile="shell")
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"c\n/bin/sh\n1\n"


def test_minimal_profile_runs_a_static_binary_and_nothing_else(sandbox: Runner,
                                                               unprivileged_tmp: Path) -> None:
    gcc = shutil.which("gcc")
    require(gcc, "gcc is needed to build the static test binary")
    assert gcc
    source = unprivileged_tmp / "hello.c"
    source.write_text(
        '#include <stdio.h>\n#include <unistd.h>\n'
        'int main(void) { printf("static usr=%d sh=%d\\n", access("/usr", F_OK) == 0, '
        'access("/bin/sh", F_OK) == 0); return 0; }\n')
    binary = unprivileged_tmp / "hello"
    done = subprocess.run([gcc, "-static", "-O1", "-o", str(binary), str(source)],
                          capture_output=True, check=False)
    require(done.returncode == 0, f"gcc -static failed (libc6-dev?): {done.stderr[-300:]!r}")
    binary.chmod(0o755)
    mount = {"type": "bind", "source": str(binary), "target": "/app/hello"}
    result = sandbox.run(["hello"], profile="minimal", overrides={"mounts": [mount]})
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"static usr=0 sh=0\n"


def test_net_allow_profile_reaches_only_its_allow_list(sandbox: Runner) -> None:
    fetch = ("import sys, urllib.request, urllib.error\n"
             "for url in sys.argv[1:]:\n"
             "    try:\n"
             "        print(urllib.request.urlopen(url, timeout=10).read().decode(), end='')\n"
             "    except urllib.error.HTTPError as e:\n"
             "        print(e.code, e.read().decode().strip())\n")
    with HTTPServer() as server:
        listed = f"127.0.0.1:{server.port}"
        # The override replaces the profile's list: the package index is not reachable now,
        # and the proxy answers for it without any lookup.
        result = sandbox.run(["python3", "-c", fetch, f"http://{listed}/data",
                              "http://pypi.org/simple/"],
                             profile="net-allow", overrides={"allow": [listed]})
    assert result.status is Status.OK, result.stderr
    assert result.stdout == (b"hello from the host\n"
                             b"403 nsbox proxy: pypi.org:80 is not in the allow-list\n")
    assert [r["line"] for r in server.requests] == ["GET /data HTTP/1.1"]


def test_build_profile_compiles_and_runs_c(sandbox: Runner) -> None:
    require(shutil.which("cc"), "the host has no C compiler")
    script = ("printf 'int main(void){return 42;}' > t.c && cc -o t t.c && ./t; "
              "echo status=$?")
    result = sandbox.run(["sh", "-c", script], profile="build")
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"status=42\n"


def test_profile_limit_applies_in_the_sandbox(sandbox: Runner) -> None:
    result = sandbox.run(["sleep", "5"], profile="shell", overrides={"wall_time": "0.5s"})
    assert result.status is Status.TO
    assert result.timed_out


def test_profile_file_with_a_seccomp_rule_and_a_file_mount(sandbox: Runner,
                                                            unprivileged_tmp: Path) -> None:
    profile = unprivileged_tmp / "strict.toml"
    profile.write_text(
        'extends = "shell"\n'
        "[[filesystem.mounts]]\n"
        'type = "file"\ntarget = "/etc/motd"\ncontent = "from the profile\\n"\n'
        "[[seccomp.rules]]\n"
        'syscall = "mkdir"\naction = "errno:EACCES"\n'
        "[[seccomp.rules]]\n"
        'syscall = "mkdirat"\naction = "errno:EACCES"\n')
    profile.chmod(0o644)
    script = "cat /etc/motd; mkdir /tmp/x 2>&1 | grep -c 'Permission denied'; ls /tmp | wc -l"
    result = sandbox.run(["sh", "-c", script], profile=str(profile))
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"from the profile\n1\n0\n"


def test_identity_keys_reach_the_sandbox(sandbox: Runner) -> None:
    overrides = {"uid": 0, "gid": 0, "user": "agent", "hostname": "box",
                 "environment.set": {"GREETING": "hi"}}
    result = sandbox.run(["sh", "-c", "id -u; id -g; id -un; hostname; echo $GREETING"],
                         profile="shell", overrides=overrides)
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"0\n0\nagent\nbox\nhi\n"


# --- the command line --------------------------------------------------------------------------


def nsbox_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True,
                          text=True, check=False, cwd=cwd, stdin=subprocess.DEVNULL)


def test_cli_lists_and_shows_profiles() -> None:
    listed = nsbox_cli("profiles")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert names == ["build", "default", "minimal", "net-allow", "python", "shell"]
    shown = nsbox_cli("profiles", "show", "python")
    assert shown.returncode == 0
    assert 'MPLBACKEND = "Agg"' in shown.stdout
    assert 'memory = "1G"' in shown.stdout
    missing = nsbox_cli("profiles", "show", "pyton")
    assert missing.returncode == 125
    assert missing.stderr == ("nsbox: no shipped profile named 'pyton'\n"
                              '  hint: did you mean "python"?\n')


def test_cli_print_profile_applies_options(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    done = nsbox_cli("run", "--profile", "build", "--time", "7", "--workspace", "ws",
                     "--set", "limits.memory=3G", "--set", "limits.pids=99", "-e", "A=b",
                     "--cpus", "0.5", "--workspace-size", "64M", "--net", "loopback",
                     "--print-profile", cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    saved = tmp_path / "effective.toml"
    saved.write_text(done.stdout)
    from nsbox.profiles import load_profile

    policy = load_profile(str(saved))
    assert policy.limits.wall_time == 7.0
    assert policy.limits.memory == 3 << 30
    assert policy.limits.pids == 99
    assert policy.workspace == str(tmp_path / "ws")
    assert dict(policy.env)["A"] == "b" and dict(policy.env)["CC"] == "cc"
    assert policy.limits.cpus == 0.5 and policy.limits.workspace_size == 64 << 20
    assert policy.network.mode == "loopback"


def test_cli_set_takes_toml_values_and_pass_env_adds_to_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "mine.toml"
    profile.write_text('extends = "default"\n[environment]\npassthrough = ["TZ"]\n')
    done = nsbox_cli("run", "-p", str(profile), "--pass-env", "TERM",
                     "--set", 'network.allow=["pypi.org:443"]', "--set", "network.mode=allow",
                     "--set", "limits.cpu_time=none", "--print-profile")
    assert done.returncode == 0, done.stderr
    assert 'passthrough = ["TZ", "TERM"]' in done.stdout
    assert 'allow = ["pypi.org:443"]' in done.stdout
    assert 'cpu_time = "none"' in done.stdout
    bad = nsbox_cli("run", "--set", "network.mode=everywhere", "--", "true")
    assert bad.returncode == 125
    assert bad.stderr == ("nsbox: --set network.mode: 'everywhere' is not one of none, "
                          "loopback, allow\n")


def test_cli_bind_errors_name_the_option() -> None:
    done = nsbox_cli("run", "--ro-bind", "/nonexistent-dir:/data", "--", "true")
    assert done.returncode == 125
    assert done.stderr == ("nsbox: --ro-bind /nonexistent-dir:/data: /nonexistent-dir does not "
                           "exist\n  hint: fix the path: the source of a bind must exist on "
                           "this host\n")
    done = nsbox_cli("run", "--bind", "/etc:/e", "--", "true")
    assert done.stderr.startswith("nsbox: --bind /etc:/e: refused by rule writable-system-dir: "
                                  "/etc is at or below /etc (")
    assert "hint: bind it read-only" in done.stderr


def test_cli_reports_a_bad_profile_with_file_key_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('extends = "default"\n\n[limits]\nmemory = 0\n')
    done = nsbox_cli("run", "--profile", str(bad), "--", "true")
    assert done.returncode == 125
    assert done.stderr == f"nsbox: {bad}:4: limits.memory: must be at least 1 byte, got 0\n"
    assert "Traceback" not in done.stderr


def test_cli_doctor_json_and_exit_status() -> None:
    done = nsbox_cli("doctor", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["ok"] else 1)
    assert {c["name"] for c in report["checks"]} >= {"kernel", "user namespaces", "seccomp",
                                                     "cgroups", "live probe"}
    require(report["ok"], f"doctor says this host cannot run the default profile: {report}")
    table = nsbox_cli("doctor")
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split() == ["STATUS", "CHECK", "DETAIL"]
    assert os.uname().release in table.stdout


def test_run_takes_a_profile_by_name():
    import nsbox

    result = nsbox.run(["sh", "-c", "echo $0"], profile="shell")
    assert result.stdout == b"sh\n"
    with pytest.raises(nsbox.PolicyError, match="give a policy or a profile, not both"):
        nsbox.run(["true"], nsbox.Policy(), profile="shell")
