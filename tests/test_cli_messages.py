"""The command line's messages speak its own language: an error names the option the user typed
(``--ro-bind DIR``, ``--workspace``), not the policy's terms (``mounts[9].source``,
``workspace.path``, ``Network(mode='allow')``), and no help text points at files an installed
copy does not have (docs/*.md, source paths)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from nsbox.cli import commands as cli
from nsbox.policy.rules import RULES


def nsbox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60, cwd="/",
                          env={**os.environ, **(env or {})})


def assert_cli_terms(stderr: str) -> None:
    """No policy terms in a message to a command-line user, and no traceback."""
    assert "Traceback" not in stderr
    assert not re.search(r"mounts\[\d+\]", stderr), stderr
    assert "allow_rules =" not in stderr, stderr
    assert "Network(" not in stderr and "callable" not in stderr, stderr


# --- --ask ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--ask"], ["--ask", "--net", "loopback"],
                                  ["--ask", "--net", "allow"]])
def test_ask_without_an_allow_list_is_a_usage_error_naming_allow_host(args: list[str]):
    proc = nsbox("run", *args, "--", "true")
    assert proc.returncode == 2, proc.stderr
    assert "Invalid value for --ask: it asks about the hosts that are not on the " \
           "allow-list: name at least one with --allow-host HOST" in proc.stderr
    assert_cli_terms(proc.stderr)


# --- refusals name the option ---------------------------------------------------------------


@pytest.fixture
def fifo_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory holding a FIFO: the rule host-socket refuses to bind it, when the launch
    looks at the host (after the options became a policy)."""
    folder = tmp_path / "data"
    folder.mkdir()
    os.mkfifo(folder / "pipe")
    yield folder


HOST_SOCKET = "refused by rule host-socket: "
LIFT = "a trusted caller may lift this rule with --allow-rule host-socket"


@pytest.mark.parametrize("option", ["--ro-bind", "--bind", "--input"])
def test_a_refused_bind_names_the_option_nsbox_run(fifo_dir: Path, option: str):
    spec = f"{fifo_dir}:/data" if option != "--input" else str(fifo_dir)
    proc = nsbox("run", option, spec, "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith(f"nsbox: {option} {spec}: {HOST_SOCKET}{fifo_dir}/pipe is a "
                                  "FIFO"), proc.stderr
    assert LIFT in proc.stderr
    assert_cli_terms(proc.stderr)


