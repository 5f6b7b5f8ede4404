"""``nsbox mcp``: a Model Context Protocol server whose tools run an agent's code in a sandbox.

One server process serves one MCP connection over stdio and owns one nsbox session for it: the
session is created before the handshake and destroyed when the client disconnects (end of
stdin), on SIGTERM, SIGHUP or SIGINT, and, because every sandbox is supervised by the launch
helper that kills it when this process's socket to it closes (nsbox/_helper.py), also when this
process is killed outright.

The tools' logic (``Workbench``, nsbox/mcp/tools.py) is plain, synchronous Python over the
session; this MCP layer (``build_server``) only validates arguments, runs a tool in a worker
thread so that a long command does not stall the protocol, and turns the reply into MCP
content. The ``mcp`` SDK is an optional extra (``pip install 'nsbox[mcp]'``): nothing here
imports it at module level, so the core never needs it.
"""

# No `from __future__ import annotations`: the MCP SDK reads the tools' annotations at run
# time, and those name objects local to build_server.

import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from nsbox.errors import NsboxError
from nsbox.mcp.probe import Installed, probe_installed
from nsbox.mcp.review import publish_for_review
from nsbox.mcp.tools import DEFAULT_TIMEOUT, Workbench, agent_policy, require_sdk, to_mcp
from nsbox.mcp.tools import ServerConfig as ServerConfig  # the configuration of serve()
from nsbox.mcp.turns import Call
from nsbox.session.policy import INPUT_DIR
from nsbox.session.session import Session
from nsbox.version import VERSION

if TYPE_CHECKING:
    from mcp.server import MCPServer


def instructions(config: ServerConfig, installed: Installed | None = None) -> str:
    """What the server tells the agent about its sandbox."""
    network = config.policy.network
    if network.effective_mode == "allow":
        reach = ("The only network is an HTTP(S) proxy (already set in HTTP_PROXY and "
                 "HTTPS_PROXY) to these hosts: " + ", ".join(network.allow) + ".")
    elif network.effective_mode == "loopback":
        reach = "There is no network beyond the sandbox's own loopback (127.0.0.1)."
    else:
        reach = "There is no network (pip cannot download anything)."
    text = ("Runs Python and bash in an isolated sandbox. " + reach + " Files live in "
            "/workspace and persist between calls for this connection.")
    if config.inputs:
        text += f" Input files are read-only under {INPUT_DIR} (read_file and list_files " \
                "see them too)."
    if installed is not None:
        text += f" Installed: {installed.summary()}."
    return text + " PNG files a command writes come back as images."


