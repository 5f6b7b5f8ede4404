"""``nsbox mcp``: a Model Context Protocol server whose tools run an agent's code in a sandbox.

One server process serves one MCP connection over stdio and owns one nsbox session for it: the
session is created before the handshake and destroyed when the client disconnects (end of
stdin), on SIGTERM, SIGHUP or SIGINT, and, because every sandbox is supervised by the launch
helper that kills it when this process's socket to it closes (nsbox/_helper.py), also when this
process is killed outright.

The tools' logic (``Workbench``, nsbox/mcp_tools.py) is plain, synchronous Python over the
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
from nsbox.mcp_review import publish_for_review
from nsbox.mcp_tools import DEFAULT_TIMEOUT, Workbench, agent_policy, require_sdk, to_mcp
from nsbox.mcp_tools import ServerConfig as ServerConfig  # the configuration of serve()
from nsbox.policy import Policy
from nsbox.session import Session

if TYPE_CHECKING:
    from mcp.server import MCPServer


def instructions(policy: Policy) -> str:
    """What the server tells the agent about its sandbox."""
    network = policy.network
    if network.mode == "allow" and network.allow:
        reach = ("The only network is an HTTP(S) proxy (already set in HTTP_PROXY and "
                 "HTTPS_PROXY) to these hosts: " + ", ".join(network.allow) + ".")
    else:
        reach = "There is no network."
    return ("Runs Python and bash in an isolated sandbox. " + reach + " Files live in "
            "/workspace and persist between calls for this connection; input files are "
            "read-only under /input. PNG files a command writes come back as images.")


def build_server(bench: Workbench) -> "MCPServer":
    """The MCP server with the five tools, each one a call into ``bench``."""
    from typing import Annotated

    import anyio
    import anyio.to_thread
    import mcp_types as types
    from mcp.server import MCPServer
    from pydantic import Field

    server: MCPServer = MCPServer("nsbox", instructions=instructions(bench.config.policy),
                                  log_level="WARNING")
    limit = bench.config.max_timeout

    async def call(fn: Any, *args: Any) -> types.CallToolResult:
        try:
            # abandon_on_cancel: a client that cancels (or goes away) does not wait for the
            # sandbox. A command's non-zero exit is a result, not a tool error: only nsbox's
            # own errors are.
            reply = await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except NsboxError as error:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=f"error: {error}")], is_error=True)
        return to_mcp(reply, types)

    async def run_command(fn: Any, text: str, timeout: float) -> types.CallToolResult:
        handle = object()  # this call, for cancel()
        try:
            return await call(fn, text, timeout, handle)
        except anyio.get_cancelled_exc_class():
            bench.cancel(handle)  # the client cancelled: the command stops now (status SG)
            raise

    Timeout = Annotated[float, Field(
        description=f"Wall-clock limit in seconds (at most {limit:g}); the command and "
                    "everything it started are killed at the limit.")]

    async def run_python(
        code: Annotated[str, Field(description="Python 3 source, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> types.CallToolResult:
        """Run Python code in the sandbox. Returns the status (OK, RE non-zero exit, TO time
        limit, ML memory limit, OL output limit, SG signal), the exit code, stdout and stderr,
        and the files the code wrote (PNG files also as images)."""
        return await run_command(bench.run_python, code, timeout)

    async def run_bash(
        command: Annotated[str, Field(description="A bash command, run with /workspace as cwd")],
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> types.CallToolResult:
        """Run a bash command in the sandbox. Returns the same as run_python."""
        return await run_command(bench.run_bash, command, timeout)

    async def write_file(
        path: Annotated[str, Field(description="Path relative to /workspace")],
        content: Annotated[str, Field(description="The file's text")],
    ) -> types.CallToolResult:
        """Write a text file into the workspace (replacing it if it exists)."""
        return await call(bench.write_file, path, content)

    async def read_file(
        path: Annotated[str, Field(description="Path relative to /workspace")],
    ) -> types.CallToolResult:
        """Read a file from the workspace: text as text, a PNG as an image."""
        return await call(bench.read_file, path)

    async def list_files() -> types.CallToolResult:
        """List the workspace's regular files with their size and SHA-256."""
        return await call(bench.list_files)

    async def changes() -> types.CallToolResult:
        """List what your code changed in the project at /workspace (added, modified, deleted
        files, with diffs). The changes reach the project only when the user applies them."""
        return await call(bench.changes)

    tools: list[Any] = [run_python, run_bash, write_file, read_file, list_files]
    if bench.config.project is not None:
        tools.append(changes)  # read-only: applying is the user's (nsbox/mcp_review.py)
    for tool in tools:
        server.add_tool(tool, structured_output=False)
    return server


def serve(config: ServerConfig) -> None:
    """Serve one MCP connection on stdin/stdout until the client disconnects or a signal
    (SIGTERM, SIGHUP, SIGINT) ends the server."""
    require_sdk()
    import anyio

    # No idle timeout: the session lives exactly as long as the connection.
    with Session(policy=agent_policy(config.policy), inputs=list(config.inputs),
                       audit=config.audit, idle_timeout=None,
                       project=config.project) as session:
        if config.project is not None:
            publish_for_review(session)
        tool_log = _audit_log(config.audit)
        try:
            server = build_server(Workbench(session, config, tool_log))
            anyio.run(_serve, server, lambda: _close(session, tool_log))
        finally:
            _close(session, tool_log)


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