def test_a_refused_bind_names_the_option_session_start(fifo_dir: Path, tmp_path: Path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    for args in (["--ro-bind", f"{fifo_dir}:/data"], ["--input", str(fifo_dir)]):
        proc = nsbox("session", "start", "--ro-bind", "/usr/share/doc:/doc", *args, env=env)
        assert proc.returncode == 125 and proc.stdout == ""
        assert proc.stderr.startswith(f"nsbox: {' '.join(args)}: {HOST_SOCKET}"), proc.stderr
        assert LIFT in proc.stderr
        assert_cli_terms(proc.stderr)


def test_a_refused_input_names_the_option_nsbox_mcp(fifo_dir: Path):
    pytest.importorskip("mcp")
    proc = nsbox("mcp", "--input", str(fifo_dir))
    assert proc.returncode == 125 and proc.stdout == ""
    assert proc.stderr.startswith(f"nsbox: --input {fifo_dir}: {HOST_SOCKET}"), proc.stderr
    assert_cli_terms(proc.stderr)


@pytest.mark.parametrize(("args", "named"), [
    (["--workspace", "/proc"], "--workspace: refused by rule bind-proc"),
    (["--set", "workspace.path=/proc"], "--set workspace.path: refused by rule bind-proc"),
    (["--project", "/"], "--project: refused by rule bind-root"),
    (["--pass-env", "A=B"], "--pass-env: 'A=B' is not a variable name"),
    (["--allow-rule", "bogus"], "--allow-rule: 'bogus' is not a rule of nsbox"),
    (["--set", "limits.memory=lots"], "--set limits.memory: 'lots' is not a size"),
])
def test_policy_keys_are_named_by_the_option_that_set_them(args: list[str], named: str):
    proc = nsbox("run", *args, "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: {named}"), proc.stderr
    assert_cli_terms(proc.stderr)


def test_an_unknown_rule_lists_the_rules_instead_of_a_file():
    proc = nsbox("run", "--allow-rule", "bogus", "--", "true")
    liftable = [name for name, rule in RULES.items() if rule.can_allow]
    assert f"hint: the rules that can be lifted: {', '.join(liftable)}" in proc.stderr
    assert "docs/" not in proc.stderr


def test_a_profile_files_error_keeps_its_file_line_and_key(tmp_path: Path):
    profile = tmp_path / "bad.toml"
    profile.write_text('[workspace]\npath = "/proc"\n')
    proc = nsbox("run", "--profile", str(profile), "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith(f"nsbox: {profile}:2: workspace.path: refused by rule "
                                  "bind-proc"), proc.stderr


# --- help texts -----------------------------------------------------------------------------


def every_command() -> Iterator[tuple[str, click.Command, click.Context]]:
    def walk(command: click.Command, ctx: click.Context, name: str
             ) -> Iterator[tuple[str, click.Command, click.Context]]:
        yield name, command, ctx
        if isinstance(command, click.Group):
            for sub_name, sub in command.commands.items():
                yield from walk(sub, click.Context(sub, info_name=sub_name, parent=ctx),
                                f"{name} {sub_name}")
    root = click.Context(cli.main, info_name="nsbox")
    yield from walk(cli.main, root, "nsbox")


def test_no_help_text_points_at_files_an_installed_copy_lacks():
    seen = []
    for name, command, ctx in every_command():
        text = command.get_help(ctx)
        seen.append(name)
        # Example lines may name the user's own files (main.py, src/app.py): only docs/ and
        # this package's source count.
        assert not re.search(r"docs/|\w+\.md\b|nsbox/\S*\.py", text), (name, text)
    assert {"nsbox run", "nsbox mcp", "nsbox session start", "nsbox doctor"} <= set(seen)


@pytest.mark.parametrize(("args", "hint"), [
    # Leaving --pids out keeps the profile's limit (128 in the default profile): not "no limit".
    (["--pids", "-1"], "'-1' must be more than zero (for no limit write --pids none)"),
    (["--memory", "0"], "'0' must be more than zero (for no limit write --memory none)"),
    (["--tmp-size", "0"], "'0' must be more than zero (this limit is always set: /tmp is a "
                          "tmpfs"),
])
def test_a_limit_of_zero_says_how_to_have_none(args: list[str], hint: str):
    for command in (["run", *args, "--", "true"], ["mcp", *args]):
        proc = nsbox(*command)
        assert proc.returncode == 2, proc.stderr
        assert hint in proc.stderr, proc.stderr
        assert "leave the option out" not in proc.stderr


def test_session_exec_says_how_to_raise_a_limit(tmp_path: Path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    start = nsbox("session", "start", env=env)
    assert start.returncode == 0, start.stderr
    sid = start.stdout.strip()
    try:
        slow = nsbox("session", "exec", "--time", "1", sid, "--", "sleep", "3", env=env)
    finally:
        nsbox("session", "stop", sid, env=env)
    assert slow.returncode == 124
    assert "nsbox: TO: wall-clock limit reached; raise it with --time" in slow.stderr


def test_a_refused_mount_of_a_profile_is_named_by_its_target(fifo_dir: Path, tmp_path: Path):
    profile = tmp_path / "data.toml"
    profile.write_text(f'[[filesystem.mounts]]\ntype = "bind"\nsource = "{fifo_dir}"\n'
                       'target = "/data"\n')
    proc = nsbox("run", "--profile", str(profile), "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith(f"nsbox: the mount at /data: {HOST_SOCKET}"), proc.stderr
    assert_cli_terms(proc.stderr)


def test_ro_bind_of_the_home_names_the_option():
    """The user's own report: `--ro-bind $HOME` refused by secret-dir at the launch."""
    home = Path(os.path.expanduser("~"))
    if not (home / ".ssh").is_dir() or not str(home).startswith(("/root", "/home/")):
        pytest.skip(f"{home} holds no .ssh directory (nothing for the rule secret-dir)")
    proc = nsbox("run", "--ro-bind", str(home), "--", "true")
    assert proc.returncode == 125
    assert proc.stderr.startswith(f"nsbox: --ro-bind {home}: refused by rule secret-dir: "
                                  f"{home} holds {home}/.ssh"), proc.stderr
    assert "--allow-rule secret-dir" in proc.stderr
    assert_cli_terms(proc.stderr)


def test_a_missing_bind_source_is_not_told_to_set_optional():
    proc = nsbox("run", "--ro-bind", "/no/such/dir:/data", "--", "true")
    assert proc.returncode == 125
    assert proc.stderr == ("nsbox: --ro-bind /no/such/dir:/data: /no/such/dir does not exist\n"
                           "  hint: fix the path: the source of a bind must exist on this host\n")


# --- bad values of any kind: one line naming the option, never a traceback ----------------------

_SEVEN_ARGS = ", ".join(f'{{index={i % 6},op="eq",value=1}}' for i in range(7))


@pytest.mark.parametrize(("args", "named"), [
    (["--set", "environment.set=[1]"],
     '--set environment.set: expected a table of NAME = "value", got an array'),
    (["--set", 'environment.set="x"'],
     '--set environment.set: expected a table of NAME = "value", got a string'),
    (["--set", "environment.passthrough=HOME"],
     "--set environment.passthrough: expected an array of variable names, got a string"),
    (["--set", f'seccomp.rules=[{{syscall="ioctl",action="kill",args=[{_SEVEN_ARGS}]}}]'],
     "--set seccomp.rules: argument 0 is already compared in this rule"),
    (["--set", 'seccomp.rules=[{syscall="ioctl",action="kill",args=[{index=1,op="eq",'
      'value=1},{index=1,op="eq",value=2}]}]'],
     "--set seccomp.rules: argument 1 is already compared in this rule"),
    (["--set", 'filesystem.mounts=[{type="bind",source="",target="/x"}]'],
     "--set filesystem.mounts: is empty"),
    (["--set", "limits.pids=1"],
     "--set limits.pids: 1 is out of range (must be at least 2; the sandbox's own init"),
    (["--workspace-size", "none"],
     "--workspace-size: 'none' is only for a host-directory workspace"),
    (["--cpus", "1e9"], "--cpus: 1000000000.0 is out of range (more than 0, at most 1048576)"),
])
def test_a_bad_value_is_one_line_naming_the_option(args: list[str], named: str):
    proc = nsbox("run", *args, "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: {named}"), proc.stderr
    assert_cli_terms(proc.stderr)


def test_a_workspace_refused_at_the_launch_names_the_option():
    import nsbox as package

    code = os.path.dirname(os.path.abspath(package.__file__))  # the rule nsbox-code's
    proc = nsbox("run", "--workspace", code, "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith("nsbox: --workspace: refused by rule nsbox-code"), proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--pids", "1"], "'--pids': 1 is out of range (must be at least 2; the sandbox's own init"),
    (["--open-files", "2"], "'--open-files': 2 is out of range (must be 3..1048576; every "
     "process starts with stdin, stdout and stderr open"),
    (["--open-files", "2000000"], "'--open-files': 2000000 is out of range (must be "
     "3..1048576"),
    (["--memory", "١٢M"], "'--memory': '١٢M' has a character that is not ASCII"),
    (["--pids", "١٢"], "'--pids': '١٢' has a character that is not ASCII"),
    (["--", ""], "COMMAND is empty: no program is named ('')"),
])
def test_a_count_out_of_its_keys_range_is_a_usage_error(args: list[str], message: str):
    proc = nsbox("run", *args, *([] if "--" in args else ["--", "true"]))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert_cli_terms(proc.stderr)