def build_server(bench: Workbench, installed: Installed | None = None) -> "MCPServer":
    """The MCP server with the five tools, each one a call into ``bench``."""
    from typing import Annotated

    import anyio
    import anyio.to_thread
    import mcp_types as types
    from mcp.server import MCPServer
    from pydantic import Field

    from nsbox.mcp import schemas as schemas
    from nsbox.mcp.schemas import describe, tool_hints

    server: MCPServer = MCPServer("nsbox", version=VERSION, log_level="WARNING",
                                  instructions=instructions(bench.config, installed))
    limit = bench.config.max_timeout

    async def call(fn: Any, *args: Any) -> types.CallToolResult:
        handle = Call()  # this call, for cancel()
        try:
            # abandon_on_cancel: a client that cancels (or goes away) does not wait for the
            # sandbox; cancel() makes the abandoned thread do nothing more (nsbox/mcp/turns.py).
            # A command's non-zero exit is a result, not a tool error: only nsbox's own
            # errors are.
            reply = await anyio.to_thread.run_sync(lambda: fn(*args, call=handle),
                                                   abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            # Waiting, the call never runs; its command running, it stops now (status SG).
            bench.cancel(handle)
            raise
        except NsboxError as error:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=f"error: {error}")], is_error=True)
        return to_mcp(reply, types)

    Timeout = Annotated[float, Field(
        description=f"Wall-clock limit in seconds (at most {limit:g}); the command and "
                    "everything it started are killed at the limit.")]
    # The structured reply of each tool, published as its outputSchema (nsbox/mcp/schemas.py).
    Ran = Annotated[types.CallToolResult, schemas.RunOutput]

    async def run_python(
        code: Annotated[str, Field(description="Python 3 source, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> Ran:
        """Run Python code in the sandbox. Returns the status (OK, RE non-zero exit, TO time
        limit, ML memory limit, OL output limit, SG signal), the exit code, stdout and stderr,
        and the files the code wrote (PNG files also as images)."""
        return await call(bench.run_python, code, timeout)

    async def run_bash(
        command: Annotated[str, Field(description="A bash command, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> Ran:
        """Run a bash command in the sandbox. Returns the same as run_python."""
        return await call(bench.run_bash, command, timeout)

    async def write_file(
        path: Annotated[str, Field(description="Path relative to /workspace")],
        content: Annotated[str, Field(description="The file's text")],
    ) -> Annotated[types.CallToolResult, schemas.WriteOutput]:
        """Write a text file into the workspace (replacing it if it exists)."""
        return await call(bench.write_file, path, content)

    where = "Path relative to /workspace" + (
        f", or absolute below {INPUT_DIR} (the inputs)" if bench.config.inputs else "")

    async def read_file(
        path: Annotated[str, Field(description=where)],
    ) -> Annotated[types.CallToolResult, schemas.ReadOutput]:
        """Read a file of the sandbox: text as text, a PNG as an image."""
        return await call(bench.read_file, path)

    async def list_files() -> Annotated[types.CallToolResult, schemas.ListOutput]:
        """List the workspace's regular files (and the inputs') with their size and
        SHA-256."""
        return await call(bench.list_files)

    async def changes() -> Annotated[types.CallToolResult, schemas.ChangesOutput]:
        """List what your code changed in the project at /workspace (added, modified, deleted
        files, with diffs). The changes reach the project only when the user applies them."""
        return await call(bench.changes)

    # The run tools can delete and overwrite the workspace's files (the host's are out of
    # their reach); they reach the world only through an allow-list.
    reaches_out = bench.config.policy.network.effective_mode == "allow"
    installed_text = f"Installed: {installed.summary()}." if installed is not None else ""
    commands_text = (f"Installed: {installed.commands_summary()}." if installed is not None
                     else "")
    tools: list[tuple[Any, str, Any]] = [
        (run_python, installed_text,
         tool_hints("Run Python", read_only=False, destructive=True, open_world=reaches_out)),
        (run_bash, commands_text,
         tool_hints("Run bash", read_only=False, destructive=True, open_world=reaches_out)),
        (write_file, "",
         tool_hints("Write a file", read_only=False, destructive=True, idempotent=True)),
        (read_file, "", tool_hints("Read a file", read_only=True, idempotent=True)),
        (list_files, "", tool_hints("List files", read_only=True, idempotent=True)),
    ]
    if bench.config.project is not None:
        # read-only: applying is the user's (nsbox/mcp/review.py)
        tools.append((changes, "", tool_hints("Project changes", read_only=True,
                                               idempotent=True)))
    for tool, more, hints in tools:
        server.add_tool(tool, description=describe(tool, more), annotations=hints,
                        structured_output=True)
    return server


def serve(config: ServerConfig) -> None:
    """Serve one MCP connection on stdin/stdout until the client disconnects or a signal
    (SIGTERM, SIGHUP, SIGINT) ends the server."""
    policy = agent_policy(config.policy)
    # What is installed is probed in a sandbox of its own (so the session's audit record holds
    # the agent's commands only), while the SDK is imported and the session starts.
    installed = _in_background(probe_installed, policy)
    require_sdk()
    import anyio

    # No idle timeout: the session lives exactly as long as the connection.
    with Session(policy=policy, inputs=list(config.inputs),
                       audit=config.audit, idle_timeout=None,
                       project=config.project) as session:
        if config.project is not None:
            publish_for_review(session)
        tool_log = _audit_log(config.audit)
        try:
            server = build_server(Workbench(session, config, tool_log), installed())
            if sys.stdin.isatty():  # someone trying it by hand: stdout is the protocol's
                print("nsbox mcp: waiting for an MCP client on stdin and stdout (an agent's "
                      "client starts this server); Ctrl-D or Ctrl-C ends it",
                      file=sys.stderr, flush=True)
            anyio.run(_serve, server, lambda: _close(session, tool_log))
        finally:
            _close(session, tool_log)


def _in_background(fn: Any, *args: Any) -> Any:
    """Start ``fn(*args)`` in a thread; the returned function waits for its result."""
    import threading

    result: list[Any] = [None]
    thread = threading.Thread(target=lambda: result.__setitem__(0, fn(*args)),
                              name="nsbox-probe")
    thread.start()

    def wait() -> Any:
        thread.join()
        return result[0]
    return wait


async def _serve(server: "MCPServer", close: Any) -> None:
    import anyio

    async with anyio.create_task_group() as group:
        group.start_soon(_exit_on_signal, close)
        await server.run_stdio_async()  # returns at end-of-file on stdin
        group.cancel_scope.cancel()


async def _exit_on_signal(close: Any) -> None:
    """On a signal, destroy the session and exit at once.

    Unwinding the event loop instead would wait for the SDK's thread that reads stdin, which
    only returns when the client closes it, so a signalled server would hang.
    """
    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP, signal.SIGINT) as signals:
        async for signum in signals:
            close()
            os._exit(128 + signum)


def _close(session: Any, tool_log: Any) -> None:
    session.close()  # idempotent: every process, mount and file of the sandbox is gone
    if tool_log is not None:
        tool_log.close()
    sys.stderr.flush()


def _audit_log(path: str | None) -> Any:
    if path is None:
        return None
    from nsbox.host.audit import AuditLog

    return AuditLog(path)
