"""`nsbox mcp` as agents' clients read it (the MCP Inspector, the SDK's own client): what
tools/list and initialize publish, read_file on the inputs the instructions point at, a memory
kill named as such, and the options it shares with `nsbox run`. The server runs as a subprocess
and the tests talk to it with the mcp SDK's stdio client, as tests/test_mcp.py does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, require
from test_mcp import Server, call, caller_server, connect, run, text_of

from nsbox import cgroups
from nsbox.mcp.probe import COMMANDS, NOTABLE
from nsbox.profiles import load_profile
from nsbox.version import VERSION

__all__ = ["caller_server"]  # the fixture, shared with tests/test_mcp.py

RUN_TOOLS = ("run_python", "run_bash")


def host_python() -> tuple[str, dict[str, str]]:
    """The version of the sandbox's python3 (the host's) and the NOTABLE packages it has."""
    code = ("import importlib.metadata as m, json, platform; found = {}\n"
            "for d in m.distributions(): found[d.metadata['Name'].lower()] = d.version\n"
            "print(json.dumps([platform.python_version(), found]))")
    version, found = json.loads(subprocess.run([PYTHON, "-I", "-c", code], capture_output=True,
                                               text=True, check=True).stdout)
    return version, {name: found[name] for name in NOTABLE if name in found}


def test_tools_publish_schemas_hints_and_what_is_installed(caller_server: Server):
    async def scenario() -> tuple[Any, ...]:
        async with connect(caller_server) as client:
            tools = (await client.list_tools()).tools
            ran = await call(client, "run_bash", command="echo hi")
            return client.server_info, client.instructions, tools, ran

    info, instructions, tools, ran = run(scenario)
    assert info.name == "nsbox" and info.version == VERSION
    by_name = {tool.name: tool for tool in tools}
    for tool in tools:
        # One paragraph: no docstring indentation, no line breaks.
        assert "\n" not in tool.description and "  " not in tool.description, tool.description
        assert tool.description == tool.description.strip()
        assert tool.output_schema is not None and tool.output_schema["type"] == "object"
        assert tool.annotations is not None and tool.annotations.title
        assert tool.annotations.open_world_hint is False  # no network: nothing beyond
    for name in ("read_file", "list_files"):
        assert by_name[name].annotations.read_only_hint is True
        assert by_name[name].annotations.idempotent_hint is True
    for name in (*RUN_TOOLS, "write_file"):
        hints = by_name[name].annotations
        assert hints.read_only_hint is False and hints.destructive_hint is True
    assert by_name["write_file"].annotations.idempotent_hint is True
    assert by_name["run_bash"].annotations.idempotent_hint is False
    run_schema = by_name["run_python"].output_schema
    assert {"status", "exit_code", "stdout", "stderr", "files"} <= set(run_schema["required"])
    assert set(by_name["read_file"].output_schema["required"]) == {"file"}
    # The reply matches its schema (the SDK checks it before sending).
    assert set(run_schema["required"]) <= set(ran.structured_content)
    # What the sandbox's python3 has, computed: its version and the notable packages.
    version, notable = host_python()
    for text in (by_name["run_python"].description, instructions):
        assert f"Python {version}" in text
        for name, package_version in notable.items():
            assert f"{name} {package_version}" in text
    assert "There is no network" in instructions
    # And the programs on the sandbox's PATH that bash commands reach for (/usr is the host's).
    bash = by_name["run_bash"].description
    assert "Installed: bash with coreutils" in bash
    for name in COMMANDS:
        if os.access(f"/usr/bin/{name}", os.X_OK):
            assert re.search(rf"[ ,]{re.escape(name)}[,.]", bash), (name, bash)


def test_read_file_and_list_files_reach_the_inputs(caller_server: Server, unprivileged_tmp: Path):
    source = unprivileged_tmp / "sales.csv"
    source.write_text("region,units\nnorth,12\n")
    source.chmod(0o644)
    folder = unprivileged_tmp / "refs"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha\n")
    for path in (folder, folder / "a.txt"):
        path.chmod(0o755 if path.is_dir() else 0o644)

    async def scenario() -> dict[str, Any]:
        async with connect(caller_server, "--input", f"{source}:data.csv",
                           "--input", str(folder)) as client:
            out: dict[str, Any] = {"instructions": client.instructions}
            out["read"] = await call(client, "read_file", path="/input/data.csv")
            out["nested"] = await call(client, "read_file", path="/input/refs/a.txt")
            out["dotdot"] = await call(client, "read_file", path="/input/../etc/passwd")
            out["write"] = await call(client, "write_file", path="/input/data.csv", content="x")
            out["listed"] = await call(client, "list_files")
            return out

    out = run(scenario)
    assert "read-only under /input" in out["instructions"]
    assert not out["read"].is_error, text_of(out["read"])
    assert out["read"].structured_content["content"] == "region,units\nnorth,12\n"
    assert out["read"].structured_content["file"]["name"] == "/input/data.csv"
    assert out["nested"].structured_content["content"] == "alpha\n"
    assert out["dotdot"].is_error and "uses '..'" in text_of(out["dotdot"])
    # Inputs are read-only: write_file stays in the workspace.
    assert out["write"].is_error and "outside the workspace" in text_of(out["write"])
    listed = out["listed"].structured_content
    assert listed["files"] == []
    assert {f["name"] for f in listed["inputs"]} == {"/input/data.csv", "/input/refs/a.txt"}
    assert source.read_text() == "region,units\nnorth,12\n"


def test_a_memory_kill_is_named_the_memory_limit(caller_server: Server):
    backend = cgroups.detect()
    require(cgroups.MEMORY in backend.supports(),
            f"no writable cgroup with memory here: {backend.reason}")

    async def scenario() -> tuple[Any, Any]:
        async with connect(caller_server, "--memory", "128M") as client:
            hog = await call(client, "run_python", code="x = bytearray(1 << 30)\nprint('kept')")
            after = await call(client, "run_bash", command="echo alive")
            return hog, after

    hog, after = run(scenario)
    assert hog.structured_content["status"] == "ML", text_of(hog)
    text = text_of(hog)
    assert text.startswith("status: ML,")
    assert "memory limit of 128 MiB" in text
    assert "signal" not in text.splitlines()[0]
    assert after.structured_content["stdout"] == "alive\n"  # the session goes on


def test_mcp_takes_the_options_of_nsbox_run(caller_server: Server):
    async def scenario() -> Any:
        async with connect(caller_server, "--profile", "python", "--time", "7",
                           "--set", "identity.hostname=agentbox") as client:
            return await call(client, "run_bash", command="hostname", timeout=10_000)

    result = run(scenario)
    assert result.structured_content["stdout"] == "agentbox\n", text_of(result)
    assert result.structured_content["timeout"] == 7  # --time bounds every tool's timeout
    assert "to the profile's limit of 7 s" in text_of(result)


@pytest.mark.parametrize(("args", "message"), [
    (["--memory", "lots"], "Invalid value for '--memory'"),
    (["--time", "0"], "Invalid value for '-t' / '--time'"),
    (["--set", "limits.memroy=1G"], 'did you mean "limits.memory"?'),
])
def test_mcp_refuses_bad_options_as_nsbox_run_does(args: list[str], message: str):
    proc = subprocess.run([sys.executable, "-m", "nsbox", "mcp", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode in (2, 125), proc.stderr
    assert proc.stdout == ""
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mcp_and_run_share_the_option_definitions():
    from test_cli_options import click_table, option_table

    from nsbox.cli import commands as cli
    from nsbox.cli import options as _options

    table = click_table(cli.mcp_command)
    assert {k: v for k, v in table.items() if k != "review_id"} == option_table(_options.MCP)
    shared = {"profile", "settings", "wall_time", "memory", "allow_host", "inputs", "project"}
    assert shared <= set(table)
    for name in shared:
        assert option_table(_options.MCP)[name] == option_table(_options.RUN)[name]
    assert load_profile("python").limits.wall_time  # the default profile bounds the timeout


def test_project_tools_and_the_review_server_publish_their_schemas(
        caller_server: Server, tmp_path: Path):
    """`nsbox mcp --project` gives the agent the read-only `changes`; `nsbox mcp --review ID`
    serves the user's changes/apply/discard over a session published by `nsbox session start`."""
    project = tmp_path / "app"
    project.mkdir()
    (project / "README.md").write_text("# app\n")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True,
                              text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    async def agent() -> Any:
        async with connect(caller_server, "--project", str(project)) as client:
            return {tool.name: tool for tool in (await client.list_tools()).tools}

    agent_tools = run(agent)
    assert agent_tools["changes"].annotations.read_only_hint is True
    assert "changes" in agent_tools["changes"].output_schema["properties"]

    sid = cli("session", "start", "--project", str(project)).strip()
    try:
        cli("session", "exec", sid, "--", "sh", "-c", "echo agent >> README.md")

        async def review() -> tuple[Any, ...]:
            async with connect(caller_server, "--review", sid,
                               env={"XDG_RUNTIME_DIR": str(runtime)}) as client:
                tools = {tool.name: tool for tool in (await client.list_tools()).tools}
                listed = await call(client, "changes")
                applied = await call(client, "apply", paths=["README.md"])
                return client.server_info, tools, listed, applied

        info, tools, listed, applied = run(review)
    finally:
        cli("session", "stop", sid)
    assert info.version == VERSION
    assert set(tools) == {"changes", "apply", "discard"}
    assert tools["changes"].annotations.read_only_hint is True
    assert tools["apply"].annotations.destructive_hint is True
    assert set(tools["apply"].output_schema["required"]) == {"applied", "conflicts", "refused"}
    assert [c["path"] for c in listed.structured_content["changes"]] == ["README.md"]
    assert applied.structured_content == {"applied": ["README.md"], "conflicts": [],
                                          "refused": []}
    assert (project / "README.md").read_text() == "# app\nagent\n"


def test_allow_host_makes_the_run_tools_open_world(caller_server: Server):
    async def scenario() -> Any:
        async with connect(caller_server, "--allow-host", "example.org") as client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            return client.instructions, tools

    instructions, tools = run(scenario)
    for name in RUN_TOOLS:
        assert tools[name].annotations.open_world_hint is True
    for name in ("write_file", "read_file", "list_files"):
        assert tools[name].annotations.open_world_hint is False
    assert "to these hosts: example.org." in instructions


def test_by_hand_on_a_terminal_it_says_it_waits_for_a_client():
    """Started on a terminal, the server says on stderr what it is, and Ctrl-D ends it."""
    import pty
    import select
    import time

    pytest.importorskip("mcp")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "nsbox", "mcp"], stdin=slave, stdout=slave,
                            stderr=slave, cwd="/", start_new_session=True)
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 60
    try:
        while b"waiting for an MCP client" not in shown and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                shown += os.read(master, 4096)
        os.write(master, b"\x04")  # end of file, as the terminal's line discipline makes it
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert b"nsbox mcp: waiting for an MCP client on stdin and stdout" in shown