def test_two_binds_on_one_target_are_refused(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc = nsbox("run", "--ro-bind", f"{tmp_path}/a:/x", "--bind", f"{tmp_path}/b:/x/",
                 "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: --bind {tmp_path}/b:/x/: /x is already the target "
                                  f"of --ro-bind {tmp_path}/a:/x\n"), proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_audit_file_that_is_not_regular_is_refused_before_the_run(tmp_path: Path,
                                                                      kind: str):
    path = tmp_path / "audit"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path("/dev/null")
    proc = nsbox("run", "--audit", str(path), "--", "sh", "-c", "echo ran")
    assert proc.returncode == 125, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"nsbox: the audit file {path} is not a regular file"), \
        proc.stderr


def test_an_extends_of_a_missing_file_names_the_extending_file(tmp_path: Path):
    profile = tmp_path / "child.toml"
    profile.write_text('description = "x"\nextends = "./gone.toml"\n')
    proc = nsbox("run", "--profile", str(profile), "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: {profile}:2: extends: {tmp_path}/gone.toml: "
                                  "profile file not found"), proc.stderr


def test_a_profile_error_of_a_seccomp_rule_names_file_line_and_key(tmp_path: Path):
    profile = tmp_path / "rules.toml"
    profile.write_text('[[seccomp.rules]]\nsyscall = "ioctl"\naction = "kill"\n'
                       'args = [{index=0,op="eq",value=1}, {index=0,op="eq",value=2}]\n')
    proc = nsbox("run", "--profile", str(profile), "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: {profile}:4: seccomp.rules[0].args[1].index: "
                                  "argument 0 is already compared in this rule"), proc.stderr
    profile.write_text('[[filesystem.mounts]]\ntype = "bind"\nsource = ""\ntarget = "/x"\n')
    proc = nsbox("run", "--profile", str(profile), "--", "true")
    assert proc.returncode == 125, proc.stderr
    assert proc.stderr.startswith(f"nsbox: {profile}:3: filesystem.mounts[0].source: is "
                                  "empty"), proc.stderr


def test_print_profile_output_loads_back(tmp_path: Path):
    first = nsbox("run", "--set", "limits.wall_time=0.0000001", "--set",
                  "network.connect_timeout=2e-8", "--print-profile")
    assert first.returncode == 0, first.stderr
    assert 'wall_time = "0.0000001s"' in first.stdout
    saved = tmp_path / "r.toml"
    saved.write_text(first.stdout)
    again = nsbox("run", "--profile", str(saved), "--print-profile")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[1:] == first.stdout.splitlines()[1:]


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large"])
def test_session_cp_in_refuses_what_is_not_a_file_it_can_hold(tmp_path: Path, kind: str):
    """Refused before the session is asked (the ID needs no session): a FIFO would block,
    /dev/zero never ends, and a file past MAX_COPY_IN would fill the memory on its way."""
    from nsbox.cli.session import MAX_COPY_IN

    source = tmp_path / "src"
    if kind == "fifo":
        os.mkfifo(source)
    elif kind == "device":
        source = Path("/dev/zero")
    elif kind == "directory":
        source.mkdir()
    else:
        with open(source, "wb") as f:
            f.truncate(MAX_COPY_IN + 1)  # sparse: nothing is written
    proc = nsbox("session", "cp", str(source), "0123456789ab:z",
                 env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert proc.returncode == 125, proc.stderr
    reason = ("larger than 1024 MiB, the most `session cp` copies in" if kind == "too large"
              else "not a regular file (a directory, FIFO, device or socket)")
    assert proc.stderr.startswith(f"nsbox: cannot copy {source}: {reason}"), proc.stderr


def test_an_env_without_a_value_points_at_pass_env():
    """`-e FOO` (docker's way to pass the caller's FOO) is no KEY=VAL here: the error says which
    option passes a variable of the caller's."""
    done = nsbox("run", "-e", "FOO", "--", "true")
    assert done.returncode == 2, done.stderr
    assert "'FOO': expected KEY=VAL (to pass the caller's FOO, as docker's -e FOO does: " \
           "--pass-env FOO)" in done.stderr
